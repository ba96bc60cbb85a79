//! The `pools` collection: which pools exist and their settings. A pool
//! exists once it has held a code (an import creates it when its first code
//! lands) or once it was created on purpose (`codepool pool create`); a
//! purchase for any other pool is dead-lettered as `unknown_pool`, never
//! backordered forever.

use bson::{doc, DateTime};
use codepool_domain::{LookAlikeRule, PoolPolicy};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::{Store, StoreError};

pub const POOLS: &str = "pools";

/// A pool and its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolDoc {
    #[serde(rename = "_id")]
    pub name: String,
    pub created_at: DateTime,
    /// Publish `pool.low_stock` when unissued stock falls below this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_stock: Option<i64>,
    /// Prefix of grant numbers for this pool (default `G`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant_prefix: Option<String>,
    /// Set while stock is below `low_stock` and the alert has been sent.
    #[serde(default)]
    pub low_stock_alerted: bool,
    /// Orders one user may hold in this pool; absent or 0 is unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_user: Option<i64>,
    /// While true, purchases wait as backorders (`codepool pool pause`).
    #[serde(default)]
    pub paused: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<DateTime>,
    /// Codes of this pool differ by case on its platform: look-alikes fold
    /// by NFKC only (`codepool pool set --case-sensitive-codes`).
    #[serde(default)]
    pub case_sensitive_codes: bool,
    /// `O` reads as `0`, `I` and `L` as `1`: look-alikes fold them too, and
    /// a redemption finds the code however it was typed
    /// (`codepool pool set --fold-confusables`).
    #[serde(default)]
    pub fold_confusables: bool,
    /// Set by the first import: the look-alike rule (case, confusables)
    /// keys the codes, so it no longer changes.
    #[serde(default)]
    pub lookalike_fixed: bool,
    /// The largest share of the pool's stock (free plus held), in percent,
    /// one buyer may hold at once; absent is 10.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_share: Option<i64>,
    /// How many open holds one buyer may have; absent is 5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holds_per_uid: Option<i64>,
    /// The largest share of the pool's stock (free plus held), in percent,
    /// one API key, or one shop's keys together, may hold at once; absent
    /// is 50 for a shop and 100 for a key of no shop (the operator's own
    /// backend).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_share_per_owner: Option<i64>,
    /// How many codes of one order support may replace; absent is
    /// [`DEFAULT_REPLACEMENTS_PER_ORDER`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replacements_per_order: Option<i64>,
    /// Every code of the pool ends with a Crockford check symbol: set by a
    /// generation run with check symbols into an empty pool, cleared when
    /// any other codes land. A redemption by code refuses a code whose
    /// check fails in such a pool before it looks anything up.
    #[serde(default)]
    pub check_symbols: bool,
}

/// Replacements per order when a pool sets none.
pub const DEFAULT_REPLACEMENTS_PER_ORDER: u32 = 3;

/// The most replacements per order a pool may allow.
pub const MAX_REPLACEMENTS_PER_ORDER: u32 = 100;

fn rule_of(d: &bson::Document) -> LookAlikeRule {
    LookAlikeRule {
        case_sensitive: d.get_bool("case_sensitive_codes").unwrap_or(false),
        confusables: d.get_bool("fold_confusables").unwrap_or(false),
    }
}

impl PoolDoc {
    /// Which of the pool's codes read the same.
    pub fn lookalike_rule(&self) -> LookAlikeRule {
        LookAlikeRule {
            case_sensitive: self.case_sensitive_codes,
            confusables: self.fold_confusables,
        }
    }

    /// The pool's policy as the dispatcher applies it.
    /// See [`PoolDoc::hold_share`] (the field); 1 to 100.
    pub fn hold_share(&self) -> u32 {
        self.hold_share.map_or(10, |n| n.clamp(1, 100) as u32)
    }

