//! Ready to shard, proved the way a `mongos` decides: the operator's script
//! shards exactly the collections and keys the code declares
//! (`codepool_store::sharding::SHARDED`), every unique index of a sharded
//! collection starts with its key, and every write of the order path names
//! the key's first field (read from MongoDB's profiler).

use std::io::Write;
use std::process::{Command, Stdio};

use codepool_store::collections::CODES;
use codepool_store::sharding::{KeyField, SHARDED};
use futures::TryStreamExt;

use crate::common::TestEnv;
use crate::deploy::repo;

/// Where node is: on PATH, else Debian's.
fn node() -> std::path::PathBuf {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([std::path::PathBuf::from("/usr/bin")])
        .map(|d| d.join("node"))
        .find(|p| p.is_file())
        .expect("node is needed to check deploy/mongodb/sharding.js (apt-get install nodejs)")
}

/// A stub of mongosh's `db`, `sh` and `print`: every call the script makes
/// is printed as one JSON line.
const STUB: &str = r#"
var calls = [];
function record(name, args) { console.log(JSON.stringify({ call: name, args: args })); }
var print = function (s) { record("print", [String(s)]); };
function database(name) {
  return {
    getSiblingDB: function (n) {
      if (n === "config") return { collections: { findOne: function () { return null; } } };
      return database(n);
    },
    getCollectionInfos: function () { return []; },
    getCollection: function (c) {
      return { createIndex: function (k) { record("createIndex", [name + "." + c, k]); } };
    },
  };
}
var db = database("test");
var sh = {
  enableSharding: function (d) { record("enableSharding", [d]); },
  addShardToZone: function (s, z) { record("addShardToZone", [s, z]); },
  updateZoneKeyRange: function (ns, min, max, z) { record("updateZoneKeyRange", [ns, min, max, z]); },
  shardCollection: function (ns, key, unique) {
    if (arguments.length > 2) throw new Error("shardCollection with options: " + ns);
    record("shardCollection", [ns, key]);
  },
};
var dbName = "shardtest";
var zones = [{ zone: "partner-a", shard: "shard-a", pools: ["pa-1", "pa-2"] }];
"#;

/// Runs the script against the stub; returns its calls.
fn stub_run() -> Vec<serde_json::Value> {
    let script = std::fs::read_to_string(repo().join("deploy/mongodb/sharding.js"))
        .expect("deploy/mongodb/sharding.js");
    let mut child = Command::new(node())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("node runs");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(format!("{STUB}\n{script}").as_bytes())
        .expect("script written to node");
    drop(stdin);
    let out = child.wait_with_output().expect("node ends");
    assert!(
        out.status.success(),
        "sharding.js failed on the stub:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON call a line"))
        .collect()
}

/// A declared key as the script writes it: `{field: 1 | "hashed"}`.
fn declared_key(key: &[(&str, KeyField)]) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> = key
        .iter()
        .map(|(f, k)| {
            let v = match k {
                KeyField::Range => serde_json::json!(1),
                KeyField::Hashed => serde_json::json!("hashed"),
            };
            ((*f).to_owned(), v)
        })
        .collect();
    serde_json::Value::Object(map)
}

