"""What encryption at rest costs MongoDB on import: raw `insert_many` of the
plaintext documents `codepool bench import` uses as its baseline, beside
documents shaped as codepool stores them (sealed code, key id and HMAC),
with and without the collection's validator. Each side gets a fresh
collection with the indexes and validator of `migrations/`; two rounds.

    .services/venv/bin/python scripts/insert_probe.py [CODES]

Default 200,000 codes, unordered batches of 1,000, three in flight,
w:majority, j:true. Prints wall time and mongod's CPU (from its pid file
under .services/mongo, when there is one). MONGODB_URI overrides the server.
"""

import datetime
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bson import Binary, Int64, ObjectId
from pymongo.write_concern import WriteConcern

from probe_db import client as connect, fresh, mongod_cpu

n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
client = connect()
name = f"insert_probe_{os.getpid()}"
now = datetime.datetime.now(datetime.timezone.utc)


def plain(i, batch):
    code = "BN%04X-%011d" % ((i * 2_654_435_761) & 0xFFFF, i)
    return {"_id": ObjectId(), "pool": "p", "code": code, "status": 0, "seq": Int64(i + 1),
            "batch_id": batch, "created_at": now, "is_sms": 0}


def sealed(i, batch):
    # 24-byte nonce + 18-byte code + 16-byte tag; 32-byte HMAC.
    return {"_id": ObjectId(), "pool": "p", "code_enc": Binary(os.urandom(58)), "key_id": "k1",
            "code_hmac": Binary(os.urandom(32)), "status": 0, "seq": Int64(i + 1),
            "batch_id": batch, "created_at": now, "is_sms": 0}


def run(label, make, bypass):
    coll = fresh(client, name).get_collection("codes", write_concern=WriteConcern(w="majority", j=True))
    batch = ObjectId()
    docs = [make(i, batch) for i in range(n)]
    chunks = [docs[i:i + 1000] for i in range(0, n, 1000)]
    cpu, started = mongod_cpu(), time.time()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda c: coll.insert_many(c, ordered=False, bypass_document_validation=bypass), chunks))
    wall = time.time() - started
    print(f"{label:32s} {wall:6.2f} s {n / wall:9,.0f}/s  mongod CPU {mongod_cpu() - cpu:5.2f} s")


try:
    for _ in range(2):
        run("plaintext, validator bypassed", plain, True)
        run("sealed, validated", sealed, False)
        run("sealed, validator bypassed", sealed, True)
finally:
    client.drop_database(name)
