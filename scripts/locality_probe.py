"""What a claim costs mongod when its codes lie in one pool, and when they
lie in many: the floor under the cold many-pool row of `make bench`.

The claim writes each batch of 256 candidates in one multi-document update
(`store/src/codes/claim.rs::claim_statement`: `_id $in`, still unissued and
unexpired, each document taking the holder at its own position) and reads
the candidates' sealed codes meanwhile (`codes_by_id`). This probe runs that
statement, and that read, on the same data two ways:

- one pool: 256 consecutive codes of a pool as large as all the others;
- many pools: the oldest unissued code of 256 pools drawn at random from
  1,000 pools (about 224 distinct pools a batch, as in
  `dispatch --pools 1000 --spread uniform --cold`).

Each round claims BATCHES batches of each side, after a checkpoint (as the
bench takes one before each run), then reads the same codes, and measures
mongod's CPU time (from /proc) for the writes and for the reads; the side that goes first
alternates. It prints the median of the rounds, in ms of mongod CPU per
1,000 codes. Nothing here is Redis, RabbitMQ or the dispatcher: what the
spread side costs more is MongoDB's own work on scattered documents
(B-tree descents, pages touched, index entries of 224 pools' key ranges).

    .services/venv/bin/python scripts/locality_probe.py [ROUNDS] [BATCHES]

Defaults: 5 rounds of 80 batches (mongod's CPU time moves in ticks of
10 ms: fewer batches measure the reads coarsely). Works in its own database
(`locality_probe_<pid>`), made with the project's migrations and dropped at
the end. MONGODB_URI overrides the local server; MONGOD_PID names the
process to measure (default: .services/mongo/mongod.pid).
"""

import datetime
import os
import random
import statistics
import sys
import time

from bson import Binary, Int64, ObjectId

from probe_db import client as connect, fresh, mongod_cpu

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
batches = int(sys.argv[2]) if len(sys.argv) > 2 else 80
BATCH = 256
POOLS = 1000
# At least 125 codes a pool (the bench's), and twice what the rounds claim,
# so the last batches still draw from most pools.
PER_POOL = max(125, -(-2 * rounds * batches * BATCH // POOLS))

client = connect()
name = f"locality_probe_{os.getpid()}"
db = fresh(client, name)
codes = db.codes


def code(pool, seq):
    return {
        "_id": ObjectId(),
        "pool": pool,
        "code_enc": Binary(os.urandom(60)),
        "key_id": "k1",
        "code_hmac": Binary(os.urandom(32)),
        "code_fold_hmac": Binary(os.urandom(32)),
        "status": 0,
        "seq": Int64(seq),
        "batch_id": ObjectId(),
        "created_at": datetime.datetime.now(datetime.timezone.utc),
        "is_sms": 0,
    }


def fill():
    """One pool as large as all the small ones together, imported first."""
    docs = [code("one", s) for s in range(1, POOLS * PER_POOL + 1)]
    for p in range(POOLS):
        docs.extend(code(f"p-{p:04}", s) for s in range(1, PER_POOL + 1))
    for i in range(0, len(docs), 5000):
        codes.insert_many(docs[i : i + 5000], ordered=False)


def unissued():
    """Each pool's unissued codes, oldest first: the candidates."""
    by_pool = {}
    for d in codes.find({"status": 0}, {"pool": 1}).sort([("pool", 1), ("status", 1), ("seq", 1)]):
        by_pool.setdefault(d["pool"], []).append(d["_id"])
    return by_pool


orders = iter(range(10**9))


def claim(batch):
    """The claim statement of `claim.rs`, for orders of one code."""
    ids = [i for i, _ in batch]
    pools = [p for _, p in batch]
    now = datetime.datetime.now(datetime.timezone.utc)
    n = [next(orders) for _ in batch]
    columns = {
        "order_id": [f"O-{k}" for k in n],
        "uid": [f"u-{k}" for k in n],
        "phone": [f"+86138{k:08}" for k in n],
        "sms_pending": [True] * len(batch),
    }
    at = {"$indexOfArray": [{"$literal": ids}, "$_id"]}
    holder = {"status": 1, "issued_at": now}
    for field, column in columns.items():
        holder[field] = {"$ifNull": [{"$arrayElemAt": [{"$literal": column}, "$$i"]}, "$$REMOVE"]}
    q = {
        "_id": {"$in": ids},
        "status": {"$in": [0]},
        "$or": [{"expires_at": None}, {"expires_at": {"$gt": now}}],
        "$expr": {"$eq": ["$pool", {"$arrayElemAt": [{"$literal": pools}, at]}]},
    }
    u = [{"$replaceWith": {"$mergeObjects": ["$$ROOT", {"$let": {"vars": {"i": at}, "in": holder}}]}}]
    reply = db.command(
        {
            "update": "codes",
            "updates": [{"q": q, "u": u, "multi": True}],
            "ordered": False,
            "writeConcern": {"w": "majority", "j": True},
        }
    )
    assert reply["nModified"] == len(batch), reply


def read(batch):
    """The candidates' codes, as `codes_by_id` reads them."""
    got = list(codes.find({"_id": {"$in": [i for i, _ in batch]}}))
    assert len(got) == len(batch)


def measure(take):
    """mongod's CPU ms per 1,000 codes: claiming BATCHES batches, then
    reading the same codes back."""
    work = [take() for _ in range(batches)]
    client.admin.command("fsync")
    out = {}
    for what, run in (("write", claim), ("read", read)):
        before = mongod_cpu()
        for b in work:
            run(b)
        out[what] = (mongod_cpu() - before) * 1000 / (batches * BATCH / 1000)
    return out


try:
    started = time.time()
    fill()
    by_pool = unissued()
    small = [p for p in by_pool if p != "one"]

    def one_pool():
        return [(by_pool["one"].pop(0), "one") for _ in range(BATCH)]

    def many_pools():
        batch = []
        while len(batch) < BATCH:
            p = random.choice(small)
            if by_pool[p]:
                batch.append((by_pool[p].pop(0), p))
        return batch

    print(f"{POOLS * PER_POOL * 2} codes ({POOLS} pools of {PER_POOL} and one of {POOLS * PER_POOL}) in {time.time() - started:.1f} s; {rounds} rounds of {batches} batches of {BATCH}")
    results = {"one pool": [], "many pools": []}
    sides = [("one pool", one_pool), ("many pools", many_pools)]
    for r in range(rounds):
        for side, take in sides if r % 2 == 0 else sides[::-1]:
            results[side].append(measure(take))
    median = {
        side: {what: statistics.median(r[what] for r in runs) for what in ("write", "read")}
        for side, runs in results.items()
    }
    for side, m in median.items():
        print(f"{side:>10}: write {m['write']:.1f} ms, read {m['read']:.1f} ms of mongod CPU per 1,000 codes")
    for what in ("write", "read"):
        each = [b[what] / a[what] for a, b in zip(results["one pool"], results["many pools"]) if a[what] > 0]
        base = median["one pool"][what]
        ratio = f"{median['many pools'][what] / base:.2f}x" if base > 0 else "n/a (under a tick)"
        print(f"many / one pool, {what}: {ratio} (rounds {', '.join(f'{x:.2f}' for x in each)})")
finally:
    client.drop_database(name)
