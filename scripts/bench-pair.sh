#!/usr/bin/env bash
# Two builds of codepool-bench side by side: the dispatcher, HTTP, holds and
# redemption benchmarks, each build in turn, ROUNDS times, in one run (so the
# host's drift falls on both). Build each side with
#   git worktree add /tmp/before REV && CARGO_TARGET_DIR=/tmp/tgt-before \
#     cargo build --release -p codepool-bench --manifest-path /tmp/before/Cargo.toml
#
#   bash scripts/bench-pair.sh BEFORE_BIN AFTER_BIN [OUT_DIR]
#
# Results: OUT_DIR/{before,after}-ROUND/*.json and a log of each run.
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?the before build of codepool-bench}
after=${2:?the after build of codepool-bench}
out=${3:-target/bench-pair}
ROUNDS=${ROUNDS:-2}
# API_ORDERS: orders of each api run (its findOneAndUpdate baseline takes most of its time)
export RUST_LOG=${RUST_LOG:-warn}
mkdir -p "$out"
run() { # side round args...
	local side=$1 round=$2
	shift 2
	local bin=$before
	[[ $side == after ]] && bin=$after
	mkdir -p "$out/$side-$round"
	echo "== $side round $round: $*" | tee -a "$out/log"
	local t0=$SECONDS
	"$bin" --out-dir "$out/$side-$round" "$@" >>"$out/$side-$round.txt" 2>&1
	echo "   exit $? in $((SECONDS - t0)) s" | tee -a "$out/log"
}
for ((round = 1; round <= ROUNDS; round++)); do
	# Each pair starts with the other side than the pair before it.
	for side in before after; do run $side $round --queue-type quorum dispatch --purchases 20000; done
	for side in after before; do run $side $round api --orders ${API_ORDERS:-20000} --clients 64 --rate 1000 --seconds 10 --rounds 1; done
	for side in before after; do run $side $round holds --requests 10000 --clients 64 --rounds 1; done
	for side in after before; do run $side $round redeem --requests 10000 --clients 64 --rounds 1 --rate 2000 --seconds 10; done
done
echo "results: $out"
