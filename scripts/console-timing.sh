#!/usr/bin/env bash
# Render times of the console's heaviest pages on a large database: 10,000
# pools (POOLS) and one pool of BIG codes with a few hundred grants, served
# by a real `codepool api` (debug build unless BIN says otherwise). Prints
# one line per page: the median and the slowest of RUNS requests, in ms.
# Usage: scripts/console-timing.sh [BIN]   (services up: make services)
set -euo pipefail
BIN=${1:-target/debug/codepool}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
POOLS=${POOLS:-10000}
BIG=${BIG:-1000000}
RUNS=${RUNS:-20}
export CODEPOOL_DB=${CODEPOOL_DB:-codepool_console_timing}
export CODEPOOL_AMQP_PREFIX=console-timing.
export CODEPOOL_REDIS_PREFIX=console-timing
export RUST_LOG=warn
WORK=$(mktemp -d)
export CODEPOOL_KEY_FILE=$WORK/keys.json
trap 'kill $API 2>/dev/null || true; rm -rf "$WORK"' EXIT
PY=.services/venv/bin/python
"$BIN" keys init >/dev/null
"$PY" - "$CODEPOOL_DB" "$POOLS" <<'PY'
import sys, datetime, pymongo
db = pymongo.MongoClient("mongodb://127.0.0.1:27017/?directConnection=true")[sys.argv[1]]
db.client.drop_database(sys.argv[1])
now = datetime.datetime.now(datetime.timezone.utc)
db.pools.insert_many([{"_id": f"pool-{i:05d}", "created_at": now, "low_stock": 100, "paused": i % 97 == 0}
                      for i in range(int(sys.argv[2]))], ordered=False)
PY
"$BIN" migrate >/dev/null
"$PY" -c "
import sys
with open('$WORK/big.csv','w') as f:
    f.write('code\n')
    for i in range($BIG): f.write(f'BIG-{i:09d}\n')
"
echo "importing $BIG codes into pool big ..." >&2
"$BIN" import "$WORK/big.csv" --pool big >/dev/null 2>&1 || true
KEY=$("$BIN" api-keys create --name timing --scopes orders:write 2>/dev/null)
printf '%s\n' "timing password 1" | "$BIN" operators add --name timing --role admin --password-stdin >/dev/null
"$BIN" api --listen 127.0.0.1:0 2>"$WORK/api.log" &
API=$!
for _ in $(seq 1 200); do grep -q "api listening on" "$WORK/api.log" && break; sleep 0.1; done
ADDR=$(grep -o "api listening on .*" "$WORK/api.log" | awk '{print $4}')
for i in $(seq 1 300); do
  curl -s -o /dev/null -X POST "http://$ADDR/v1/orders" -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' \
    -d "{\"order_id\":\"T-$i\",\"uid\":\"u-$((i % 50))\",\"phone\":\"+86138000$((i % 50 + 10000))\",\"pool\":\"big\"}"
done
curl -s -o /dev/null -c "$WORK/jar" -d "name=timing&password=timing+password+1" "http://$ADDR/console/signin"
time_page() {
  local label=$1 path=$2
  for _ in $(seq 1 "$RUNS"); do
    curl -s -o /dev/null -b "$WORK/jar" -w '%{time_total}\n' "http://$ADDR$path"
  done | sort -n | awk -v l="$label" '{a[NR]=$1} END {printf "%-44s median %6.1f ms   max %6.1f ms\n", l, a[int((NR+1)/2)]*1000, a[NR]*1000}'
}
time_page "pools, first page (of $POOLS pools)" "/console/pools?chart=big"
time_page "pools, a middle page" "/console/pools?after=pool-05000"
time_page "pools, live rows" "/console/pools?part=rows&after=pool-05000"
time_page "pool big ($BIG codes) detail + chart" "/console/pools/big"
time_page "order search by order id" "/console/orders?by=order&q=T-150"
time_page "order search by uid" "/console/orders?by=uid&q=u-7"
time_page "order search by phone" "/console/orders?by=phone&q=%2B8613800010007"
time_page "order detail" "/console/orders/T-150"
time_page "audit log" "/console/audit"
