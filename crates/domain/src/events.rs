//! The messages codepool publishes and receives besides purchases.

use serde::{Deserialize, Serialize};

/// "Text this code to this buyer." Published persistent and confirmed to the
/// `sms` exchange with routing key `sms.pending`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SmsPending {
    pub event_id: String,
    pub order_id: String,
    pub uid: String,
    pub phone: String,
    pub pool: String,
    pub code: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant_no: Option<String>,
    pub issued_at: String,
}

impl SmsPending {
    pub fn event_id_for(order_id: &str) -> String {
        format!("sms:{order_id}")
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The SMS service's report on one event (`sms.sent` / `sms.failed`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SmsReceipt {
    pub event_id: String,
    pub order_id: String,
    #[serde(default)]
    pub error: Option<String>,
}

/// What happened to a pool's stock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolEventKind {
    LowStock,
    Exhausted,
    Replenished,
    /// An operator paused the pool: purchases wait as backorders.
    Paused,
    /// An operator resumed the pool: dispatchers fulfil its backorders.
    Resumed,
}

impl PoolEventKind {
    /// The routing key on the `codepool.events` exchange.
    pub fn routing_key(self) -> &'static str {
        match self {
            Self::LowStock => "pool.low_stock",
            Self::Exhausted => "pool.exhausted",
            Self::Replenished => "pool.replenished",
            Self::Paused => "pool.paused",
            Self::Resumed => "pool.resumed",
        }
    }
}

/// A pool event as published on `codepool.events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolEvent {
    pub event: String,
    pub pool: String,
    pub at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unissued: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inserted: Option<u64>,
}

impl PoolEvent {
    pub fn new(kind: PoolEventKind, pool: &str) -> Self {
        Self {
            event: kind.routing_key().to_owned(),
            pool: pool.to_owned(),
            at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            unissued: None,
            inserted: None,
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}
