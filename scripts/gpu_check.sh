#!/usr/bin/env bash
# GPU checks and records: label looping and its CUDA graph modes (issue 3), the HTTP path against the offline
# engine (issue 4), and batchasr against NeMo's own transcribe() (issue 7), inside the device time a session is
# lent (15 minutes, the machine's start included; 10 minutes a command).
#
#   bash scripts/gpu_check.sh [STAGE ...] [extra options for a single stage's script]
#   GPU_CHECK_BUDGET_S (default 540): seconds the whole command may take, its setup included
#
# The stages run in this order (the default: all of them), which is their priority. Each is given what is left
# of the budget, at most its cap; its script begins nothing new past its share and writes what it has measured.
# A stage left with under a minute (beyond what its script may run on past its budget) is skipped, and summary.md
# says so: run it in the next call. Before them, one small decode with conditional nodes against eager: should it
# hang, fail or differ, the stages after tests run with BATCHASR_CONDITIONAL_NODES=0 (plain graphs) rather than
# hang until their shares run out.
#   stage      cap s  what                                                      files
#   tests      120    tests/gpu                                                 gpu_tests.log
#   bench      200    scripts/bench_table.py: parakeet-tdt-0.6b-v2, parakeet-rnnt-1.1b, parakeet-ctc-1.1b; bf16;
#                     batch 128, 16, then 1 (cut first); every algorithm and graph mode, both attention kernels,
#                     the token scores, 20 hotwords a row                   bench.log, bench.jsonl, bench_table.md
#   nemo       190    scripts/nemo_compare.py: the two transducers, bf16, batch 128, 256 utterances, against
#                     NeMo 3.0 on the same weights and audio: tokens (bf16, and float32), stage times, the
#                     encoder's share of the speed of light, cost per 1M audio hours
#                                                                           nemo.log, nemo_compare.jsonl, nemo_compare.md
#   http       200    loadtest/http_bench.py: parakeet-tdt-0.6b-v2, bf16, `batchasr serve` at saturation and at
#                     half load against the offline engine; 4 front-end processes, then HTTP in the engine's
#                     process                                               http.log, http_bench.json
#   stability   60    loadtest/batch_stability.py: the embedded model on held-out speech (.carry/speech), alone
#                     and in batches of 128, bf16 and float32; bf16 through the engine with
#                     fixed batch shapes (--length-bucket-s 2), two orders   stability.log, stability.jsonl
#   bulk       120    loadtest/http_bench.py --jobs: 2,048 clips as one bulk job through Redis (.whl/redis),
#                     and over HTTP                                          bulk.log, bulk_bench.json
# Under $OUT (the device tool's output folder; ./gpu_check_out when unset) come three files, whatever ran:
# env.txt (GPU, driver, torch, the graph mode "auto" picks and why, whether the condition kernel loads),
# summary.md (the issues' goals as measured, then each stage's exit status, seconds and tables) and
# results.tar.gz (every file above), rewritten after each stage, so a command stopped from outside keeps what it
# measured.
#
# Once here (the device tool sends the repository, not ../shared), about a minute:
#   bash scripts/prepare_gpu_carry.sh   # .carry/nemo-parity (12 MiB), .carry/speech (held-out test speech as
#                                       # FLAC, 14 MiB), .whl/ (what the image lacks: service and NeMo, 18 MiB)
# A call sends at most 64 MiB: the repository's files (19 MiB, the embedded model among them) and what it carries.
# Then, in 15 minutes of device time:
#   1. run(command="bash scripts/gpu_check.sh", carry=[".carry/nemo-parity", ".whl"], timeout_s=600): tests,
#      bench, nemo and what else fits (the machine's start takes a minute or two, this call nine minutes at most);
#   2. at once, while the machine is warm (30 s), the stages summary.md lists as skipped, in status's
#      budget_left_s less a minute: run(command="GPU_CHECK_BUDGET_S=200 bash scripts/gpu_check.sh http stability
#      bulk", carry=[".carry/speech", ".whl"]) (without the fixtures the smoke decode uses a random model).
# Beyond the image's torch, numpy, sentencepiece, pyyaml, pytest, hypothesis, prometheus-client and cuda-bindings,
# the tests and the stability stage read audio with soundfile and soxr, and nemo and http need more: all carried
# in .whl. Checked on a CPU with those alone (the image's packages at its versions, the wheels built for the
# CPU's Python): tests/gpu is collected, and every stage's script runs through on small inputs.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
started=$(date +%s)
BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
OUT="${OUT:-$PWD/gpu_check_out}"
WORK="$(mktemp -d)"
mkdir -p "$OUT"

STAGES=(tests bench nemo http stability bulk)
declare -A CAP_S=([tests]=120 [bench]=200 [nemo]=190 [http]=200 [stability]=60 [bulk]=120)
# how long a stage's script may go on after its last look at its budget: a setting, a server run
declare -A TAIL_S=([bench]=30 [nemo]=0 [http]=70 [bulk]=40)
MIN_STAGE_S=60
declare -A SHOWN=([bench]=bench_table.md [nemo]=nemo_compare.md [http]=http_bench.json [stability]=stability.jsonl
                  [bulk]=bulk_bench.json)  # what summary.md shows of each stage; else, or without it, its log's end
