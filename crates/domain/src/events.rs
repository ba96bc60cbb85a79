//! The messages codepool publishes and receives besides purchases.

use serde::{Deserialize, Serialize};

/// "Text these codes to this buyer." Published persistent and confirmed to
/// the `sms` exchange with routing key `sms.pending`.
///
/// An order of one code gets the shape SMS services have always read: one
/// `code`, `grant_no` and `issued_at`. An order of several codes gets
/// `quantity` and a `codes` list instead, one entry per code of this part
/// of the order; it has no top-level `code`, so a service that only knows
/// the first shape refuses it rather than texting one code of several.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SmsPending {
    pub event_id: String,
    pub order_id: String,
    pub uid: String,
    pub phone: String,
    pub pool: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant_no: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issued_at: Option<String>,
    /// The order's quantity, when it asked for more than one code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantity: Option<u32>,
    /// The codes of this part of a several-code order, by line.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub codes: Vec<SmsCode>,
}

/// One code of a several-code SMS-pending event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SmsCode {
    /// The code's line in its order: 0 to quantity − 1.
    pub line: u32,
    pub code: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant_no: Option<String>,
    pub issued_at: String,
    /// A bundle's code from another pool than the event's (its first
    /// item's): its own pool. Absent for the event's pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
}

/// What the event ids of a replacement's code add after the order id,
/// before the replacement's number: `sms:O-1#r1`.
pub const REPLACEMENT_MARK: &str = "#r";

impl SmsPending {
    /// The id of the event of an order of one code.
    pub fn event_id_for(order_id: &str) -> String {
        format!("sms:{order_id}")
    }

    /// The id of the event that carries `lines` (ascending) of a
    /// several-code order: `sms:O-1:0-3`, `sms:O-1:4-9`, `sms:O-1:0-1,3`.
    /// It names exactly what the event carries, so the same id always
    /// carries the same codes, and a part sent again is the same event.
    pub fn event_id_for_lines(order_id: &str, lines: &[u32]) -> String {
        format!("sms:{order_id}:{}", line_ranges(lines))
    }

    /// The id of the event that carries the code the `n`-th replacement
    /// (1 or more) of an order gave it: `sms:O-1#r1` for an order of one
    /// code, `sms:O-1#r2:3` (its line) for an order of several. Never the
    /// id of the code it replaced, so the SMS service texts it.
    pub fn replacement_event_id(order_id: &str, n: u32, lines: Option<&[u32]>) -> String {
        match lines {
            None => format!("sms:{order_id}{REPLACEMENT_MARK}{n}"),
            Some(lines) => format!("sms:{order_id}{REPLACEMENT_MARK}{n}:{}", line_ranges(lines)),
        }
    }

    /// Which replacement of order `order_id` an event id names: 0 for a
    /// code the order got when it was placed, `n` for the code of its
    /// `n`-th replacement; an error when the id is not one codepool gives.
    pub fn replacement_of(event_id: &str, order_id: &str) -> Result<u32, String> {
        Self::split_id(event_id, order_id).map(|(n, _)| n)
    }

    /// The replacement an event id names (0: none) and what follows it.
    fn split_id<'a>(event_id: &'a str, order_id: &str) -> Result<(u32, &'a str), String> {
        let bad = || format!("event_id {event_id:?} is not an SMS event id of order {order_id:?}");
        let rest = event_id
            .strip_prefix("sms:")
            .and_then(|r| r.strip_prefix(order_id))
            .ok_or_else(bad)?;
        let Some(marked) = rest.strip_prefix(REPLACEMENT_MARK) else {
            return Ok((0, rest));
        };
        let digits = marked.find(':').unwrap_or(marked.len());
        match marked[..digits].parse::<u32>() {
            Ok(n) if n > 0 && !marked[..digits].starts_with('0') => Ok((n, &marked[digits..])),
            _ => Err(bad()),
        }
    }

    /// The lines an event id names, for an order of `order_id`: `None` for
    /// the id of a one-code order (`sms:O-1`, `sms:O-1#r1`), which names
    /// the whole order; an error when the id is not one codepool gives.
    pub fn lines_of(event_id: &str, order_id: &str) -> Result<Option<Vec<u32>>, String> {
        let bad = || format!("event_id {event_id:?} is not an SMS event id of order {order_id:?}");
        let (_, rest) = Self::split_id(event_id, order_id)?;
        if rest.is_empty() {
            return Ok(None);
        }
        let ranges = rest.strip_prefix(':').ok_or_else(bad)?;
        let mut lines = Vec::new();
        for part in ranges.split(',') {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
            if b < a || b - a > crate::purchase::MAX_QUANTITY {
                return Err(bad());
            }
            lines.extend(a..=b);
        }
        Ok(Some(lines))
    }

    /// Every code the event carries, by line (one for a one-code order).
    pub fn all_codes(&self) -> Vec<SmsCode> {
        match &self.code {
            Some(code) => vec![SmsCode {
                line: 0,
                code: code.clone(),
                grant_no: self.grant_no.clone(),
                issued_at: self.issued_at.clone().unwrap_or_default(),
                pool: None,
            }],
            None => self.codes.clone(),
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Ascending lines as ranges: `[0,1,2,3]` → `0-3`, `[0,1,3]` → `0-1,3`.
fn line_ranges(lines: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let start = lines[i];
        let mut end = start;
        while i + 1 < lines.len() && lines[i + 1] == end + 1 {
            i += 1;
            end = lines[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_ranges_name_exactly_the_lines() {
        assert_eq!(
            SmsPending::event_id_for_lines("O-1", &[0, 1, 2, 3]),
            "sms:O-1:0-3"
        );
        assert_eq!(SmsPending::event_id_for_lines("O-1", &[4]), "sms:O-1:4");
        assert_eq!(
            SmsPending::event_id_for_lines("O-1", &[0, 1, 3, 5, 6]),
            "sms:O-1:0-1,3,5-6"
        );
        for lines in [vec![0, 1, 2, 3], vec![4], vec![0, 1, 3, 5, 6], vec![99]] {
            let id = SmsPending::event_id_for_lines("O:1", &lines);
            assert_eq!(SmsPending::lines_of(&id, "O:1"), Ok(Some(lines)));
        }
        assert_eq!(SmsPending::lines_of("sms:O-1", "O-1"), Ok(None));
        for bad in [
            "sms:O-2",
            "sms:O-1x",
            "sms:O-1:",
            "sms:O-1:3-1",
            "sms:O-1:a",
            "sms:O-1:0-4000000000",
            "sms:O-1#r",
            "sms:O-1#r0",
            "sms:O-1#rx:1",
            "O-1",
        ] {
            assert!(SmsPending::lines_of(bad, "O-1").is_err(), "{bad}");
        }
    }
}
