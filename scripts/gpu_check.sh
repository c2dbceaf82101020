#!/usr/bin/env bash
# GPU checks for label looping and its CUDA graph modes (issue 3): tests/gpu, then the bench table for
# docs/benchmarks.md (parakeet-tdt-0.6b-v2 and parakeet-rnnt-1.1b, bf16, batch 1/16/128, every algorithm
# and graph mode).
#
#   bash scripts/gpu_check.sh [all|tests|bench] [extra scripts/bench_table.py options]
#
# Results go under $OUT (the device tool's output folder; ./gpu_check_out when unset):
#   env.txt (GPU, driver, torch, which graph mode "auto" picks and why), gpu_tests.log,
#   bench.log, bench.jsonl (one `batchasr bench --json` object a line), bench_table.md.
#
# From a development checkout (run through the device tool, which sends the repository but not ../shared):
#   once here:  mkdir -p .carry && cp -r ../shared/fixtures/nemo-parity .carry/
#               x=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$x")"; echo /.carry/ >> "$x"
#   then:       run(command="bash scripts/gpu_check.sh tests", carry=[".carry"])   # and again with "bench"
# Python packages the GPU image lacks can travel as wheels in .whl/ (see the device tool's README); the GPU
# tests and the bench use synthetic audio and need none beyond the image's torch, numpy, sentencepiece, pyyaml,
# pytest, hypothesis and cuda-bindings.
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
export PYTHONUNBUFFERED=1
if [ -z "${BATCHASR_PARITY_DIR:-}" ] && [ -f .carry/nemo-parity/reference.json ]; then
    export BATCHASR_PARITY_DIR="$PWD/.carry/nemo-parity"
fi

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 - <<'EOF'
import torch

from decoding.cuda_conditional import conditional_support
from decoding.cuda_graphs import choose_mode

print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
try:
    import cuda.bindings

    print("cuda-bindings", cuda.bindings.__version__)
except ImportError as exc:
    print("cuda-bindings missing:", exc)
print("conditional nodes:", conditional_support())
print("auto picks:", choose_mode("auto", torch.device("cuda")))
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
exit "$status"
