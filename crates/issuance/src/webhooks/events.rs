//! The events a shop's webhooks carry, their ids and bodies. An event's id
//! is derived from what it announces, so recording it twice (a crash, a
//! second process, a redelivered purchase) records it once, and every
//! retry and replay carries the same `webhook-id`.

use std::collections::BTreeMap;

use codepool_domain::{Code, Grant, PoolEvent, Refusal};
use codepool_store::replacements::ReplacementDoc;
use codepool_store::webhooks::NewEvent;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::shops::shop_of;

pub const ORDER_GRANTED: &str = "order.granted";
pub const ORDER_PARTLY_GRANTED: &str = "order.partly_granted";
pub const ORDER_VOIDED: &str = "order.voided";
pub const ORDER_REFUSED: &str = "order.refused";
pub const POOL_LOW_STOCK: &str = "pool.low_stock";
pub const POOL_EXHAUSTED: &str = "pool.exhausted";
pub const POOL_REPLENISHED: &str = "pool.replenished";
pub const CODE_REPLACED: &str = "code.replaced";
pub const CODE_REDEEMED: &str = "code.redeemed";

/// Every event type an endpoint may subscribe to.
pub const EVENT_TYPES: [&str; 9] = [
    ORDER_GRANTED,
    ORDER_PARTLY_GRANTED,
    ORDER_VOIDED,
    ORDER_REFUSED,
    POOL_LOW_STOCK,
    POOL_EXHAUSTED,
    POOL_REPLENISHED,
    CODE_REPLACED,
    CODE_REDEEMED,
];

/// The `webhook-id` of the event of type `kind` about `about`.
pub fn event_id(kind: &str, about: &str) -> String {
    let digest = Sha256::new()
        .chain_update(kind.as_bytes())
        .chain_update([0])
        .chain_update(about.as_bytes())
        .finalize();
    format!("msg_{}", &hex::encode(digest)[..32])
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn event(kind: &str, about: &str, shop: &str, data: Value) -> NewEvent {
    let body = json!({"type": kind, "timestamp": now(), "data": data});
    NewEvent {
        id: event_id(kind, about),
        shop: shop.to_owned(),
        kind: kind.to_owned(),
        body: body.to_string(),
    }
}

/// The grants of one claim of one shop order (one part), and how many
/// codes the order holds in all.
pub struct OrderPart<'a> {
    pub grants: Vec<&'a Grant>,
    pub held: u64,
}

/// Groups grants owing webhooks by order and part: each claim of an order
/// is one event. Grants without a shop owner are left out.
pub fn parts(grants: &[Grant]) -> BTreeMap<(String, u32), Vec<&Grant>> {
    let mut out: BTreeMap<(String, u32), Vec<&Grant>> = BTreeMap::new();
    for g in grants {
        if shop_of(g.owner.as_deref()).is_some() {
            out.entry((g.order_id.clone(), g.part)).or_default().push(g);
        }
    }
    out
}

/// `order.granted` (every line of the order holds a code now) or
/// `order.partly_granted` (some lines still wait), with the codes of this
/// part in plaintext. `None` when every code of it was voided since.
pub fn order_granted(part: &OrderPart<'_>) -> Option<NewEvent> {
    let first = part.grants.first()?;
    let shop = shop_of(first.owner.as_deref())?;
    let live: Vec<&&Grant> = part.grants.iter().filter(|g| !g.revoked).collect();
    if live.is_empty() {
        return None;
    }
    let complete = part.held >= u64::from(first.quantity);
    let (kind, state) = if complete {
        (ORDER_GRANTED, "granted")
    } else {
        (ORDER_PARTLY_GRANTED, "partly_granted")
    };
    let codes: Vec<Value> = live
        .iter()
        .map(|g| json!({"pool": g.pool, "line": g.line, "code": g.code, "grant_no": g.grant_no, "issued_at": g.issued_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)}))
        .collect();
    let about = format!("{}\0{}", first.order_id, first.part);
    Some(event(
        kind,
        &about,
        shop,
        json!({
            "order_id": first.order_id, "shop": shop, "uid": first.uid, "state": state,
            "quantity": first.quantity, "codes": codes,
            "waiting": u64::from(first.quantity).saturating_sub(part.held),
        }),
    ))
}

/// `order.refused` for a shop's order a pool policy refused.
pub fn order_refused(r: &Refusal) -> Option<NewEvent> {
    let p = &r.purchase;
    let shop = shop_of(p.owner.as_deref())?;
    Some(event(
        ORDER_REFUSED,
        &p.order_id,
        shop,
        json!({
            "order_id": p.order_id, "shop": shop, "uid": p.uid, "pool": p.pool,
            "quantity": p.quantity, "reason": r.reason.as_str(), "limit": r.limit,
        }),
    ))
}

