//! A pool's operator settings (low-stock threshold, grant-number prefix) and
//! the low-stock alert state that makes `pool.low_stock` fire once per
//! crossing, not once per claim, however many dispatchers watch the pool.
//!
//! The state is one boolean on the pool document, `low_stock_alerted`. The
//! dispatcher that flips it from false to true (a conditional update, so at
//! most one wins) publishes the event; whoever sees stock back at or above
//! the threshold flips it back (re-arms), and counts the crossing
//! (`low_stock_crossings`): the webhook events of a crossing are named by
//! it, so a crossing told again (its alert given back after a failed
//! publish) is the same event.
//!
//! `pool.exhausted` has a latch of the same kind, `exhausted_alerted`:
//! raised by the one claimer (of any process, through either door) that
//! flips it when an order finds the pool short, re-armed when codes come
//! in (an import, held codes back in stock), which counts the exhaustion
//! (`exhaustions`) and notes when (`exhausted_rearmed_at`). A shortage
//! seen before codes came in raises nothing: it may be over.

use std::ops::RangeInclusive;

use bson::doc;
use mongodb::options::ReturnDocument;

use crate::pools::POOLS;
use crate::{durable, Store, StoreError};

/// Longest grant-number prefix: grant numbers are prefix + date + counter
/// and end up on receipts, so they stay short.
pub const MAX_GRANT_PREFIX_LEN: usize = 16;

/// What an operator may change about a pool. `None` leaves a setting as it is.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PoolSettings {
    /// Alert when unissued stock falls below this (0 turns alerts off).
    pub low_stock: Option<i64>,
    pub grant_prefix: Option<String>,
    /// Orders one user may hold in the pool (0: unlimited).
    pub per_user: Option<i64>,
    /// The pool's platform tells `ABC` from `abc`: look-alike codes fold by
    /// NFKC only, not by case. Fixed once the pool holds a code.
    pub case_sensitive_codes: Option<bool>,
    /// `O` reads as `0`, `I` and `L` as `1`: look-alike codes fold them
    /// too. Fixed once the pool holds a code.
    pub fold_confusables: Option<bool>,
    /// The largest share of the pool's stock (free plus held), in percent,
    /// one buyer may hold at once: 1 to 100.
    pub hold_share: Option<i64>,
    /// Open holds one buyer may have: 1 or more.
    pub holds_per_uid: Option<i64>,
    /// The largest share of the pool's stock, in percent, one key or one
    /// shop may hold at once: 1 to 100.
    pub hold_share_per_owner: Option<i64>,
    /// How many codes of one order support may replace: 0 (none) to 100.
    pub replacements_per_order: Option<i64>,
}

/// One setting of a pool. Each door names it in its own words: the CLI's
/// flag, the HTTP API's JSON field, the console's label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    LowStock,
    GrantPrefix,
    PerUser,
    CaseSensitiveCodes,
    FoldConfusables,
    HoldShare,
    HoldsPerUid,
    HoldSharePerOwner,
    ReplacementsPerOrder,
}

impl Setting {
    pub const ALL: [Setting; 9] = [
        Setting::LowStock,
        Setting::GrantPrefix,
        Setting::PerUser,
        Setting::CaseSensitiveCodes,
        Setting::FoldConfusables,
        Setting::HoldShare,
        Setting::HoldsPerUid,
        Setting::HoldSharePerOwner,
        Setting::ReplacementsPerOrder,
    ];