    /// See [`PoolDoc::hold_share_per_owner`] (the field); 1 to 100, or
    /// `None` when the pool leaves it to the default.
    pub fn hold_share_per_owner(&self) -> Option<u32> {
        self.hold_share_per_owner.map(|n| n.clamp(1, 100) as u32)
    }

    /// See [`PoolDoc::replacements_per_order`] (the field); 0 to
    /// [`MAX_REPLACEMENTS_PER_ORDER`].
    pub fn replacements_per_order(&self) -> u32 {
        self.replacements_per_order
            .map_or(DEFAULT_REPLACEMENTS_PER_ORDER, |n| {
                n.clamp(0, i64::from(MAX_REPLACEMENTS_PER_ORDER)) as u32
            })
    }

    /// See [`PoolDoc::holds_per_uid`] (the field); at least 1.
    pub fn holds_per_uid(&self) -> u32 {
        self.holds_per_uid
            .map_or(5, |n| n.clamp(1, i64::from(u32::MAX)) as u32)
    }

    pub fn policy(&self) -> PoolPolicy {
        PoolPolicy {
            per_user: self
                .per_user
                .map_or(0, |n| u32::try_from(n.max(0)).unwrap_or(u32::MAX)),
            paused: self.paused,
        }
    }
}

impl Store {
    /// Creates the pool if it does not exist yet.
    pub async fn ensure_pool(&self, name: &str) -> Result<(), StoreError> {
        self.create_pool(name).await.map(|_| ())
    }

    /// Creates the pool if it does not exist yet; true when this call
    /// created it.
    pub async fn create_pool(&self, name: &str) -> Result<bool, StoreError> {
        let r = self
            .collection(POOLS)
            .update_one(
                doc! {"_id": name},
                doc! {"$setOnInsert": {"created_at": DateTime::now(), "low_stock_alerted": false}},
            )
            .upsert(true)
            .await?;
        Ok(r.upserted_id.is_some())
    }

    /// Says that every code of `pool` ends with a check symbol (true), or
    /// no longer (false). Creates the pool when it does not exist.
    pub async fn set_check_symbols(&self, pool: &str, on: bool) -> Result<(), StoreError> {
        self.ensure_pool(pool).await?;
        self.collection(POOLS)
            .update_one(
                doc! {"_id": pool, "check_symbols": {"$ne": on}},
                doc! {"$set": {"check_symbols": on}},
            )
            .await?;
        Ok(())
    }

    /// True when at least one code (of any status) belongs to `pool`.
    pub async fn pool_holds_codes(&self, pool: &str) -> Result<bool, StoreError> {
        Ok(self
            .collection(crate::collections::CODES)
            .find_one(doc! {"pool": pool})
            .projection(doc! {"_id": 1})
            .await?
            .is_some())
    }

    /// Which of `pool`'s codes read the same (the default for a pool that
    /// does not exist yet: an import creates it with the default).
    pub async fn lookalike_rule(&self, pool: &str) -> Result<LookAlikeRule, StoreError> {
        let d = self
            .collection(POOLS)
            .find_one(doc! {"_id": pool})
            .projection(doc! {"case_sensitive_codes": 1, "fold_confusables": 1})
            .await?;
        Ok(d.as_ref().map_or_else(LookAlikeRule::default, rule_of))
    }

    /// [`Store::lookalike_rule`], fixed from now on: an import calls this
    /// before it keys its codes, in one write with the read, so a setting
    /// cannot change the rule under a running import (the setting's update
    /// is conditional on the pool not being fixed).
    pub async fn fix_lookalike_rule(&self, pool: &str) -> Result<LookAlikeRule, StoreError> {
        let known = match self.fixed_rules.lock() {
            Ok(rules) => rules.get(pool).copied(),
            Err(_) => None,
        };
        if let Some(rule) = known {
            return Ok(rule);
        }
        let d = self
            .collection(POOLS)
            .find_one_and_update(doc! {"_id": pool}, doc! {"$set": {"lookalike_fixed": true}})
            .projection(doc! {"case_sensitive_codes": 1, "fold_confusables": 1})
            .write_concern(crate::durable())
            .await?;
        let Some(d) = d else {
            // No record yet: nothing is fixed, the next batch asks again.
            return Ok(LookAlikeRule::default());
        };
        let rule = rule_of(&d);
        if let Ok(mut rules) = self.fixed_rules.lock() {
            rules.insert(pool.to_owned(), rule);
        }
        Ok(rule)
    }

