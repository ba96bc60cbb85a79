#!/usr/bin/env bash
# Side-by-side benchmarks on the local servers (see `codepool-bench --help`).
# Builds the release binary, runs every benchmark once, and leaves the JSON
# results in target/bench/ (or $OUT_DIR). Each benchmark works in its own
# scratch database, Redis prefix and queue prefix, and removes them after.
#
#   bash scripts/bench.sh                # all of them, default sizes
#   bash scripts/bench.sh claim dispatch # only these
#   CLAIM_CODES=50000 bash scripts/bench.sh claim
#   HUGE_POOL=10000000 bash scripts/bench.sh huge   # the 10M pool of issue 10 (slow to fill)
#
# `latency` measures its own maximum first (closed loop) and sends at half
# of it. It, `api` and `channels` (also open loop) run right after `dispatch`, before
# `pools` and `huge` leave MongoDB with gigabytes of dropped collections to
# reclaim and dirty pages to write: that cleanup would land in the middle of
# an open-loop measurement.
#
# RUST_LOG defaults to warn: the dispatcher logs every grant at info level,
# and a terminal printing 20,000 lines would be part of the measurement.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${OUT_DIR:-target/bench}
CLAIM_CONCURRENCY=${CLAIM_CONCURRENCY:-1,8,32}
CLAIM_CODES=${CLAIM_CODES:-20000}
DISPATCH_PURCHASES=${DISPATCH_PURCHASES:-20000}
IMPORT_CODES=${IMPORT_CODES:-200000}
SEQ_IDS=${SEQ_IDS:-4000}
SCALE_POOLS=${SCALE_POOLS:-1000}
HUGE_POOL=${HUGE_POOL:-1000000}
# The scale comparisons alternate their two sides this many times and judge
# the median ratio: one pair of runs moves by ±0.1 with the host's load.
SCALE_ROUNDS=${SCALE_ROUNDS:-3}
# The cold many-pool row (issue 47): codes in each of SCALE_POOLS pools.
SCALE_CODES_PER_POOL=${SCALE_CODES_PER_POOL:-125}
LATENCY_SECONDS=${LATENCY_SECONDS:-10}
# The HTTP API (issue 33): fresh orders from API_CLIENTS keep-alive clients
# against the AMQP dispatcher (and the dispatcher held to the HTTP batches'
# size) alternating SCALE_ROUNDS times, a findOneAndUpdate handler, repeats,
# and the p99 at API_RATE requests/s open loop for LATENCY_SECONDS, run
# SCALE_ROUNDS times.
API_ORDERS=${API_ORDERS:-20000}
API_CLIENTS=${API_CLIENTS:-64}
API_RATE=${API_RATE:-1000}
# Webhooks (issue 45): purchases of no shop against the same purchases of a
# shop with WEBHOOK_ENDPOINTS endpoints subscribed to every event.
WEBHOOK_ENDPOINTS=${WEBHOOK_ENDPOINTS:-100}
# Holds and bundles (issue 46): HOLD_REQUESTS holds against as many HTTP
# orders, and as many 2-item bundles against orders of 2, alternating
# SCALE_ROUNDS times.
HOLD_REQUESTS=${HOLD_REQUESTS:-10000}
# Redemption by code (issue 55): REDEEM_REQUESTS orders then as many
# redemptions of their codes, alternating SCALE_ROUNDS times; the p99 of a
# check at REDEEM_RATE requests/s for LATENCY_SECONDS.
REDEEM_REQUESTS=${REDEEM_REQUESTS:-10000}
REDEEM_RATE=${REDEEM_RATE:-2000}
# Generated codes (issue 56): GENERATE_CODES generated against as many
# imported from a file, then statements over the imported ones.
GENERATE_CODES=${GENERATE_CODES:-1000000}
# Marketplace channels (issue 74): Eneba's RESERVE then PROVIDE at
# CHANNEL_RATE orders/s, open loop, beside the shop's own HTTP orders at
# CHANNEL_HTTP_RATE/s on the same pool, for LATENCY_SECONDS.
CHANNEL_RATE=${CHANNEL_RATE:-200}
CHANNEL_HTTP_RATE=${CHANNEL_HTTP_RATE:-100}
export RUST_LOG=${RUST_LOG:-warn}