    /// The name in JSON (the HTTP API, the audit record).
    pub fn field(self) -> &'static str {
        match self {
            Setting::LowStock => "low_stock",
            Setting::GrantPrefix => "grant_prefix",
            Setting::PerUser => "per_user",
            Setting::CaseSensitiveCodes => "case_sensitive_codes",
            Setting::FoldConfusables => "fold_confusables",
            Setting::HoldShare => "hold_share",
            Setting::HoldsPerUid => "holds_per_uid",
            Setting::HoldSharePerOwner => "hold_share_per_owner",
            Setting::ReplacementsPerOrder => "replacements_per_order",
        }
    }

    /// The CLI's flag (`codepool pool set`).
    pub fn flag(self) -> &'static str {
        match self {
            Setting::LowStock => "--low-stock",
            Setting::GrantPrefix => "--grant-prefix",
            Setting::PerUser => "--per-user",
            Setting::CaseSensitiveCodes => "--case-sensitive-codes",
            Setting::FoldConfusables => "--fold-confusables",
            Setting::HoldShare => "--hold-share",
            Setting::HoldsPerUid => "--holds-per-uid",
            Setting::HoldSharePerOwner => "--hold-share-per-owner",
            Setting::ReplacementsPerOrder => "--replacements-per-order",
        }
    }

    /// Words for a sentence (the console, logs).
    pub fn label(self) -> &'static str {
        match self {
            Setting::LowStock => "the low-stock threshold",
            Setting::GrantPrefix => "the grant prefix",
            Setting::PerUser => "codes per user",
            Setting::CaseSensitiveCodes => "whether codes are case-sensitive",
            Setting::FoldConfusables => "whether O reads as 0, and I and L as 1",
            Setting::HoldShare => "the share of stock one buyer may hold (percent)",
            Setting::HoldsPerUid => "open holds per buyer",
            Setting::HoldSharePerOwner => "the share of stock one key or shop may hold (percent)",
            Setting::ReplacementsPerOrder => "replacements per order",
        }
    }
}

