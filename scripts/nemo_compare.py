"""The performance record against NeMo (issue 7): batchasr and NeMo's own ``transcribe()``, same weights, same audio.

For each architecture (random weights, the blank calibrated as ``batchasr bench`` does, about one token in three
frames) one ``.nemo`` file is written that both load. The audio is ``batchasr bench``'s LibriSpeech-like synthetic
mix, in memory for both. Each side runs its public API (``ASRModel.transcribe`` / NeMo's ``transcribe``, greedy
label looping with CUDA graphs) at one batch size: a warm-up pass, then ``--repeat`` timed passes (the median is
kept). NeMo gets its inputs sorted longest first, its best case; batchasr sorts them itself.

Also recorded:
- tokens, utterance by utterance: in the timed precision, and in float32 on a subset (TF32 off on both sides);
- each side's stage times (features, encoder, decoder; NeMo's timed on its own modules, so what its
  transcribe() takes beyond their sum is its data path);
- the encoder's share of the speed of light: FLOPs counted by torch's ``FlopCounterMode`` over one pass,
  divided by a measured large matrix product's rate (in the timed dtype) and by the encoder's measured seconds;
- cost per million audio hours at ``--gpu-hour-usd``.

NeMo's precision follows the Open ASR Leaderboard's NeMo runner: the whole model cast with ``.to(bfloat16)``.

    PYTHONPATH=. python scripts/nemo_compare.py --out DIR [--models parakeet-tdt-0.6b-v2 parakeet-rnnt-1.1b]
        [--batch-size 128] [--n-utterances 512] [--repeat 3] [--dtype bfloat16] [--gpu-hour-usd 2.50]
        [--budget-s S]

Writes DIR/nemo_compare.jsonl (one object a model) and DIR/nemo_compare.md (the table for docs/benchmarks.md),
both rewritten after each phase of a model (the float32 check, NeMo's timing, each attention kernel's), so a run
stopped from outside keeps what it measured; an interrupt (the stage's time limit sends SIGINT) is written down
as where the model stopped. Every model is compared with the first attention kernel before any is timed with the
others, so a short budget still covers every model. ``--budget-s`` counts from the process's start: no model is
begun where the last one's time does not fit in what is left, and no further attention kernel where the model's
first one's does not. Needs NeMo (``nemo_toolkit[asr]``) importable, checked before any model's work; with it,
whether NeMo's own check takes conditional nodes is recorded (``full_graph`` is NeMo at its best, and the ratio
goal is judged only then). scripts/gpu_check.sh installs NeMo from carried wheels.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from models import load_model
from models.architectures import ARCHITECTURES
from models.asr_model import ASRModel, exact_float32
from models.fastconformer import ATTENTION_KERNELS
from models.training.evaluate import edit_distance
from service.bench import (
    SAMPLE_RATE,
    Budget,
    TimedPasses,
    Workload,
    add_budget_option,
    measure,
    save_random_checkpoint,
    synchronize,
    synthetic_audio,
    timed_passes,
    tokens_sha1,
)
from service.timing import StageClock

MODELS = ("parakeet-tdt-0.6b-v2", "parakeet-rnnt-1.1b")
# transducers only (a hybrid counts: both sides decode it with its transducer): token ids are compared, and
# NeMo's CTC hypotheses hold log-probabilities rather than ids
TRANSDUCERS = tuple(name for name, cfg in ARCHITECTURES.items() if "joint" in cfg)


# --- each side's transcribe -----------------------------------------------------------------------------------

Transcriber = Callable[[list[np.ndarray]], list[list[int]]]  # waveforms -> token ids, in input order


def batchasr_transcriber(model: ASRModel, batch_size: int) -> Transcriber:
    return lambda waves: [t.tokens for t in model.transcribe(waves, batch_size=batch_size)]


def load_nemo(path: Path, device: str, dtype: torch.dtype) -> Any:
    """NeMo's own model from the file, greedy label looping with CUDA graphs (NeMo's fast path)."""
    from nemo.collections.asr.models import ASRModel as NeMoASRModel
    from omegaconf import open_dict

    model = NeMoASRModel.restore_from(str(path), map_location=torch.device(device))
    model.eval()
    decoding = copy.deepcopy(model.cfg.decoding)
    with open_dict(decoding):
        decoding.strategy = "greedy_batch"
        decoding.greedy.max_symbols = 10
        decoding.greedy.loop_labels = True
        decoding.greedy.use_cuda_graph_decoder = True
    model.change_decoding_strategy(decoding, verbose=False)
    return model.to(dtype)


def nemo_conditional_nodes() -> str:
    """Imports NeMo's ASR collection (an ImportError here: NeMo is missing or broken, before any model's work) and
    says whether NeMo's own check finds conditional nodes usable: "supported", else its reason."""
    import nemo.collections.asr  # noqa: F401 - the import is the check
    from nemo.core.utils.cuda_python_utils import check_cuda_python_cuda_graphs_conditional_nodes_supported

    try:
        check_cuda_python_cuda_graphs_conditional_nodes_supported()
    except Exception as exc:  # its reason, whatever it is, is what is recorded
        return f"not supported: {type(exc).__name__}: {exc}"
    return "supported"