which=("$@")
[[ ${#which[@]} -gt 0 ]] || which=(claim dispatch latency api channels holds redeem webhooks pools huge import generate seq crypto)

cargo build --locked --release -p codepool -p codepool-bench
bin=${CARGO_TARGET_DIR:-target}/release/codepool-bench
mkdir -p "$OUT_DIR"

for b in "${which[@]}"; do
	echo "== codepool-bench $b"
	case $b in
	claim) "$bin" --out-dir "$OUT_DIR" claim --concurrency "$CLAIM_CONCURRENCY" --codes "$CLAIM_CODES" ;;
	dispatch)
		# Quorum queues (the default) on both broker sides, then classic
		# ones (dispatch-classic.json): the pass-through's rate, and so goal
		# 3's ratio, depends on the queue type far more than the dispatcher's.
		# Named explicitly: CODEPOOL_QUEUE_TYPE may be set for the product.
		"$bin" --out-dir "$OUT_DIR" --queue-type quorum dispatch --purchases "$DISPATCH_PURCHASES" --quantity 5
		"$bin" --out-dir "$OUT_DIR" --queue-type classic dispatch --purchases "$DISPATCH_PURCHASES"
		;;
	pools)
		for spread in uniform zipf; do
			"$bin" --out-dir "$OUT_DIR" dispatch --purchases "$DISPATCH_PURCHASES" --pools "$SCALE_POOLS" --spread "$spread" --rounds "$SCALE_ROUNDS"
		done
		# Issue 47: the cold start of a large catalogue with a backlog, pools
		# of SCALE_CODES_PER_POOL codes, clock stopped at the last code issued.
		"$bin" --out-dir "$OUT_DIR" dispatch --purchases "$DISPATCH_PURCHASES" --pools "$SCALE_POOLS" --spread uniform --cold --codes-per-pool "$SCALE_CODES_PER_POOL" --rounds "$SCALE_ROUNDS"
		;;
	huge) "$bin" --out-dir "$OUT_DIR" dispatch --purchases "$DISPATCH_PURCHASES" --pool-size "$HUGE_POOL" --rounds "$SCALE_ROUNDS" ;;
	latency)
		# `half`: half the maximum of the same loop (sender and listener on
		# the machine too), measured first in the same run.
		# Each rate runs SCALE_ROUNDS times; the run of the median p99 is
		# reported.
		"$bin" --out-dir "$OUT_DIR" latency --rate "100,1000,half" --seconds "$LATENCY_SECONDS" --rounds "$SCALE_ROUNDS"
		;;
	webhooks) "$bin" --out-dir "$OUT_DIR" dispatch --purchases "$DISPATCH_PURCHASES" --webhook-endpoints "$WEBHOOK_ENDPOINTS" --rounds "$SCALE_ROUNDS" ;;
	api) "$bin" --out-dir "$OUT_DIR" api --orders "$API_ORDERS" --clients "$API_CLIENTS" --rate "$API_RATE" --seconds "$LATENCY_SECONDS" --rounds "$SCALE_ROUNDS" ;;
	channels) "$bin" --out-dir "$OUT_DIR" channels --rate "$CHANNEL_RATE" --http-rate "$CHANNEL_HTTP_RATE" --seconds "$LATENCY_SECONDS" ;;
	holds) "$bin" --out-dir "$OUT_DIR" holds --requests "$HOLD_REQUESTS" --clients "$API_CLIENTS" --rounds "$SCALE_ROUNDS" ;;
	redeem) "$bin" --out-dir "$OUT_DIR" redeem --requests "$REDEEM_REQUESTS" --clients "$API_CLIENTS" --rounds "$SCALE_ROUNDS" --rate "$REDEEM_RATE" --seconds "$LATENCY_SECONDS" ;;
	import) "$bin" --out-dir "$OUT_DIR" import --codes "$IMPORT_CODES" --rounds "$SCALE_ROUNDS" ;;
	generate) "$bin" --out-dir "$OUT_DIR" generate --codes "$GENERATE_CODES" ;;
	seq) "$bin" --out-dir "$OUT_DIR" seq --ids "$SEQ_IDS" ;;
	crypto) "$bin" --out-dir "$OUT_DIR" crypto ;; # after import and dispatch: reads their results
	*)
		echo "unknown benchmark $b (claim, dispatch, pools, huge, latency, api, channels, holds, redeem, webhooks, import, generate, seq, crypto)" >&2
		exit 2
		;;
	esac
	echo
done
echo "results: $OUT_DIR/*.json"
