//! [`Code`]: one code as codepool knows it — its value, where it is in its
//! lifecycle, which order holds it, and what became of the SMS that carries
//! it. Adapters read their documents into this type; everything that
//! decides (the claim engine, resend, lookup) works on it.

use chrono::{DateTime, SecondsFormat, Utc};

use crate::code::{mask, CodeId, CodeStatus};
use crate::grant::Grant;

/// The order a code was issued to, written by the claim in the same update
/// that moved the code from unissued to issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub order_id: String,
    pub uid: String,
    pub phone: String,
    pub issued_at: DateTime<Utc>,
    pub grant_no: Option<String>,
    /// Which of the order's codes this is (0 to `quantity` − 1).
    pub line: u32,
    /// How many codes the order asked for.
    pub quantity: u32,
    /// The first line of the claim that issued it (see
    /// [`crate::Grant::part`]).
    pub part: u32,
    /// Who placed the order (`api-key-id:ID`), `None` for one over AMQP.
    pub owner: Option<String>,
    /// 0 for the code the line got when the order was placed; `n` for the
    /// code the order's `n`-th replacement gave it. A line keeps each code
    /// it held (a replaced one void): the highest is its code now.
    pub replacement: u32,
}

/// How the `order_id` of a code a checkout hold sets aside begins. Like
/// [`BUNDLE_KEY_PREFIX`], it starts with a control character, which no
/// order id may hold, so no order is ever mistaken for a hold.
pub const HOLD_KEY_PREFIX: &str = "\u{1}hold:";

/// How the `order_id` of a code a bundle sets aside (until the bundle is
/// whole) begins.
pub const BUNDLE_KEY_PREFIX: &str = "\u{1}bundle:";

/// What set a code aside, when its `order_id` is not an order's but the
/// internal key of a checkout hold or of a bundle being put together. The
/// key itself is never shown: doors show this instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetAside {
    /// The checkout hold of this id (each owner's own).
    Hold { hold_id: String },
    /// The bundle order of this id, while it was put together.
    Bundle { order_id: String },
}

impl SetAside {
    /// What the internal key `key` names; `None` for an order's id. A
    /// hold's key is `PREFIX item : nonce : hold id` (the nonce hex, or
    /// empty for a hold recorded before nonces; a key older still has no
    /// nonce), a bundle's `PREFIX item : order id`.
    pub fn of_key(key: &str) -> Option<Self> {
        if let Some(rest) = key.strip_prefix(HOLD_KEY_PREFIX) {
            let (_, rest) = rest.split_once(':')?;
            let hold_id = match rest.split_once(':') {
                Some((nonce, id)) if is_nonce(nonce) => id,
                _ => rest,
            };
            return Some(Self::Hold {
                hold_id: hold_id.to_owned(),
            });
        }
        let rest = key.strip_prefix(BUNDLE_KEY_PREFIX)?;
        let (_, order_id) = rest.split_once(':')?;
        Some(Self::Bundle {
            order_id: order_id.to_owned(),
        })
    }
}

/// Whether `s` is a hold attempt's nonce as hold keys carry it: an
/// ObjectId's 24 hex digits, or empty (a hold recorded before nonces).
fn is_nonce(s: &str) -> bool {
    s.is_empty() || (s.len() == 24 && s.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl std::fmt::Display for SetAside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Hold { hold_id } => write!(f, "hold: {hold_id}"),
            Self::Bundle { order_id } => write!(f, "bundle of order {order_id}"),
        }
    }
}

/// One step in the SMS story of a code (`published`, `resent`, `sent`,
/// `failed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmsEvent {
    pub event: String,
    pub at: DateTime<Utc>,
    pub error: Option<String>,
}

/// What became of the text that carries a code.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SmsRecord {
    /// The SMS service reported the text as sent (`is_sms` = 1).
    pub sent: bool,
    /// The broker confirmed the SMS-pending event (recorded by the relay,
    /// backorders and re-sends; a purchase's own grant is confirmed before
    /// the purchase is acked, and records nothing).
    pub published_at: Option<DateTime<Utc>>,
    /// The relay owes this grant its event (`sms_pending`): it was issued
    /// without a message that the broker would redeliver.
    pub awaiting_relay: bool,
    pub sent_at: Option<DateTime<Utc>>,
    pub failed_at: Option<DateTime<Utc>>,
    pub error: Option<String>,
    pub failures: i64,
    pub resends: i64,
    /// The most recent events, oldest first.
    pub history: Vec<SmsEvent>,
}

