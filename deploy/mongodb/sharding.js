// Shards codepool's database. Run it with mongosh on a mongos, after
// `codepool migrate` has created the collections and their indexes:
//
//   mongosh "mongodb://MONGOS:27017" --eval 'var dbName = "codepool"' deploy/mongodb/sharding.js
//
// Optional, before the file: `var zones = [{zone, shard, pools: [...]}]`
// pins pools to a shard (a partner's pools on the shard in its region, a
// big shop's pools on a shard of their own). Without it, one example zone
// is created with no pools in it, and the balancer places every pool.
//
// Safe to run again: a collection already sharded is left as it is.
// Every key below is the one in crates/store/src/sharding.rs (the suite
// runs this file against a stub `sh` and compares); docs/scaling.md says
// why each key is what it is.

/* global db, sh, print */
var dbName = typeof dbName === "string" ? dbName : "codepool";
var zones = typeof zones === "object" && zones !== null ? zones : [
  // Example: a partner's pools on one shard. Name your shards (sh.status()).
  { zone: "partner-a", shard: null, pools: [] },
];

// The collections that grow with traffic, and their keys.
var shardKeys = [
  // A pool's codes together: every write of a code names its pool, and every
  // unique rule of a code is a rule within one pool.
  { coll: "codes", key: { pool: 1 } },
  // An order's backorder and replacements by order: both are unique by order.
  { coll: "backorders", key: { order_id: 1 } },
  { coll: "replacements", key: { order_id: 1 } },
  // A hold is unique by (hold_id, owner), and named by it.
  { coll: "holds", key: { hold_id: 1, owner: 1 } },
  // The guards of the rules that span pools or orders: each one's _id is its
  // rule. Redemption ids ({by, id}) and replacement ids (owner and id) by
  // range; order ids hashed, so a launch's orders spread.
  { coll: "redemption_ids", key: { _id: 1 } },
  { coll: "replacement_ids", key: { _id: 1 } },
  { coll: "order_ids", key: { _id: "hashed" } },
  // One document per code's look-alike key (an HMAC), written by _id.
  { coll: "code_claims", key: { _id: "hashed" } },
  // Outboxes and records found by _id: hashed, so inserts spread.
  { coll: "webhook_tasks", key: { _id: "hashed" } },
  { coll: "webhook_events", key: { _id: "hashed" } },
  { coll: "webhook_attempts", key: { _id: "hashed" } },
  { coll: "sms_owed", key: { _id: "hashed" } },
  { coll: "user_quotas", key: { _id: "hashed" } },
  { coll: "refusals", key: { _id: "hashed" } },
  { coll: "audit", key: { _id: "hashed" } },
  // A marketplace's deals and Kinguin's uploads, written by _id.
  { coll: "channel_deals", key: { _id: "hashed" } },
  { coll: "kinguin_uploads", key: { _id: "hashed" } },
];

var target = db.getSiblingDB(dbName);
sh.enableSharding(dbName);

// Zones first, so the pinned pools' chunks are created where they belong.
zones.forEach(function (z) {
  if (z.shard) {
    sh.addShardToZone(z.shard, z.zone);
  }
  (z.pools || []).forEach(function (pool) {
    // One pool is the range [pool, pool + "\u0000"): all of its codes.
    sh.updateZoneKeyRange(dbName + ".codes", { pool: pool }, { pool: pool + "\u0000" }, z.zone);
  });
});

shardKeys.forEach(function (s) {
  var ns = dbName + "." + s.coll;
  var info = target.getCollectionInfos({ name: s.coll });
  if (!info || info.length === 0) {
    // sh.shardCollection creates it; codepool's migrations add its indexes.
    print("creating " + ns);
  }
  var existing = target.getSiblingDB("config").collections.findOne({ _id: ns, dropped: { $ne: true } });
  if (existing && existing.key) {
    print(ns + " is already sharded on " + JSON.stringify(existing.key));
    return;
  }
  // A hashed key needs its hashed index on a collection that has documents;
  // each ranged key is the prefix of an index codepool's migrations create.
  if (Object.keys(s.key).some(function (f) { return s.key[f] === "hashed"; })) {
    target.getCollection(s.coll).createIndex(s.key);
  }
  sh.shardCollection(ns, s.key);
  print("sharded " + ns + " on " + JSON.stringify(s.key));
});
