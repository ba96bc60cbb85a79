//! Inventory per pool, computed from MongoDB in two aggregations.

use std::collections::BTreeMap;

use bson::{doc, Bson, DateTime, Document};
use futures::TryStreamExt;
use serde::Serialize;

use crate::backorders::{BACKORDERS, WAITING};
use crate::codes::CODES;
use crate::{Store, StoreError};

/// Counts of one pool's codes and backorders.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct PoolStats {
    pub pool: String,
    pub unissued: u64,
    pub issued: u64,
    pub used: u64,
    pub void: u64,
    /// Unissued codes whose `expires_at` has passed (not yet voided).
    pub expired: u64,
    pub backorders_waiting: u64,
    pub issued_last_hour: u64,
    pub issued_last_day: u64,
}

fn as_u64(v: Option<&Bson>) -> u64 {
    match v {
        Some(Bson::Int32(n)) => *n as u64,
        Some(Bson::Int64(n)) => *n as u64,
        Some(Bson::Double(n)) => *n as u64,
        _ => 0,
    }
}

impl Store {
    /// Inventory of every pool (or one), sorted by name.
    pub async fn pool_stats(&self, pool: Option<&str>) -> Result<Vec<PoolStats>, StoreError> {
        let now = DateTime::now();
        let hour_ago = DateTime::from_millis(now.timestamp_millis() - 3_600_000);
        let day_ago = DateTime::from_millis(now.timestamp_millis() - 86_400_000);
        let mut stats: BTreeMap<String, PoolStats> = BTreeMap::new();
        for p in self.pools().await? {
            if pool.is_none_or(|x| x == p.name) {
                stats.insert(
                    p.name.clone(),
                    PoolStats {
                        pool: p.name,
                        ..PoolStats::default()
                    },
                );
            }
        }
        let matcher = match pool {
            Some(p) => doc! {"pool": p},
            None => doc! {},
        };
        let pipeline = vec![
            doc! {"$match": matcher.clone()},
            doc! {"$group": {
                "_id": "$pool",
                "unissued": {"$sum": {"$cond": [{"$and": [
                    {"$eq": ["$status", 0]},
                    {"$or": [{"$lte": ["$expires_at", null]}, {"$gt": ["$expires_at", now]}]}
                ]}, 1, 0]}},
                "expired": {"$sum": {"$cond": [{"$and": [
                    {"$eq": ["$status", 0]}, {"$gt": ["$expires_at", null]}, {"$lte": ["$expires_at", now]}
                ]}, 1, 0]}},
                "issued": {"$sum": {"$cond": [{"$eq": ["$status", 1]}, 1, 0]}},
                "used": {"$sum": {"$cond": [{"$eq": ["$status", 2]}, 1, 0]}},
                "void": {"$sum": {"$cond": [{"$eq": ["$status", 3]}, 1, 0]}},
                "hour": {"$sum": {"$cond": [{"$gte": ["$issued_at", hour_ago]}, 1, 0]}},
                "day": {"$sum": {"$cond": [{"$gte": ["$issued_at", day_ago]}, 1, 0]}},
            }},
        ];
        let rows: Vec<Document> = self
            .collection(CODES)
            .aggregate(pipeline)
            .await?
            .try_collect()
            .await?;
        for r in rows {
            let Ok(name) = r.get_str("_id") else { continue };
            let s = stats.entry(name.to_owned()).or_insert_with(|| PoolStats {
                pool: name.to_owned(),
                ..PoolStats::default()
            });
            s.unissued = as_u64(r.get("unissued"));
            s.expired = as_u64(r.get("expired"));
            s.issued = as_u64(r.get("issued"));
            s.used = as_u64(r.get("used"));
            s.void = as_u64(r.get("void"));
            s.issued_last_hour = as_u64(r.get("hour"));
            s.issued_last_day = as_u64(r.get("day"));
        }
        let mut waiting = matcher;
        waiting.insert("status", WAITING);
        let rows: Vec<Document> = self
            .collection(BACKORDERS)
            .aggregate(vec![
                doc! {"$match": waiting},
                doc! {"$group": {"_id": "$pool", "n": {"$sum": 1}}},
            ])
            .await?
            .try_collect()
            .await?;
        for r in rows {
            if let Some(s) = r.get_str("_id").ok().and_then(|n| stats.get_mut(n)) {
                s.backorders_waiting = as_u64(r.get("n"));
            }
        }
        Ok(stats.into_values().collect())
    }
}
