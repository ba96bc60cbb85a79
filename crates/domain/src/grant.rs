//! Grants: the binding of one code to one line of one order, the fact
//! codepool exists to produce exactly once per line.

use std::borrow::Borrow;
use std::collections::HashMap;

use chrono::{DateTime, SecondsFormat, Utc};

use crate::code::{mask, CodeId};
use crate::events::{SmsCode, SmsPending};

/// One code issued to one line of one order. Created only by the claim (a
/// conditional update from status 0 to 1 in MongoDB); everything else reads
/// it.
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
    /// Which of the order's codes this is: 0 to `quantity` − 1. The unique
    /// `(order_id, line)` index allows one code per line.
    pub line: u32,
    /// How many codes the order asked for.
    pub quantity: u32,
    /// The first line of the claim that issued this code: the codes of an
    /// order issued together share a part, and travel in one event. An
    /// order served in two goes (stock ran short) has two parts.
    pub part: u32,
    /// Who placed the order (`api-key-id:ID`), `None` for one over AMQP:
    /// only its owner's repeat of the order is answered with the codes.
    pub owner: Option<String>,
    /// 0 for a line's first code; `n` for the code the order's `n`-th
    /// replacement gave the line. It travels in an event of its own, with
    /// an id of its own ([`SmsPending::replacement_event_id`]), so an SMS
    /// service that dropped the first text as a duplicate sends this one.
    pub replacement: u32,
}

impl Grant {
    /// The event that asks the SMS service to text the code of a one-code
    /// order (see [`sms_events`] for orders of several). Its `event_id` is
    /// derived from the order, so every re-send of the same grant carries
    /// the same id and the SMS service can drop duplicates. A revoked grant
    /// has nothing to send, nor has a grant of no phone (a marketplace's
    /// sale: its keys went back in the marketplace's answer): `None`,
    /// whoever asks (dispatcher, fulfilment, relay, resend).
    pub fn sms_pending(&self) -> Option<SmsPending> {
        if self.revoked || self.phone.is_empty() {
            return None;
        }
        let event_id = match self.replacement {
            0 => SmsPending::event_id_for(&self.order_id),
            n => SmsPending::replacement_event_id(&self.order_id, n, None),
        };
        Some(SmsPending {
            event_id,
            order_id: self.order_id.clone(),
            uid: self.uid.clone(),
            phone: self.phone.clone(),
            pool: self.pool.clone(),
            code: Some(self.code.clone()),
            grant_no: self.grant_no.clone(),
            issued_at: Some(self.issued_at_text()),
            quantity: None,
            codes: Vec::new(),
        })
    }

    /// The code as it may appear in logs.
    pub fn masked_code(&self) -> String {
        mask(&self.code)
    }

    fn issued_at_text(&self) -> String {
        self.issued_at.to_rfc3339_opts(SecondsFormat::Millis, true)
    }
}

