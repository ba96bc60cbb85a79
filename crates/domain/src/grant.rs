//! Grants: the binding of one code to one order, the fact codepool exists
//! to produce exactly once per purchase.

use chrono::{DateTime, SecondsFormat, Utc};

use crate::code::{mask, CodeId};
use crate::events::SmsPending;

/// One code issued to one order. Created only by the claim (a conditional
/// update from status 0 to 1 in MongoDB); everything else reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The code document that carries the grant.
    pub code_id: CodeId,
    pub pool: String,
    pub code: String,
    pub order_id: String,
    pub uid: String,
    pub phone: String,
    pub grant_no: Option<String>,
    pub issued_at: DateTime<Utc>,
    /// The code was voided after it was issued (a refund). The order keeps
    /// it, so it never gets a second code, but it is never texted again.
    pub revoked: bool,
}

impl Grant {
    /// The event that asks the SMS service to text the code. Its `event_id`
    /// is derived from the order, so every re-send of the same grant carries
    /// the same id and the SMS service can drop duplicates. A revoked grant
    /// has nothing to send: `None`, whoever asks (dispatcher, fulfilment,
    /// relay, resend).
    pub fn sms_pending(&self) -> Option<SmsPending> {
        if self.revoked {
            return None;
        }
        Some(SmsPending {
            event_id: SmsPending::event_id_for(&self.order_id),
            order_id: self.order_id.clone(),
            uid: self.uid.clone(),
            phone: self.phone.clone(),
            pool: self.pool.clone(),
            code: self.code.clone(),
            grant_no: self.grant_no.clone(),
            issued_at: self.issued_at.to_rfc3339_opts(SecondsFormat::Millis, true),
        })
    }

    /// The code as it may appear in logs.
    pub fn masked_code(&self) -> String {
        mask(&self.code)
    }
}
