#!/usr/bin/env bash
# `make run`: the whole product path on local servers, start to finish.
# Imports fixtures/codes.csv into pool "demo", starts a dispatcher, publishes
# fixtures/purchases.jsonl (10 orders plus one duplicate delivery), waits
# until every order has its codes, shows the grants (codes masked) and the
# SMS-pending events, places an order over the HTTP API with curl, and stops
# the API and the dispatcher cleanly.
set -euo pipefail
BIN=${1:-target/debug/codepool}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export RUST_LOG=${RUST_LOG:-warn}
LOG=$(mktemp -t codepool-demo.XXXXXX.log)
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# Codes are encrypted at rest: the demo keeps its own key file, created on
# the first run (a real deployment runs `codepool keys init` once and backs
# the file up: losing it loses the codes).
export CODEPOOL_KEY_FILE=${CODEPOOL_KEY_FILE:-$ROOT/.services/demo-keys.json}
step "key file $CODEPOOL_KEY_FILE"
if [ -f "$CODEPOOL_KEY_FILE" ]; then
  echo "present (created by an earlier run)"
else
  "$BIN" keys init
fi
# The demo's data belongs to its key file: the database (and the queue and
# Redis prefixes) are named after the key file's HMAC key, so a second
# checkout on this machine, with a key file of its own, gets its own.
DEMO_DB=$(scripts/demo-db.sh "$CODEPOOL_KEY_FILE")
export CODEPOOL_DB=${CODEPOOL_DB:-$DEMO_DB}
export CODEPOOL_AMQP_PREFIX=${CODEPOOL_AMQP_PREFIX:-demo.${DEMO_DB#codepool_demo_}.}
export CODEPOOL_REDIS_PREFIX=${CODEPOOL_REDIS_PREFIX:-$DEMO_DB}

step "migrate (database $CODEPOOL_DB)"
"$BIN" migrate

# Queues are quorum queues now; a demo run by an older version left classic
# ones, and a queue's type cannot change. Run the demo on them, and say how
# to move to quorum queues.
if ! out=$("$BIN" sms-pending --limit 0 2>&1); then
  if [[ -z ${CODEPOOL_QUEUE_TYPE:-} ]] && grep -q "exists as a classic queue" <<<"$out"; then
    printf '%s\n' "note: the demo's queues (${CODEPOOL_AMQP_PREFIX}*) are classic queues from an older" \
      "      version; this run uses them as they are (CODEPOOL_QUEUE_TYPE=classic). To move" \
      "      to quorum queues, delete them and run again: for q in purchases purchases.dead" \
      "      sms.pending sms.receipts code.redeemed; do rabbitmqctl delete_queue ${CODEPOOL_AMQP_PREFIX}\$q; done"
    export CODEPOOL_QUEUE_TYPE=classic
  else
    echo "$out" >&2
    exit 1
  fi
fi

step "import fixtures/codes.csv into pool demo"
"$BIN" import fixtures/codes.csv --pool demo

step "start the dispatcher (log: $LOG)"
RUST_LOG=info "$BIN" dispatch --http 127.0.0.1:0 >"$LOG" 2>&1 &
DISPATCHER=$!
trap 'kill -TERM $DISPATCHER 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  grep -q "consuming purchases" "$LOG" && break
  kill -0 $DISPATCHER 2>/dev/null || { cat "$LOG"; echo "the dispatcher failed to start" >&2; exit 1; }
  sleep 0.1
done
grep -o "http listening on .*" "$LOG" || true

step "publish fixtures/purchases.jsonl (10 orders, two of several codes, + 1 duplicate delivery)"
"$BIN" publish --file fixtures/purchases.jsonl

# Codes to wait for: one per order, plus the extra codes of orders of several.
ORDERS=$(( $(grep -o '"order_id": *"[^"]*"' fixtures/purchases.jsonl | sort -u | wc -l) + 3 ))
for _ in $(seq 1 100); do
  n=$("$BIN" lookup --pool demo --json --limit 1000 | grep -c '"order_id": "DEMO-' || true)
  [ "$n" -ge "$ORDERS" ] && break
  sleep 0.2
done

step "which order got which code (codes masked; add --reveal to see them)"
"$BIN" lookup --pool demo --limit 20

step "the dispatcher's log of grants and SMS-pending events"
grep -E "granted|dead-lettered" "$LOG" | sed -E 's/\x1b\[[0-9;]*m//g' || true

step "SMS-pending events waiting for the SMS service (queue ${CODEPOOL_AMQP_PREFIX}sms.pending)"
"$BIN" sms-pending --limit 12 || true

step "the HTTP API: a key for the shop, then an order of 2 codes placed with curl"
if ! command -v curl >/dev/null; then
  if [ "$(id -u)" = 0 ]; then apt-get install -y -qq curl >/dev/null; else sudo apt-get install -y -qq curl >/dev/null; fi
fi
SHOP="demo-shop-$$"
KEY=$("$BIN" api-keys create --name "$SHOP" --scopes orders:write,orders:read)
API_LOG=$(mktemp -t codepool-api.XXXXXX.log)
RUST_LOG=info "$BIN" api --listen 127.0.0.1:0 >"$API_LOG" 2>&1 &
API=$!
trap 'kill -TERM $DISPATCHER $API 2>/dev/null || true' EXIT
ADDR=
for _ in $(seq 1 100); do
  ADDR=$(grep -o "api listening on .*" "$API_LOG" | awk '{print $4}' || true)
  [ -n "$ADDR" ] && break
  kill -0 $API 2>/dev/null || { cat "$API_LOG"; echo "the API failed to start" >&2; exit 1; }
  sleep 0.1
done
echo "codepool api on $ADDR (log: $API_LOG)"

# The operator console is served by the same process, under /console. The
# demo operator is an admin of the demo database only.
DEMO_OPERATOR_PASSWORD=${DEMO_OPERATOR_PASSWORD:-demo-console-1}
if ! printf '%s\n' "$DEMO_OPERATOR_PASSWORD" | "$BIN" operators add --name demo --role admin --password-stdin >/dev/null 2>&1; then
  printf '%s\n' "$DEMO_OPERATOR_PASSWORD" | "$BIN" operators passwd --name demo --password-stdin >/dev/null
fi
echo "operator console: http://$ADDR/console  (sign in as demo / $DEMO_OPERATOR_PASSWORD, role admin)"
SIGNIN=$(curl -s -o /dev/null -w '%{http_code} %{redirect_url}' -d "name=demo&password=$DEMO_OPERATOR_PASSWORD" "http://$ADDR/console/signin")
echo "sign-in check: $SIGNIN (303 to the pools page: signed in)"
echo "(this API stops at the end of the demo; to keep the console: $BIN api --listen 127.0.0.1:8080, then open http://127.0.0.1:8080/console)"
BODY='{"order_id":"DEMO-WEB-1","uid":"user-web","phone":"+8613800000011","pool":"demo","quantity":2}'
echo "\$ curl -X POST http://$ADDR/v1/orders -H 'Authorization: Bearer \$KEY' -H 'Content-Type: application/json' -d '$BODY'"
curl -sS -X POST "http://$ADDR/v1/orders" -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' -d "$BODY"
echo
echo "\$ curl http://$ADDR/v1/orders/DEMO-WEB-1 -H 'Authorization: Bearer \$KEY'"
curl -sS "http://$ADDR/v1/orders/DEMO-WEB-1" -H "Authorization: Bearer $KEY"
echo
kill -TERM $API
wait $API && echo "API exited cleanly (status 0)"
"$BIN" api-keys revoke --name "$SHOP" >/dev/null

step "stock"
"$BIN" stats --pool demo

step "codes per encryption key"
"$BIN" keys status

step "stop the dispatcher (SIGTERM)"
kill -TERM $DISPATCHER
wait $DISPATCHER && echo "dispatcher exited cleanly (status 0)"
trap - EXIT
