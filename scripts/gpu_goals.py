"""The issues' GPU goals, read off what scripts/gpu_check.sh's stages wrote (run by it after each stage).

    python scripts/gpu_goals.py DIR      # DIR: the stages' files (bench.jsonl, nemo_compare.jsonl, http_bench.json)

Prints a markdown table, one goal a row, with what was measured and whether it is met; a goal whose stage has not
written its file yet is left out. The device time a session is lent is short: this says at once what a run
showed, and the files beside it say how.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

DECODER_SHARE_MAX = 0.05  # issue 3: the decoder's share of the time, batch 128, conditional mode
DECODER_SPEEDUP_MIN = 5.0  # issue 3: label looping + conditional against frame looping eager, decoder time
HTTP_SHARE_MIN = 0.90  # issue 4: HTTP RTFx against the offline engine's
NEMO_RATIO_MIN = 1.3  # issue 7: RTFx against NeMo's on the same GPU
GOAL_BATCH = 128

Row = tuple[str, str, bool | None]  # goal, what was measured, met (None: nothing to judge)


def _setting(r: dict[str, Any]) -> tuple:
    return (r["decoder_algorithm"], r["mode"], r.get("attention_kernel"), r.get("scores"), r.get("hotwords"))


def bench_goals(records: list[dict[str, Any]]) -> list[Row]:
    """Issue 3 from bench.jsonl: at batch 128, the greedy search alone (no scores, no hotwords, reference
    attention) in conditional mode against frame looping eager; and, at every batch size, one set of tokens for
    every algorithm and mode."""
    measured = [r for r in records if "error" not in r and r.get("decoder") != "ctc"]
    rows: list[Row] = []
    for model in dict.fromkeys(r["model"] for r in measured):
        at_goal = {_setting(r): r for r in measured if r["model"] == model and r["batch_size"] == GOAL_BATCH}
        conditional = at_goal.get(("label_looping", "conditional", "reference", False, 0))
        baseline = at_goal.get(("frame_looping", "eager", "reference", False, 0))
        if conditional:
            share = conditional["decoder_share"]
            rows.append((f"issue 3, {model}: decoder share <= {DECODER_SHARE_MAX:.0%} at batch {GOAL_BATCH}, "
                         "conditional", f"{share:.1%}", share <= DECODER_SHARE_MAX))
        if conditional and baseline:
            speedup = baseline["stage_s"]["decoder"] / conditional["stage_s"]["decoder"]
            rows.append((f"issue 3, {model}: label looping + conditional >= {DECODER_SPEEDUP_MIN:.0f}x frame "
                         f"looping eager, decoder time, batch {GOAL_BATCH}", f"{speedup:.1f}x",
                         speedup >= DECODER_SPEEDUP_MIN))
        hashes: dict[int, set[str]] = defaultdict(set)
        for r in measured:
            if r["model"] == model and r.get("attention_kernel") == "reference" and not r.get("hotwords"):
                hashes[r["batch_size"]].add(r["tokens_sha1"])
        if hashes:
            same = [b for b, h in sorted(hashes.items()) if len(h) == 1]
            rows.append((f"issue 3, {model}: the same tokens from every algorithm and graph mode",
                         f"at batch {', '.join(map(str, same)) or 'none'} of {', '.join(map(str, sorted(hashes)))}",
                         len(same) == len(hashes)))
    return rows


def http_goals(report: dict[str, Any], what: str = "HTTP") -> list[Row]:
    """Issue 4 from http_bench.json: each server layout's saturation RTFx against the offline engine's."""
    rows: list[Row] = []
    for server in report.get("servers", []):
        layout = f"{server['frontends']} front-end processes" if server["frontends"] else "HTTP in the engine's process"
        if "http_vs_bench" in server:
            share = server["http_vs_bench"]
            rows.append((f"issue 4: {what} >= {HTTP_SHARE_MIN:.0%} of offline RTFx, {layout}",
                         f"{share:.0%} ({server['http_saturation']['rtfx']:.0f} against "
                         f"{report['offline']['bench']['rtfx']:.0f})", share >= HTTP_SHARE_MIN))
        else:
            rows.append((f"issue 4: {what}, {layout}", server.get("not_measured", "not measured"), None))
    return rows


def nemo_goals(records: list[dict[str, Any]]) -> list[Row]:
    """Issue 7 from nemo_compare.jsonl: RTFx against NeMo's, and the same tokens (float32, then the timed dtype)."""
    rows: list[Row] = []
    for r in records:
        if "error" in r:
            rows.append((f"issue 7, {r['model']}", f"failed: {r['error']}", False))
            continue
        same32 = r["float32_agreement"]
        rows.append((f"issue 7, {r['model']}: the same tokens as NeMo in float32",
                     f"{same32['identical']} of {same32['utterances']}", same32["identical"] == same32["utterances"]))
        for run in r["runs"]:
            same = run["agreement"]
            rows.append((f"issue 7, {r['model']}, {run['attention_kernel']} attention: RTFx >= "
                         f"{NEMO_RATIO_MIN}x NeMo's, {r['dtype']}, batch {r['batch_size']}",
                         f"{run['rtfx_ratio']:.2f}x ({run['batchasr']['rtfx']:.0f} against {r['nemo']['rtfx']:.0f}, "
                         f"NeMo's graph mode {r.get('nemo_graph_mode')}); "
                         f"the same tokens in {same['identical']} of {same['utterances']} utterances",
                         run["rtfx_ratio"] >= NEMO_RATIO_MIN))
    return rows


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The file's objects; a line cut short (a stage stopped while writing) is left out."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def goals_table(out: Path) -> str:
    rows = bench_goals(_jsonl(out / "bench.jsonl")) + nemo_goals(_jsonl(out / "nemo_compare.jsonl"))
    for name, what in (("http_bench.json", "HTTP"), ("bulk_bench.json", "HTTP beside a bulk job")):
        if (out / name).exists():
            rows += http_goals(json.loads((out / name).read_text()), what)
    if not rows:
        return "## Goals\n\nNothing measured yet.\n"
    met = {True: "yes", False: "**no**", None: ""}
    return ("## Goals\n\n| goal | measured | met |\n|---|---|---|\n"
            + "".join(f"| {goal} | {measured} | {met[ok]} |\n" for goal, measured, ok in rows))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(goals_table(Path(args[0])), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
