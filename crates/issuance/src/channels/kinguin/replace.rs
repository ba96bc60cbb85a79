//! Kinguin's replacements: a replacement is a new reservation whose
//! webhooks carry `replacedFrom`, the reservation whose key it replaces.
//! codepool makes it a replace ([`crate::replace`]) of that key in the
//! first reservation's order (line 0: one key per reservation), under the
//! order's replacement cap, named by the channel and the new reservation,
//! and uploads the new key to the new reservation through the same
//! uploads as a sale's ([`super::Uploader`]).
//!
//! - The link is recorded on the new reservation's document
//!   (`replaced_from`) the first time a webhook names it. Later webhooks
//!   of the reservation are the replacement's whether they name it or
//!   not; one naming another reservation is refused.
//! - The reservation replaced must be this channel's, of the same offer,
//!   with its key given (a sale's or a replacement's: chains follow).
//! - `BUYING` checks the link and holds nothing.
//! - `BOUGHT` stages the upload (due a little later: a process that dies
//!   in the middle leaves it to the uploaders, which finish the same
//!   replacement), replaces the key, records the new key's code and makes
//!   the upload due. Over the cap, a key that is no longer issued, a pool
//!   with no free code: refused, nothing replaced, nothing staged.
//! - `CANCELED`, `REFUNDED`, `REVERSED`, `RETURNED`: the new key, once
//!   given, is voided (it may have been shown); an upload not sent is
//!   dropped; one that comes first leaves the upload cancelled, so a later
//!   BOUGHT replaces nothing.
//! - `DELIVERED` is recorded, as a sale's.
//!
//! The same webhook again changes nothing more: the same replacement id
//! answers the same key, and the upload is staged once.

use std::time::Duration;

use bson::DateTime;
use codepool_domain::{CodeId, CodeStatus};
use codepool_store::channels::{deal_id, ChannelDoc, DealDoc, DealState};
use codepool_store::kinguin::{UploadDoc, UploadState};

use super::Done;
use crate::audit::Actor;
use crate::channels::{placed_by, stock, CallError};
use crate::replace::{Ask, ReplaceError};
use crate::Core;

/// How long a replacement's staged upload waits before an uploader may
/// take it: the webhook that staged it replaces the key and makes it due
/// at once; only a process that died in between leaves it to wait.
const STAGED_GRACE: Duration = Duration::from_secs(10);

/// A replacement's link: the reservation it replaces and the order its
/// key is a line of.
#[derive(Debug, Clone)]
pub(super) struct Link {
    pub old: String,
    pub order_id: String,
}

/// The replacement id of Kinguin reservation `reservation`.
fn replacement_id(c: &ChannelDoc, reservation: &str) -> String {
    format!("kinguin:{}:{reservation}", c.name)
}

/// The replace that reservation `reservation`, linked by `link`, makes.
fn ask_of<'a>(link: &'a Link, id: &'a str, reason: &'a str) -> Ask<'a> {
    Ask {
        order_id: &link.order_id,
        line: 0,
        replacement_id: id,
        reason,
    }
}

fn reason_of(link: &Link) -> String {
    format!("Kinguin replacement of reservation {}", link.old)
}

/// Why a replacement was not made, as Kinguin is told: nothing changed.
fn refused(e: ReplaceError) -> CallError {
    if e.is_unavailable() {
        return CallError::Retry(e.to_string());
    }
    match e {
        ReplaceError::Cancelled { .. } => CallError::Cancelled,
        ReplaceError::Conflict { .. } => CallError::OrderExists,
        ReplaceError::Limit { .. }
        | ReplaceError::NotReplaceable { .. }
        | ReplaceError::PoolNotAllowed { .. }
        | ReplaceError::NoLine { .. } => CallError::NotReplaced(e.to_string()),
        other => CallError::Failed(other.to_string()),
    }
}

