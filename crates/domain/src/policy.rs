//! Pool policies: the operator's controls over who may get a code from a
//! pool and when. They live on the pool document; the dispatcher applies
//! them before any claim, so a refused or held purchase never takes a code.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};

use crate::purchase::Purchase;

/// What a pool's operator has decided about issuing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PoolPolicy {
    /// Orders one user (`uid`) may hold a code or a waiting backorder for;
    /// 0 means unlimited. A voided grant still counts.
    pub per_user: u32,
    /// While paused, purchases wait as backorders: nothing is issued.
    pub paused: bool,
}

impl PoolPolicy {
    /// Whether purchases of this pool need more than the plain claim.
    pub fn is_active(&self) -> bool {
        self.paused || self.per_user > 0
    }

    pub fn limits_users(&self) -> bool {
        self.per_user > 0
    }
}

/// Why a valid purchase got no code on purpose. A refusal is an outcome,
/// never a dead letter: the purchase itself was fine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalReason {
    /// The buyer already holds the pool's per-user number of orders.
    PerUserLimit,
}

impl RefusalReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PerUserLimit => "per_user_limit",
        }
    }
}

/// The routing key of [`PurchaseRefused`] on `codepool.events`.
pub const PURCHASE_REFUSED_KEY: &str = "purchase.refused";

/// "This purchase gets no code, on purpose." Published persistent and
/// confirmed on `codepool.events` with routing key `purchase.refused`;
/// `event_id` is stable per order, so a redelivered refusal carries the
/// same id and consumers can drop duplicates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PurchaseRefused {
    pub event: String,
    pub event_id: String,
    pub order_id: String,
    pub pool: String,
    pub uid: String,
    pub reason: RefusalReason,
    /// The per-user limit in force when the order was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    pub refused_at: String,
}

impl PurchaseRefused {
    pub fn event_id_for(order_id: &str) -> String {
        format!("refused:{order_id}")
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A purchase a pool policy refused: no code, ever, for this order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub purchase: Purchase,
    pub reason: RefusalReason,
    pub limit: Option<u32>,
    /// When the order was first refused; a redelivery keeps this time, so
    /// its event is the same event again.
    pub at: DateTime<Utc>,
}

impl Refusal {
    /// The `purchase.refused` event that tells the shop.
    pub fn event(&self) -> PurchaseRefused {
        PurchaseRefused {
            event: PURCHASE_REFUSED_KEY.into(),
            event_id: PurchaseRefused::event_id_for(&self.purchase.order_id),
            order_id: self.purchase.order_id.clone(),
            pool: self.purchase.pool.clone(),
            uid: self.purchase.uid.clone(),
            reason: self.reason,
            limit: self.limit,
            refused_at: self.at.to_rfc3339_opts(SecondsFormat::Millis, true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_event_names_order_pool_uid_and_reason() {
        let e = PurchaseRefused {
            event: PURCHASE_REFUSED_KEY.into(),
            event_id: PurchaseRefused::event_id_for("O-1"),
            order_id: "O-1".into(),
            pool: "game-x".into(),
            uid: "u1".into(),
            reason: RefusalReason::PerUserLimit,
            limit: Some(1),
            refused_at: "2026-11-20T10:00:00.000Z".into(),
        };
        let v: serde_json::Value = serde_json::from_slice(&e.to_json()).unwrap();
        assert_eq!(v["reason"], "per_user_limit");
        assert_eq!(v["order_id"], "O-1");
        assert_eq!(v["pool"], "game-x");
        assert_eq!(v["uid"], "u1");
        assert_eq!(v["event_id"], "refused:O-1");
    }

    #[test]
    fn zero_means_unlimited() {
        assert!(!PoolPolicy::default().is_active());
        assert!(PoolPolicy {
            per_user: 1,
            paused: false
        }
        .limits_users());
        assert!(PoolPolicy {
            per_user: 0,
            paused: true
        }
        .is_active());
    }
}