/// `order.voided` for the codes of a shop's order just voided (masked:
/// a voided code is worth nothing, and the shop already had it).
pub fn order_voided(grants: &[Grant], reason: &str) -> Vec<NewEvent> {
    let mut by_order: BTreeMap<&str, Vec<&Grant>> = BTreeMap::new();
    for g in grants {
        by_order.entry(g.order_id.as_str()).or_default().push(g);
    }
    by_order
        .into_iter()
        .filter_map(|(order_id, gs)| {
            let shop = shop_of(gs[0].owner.as_deref())?;
            let mut ids: Vec<String> = gs.iter().map(|g| g.code_id.to_string()).collect();
            ids.sort();
            let lines: Vec<Value> = gs
                .iter()
                .map(|g| json!({"pool": g.pool, "line": g.line, "code": g.masked_code()}))
                .collect();
            Some(event(
                ORDER_VOIDED,
                &format!("{order_id}\0{}", ids.join(",")),
                shop,
                json!({"order_id": order_id, "shop": shop, "uid": gs[0].uid, "reason": reason, "codes": lines}),
            ))
        })
        .collect()
}

/// `code.replaced` for a shop's order whose line got the new code of
/// replacement `r`: the order, the line, and the grant numbers of the old
/// code and the new, never a code (the buyer gets it by SMS). Its id is
/// the replacement's, so recording it again records nothing new.
pub fn code_replaced(r: &ReplacementDoc, new: &Code) -> Option<NewEvent> {
    let shop = shop_of(r.owner.as_deref())?;
    let h = new.holder.as_ref()?;
    let issued_at = h
        .issued_at
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    Some(event(
        CODE_REPLACED,
        &format!("{}\0{}", r.order_id, r.id),
        shop,
        json!({
            "order_id": r.order_id, "shop": shop, "uid": r.uid, "pool": r.pool,
            "line": r.line, "replacement_id": r.id, "reason": r.reason,
            "old_grant_no": r.old_grant_no, "new_grant_no": h.grant_no, "issued_at": issued_at,
        }),
    ))
}

/// `code.redeemed` for a shop's code just redeemed (`before`: the code
/// as it was, issued): the order, the line, the grant number and when,
/// never the code. A code is redeemed once, so its id names the event.
pub fn code_redeemed(before: &Code, at: chrono::DateTime<chrono::Utc>) -> Option<NewEvent> {
    let h = before.holder.as_ref()?;
    let shop = shop_of(h.owner.as_deref())?;
    Some(event(
        CODE_REDEEMED,
        &before.id.to_string(),
        shop,
        json!({
            "order_id": h.order_id, "shop": shop, "uid": h.uid, "pool": before.pool,
            "line": h.line, "grant_no": h.grant_no,
            "redeemed_at": at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        }),
    ))
}

/// The webhook form of a pool event, for each shop in `shops`: an event
/// of each shop's own (its id names the shop), named by `occurrence`.
pub fn pool_event(e: &PoolEvent, shops: &[String], occurrence: &str) -> Vec<NewEvent> {
    shops
        .iter()
        .map(|shop| {
            let about = format!("{}\0{shop}\0{occurrence}", e.pool);
            let mut data = json!({"pool": e.pool, "shop": shop, "at": e.at});
            if let Some(n) = e.unissued {
                data["unissued"] = n.into();
            }
            if let Some(n) = e.inserted {
                data["inserted"] = n.into();
            }
            event(&e.event, &about, shop, data)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_per_subject_and_differ_between_events() {
        assert_eq!(
            event_id(ORDER_GRANTED, "O-1/0"),
            event_id(ORDER_GRANTED, "O-1/0")
        );
        assert_ne!(
            event_id(ORDER_GRANTED, "O-1/0"),
            event_id(ORDER_GRANTED, "O-1/1")
        );
        assert_ne!(
            event_id(ORDER_GRANTED, "O-1"),
            event_id(ORDER_REFUSED, "O-1")
        );
        assert!(event_id(ORDER_GRANTED, "x").starts_with("msg_"));
    }

    #[test]
    fn each_shop_gets_its_own_pool_event_named_by_the_occurrence() {
        let e = PoolEvent::new(codepool_domain::PoolEventKind::Exhausted, "px");
        let shops = ["acme".to_owned(), "globex".to_owned()];
        let first = pool_event(&e, &shops, "exhaustion 0");
        assert_eq!(first.len(), 2);
        assert_ne!(first[0].id, first[1].id, "one event per shop");
        assert!(first[1].body.contains("\"shop\":\"globex\""));
        let mut later = e.clone();
        later.at = "2030-01-01T00:00:00.000Z".to_owned();
        let again = pool_event(&later, &shops, "exhaustion 0");
        assert_eq!(again[0].id, first[0].id, "told again: the same event");
        let next = pool_event(&e, &shops, "exhaustion 1");
        assert_ne!(
            next[0].id, first[0].id,
            "the next exhaustion is a new event"
        );
    }
}
