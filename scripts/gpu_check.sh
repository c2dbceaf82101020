#!/usr/bin/env bash
# GPU checks and records: label looping and its CUDA graph modes (issue 3), the HTTP path against the offline
# engine (issue 4), and batchasr against NeMo's own transcribe() (issue 7).
#
#   bash scripts/gpu_check.sh [all|tests|bench|nemo|http|bulk|stability] [extra options for the stage's script]
#
# Stages and what each writes under $OUT (the device tool's output folder; ./gpu_check_out when unset). Every
# stage also writes env.txt (GPU, driver, Python, torch, which graph mode "auto" picks and why).
#   tests  tests/gpu                                                    gpu_tests.log
#   bench  scripts/bench_table.py: parakeet-tdt-0.6b-v2 and parakeet-rnnt-1.1b, bf16, batch 1/16/128, every
#          algorithm and graph mode, both attention kernels in conditional mode, 20 hotwords a row;
#          parakeet-ctc-1.1b plain and with the 20 hotwords
#                                                                       bench.log, bench.jsonl, bench_table.md
#   nemo   scripts/nemo_compare.py: the same two, bf16, batch 128, against NeMo 3.0 on the same weights and
#          audio, batchasr with both attention kernels; tokens compared; each side's stage times; encoder
#          share of the speed of light; cost per 1M audio hours
#                                                                       nemo.log, nemo_compare.jsonl, nemo_compare.md
#   http   loadtest/http_bench.py: parakeet-tdt-0.6b-v2, bf16, `batchasr serve` at saturation and half load vs
#          the offline engine; 16x the batch size in flight, the pool the batcher matches lengths from;
#          with 4 HTTP front-end processes, then with HTTP in the engine's process
#                                                                       http.log, http_bench.json
#   bulk   loadtest/http_bench.py --jobs: 4,096 clips as one bulk job through Redis (carried in .whl/redis), and
#          over HTTP; 4 front-end and 2 job consumer processes           bulk.log, bulk_bench.json
#   stability  loadtest/batch_stability.py: the embedded model on held-out speech (carried in .carry/speech), each
#          utterance alone and in batches of 128 (sorted, shuffled), bf16 and float32: how many transcripts move
#                                                                       stability.log, stability.jsonl
# The device tool brings back at most 8 files a call and runs a call for at most 10 minutes: run one stage a call.
#
# From a development checkout (run through the device tool, which sends the repository but not ../shared):
#   once here:  mkdir -p .carry && cp -r ../shared/fixtures/nemo-parity .carry/
#               python -m models.training.data --cache /tmp/speech --n-train 0        # held-out test speech
#               mkdir -p .carry/speech && for f in /tmp/speech/test_sentences/*.wav; do
#                   sox "$f" ".carry/speech/$(basename "$f" .wav).flac"; done       # about 10 MB
#               x=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$x")"; echo /.carry/ >> "$x"
#               bash scripts/fetch_gpu_wheels.sh          # .whl/: what the image lacks (service and NeMo)
#   then:       run(command="bash scripts/gpu_check.sh tests", carry=[".carry", ".whl"])
#               # then bench, nemo, http, bulk, stability
# Beyond the image's torch, numpy, sentencepiece, pyyaml, pytest, hypothesis, prometheus-client and cuda-bindings,
# the tests and the stability stage read audio with soundfile and soxr, and nemo and http need more: all carried
# in .whl (checked on a CPU: with those alone, tests/gpu is collected and every stage's script starts).
set -uo pipefail

what="${1:-all}"
[ $# -gt 0 ] && shift
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/redis/*.deb" > /dev/null; then  # Redis for the bulk-job stage, unpacked beside the image
    for deb in .whl/redis/*.deb; do dpkg -x "$deb" /tmp/redis; done
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

status=0
if [ "$what" = all ] || [ "$what" = tests ]; then
    python3 -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    python3 scripts/bench_table.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" = all ] || [ "$what" = nemo ]; then
    python3 scripts/nemo_compare.py --out "$OUT" "$@" 2>&1 | tee "$OUT/nemo.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" = all ] || [ "$what" = http ]; then
    # 4 front-end processes (the deployments' layout), then HTTP in the engine's process, on the same audio
    python3 loadtest/http_bench.py --model parakeet-tdt-0.6b-v2 --device cuda --dtype bfloat16 --batch-size 128 \
        --requests 6144 --concurrency 2048 --frontends 4,0 --out "$OUT/http_bench.json" "$@" 2>&1 | tee "$OUT/http.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" = all ] || [ "$what" = bulk ]; then
    if redis-server --version > /dev/null 2>&1; then
        # a bulk job of the same kind of audio through Redis, beside HTTP: 4 front ends, 2 consumer processes
        BATCHASR_JOB_CONSUMERS=2 python3 loadtest/http_bench.py --model parakeet-tdt-0.6b-v2 --device cuda --dtype bfloat16 --batch-size 128 \
            --requests 4096 --concurrency 2048 --frontends 4 --jobs --out "$OUT/bulk_bench.json" "$@" 2>&1 \
            | tee "$OUT/bulk.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    else
        echo "bulk: no redis-server (bash scripts/fetch_gpu_wheels.sh service puts one in .whl/redis)" | tee "$OUT/bulk.log"
    fi
fi
if [ "$what" = all ] || [ "$what" = stability ]; then
    if [ -d .carry/speech ]; then
        (
            rc=0
            for dtype in bfloat16 float32; do
                python3 loadtest/batch_stability.py --device cuda --dtype "$dtype" --audio .carry/speech \
                    --batch-size 128 --shuffles 2 --json "$@" || rc=1
            done
            exit "$rc"
        ) 2> "$OUT/stability.log" | tee "$OUT/stability.jsonl"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    else
        echo "stability: no .carry/speech (see the top of this script)" | tee "$OUT/stability.log"
    fi
fi
exit "$status"
