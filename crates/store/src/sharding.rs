//! The shard key of every collection that grows with traffic: the one table
//! `deploy/mongodb/sharding.js` is checked against (the suite runs the
//! script with a stub `sh` and compares each `shardCollection` to this
//! list), and the one the suite's index and profiler tests read.
//!
//! The rules a key must keep, and why each key is what it is, are in
//! `docs/scaling.md`:
//! - every unique index of the collection starts with the whole key (a
//!   hashed key allows no unique index but `_id`'s);
//! - every write on the order path names the key's first field (an
//!   equality, or `$in` for a batch), so a `mongos` sends it to the shards
//!   that hold it and to no other.
//!
//! The collections not listed stay unsharded on the primary shard: their
//! size follows the number of pools, shops, operators or imports, not the
//! traffic.

/// How a key field is indexed for sharding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyField {
    /// Ranges of values: a range (one pool, one order's lines) stays on one
    /// shard, and zones can pin it.
    Range,
    /// Hashed values: inserts spread evenly; only an equality targets.
    Hashed,
}

/// One sharded collection and its key, field by field in order.
#[derive(Debug, Clone, Copy)]
pub struct ShardedCollection {
    pub collection: &'static str,
    pub key: &'static [(&'static str, KeyField)],
}

impl ShardedCollection {
    /// The key's first field: what a write must name to be targeted.
    pub fn first_field(&self) -> &'static str {
        self.key[0].0
    }

    /// True when the key is hashed (no unique index but `_id` is allowed).
    pub fn hashed(&self) -> bool {
        self.key.iter().any(|(_, f)| *f == KeyField::Hashed)
    }
}

use KeyField::{Hashed, Range};

/// Every sharded collection with its key. `deploy/mongodb/sharding.js`
/// shards exactly these, with exactly these keys.
pub const SHARDED: &[ShardedCollection] = &[
    // A pool's codes together: every claim, hold and move of a code names
    // its pool, and every unique rule of a code (its HMAC, its look-alike,
    // its order line) is a rule within one pool.
    ShardedCollection {
        collection: crate::collections::CODES,
        key: &[("pool", Range)],
    },
    // An order's backorder and replacements beside each other; both are
    // unique by order.
    ShardedCollection {
        collection: crate::backorders::BACKORDERS,
        key: &[("order_id", Range)],
    },
    ShardedCollection {
        collection: crate::replacements::REPLACEMENTS,
        key: &[("order_id", Range)],
    },
    // A hold is unique by (hold_id, owner), and named by it.
    ShardedCollection {
        collection: crate::holds::HOLDS,
        key: &[("hold_id", Range), ("owner", Range)],
    },
    // The guards of the rules that span pools or orders: each one's `_id`
    // is its rule. The redemption id (`{by, id}`) and the replacement id
    // (owner and id) by range, so one caller's ids sit together; the order
    // id hashed, so a launch's orders spread over every shard.
    ShardedCollection {
        collection: crate::redemptions::REDEMPTION_IDS,
        key: &[("_id", Range)],
    },
    ShardedCollection {
        collection: crate::replacements::REPLACEMENT_IDS,
        key: &[("_id", Range)],
    },
    ShardedCollection {
        collection: crate::order_ids::ORDER_IDS,
        key: &[("_id", Hashed)],
    },
    // One document per code's look-alike key (an HMAC): written by `_id`.
    ShardedCollection {
        collection: crate::claims::CODE_CLAIMS,
        key: &[("_id", Hashed)],
    },
    // Outboxes and records written once and found by `_id`: hashed, so
    // inserts spread over every shard.
    ShardedCollection {
        collection: crate::webhooks::TASKS,
        key: &[("_id", Hashed)],
    },
    ShardedCollection {
        collection: crate::webhooks::EVENTS,
        key: &[("_id", Hashed)],
    },
    ShardedCollection {
        collection: crate::webhooks::ATTEMPTS,
        key: &[("_id", Hashed)],
    },
    ShardedCollection {
        collection: crate::codes::SMS_OWED,
        key: &[("_id", Hashed)],
    },
    ShardedCollection {
        collection: crate::policies::USER_QUOTAS,
        key: &[("_id", Hashed)],
    },
    ShardedCollection {
        collection: crate::policies::REFUSALS,
        key: &[("_id", Hashed)],
    },
    ShardedCollection {
        collection: crate::audit::AUDIT,
        key: &[("_id", Hashed)],
    },
    // A marketplace's deals (one per reservation) and Kinguin's uploads:
    // one document per channel and marketplace id, every write by `_id`
    // (the uploader finds the upload due first by a read, then leases it
    // by `_id`).
    ShardedCollection {
        collection: crate::channels::CHANNEL_DEALS,
        key: &[("_id", Hashed)],
    },
    ShardedCollection {
        collection: crate::kinguin::KINGUIN_UPLOADS,
        key: &[("_id", Hashed)],
    },
];

/// The key of `collection`, when it is sharded.
pub fn shard_key(collection: &str) -> Option<&'static ShardedCollection> {
    SHARDED.iter().find(|s| s.collection == collection)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_collection_is_sharded_once() {
        let mut names: Vec<&str> = SHARDED.iter().map(|s| s.collection).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(names.len(), before);
        assert!(SHARDED.iter().all(|s| !s.key.is_empty()));
    }
}