/// Whether webhook `h` is of a replacement, and of which reservation:
/// named now (`replacedFrom`) or linked before. A reservation sold as a
/// sale of its own is none; one that names another link is refused. The
/// link is checked until the replacement's upload is staged.
pub(super) async fn link(
    core: &Core,
    c: &ChannelDoc,
    h: &super::Hook,
    deal: Option<&DealDoc>,
) -> Result<Option<Link>, CallError> {
    let store = core.store();
    let named = h.replaced_from.as_deref();
    if let Some(d) = deal {
        return match named {
            None => Ok(None),
            Some(_) if d.state == DealState::Cancelled => Err(CallError::Cancelled),
            Some(_) => Err(CallError::OrderExists),
        };
    }
    let doc = store.kinguin_upload(&c.name, &h.reservation).await?;
    let known = doc.as_ref().and_then(|d| d.replaced_from.clone());
    let old = match (known.as_deref(), named) {
        (None, None) => return Ok(None),
        (Some(k), Some(n)) if k != n => return Err(CallError::OrderExists),
        (Some(k), _) | (None, Some(k)) => k.to_owned(),
    };
    if old == h.reservation {
        return Err(CallError::Malformed(
            "\"replacedFrom\" names the reservation itself".into(),
        ));
    }
    if let Some(d) = doc.filter(|_| known.is_some()) {
        if d.offer_id != h.offer {
            return Err(CallError::Malformed(format!(
                "reservation {:?} is of another offer",
                h.reservation
            )));
        }
        if let Some(order_id) = d.order_id {
            return Ok(Some(Link { old, order_id }));
        }
    }
    let order_id = replaced(core, c, h, &old).await?;
    let id = deal_id(&c.name, &h.reservation);
    if known.is_none()
        && store.link_kinguin_replacement(&id, &old).await?.as_deref() != Some(old.as_str())
    {
        // Staged as a sale meanwhile, or linked to another.
        return Err(CallError::OrderExists);
    }
    Ok(Some(Link { old, order_id }))
}

/// The order of the key of reservation `old` that `h` replaces: `old`
/// must be this channel's, of the same offer, its key given.
async fn replaced(
    core: &Core,
    c: &ChannelDoc,
    h: &super::Hook,
    old: &str,
) -> Result<String, CallError> {
    let doc = (core.store().kinguin_upload(&c.name, old).await?)
        .filter(|d| d.upload.is_some())
        .ok_or_else(|| CallError::UnknownDeal(old.to_owned()))?;
    if doc.offer_id != h.offer {
        return Err(CallError::Malformed(format!(
            "\"replacedFrom\" names reservation {old:?} of another offer"
        )));
    }
    if doc.upload == Some(UploadState::Cancelled) {
        return Err(CallError::Cancelled);
    }
    if doc.code_id.is_none() {
        return Err(CallError::Retry(format!(
            "the key of reservation {old:?} is not given yet"
        )));
    }
    Ok(doc
        .order_id
        .unwrap_or_else(|| crate::channels::order_id_of(c, old)))
}

/// Acts on webhook `h` of a replacement (see the module doc).
pub(super) async fn webhook(
    core: &Core,
    c: &ChannelDoc,
    h: &super::Hook,
    link: &Link,
) -> Result<Done, CallError> {
    match h.status.as_str() {
        "BUYING" => Ok(Done::Linked),
        "BOUGHT" => bought(core, c, h, link).await,
        s if super::CANCELLING.contains(&s) => cancelled(core, c, h).await,
        "DELIVERED" => super::delivered(core, c, h).await,
        _ => Ok(Done::Recorded),
    }
}

