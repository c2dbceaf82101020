"""``batchasr bench`` on CPU with a fixture model: JSON shape, exactness hash, blank calibration; random-weight
checkpoints for the tools that need a file."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import sentencepiece as spm
import torch
import yaml

from models import load_model
from models.architectures import build_random_model
from service.bench import (
    DURATION_RANGE_S,
    Budget,
    calibrate_blank_bias,
    save_random_checkpoint,
    synthetic_audio,
    synthetic_durations,
    synthetic_tokenizer,
    tokens_sha1,
)
from service.cli import main as cli_main
from tests.conftest import REPO, load_script

REQUIRED = {"rtfx", "audio_s", "wall_s", "stage_s", "mode", "batch_size", "device", "dtype", "tokens_sha1"}



def _bench(capsys, *args: str) -> dict:
    assert cli_main(["bench", "--device", "cpu", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_json_and_equal_hashes_for_both_algorithms(parity_dir, capsys):
    common = ("--model", str(parity_dir / "tdt.nemo"), "--n-utterances", "5", "--batch-size", "2")
    label = _bench(capsys, *common)
    frame = _bench(capsys, *common, "--decoder-algorithm", "frame_looping")
    assert label.keys() >= REQUIRED
    assert set(label["stage_s"]) == {"features", "encoder", "decoder"}
    assert label["mode"] == "eager" and label["device"] == "cpu" and label["dtype"] == "float32"
    assert label["decoder_algorithm"] == "label_looping" and frame["decoder_algorithm"] == "frame_looping"
    assert label["tokens"] > 0
    assert label["tokens_sha1"] == frame["tokens_sha1"]
    assert label["audio_s"] == frame["audio_s"] > 5 * DURATION_RANGE_S[0]
    assert label["rtfx"] == pytest.approx(label["audio_s"] / label["wall_s"], rel=0.01)
    reference = _bench(capsys, *common, "--attention-kernel", "reference")
    assert (label["attention_kernel"], reference["attention_kernel"]) == ("sdpa", "reference")  # auto on CPU: sdpa
    assert reference["tokens_sha1"] == label["tokens_sha1"]


def test_bench_boosts_hotwords_alike_in_both_algorithms_and_on_the_ctc_head(parity_dir, capsys):
    common = ("--model", str(parity_dir / "tdt_ctc_hybrid.nemo"), "--n-utterances", "4", "--batch-size", "2")
    plain = _bench(capsys, *common)
    label = _bench(capsys, *common, "--hotwords", "20")
    frame = _bench(capsys, *common, "--hotwords", "20", "--decoder-algorithm", "frame_looping")
    assert (plain["hotwords"], label["hotwords"], label["mode"]) == (0, 20, "eager")
    assert label["tokens_sha1"] == frame["tokens_sha1"] != plain["tokens_sha1"]  # boosted, and alike
    ctc, ctc_boosted = _bench(capsys, *common, "--decoder", "ctc"), _bench(capsys, *common, "--decoder", "ctc",
                                                                           "--hotwords", "20")
    assert ctc["decoder"] == ctc_boosted["decoder"] == "ctc" and ctc["tokens_sha1"] != ctc_boosted["tokens_sha1"]
    assert cli_main(["bench", "--device", "cpu", *common, "--hotwords", "-1"]) == 2
    assert "hotwords must be >= 0" in capsys.readouterr().err


def run_bench_table(table, out, monkeypatch, *args: str) -> tuple[int, list[dict], list[str]]:
    """scripts/bench_table.py's main on CPU, float32: its exit status, bench.jsonl's records, bench_table.md."""
    monkeypatch.setattr("sys.argv", ["bench_table.py", "--out", str(out), "--device", "cpu", "--dtype", "float32",
                                     *args])
    status = table.main()
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    return status, records, (out / "bench_table.md").read_text().splitlines()


@pytest.fixture()
def bench_table():
    yield load_script(REPO / "scripts" / "bench_table.py")
    del sys.modules["bench_table"]


def test_the_gpu_bench_table_measures_every_setting_and_shows_the_ones_that_fail(bench_table, parity_dir, tmp_path,
                                                                                  monkeypatch):
    """scripts/bench_table.py runs only where a GPU is lent: here, on CPU, the graph modes fail (they need CUDA)
    and every other setting still gives its row, hotwords included, for a transducer and a CTC model. The
    failures are rows of the table too, and the exit status says there were some."""
    status, lines, rows = run_bench_table(bench_table, tmp_path, monkeypatch, "--batch-sizes", "2",
                                          "--n-utterances", "3", "--models", str(parity_dir / "tdt.nemo"),
                                          str(parity_dir / "ctc.nemo"))
    assert status == 1
    failed = [(r["cuda_graphs"], r["hotwords"]) for r in lines if "error" in r]
    assert failed == [(s[1], s[4]) for s in bench_table.TRANSDUCER_SETTINGS if s[1] in ("no_while", "conditional")]
    measured = [r for r in lines if "error" not in r]
    assert [(r["decoder"], r["hotwords"]) for r in measured] == [("tdt", 0), ("tdt", 0), ("ctc", 0), ("ctc", 20)]
    assert measured[0]["tokens_sha1"] == measured[1]["tokens_sha1"]  # frame looping and label looping
    table_rows = [row for row in rows[2:] if row]
    assert len(table_rows) == len(lines) and all(row.count("|") == rows[0].count("|") for row in table_rows)
    assert sum("| **failed**: " in row for row in table_rows) == len(failed)
    goals = load_script(REPO / "scripts" / "gpu_goals.py").bench_goals(lines)  # reads what the table wrote
    assert goals[2][1:] == ("failed settings (3) at batch 2", False)  # the failed graph modes count against it
    assert [(measured, met) for _, measured, met in goals[:2]] == [
        ("not measured", False), ("frame looping: not measured; label looping: not measured", False)]  # batch 128


def test_the_gpu_bench_table_fails_when_no_model_can_be_prepared(bench_table, tmp_path, monkeypatch):
    status, lines, rows = run_bench_table(bench_table, tmp_path, monkeypatch, "--batch-sizes", "2",
                                          "--models", str(tmp_path / "missing.nemo"))
    assert status == 1
    assert [r["model"] for r in lines] == [str(tmp_path / "missing.nemo")] and "preparing" in lines[0]["error"]
    assert "| **failed**: preparing: ValueError(" in rows[2]


def test_the_gpu_bench_table_begins_nothing_once_its_budget_is_spent(bench_table, parity_dir, tmp_path, monkeypatch):
    """The device run shares its minutes out between stages: a spent budget leaves the table's header and a line
    for each batch size and model not measured, in the order they would have come, and prepares no model."""
    models = [str(parity_dir / "tdt.nemo"), str(parity_dir / "ctc.nemo")]
    status, lines, rows = run_bench_table(bench_table, tmp_path, monkeypatch, "--models", *models,
                                          "--batch-sizes", "4", "1", "--budget-s", "0")
    assert status == 0
    assert [(r["model"], r["batch_size"], r["not_measured"]) for r in lines] == [
        (m, b, "budget spent") for b in (4, 1) for m in models]  # for the goals: "not measured", not nothing
    assert rows[:2] == bench_table.HEADER.splitlines()
    assert [line for line in rows[2:] if line] == [f"Not measured (budget spent): {m} at batch {b}"
                                                   for b in (4, 1) for m in models]


def test_each_batch_size_is_decoded_in_buffers_of_its_own_size(bench_table, parity_dir, tmp_path, monkeypatch):
    """The model keeps its label-looping decoders, whose buffers only grow: after batch 4, batch 2 searched 4
    rows (speed-up column skewed). Each batch size is measured as a fresh `batchasr bench --batch-size N`."""
    capacities = []
    measure = bench_table.measure

    def measured_rows(work, batch_size, repeat, algorithm, graphs, *rest):
        result = measure(work, batch_size, repeat, algorithm, graphs, *rest)
        if algorithm == "label_looping":
            capacities.append((batch_size, work.model.label_looper(graphs).capacity[0]))
        return result

    monkeypatch.setattr(bench_table, "measure", measured_rows)
    monkeypatch.setattr(bench_table, "TRANSDUCER_SETTINGS", bench_table.TRANSDUCER_SETTINGS[:2])
    run_bench_table(bench_table, tmp_path, monkeypatch, "--batch-sizes", "4", "2", "--n-utterances", "4",
                    "--models", str(parity_dir / "tdt.nemo"))
    assert capacities == [(4, 4), (2, 2)]


def test_the_goal_settings_get_more_passes_and_their_median(bench_table, parity_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_table, "GOAL_BATCH", 2)
    monkeypatch.setattr(bench_table, "TRANSDUCER_SETTINGS", bench_table.TRANSDUCER_SETTINGS[:2])
    monkeypatch.setattr(bench_table, "GOAL_SETTINGS", bench_table.TRANSDUCER_SETTINGS[:1])
    _, lines, rows = run_bench_table(bench_table, tmp_path, monkeypatch, "--batch-sizes", "2", "4",
                                     "--n-utterances", "3", "--goal-repeat", "3",
                                     "--models", str(parity_dir / "tdt.nemo"))
    assert [(r["batch_size"], r["decoder_algorithm"], r["repeat"], len(r["pass_s"])) for r in lines] == [
        (2, "frame_looping", 3, 3), (2, "label_looping", 1, 1), (4, "frame_looping", 1, 1),
        (4, "label_looping", 1, 1)]
    goal = lines[0]
    assert goal["stage_median_s"]["decoder"] <= goal["stage_s"]["decoder"] / 1.5  # one pass's, not three's
    assert "| 3 x 3 |" in rows[2]


def test_with_conditional_nodes_off_the_conditional_rows_are_no_while(bench_table, parity_dir, tmp_path, monkeypatch):
    """gpu_check.sh switches them off when its smoke decode fails: forced conditional rows would all fail, and
    the goals read on them vanish. no_while stands in, and the table and the records say so."""
    monkeypatch.setenv("BATCHASR_CONDITIONAL_NODES", "0")
    _, lines, rows = run_bench_table(bench_table, tmp_path, monkeypatch, "--batch-sizes", "2", "--n-utterances", "2",
                                     "--models", str(parity_dir / "tdt.nemo"))
    asked = [(r["decoder_algorithm"], r["cuda_graphs"], r["attention_kernel"], r["scores"], r["hotwords"])
             for r in lines]
    assert asked == bench_table.transducer_settings("off") and "conditional" not in {a[1] for a in asked}
    assert len(asked) == len(bench_table.TRANSDUCER_SETTINGS) - 1  # conditional without scores is no_while's row
    assert all(r["conditional_nodes"].startswith("off: switched off") for r in lines)
    assert any(row.startswith("Conditional nodes off: switched off") for row in rows)


def test_a_budget_without_a_limit_is_never_spent():
    assert not Budget(None).spent and Budget(None).left() == float("inf")
    assert Budget(0).spent and 59 < Budget(60).left() <= 60


def test_a_budget_counts_from_the_process_start():
    """A stage's time limit counts from its launch: imports (torch, NeMo) used to be left out of the budget."""
    code = "import time; time.sleep(1.5); from service.bench import Budget; print(Budget.from_launch(60).left())"
    left = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert float(left) <= 58.5