/// Why settings were not changed. The setting, the value and the rule are
/// data ([`PoolSettingsError::setting`], [`PoolSettingsError::rule`]); the
/// `Display` is a sentence in neutral words, and each door may name the
/// setting its own way instead.
#[derive(Debug, thiserror::Error)]
pub enum PoolSettingsError {
    #[error("pool {0:?} does not exist; import codes into it first with `codepool import FILE --pool {0}`")]
    UnknownPool(String),
    #[error("the low-stock threshold {}", self.rule().unwrap_or_default())]
    NegativeThreshold(i64),
    #[error("the grant prefix {}", self.rule().unwrap_or_default())]
    BadPrefix(String),
    #[error("codes per user {}", self.rule().unwrap_or_default())]
    NegativePerUser(i64),
    #[error("{} {}", Setting::HoldShare.label(), self.rule().unwrap_or_default())]
    BadHoldShare(i64),
    #[error("{} {}", Setting::HoldsPerUid.label(), self.rule().unwrap_or_default())]
    BadHoldsPerUid(i64),
    #[error("{} {}", Setting::HoldSharePerOwner.label(), self.rule().unwrap_or_default())]
    BadHoldSharePerOwner(i64),
    #[error("{} {}", Setting::ReplacementsPerOrder.label(), self.rule().unwrap_or_default())]
    BadReplacementsPerOrder(i64),
    #[error("nothing to change; give at least one setting")]
    Nothing,
    #[error("pool {pool:?} holds codes already, and {} decides which of them are look-alikes; it cannot change now. Set it on a new pool before its first import (`codepool pool create --pool NEW`, then `codepool pool set --pool NEW {} true`)", .setting.label(), .setting.flag())]
    CaseRuleFixed { pool: String, setting: Setting },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl PoolSettingsError {
    /// The setting at fault, if one is.
    pub fn setting(&self) -> Option<Setting> {
        match self {
            Self::NegativeThreshold(_) => Some(Setting::LowStock),
            Self::BadPrefix(_) => Some(Setting::GrantPrefix),
            Self::NegativePerUser(_) => Some(Setting::PerUser),
            Self::CaseRuleFixed { setting, .. } => Some(*setting),
            Self::BadHoldShare(_) => Some(Setting::HoldShare),
            Self::BadHoldsPerUid(_) => Some(Setting::HoldsPerUid),
            Self::BadHoldSharePerOwner(_) => Some(Setting::HoldSharePerOwner),
            Self::BadReplacementsPerOrder(_) => Some(Setting::ReplacementsPerOrder),
            _ => None,
        }
    }

    /// What the value must be, after the setting's name ("must be 0 (off)
    /// or more, not -1"), for a value that breaks a rule.
    pub fn rule(&self) -> Option<String> {
        match self {
            Self::NegativeThreshold(n) => Some(format!("must be 0 (off) or more, not {n}")),
            Self::BadPrefix(p) => Some(format!(
                "{p:?} is not usable: use 1 to {MAX_GRANT_PREFIX_LEN} letters or digits, e.g. GX"
            )),
            Self::NegativePerUser(n) => Some(format!("must be 0 (unlimited) or more, not {n}")),
            Self::BadHoldShare(n) | Self::BadHoldSharePerOwner(n) => {
                Some(format!("must be 1 to 100, not {n}"))
            }
            Self::BadHoldsPerUid(n) => Some(format!("must be 1 or more, not {n}")),
            Self::BadReplacementsPerOrder(n) => Some(format!(
                "must be 0 (none) to {}, not {n}",
                crate::pools::MAX_REPLACEMENTS_PER_ORDER
            )),
            _ => None,
        }
    }

    /// The error in a door's words: `name` names a setting (its flag, its
    /// field); `choices` lists what may be given when nothing was.
    pub fn in_words(&self, name: impl Fn(Setting) -> String) -> String {
        match (self.setting(), self.rule()) {
            (Some(s), Some(rule)) => format!("{} {rule}", name(s)),
            _ if matches!(self, Self::Nothing) => {
                let all: Vec<String> = Setting::ALL.into_iter().map(name).collect();
                format!("nothing to change; give any of {}", all.join(", "))
            }
            _ => self.to_string(),
        }
    }
}

/// A numeric setting: its field, the value asked, the values allowed, and
/// the refusal of any other.
type Ranged = (
    &'static str,
    Option<i64>,
    RangeInclusive<i64>,
    fn(i64) -> PoolSettingsError,
);

/// The settings that need no look at the pool, checked, as a `$set`.
fn plain_settings(settings: &PoolSettings) -> Result<bson::Document, PoolSettingsError> {
    let mut set = doc! {};
    if let Some(n) = settings.low_stock {
        if n < 0 {
            return Err(PoolSettingsError::NegativeThreshold(n));
        }
        set.insert("low_stock", n);
        set.insert("low_stock_alerted", false);
    }
    if let Some(p) = &settings.grant_prefix {
        if !valid_grant_prefix(p) {
            return Err(PoolSettingsError::BadPrefix(p.chars().take(40).collect()));
        }
        set.insert("grant_prefix", p);
    }
    let most = i64::from(crate::pools::MAX_REPLACEMENTS_PER_ORDER);
    let ranged: [Ranged; 5] = [
        (
            "per_user",
            settings.per_user,
            0..=i64::from(u32::MAX),
            PoolSettingsError::NegativePerUser,
        ),
        (
            "hold_share",
            settings.hold_share,
            1..=100,
            PoolSettingsError::BadHoldShare,
        ),
        (
            "holds_per_uid",
            settings.holds_per_uid,
            1..=i64::from(u32::MAX),
            PoolSettingsError::BadHoldsPerUid,
        ),
        (
            "hold_share_per_owner",
            settings.hold_share_per_owner,
            1..=100,
            PoolSettingsError::BadHoldSharePerOwner,
        ),
        (
            "replacements_per_order",
            settings.replacements_per_order,
            0..=most,
            PoolSettingsError::BadReplacementsPerOrder,
        ),
    ];
    for (field, value, allowed, bad) in ranged {
        let Some(n) = value else { continue };
        if !allowed.contains(&n) {
            return Err(bad(n));
        }
        set.insert(field, n);
    }
    Ok(set)
}

/// Checks a grant-number prefix: ASCII letters and digits only.
pub fn valid_grant_prefix(p: &str) -> bool {
    (1..=MAX_GRANT_PREFIX_LEN).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_alphanumeric())
}

impl Store {
    /// Changes a pool's settings. A new threshold re-arms the alert, so the
    /// next stock check judges the pool against it afresh.
    pub async fn set_pool_settings(
        &self,
        pool: &str,
        settings: &PoolSettings,
    ) -> Result<(), PoolSettingsError> {
        let mut set = plain_settings(settings)?;
        // A new threshold: the next crossing is a new one.
        let count = settings.low_stock.is_some();
        let lookalike = self.lookalike_settings(pool, settings).await?;
        let fixing = !lookalike.is_empty();
        set.extend(lookalike);
        if set.is_empty() {
            // A look-alike rule the pool has already changes nothing.
            let asked = settings.case_sensitive_codes.or(settings.fold_confusables);
            return match asked {
                Some(_) => Ok(()),
                None => Err(PoolSettingsError::Nothing),
            };
        }
        let mut update = doc! {"$set": set};
        if count {
            update.insert("$inc", doc! {"low_stock_crossings": 1_i64});
        }
        // The look-alike rule changes only while no import has fixed it
        // (see [`Store::fix_lookalike_rule`]): one conditional update, so a
        // setting and an import racing cannot both win.
        let mut filter = doc! {"_id": pool};
        if fixing {
            filter.insert("lookalike_fixed", doc! {"$ne": true});
        }
        let r = self
            .collection(POOLS)
            .update_one(filter, update)
            .write_concern(durable())
            .await
            .map_err(StoreError::from)?;
        if r.matched_count == 0 {
            return Err(match (fixing, self.pool(pool).await?) {
                (true, Some(_)) => PoolSettingsError::CaseRuleFixed {
                    pool: pool.to_owned(),
                    setting: Setting::CaseSensitiveCodes,
                },
                _ => PoolSettingsError::UnknownPool(pool.to_owned()),
            });
        }
        Ok(())
    }

