"""The issues' GPU goals, read off what scripts/gpu_check.sh's stages wrote (run by it as they go).

    python scripts/gpu_goals.py DIR      # DIR: the stages' files (bench.jsonl, nemo_compare.jsonl, http_bench.json)

Prints a markdown table, one goal a row, with what was measured and whether it is met; a stage that has not
written its file yet adds no rows. Once it has, each of its goals has a row: a goal whose settings failed says
"failed", one whose settings were not measured (the budget, a stage cut short) says "not measured", and neither
is met. The device time a session is lent is short: this says at once what a run showed, and the files beside it
say how.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

DECODER_SHARE_MAX = 0.05  # issue 3: the decoder's share of the time, batch 128, conditional mode
DECODER_SPEEDUP_MIN = 5.0  # issue 3: label looping + conditional against frame looping eager, decoder time
HTTP_SHARE_MIN = 0.90  # issue 4: HTTP RTFx against the offline engine's (a bulk job's too)
NEMO_RATIO_MIN = 1.3  # issue 7: RTFx against NeMo's on the same GPU
NEMO_BEST_MODE = "full_graph"  # NeMo's label looping in one graph with conditional nodes: its fast path
GOAL_BATCH = 128
GRAPH_MODES = {"off": "eager"}  # a requested cuda_graphs that failed or was not measured, as a mode

Row = tuple[str, str, bool | None]  # goal, what was measured, met (None: nothing to judge)


def _setting(r: dict[str, Any]) -> tuple:
    mode = r.get("mode") or GRAPH_MODES.get(r["cuda_graphs"], r["cuda_graphs"])
    return (r["decoder_algorithm"], mode, r.get("attention_kernel"), r.get("scores"), r.get("hotwords"))


def _unmeasured(r: dict[str, Any] | None) -> str | None:
    """Why a setting's record holds no measurement (None: it does)."""
    if r is None:
        return "not measured"
    if "error" in r:
        return f"failed: {r['error']}"
    if "not_measured" in r:
        return f"not measured ({r['not_measured']})"
    return None


def _per_pass_s(r: dict[str, Any]) -> dict[str, float]:
    """One pass's stage seconds: the median pass where the record has it, else the mean."""
    return r.get("stage_median_s") or {k: v / r.get("repeat", 1) for k, v in r["stage_s"].items()}


def _conditional(at_goal: dict[tuple, dict[str, Any]], scores: bool) -> tuple[dict[str, Any] | None, str]:
    """The goal's label-looping row (with or without token scores) and its mode: conditional, or no_while where
    bench_table.py measured that instead because conditional nodes were off."""
    conditional = at_goal.get(("label_looping", "conditional", "reference", scores, 0))
    stand_in = at_goal.get(("label_looping", "no_while", "reference", scores, 0))
    if conditional is None and stand_in is not None and "conditional_nodes" in stand_in:
        return stand_in, f"no_while, as conditional nodes were {stand_in['conditional_nodes']}"
    return conditional, "conditional"


def bench_goals(records: list[dict[str, Any]]) -> list[Row]:
    """Issue 3 from bench.jsonl, per transducer: at batch 128 in conditional mode, the decoder's share with the
    token scores the service computes (without, beside it), and the greedy search's decoder time against frame
    looping eager; at every batch size, one set of tokens for every algorithm and mode, a failed one counting
    against it."""
    rows: list[Row] = []
    for model in dict.fromkeys(r["model"] for r in records):
        mine = [r for r in records if r["model"] == model]
        if all(r.get("decoder") == "ctc" for r in mine):  # issue 3 is about the transducers' search
            continue
        unprepared = next((r for r in mine if "error" in r and "decoder_algorithm" not in r), None)
        if unprepared:
            rows.append((f"issue 3, {model}", f"failed: {unprepared['error']}", False))
            continue
        at_goal = {_setting(r): r for r in mine if r["batch_size"] == GOAL_BATCH and "decoder_algorithm" in r}
        rows += [_share_goal(model, at_goal), _speedup_goal(model, at_goal), _same_tokens_goal(model, mine)]
    return rows


