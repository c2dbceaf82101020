#!/usr/bin/env bash
# Headless locust run against a batchasr server on this machine; CSV, HTML and /metrics snapshots land in
# one results directory.
#
#   loadtest/run.sh                                  # 8 users, 60 s, both user classes
#   LOADTEST_USERS=4 LOADTEST_RUN_TIME=2m loadtest/run.sh TranscribeUser   # only the HTTP user
#
# Environment: LOADTEST_HOST (default http://127.0.0.1:8000; loopback only), LOADTEST_USERS (8),
# LOADTEST_SPAWN_RATE (2 per second), LOADTEST_RUN_TIME (60s), LOADTEST_RESULTS_DIR (default
# loadtest/results/<UTC time>), and the locustfile's LOADTEST_* (audio, API key, job size).
# Arguments: user classes to run (default: all), then any further locust options.
# Locust shares users out by weight (TranscribeUser 4, JobsUser 1): below 3 users no JobsUser starts, so bulk jobs
# go untested; name JobsUser alone to load them. JobsUser needs a server with Redis (`serve --redis-url`): without
# one, its every job is answered 503 jobs_disabled and the run fails.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

host="${LOADTEST_HOST:-http://127.0.0.1:8000}"
users="${LOADTEST_USERS:-8}"
spawn_rate="${LOADTEST_SPAWN_RATE:-2}"
run_time="${LOADTEST_RUN_TIME:-60s}"
results="${LOADTEST_RESULTS_DIR:-$here/results/$(date -u +%Y%m%dT%H%M%SZ)}"

# the locustfile's own rule, before /metrics is fetched (a pattern here let 127.0.0.1.nip.io and
# http://localhost:8000@example.com through)
loopback='import ipaddress, sys, urllib.parse
host = urllib.parse.urlsplit(sys.argv[1]).hostname or ""
try:
    sys.exit(0 if host == "localhost" or ipaddress.ip_address(host).is_loopback else 1)
except ValueError:
    sys.exit(1)'
python3 -c "$loopback" "$host" \
    || { echo "run.sh: refusing to load $host: only loopback hosts (127.0.0.1, localhost, [::1])" >&2; exit 2; }
command -v locust >/dev/null || { echo "run.sh: locust is missing: pip install -e '.[loadtest]'" >&2; exit 2; }

snapshot() {  # /metrics before and after: RTFx over the run = delta audio seconds / delta compute seconds
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
        "$host/metrics" > "$results/metrics-$1.txt" \
        || { rm -f "$results/metrics-$1.txt"; echo "run.sh: no /metrics snapshot ($1)" >&2; }  # no empty file left
}

mkdir -p "$results"
snapshot before
set +e
locust -f "$here/locustfile.py" --headless --host "$host" --users "$users" --spawn-rate "$spawn_rate" \
    --run-time "$run_time" --stop-timeout 60 --csv "$results/locust" --csv-full-history \
    --html "$results/report.html" --logfile "$results/locust.log" "$@"
status=$?
set -e
snapshot after
python3 - "$results" <<'PY'
import pathlib, re, sys

results = pathlib.Path(sys.argv[1])


def total(name: str, which: str) -> float | None:
    path = results / f"metrics-{which}.txt"
    match = re.search(rf"^{name} (\S+)$", path.read_text() if path.exists() else "", re.M)
    return float(match.group(1)) if match else None


series = ("batchasr_audio_seconds_total", "batchasr_compute_seconds_total")
before, after = ([total(name, which) for name in series] for which in ("before", "after"))
if None in before or None in after:  # a counter taken as 0 would give the server's whole life, or a negative
    missing = " and ".join(w for w, values in (("before", before), ("after", after)) if None in values)
    line = f"no RTFx: no /metrics snapshot {missing} the run (was the server up throughout?)"
elif after[0] < before[0] or after[1] < before[1]:
    line = "no RTFx: the server's counters went back during the run (it restarted)"
else:
    audio, compute = after[0] - before[0], after[1] - before[1]
    line = f"audio {audio:.1f} s, engine compute {compute:.1f} s, RTFx {audio / compute:.2f}" if compute else "no audio"
(results / "rtfx.txt").write_text(line + "\n")
print(f"server: {line}")
PY
echo "results: $results (report.html, locust_stats.csv, locust_failures.csv, rtfx.txt)"
exit "$status"