    /// The look-alike settings that change the pool's rule: a value equal
    /// to the pool's is no change. A change is refused once the pool holds
    /// a code.
    async fn lookalike_settings(
        &self,
        pool: &str,
        settings: &PoolSettings,
    ) -> Result<bson::Document, PoolSettingsError> {
        let mut set = doc! {};
        if settings.case_sensitive_codes.is_none() && settings.fold_confusables.is_none() {
            return Ok(set);
        }
        let Some(doc) = self.pool(pool).await? else {
            return Err(PoolSettingsError::UnknownPool(pool.to_owned()));
        };
        let now = doc.lookalike_rule();
        let asked = [
            (
                Setting::CaseSensitiveCodes,
                settings.case_sensitive_codes,
                now.case_sensitive,
            ),
            (
                Setting::FoldConfusables,
                settings.fold_confusables,
                now.confusables,
            ),
        ];
        for (setting, value, current) in asked {
            let Some(value) = value.filter(|v| *v != current) else {
                continue;
            };
            if doc.lookalike_fixed || self.pool_holds_codes(pool).await? {
                return Err(PoolSettingsError::CaseRuleFixed {
                    pool: pool.to_owned(),
                    setting,
                });
            }
            set.insert(setting.field(), value);
        }
        Ok(set)
    }

    /// Pauses (`true`) or resumes (`false`) a pool. Returns whether the
    /// state changed: pausing a paused pool changes nothing and announces
    /// nothing.
    pub async fn set_paused(&self, pool: &str, paused: bool) -> Result<bool, PoolSettingsError> {
        let update = if paused {
            doc! {"$set": {"paused": true, "paused_at": bson::DateTime::now()}}
        } else {
            doc! {"$set": {"paused": false}, "$unset": {"paused_at": ""}}
        };
        let r = self
            .collection(POOLS)
            .update_one(doc! {"_id": pool, "paused": {"$ne": paused}}, update)
            .write_concern(durable())
            .await
            .map_err(StoreError::from)?;
        if r.matched_count == 1 {
            return Ok(true);
        }
        match self.pool(pool).await? {
            Some(_) => Ok(false),
            None => Err(PoolSettingsError::UnknownPool(pool.to_owned())),
        }
    }

    /// Marks the pool's low-stock alert as sent. `Some(crossing)` (the
    /// crossing's number, which names its webhook events) only for the one
    /// caller that flipped it: that caller publishes `pool.low_stock`.
    pub async fn claim_low_stock_alert(&self, pool: &str) -> Result<Option<i64>, StoreError> {
        let after = self
            .collection(POOLS)
            .find_one_and_update(
                doc! {"_id": pool, "low_stock_alerted": {"$ne": true}},
                doc! {"$set": {"low_stock_alerted": true, "low_stock_alerted_at": bson::DateTime::now()}},
            )
            .projection(doc! {"low_stock_crossings": 1})
            .return_document(ReturnDocument::After)
            .await?;
        Ok(after.map(|d| count_of(&d, "low_stock_crossings")))
    }

    /// Re-arms the low-stock alert: stock is back at or above the
    /// threshold, so the next fall below it is a new crossing. True if it
    /// was set.
    pub async fn rearm_low_stock_alert(&self, pool: &str) -> Result<bool, StoreError> {
        let r = self
            .collection(POOLS)
            .update_one(
                doc! {"_id": pool, "low_stock_alerted": true},
                doc! {"$set": {"low_stock_alerted": false}, "$inc": {"low_stock_crossings": 1}},
            )
            .await?;
        Ok(r.modified_count == 1)
    }