/// The SMS-pending events of `grants`, each with the positions (in
/// `grants`) of the grants it carries. A one-code order's grant gets the
/// one-code event; the grants of a several-code order travel together by
/// part, one event per part, lines ascending, its id naming its lines.
/// The code of a replacement travels in an event of its own. Revoked
/// grants are carried by none, nor are grants of no phone (a
/// marketplace's sale: its keys went back in the marketplace's answer, no
/// SMS is owed). Events come in the order of their first grant.
pub fn sms_events<G: Borrow<Grant>>(grants: &[G]) -> Vec<(SmsPending, Vec<usize>)> {
    let mut out: Vec<(SmsPending, Vec<usize>)> = Vec::new();
    let mut part_at: HashMap<(&str, u32, u32), usize> = HashMap::new();
    let mut replacement_at: Vec<u32> = Vec::new();
    for (i, g) in grants.iter().map(Borrow::borrow).enumerate() {
        if g.revoked || g.phone.is_empty() {
            continue;
        }
        if g.quantity <= 1 {
            if let Some(e) = g.sms_pending() {
                out.push((e, vec![i]));
                replacement_at.push(g.replacement);
            }
            continue;
        }
        let key = (g.order_id.as_str(), g.part, g.replacement);
        let at = *part_at.entry(key).or_insert_with(|| {
            replacement_at.push(g.replacement);
            out.push((
                SmsPending {
                    event_id: String::new(),
                    order_id: g.order_id.clone(),
                    uid: g.uid.clone(),
                    phone: g.phone.clone(),
                    pool: g.pool.clone(),
                    code: None,
                    grant_no: None,
                    issued_at: None,
                    quantity: Some(g.quantity),
                    codes: Vec::new(),
                },
                Vec::new(),
            ));
            out.len() - 1
        });
        let (event, carried) = &mut out[at];
        carried.push(i);
        // The same line twice (a batch that read an order twice) travels
        // once; both grants are carried by the event.
        if !event.codes.iter().any(|c| c.line == g.line) {
            event.codes.push(SmsCode {
                line: g.line,
                code: g.code.clone(),
                grant_no: g.grant_no.clone(),
                issued_at: g.issued_at_text(),
                // A bundle's line of another pool names its own.
                pool: (g.pool != event.pool).then(|| g.pool.clone()),
            });
        }
    }
    for ((event, _), &n) in out.iter_mut().zip(&replacement_at) {
        if event.code.is_none() {
            event.codes.sort_by_key(|c| c.line);
            let lines: Vec<u32> = event.codes.iter().map(|c| c.line).collect();
            event.event_id = match n {
                0 => SmsPending::event_id_for_lines(&event.order_id, &lines),
                n => SmsPending::replacement_event_id(&event.order_id, n, Some(&lines)),
            };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(order: &str, line: u32, quantity: u32, part: u32) -> Grant {
        Grant {
            code_id: CodeId::from_bytes([line as u8; 12]),
            pool: "p".into(),
            code: format!("CODE-{line}"),
            order_id: order.into(),
            uid: "u".into(),
            phone: "+8613800000000".into(),
            grant_no: Some(format!("G{line}")),
            issued_at: Utc::now(),
            revoked: false,
            line,
            quantity,
            part,
            owner: None,
            replacement: 0,
        }
    }

    #[test]
    fn a_one_code_order_keeps_its_event_shape() {
        let events = sms_events(&[grant("O-1", 0, 1, 0)]);
        assert_eq!(events.len(), 1);
        let json: serde_json::Value = serde_json::from_slice(&events[0].0.to_json()).unwrap();
        let mut keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "code",
                "event_id",
                "grant_no",
                "issued_at",
                "order_id",
                "phone",
                "pool",
                "uid"
            ]
        );
        assert_eq!(json["event_id"], "sms:O-1");
    }

    #[test]
    fn a_grant_of_no_phone_owes_no_sms() {
        let mut one = grant("eneba:en:o-1", 0, 1, 0);
        one.phone = String::new();
        let mut two = [grant("g2a:g2:r", 0, 2, 0), grant("g2a:g2:r", 1, 2, 0)];
        for g in &mut two {
            g.phone = String::new();
        }
        assert_eq!(one.sms_pending(), None);
        assert!(sms_events(&[one]).is_empty());
        assert!(sms_events(&two).is_empty());
    }

    #[test]
    fn several_codes_travel_by_part_lines_ascending() {
        let mut revoked = grant("O-2", 9, 10, 4);
        revoked.revoked = true;
        let grants = [
            grant("O-2", 5, 10, 4),
            grant("O-2", 1, 10, 0),
            grant("O-2", 0, 10, 0),
            grant("O-3", 0, 1, 0),
            grant("O-2", 4, 10, 4),
            revoked,
            grant("O-2", 1, 10, 0),
        ];
        let events = sms_events(&grants);
        let ids: Vec<&str> = events.iter().map(|(e, _)| e.event_id.as_str()).collect();
        assert_eq!(ids, ["sms:O-2:4-5", "sms:O-2:0-1", "sms:O-3"]);
        assert_eq!(events[0].1, vec![0, 4]);
        assert_eq!(
            events[1].1,
            vec![1, 2, 6],
            "a line read twice is carried, and sent once"
        );
        assert_eq!(events[1].0.codes.len(), 2);
        let first = &events[1].0;
        assert_eq!(first.quantity, Some(10));
        assert!(first.code.is_none());
        let lines: Vec<u32> = first.codes.iter().map(|c| c.line).collect();
        assert_eq!(lines, [0, 1]);
        assert_eq!(first.all_codes()[1].code, "CODE-1");
    }

    #[test]
    fn a_replacement_code_travels_alone_under_an_id_of_its_own() {
        let mut one = grant("O-1", 0, 1, 0);
        one.replacement = 2;
        let mut of_two = grant("O-2", 0, 2, 0);
        of_two.replacement = 1;
        let events = sms_events(&[grant("O-2", 1, 2, 0), of_two, one]);
        let ids: Vec<&str> = events.iter().map(|(e, _)| e.event_id.as_str()).collect();
        assert_eq!(ids, ["sms:O-2:1", "sms:O-2#r1:0", "sms:O-1#r2"]);
        assert_eq!(
            SmsPending::replacement_of("sms:O-2#r1:0", "O-2"),
            Ok(1),
            "a receipt names the replacement"
        );
        assert_eq!(
            SmsPending::lines_of("sms:O-2#r1:0", "O-2"),
            Ok(Some(vec![0]))
        );
        assert_eq!(SmsPending::lines_of("sms:O-1#r2", "O-1"), Ok(None));
    }
}
