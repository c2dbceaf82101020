"""``batchasr bench``: offline throughput (RTFx) of a model, with features, encoder and decoder timed apart.

``--model`` is a checkpoint or the name of a built-in architecture with random weights; for those the blank
logit is calibrated so greedy decoding emits about one token per three encoder frames, as real speech does,
since the decoder's cost depends on how many labels it finds. Without ``--audio`` the input is a synthetic,
speech-like signal whose durations follow a LibriSpeech-like mix (deterministic for a seed).
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch

from decoding.boosting import build_boost_table
from decoding.types import HOTWORD_BOOST, Hotword, Hotwords
from models.asr_model import ASRModel, EncodedBatch
from models.audio_io import find_audio_files

from .line_output import cannot_write
from .timing import StageClock

SAMPLE_RATE = 16000
# LibriSpeech test-clean/test-other: about 5.4 h in 2620 utterances (7.4 s mean), 1.3 s to 35 s, right-skewed.
DURATION_MEAN_S = 7.4
DURATION_SHAPE = 2.2  # gamma shape: std about 5 s
DURATION_RANGE_S = (1.3, 35.0)
TARGET_TOKENS_PER_FRAME = 1 / 3  # a Parakeet model on English speech emits about one token per 3 frames (240 ms)
CALIBRATION_UTTERANCES = 4
HOTWORD_TOKENS = (1, 3)  # a bench hotword's length in tokens: a short word to a short phrase


@dataclass
class BenchResult:
    model: str
    device: str
    dtype: str
    batch_size: int
    decoder: str  # ctc | rnnt | tdt
    decoder_algorithm: str
    cuda_graphs: str  # requested
    mode: str  # graph mode actually used: conditional | no_while | eager
    n_utterances: int
    repeat: int
    audio_s: float  # audio decoded in the timed passes (all repeats)
    wall_s: float
    rtfx: float
    stage_s: dict[str, float]
    stage_cpu_s: dict[str, float] | None  # CPU time per stage (CPU runs; steadier on a shared machine)
    decoder_share: float  # decoder seconds / sum of stage seconds, of the median pass (stage_median_s)
    tokens: int  # tokens in one pass
    frames: int  # encoder frames in one pass
    tokens_per_frame: float
    tokens_sha1: str  # all token ids in input order: equal hashes, equal transcripts
    blank_bias: float | None  # calibrated blank-logit offset (built-in architectures only)
    attention_kernel: str = "reference"
    scores: bool = True  # the decoder stage includes the tokens' log-probabilities (decoding.scores)
    hotwords: int = 0  # phrases boosted in every row (decoding.boosting): label looping's graphs that boost
    torch: str = field(default_factory=lambda: torch.__version__)
    gpu: str | None = None
    # per timed pass: each stage's median over the passes (one slow pass moves a sum, not this), and each wall time
    stage_median_s: dict[str, float] | None = None
    pass_s: list[float] | None = None


# --- inputs ---------------------------------------------------------------------------------------------------

def synthetic_durations(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    durations = rng.gamma(DURATION_SHAPE, DURATION_MEAN_S / DURATION_SHAPE, size=n)
    return np.clip(durations, *DURATION_RANGE_S)


def synthetic_speech(duration_s: float, rng: np.random.Generator, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Speech-like float32 audio: a gliding harmonic voice, syllable-rate envelope, a little noise."""
    t = np.arange(int(duration_s * sample_rate)) / sample_rate
    f0 = rng.uniform(100.0, 220.0) * (1.0 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.3, 0.8) * t))
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voice = sum(np.sin(h * phase) / h for h in range(1, 7))
    syllables = np.sin(2 * np.pi * rng.uniform(3.0, 5.0) * t + rng.uniform(0, 2 * np.pi)) ** 2
    noise = rng.standard_normal(t.size)
    return (0.1 * voice * syllables + 0.01 * noise).astype(np.float32)


def synthetic_audio(n: int, seed: int, sample_rate: int = SAMPLE_RATE) -> list[np.ndarray]:
    """``n`` synthetic utterances (``synthetic_speech``), made once per process for each (n, seed, rate) and copied
    out: a bench table measures several models on the same audio, and 256 utterances took 5.6 s to make on a CPU,
    each time, on the rare GPU machine."""
    return [wave.copy() for wave in _synthetic_audio(n, seed, sample_rate)]