    /// Gives the low-stock alert of `crossing` back (it could not be
    /// published): the next check tells the same crossing again.
    pub async fn give_back_low_stock_alert(
        &self,
        pool: &str,
        crossing: i64,
    ) -> Result<(), StoreError> {
        self.collection(POOLS)
            .update_one(
                doc! {"_id": pool, "low_stock_alerted": true, "low_stock_crossings": crossing_filter(crossing)},
                doc! {"$set": {"low_stock_alerted": false}},
            )
            .await?;
        Ok(())
    }

    /// Raises the pool's exhaustion latch for a shortage seen by claims
    /// that began at `short_since`. `Some(n)` (the exhaustion's number,
    /// which names its webhook events) only for the one caller that
    /// raised it: that caller tells `pool.exhausted`. `None` while it is
    /// raised already, and when codes came in after `short_since` (the
    /// shortage may be over; the next one raises it).
    pub async fn claim_exhausted_alert(
        &self,
        pool: &str,
        short_since: bson::DateTime,
    ) -> Result<Option<i64>, StoreError> {
        let after = self
            .collection(POOLS)
            .find_one_and_update(
                doc! {
                    "_id": pool,
                    "exhausted_alerted": {"$ne": true},
                    "exhausted_rearmed_at": {"$not": {"$gt": short_since}},
                },
                doc! {"$set": {"exhausted_alerted": true, "exhausted_alerted_at": bson::DateTime::now()}},
            )
            .projection(doc! {"exhaustions": 1})
            .return_document(ReturnDocument::After)
            .write_concern(durable())
            .await?;
        Ok(after.map(|d| count_of(&d, "exhaustions")))
    }

    /// Gives exhaustion `n`'s latch back (it could not be told): the next
    /// shortage tells the same exhaustion again, under the same ids.
    pub async fn give_back_exhausted_alert(&self, pool: &str, n: i64) -> Result<(), StoreError> {
        self.collection(POOLS)
            .update_one(
                doc! {"_id": pool, "exhausted_alerted": true, "exhaustions": crossing_filter(n)},
                doc! {"$set": {"exhausted_alerted": false}},
            )
            .write_concern(durable())
            .await?;
        Ok(())
    }

    /// Re-arms the exhaustion latch of `pools`: codes came in (an import,
    /// held codes back in stock), so their next shortage is a new
    /// exhaustion. One write for all of them.
    pub async fn rearm_exhausted_alerts(&self, pools: &[&str]) -> Result<(), StoreError> {
        if pools.is_empty() {
            return Ok(());
        }
        let raised = doc! {"$eq": ["$exhausted_alerted", true]};
        let counted = doc! {"$ifNull": ["$exhaustions", 0_i64]};
        self.collection(POOLS)
            .update_many(
                doc! {"_id": {"$in": pools}},
                vec![doc! {"$set": {
                    "exhaustions": {"$cond": [raised, {"$add": [counted.clone(), 1_i64]}, counted]},
                    "exhausted_alerted": false,
                    // The clock claims compare with (`short_since`).
                    "exhausted_rearmed_at": bson::DateTime::now(),
                }}],
            )
            .write_concern(durable())
            .await?;
        Ok(())
    }
}

/// A counter on a pool document (absent: 0).
fn count_of(d: &bson::Document, field: &str) -> i64 {
    match d.get(field) {
        Some(bson::Bson::Int64(n)) => *n,
        Some(bson::Bson::Int32(n)) => i64::from(*n),
        Some(bson::Bson::Double(n)) => *n as i64,
        _ => 0,
    }
}

/// Matches a counter of `n` (0 matches an absent one too).
fn crossing_filter(n: i64) -> bson::Document {
    if n == 0 {
        doc! {"$in": [0_i64, bson::Bson::Null]}
    } else {
        doc! {"$eq": n}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grant_prefixes_are_short_and_alphanumeric() {
        assert!(valid_grant_prefix("GX"));
        assert!(valid_grant_prefix("G2026"));
        assert!(!valid_grant_prefix(""));
        assert!(!valid_grant_prefix("G-X"));
        assert!(!valid_grant_prefix(&"G".repeat(17)));
    }
}