def rebuild_nemo_decoding(model: Any) -> Any:
    """NeMo's decoder again, after a cast: its CUDA graphs were captured on the float32 weights, which ``to(dtype)``
    frees, and NeMo recaptures only when the batch, the length or the device grows, not the dtype."""
    model.change_decoding_strategy(copy.deepcopy(model.cfg.decoding), verbose=False)
    return model


def nemo_graph_mode(model: Any) -> str | None:
    """The CUDA graph mode NeMo's label-looping decoder ran in (``full_graph`` is its conditional-node mode), as it
    says after a pass; None where it has no such decoder."""
    computer = getattr(getattr(getattr(model, "decoding", None), "decoding", None), "decoding_computer", None)
    mode = getattr(computer, "cuda_graphs_mode", None)
    return None if mode is None else str(getattr(mode, "value", mode))


def nemo_transcriber(model: Any, batch_size: int) -> Transcriber:
    def run(waves: list[np.ndarray]) -> list[list[int]]:
        order = sorted(range(len(waves)), key=lambda i: len(waves[i]), reverse=True)
        hyps = model.transcribe([waves[i] for i in order], batch_size=batch_size, return_hypotheses=True,
                                verbose=False)
        if isinstance(hyps, tuple):  # some NeMo versions return (best, all)
            hyps = hyps[0]
        tokens: list[list[int]] = [[] for _ in waves]
        for i, hyp in zip(order, hyps, strict=True):
            tokens[i] = [int(t) for t in hyp.y_sequence]
        return tokens

    return run


@torch.inference_mode()
def nemo_stage_seconds(model: Any, waves: list[np.ndarray], batch_size: int) -> dict[str, float]:
    """NeMo's own modules timed stage by stage on batches grouped as transcribe() groups them: the preprocessor,
    the encoder, the greedy decoding. What transcribe() takes beyond their sum is its data path."""
    device = next(model.parameters()).device
    clock = StageClock(device)
    order = sorted(range(len(waves)), key=lambda i: len(waves[i]), reverse=True)
    for start in range(0, len(order), batch_size):
        chunk = [waves[i] for i in order[start : start + batch_size]]
        audio = torch.zeros(len(chunk), len(chunk[0]))
        for row, wave in enumerate(chunk):
            audio[row, : len(wave)] = torch.from_numpy(wave)
        lengths = torch.tensor([len(w) for w in chunk])
        audio, lengths = audio.to(device), lengths.to(device)
        marks = [clock.mark()]
        features, n_frames = model.preprocessor(input_signal=audio, length=lengths)
        marks.append(clock.mark())
        encoded, encoded_lengths = model.encoder(audio_signal=features, length=n_frames)
        marks.append(clock.mark())
        model.decoding.rnnt_decoder_predictions_tensor(encoder_output=encoded, encoded_lengths=encoded_lengths)
        clock.marks.append([*marks, clock.mark()])
    return {k: round(v, 4) for k, v in clock.stage_seconds().items()}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """Utterances with identical tokens, and token edits over NeMo's token count where they differ."""
    edits = sum(edit_distance(a, b) for a, b in zip(ours, theirs, strict=True) if a != b)
    return {"utterances": len(ours), "identical": sum(a == b for a, b in zip(ours, theirs, strict=True)),
            "token_edit_rate": round(edits / max(sum(map(len, theirs)), 1), 6),
            "sha1_batchasr": _sha1(ours), "sha1_nemo": _sha1(theirs)}


def _sha1(tokens: list[list[int]]) -> str:
    return tokens_sha1(dict(enumerate(tokens)))


# --- speed of light -------------------------------------------------------------------------------------------

