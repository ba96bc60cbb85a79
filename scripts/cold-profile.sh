#!/usr/bin/env bash
# Where the cold many-pool row of `make bench` spends its CPU, side by side:
# one round of `codepool-bench dispatch --pools 1000 --spread uniform --cold`
# (one pool, then many) under `perf record -a -g`, then each process's CPU
# and mongod's by operation, per 1,000 purchases of each side
# (scripts/cold_profile.py). The machine is saturated during both runs, so
# what a side spends per purchase is what sets its rate.
#
#   bash scripts/cold-profile.sh [OUT_DIR]     # default target/cold-profile
#
# Needs `perf` (Debian: linux-perf) and the servers of `make services`;
# builds the release bench like scripts/bench.sh. Not part of `make bench`:
# perf is not one of the project's servers, and sampling costs a little.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v perf >/dev/null || {
	echo "cold-profile: perf is not installed (Debian: apt-get install linux-perf)" >&2
	exit 2
}
OUT=${1:-target/cold-profile}
mkdir -p "$OUT"
export RUST_LOG=${RUST_LOG:-warn}
[[ -n "${NO_BUILD:-}" ]] || cargo build --locked --release -p codepool-bench
bin=${CARGO_TARGET_DIR:-target}/release/codepool-bench

# The whole run is recorded against CLOCK_MONOTONIC; each side's window
# starts when its dispatcher starts (its line on stderr, stamped with the
# same clock, after the checkpoint the bench takes first) and lasts as long
# as the side ran (its `settled_seconds`).
perf record -a -g -F 499 -k CLOCK_MONOTONIC -o "$OUT/perf.data" -- sleep 600 >/dev/null 2>&1 &
perf_pid=$!
trap 'kill -INT $perf_pid 2>/dev/null || true' EXIT
sleep 1
"$bin" --out-dir "$OUT" dispatch --purchases 20000 --pools 1000 --spread uniform --cold --codes-per-pool 125 --rounds 1 2>&1 |
	python3 -u -c '
import sys, time
for line in sys.stdin:
    if line.endswith(": dispatcher started\n"):
        print("%.6f %s" % (time.clock_gettime(time.CLOCK_MONOTONIC), line.split(":")[0]), flush=True)
    sys.stderr.write(line)
' >"$OUT/starts.txt"
kill -INT $perf_pid
wait $perf_pid || true
trap - EXIT
python3 scripts/cold_profile.py "$OUT"