/// Where the SMS of a code is, in one word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmsState {
    /// The code was never issued: there is nothing to text.
    None,
    /// Issued, and the relay owes it its event: not confirmed yet.
    Pending,
    /// Confirmed by the broker, or carried by its purchase (acked only once
    /// the event is confirmed, redelivered until then); waiting for the
    /// SMS service.
    Queued,
    Sent,
    Failed,
}

impl SmsState {
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "-",
            Self::Pending => "pending",
            Self::Queued => "queued",
            Self::Sent => "sent",
            Self::Failed => "failed",
        }
    }
}

/// One code of one pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Code {
    pub id: CodeId,
    pub pool: String,
    /// The secret itself. Only [`Code::masked`] may reach a log.
    pub code: String,
    pub status: CodeStatus,
    /// Import order within the pool: claims hand out the oldest first.
    pub seq: i64,
    pub expires_at: Option<DateTime<Utc>>,
    pub holder: Option<Holder>,
    pub used_at: Option<DateTime<Utc>>,
    pub voided_at: Option<DateTime<Utc>>,
    pub void_reason: Option<String>,
    pub sms: SmsRecord,
}

/// Why a code's SMS cannot be sent (again). Each says what is true instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotSendable {
    #[error("the code was never issued, so there is no SMS to send")]
    Unissued,
    #[error("the code was voided at {at} ({reason}); a void code is never sent again")]
    Void { at: String, reason: String },
    #[error("the code was already redeemed at {at}; there is nothing to re-send")]
    Used { at: String },
}

/// A time as operators read it, or "an unknown time".
pub fn when(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.to_rfc3339_opts(SecondsFormat::Secs, true))
        .unwrap_or_else(|| "an unknown time".into())
}

impl Code {
    /// The grant this code records: `None` while it was never issued. A
    /// voided grant is still a grant (its order keeps it), marked revoked.
    pub fn grant(&self) -> Option<Grant> {
        let h = self.holder.as_ref()?;
        Some(Grant {
            code_id: self.id,
            pool: self.pool.clone(),
            code: self.code.clone(),
            order_id: h.order_id.clone(),
            uid: h.uid.clone(),
            phone: h.phone.clone(),
            grant_no: h.grant_no.clone(),
            issued_at: h.issued_at,
            revoked: self.status == CodeStatus::Void,
            line: h.line,
            quantity: h.quantity,
            part: h.part,
            owner: h.owner.clone(),
            replacement: h.replacement,
        })
    }

    /// The order this code was given to, as listings show it: `None` for
    /// a code never issued, and for one a checkout hold or a bundle set
    /// aside (held, or voided while held), whose holder is an internal key
    /// ([`Code::set_aside`] says whose instead).
    pub fn order_holder(&self) -> Option<&Holder> {
        self.holder
            .as_ref()
            .filter(|h| SetAside::of_key(&h.order_id).is_none())
    }

    /// The hold or bundle that set this code aside (it may since have been
    /// voided, by a recall or its expiry); `None` for stock and orders.
    pub fn set_aside(&self) -> Option<SetAside> {
        SetAside::of_key(&self.holder.as_ref()?.order_id)
    }

    /// The code as it may appear in logs and listings.
    pub fn masked(&self) -> String {
        mask(&self.code)
    }

    pub fn sms_state(&self) -> SmsState {
        if self.sms.sent {
            SmsState::Sent
        } else if self.sms.failures > 0 {
            SmsState::Failed
        } else if self.order_holder().is_none() {
            SmsState::None
        } else if self.sms.awaiting_relay && self.sms.published_at.is_none() {
            SmsState::Pending
        } else {
            SmsState::Queued
        }
    }