def test_bench_reads_audio_files_and_prints_a_table(parity_dir, parity_audio, capsys):
    assert cli_main(["bench", "--device", "cpu", "--model", str(parity_dir / "tdt_ctc_hybrid.nemo"),
                     "--audio", *parity_audio[:3], "--batch-size", "3", "--repeat", "2"]) == 0
    report = capsys.readouterr().out
    assert "RTFx" in report and "decoder" in report and "3 utterances x 2" in report


def test_synthetic_mix_is_deterministic_and_librispeech_like():
    durations = synthetic_durations(2000, seed=0)
    assert durations.min() >= DURATION_RANGE_S[0] and durations.max() <= DURATION_RANGE_S[1]
    assert 6.5 < durations.mean() < 8.5
    first, again = synthetic_audio(3, seed=4), synthetic_audio(3, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    first[0][:] = 0  # made once a process (each model of a bench table measured on it), each caller its own copy
    assert np.abs(synthetic_audio(3, seed=4)[0]).max() > 0
    assert all(a.dtype == np.float32 and np.abs(a).max() < 1 for a in first)


def test_tokens_hash_follows_input_order():
    assert tokens_sha1({0: [1, 2], 1: [3]}) == tokens_sha1({1: [3], 0: [1, 2]})
    assert tokens_sha1({0: [1, 2], 1: [3]}) != tokens_sha1({0: [3], 1: [1, 2]})


@pytest.mark.parametrize(("name", "decoder"), [("ctc", "ctc"), ("tdt_ctc_hybrid", "tdt")])
def test_blank_calibration_reaches_one_token_per_three_frames(parity_dir, name, decoder):
    model = load_model(parity_dir / f"{name}.nemo", device="cpu", dtype="float32")
    waves = synthetic_audio(3, seed=1)
    calibrate_blank_bias(model, waves, decoder)
    batch = model.encode(waves)
    hyps = model.decode(batch, decoder)
    rate = sum(len(h.tokens) for h in hyps) / int(batch.lengths.sum())
    assert rate == pytest.approx(1 / 3, abs=0.05)


def test_synthetic_tokenizer_has_exactly_the_pieces_asked_for_and_is_seeded():
    proto = synthetic_tokenizer(1024, seed=3)
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto)
    assert sp.get_piece_size() == 1024 and sp.bos_id() == sp.eos_id() == -1
    assert synthetic_tokenizer(1024, seed=3) == proto


