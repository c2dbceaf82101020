#!/usr/bin/env bash
# Fetch, here where pip reaches a package index, the wheels the GPU machine's image lacks, into .whl/ (ignored
# by git; the device tool carries it when a run names it). scripts/gpu_check.sh installs whatever is there.
#
#   bash scripts/fetch_gpu_wheels.sh [service] [nemo]      # default: both lists
#
# The image's Python is 3.12 (override with PYTHON_VERSION). A package published only as source is built here
# into a wheel, which must come out pure Python (py3-none-any) to run there. With the service group, Redis comes
# too, as Debian packages in .whl/redis (the image has none; gpu_check.sh unpacks them for the bulk-job stage).
set -euo pipefail
cd "$(dirname "$0")/.."
python_version="${PYTHON_VERSION:-3.12}"
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(service nemo)
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p .whl "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
platforms=()
for n in 1 2014 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do
    case "$n" in 1|2014) platforms+=(--platform "manylinux${n}_x86_64") ;; *) platforms+=(--platform "manylinux_${n}_x86_64") ;; esac
done
for group in "${groups[@]}"; do
    for spec in $(grep -v '^#' "scripts/gpu_wheels_${group}.txt"); do
        if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" \
                --implementation cp "${platforms[@]}" -d .whl "$spec" 2>/dev/null; then
            python3 -m pip wheel -q --no-deps -w .whl "$spec"
        fi
    done
done
if [[ " ${groups[*]} " == *" service "* ]] && command -v apt-get > /dev/null; then
    mkdir -p .whl/redis
    (cd .whl/redis && apt-get download -q redis-server redis-tools liblzf1 libjemalloc2 > /dev/null 2>&1) \
        || echo "warning: no Redis packages; the GPU bulk-job stage will skip" >&2
    for deb in .whl/redis/*_*.deb; do  # package names only: plain names travel best
        [ -e "$deb" ] || continue  # none downloaded: the glob stays as written (the bulk stage skips, as warned)
        mv "$deb" "${deb%%_*}.deb"
    done
fi
# a wheel tagged for one Python (cp312, py312) must be for the image's
if ls .whl | grep -E -- '-(cp|py)3[0-9]+-' | grep -v -- "-\(cp\|py\)${python_version/./}-"; then
    echo "error: the wheels above are for another Python than $python_version" >&2
    exit 1
fi
du -sh .whl