def encoder_flops(model: ASRModel, waves: list[np.ndarray], batch_size: int) -> int:
    """FLOPs of the encoder over ``waves`` in batches of ``batch_size`` (longest first, as transcribe groups)."""
    order = sorted(range(len(waves)), key=lambda i: len(waves[i]), reverse=True)
    counter = FlopCounterMode(display=False)
    total = 0
    for start in range(0, len(order), batch_size):
        features, n_frames = model.featurize([waves[i] for i in order[start : start + batch_size]])
        with counter:
            model.run_encoder(features, n_frames)
        total += counter.get_total_flops()
    return total


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 8192, repeat: int = 20) -> float:
    """Measured FLOP/s of a large square matrix product: the speed of light the encoder is held to."""
    if device.type != "cuda":
        n, repeat = 1024, 3
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeat):
        a @ b
    synchronize(device)
    return 2 * n**3 * repeat / (time.perf_counter() - started)


# --- one model ------------------------------------------------------------------------------------------------

@dataclass
class Compared:
    """A model measured against NeMo, kept for timing it with the other attention kernels."""
    record: dict[str, Any]
    path: Path  # its checkpoint
    ours: ASRModel  # in the timed dtype
    waves: list[np.ndarray]
    nemo_run: TimedPasses
    kernel_s: float = 0.0  # what its first kernel's run took: what another is expected to take


def compare_model(name: str, args: argparse.Namespace, workdir: Path, peak: float, record: dict[str, Any],
                  save: Callable[[], object]) -> Compared:
    """The checkpoint, the float32 tokens of both sides, NeMo's timing, then batchasr's with the first attention
    kernel. Fills ``record`` phase by phase, calling ``save`` after each; ``record["running"]`` names the phase
    under way, for a record cut short."""
    dtype = getattr(torch, args.dtype)
    waves = synthetic_audio(args.n_utterances, args.seed)
    audio_s = sum(len(w) for w in waves) / SAMPLE_RATE
    check = waves[: args.check_utterances]
    path = workdir / f"{name}.nemo"
    started = time.perf_counter()
    record["running"] = "writing the checkpoint"
    shift = save_random_checkpoint(name, path, args.device, waves[:4], args.seed)
    print(f"{name}: checkpoint written in {time.perf_counter() - started:.0f} s (blank shift {shift:+.2f})",
          flush=True)
    record.update({"batch_size": args.batch_size, "dtype": args.dtype, "n_utterances": len(waves),
                   "audio_s": round(audio_s, 2), "repeat": args.repeat, "blank_shift": round(shift, 3),
                   "gpu_hour_usd": args.gpu_hour_usd, "running": "comparing tokens in float32"})
    save()

    # float32 first: both sides must give the same tokens
    with exact_float32():
        ours32 = load_model(path, device=args.device, dtype="float32")
        ours_tokens = batchasr_transcriber(ours32, args.batch_size)(check)
        del ours32
        nemo32 = load_nemo(path, args.device, torch.float32)
        nemo_tokens = nemo_transcriber(nemo32, args.batch_size)(check)
    record["float32_agreement"] = agreement(ours_tokens, nemo_tokens)
    print(f"{name}: float32 tokens {record['float32_agreement']}", flush=True)
    record["running"] = "timing NeMo"
    save()

    nemo = rebuild_nemo_decoding(nemo32.to(dtype))
    del nemo32
    nemo_run = timed_passes(partial(nemo_transcriber(nemo, args.batch_size), waves), torch.device(args.device),
                            args.repeat)
    nemo_stages = nemo_stage_seconds(nemo, waves, args.batch_size)
    record["nemo_graph_mode"] = nemo_graph_mode(nemo)
    del nemo
    _free()
    record.update({"nemo": _side(audio_s, nemo_run, args.gpu_hour_usd), "nemo_stage_s": nemo_stages, "runs": []})
    save()

    kernel = args.attention_kernels[0]
    record["running"] = f"loading batchasr with {kernel} attention"
    started = time.monotonic()
    ours = load_model(path, device=args.device, dtype=args.dtype, attention_kernel=kernel)
    compared = Compared(record, path, ours, waves, nemo_run)
    time_kernel(compared, kernel, args, peak, save)
    compared.kernel_s = time.monotonic() - started
    return compared


def time_kernel(compared: Compared, kernel: str, args: argparse.Namespace, peak: float,
                save: Callable[[], object]) -> None:
    """batchasr's timed passes of the model with ``kernel`` attention, against NeMo's, added to its record."""
    record = compared.record
    record["running"] = f"timing batchasr with {kernel} attention"
    save()
    compared.ours.encoder.set_attention_kernel(kernel)
    record["runs"].append(batchasr_run(compared.ours, compared.path.stem, compared.waves, compared.nemo_run, args,
                                       peak))
    record.pop("running")
    save()