def _share_goal(model: str, at_goal: dict[tuple, dict[str, Any]]) -> Row:
    scored, mode = _conditional(at_goal, scores=True)
    search, _ = _conditional(at_goal, scores=False)
    goal = f"issue 3, {model}: decoder share <= {DECODER_SHARE_MAX:.0%} at batch {GOAL_BATCH}, {mode}, token scores"
    without = "" if _unmeasured(search) else f" ({search['decoder_share']:.1%} without scores)"
    if why := _unmeasured(scored):
        return goal, why + without, False
    share = scored["decoder_share"]
    return goal, f"{share:.1%}{without}", share <= DECODER_SHARE_MAX


def _speedup_goal(model: str, at_goal: dict[tuple, dict[str, Any]]) -> Row:
    search, mode = _conditional(at_goal, scores=False)
    baseline = at_goal.get(("frame_looping", "eager", "reference", False, 0))
    goal = (f"issue 3, {model}: label looping + {mode} >= {DECODER_SPEEDUP_MIN:.0f}x frame looping eager, "
            f"decoder time, batch {GOAL_BATCH}")
    why = [f"{what}: {reason}" for what, r in (("frame looping", baseline), ("label looping", search))
           if (reason := _unmeasured(r))]
    if why:
        return goal, "; ".join(why), False
    speedup = _per_pass_s(baseline)["decoder"] / _per_pass_s(search)["decoder"]
    return goal, f"{speedup:.1f}x", speedup >= DECODER_SPEEDUP_MIN


def _same_tokens_goal(model: str, records: list[dict[str, Any]]) -> Row:
    """Per batch size, the settings that compare (reference attention, no hotwords): one hash, none failed."""
    hashes: dict[int, set[str]] = defaultdict(set)
    measured: dict[int, int] = defaultdict(int)
    failed: dict[int, int] = defaultdict(int)
    missing: dict[int, int] = defaultdict(int)
    for r in records:
        if r.get("attention_kernel", "reference") != "reference" or r.get("hotwords"):
            continue
        batch = r["batch_size"]
        if "error" in r:
            failed[batch] += 1
        elif "not_measured" in r:
            missing[batch] += 1
        else:
            hashes[batch].add(r["tokens_sha1"])
            measured[batch] += 1
    batches = sorted(hashes.keys() | failed.keys() | missing.keys(), reverse=True)
    verdicts: dict[str, list[int]] = defaultdict(list)
    for b in batches:
        if failed[b]:
            verdicts[f"failed settings ({failed[b]})"].append(b)
        elif len(hashes[b]) > 1:
            verdicts["other tokens"].append(b)
        elif missing[b] or measured[b] < 2:  # one setting alone compares with nothing
            verdicts["not all measured"].append(b)
        else:
            verdicts["same"].append(b)
    text = "; ".join(f"{verdict} at batch {', '.join(map(str, b))}" for verdict, b in verdicts.items())
    met = bool(verdicts["same"]) and not any(v.startswith("failed") or v == "other tokens" for v in verdicts)
    return f"issue 3, {model}: the same tokens from every algorithm and graph mode", text, met


def http_goals(report: dict[str, Any], stage: str = "http") -> list[Row]:
    """Issue 4 from http_bench.json: each server layout's saturation RTFx against the offline engine's. From the
    bulk stage's bulk_bench.json (``stage="bulk"``) also the bulk job's: its server has Redis jobs beside HTTP."""
    rows: list[Row] = []
    where = " (the bulk stage's server, with Redis jobs)" if stage == "bulk" else ""
    offline = report.get("offline", {}).get("bench", {}).get("rtfx")
    servers = report.get("servers")
    if not servers:
        why = report.get("stopped") or ("failed: " + report["error"] if "error" in report
                                         else "the stage ended before a server ran")
        rows.append((f"issue 4: HTTP >= {HTTP_SHARE_MIN:.0%} of offline RTFx{where}", f"not measured ({why})", False))
    for server in servers or []:
        layout = f"{server['frontends']} front-end processes" if server["frontends"] else "HTTP in the engine's process"
        goal = f"issue 4: HTTP >= {HTTP_SHARE_MIN:.0%} of offline RTFx, {layout}{where}"
        if "http_vs_bench" in server:
            share = server["http_vs_bench"]
            rows.append((goal, f"{share:.0%} ({server['http_saturation']['rtfx']:.0f} against {offline:.0f})",
                         share >= HTTP_SHARE_MIN))
        else:
            rows.append((goal, _server_unmeasured(server), False))
        if stage == "bulk":
            rows.append(_bulk_goal(server, layout, offline))
    return rows


