#!/usr/bin/env bash
# Make here, once, what the device calls carry (scripts/gpu_check.sh's header says which call carries which):
#   .carry/nemo-parity   NeMo's fixtures (BATCHASR_PARITY_DIR, else ../shared/fixtures/nemo-parity), 12 MiB
#   .carry/speech        held-out test speech (espeak-ng) as FLAC, for the stability stage, 14 MiB
#   .whl                 the wheels and Redis packages the GPU image lacks (scripts/fetch_gpu_wheels.sh), 18 MiB
# Both folders are ignored by git. Needs espeak-ng and sox (apt-get install espeak-ng sox).
#
#   bash scripts/prepare_gpu_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
parity="${BATCHASR_PARITY_DIR:-../shared/fixtures/nemo-parity}"
[ -f "$parity/tdt.nemo" ] || { echo "no NeMo fixtures in $parity (set BATCHASR_PARITY_DIR)" >&2; exit 1; }
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p .carry "$(dirname "$exclude")"
grep -qx '/.carry/' "$exclude" 2>/dev/null || echo /.carry/ >> "$exclude"

rm -rf .carry/nemo-parity && cp -r "$parity" .carry/nemo-parity

speech="$(mktemp -d)"
trap 'rm -rf "$speech"' EXIT
python -m models.training.data --cache "$speech" --n-train 0 --workers "$(nproc)"
rm -rf .carry/speech && mkdir -p .carry/speech
for wav in "$speech"/test_sentences/*.wav; do
    sox "$wav" ".carry/speech/$(basename "$wav" .wav).flac"
done

bash scripts/fetch_gpu_wheels.sh
du -sh .carry/nemo-parity .carry/speech .whl