def batchasr_run(ours: ASRModel, name: str, waves: list[np.ndarray], nemo_run: TimedPasses,
                 args: argparse.Namespace, peak: float) -> dict[str, Any]:
    """batchasr's timed passes with the model's attention kernel, against NeMo's."""
    audio_s = sum(len(w) for w in waves) / SAMPLE_RATE
    kernel = ours.encoder.attention_kernel
    run = timed_passes(partial(batchasr_transcriber(ours, args.batch_size), waves), ours.device, args.repeat)
    stages = measure(Workload(name, ours, waves, ours.default_decoder, None), args.batch_size, 1)
    flops = encoder_flops(ours, waves, args.batch_size)
    side = _side(audio_s, run, args.gpu_hour_usd)
    encoder_s = stages.stage_s["encoder"]
    return {"attention_kernel": kernel, "batchasr": side,
            "rtfx_ratio": round(side["rtfx"] / (audio_s / nemo_run.median_s), 3),
            "agreement": agreement(run.result, nemo_run.result),
            "stages": {"stage_s": stages.stage_s, "decoder_share": stages.decoder_share, "mode": stages.mode,
                       "tokens_per_frame": stages.tokens_per_frame, "tokens_sha1": stages.tokens_sha1},
            "encoder": {"flops": flops, "flops_per_audio_s": round(flops / audio_s), "seconds": encoder_s,
                        "achieved_tflops": round(flops / encoder_s / 1e12, 3), "peak_tflops": round(peak / 1e12, 3),
                        "share_of_speed_of_light": round(flops / peak / encoder_s, 3)}}


def _side(audio_s: float, run: TimedPasses, gpu_hour_usd: float) -> dict[str, Any]:
    rtfx = audio_s / run.median_s
    return {"wall_s": round(run.median_s, 4), "passes_s": [round(p, 4) for p in run.seconds],
            "rtfx": round(rtfx, 1), "usd_per_million_audio_hours": round(1e6 / rtfx * gpu_hour_usd, 2)}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- output ---------------------------------------------------------------------------------------------------

