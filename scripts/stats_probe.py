"""The cost of `codepool stats`'s last-hour and last-day grant counts on a
pool that has handed out many codes: the count before migration 0009 (a walk
of `(pool, status, seq)` that fetches every handed-out document) beside the
count scan of the partial `(pool, issued_at)` index, on the same data.

    .services/venv/bin/python scripts/stats_probe.py [CODES] [ISSUED]

Defaults: 2,000,000 codes of which 1,000,000 were handed out, evenly over
the last 30 days. Works in its own database (`stats_probe_<pid>`), dropped
at the end. MONGODB_URI overrides the local server.
"""

import datetime
import os
import sys
import time

from bson import Int64
from pymongo import MongoClient

codes = int(sys.argv[1]) if len(sys.argv) > 1 else 2_000_000
issued = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
client = MongoClient(os.environ.get("MONGODB_URI", "mongodb://127.0.0.1:27017/?directConnection=true"))
name = f"stats_probe_{os.getpid()}"
db = client[name]
try:
    now = datetime.datetime.now(datetime.timezone.utc)
    span = 30 * 86400
    started = time.time()
    batch = []
    for i in range(codes):
        d = {"pool": "big", "seq": Int64(i + 1)}
        if i < issued:
            d.update(status=1, order_id=f"o{i}", issued_at=now - datetime.timedelta(seconds=(issued - i) * span / issued))
        else:
            d["status"] = 0
        batch.append(d)
        if len(batch) == 10_000:
            db.codes.insert_many(batch, ordered=False)
            batch = []
    if batch:
        db.codes.insert_many(batch, ordered=False)
    db.codes.create_index([("pool", 1), ("status", 1), ("seq", 1)], name="pool_status_seq")
    db.codes.create_index(
        [("pool", 1), ("issued_at", 1)],
        name="pool_issued_at",
        partialFilterExpression={"issued_at": {"$exists": True}},
    )
    print(f"{codes:,} codes, {issued:,} handed out over 30 days: filled in {time.time() - started:.1f} s")

    def timed(label, query, hint=None):
        best, n = float("inf"), 0
        for _ in range(3):
            cmd = {"count": "codes", "query": query}
            if hint:
                cmd["hint"] = hint
            t = time.time()
            n = db.command(cmd)["n"]
            best = min(best, time.time() - t)
        print(f"{label:48s} n={n:>9,} {best * 1000:9.1f} ms (best of 3)")

    for period, since in [("hour", now - datetime.timedelta(hours=1)), ("day", now - datetime.timedelta(days=1))]:
        timed(
            f"last {period}, before 0009 (pool_status_seq)",
            {"pool": "big", "status": {"$in": [1, 2, 3]}, "issued_at": {"$gte": since}},
            hint="pool_status_seq",
        )
        timed(f"last {period}, now (pool_issued_at)", {"pool": "big", "issued_at": {"$gte": since}})
    timed("issued (pool_status_seq, count scan)", {"pool": "big", "status": 1})
finally:
    client.drop_database(name)
