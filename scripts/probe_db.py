"""What the MongoDB probes in scripts/ share: the local server, a database
made by the project's migrations, and mongod's CPU time."""

import glob
import json
import os

from pymongo import MongoClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def client():
    """The server of MONGODB_URI, or the local one of `make services`."""
    return MongoClient(os.environ.get("MONGODB_URI", "mongodb://127.0.0.1:27017/?directConnection=true"))


def fresh(client, name):
    """Database `name`, dropped and made again by `migrations/`, as
    `codepool migrate` applies them (a `collMod` needs its collection)."""
    client.drop_database(name)
    db = client[name]
    db.create_collection("codes")
    for f in sorted(glob.glob(os.path.join(ROOT, "migrations/*.json"))):
        for cmd in json.load(open(f)):
            target = cmd.get("collMod")
            if target and target not in db.list_collection_names():
                db.create_collection(target)
            db.command(cmd)
    return db


def _mongod_pid():
    if "MONGOD_PID" in os.environ:
        return int(os.environ["MONGOD_PID"])
    pid_file = os.path.join(ROOT, ".services/mongo/mongod.pid")
    return int(open(pid_file).read().split()[0]) if os.path.exists(pid_file) else None


PID = _mongod_pid()


def mongod_cpu():
    """Seconds of CPU mongod has used (NaN without a pid to read): from
    MONGOD_PID, or the pid file of `make services`."""
    if not PID:
        return float("nan")
    fields = open(f"/proc/{PID}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