#[test]
fn the_sharding_script_parses_as_javascript() {
    let out = Command::new(node())
        .arg("--check")
        .arg(repo().join("deploy/mongodb/sharding.js"))
        .output()
        .expect("node runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_sharding_script_shards_exactly_the_declared_collections_on_their_keys() {
    let calls = stub_run();
    let of = |name: &str| -> Vec<&serde_json::Value> {
        calls
            .iter()
            .filter(|c| c["call"] == name)
            .map(|c| &c["args"])
            .collect()
    };
    assert_eq!(
        of("enableSharding"),
        vec![&serde_json::json!(["shardtest"])]
    );
    let sharded: Vec<(String, serde_json::Value)> = of("shardCollection")
        .into_iter()
        .map(|a| (a[0].as_str().unwrap_or_default().to_owned(), a[1].clone()))
        .collect();
    let declared: Vec<(String, serde_json::Value)> = SHARDED
        .iter()
        .map(|s| (format!("shardtest.{}", s.collection), declared_key(s.key)))
        .collect();
    // Order aside, the same collections on the same keys (JSON objects keep
    // their fields' order, so a key's field order counts).
    let mut a = sharded.clone();
    let mut b = declared.clone();
    a.sort_by(|x, y| x.0.cmp(&y.0));
    b.sort_by(|x, y| x.0.cmp(&y.0));
    for ((na, ka), (nb, kb)) in a.iter().zip(&b) {
        assert_eq!(na, nb, "script shards {a:?}\ncode declares {b:?}");
        assert_eq!(
            serde_json::to_string(ka).unwrap(),
            serde_json::to_string(kb).unwrap(),
            "{na}"
        );
    }
    assert_eq!(a.len(), b.len(), "script shards {a:?}\ncode declares {b:?}");
    // A hashed key gets its hashed index before the collection is sharded.
    for s in SHARDED.iter().filter(|s| s.hashed()) {
        let ns = format!("shardtest.{}", s.collection);
        assert!(
            of("createIndex").iter().any(|a| a[0] == ns.as_str()),
            "{ns}: no hashed index"
        );
    }
    // The zone example pins each pool of the partner to its shard.
    assert_eq!(
        of("addShardToZone"),
        vec![&serde_json::json!(["shard-a", "partner-a"])]
    );
    let ranges = of("updateZoneKeyRange");
    assert_eq!(ranges.len(), 2);
    assert_eq!(ranges[0][0], "shardtest.codes");
    assert_eq!(ranges[0][1], serde_json::json!({"pool": "pa-1"}));
    assert_eq!(ranges[0][2], serde_json::json!({"pool": "pa-1\u{0}"}));
}

/// The fields of an index key, in order.
fn key_fields(key: &bson::Document) -> Vec<String> {
    key.keys().cloned().collect()
}

#[tokio::test]
async fn every_unique_index_of_a_sharded_collection_starts_with_its_shard_key() {
    let env = TestEnv::new("shard_unique").await;
    let mut offenders = Vec::new();
    for s in SHARDED {
        let key: Vec<String> = s.key.iter().map(|(f, _)| (*f).to_owned()).collect();
        let indexes: Vec<mongodb::IndexModel> = match env.coll(s.collection).list_indexes().await {
            Ok(c) => c.try_collect().await.expect("indexes"),
            // Not created yet: no index but `_id`'s.
            Err(_) => continue,
        };
        for ix in indexes {
            let unique = ix.options.as_ref().and_then(|o| o.unique).unwrap_or(false);
            let name = ix
                .options
                .as_ref()
                .and_then(|o| o.name.clone())
                .unwrap_or_default();
            if !unique || name == "_id_" {
                continue;
            }
            let fields = key_fields(&ix.keys);
            let starts = !s.hashed() && fields.len() >= key.len() && fields[..key.len()] == key[..];
            if !starts {
                offenders.push(format!(
                    "{}.{name} {:?} does not start with the shard key {:?}",
                    s.collection, fields, key
                ));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "a sharded cluster refuses these unique indexes:\n{}",
        offenders.join("\n")
    );
    env.cleanup().await;
}

/// The comment the checker's own reads carry: they read the whole history
/// (every code of the run), which is the test's work, not codepool's.
pub const HARNESS: &str = "checker-harness";

/// The profiler's own collection, made large enough for a whole mix.
const PROFILE_BYTES: i64 = 512 << 20;

/// Turns MongoDB's profiler on for `env`'s database, recording every write
/// (update, delete, findAndModify) to a sharded collection, and every
/// operation that scans the whole of `codes` (no index: on a pool of
/// millions, one such read per claim batch is the whole collection each
/// time). A filter keeps other reads out, so a run of the whole mix fits in
/// the capped collection.
pub async fn profile_writes(env: &TestEnv) {
    let db = env.store.database();
    db.run_command(bson::doc! {"profile": 0})
        .await
        .expect("profiler off");
    let _ = db
        .collection::<bson::Document>("system.profile")
        .drop()
        .await;
    db.run_command(bson::doc! {"create": "system.profile", "capped": true, "size": PROFILE_BYTES})
        .await
        .expect("system.profile created");
    let sharded: Vec<String> = SHARDED
        .iter()
        .map(|s| format!("{}.{}", env.db, s.collection))
        .collect();
    db.run_command(bson::doc! {
        "profile": 1,
        "filter": {
            "$or": [
                {"ns": {"$in": &sharded}, "op": {"$in": ["update", "remove"]}},
                {"ns": {"$in": &sharded}, "command.findAndModify": {"$exists": true}},
                {"ns": {"$in": &sharded}, "command.findandmodify": {"$exists": true}},
                {
                    "ns": format!("{}.{}", env.db, CODES),
                    "planSummary": "COLLSCAN",
                    "command.comment": {"$ne": HARNESS},
                    "originatingCommand.comment": {"$ne": HARNESS},
                },
            ],
        },
    })
    .await
    .expect("profiler on");
}

/// True when `filter` names `field` as an equality or an `$in`/`$eq` at its
/// top level: what a `mongos` targets on.
fn names_field(filter: &bson::Document, field: &str) -> bool {
    match filter.get(field) {
        None => false,
        Some(bson::Bson::Document(d)) if d.keys().any(|k| k.starts_with('$')) => {
            d.keys().all(|k| k == "$in" || k == "$eq")
        }
        Some(_) => true,
    }
}

/// What a whole-collection scan was: its command and the fields it
/// matched on (a `find`'s filter, an aggregation's first `$match`, a
/// count's query), values left out.
fn scan_shape(command: &bson::Document) -> String {
    let name = command.keys().next().cloned().unwrap_or_default();
    let first_match = || {
        command
            .get_array("pipeline")
            .ok()?
            .first()?
            .as_document()?
            .get_document("$match")
            .ok()
    };
    let matched = (command.get_document("filter").ok())
        .or_else(|| command.get_document("query").ok())
        .or_else(first_match);
    let fields: Vec<&str> = matched.map_or(Vec::new(), |m| m.keys().map(String::as_str).collect());
    format!("{name} on {fields:?}")
}

/// The writes the profiler saw on sharded collections whose filter lacks
/// the key's first field, and the operations that scanned the whole of
/// `codes`, one line each (collection, op, filter), counted by shape.
/// Fails when the profiler saw no write at all.
pub async fn untargeted_writes(env: &TestEnv) -> Vec<String> {
    let db = env.store.database();
    db.run_command(bson::doc! {"profile": 0})
        .await
        .expect("profiler off");
    let entries: Vec<bson::Document> = db
        .collection::<bson::Document>("system.profile")
        .find(bson::doc! {})
        .await
        .expect("profile read")
        .try_collect()
        .await
        .expect("profile read");
    assert!(!entries.is_empty(), "the profiler saw no write");
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    let mut counted = std::collections::BTreeMap::<String, usize>::new();
    for e in &entries {
        let ns = e.get_str("ns").unwrap_or_default();
        let coll = ns.split_once('.').map_or(ns, |(_, c)| c);
        let Some(s) = SHARDED.iter().find(|s| s.collection == coll) else {
            continue;
        };
        let op = e.get_str("op").unwrap_or_default();
        let Ok(command) = e.get_document("command") else {
            continue;
        };
        let filter = match op {
            "update" | "remove" => command.get_document("q").ok(),
            _ => command.get_document("query").ok(),
        };
        if e.get_str("planSummary") == Ok("COLLSCAN") {
            let line = format!(
                "{coll} {op} scanned the whole collection: {}",
                scan_shape(command)
            );
            *seen.entry(line).or_default() += 1;
            continue;
        }
        *counted.entry(format!("{coll} {op}")).or_default() += 1;
        let Some(filter) = filter else { continue };
        if !names_field(filter, s.first_field()) {
            let shape: Vec<&str> = filter.keys().map(String::as_str).collect();
            let line = format!("{coll} {op} without {}: {shape:?}", s.first_field());
            *seen.entry(line).or_default() += 1;
        }
    }
    eprintln!("sharding: writes profiled: {counted:?}");
    seen.into_iter()
        .map(|(line, n)| format!("{line} ({n}×)"))
        .collect()
}

#[tokio::test]
async fn every_write_of_the_mix_names_its_shard_key() {
    let seed = crate::checker::seed();
    let (violations, untargeted) = crate::checker::run_mix(seed, 20, true).await;
    assert!(
        untargeted.is_empty(),
        "seed {seed}: writes a mongos would send to every shard, or scans of all of codes:\n{}",
        untargeted.join("\n")
    );
    assert!(
        violations.is_empty(),
        "seed {seed} broke {} invariant(s):\n{}",
        violations.len(),
        violations.join("\n")
    );
}