declare -A LOG=([tests]=gpu_tests.log [bench]=bench.log [nemo]=nemo.log [http]=http.log [stability]=stability.log
                [bulk]=bulk.log)

chosen=()
while [ $# -gt 0 ] && [[ " all ${STAGES[*]} " == *" $1 "* ]]; do
    if [ "$1" = all ]; then chosen+=("${STAGES[@]}"); else chosen+=("$1"); fi
    shift
done
[ ${#chosen[@]} -gt 0 ] || chosen=("${STAGES[@]}")
if [ $# -gt 0 ] && [ ${#chosen[@]} -gt 1 ]; then
    echo "gpu_check: extra options ($*) go to one stage's script: name a single stage" >&2
    exit 2
fi

wheels="${GPU_CHECK_WHEELS:-.whl}"  # the carried wheels (the script's own tests name an empty folder)
if compgen -G "$wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$wheels/redis/*.deb" > /dev/null; then  # Redis for the bulk-job stage, unpacked beside the image
    for deb in "$wheels"/redis/*.deb; do dpkg -x "$deb" /tmp/redis; done
    export PATH="/tmp/redis/usr/bin:$PATH"
    export LD_LIBRARY_PATH="/tmp/redis/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONUNBUFFERED=1
if [ -z "${BATCHASR_PARITY_DIR:-}" ] && [ -f .carry/nemo-parity/reference.json ]; then
    export BATCHASR_PARITY_DIR="$PWD/.carry/nemo-parity"
fi

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 --version
    python3 - <<'EOF'
import torch

from decoding.cuda_conditional import conditional_support, load_condition_kernel
from decoding.cuda_graphs import choose_mode

print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
try:
    import cuda.bindings

    print("cuda-bindings", cuda.bindings.__version__)
except ImportError as exc:
    print("cuda-bindings missing:", exc)
print("conditional nodes:", conditional_support())
print("auto picks:", choose_mode("auto", torch.device("cuda")))
try:  # the condition kernel: NVRTC's version, and whether its cubin (or PTX) loads on this driver
    from cuda.bindings import nvrtc

    print("nvrtc", nvrtc.nvrtcVersion()[1:])
    print("condition kernel:", load_condition_kernel(torch.device("cuda")))
except Exception as exc:  # noqa: BLE001 - a diagnostic line, whatever went wrong
    print("condition kernel unavailable:", repr(exc))
EOF
    echo "parity fixtures: ${BATCHASR_PARITY_DIR:-not found (fixture-model GPU tests will skip)}"
} 2>&1 | tee "$OUT/env.txt"

# Conditional nodes, tried once before anything leans on them: if a decode with them hangs, fails or gives other
# tokens than eager, the stages after tests run with them switched off ("auto" takes plain graphs) instead of
# hanging until their shares run out. tests/gpu keeps them on: it is where such a fault is told apart.
timeout -s INT -k 10 90 python3 - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import os
from pathlib import Path

from models import load_model
from models.architectures import build_random_model
from service.bench import synthetic_audio

parity = os.environ.get("BATCHASR_PARITY_DIR")
if parity:  # the NeMo fixtures: small, and their audio is speech
    models = {name: load_model(Path(parity, name), device="cuda", dtype="float32")
              for name in ("tdt.nemo", "rnnt.nemo")}
    audio = sorted(str(p) for p in Path(parity, "audio").iterdir())
else:
    models = {"parakeet-tdt_ctc-110m": build_random_model("parakeet-tdt_ctc-110m", device="cuda", dtype="float32")}
    audio = synthetic_audio(8, seed=0)
same = True
for name, model in models.items():
    eager, graphs = ([t.tokens for t in model.transcribe(audio, batch_size=4, cuda_graphs=mode)]
                     for mode in ("off", "conditional"))
    same &= eager == graphs
    print(f"conditional smoke, {name}: {'the same tokens as eager' if eager == graphs else 'OTHER TOKENS than eager'}")
raise SystemExit(0 if same else 1)
EOF
smoke_rc=${PIPESTATUS[0]}  # read at once: any command resets PIPESTATUS
conditional_off=""
if [ "$smoke_rc" -ne 0 ]; then
    echo "conditional smoke failed: the stages after tests run with BATCHASR_CONDITIONAL_NODES=0" \
        | tee -a "$OUT/env.txt"
    conditional_off=1
fi

# Each stage: $1 its share in seconds, then the extra options. Its files go to $WORK.
stage_tests() {  # -v: a test's name is written before it runs, so a test that hangs the GPU is named
    timeout -s INT -k 15 "$1" python3 -m pytest -v -rs -p no:cacheprovider tests/gpu "${@:2}" \
        > "$WORK/gpu_tests.log" 2>&1
}
stage_bench() {
    timeout -s INT -k 15 "$1" python3 scripts/bench_table.py --out "$WORK" --batch-sizes 128 16 1 \
        --n-utterances 128 --budget-s "$(( $1 - TAIL_S[bench] ))" "${@:2}" > "$WORK/bench.log" 2>&1
}
stage_nemo() {
    timeout -s INT -k 15 "$1" python3 scripts/nemo_compare.py --out "$WORK" --n-utterances 256 --repeat 2 \
        --check-utterances 64 --budget-s "$(( $1 - TAIL_S[nemo] ))" "${@:2}" > "$WORK/nemo.log" 2>&1
}
stage_http() {
    timeout -s INT -k 15 "$1" python3 loadtest/http_bench.py --model parakeet-tdt-0.6b-v2 --device cuda \
        --dtype bfloat16 --batch-size 128 --requests 3072 --concurrency 1536 --frontends 4,0 \
        --budget-s "$(( $1 - TAIL_S[http] ))" --out "$WORK/http_bench.json" "${@:2}" > "$WORK/http.log" 2>&1
}
stage_stability() {
    if [ ! -d .carry/speech ]; then
        echo "no .carry/speech (see the top of this script)" > "$WORK/stability.log"
        return 1
    fi
    local rc=0 dtype
    for dtype in bfloat16 float32; do
        timeout -s INT -k 15 "$(( $1 / 3 ))" python3 loadtest/batch_stability.py --device cuda --dtype "$dtype" \
            --audio .carry/speech --batch-size 128 --shuffles 2 --json "${@:2}" >> "$WORK/stability.jsonl" \
            2>> "$WORK/stability.log" || rc=1
    done
    # fixed batch shapes (BATCHASR_LENGTH_BUCKET_S) in bf16: do two submission orders give the same tokens and scores?
    timeout -s INT -k 15 "$(( $1 / 3 ))" python3 loadtest/batch_stability.py --device cuda --dtype bfloat16 \
        --audio .carry/speech --batch-size 128 --through-engine --length-bucket-s 2 --json "${@:2}" \
        >> "$WORK/stability.jsonl" 2>> "$WORK/stability.log" || rc=1
    return "$rc"
}
stage_bulk() {
    if ! redis-server --version > /dev/null 2>&1; then
        echo "no redis-server (bash scripts/fetch_gpu_wheels.sh service puts one in .whl/redis)" > "$WORK/bulk.log"
        return 1
    fi
    BATCHASR_JOB_CONSUMERS=2 timeout -s INT -k 15 "$1" python3 loadtest/http_bench.py \
        --model parakeet-tdt-0.6b-v2 --device cuda --dtype bfloat16 --batch-size 128 --requests 2048 \
        --concurrency 1024 --frontends 4 --jobs --budget-s "$(( $1 - TAIL_S[bulk] ))" \
        --out "$WORK/bulk_bench.json" "${@:2}" > "$WORK/bulk.log" 2>&1
}

save() {  # summary.md: the run, the issues' goals as measured so far (scripts/gpu_goals.py), each stage's section
    { cat "$WORK/head.md"; echo; python3 scripts/gpu_goals.py "$WORK"; cat "$WORK/stages.md"; } > "$WORK/summary.md"
    cp "$WORK/summary.md" "$OUT/summary.md"
    tar -czf "$OUT/results.tar.gz" -C "$WORK" .
}

printf '# gpu_check %s: %s in %s s\n' "$(date -u +%Y-%m-%dT%H:%MZ)" "${chosen[*]}" "$BUDGET_S" > "$WORK/head.md"
grep -E "^(auto picks|condition kernel|conditional smoke)" "$OUT/env.txt" | sed 's/^/    /' >> "$WORK/head.md"
: > "$WORK/stages.md"
status=0
for stage in "${chosen[@]}"; do
    left=$(( started + BUDGET_S - $(date +%s) ))
    share=$(( CAP_S[$stage] < left ? CAP_S[$stage] : left ))
    if [ "$share" -lt $(( MIN_STAGE_S + ${TAIL_S[$stage]:-0} )) ]; then  # a minute of measuring, then its tail
        printf '\n## %s: skipped, %s s of the budget left\n' "$stage" "$left" >> "$WORK/stages.md"
        status=1
        continue
    fi
    echo "== $stage: up to $share s"
    began=$(date +%s)
    if [ "$stage" != tests ] && [ -n "$conditional_off" ]; then
        (export BATCHASR_CONDITIONAL_NODES=0; "stage_$stage" "$share" "$@")
    else
        "stage_$stage" "$share" "$@"
    fi
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    why=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (stopped: its share ran out)"
    printf '\n## %s: exit status %s%s, %s s\n\n' "$stage" "$rc" "$why" "$(( $(date +%s) - began ))" \
        >> "$WORK/stages.md"
    shown="$WORK/${SHOWN[$stage]:-none}"
    if [ -s "$shown" ]; then
        cat "$shown" >> "$WORK/stages.md"
    else  # pytest's summary, or why a stage gave nothing
        tail -n 60 "$WORK/${LOG[$stage]}" >> "$WORK/stages.md" 2>/dev/null
    fi
    save
done
save
cat "$OUT/summary.md"
exit "$status"
