#!/usr/bin/env bash
# GPU checks and records: label looping and its CUDA graph modes (issue 3), the HTTP path against the offline
# engine (issue 4), and batchasr against NeMo's own transcribe() (issue 7), inside the device time a session is
# lent (15 minutes, the machine's start included; 10 minutes a command).
#
#   bash scripts/gpu_check.sh [STAGE ...] [extra options for a single stage's script]
#   GPU_CHECK_BUDGET_S (default 525): seconds the whole command may take, its setup included; give the device
#     call a timeout_s 45 s longer
#
# The stages run in this order (the default: all of them), which is their priority. Each is given what is left
# of the budget (less 20 s: its kill's grace and the last save), at most its cap; its script begins nothing new
# past its share less its tail (how long it may run on after its last look at its budget) and writes what it has
# measured as it goes. A stage whose share leaves under a minute past its tail is skipped, and summary.md says
# so: run it in the next call. Before them, one small decode with conditional nodes against eager: should it
# hang, fail or differ, the stages after tests run with BATCHASR_CONDITIONAL_NODES=0 (plain graphs; bench then
# measures no_while where it would have measured conditional, and says so) rather than hang until their shares
# run out, and scripts/diag_conditional.py looks into which of the decoder's work a conditional body cannot hold
# (GPU_CHECK_DIAG_BUDGET_S, 75 s; a line a variant in env.txt, logs under diag/); where it passes, they run with
# BATCHASR_CONDITIONAL_NODES=1, so that "auto" takes conditional nodes.
#   stage      cap s  tail s  what                                                      files
#   tests      120       0    tests/gpu, the conditional-node tests last in a pytest of their own  gpu_tests.log
#   bench      170      30    scripts/bench_table.py: parakeet-tdt-0.6b-v2, parakeet-rnnt-1.1b, parakeet-ctc-1.1b;
#                             bf16; batch 128 (256 utterances), 16 (128), then 1 (48; cut first); every algorithm
#                             and graph mode, both attention kernels, the token scores, 20 hotwords a row; issue 3's
#                             goal settings with 5 timed passes (the median), the others one
#                                                                           bench.log, bench.jsonl, bench_table.md
#   nemo       240      30    scripts/nemo_compare.py: the two transducers, bf16, batch 128, 256 utterances,
#                             against NeMo 3.0 on the same weights and audio: tokens (bf16, and float32), stage
#                             times, the encoder's share of the speed of light, cost per 1M audio hours; both
#                             models with reference attention before either with sdpa
#                                                                 nemo.log, nemo_compare.jsonl, nemo_compare.md
#   http       200      70    loadtest/http_bench.py: parakeet-tdt-0.6b-v2, bf16, `batchasr serve` at saturation and
#                             at half load against the offline engine; 4 front-end processes, then HTTP in the
#                             engine's process (about 45 s before the first server, 65 s a server)
#                                                                 http.log, http_bench.json, http_bench_serve_*.log
#   stability   60       0    loadtest/batch_stability.py in one process: the embedded model on held-out speech
#                             (.carry/speech), alone and in batches of 128, bf16 and float32; bf16 through the engine
#                             with fixed batch shapes (--length-bucket-s 2), two orders   stability.log, stability.jsonl
#   bulk       120      60    loadtest/http_bench.py --jobs: 2,048 clips over HTTP at saturation, then as one bulk
#                             job through Redis (.whl/redis), 4 front ends
#                                                                 bulk.log, bulk_bench.json, bulk_bench_serve_4.log
# http and bulk keep the random checkpoint and the offline baseline in the machine's /tmp: the second of them, in
# this call or the next on the same machine, reuses both.
# Under $OUT (the device tool's output folder; ./gpu_check_out when unset) come three files, whatever ran:
# env.txt (GPU, driver, torch, the graph mode "auto" picks and why, whether the condition kernel loads),
# summary.md (the issues' goals as measured, then each stage's exit status, seconds and tables) and
# results.tar.gz (every file above). The last two are rewritten every 15 s while a stage runs and after each, so
# a command stopped from outside keeps what its stages had written, and summary.md names the stage that was
# running when it was cut.
#
# Once here (the device tool sends the repository, not ../shared), about a minute:
#   bash scripts/prepare_gpu_carry.sh   # .carry/nemo-parity (12 MiB), .carry/speech (held-out test speech as
#                                       # FLAC, 14 MiB), .whl/ (what the image lacks: service and NeMo, 18 MiB)
# A call sends at most 64 MiB: the repository's files (19 MiB, the embedded model among them) and what it carries.
# Then, in 15 minutes of device time (the machine's start, 1-2 minutes, included):
#   1. run(command="GPU_CHECK_BUDGET_S=525 bash scripts/gpu_check.sh", carry=[".carry/nemo-parity", ".whl"],
#      timeout_s=570): the setup (wheels, env probe, smoke decode: about a minute), tests, bench, nemo and what
#      else fits. About 4-5 minutes are left after it.
#   2. at once, while the machine is warm (30 s), the stages summary.md lists as skipped: timeout_s is
#      budget_left_s (status's, or the reply's lease) less 60, and GPU_CHECK_BUDGET_S is that timeout_s less 45:
#      run(command="GPU_CHECK_BUDGET_S=<timeout_s - 45> bash scripts/gpu_check.sh http stability bulk",
#      carry=[".carry/speech", ".whl"], timeout_s=<budget_left_s - 60>). On the warm machine it skips the setup
#      (the first call left a marker in /tmp: GPU_CHECK_FRESH=1 redoes it); a fresh machine does it again. The
#      stages fit from about these GPU_CHECK_BUDGET_S: http 155, bulk 145, stability 85 (what is skipped is said),
#      each alone: the second call's 100-190 s fit http, the last goal; stability and bulk (no goal of the
#      issues' open ones) wait for a later lease: `gpu_check.sh stability bulk`.
# Beyond the image's torch, numpy, sentencepiece, pyyaml, pytest, hypothesis, prometheus-client and cuda-bindings,
# the tests and the stability stage read audio with soundfile and soxr, and nemo and http need more: all carried
# in .whl. Checked on a CPU with those alone (the image's packages at its versions, the wheels built for the
# CPU's Python): tests/gpu is collected, and every stage's script runs through on small inputs.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
started=$(date +%s)
BUDGET_S="${GPU_CHECK_BUDGET_S:-525}"
OUT="${OUT:-$PWD/gpu_check_out}"
STATE="${GPU_CHECK_STATE:-/tmp/gpu_check_state}"  # the setup, kept while the machine stays warm
SAVE_EVERY_S="${GPU_CHECK_SAVE_EVERY_S:-15}"
DIAG_BUDGET_S="${GPU_CHECK_DIAG_BUDGET_S:-75}"  # scripts/diag_conditional.py, where the conditional smoke fails
WORK="$(mktemp -d)"
mkdir -p "$OUT" "$STATE"

