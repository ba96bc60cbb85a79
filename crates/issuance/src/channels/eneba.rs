//! Eneba's key replacement: after Eneba approves a buyer's ticket, it
//! sends a RESERVE naming the order (`orderId`), the auction and the key
//! being replaced (`keyId`), then a PROVIDE of the order. Codepool
//! replaces a key of that auction in the order ([`crate::replace`]: the
//! old code void, the line a fresh one from the same pool, under the
//! pool's replacements-per-order cap), and the PROVIDE answers the new
//! key. `(orderId, keyId)` names the replacement: the same RESERVE or
//! PROVIDE again gives the same key, and replaces nothing more.
//!
//! Eneba's `keyId` is its own id of the key, which codepool never saw;
//! each new `keyId` of an order replaces the next line of the auction (the
//! keys of one auction are alike), in turn.

use codepool_store::channels::{ChannelDoc, DealDoc, DealState, ReplacedKey};

use super::{CallError, Key};
use crate::audit::Actor;
use crate::replace::{Ask, ReplaceError, Replaced};

/// The replacement id of key `key_id` of Eneba order `order`: scoped by
/// the channel and the order, so no other replacement of the shop
/// shares it.
fn replacement_id(c: &ChannelDoc, order: &str, key_id: &str) -> String {
    format!("eneba:{}:{order}:{key_id}", c.name)
}

/// Why a replacement was not made: as Eneba is told (`success:false`,
/// it refunds the buyer), nothing changed.
fn refused(e: ReplaceError) -> CallError {
    if e.is_unavailable() {
        return CallError::Retry(e.to_string());
    }
    match e {
        ReplaceError::Limit { .. }
        | ReplaceError::NotReplaceable { .. }
        | ReplaceError::PoolNotAllowed { .. } => CallError::Unavailable(e.to_string()),
        ReplaceError::Cancelled { .. } => CallError::Cancelled,
        other => CallError::Failed(other.to_string()),
    }
}

/// The provided deal `order` of channel `c`.
async fn provided(core: &crate::Core, c: &ChannelDoc, order: &str) -> Result<DealDoc, CallError> {
    match core.store().deal(&c.name, order).await? {
        Some(d) if d.state == DealState::Provided => Ok(d),
        Some(d) if d.state == DealState::Cancelled => Err(CallError::Cancelled),
        _ => Err(CallError::UnknownDeal(order.to_owned())),
    }
}

/// Replaces the code of `line` of the deal's order under the replacement
/// id of `key_id`.
async fn replace_line(
    core: &crate::Core,
    c: &ChannelDoc,
    d: &DealDoc,
    key_id: &str,
    line: u32,
) -> Result<Replaced, ReplaceError> {
    let id = replacement_id(c, &d.external_id, key_id);
    let reason = format!("Eneba key replacement (key {key_id})");
    let ask = Ask {
        order_id: &d.order_id,
        line,
        replacement_id: &id,
        reason: &reason,
    };
    let actor = Actor {
        who: super::placed_by(&c.name),
        via: format!("Eneba RESERVE {} (replacement)", d.external_id),
    };
    core.replace(&ask, &actor).await
}

/// RESERVE `{orderId, auctionId, keyId}`: replaces a key of `auction` in
/// the order, all or nothing; the same `keyId` again is the same
/// replacement. A pool with no free code refuses it before anything is
/// voided (the buyer is refunded instead).
pub(crate) async fn reserve_replacement(
    core: &crate::Core,
    c: &ChannelDoc,
    order: &str,
    auction: &str,
    key_id: &str,
) -> Result<(), CallError> {
    let d = provided(core, c, order).await?;
    if let Some(r) = d.replaced.iter().find(|r| r.key_id == key_id) {
        if r.product != auction {
            return Err(CallError::OrderExists);
        }
        return replace_line(core, c, &d, key_id, r.line)
            .await
            .map(drop)
            .map_err(refused);
    }
    // The auction's lines in the order, and the next one's turn.
    let mut offset = 0;
    let mut lines = None;
    for l in &d.lines {
        if l.product == auction {
            lines = Some((offset, l.quantity, l.pool.clone()));
        }
        offset += l.quantity;
    }
    let Some((first, count, pool)) = lines else {
        return Err(CallError::UnknownProduct(
            auction.chars().take(80).collect(),
        ));
    };
    let before = d.replaced.iter().filter(|r| r.product == auction).count() as u32;
    let line = first + before % count;
    // Nothing is voided for a line that would wait: Eneba refunds instead.
    if core.store().unissued_stock(&pool).await? == 0 {
        super::stock::refused_for_stock(c, &d.lines);
        return Err(CallError::Unavailable(format!(
            "pool {pool:?} has no free code"
        )));
    }
    let done = replace_line(core, c, &d, key_id, line)
        .await
        .map_err(refused)?;
    core.store()
        .add_deal_replacement(
            &c.name,
            order,
            &ReplacedKey {
                key_id: key_id.to_owned(),
                product: auction.to_owned(),
                line,
            },
        )
        .await?;
    super::stock::changed([pool.as_str()]);
    if done.code.is_none() {
        // Taken meanwhile: the line waits for stock, and gets its code
        // at the next import (before the pool's backorders).
        return Err(CallError::Unavailable(format!(
            "pool {pool:?} ran out during the replacement"
        )));
    }
    Ok(())
}

/// The new key of a replacement of order `order`: of `key_id`, or the
/// latest one when Eneba's PROVIDE names no key. `None` when the order had
/// no replacement (its PROVIDE is the order's own).
pub(crate) async fn replacement_keys(
    core: &crate::Core,
    c: &ChannelDoc,
    order: &str,
    key_id: Option<&str>,
) -> Result<Option<Vec<Key>>, CallError> {
    let Some(d) = core.store().deal(&c.name, order).await? else {
        return match key_id {
            Some(_) => Err(CallError::UnknownDeal(order.to_owned())),
            None => Ok(None),
        };
    };
    let r = match key_id {
        Some(k) => d.replaced.iter().find(|r| r.key_id == k),
        None => d.replaced.last(),
    };
    let Some(r) = r else {
        return match key_id {
            Some(_) => Err(CallError::UnknownDeal(order.to_owned())),
            None => Ok(None),
        };
    };
    if d.state == DealState::Cancelled {
        return Err(CallError::Cancelled);
    }
    let done = replace_line(core, c, &d, &r.key_id, r.line)
        .await
        .map_err(refused)?;
    let Some(code) = done.code.as_ref().and_then(|c| c.grant()) else {
        return Err(CallError::Unavailable(
            "the replacement waits for stock".into(),
        ));
    };
    if code.revoked {
        return Err(CallError::Cancelled);
    }
    Ok(Some(vec![Key {
        id: code.code_id.to_string(),
        product: r.product.clone(),
        value: code.code,
        revoked: false,
    }]))
}