@functools.lru_cache(maxsize=2)
def _synthetic_audio(n: int, seed: int, sample_rate: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed + 1)
    return tuple(synthetic_speech(d, rng, sample_rate) for d in synthetic_durations(n, seed))


def synthetic_hotwords(n: int, vocab_size: int, seed: int) -> Hotwords:
    """``n`` distinct phrases of random tokens, 1 to 3 each, with the default bonus: what the decoder's boosting
    costs depends on how many phrases and tokens a row has, not on what they spell."""
    rng = np.random.default_rng(seed + 2)
    phrases: dict[tuple[int, ...], None] = {}
    while len(phrases) < n:
        length = int(rng.integers(HOTWORD_TOKENS[0], HOTWORD_TOKENS[1] + 1))
        phrases[tuple(int(t) for t in rng.integers(0, vocab_size, size=length))] = None
    return tuple(Hotword(tokens) for tokens in phrases)


def audio_files(paths: list[str]) -> list[Path]:
    files = find_audio_files(paths)
    if not files:
        raise ValueError(f"no audio files in {', '.join(paths)}")
    return files


# --- model ----------------------------------------------------------------------------------------------------

def load_bench_model(name: str | None, device: str, dtype: str, seed: int,
                     attention_kernel: str = "auto") -> tuple[ASRModel, bool]:
    """(model, has_random_weights): a built-in architecture by name, else a checkpoint path."""
    from models import load_model
    from models.architectures import ARCHITECTURES, build_random_model
    from models.fastconformer import resolve_attention_kernel

    if name in ARCHITECTURES:
        model = build_random_model(name, device=device, dtype=dtype, seed=seed)
        model.encoder.set_attention_kernel(resolve_attention_kernel(attention_kernel, model.device))
        return model, True
    if name is not None and not Path(name).exists():  # a mistyped architecture is no missing file
        raise ValueError(f"{name}: neither a checkpoint (no such file or directory) nor a built-in architecture "
                         f"({', '.join(ARCHITECTURES)})")
    return load_model(name, device=device, dtype=dtype, attention_kernel=attention_kernel), False


def _blank_bias_param(model: ASRModel, decoder: str) -> tuple[torch.Tensor, int]:
    """The output bias holding the blank logit of ``decoder``'s head, and the blank's index."""
    if decoder == "ctc":
        head = model.ctc_head
        assert head is not None
        return head.decoder_layers[0].bias, head.blank_id
    return model.joint.joint_net[-1].bias, model.config.vocab_size


def _token_rate(model: ASRModel, batch: EncodedBatch, decoder: str) -> float:
    hyps = model.decode(batch, decoder, "label_looping", "off", scores=False)
    return sum(len(h.tokens) for h in hyps) / max(int(batch.lengths.sum()), 1)


@torch.no_grad()
def calibrate_blank_bias(model: ASRModel, waveforms: list[np.ndarray], decoder: str,
                         target: float = TARGET_TOKENS_PER_FRAME, steps: int = 12) -> float:
    """Shift the blank logit (in place) so greedy decoding emits about ``target`` tokens per frame.

    Bisection: more blank bias, fewer tokens (monotonic up to ties). Keeps the shift whose rate came
    closest, since with random weights the rate can jump, and a TDT head's durations cap it. Returns the shift.
    """
    bias, blank = _blank_bias_param(model, decoder)
    batch = model.encode(waveforms)
    base = float(bias[blank])
    low, high = -8.0, 24.0
    best_shift, best_error = 0.0, float("inf")
    for _ in range(steps):
        mid = (low + high) / 2
        bias[blank] = base + mid
        rate = _token_rate(model, batch, decoder)
        if abs(rate - target) < best_error:
            best_shift, best_error = mid, abs(rate - target)
        low, high = (mid, high) if rate > target else (low, mid)
    bias[blank] = base + best_shift
    return best_shift


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so a wall clock around it measures it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TimedPasses:
    seconds: list[float]  # one per timed pass
    result: Any  # what the last pass returned

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def timed_passes(run: Callable[[], Any], device: torch.device, repeat: int = 1) -> TimedPasses:
    """Wall time of a whole pass (a public API, data path included): one untimed warm-up pass (graph capture,
    allocator growth), then ``repeat`` timed ones. ``measure`` times the model's stages instead."""
    run()
    seconds, result = [], None
    for _ in range(repeat):
        synchronize(device)
        started = time.perf_counter()
        result = run()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return TimedPasses(seconds, result)


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 where that cannot be read or makes no sense)."""
    try:
        started_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    age = uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")
    return age if 0 <= age < MAX_PLAUSIBLE_AGE_S else 0.0


MAX_PLAUSIBLE_AGE_S = 600  # no script spends this long before its budget is made: a larger age is a misreading


@dataclass
class Budget:
    """The seconds a benchmark script may spend (scripts/gpu_check.sh shares the device time out between stages):
    no new measurement is begun once they are spent, so what was measured is written in time."""

    seconds: float | None  # None: no limit
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def from_launch(cls, seconds: float | None) -> Budget:
        """Counted from the process's start, as the time limit around a stage counts: imports (torch, NeMo) and
        CUDA's start take seconds of it before ``main`` runs."""
        return cls(seconds, time.monotonic() - process_age_s())

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.started)

    @property
    def spent(self) -> bool:
        return self.left() <= 0

    def allows(self, seconds: float) -> bool:
        """Whether a step expected to take ``seconds`` fits in what is left."""
        return self.left() >= seconds