STAGES=(tests bench nemo http stability bulk)
declare -A CAP_S=([tests]=120 [bench]=170 [nemo]=240 [http]=200 [stability]=60 [bulk]=120)
# how long a stage's script may go on after its last look at its budget: a setting, a model's phase, a server run
declare -A TAIL_S=([bench]=30 [nemo]=30 [http]=70 [bulk]=60)
MIN_STAGE_S=60
END_S=20  # after a stage's share: timeout's grace before it kills (15 s), then the last save
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

running=setup  # what is under way, for a summary written meanwhile or when the command is stopped
running_since=$started
running_share=0
cut=""

show() {  # what summary.md shows of a stage: its table, else its log's end (pytest's summary, or why it gave nothing)
    local shown="$WORK/${SHOWN[$1]:-none}"
    if [ -s "$shown" ]; then
        cat "$shown"
    else
        tail -n 60 "$WORK/${LOG[$1]}" 2>/dev/null
    fi
}

save() {  # summary.md (the run, the goals as measured so far by scripts/gpu_goals.py, each stage's section) and
    # results.tar.gz under $OUT, each by a rename: a command killed while copying leaves the last whole one
    {
        cat "$WORK/head.md"
        [ -z "$cut" ] || printf '\n**Cut while %s was running:** %s\n' "${running:-the last save}" "$cut"
        echo
        python3 scripts/gpu_goals.py "$WORK" 2>&1 || echo "(scripts/gpu_goals.py failed)"
        cat "$WORK/stages.md"
        if [ "$running" = setup ]; then
            printf '\n## setup: running, %s s so far\n' "$(( $(date +%s) - running_since ))"
        elif [ -n "$running" ]; then
            printf '\n## %s: running, %s s of its %s s share so far (in the last summary to come back: cut here)\n\n' \
                "$running" "$(( $(date +%s) - running_since ))" "$running_share"
            show "$running"
        fi
    } > "$WORK/summary.md"
    cp "$WORK/summary.md" "$OUT/summary.md.part" && mv -f "$OUT/summary.md.part" "$OUT/summary.md"
    # tar's exit status 1: a file changed while it was read (a stage writing), and the archive is whole all the same
    if tar -czf "$OUT/results.tar.gz.part" -C "$WORK" . 2> /dev/null; [ $? -le 1 ]; then
        mv -f "$OUT/results.tar.gz.part" "$OUT/results.tar.gz"
    else
        rm -f "$OUT/results.tar.gz.part"
    fi
}