    pub async fn pool(&self, name: &str) -> Result<Option<PoolDoc>, StoreError> {
        Ok(self
            .typed::<PoolDoc>(POOLS)
            .find_one(doc! {"_id": name})
            .await?)
    }

    /// The pools of `names` that exist, in one query (a batch's pools).
    pub async fn pools_named(&self, names: &[&str]) -> Result<Vec<PoolDoc>, StoreError> {
        self.find_in(POOLS, "_id", names).await
    }

    /// A page of pools by name: up to `limit` after `after` (from the
    /// first when `None`), read along the `_id` index.
    pub async fn pools_page(
        &self,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<PoolDoc>, StoreError> {
        self.pools_page_of(after, limit, None).await
    }

    /// [`Store::pools_page`] of the pools in `only` (every pool when
    /// `None`): a shop's.
    pub async fn pools_page_of(
        &self,
        after: Option<&str>,
        limit: i64,
        only: Option<&[String]>,
    ) -> Result<Vec<PoolDoc>, StoreError> {
        let mut filter = match after {
            Some(a) => doc! {"_id": {"$gt": a}},
            None => doc! {},
        };
        if let Some(only) = only {
            let mut id = filter.get_document("_id").cloned().unwrap_or_default();
            id.insert("$in", only);
            filter.insert("_id", id);
        }
        Ok(self
            .typed::<PoolDoc>(POOLS)
            .find(filter)
            .sort(doc! {"_id": 1})
            .limit(limit.max(1))
            .await?
            .try_collect()
            .await?)
    }

    /// Up to `most` pools, in one reply: the whole catalogue when fewer
    /// come back.
    pub async fn pools_up_to(&self, most: usize) -> Result<Vec<PoolDoc>, StoreError> {
        Ok(self
            .typed::<PoolDoc>(POOLS)
            .find(doc! {})
            .limit(i64::try_from(most).unwrap_or(i64::MAX))
            .batch_size(crate::one_batch_for(most))
            .await?
            .try_collect()
            .await?)
    }

    pub async fn pools(&self) -> Result<Vec<PoolDoc>, StoreError> {
        Ok(self
            .typed::<PoolDoc>(POOLS)
            .find(doc! {})
            .sort(doc! {"_id": 1})
            .await?
            .try_collect()
            .await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(per_user: Option<i64>, paused: bool) -> PoolDoc {
        PoolDoc {
            name: "p".into(),
            created_at: DateTime::now(),
            low_stock: None,
            grant_prefix: None,
            low_stock_alerted: false,
            per_user,
            paused,
            paused_at: None,
            case_sensitive_codes: false,
            fold_confusables: false,
            lookalike_fixed: false,
            hold_share: None,
            holds_per_uid: None,
            hold_share_per_owner: None,
            replacements_per_order: None,
            check_symbols: false,
        }
    }

    #[test]
    fn a_pool_without_settings_has_no_policy() {
        assert!(!pool(None, false).policy().is_active());
        assert!(!pool(Some(0), false).policy().is_active());
        assert_eq!(pool(Some(3), true).policy().per_user, 3);
        assert!(pool(Some(3), true).policy().paused);
        assert_eq!(pool(Some(-1), false).policy().per_user, 0, "never negative");
    }

    #[test]
    fn an_old_pool_document_reads_as_active_and_unlimited() {
        let doc = doc! {"_id": "p", "created_at": DateTime::now()};
        let p: PoolDoc = bson::from_document(doc).unwrap();
        assert_eq!(p.policy(), PoolPolicy::default());
    }
}
