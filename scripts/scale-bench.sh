#!/usr/bin/env bash
# Dispatcher throughput on the replicated servers (scripts/cluster.sh), for
# 1, 2 and 3 dispatcher processes: the purchases queue is filled first, then
# the dispatchers start; throughput is grants / (last issued_at - first
# issued_at), read from MongoDB, so start-up time does not count.
#
# Usage: scripts/scale-bench.sh [BIN] [PURCHASES] [DISPATCHER COUNTS...]
#   defaults: target/release/codepool 20000 1 2 3
# Prints one line per run and writes target/bench/scale.json.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BIN=${1:-target/release/codepool}
N=${2:-20000}
shift $(($# > 2 ? 2 : $#))
COUNTS=("$@")
((${#COUNTS[@]})) || COUNTS=(1 2 3)
[[ -x $BIN ]] || {
	echo "scale-bench: $BIN is not built; run: cargo build --release -p codepool" >&2
	exit 1
}

eval "$(bash scripts/cluster.sh start 2>/dev/null)"
export RUST_LOG=warn
PY=.services/venv/bin/python
mkdir -p target/bench
WORK=$(mktemp -d -t codepool-scale.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
seq -f "SCALE-%07g" 1 "$N" >"$WORK/codes.csv"
results=()

# clean_up RUN: drop the run's database and queues (its exchanges stay, reused)
clean_up() {
	"$PY" -c 'import sys; from pymongo import MongoClient; MongoClient(sys.argv[1]).drop_database(sys.argv[2])' \
		"$CODEPOOL_MONGODB_URI" "$1"
	local q n
	for q in purchases purchases.dead sms.pending sms.receipts code.redeemed; do
		for n in 1 2 3; do
			rabbitmqctl -q -n "rabbit-c$n@localhost" delete_queue "$1.$q" >/dev/null 2>&1 && break
		done
	done
	return 0
}

for k in "${COUNTS[@]}"; do
	run=codepool_scale_$k # fixed names: a rerun reuses (and first empties) them
	export CODEPOOL_DB=$run CODEPOOL_AMQP_PREFIX=$run. CODEPOOL_REDIS_PREFIX=$run
	clean_up "$run"
	"$BIN" migrate >/dev/null
	"$BIN" import "$WORK/codes.csv" --pool scale >/dev/null
	awk -v n="$N" -v run="$run" 'BEGIN { for (i = 1; i <= n; i++)
		printf "{\"order_id\":\"%s-%07d\",\"uid\":\"u%d\",\"phone\":\"+8613800000000\",\"pool\":\"scale\"}\n", run, i, i }' \
		>"$WORK/purchases.jsonl"
	t0=$(date +%s.%N)
	"$BIN" publish --file "$WORK/purchases.jsonl" >/dev/null
	publish_secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
	pids=()
	for _ in $(seq 1 "$k"); do
		"$BIN" dispatch --no-http 2>>"$WORK/dispatch-$k.log" &
		pids+=($!)
	done
	line=$("$PY" - "$CODEPOOL_MONGODB_URI" "$run" "$N" "$k" "$publish_secs" <<'PY'
import os, sys, time
from pymongo import MongoClient
uri, db, n, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
publish = float(sys.argv[5])
codes = MongoClient(uri)[db].codes
deadline = time.time() + 900
while codes.count_documents({"status": 1}) < n and time.time() < deadline:
    time.sleep(0.5)
first = codes.find_one({"status": 1}, sort=[("issued_at", 1)])["issued_at"]
last = codes.find_one({"status": 1}, sort=[("issued_at", -1)])["issued_at"]
granted = codes.count_documents({"status": 1})
secs = max((last - first).total_seconds(), 0.001)
print(f'{{"dispatchers": {k}, "purchases": {granted}, "seconds": {secs:.2f}, "per_second": {granted / secs:.0f}, '
      f'"publish_per_second": {n / publish:.0f}}}')
sys.stdout.flush()
os._exit(0)
PY
)
	kill -TERM "${pids[@]}" 2>/dev/null || true
	wait "${pids[@]}" 2>/dev/null || true
	echo "scale-bench: $line" >&2
	results+=("$line")
	clean_up "$run"
done
(
	IFS=,
	echo "[${results[*]}]"
) >target/bench/scale.json
echo "scale-bench: results in target/bench/scale.json" >&2
