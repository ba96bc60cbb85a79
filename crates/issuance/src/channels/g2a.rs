//! What G2A's Dropshipping API needs beyond the shared operations: the
//! OAuth2 client-credentials tokens codepool issues to G2A (kept by their
//! hash, each with its expiry), a reservation's renewal (a new hold when
//! the old one ran out), its release, and returns by item id.

use bson::DateTime;
use codepool_store::channels::{ChannelDoc, DealState, TokenDoc};
use rand::RngCore;

use super::{
    hold, hold_id_of, keys_of, release, still_held, taking, CallError, Holder, Kind, Placer,
};
use crate::audit::Actor;

/// Issues an access token to G2A for channel `name` when `client_id` and
/// `client_secret` are the channel's: the token and its life in seconds.
pub async fn issue_token(
    store: &codepool_store::Store,
    name: &str,
    client_id: &str,
    client_secret: &str,
) -> Result<(String, u64), CallError> {
    let c = super::authorized(store, name, Kind::G2a, Some(client_secret)).await?;
    let id_ok: bool = subtle::ConstantTimeEq::ct_eq(
        c.client_id.as_deref().unwrap_or_default().as_bytes(),
        client_id.as_bytes(),
    )
    .into();
    if !id_ok {
        return Err(CallError::Unauthorized);
    }
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let token = hex::encode(bytes);
    let ttl = c
        .token_ttl_seconds
        .unwrap_or(super::DEFAULT_TOKEN_TTL_SECONDS as i64)
        .max(1);
    let expires_at = DateTime::from_millis(DateTime::now().timestamp_millis() + ttl * 1000);
    store
        .insert_channel_token(&TokenDoc {
            hash: super::secret_hash(&token),
            channel: c.name.clone(),
            expires_at,
        })
        .await?;
    Ok((token, ttl as u64))
}

/// The G2A channel `name` when `token` is an access token codepool issued
/// to it and not expired.
pub async fn verify_token(
    store: &codepool_store::Store,
    name: &str,
    token: Option<&str>,
) -> Result<ChannelDoc, CallError> {
    let c = match store.channel(name).await? {
        Some(c) if c.kind == Kind::G2a.as_str() => c,
        _ => return Err(CallError::UnknownChannel),
    };
    let Some(token) = token else {
        return Err(CallError::Unauthorized);
    };
    match store.channel_token(&super::secret_hash(token)).await? {
        Some(t) if t.channel == c.name && t.expires_at > DateTime::now() => Ok(c),
        _ => Err(CallError::Unauthorized),
    }
}

/// A new reservation id: a random UUID (version 4).
pub fn new_reservation_id() -> String {
    let mut b = [0u8; 16];
    rand::rng().fill_bytes(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Renews a reservation: one whose hold still holds stands as it is; one
/// whose hold ran out holds its lines again under a new hold, all or
/// nothing.
pub(crate) async fn renew(
    core: &crate::Core,
    holder: &dyn Holder,
    c: &ChannelDoc,
    rid: &str,
) -> Result<codepool_store::channels::DealDoc, CallError> {
    let store = core.store();
    let d =
        (store.deal(&c.name, rid).await?).ok_or_else(|| CallError::UnknownDeal(rid.to_owned()))?;
    match d.state {
        DealState::Cancelled => return Err(CallError::Cancelled),
        DealState::Provided => return Err(CallError::OrderExists),
        DealState::Reserved => {}
    }
    if still_held(core, c, &d).await? {
        return Ok(d);
    }
    taking(c)?;
    let new_hold = hold_id_of(c, rid, d.holds.max(1));
    hold(core, holder, c, rid, &d.lines, &new_hold).await?;
    if !store
        .renew_deal(&c.name, rid, &d.hold_id, &new_hold)
        .await?
    {
        release(core, c, &new_hold).await?;
        return Err(CallError::Cancelled);
    }
    (store.deal(&c.name, rid).await?).ok_or_else(|| CallError::UnknownDeal(rid.to_owned()))
}

/// Releases a reservation not ordered yet: its codes go back to stock.
/// A reservation released before is released again: the process that
/// recorded its release may have died before it released the hold (G2A
/// calls again), and a hold released twice is released once.
pub(crate) async fn release_reservation(
    core: &crate::Core,
    c: &ChannelDoc,
    rid: &str,
) -> Result<(), CallError> {
    let store = core.store();
    let d =
        (store.deal(&c.name, rid).await?).ok_or_else(|| CallError::UnknownDeal(rid.to_owned()))?;
    match d.state {
        DealState::Provided => return Err(CallError::OrderExists),
        DealState::Cancelled => return release(core, c, &d.hold_id).await,
        DealState::Reserved => {}
    }
    let moved = store
        .move_deal(
            &c.name,
            rid,
            &[DealState::Reserved],
            DealState::Cancelled,
            None,
        )
        .await?;
    if moved.is_none() {
        // Ordered meanwhile.
        return Err(CallError::OrderExists);
    }
    if let Some(pause) = crate::failpoint::pause("channel-cancel-pause") {
        // Recorded released, its hold not released yet.
        tokio::time::sleep(pause).await;
    }
    release(core, c, &d.hold_id).await
}

/// Takes back the items `ids` of an ordered reservation: each is voided
/// (it was shown to G2A, so it never returns to stock). Every id must be
/// one of the order's items, or nothing changes.
pub(crate) async fn return_items(
    core: &crate::Core,
    placer: &dyn Placer,
    c: &ChannelDoc,
    rid: &str,
    ids: &[String],
) -> Result<usize, CallError> {
    let store = core.store();
    let d =
        (store.deal(&c.name, rid).await?).ok_or_else(|| CallError::UnknownDeal(rid.to_owned()))?;
    if d.state == DealState::Reserved {
        return Err(CallError::UnknownDeal(rid.to_owned()));
    }
    let via = format!("G2A DELETE /order/{rid}/inventory");
    let keys = keys_of(core, placer, c, &d, &via).await?;
    let mut targets = Vec::new();
    for id in ids {
        let Some(k) = keys.iter().find(|k| &k.id == id) else {
            return Err(CallError::UnknownProduct(id.chars().take(40).collect()));
        };
        if !k.revoked {
            targets.push(k.id.clone());
        }
    }
    let actor = Actor {
        who: super::placed_by(&c.name),
        via,
    };
    for id in &targets {
        let Ok(code_id) = codepool_domain::CodeId::parse(id) else {
            continue;
        };
        match core
            .void(
                codepool_store::lifecycle::CodeRef::Id(code_id),
                "channel: returned by the marketplace",
                &actor,
            )
            .await
        {
            Ok(_) => {}
            Err(crate::ops::VoidError::Lifecycle(
                codepool_store::lifecycle::LifecycleError::Store(e),
            )) => return Err(e.into()),
            Err(e) => tracing::warn!(code_id = %id, error = %e, "a returned key was not voided"),
        }
    }
    Ok(targets.len())
}