/// BOUGHT: the key replaced, its upload staged then due.
async fn bought(
    core: &Core,
    c: &ChannelDoc,
    h: &super::Hook,
    link: &Link,
) -> Result<Done, CallError> {
    let store = core.store();
    let id = deal_id(&c.name, &h.reservation);
    let line = crate::channels::line_of(c, &h.offer, 1)?;
    let pool = line.pool.clone();
    let before = store.kinguin_upload(&c.name, &h.reservation).await?;
    let staged_before = before.as_ref().and_then(|d| d.upload);
    if staged_before == Some(UploadState::Cancelled) {
        return Err(CallError::Cancelled);
    }
    // Nothing is voided for a line that would wait: refused before.
    if staged_before.is_none() && store.unissued_stock(&pool).await? == 0 {
        stock::refused_for_stock(c, &[line]);
        return Err(CallError::Unavailable(format!(
            "pool {pool:?} has no free code"
        )));
    }
    let due =
        DateTime::from_millis(DateTime::now().timestamp_millis() + STAGED_GRACE.as_millis() as i64);
    let order = &link.order_id;
    let staged =
        (store.stage_kinguin_upload(&c.name, &h.reservation, order, &super::request_id(), due))
            .await?;
    if staged.and_then(|s| s.upload) == Some(UploadState::Cancelled) {
        return Err(CallError::Cancelled);
    }
    let (rid, reason) = (replacement_id(c, &h.reservation), reason_of(link));
    let actor = Actor {
        who: placed_by(&c.name),
        via: format!("Kinguin BOUGHT {} (replacing {})", h.reservation, link.old),
    };
    let done = match core.replace(&ask_of(link, &rid, &reason), &actor).await {
        Ok(done) => done,
        Err(e) => {
            if !e.is_unavailable() {
                store.unstage_kinguin_upload(&id).await?;
            }
            return Err(refused(e));
        }
    };
    stock::changed([pool.as_str()]);
    if let Some(code) = &done.code {
        store.set_kinguin_code(&id, &code.id.to_string()).await?;
    }
    store.kinguin_upload_due_now(&id).await?;
    // A cancellation that came meanwhile dropped the upload: the key it
    // would have sent goes too.
    if (store.kinguin_upload(&c.name, &h.reservation).await?)
        .is_some_and(|d| d.upload == Some(UploadState::Cancelled))
    {
        void_given(core, c, h).await?;
        return Err(CallError::Cancelled);
    }
    Ok(Done::Replaced)
}

/// A cancellation of a replacement: the upload closed, the new key (once
/// given) voided.
async fn cancelled(core: &Core, c: &ChannelDoc, h: &super::Hook) -> Result<Done, CallError> {
    let id = deal_id(&c.name, &h.reservation);
    core.store().close_kinguin_upload(&id).await?;
    if void_given(core, c, h).await? {
        Ok(Done::Voided)
    } else {
        Ok(Done::Released)
    }
}

/// Voids the key a replacement was given, if it was; whether it was.
async fn void_given(core: &Core, c: &ChannelDoc, h: &super::Hook) -> Result<bool, CallError> {
    let doc = core.store().kinguin_upload(&c.name, &h.reservation).await?;
    let Some(code_id) = doc.and_then(|d| d.code_id) else {
        return Ok(false);
    };
    let id = CodeId::parse(&code_id).map_err(|e| CallError::Failed(e.to_string()))?;
    let actor = Actor {
        who: placed_by(&c.name),
        via: format!("Kinguin {} {}", h.status, h.reservation),
    };
    crate::channels::void_sold(core, codepool_store::lifecycle::CodeRef::Id(id), &actor).await?;
    Ok(true)
}

/// The key of a replacement's upload `u` whose code is not recorded:
/// the same replacement again (finished now, if the process that began it
/// died), its code recorded. `Ok(Err)`: none will ever be sent.
pub(super) async fn key_of(
    core: &Core,
    c: &ChannelDoc,
    u: &UploadDoc,
) -> Result<Result<String, String>, String> {
    let (Some(old), Some(order_id)) = (u.replaced_from.clone(), u.order_id.clone()) else {
        return Ok(Err("the replacement names no reservation".into()));
    };
    let link = Link { old, order_id };
    let (rid, reason) = (replacement_id(c, &u.reservation_id), reason_of(&link));
    let actor = Actor {
        who: placed_by(&c.name),
        via: format!(
            "Kinguin upload {} (replacing {})",
            u.reservation_id, link.old
        ),
    };
    let done = match core.replace(&ask_of(&link, &rid, &reason), &actor).await {
        Ok(done) => done,
        Err(e) if e.is_unavailable() => return Err(e.to_string()),
        Err(e) => return Ok(Err(e.to_string())),
    };
    let Some(code) = done.code else {
        return Err("the replacement waits for stock".into());
    };
    let _ = core
        .store()
        .set_kinguin_code(&u.id, &code.id.to_string())
        .await;
    if code.status == CodeStatus::Void {
        return Ok(Err("the key was voided".into()));
    }
    Ok(Ok(code.code))
}