    /// The grant whose SMS an operator may send again: only an issued
    /// code's, since a used code has served and a void one is revoked.
    pub fn resendable(&self) -> Result<Grant, NotSendable> {
        match (self.status, self.grant()) {
            (CodeStatus::Issued, Some(grant)) => Ok(grant),
            (CodeStatus::Void, _) => Err(NotSendable::Void {
                at: when(self.voided_at),
                reason: self
                    .void_reason
                    .clone()
                    .unwrap_or_else(|| "no reason given".into()),
            }),
            (CodeStatus::Used, _) => Err(NotSendable::Used {
                at: when(self.used_at),
            }),
            _ => Err(NotSendable::Unissued),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(status: CodeStatus, held: bool) -> Code {
        Code {
            id: CodeId::from_bytes([7; 12]),
            pool: "game-x".into(),
            code: "QWER-1234".into(),
            status,
            seq: 1,
            expires_at: None,
            holder: held.then(|| Holder {
                order_id: "O-1".into(),
                uid: "u".into(),
                phone: "+8613800000000".into(),
                issued_at: Utc::now(),
                grant_no: Some("G202611200001".into()),
                line: 0,
                quantity: 1,
                part: 0,
                owner: None,
                replacement: 0,
            }),
            used_at: None,
            voided_at: None,
            void_reason: Some("refund".into()),
            sms: SmsRecord::default(),
        }
    }

    #[test]
    fn an_unissued_code_has_no_grant_and_nothing_to_send() {
        let c = code(CodeStatus::Unissued, false);
        assert_eq!(c.grant(), None);
        assert_eq!(c.resendable(), Err(NotSendable::Unissued));
        assert_eq!(c.sms_state(), SmsState::None);
    }

    #[test]
    fn an_issued_code_is_a_grant_that_can_be_resent() {
        let c = code(CodeStatus::Issued, true);
        let g = c.resendable().unwrap();
        assert_eq!(g.order_id, "O-1");
        assert!(!g.revoked);
        assert_eq!(g.sms_pending().unwrap().event_id, "sms:O-1");
        // Issued for a purchase: the purchase carries the event.
        assert_eq!(c.sms_state(), SmsState::Queued);
    }

    #[test]
    fn a_grant_the_relay_owes_its_event_is_pending_until_confirmed() {
        let mut c = code(CodeStatus::Issued, true);
        c.sms.awaiting_relay = true;
        assert_eq!(c.sms_state(), SmsState::Pending);
        c.sms.published_at = Some(Utc::now());
        assert_eq!(c.sms_state(), SmsState::Queued);
    }

    #[test]
    fn a_voided_grant_stays_with_its_order_but_is_never_texted() {
        let c = code(CodeStatus::Void, true);
        let g = c.grant().unwrap();
        assert!(g.revoked);
        assert_eq!(g.sms_pending(), None);
        assert!(
            matches!(c.resendable(), Err(NotSendable::Void { reason, .. }) if reason == "refund")
        );
    }

    #[test]
    fn a_used_code_is_not_resent() {
        let c = code(CodeStatus::Used, true);
        assert!(matches!(c.resendable(), Err(NotSendable::Used { .. })));
    }

    #[test]
    fn a_code_a_hold_or_bundle_set_aside_names_it_and_no_order() {
        for (key, aside) in [
            (
                "\u{1}hold:0:6740a1b2c3d4e5f601234567:cart-1",
                SetAside::Hold {
                    hold_id: "cart-1".into(),
                },
            ),
            (
                "\u{1}hold:1::cart:2",
                SetAside::Hold {
                    hold_id: "cart:2".into(),
                },
            ),
            (
                "\u{1}hold:0:cart-3",
                SetAside::Hold {
                    hold_id: "cart-3".into(),
                },
            ),
            (
                "\u{1}bundle:2:B-1",
                SetAside::Bundle {
                    order_id: "B-1".into(),
                },
            ),
        ] {
            let mut c = code(CodeStatus::Void, true);
            c.holder.as_mut().unwrap().order_id = key.into();
            assert_eq!(c.set_aside(), Some(aside.clone()), "{key:?}");
            assert_eq!(c.order_holder(), None, "{key:?}");
            assert_eq!(c.sms_state(), SmsState::None, "{key:?}");
            assert!(!aside.to_string().contains('\u{1}'));
        }
        assert_eq!(code(CodeStatus::Issued, true).set_aside(), None);
        assert!(code(CodeStatus::Issued, true).order_holder().is_some());
        assert_eq!(
            SetAside::Hold {
                hold_id: "cart-1".into()
            }
            .to_string(),
            "hold: cart-1"
        );
    }

    #[test]
    fn sms_state_follows_the_record() {
        let mut c = code(CodeStatus::Issued, true);
        c.sms.published_at = Some(Utc::now());
        assert_eq!(c.sms_state(), SmsState::Queued);
        c.sms.failures = 1;
        assert_eq!(c.sms_state(), SmsState::Failed);
        c.sms.sent = true;
        assert_eq!(c.sms_state(), SmsState::Sent);
        assert_eq!(c.masked(), "Q*******4");
    }
}
