#!/usr/bin/env bash
# A sharded MongoDB on this machine, and codepool's exactly-once test through
# it (`make cluster-sharded`):
#
#   config server  127.0.0.1:27217  replica set cfgc (one member)
#   shard 1        127.0.0.1:27218  replica set shc1 (one member)
#   shard 2        127.0.0.1:27219  replica set shc2 (one member)
#   mongos         127.0.0.1:27220
#
# It migrates a database through the mongos, runs deploy/mongodb/sharding.js
# on it (one zone per shard, one pool pinned to each), imports codes into
# both pools, runs the exactly-once claim tests with every test database
# sharded by the same script, and prints where each pool's codes live.
#
# Needs `mongos` and `mongosh` on PATH (no registry package ships mongos
# alone: install MongoDB's server tarball). Where `mongos` is missing it says
# so and exits 1. Data lives in .services/sharded (deleted by `reset`).
#
# Usage: scripts/cluster-sharded.sh [start|stop|reset]
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${SERVICES_DIR:-$REPO/.services}/sharded
LOCAL=127.0.0.1
CFG_PORT=27217
SHARD_PORTS=(27218 27219)
MONGOS_PORT=27220
URI="mongodb://$LOCAL:$MONGOS_PORT/"
DB=codepool_sharded

say() { printf 'cluster-sharded: %s\n' "$*" >&2; }

stop() {
	local f
	for f in "$DIR"/*/pid; do
		[[ -f $f ]] || continue
		kill "$(cat "$f")" 2>/dev/null || true
		rm -f "$f"
	done
}

case ${1:-start} in
stop)
	stop
	exit 0
	;;
reset)
	stop
	rm -rf "$DIR"
	exit 0
	;;
start) ;;
*)
	echo "usage: $0 [start|stop|reset]" >&2
	exit 2
	;;
esac

if ! command -v mongos >/dev/null 2>&1; then
	say "no mongos on PATH: a sharded cluster cannot start here."
	say "install MongoDB's server tarball (mongod, mongos) and mongosh, put them on PATH, and run again;"
	say "without it, the suite proves shard readiness (tests/suite/sharding.rs, docs/scaling.md)."
	exit 1
fi
command -v mongosh >/dev/null 2>&1 || {
	say "mongos is here but mongosh is not: install mongosh and run again."
	exit 1
}
MONGOD=$(command -v mongod || true)
if [[ -z $MONGOD ]]; then
	# shellcheck source=scripts/services.sh
	source "$REPO/scripts/services.sh"
	MONGOD=$(mongod_bin)
fi

# start_mongod NAME PORT ROLE-FLAGS...
start_mongod() {
	local name=$1 port=$2
	shift 2
	mkdir -p "$DIR/$name/data"
	if mongosh --quiet "mongodb://$LOCAL:$port/?directConnection=true" --eval 'db.runCommand({ping: 1}).ok' >/dev/null 2>&1; then
		return 0
	fi
	say "starting $name on $LOCAL:$port"
	"$MONGOD" "$@" --replSet "$name" --bind_ip "$LOCAL" --port "$port" \
		--dbpath "$DIR/$name/data" --logpath "$DIR/$name/mongod.log" --logappend \
		--pidfilepath "$DIR/$name/pid" --wiredTigerCacheSizeGB 0.25 --fork >/dev/null
	mongosh --quiet "mongodb://$LOCAL:$port/?directConnection=true" --eval "
		try { rs.status() } catch (e) {
			rs.initiate({_id: '$name', configsvr: $([[ $* == *--configsvr* ]] && echo true || echo false),
				members: [{_id: 0, host: '$LOCAL:$port'}]})
		}
		while (!db.hello().isWritablePrimary) { sleep(200) }" >/dev/null
}

start_mongod cfgc "$CFG_PORT" --configsvr
start_mongod shc1 "${SHARD_PORTS[0]}" --shardsvr
start_mongod shc2 "${SHARD_PORTS[1]}" --shardsvr

if ! mongosh --quiet "$URI" --eval 'db.runCommand({ping: 1}).ok' >/dev/null 2>&1; then
	say "starting mongos on $LOCAL:$MONGOS_PORT"
	mkdir -p "$DIR/mongos"
	mongos --configdb "cfgc/$LOCAL:$CFG_PORT" --bind_ip "$LOCAL" --port "$MONGOS_PORT" \
		--logpath "$DIR/mongos/mongos.log" --logappend --pidfilepath "$DIR/mongos/pid" --fork >/dev/null
fi
mongosh --quiet "$URI" --eval "
	const have = db.adminCommand({listShards: 1}).shards.map(s => s._id);
	if (!have.includes('shc1')) sh.addShard('shc1/$LOCAL:${SHARD_PORTS[0]}');
	if (!have.includes('shc2')) sh.addShard('shc2/$LOCAL:${SHARD_PORTS[1]}');" >/dev/null

cd "$REPO"
export CODEPOOL_MONGODB_URI=$URI CODEPOOL_DB=$DB
CARGO=${CARGO:-cargo}
$CARGO run --locked -q -p codepool -- migrate
ZONES="var dbName = '$DB'; var zones = [
	{zone: 'zone-1', shard: 'shc1', pools: ['sharded-a']},
	{zone: 'zone-2', shard: 'shc2', pools: ['sharded-b']}]"
mongosh --quiet "$URI" --eval "$ZONES" deploy/mongodb/sharding.js
for p in sharded-a sharded-b; do
	$CARGO run --locked -q -p codepool -- pool create --pool "$p" >/dev/null 2>&1 || true
	f=$(mktemp)
	for i in $(seq 1 200); do printf '%s-%04d-%s\n' "${p^^}" "$i" "$RANDOM"; done >"$f"
	$CARGO run --locked -q -p codepool -- import "$f" --pool "$p"
	rm -f "$f"
done

# The exactly-once tests, every test database sharded by the same script.
say "running the exactly-once tests through the mongos"
CODEPOOL_TEST_MONGODB_URI=$URI CODEPOOL_TEST_SHARDING_JS=$REPO/deploy/mongodb/sharding.js \
	$CARGO nextest run --locked -p codepool --features codepool/failpoints --test suite \
	-E 'test(/^claims::|^sharding::every_unique/)'

say "where each pool's codes live:"
mongosh --quiet "$URI" --eval "
	const d = db.getSiblingDB('$DB');
	d.codes.aggregate([{\$group: {_id: '\$pool', codes: {\$sum: 1}}}]).forEach(p => {
		const r = d.codes.find({pool: p._id}).explain().queryPlanner.winningPlan;
		const shards = (r.shards || []).map(s => s.shardName);
		print(p._id + ': ' + p.codes + ' codes on ' + (shards.join(', ') || 'the primary shard'));
	});"