@pytest.mark.slow
def test_random_checkpoint_holds_the_calibrated_architecture_in_nemos_layout(tmp_path):
    path = tmp_path / "random.nemo"
    waves = [w[:16000] for w in synthetic_audio(4, seed=0)]
    shift = save_random_checkpoint("parakeet-tdt_ctc-110m", path, "cpu", waves, seed=0)
    loaded = load_model(path, device="cpu", dtype="float32")
    built = build_random_model("parakeet-tdt_ctc-110m", device="cpu", dtype="float32", seed=0)
    blank = built.config.vocab_size
    with torch.no_grad():  # what calibration did to the head it calibrated (the TDT head: the default)
        built.joint.joint_net[-1].bias[blank] += shift
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in built.state_dict().items())
    with tarfile.open(path) as tar:  # plain tar, as NeMo writes
        names = {m.name.removeprefix("./") for m in tar.getmembers()}
        cfg = yaml.safe_load(tar.extractfile("./model_config.yaml").read())
    fields = ("model_path", "vocab_path", "spe_tokenizer_vocab")
    assert {cfg["tokenizer"][field].removeprefix("nemo:") for field in fields} <= names
    assert loaded.tokenizer.vocab_size == blank


def test_batch_stability_finds_float32_unmoved_by_its_neighbours(parity_dir, capsys):
    """loadtest/batch_stability.py (the GPU run records bf16's figure with it): in float32 on a CPU, an utterance
    decoded beside others, sorted or shuffled, keeps the tokens it has alone."""
    stability = load_script(REPO / "loadtest" / "batch_stability.py")
    assert stability.main(["--model", str(parity_dir / "tdt.nemo"), "--audio", str(parity_dir / "audio"),
                           "--device", "cpu", "--dtype", "float32", "--batch-size", "4", "--shuffles", "2",
                           "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["utterances"] == 10 and result["tokens_alone"] > 0
    assert set(result["batchings"]) == {"longest_first", "shuffled_0", "shuffled_1"}
    assert all(r["changed"] == 0 and r["token_edit_rate"] == 0 for r in result["batchings"].values())
    # the comparison itself counts what moved
    assert stability.compare({0: [1, 2, 3], 1: [4]}, {0: [1, 3], 1: [4]}) == {
        "changed": 1, "utterances": 2, "changed_share": 0.5, "token_edit_rate": 0.25}


def test_batch_stability_runs_several_settings_in_one_process_and_goes_past_a_failed_one(parity_dir, capsys):
    """The GPU run's stability stage: bf16 and float32 alone and in batches, and bf16 through the engine, paying
    the interpreter's, CUDA's and the audio's start once; a run that fails does not lose the others."""
    stability = load_script(REPO / "loadtest" / "batch_stability.py")
    status = stability.main(["--model", str(parity_dir / "tdt.nemo"), "--audio", str(parity_dir / "audio"),
                             "--device", "cpu", "--batch-size", "4", "--shuffles", "0", "--json", "--length-bucket-s",
                             "4", "--runs", "float32", "float64", "bfloat16:engine"])
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert status == 1 and [r.get("dtype", r.get("run")) for r in results] == ["float32", "float64", "bfloat16"]
    assert "error" in results[1] and results[2]["length_bucket_s"] == 4 and results[2]["tokens_moved"] == 0
    with pytest.raises(SystemExit):
        stability.main(["--runs", "float32:batched"])


def test_batch_stability_through_the_engine_with_fixed_shapes_finds_bf16_unmoved(parity_dir, capsys):
    """--through-engine --length-bucket-s: two submission orders through an engine with fixed batch shapes give
    every utterance the same tokens and scores, in bf16."""
    stability = load_script(REPO / "loadtest" / "batch_stability.py")
    assert stability.main(["--audio", str(parity_dir / "audio"), "--device", "cpu", "--dtype", "bfloat16",
                           "--batch-size", "4", "--through-engine", "--length-bucket-s", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["utterances"] == 10 and result["length_bucket_s"] == 4.0 and min(result["rtfx"]) > 0
    assert result["tokens_moved"] == 0 and result["scores_moved"] == 0
    with pytest.raises(SystemExit):
        stability.main(["--length-bucket-s", "2"])  # only with --through-engine


def _at_8_khz(source, path):
    """``source`` with its features taken at 8 kHz: the same window and hop in samples, so the weights fit."""
    import io

    with tarfile.open(source) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    with tarfile.open(path, "w") as out:
        for member, data in members:
            if member.name.endswith("model_config.yaml"):
                config = yaml.safe_load(data)
                config["preprocessor"].update(sample_rate=8000, window_size=0.05, window_stride=0.02)
                data = yaml.safe_dump(config).encode()
                member.size = len(data)
            out.addfile(member, io.BytesIO(data) if data is not None else None)
    return path


def test_bench_counts_an_8_khz_models_audio_at_its_own_rate(parity_dir, parity_audio, tmp_path, capsys):
    """Seconds were samples / 16,000 whatever the model's rate: an 8 kHz model's RTFx came out halved."""
    import soundfile as sf

    model = str(_at_8_khz(parity_dir / "tdt.nemo", tmp_path / "tdt_8k.nemo"))
    files = _bench(capsys, "--model", model, "--audio", *parity_audio[:3])
    assert files["audio_s"] == pytest.approx(sum(sf.info(p).duration for p in parity_audio[:3]), abs=0.01)
    synthetic = _bench(capsys, "--model", model, "--n-utterances", "2")  # the mix's durations, at 8 kHz
    assert synthetic["audio_s"] == pytest.approx(float(synthetic_durations(2, seed=0).sum()), abs=0.01)


def test_bench_wants_an_utterance(capsys):
    assert cli_main(["bench", "--device", "cpu", "--n-utterances", "0"]) == 2
    assert "--n-utterances must be >= 1" in capsys.readouterr().err


def test_bench_names_the_architectures_when_the_model_is_neither_a_file_nor_one(capsys, tmp_path):
    """`--model nosuch-arch` said only "no such file or directory", as if a file had been meant."""
    from models.architectures import ARCHITECTURES

    for name in ("nosuch-arch", str(tmp_path / "missing.nemo")):
        assert cli_main(["bench", "--device", "cpu", "--model", name, "--n-utterances", "1"]) == 2
        err = capsys.readouterr().err
        assert f"error: {name}: neither a checkpoint (no such file or directory) nor a built-in architecture" in err
        assert all(arch in err for arch in ARCHITECTURES), err


def test_bench_that_cannot_write_its_report_says_so_in_one_line(parity_dir):
    """A full disk was a traceback at exit."""
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "service.cli", "bench", "--model", str(parity_dir / "tdt.nemo"),
                                 "--n-utterances", "2", "--json"], stdout=full, stderr=subprocess.PIPE, text=True,
                                timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: cannot write the results: [Errno 28]")