stopped() {  # save at once (a SIGKILL may follow), then let the running stage write down what it has and save again
    cut="the command was stopped (SIG$1) after $(( $(date +%s) - started )) s"
    save
    local limit
    limit="$(cat "$WORK/stage.pid" 2> /dev/null)"
    if [ -n "$limit" ] && kill -INT -- "-$limit" 2> /dev/null; then
        for _ in 1 2 3 4 5; do kill -0 "$limit" 2> /dev/null || break; sleep 1; done
        save
    fi
    exit 143
}
trap 'stopped TERM' TERM
trap 'stopped INT' INT
trap 'stopped HUP' HUP

printf '# gpu_check %s: %s in %s s\n' "$(date -u +%Y-%m-%dT%H:%MZ)" "${chosen[*]}" "$BUDGET_S" > "$WORK/head.md"
: > "$WORK/stages.md"
save  # from the start: a command stopped in its first stage still brings back a summary

# The setup (wheels, env probe, smoke decode) is done once a machine: a later call while it is warm finds the
# marker, which names the wheels and code it was done with, and skips it.
wheels="${GPU_CHECK_WHEELS:-.whl}"  # the carried wheels (the script's own tests name an empty folder)
fingerprint="$( { find "$wheels" -maxdepth 2 -type f -printf '%P %s\n' 2> /dev/null | sort
                  cat scripts/gpu_check.sh decoding/*.py models/*.py; } | md5sum | cut -d' ' -f1)"
set_up=""
if [ -z "${GPU_CHECK_FRESH:-}" ] && [ -f "$STATE/env.txt" ] \
        && [ "$(sed -n 1p "$STATE/ready" 2> /dev/null)" = "$fingerprint" ]; then
    set_up=1
fi
if [ -z "$set_up" ]; then
    echo "== setup: the carried wheels, the env probe, the smoke decode"
    # the cache too: its offline baseline was measured with the code and graph mode of the setup that made it
    rm -rf "$STATE/site" "$STATE/redis" "$STATE/ready" "$STATE/cache"
    if compgen -G "$wheels/*.whl" > /dev/null; then
        if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$STATE/site" "$wheels"/*.whl > "$WORK/setup.log" 2>&1; then
            cat "$WORK/setup.log"
            printf '\n## setup: the carried wheels did not install\n\n' >> "$WORK/stages.md"
            tail -n 30 "$WORK/setup.log" >> "$WORK/stages.md"
            running=""
            save
            exit 1
        fi
    fi
    if compgen -G "$wheels/redis/*.deb" > /dev/null; then  # Redis for the bulk-job stage, unpacked beside the image
        for deb in "$wheels"/redis/*.deb; do dpkg -x "$deb" "$STATE/redis"; done
    fi
fi
[ -d "$STATE/site" ] && export PYTHONPATH="$STATE/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$STATE/redis/usr/bin" ]; then
    export PATH="$STATE/redis/usr/bin:$PATH"
    export LD_LIBRARY_PATH="$STATE/redis/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONUNBUFFERED=1
if [ -z "${BATCHASR_PARITY_DIR:-}" ] && [ -f .carry/nemo-parity/reference.json ]; then
    export BATCHASR_PARITY_DIR="$PWD/.carry/nemo-parity"
fi
fixtures="parity fixtures: ${BATCHASR_PARITY_DIR:-not found (fixture-model GPU tests will skip)}"

if [ -n "$set_up" ]; then
    echo "== setup: as an earlier call on this machine left it"
    { echo "(env probe and smoke decode as an earlier call on this machine found them; GPU_CHECK_FRESH=1 redoes them)"
      cat "$STATE/env.txt"; echo "$fixtures"; } > "$OUT/env.txt"
    conditional_off="$(sed -n 2p "$STATE/ready")"
else
    {
        date -u +"%Y-%m-%dT%H:%M:%SZ"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        python3 --version
        # torch's CUDA start, NVRTC's compile and the module's load: any of them could hang on a bad driver
        timeout -s INT -k 10 60 python3 - <<'EOF' || echo "env probe failed or timed out (60 s): exit status $?"
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
    } 2>&1 | tee "$OUT/env.txt"

    # Conditional nodes, tried once before anything leans on them: if a decode with them hangs, fails or gives
    # other tokens than eager, the stages after tests run with them switched off ("auto" takes plain graphs)
    # instead of hanging until their shares run out. tests/gpu keeps them on: it is where such a fault is told
    # apart.
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
        echo "conditional smoke failed (exit status $smoke_rc): the stages after tests run with" \
            "BATCHASR_CONDITIONAL_NODES=0" | tee -a "$OUT/env.txt"
        conditional_off=1
        # which of the decoder's work a conditional body cannot hold here: a line a variant, logs in results.tar.gz
        OUT="$WORK/diag" timeout -s INT -k 10 100 python3 scripts/diag_conditional.py --budget-s "$DIAG_BUDGET_S" \
            2>&1 | sed 's/^/conditional diag: /' | tee -a "$OUT/env.txt"
    fi
    cp "$OUT/env.txt" "$STATE/env.txt"
    printf '%s\n%s\n' "$fingerprint" "$conditional_off" > "$STATE/ready"
    echo "$fixtures" | tee -a "$OUT/env.txt"
fi
grep -E "^(\(env probe|auto picks|condition kernel|conditional smoke|env probe failed)" "$OUT/env.txt" \
    | sed 's/^/    /' >> "$WORK/head.md"
if ! compgen -G "$wheels/*.whl" > /dev/null; then  # a call that forgot to carry them: said before stages fail on it
    echo "    no carried wheels in $wheels: the stages that need fastapi, soundfile or NeMo will fail (carry .whl)" \
        | tee -a "$WORK/head.md"
fi

# Each stage: $1 its share in seconds, then the extra options. Its files go to $WORK.
limited() {  # timeout with the stage's share; it leads a process group of its own, which a stop of this script's
    # never reaches (the stage ran on, unseen, its last measures unwritten): stopped() signals it by the pid noted
    timeout -s INT -k 15 "$@" &
    echo $! > "$WORK/stage.pid"
    wait $!
}
stage_tests() {  # -v: a test's name is written before it runs, so a test that hangs the GPU is named
    # A file that cannot be collected (a wheel not carried) costs its own tests, not the stage's; with
    # pytest-timeout (the image has it), a test that hangs the GPU ends the stage at once, not at its share's end
    # Conditional-node tests run last, in a pytest of their own: their capture has ended the process (a
    # segfault), which took every test after it along.
    local per_test=() rc
    python3 -c "import pytest_timeout" 2> /dev/null && per_test=(--timeout=75 --timeout-method=thread)
    limited "$1" python3 -m pytest -v -rs -p no:cacheprovider --continue-on-collection-errors "${per_test[@]}" \
        tests/gpu -k "not conditional" "${@:2}" > "$WORK/gpu_tests.log" 2>&1
    rc=$?
    echo "== conditional-node tests" >> "$WORK/gpu_tests.log"
    local left=$(( $1 - ($(date +%s) - running_since) ))
    limited "$(( left > 10 ? left : 10 ))" python3 -m pytest -v -rs -p no:cacheprovider \
        --continue-on-collection-errors "${per_test[@]}" tests/gpu -k conditional "${@:2}" \
        >> "$WORK/gpu_tests.log" 2>&1
    local rc_conditional=$?
    [ "$rc_conditional" -eq 5 ] && rc_conditional=0  # none collected (none named so): nothing failed
    return $(( rc != 0 ? rc : rc_conditional ))
}
stage_bench() {
    limited "$1" python3 scripts/bench_table.py --out "$WORK" --batch-sizes 128 16 1 \
        --n-utterances 256 --goal-repeat 5 --budget-s "$(( $1 - TAIL_S[bench] ))" "${@:2}" > "$WORK/bench.log" 2>&1
}
stage_nemo() {
    limited "$1" python3 scripts/nemo_compare.py --out "$WORK" --n-utterances 256 --repeat 2 \
        --check-utterances 64 --budget-s "$(( $1 - TAIL_S[nemo] ))" "${@:2}" > "$WORK/nemo.log" 2>&1
}
stage_http() {  # the goals read the offline engine's figure (bench): transcribe's is left out
    limited "$1" python3 loadtest/http_bench.py --model parakeet-tdt-0.6b-v2 --device cuda \
        --dtype bfloat16 --batch-size 128 --requests 3072 --concurrency 1536 --frontends 4,0 \
        --offline-baselines bench --cache-dir "$STATE/cache" --budget-s "$(( $1 - TAIL_S[http] ))" \
        --out "$WORK/http_bench.json" "${@:2}" > "$WORK/http.log" 2>&1
}
stage_stability() {  # one process: the interpreter's, CUDA's and the audio's start paid once for the three runs
    if [ ! -d .carry/speech ]; then
        echo "no .carry/speech (see the top of this script)" > "$WORK/stability.log"
        return 1
    fi
    # fixed batch shapes (BATCHASR_LENGTH_BUCKET_S) in bf16: do two submission orders give the same tokens and scores?
    limited "$1" python3 loadtest/batch_stability.py --device cuda --audio .carry/speech \
        --batch-size 128 --shuffles 2 --length-bucket-s 2 --json --runs bfloat16 float32 bfloat16:engine "${@:2}" \
        > "$WORK/stability.jsonl" 2> "$WORK/stability.log"
}
stage_bulk() {
    if ! redis-server --version > /dev/null 2>&1; then
        echo "no redis-server (bash scripts/fetch_gpu_wheels.sh service puts one in .whl/redis)" > "$WORK/bulk.log"
        return 1
    fi
    BATCHASR_JOB_CONSUMERS=2 limited "$1" python3 loadtest/http_bench.py \
        --model parakeet-tdt-0.6b-v2 --device cuda --dtype bfloat16 --batch-size 128 --requests 2048 \
        --concurrency 1024 --frontends 4 --jobs --offline-baselines bench --cache-dir "$STATE/cache" \
        --budget-s "$(( $1 - TAIL_S[bulk] ))" --out "$WORK/bulk_bench.json" "${@:2}" > "$WORK/bulk.log" 2>&1
}

status=0
for stage in "${chosen[@]}"; do
    left=$(( started + BUDGET_S - END_S - $(date +%s) ))
    share=$(( CAP_S[$stage] < left ? CAP_S[$stage] : left ))
    needed=$(( MIN_STAGE_S + ${TAIL_S[$stage]:-0} ))  # a minute of measuring, then its tail
    if [ "$share" -lt "$needed" ]; then
        printf '\n## %s: skipped, a share of %s s left, it needs %s\n' "$stage" "$share" "$needed" >> "$WORK/stages.md"
        status=1
        continue
    fi
    echo "== $stage: up to $share s"
    running=$stage
    running_since=$(date +%s)
    running_share=$share
    if [ "$stage" != tests ]; then  # "auto" takes conditional nodes where the smoke decode found them sound
        (export BATCHASR_CONDITIONAL_NODES="$([ -n "$conditional_off" ] && echo 0 || echo 1)"
         "stage_$stage" "$share" "$@") &
    else
        "stage_$stage" "$share" "$@" &
    fi
    pid=$!
    next_save=$(( running_since + SAVE_EVERY_S ))
    while kill -0 "$pid" 2> /dev/null; do  # its files reach $OUT while it runs
        sleep 1
        if [ "$(date +%s)" -ge "$next_save" ]; then
            save
            next_save=$(( $(date +%s) + SAVE_EVERY_S ))
        fi
    done
    wait "$pid"
    rc=$?
    rm -f "$WORK/stage.pid"
    running=""
    [ "$rc" -eq 0 ] || status=1
    why=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (stopped: its share ran out)"
    printf '\n## %s: exit status %s%s, %s s\n\n' "$stage" "$rc" "$why" "$(( $(date +%s) - running_since ))" \
        >> "$WORK/stages.md"
    show "$stage" >> "$WORK/stages.md"
    save
done
running=""
save
cat "$OUT/summary.md"
exit "$status"