def add_budget_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget-s", type=float, default=None,
                        help="begin no new measurement this many seconds after the process started (default: no limit)")


# --- random-weight checkpoints (for tools that need a file: HTTP bench, NeMo comparison) ----------------------

def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> bytes:
    """A SentencePiece BPE model of exactly ``vocab_size`` pieces, trained on seeded pseudo-words. A .nemo needs
    a tokenizer of the model's size; with random weights, which text it spells does not matter."""
    rng = np.random.default_rng(seed)
    onsets = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
              "bl", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ng"]

    def word() -> str:
        return "".join(str(rng.choice(onsets)) + str(rng.choice(vowels)) + str(rng.choice(codas))
                       for _ in range(int(rng.integers(1, 4))))

    words = [word() for _ in range(4 * vocab_size)]  # enough distinct pairs for every merge
    sentences = [" ".join(rng.choice(words, size=8)) for _ in range(len(words) // 2)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
                                   model_type="bpe", character_coverage=1.0, bos_id=-1, eos_id=-1,
                                   num_threads=4, minloglevel=2)
    return model.getvalue()


def save_random_checkpoint(name: str, path: Path, device: str, waveforms: list[np.ndarray],
                            seed: int) -> float:
    """``name``'s architecture with random weights and a calibrated blank, as a float32 .nemo that NeMo and
    batchasr both load. Returns the blank shift."""
    from models.architectures import ARCHITECTURES, build_random_model
    from models.training.export import save_nemo

    model = build_random_model(name, device=device, dtype="float32", seed=seed)
    shift = calibrate_blank_bias(model, waveforms, model.default_decoder)
    tokenizer = synthetic_tokenizer(model.config.vocab_size, seed)
    raw = copy.deepcopy(ARCHITECTURES[name])
    raw["tokenizer"] = {"dir": None, "type": "bpe"}
    save_nemo(model, raw, tokenizer, path, torch.float32)
    return shift


@dataclass
class PassOutput:
    tokens: dict[int, list[int]] = field(default_factory=dict)  # by input index
    frames: int = 0  # encoder frames decoded


def run_batches(model: ASRModel, waveforms: list[np.ndarray], batches: list[list[int]], decoder: str,
                decoder_algorithm: str, cuda_graphs: str, scores: bool, hotwords: Hotwords,
                clock: StageClock | None) -> PassOutput:
    """One pass: features, encoder, decoder (with ``scores``, the tokens' log-probabilities too; ``hotwords``
    boosted in every row, the boosting table built in the decoder stage, as the engine builds it) per batch."""
    out = PassOutput()
    for chunk in batches:
        marks = [clock.mark()] if clock else []
        waves = [waveforms[i] for i in chunk]
        features, n_frames = model.featurize(waves)
        marks += [clock.mark()] if clock else []
        encoded, lengths = model.run_encoder(features, n_frames)
        marks += [clock.mark()] if clock else []
        batch = EncodedBatch(encoded, lengths, [len(w) / model.sample_rate for w in waves])
        boost = build_boost_table([hotwords] * len(chunk), HOTWORD_BOOST, model.device)
        hyps = model.decode(batch, decoder, decoder_algorithm, cuda_graphs, scores, boost)
        if clock:
            clock.marks.append([*marks, clock.mark()])
        out.tokens.update((i, h.tokens) for i, h in zip(chunk, hyps, strict=True))
        out.frames += int(lengths.sum())  # after the decoder's own host copy: no extra sync in a stage
    return out


def tokens_sha1(tokens: dict[int, list[int]]) -> str:
    text = "\n".join(" ".join(map(str, tokens[i])) for i in sorted(tokens))
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass
class Workload:
    """A model with its inputs, prepared once and measured under several settings."""

    name: str
    model: ASRModel
    waveforms: list[np.ndarray]
    decoder: str  # the head measured: the model's default, or the one asked for (a hybrid has two)
    blank_bias: float | None  # calibrated shift (built-in architectures), None for checkpoints


def prepare(name: str | None, device: str = "auto", dtype: str = "auto", seed: int = 0,
            audio: list[str] | None = None, n_utterances: int = 128,
            attention_kernel: str = "auto", decoder: str = "auto") -> Workload:
    model, random_weights = load_bench_model(name, device, dtype, seed, attention_kernel)
    decoder = model.resolve_decoder(decoder)
    if audio:
        from models.audio_io import read_audio

        waveforms = [read_audio(path, model.sample_rate) for path in audio_files(audio)]
    else:  # at the model's rate: the mix's durations are what it hears
        waveforms = synthetic_audio(n_utterances, seed, model.sample_rate)
    shift = calibrate_blank_bias(model, waveforms[:CALIBRATION_UTTERANCES], decoder) if random_weights else None
    return Workload(name or "the embedded default model", model, waveforms, decoder, shift)


def measure(work: Workload, batch_size: int = 16, repeat: int = 1, decoder_algorithm: str = "label_looping",
            cuda_graphs: str = "auto", scores: bool = True, hotwords: int = 0) -> BenchResult:
    """One untimed warm-up batch, then ``repeat`` timed passes over all inputs, each stage timed in each pass.
    ``scores``: the decoder stage also gives each token its log-probability, as the service's does; without, it
    is the greedy search alone. ``hotwords``: that many random phrases boosted in every row
    (``synthetic_hotwords``)."""
    if batch_size < 1 or repeat < 1:
        raise ValueError("batch size and repeat must be >= 1")
    if hotwords < 0:
        raise ValueError("hotwords must be >= 0")
    if not work.waveforms:
        raise ValueError("no utterances to measure")
    model, waveforms = work.model, work.waveforms
    # longest first, as ``transcribe`` does: the first batch sizes the decoder's buffers and graphs
    order = sorted(range(len(waveforms)), key=lambda i: len(waveforms[i]), reverse=True)
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    phrases = synthetic_hotwords(hotwords, work.model.config.vocab_size, seed=0)
    settings = (work.decoder, decoder_algorithm, cuda_graphs, scores, phrases)
    run_batches(model, waveforms, batches[:1], *settings, None)
    clocks, pass_s = [], []
    for _ in range(repeat):
        clock = StageClock(model.device)
        synchronize(model.device)
        start = time.perf_counter()
        output = run_batches(model, waveforms, batches, *settings, clock)
        synchronize(model.device)
        pass_s.append(time.perf_counter() - start)
        clocks.append(clock)
    return _result(work, batch_size, repeat, decoder_algorithm, cuda_graphs, scores, hotwords, output, pass_s,
                   clocks)


def _result(work: Workload, batch_size: int, repeat: int, decoder_algorithm: str, cuda_graphs: str, scores: bool,
            hotwords: int, output: PassOutput, pass_s: list[float], clocks: list[StageClock]) -> BenchResult:
    passes = [clock.stage_seconds() for clock in clocks]
    stage_s = {stage: sum(p[stage] for p in passes) for stage in passes[0]}
    median_s = {stage: statistics.median(p[stage] for p in passes) for stage in passes[0]}
    stage_cpu_s = None
    if not clocks[0].cuda:
        cpu_passes = [clock.stage_seconds(cpu_time=True) for clock in clocks]
        stage_cpu_s = {stage: round(sum(p[stage] for p in cpu_passes), 4) for stage in cpu_passes[0]}
    model = work.model
    mode = "eager"  # frame looping, and CTC without hotwords (one argmax: nothing to capture)
    if work.decoder == "ctc" and hotwords:  # boosted CTC replays a plain graph on CUDA (decoding.ctc_boost)
        mode = model.ctc_boost_loop(cuda_graphs).mode(model.device)
    elif work.decoder != "ctc" and decoder_algorithm == "label_looping":
        mode = model.label_looper(cuda_graphs).mode or "eager"
    # the model's rate, which --audio is read at: an 8 kHz model's seconds counted at 16 kHz were halves
    audio_s = sum(len(w) for w in work.waveforms) / model.sample_rate * repeat
    wall_s = sum(pass_s)
    n_tokens = sum(len(t) for t in output.tokens.values())
    return BenchResult(
        model=work.name, device=str(model.device), dtype=str(model.dtype).removeprefix("torch."),
        batch_size=batch_size, decoder=work.decoder, decoder_algorithm=decoder_algorithm,
        cuda_graphs=cuda_graphs, mode=mode, n_utterances=len(work.waveforms), repeat=repeat,
        audio_s=round(audio_s, 3), wall_s=round(wall_s, 4), rtfx=round(audio_s / wall_s, 2),
        stage_s={k: round(v, 4) for k, v in stage_s.items()}, stage_cpu_s=stage_cpu_s,
        decoder_share=round(median_s["decoder"] / max(sum(median_s.values()), 1e-12), 4), tokens=n_tokens,
        frames=output.frames, tokens_per_frame=round(n_tokens / max(output.frames, 1), 4),
        tokens_sha1=tokens_sha1(output.tokens),
        blank_bias=None if work.blank_bias is None else round(work.blank_bias, 3),
        attention_kernel=model.encoder.attention_kernel, scores=scores, hotwords=hotwords,
        gpu=torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
        stage_median_s={k: round(v, 4) for k, v in median_s.items()}, pass_s=[round(s, 4) for s in pass_s])


def run_bench(args: argparse.Namespace) -> BenchResult:
    if args.batch_size < 1 or args.repeat < 1:
        raise ValueError("--batch-size and --repeat must be >= 1")
    if not args.audio and args.n_utterances < 1:
        raise ValueError("--n-utterances must be >= 1")
    work = prepare(args.model, args.device, args.dtype, args.seed, args.audio, args.n_utterances,
                   args.attention_kernel or "auto", args.decoder)
    return measure(work, args.batch_size, args.repeat, args.decoder_algorithm, args.cuda_graphs, not args.no_scores,
                   args.hotwords)


# --- output ---------------------------------------------------------------------------------------------------

def format_report(r: BenchResult) -> str:
    weights = f"random weights, blank bias {r.blank_bias:+.2f}" if r.blank_bias is not None else "checkpoint"
    cpu = r.stage_cpu_s is not None
    lines = [
        f"model {r.model} ({weights}) on {r.gpu or r.device}, {r.dtype}, batch {r.batch_size}",
        f"decoder {r.decoder}: {r.decoder_algorithm}{' with token scores' if r.scores else ''}"
        f"{f', {r.hotwords} hotwords boosted' if r.hotwords else ''}, cuda graphs {r.cuda_graphs} -> mode {r.mode}; "
        f"{r.attention_kernel} attention",
        f"{r.n_utterances} utterances x {r.repeat}: {r.audio_s:.1f} s of audio in {r.wall_s:.3f} s, "
        f"RTFx {r.rtfx:.1f}",
        f"{'stage':<10}{'seconds':>10}{'share':>9}{'RTFx':>11}" + (f"{'CPU s':>10}" if cpu else ""),
    ]
    total = max(sum(r.stage_s.values()), 1e-12)
    for stage, seconds in r.stage_s.items():
        rtfx = r.audio_s / seconds if seconds > 0 else float("inf")
        cpu_s = f"{r.stage_cpu_s[stage]:>10.4f}" if r.stage_cpu_s is not None else ""
        lines.append(f"{stage:<10}{seconds:>10.4f}{seconds / total:>9.1%}{rtfx:>11.1f}{cpu_s}")
    lines.append(f"{r.tokens_per_frame:.3f} tokens per frame; tokens_sha1 {r.tokens_sha1}")
    return "\n".join(lines) + "\n"


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        result = run_bench(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # flushed here: a full disk or a closed pipe is one error line, not a traceback at exit
        sys.stdout.write(json.dumps(asdict(result)) + "\n" if args.json else format_report(result))
        sys.stdout.flush()
    except OSError as exc:
        return cannot_write(exc)
    return 0