def _server_unmeasured(server: dict[str, Any]) -> str:
    if "error" in server:
        return f"failed: {server['error']}"
    return f"not measured ({server.get('not_measured', 'no saturation run')})"


def _bulk_goal(server: dict[str, Any], layout: str, offline: float | None) -> Row:
    goal = f"issues 4-5: a bulk job through Redis >= {HTTP_SHARE_MIN:.0%} of offline RTFx (wall), {layout}"
    bulk = server.get("bulk_job")
    if "bulk_vs_bench" in server:
        share = server["bulk_vs_bench"]
        return goal, f"{share:.0%} ({bulk['rtfx_wall']:.0f} against {offline:.0f})", share >= HTTP_SHARE_MIN
    if isinstance(bulk, dict):  # it ran, and not every item completed
        return goal, f"failed: the job ended {bulk.get('status')}, counts {bulk.get('counts')}", False
    if isinstance(bulk, str):
        return goal, bulk, False
    return goal, _server_unmeasured(server) if "error" in server else "not measured", False


def nemo_goals(records: list[dict[str, Any]]) -> list[Row]:
    """Issue 7 from nemo_compare.jsonl: RTFx against NeMo's, and the same tokens (float32, then the timed dtype);
    a model nemo_compare.py wrote part of (a stage cut, a failure) has a row for each part it is missing."""
    rows: list[Row] = []
    for r in records:
        why = _nemo_unmeasured(r)
        if "float32_agreement" not in r and not r.get("runs"):
            rows.append((f"issue 7, {r['model']}", why, False))
            continue
        goal = f"issue 7, {r['model']}: the same tokens as NeMo in float32"
        if same32 := r.get("float32_agreement"):
            rows.append((goal, f"{same32['identical']} of {same32['utterances']}",
                         same32["identical"] == same32["utterances"]))
        else:
            rows.append((goal, why, False))
        runs = r.get("runs", [])
        nemo_at_best = r.get("nemo_graph_mode") == NEMO_BEST_MODE  # else NeMo fell back: no fair ratio
        for run in runs:
            same = run["agreement"]
            rows.append((_ratio_goal(r, run["attention_kernel"]),
                         f"{run['rtfx_ratio']:.2f}x ({run['batchasr']['rtfx']:.0f} against {r['nemo']['rtfx']:.0f}, "
                         f"NeMo's graph mode {r.get('nemo_graph_mode')}"
                         f"{'' if nemo_at_best else f', not {NEMO_BEST_MODE}: not judged'}); "
                         f"the same tokens in {same['identical']} of {same['utterances']} utterances",
                         nemo_at_best and run["rtfx_ratio"] >= NEMO_RATIO_MIN))
        rows += [(_ratio_goal(r, kernel), why, False) for kernel in r.get("attention_kernels", [])[len(runs):]]
    return rows


def _ratio_goal(r: dict[str, Any], kernel: str) -> str:
    return (f"issue 7, {r['model']}, {kernel} attention: RTFx >= {NEMO_RATIO_MIN}x NeMo's, {r.get('dtype')}, "
            f"batch {r.get('batch_size')}")


def _nemo_unmeasured(r: dict[str, Any]) -> str:
    for key, what in (("error", "failed"), ("stopped", "not measured"), ("not_measured", "not measured"),
                      ("running", "not measured yet, running")):  # under way, or killed outright in it
        if key in r:
            return f"{what}: {r[key]}"
    return "not measured"


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The file's objects; a line cut short (a stage stopped while writing) is left out."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # not written yet, or being rewritten
        return None


def goals_table(out: Path) -> str:
    rows = bench_goals(_jsonl(out / "bench.jsonl")) + nemo_goals(_jsonl(out / "nemo_compare.jsonl"))
    for name, stage in (("http_bench.json", "http"), ("bulk_bench.json", "bulk")):
        if (report := _json(out / name)) is not None:
            rows += http_goals(report, stage)
    if not rows:
        return "## Goals\n\nNothing measured yet.\n"
    met = {True: "yes", False: "**no**", None: ""}
    return ("## Goals\n\n| goal | measured | met |\n|---|---|---|\n"
            + "".join(f"| {goal} | {measured.replace('|', '/')} | {met[ok]} |\n" for goal, measured, ok in rows))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(goals_table(Path(args[0])), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