HEADER = ("| model | batch | dtype | attention | batchasr RTFx (graph mode) | NeMo RTFx (graph mode) | ratio | "
          "same tokens (timed dtype) | same tokens (float32) | "
          "stages s: features / encoder / decoder (batchasr; NeMo) | "
          "encoder: share of the speed of light (matmul peak) | $ per 1M audio hours (batchasr / NeMo) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
COLUMNS = HEADER.splitlines()[0].count("|") - 1


def table_rows(r: dict[str, Any]) -> list[str]:
    """A row per attention kernel timed, and one saying what is missing from a record cut short or failed."""
    rows = []
    for run in r.get("runs", []):
        same, same32, ours, encoder = run["agreement"], r["float32_agreement"], run["batchasr"], run["encoder"]
        rows.append(
            f"| {r['model']} | {r['batch_size']} | {r['dtype']} | {run['attention_kernel']} | {ours['rtfx']:.0f} "
            f"({run['stages']['mode']}) | {r['nemo']['rtfx']:.0f} ({r.get('nemo_graph_mode')}) | "
            f"{run['rtfx_ratio']:.2f}x | {same['identical']}/{same['utterances']} "
            f"({same['token_edit_rate']:.2%} token edits) | {same32['identical']}/{same32['utterances']} | "
            f"{_stages(run['stages']['stage_s'])}; {_stages(r['nemo_stage_s'])} | "
            f"{encoder['share_of_speed_of_light']:.0%} "
            f"({encoder['achieved_tflops']:.3g} of {encoder['peak_tflops']:.3g} TFLOP/s) | "
            f"{ours['usd_per_million_audio_hours']:,.0f} / {r['nemo']['usd_per_million_audio_hours']:,.0f} |")
    missing = next((f"{what}: {r[key]}" for key, what in MISSING if key in r), None)
    if missing:
        nemo = f"{r['nemo']['rtfx']:.0f} ({r.get('nemo_graph_mode')})" if "nemo" in r else ""
        same32 = r.get("float32_agreement")
        cells = [r["model"], r.get("batch_size", ""), r.get("dtype", ""), "", missing.replace("|", "/"), nemo, "",
                 "", f"{same32['identical']}/{same32['utterances']}" if same32 else ""]
        rows.append("| " + " | ".join(map(str, cells)) + " |" + " |" * (COLUMNS - len(cells)))
    return rows


MISSING = (("error", "failed"), ("stopped", "not measured"), ("not_measured", "not measured"), ("running", "running"))


def _stages(stage_s: dict[str, float]) -> str:
    return " / ".join(f"{stage_s[k]:.3g}" for k in ("features", "encoder", "decoder"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=TRANSDUCERS)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--n-utterances", type=int, default=512)
    parser.add_argument("--check-utterances", type=int, default=128, help="float32 token check on this many")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--attention-kernels", nargs="+", default=["reference", "sdpa"],
                        choices=ATTENTION_KERNELS, help="time batchasr with each (default: both)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gpu-hour-usd", type=float, default=2.50, help="price of one GPU hour, for the cost")
    parser.add_argument("--seed", type=int, default=0)
    add_budget_option(parser)
    args = parser.parse_args(argv)
    budget = Budget.from_launch(args.budget_s)  # the stage's time limit counts from the launch, imports included
    args.out.mkdir(parents=True, exist_ok=True)
    records = Records(args.out)
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = matmul_peak_flops(device, getattr(torch, args.dtype))
    print(f"measured {args.dtype} matrix-product peak: {peak / 1e12:.1f} TFLOP/s", flush=True)
    try:
        nemo_nodes = nemo_conditional_nodes()
    except KeyboardInterrupt:  # the stage's time ran out in NeMo's import (tens of seconds)
        for name in args.models:
            records.add({"model": name, "gpu": gpu, "stopped": "interrupted while NeMo was imported"})
        print(records.save())
        return 130
    except Exception as exc:  # every model would fail the same way, each after its checkpoint: say so at once
        traceback.print_exc()
        for name in args.models:
            records.add({"model": name, "gpu": gpu, "error": f"NeMo does not import: {type(exc).__name__}: {exc}"})
        print(records.save())
        return 1
    print(f"NeMo's conditional-node check: {nemo_nodes}", flush=True)
    failed = False
    compared: list[Compared] = []
    expected_s = 0.0  # a model's run, from the last one's (the next is larger: the list goes up in size)
    with tempfile.TemporaryDirectory() as workdir:
        try:
            for name in args.models:
                if not budget.allows(expected_s) or budget.spent:
                    records.add({"model": name, "gpu": gpu, "not_measured": f"{budget.left():.0f} s of the budget "
                                 f"left, a model takes about {expected_s:.0f} s"})
                    continue
                record = records.add({"model": name, "gpu": gpu, "attention_kernels": list(args.attention_kernels),
                                      "nemo_conditional_nodes": nemo_nodes, "running": "making its audio"})
                started = time.monotonic()
                try:
                    compared.append(compare_model(name, args, Path(workdir), peak, record, records.save))
                except Exception as exc:  # one failing model must not lose the other's record
                    traceback.print_exc()
                    record["error"] = (f"{type(exc).__name__}: {exc} "
                                       f"(while {record.pop('running', 'writing its record')})")
                    failed = True
                    _free()
                records.save()
                expected_s = 1.5 * (time.monotonic() - started)
            failed |= not time_other_kernels(compared, args, peak, budget, records.save)
        except KeyboardInterrupt:  # the stage's time ran out: keep every phase measured, and say where it stopped
            for record in records.records:
                if "running" in record:
                    record["stopped"] = f"interrupted while {record.pop('running')} (the stage's time ran out)"
            print(records.save())
            return 130
    print(records.save())
    return 1 if failed else 0


def time_other_kernels(compared: list[Compared], args: argparse.Namespace, peak: float, budget: Budget,
                       save: Callable[[], object]) -> bool:
    """Each model compared, with the attention kernels after the first, while its first one's time is left;
    False if one failed."""
    ok = True
    for model in compared:
        for kernel in args.attention_kernels[1:]:
            if not budget.allows(model.kernel_s):
                model.record["not_measured"] = (f"attention kernel {kernel}: {budget.left():.0f} s of the budget "
                                                f"left, a kernel's run takes about {model.kernel_s:.0f} s")
                break
            try:
                time_kernel(model, kernel, args, peak, save)
            except Exception as exc:  # the first kernel's run stands
                traceback.print_exc()
                model.record["error"] = f"{type(exc).__name__}: {exc} (while {model.record.pop('running')})"
                ok = False
                break
        save()
    return ok


class Records:
    """DIR/nemo_compare.jsonl and DIR/nemo_compare.md, rewritten whole whenever a record grows (each by a rename:
    a run stopped mid-write leaves the last whole file)."""

    def __init__(self, out: Path):
        self.out = out
        self.records: list[dict[str, Any]] = []
        self.save()

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        self.records.append(record)
        self.save()
        return record

    def save(self) -> str:
        table = HEADER + "\n" + "".join(row + "\n" for r in self.records for row in table_rows(r))
        _replace(self.out / "nemo_compare.jsonl", "".join(json.dumps(r) + "\n" for r in self.records))
        _replace(self.out / "nemo_compare.md", table)
        return table


def _replace(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".part")
    partial.write_text(text)
    partial.replace(path)


if __name__ == "__main__":
    sys.exit(main())
