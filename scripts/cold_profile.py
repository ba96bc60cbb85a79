"""Reads what scripts/cold-profile.sh recorded: each side's CPU samples, by
process and, for mongod, by operation, per 1,000 purchases.

    python3 scripts/cold_profile.py OUT_DIR

OUT_DIR holds perf.data (the whole run, CLOCK_MONOTONIC), starts.txt (when
each side started dispatching) and the bench's JSON (how long each ran).
A process is named by the threads perf saw in it; mongod's samples are
sorted by the first operation their stack shows, in the order below.
"""

import collections
import glob
import json
import subprocess
import sys

out = sys.argv[1]
HZ = 499  # perf record -F in cold-profile.sh

# (operation, any frame containing this marks it), first match wins: the
# claim's write (split into its index maintenance, the lookups of the
# documents it updates, and the pipeline that builds each new document),
# reads, counts and candidate reads (aggregate), the rest.
MONGOD_OPS = [
    ("claim write: index entries", "IndexCatalogImpl::updateRecord"),
    ("claim write: index entries", "IndexCatalogImpl::_updateRecord"),
    ("claim write: oplog", "OpObserver"),
    ("claim write: new document", "UpdateStage::transformAndUpdate"),
    ("claim write: finding its documents", "UpdateStage::doWork"),
    ("claim write: other", "performUpdates"),
    ("find (codes read by id, orders, candidate windows)", "FindCmd"),
    ("find (codes read by id, orders, candidate windows)", "GetMoreCmd"),
    ("aggregate (stock counts, candidate reads)", "runAggregate"),
    ("aggregate (stock counts, candidate reads)", "DocumentSource"),
    ("journal and checkpoint", "__wt_log"),
    ("journal and checkpoint", "checkpoint"),
    ("cache eviction", "__evict"),
    ("network", "transport::"),
]
NAMES = {"codepool-bench": "dispatcher (codepool-bench)", "mongod": "mongod", "redis-server": "redis", "beam.smp": "rabbitmq"}


def sides():
    starts = {}
    with open(f"{out}/starts.txt") as f:
        for line in f:
            ts, tag = line.split()
            starts[tag.rstrip("0123456789")] = float(ts)
    (result,) = glob.glob(f"{out}/dispatch-pools-*-cold.json")
    data = json.load(open(result))
    for r in data["rounds"][0]["results"]:
        yield r["name"], starts[r["name"]], r["settled_seconds"], data["purchases"]


def samples(start, seconds):
    """(process id, thread name, stack) of every sample in the window."""
    text = subprocess.run(
        ["perf", "script", "-i", f"{out}/perf.data", "-F", "pid,comm,ip,sym", "--time", f"{start:.6f},{start + seconds:.6f}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for block in text.split("\n\n"):
        lines = [l for l in block.splitlines() if l.strip()]
        if not lines:
            continue
        head = lines[0].split()
        comm, pid = " ".join(head[:-1]), head[-1]
        stack = [l.strip().split(None, 1)[-1] for l in lines[1:]]
        yield pid, comm, stack


def mongod_op(stack):
    for name, key in MONGOD_OPS:
        if any(key in f for f in stack):
            return name
    return "other"


def profile(start, seconds):
    by_pid = collections.defaultdict(list)
    for pid, comm, stack in samples(start, seconds):
        by_pid[pid].append((comm, stack))
    procs, ops = collections.Counter(), collections.Counter()
    for pid, got in by_pid.items():
        comms = {c for c, _ in got}
        name = next((NAMES[c] for c in comms if c in NAMES), "idle" if pid == "0" else "other")
        if any(c.startswith("conn") or c.startswith("WT") for c in comms) and name == "other":
            name = "mongod"
        if any(c.endswith("_scheduler") for c in comms) and name == "other":
            name = "rabbitmq"
        procs[name] += len(got)
        if name == "mongod":
            ops.update(mongod_op(s) for _, s in got)
    return procs, ops


results = {}
for name, start, seconds, purchases in sides():
    procs, ops = profile(start, seconds)
    results[name] = (procs, ops, purchases / 1000)
one, many = results["single"], results["many"]


def row(label, a, b):
    x, y = a / one[2] / HZ * 1000, b / many[2] / HZ * 1000
    print(f"  {label:<52} {x:7.1f} {y:7.1f} {y - x:+7.1f}")


print("CPU ms per 1,000 purchases        (one pool, many pools, difference)")
busy = lambda p: sum(v for k, v in p.items() if k != "idle")
row("all processes", busy(one[0]), busy(many[0]))
for k in sorted(set(one[0]) | set(many[0]), key=lambda k: -many[0][k]):
    row(k, one[0][k], many[0][k])
print("mongod by operation")
for k in sorted(set(one[1]) | set(many[1]), key=lambda k: -(many[1][k] / many[2] - one[1][k] / one[2])):
    row(k, one[1][k], many[1][k])
