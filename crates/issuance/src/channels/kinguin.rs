//! Kinguin's declared (text) stock, a push protocol: Kinguin reports each
//! reservation's status by webhook (one reservation per key), and the
//! supplier uploads the key through Kinguin's API naming the
//! `reservationId`.
//!
//! - `BUYING` holds one key of the offer's pool under the hold derived
//!   from the channel and `reservationId`.
//! - `BOUGHT` stages the upload (written before the key is committed, so a
//!   process that dies after the commit leaves the upload to be done),
//!   commits the hold into the order derived from the channel and
//!   `reservationId`, and records which code it got. The [`Uploader`] of
//!   every API process sends it, with retries, always the same key.
//! - `CANCELED`, `REFUNDED`, `REVERSED` and `RETURNED` (the buyer returned
//!   the key) release the hold before BOUGHT, and void the key after (it
//!   may have been shown): never back in stock. A cancellation that comes
//!   first leaves a cancelled record: a later BUYING or BOUGHT gets
//!   nothing.
//! - `DELIVERED` records Kinguin's `releasedStockId`.
//! - Any other status is recorded and changes nothing.
//! - A reservation whose webhooks carry `replacedFrom` is a replacement of
//!   another reservation's key ([`replace`]).
//!
//! Every webhook is idempotent: Kinguin retries, and the same webhook
//! twice changes nothing more.

pub mod client;
mod replace;

use std::sync::Arc;
use std::time::Duration;

use bson::DateTime;
use codepool_domain::CodeStatus;
use codepool_store::channels::{deal_id, ChannelDoc, DealDoc, DealState};
use codepool_store::kinguin::{AttemptEnd, UploadDoc};
use codepool_store::Store;
use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{CallError, Holder, Kind, Placer};
use crate::Core;

pub use codepool_store::kinguin::UploadState;

/// The statuses that cancel a reservation (and return its key, once
/// given).
const CANCELLING: [&str; 4] = ["CANCELED", "REFUNDED", "REVERSED", "RETURNED"];

/// One webhook of Kinguin, as read from its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hook {
    pub reservation: String,
    pub offer: String,
    /// Kinguin's order id, when the webhook names it.
    pub order: Option<String>,
    /// Upper case.
    pub status: String,
    /// DELIVERED: the stock Kinguin released to the buyer.
    pub released_stock_id: Option<String>,
    /// A replacement's: the reservation whose key it replaces.
    pub replaced_from: Option<String>,
}

/// Reads a webhook's body: `{reservationId, offerId, status, orderId?,
/// releasedStockId?, replacedFrom?, …}`; other fields are ignored.
pub fn read(body: &[u8]) -> Result<Hook, String> {
    let map: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| format!("the body is not a JSON object: {e}"))?;
    let id = |field: &str| -> Result<Option<String>, String> {
        match map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if super::valid_external_id(s) => Ok(Some(s.clone())),
            // Kinguin's ids may be numbers.
            Some(Value::Number(n)) if n.is_u64() => Ok(Some(n.to_string())),
            Some(_) => Err(format!(
                "{field:?} must be an id of 1 to {} characters from A-Z a-z 0-9 _ -",
                super::MAX_EXTERNAL_ID
            )),
        }
    };
    let reservation = id("reservationId")?.ok_or("\"reservationId\" is missing")?;
    let offer = id("offerId")?.ok_or("\"offerId\" is missing")?;
    let order = id("orderId")?;
    let replaced_from = id("replacedFrom")?;
    let status = match map.get("status").and_then(Value::as_str) {
        Some(s)
            if (1..=40).contains(&s.len())
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') =>
        {
            s.to_ascii_uppercase()
        }
        _ => return Err(
            "\"status\" must be a reservation status such as BUYING, BOUGHT, CANCELED or DELIVERED"
                .into(),
        ),
    };
    let released_stock_id = match map.get("releasedStockId") {
        Some(Value::String(s)) => Some(s.chars().take(100).collect()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    Ok(Hook {
        reservation,
        offer,
        order,
        status,
        released_stock_id,
        replaced_from,
    })
}

/// What a webhook did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Done {
    /// BUYING: one key held.
    Held,
    /// BOUGHT: the key committed, its upload staged.
    Bought,
    /// Cancelled before BOUGHT: the hold released (or there was none).
    Released,
    /// Cancelled after BOUGHT: the key voided.
    Voided,
    /// DELIVERED recorded.
    Delivered,
    /// BUYING of a replacement: its link checked and recorded; nothing
    /// held (the key is replaced at BOUGHT).
    Linked,
    /// BOUGHT of a replacement: the key replaced, its upload staged.
    Replaced,
    /// Another status, recorded.
    Recorded,
}

impl Done {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::Bought => "bought",
            Self::Released => "released",
            Self::Voided => "voided",
            Self::Delivered => "delivered",
            Self::Linked => "linked",
            Self::Replaced => "replaced",
            Self::Recorded => "recorded",
        }
    }
}

impl Core {
    /// The Kinguin channel `name` when `presented` is its webhook secret.
    pub async fn kinguin_authorized(
        &self,
        name: &str,
        presented: Option<&str>,
    ) -> Result<ChannelDoc, CallError> {
        super::authorized(self.store(), name, Kind::Kinguin, presented).await
    }

    /// Acts on one webhook of Kinguin (see the module doc).
    pub async fn kinguin_webhook(
        &self,
        holder: &dyn Holder,
        placer: &dyn Placer,
        c: &ChannelDoc,
        h: &Hook,
    ) -> Result<Done, CallError> {
        webhook(self, holder, placer, c, h).await
    }

    /// A Kinguin reservation's record.
    pub async fn kinguin_upload(
        &self,
        c: &ChannelDoc,
        reservation: &str,
    ) -> Result<Option<UploadDoc>, CallError> {
        Ok(self.store().kinguin_upload(&c.name, reservation).await?)
    }
}

async fn webhook(
    core: &Core,
    holder: &dyn Holder,
    placer: &dyn Placer,
    c: &ChannelDoc,
    h: &Hook,
) -> Result<Done, CallError> {
    let store = core.store();
    let deal = store.deal(&c.name, &h.reservation).await?;
    if deal.is_none() && !c.products.contains_key(&h.offer) {
        return Err(CallError::UnknownProduct(h.offer.clone()));
    }
    if let Some(d) = &deal {
        if d.lines.first().is_some_and(|l| l.product != h.offer) {
            return Err(CallError::Malformed(format!(
                "reservation {:?} is of another offer",
                h.reservation
            )));
        }
    }
    store
        .note_kinguin_status(
            &c.name,
            &h.reservation,
            &h.offer,
            h.order.as_deref(),
            &h.status,
        )
        .await?;
    if let Some(link) = replace::link(core, c, h, deal.as_ref()).await? {
        return replace::webhook(core, c, h, &link).await;
    }
    match h.status.as_str() {
        "BUYING" => {
            buying(core, holder, c, h).await?;
            Ok(Done::Held)
        }
        "BOUGHT" => bought(core, holder, placer, c, h, deal).await,
        s if CANCELLING.contains(&s) => cancelled(core, placer, c, h, deal).await,
        "DELIVERED" => delivered(core, c, h).await,
        _ => Ok(Done::Recorded),
    }
}

/// DELIVERED: the key reached its buyer (of a sale or a replacement).
async fn delivered(core: &Core, c: &ChannelDoc, h: &Hook) -> Result<Done, CallError> {
    (core.store())
        .note_kinguin_delivered(
            &deal_id(&c.name, &h.reservation),
            h.released_stock_id.as_deref(),
        )
        .await?;
    Ok(Done::Delivered)
}

/// Holds one key for the reservation (again: the same hold).
async fn buying(
    core: &Core,
    holder: &dyn Holder,
    c: &ChannelDoc,
    h: &Hook,
) -> Result<DealDoc, CallError> {
    let line = super::line_of(c, &h.offer, 1)?;
    match super::reserve(core, holder, c, &h.reservation, vec![line]).await {
        Err(CallError::Cancelled) => {
            // Cancelled while it was being held: what it held goes back.
            super::release(core, c, &super::hold_id_of(c, &h.reservation, 0)).await?;
            Err(CallError::Cancelled)
        }
        other => other,
    }
}

/// A new `requestId` for an upload: a random UUID.
fn request_id() -> String {
    super::g2a::new_reservation_id()
}

async fn bought(
    core: &Core,
    holder: &dyn Holder,
    placer: &dyn Placer,
    c: &ChannelDoc,
    h: &Hook,
    deal: Option<DealDoc>,
) -> Result<Done, CallError> {
    let store = core.store();
    match deal.as_ref().map(|d| d.state) {
        Some(DealState::Cancelled) => return Err(CallError::Cancelled),
        // BUYING never came (or was lost): hold now.
        None => {
            buying(core, holder, c, h).await?;
        }
        Some(DealState::Reserved) => {
            if let Some(d) = &deal {
                if !super::still_held(core, c, d).await? {
                    // The hold ran out before the buyer paid: hold again.
                    super::g2a::renew(core, holder, c, &h.reservation).await?;
                }
            }
        }
        Some(DealState::Provided) => {}
    }
    let order_id = super::order_id_of(c, &h.reservation);
    // Staged before the commit: a process that dies after the commit
    // leaves the upload to the uploaders.
    let staged = store
        .stage_kinguin_upload(
            &c.name,
            &h.reservation,
            &order_id,
            &request_id(),
            DateTime::now(),
        )
        .await?;
    let id = deal_id(&c.name, &h.reservation);
    let via = format!("Kinguin BOUGHT {}", h.reservation);
    match super::provide(core, placer, c, &h.reservation, None, &via).await {
        Ok(keys) => {
            if let Some(k) = keys.first() {
                store.set_kinguin_code(&id, &k.id).await?;
            }
            Ok(Done::Bought)
        }
        // Cancelled meanwhile: nothing to send.
        Err(CallError::Cancelled) => {
            store.cancel_kinguin_upload(&id).await?;
            Err(CallError::Cancelled)
        }
        Err(CallError::Expired) => {
            if staged.is_some_and(|s| s.upload == Some(UploadState::Pending)) {
                let why = CallError::Expired.to_string();
                store
                    .end_kinguin_attempt(&id, &AttemptEnd::Failed(why))
                    .await?;
                uploaded(c, "failed");
            }
            Err(CallError::Expired)
        }
        // Left pending: an uploader commits it (the same order) and sends.
        Err(e) => Err(e),
    }
}

async fn cancelled(
    core: &Core,
    placer: &dyn Placer,
    c: &ChannelDoc,
    h: &Hook,
    deal: Option<DealDoc>,
) -> Result<Done, CallError> {
    let store = core.store();
    if deal.is_none() {
        // First of all: a record that a later BUYING or BOUGHT finds.
        let lines = super::line_of(c, &h.offer, 1).into_iter().collect();
        let tomb = DealDoc {
            id: deal_id(&c.name, &h.reservation),
            channel: c.name.clone(),
            external_id: h.reservation.clone(),
            state: DealState::Cancelled,
            lines,
            hold_id: super::hold_id_of(c, &h.reservation, 0),
            holds: 0,
            order_id: super::order_id_of(c, &h.reservation),
            marketplace_order: None,
            cancelled_after_provide: false,
            created_at: DateTime::now(),
            updated_at: None,
            replaced: Vec::new(),
        };
        if store.insert_deal(&tomb).await? {
            super::release(core, c, &tomb.hold_id).await?;
            return Ok(Done::Released);
        }
    }
    store
        .cancel_kinguin_upload(&deal_id(&c.name, &h.reservation))
        .await?;
    // A key shown to Kinguin never returns to stock, whatever the policy.
    let burn = ChannelDoc {
        after_provide: super::AfterProvide::Burn.as_str().to_owned(),
        ..c.clone()
    };
    let via = format!("Kinguin {} {}", h.status, h.reservation);
    // A repeat racing the first sees the deal cancelled already: the
    // deal as the webhook found it says what the cancellation is.
    let after = deal.is_some_and(|d| d.state == DealState::Provided || d.cancelled_after_provide);
    match super::cancel(core, placer, &burn, &h.reservation, &via).await? {
        super::Cancelled::Released if !after => Ok(Done::Released),
        _ => Ok(Done::Voided),
    }
}

/// Counts one upload attempt's outcome.
fn uploaded(c: &ChannelDoc, outcome: &'static str) {
    metrics::counter!("codepool_channel_uploads_total", "channel" => c.name.clone(), "outcome" => outcome).increment(1);
}

/// How long a leased upload is one process's: longer than an attempt
/// (its token, upload and check), so a process killed mid-attempt leaves
/// it to the next after this.
fn lease_for(timeout: Duration) -> Duration {
    timeout * 3 + Duration::from_secs(2)
}

/// How long a call to Kinguin's API may take unless the process says
/// (`codepool api --channel-call-timeout`).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// How often an idle uploader looks for due uploads.
const IDLE: Duration = Duration::from_millis(200);

/// The wait before attempt `n + 1` after `n` failed: exponential from
/// 250 ms, doubling, at most a minute, with jitter.
pub fn backoff(n: u32) -> Duration {
    use backon::BackoffBuilder;
    const MAX: Duration = Duration::from_secs(60);
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(MAX)
        .with_jitter()
        .without_max_times()
        .build()
        .nth(n.saturating_sub(1).min(30) as usize)
        .unwrap_or(MAX)
}

/// Sends the staged uploads of every Kinguin channel to Kinguin, one at
/// a time, each leased so no two processes send it at once, retried with
/// [`backoff`] until Kinguin holds the key codepool sent, or refuses it
/// for good. Every granting process runs one: the API's also commits
/// what a process that died left staged, the dispatcher's only sends.
pub struct Uploader {
    store: Store,
    /// The core and the door that commit an upload staged by a process
    /// that died before its commit (the API's). Without them (the
    /// dispatcher), only uploads whose key is committed are sent.
    commits: Option<(Arc<Core>, Arc<dyn Placer>)>,
    client: reqwest::Client,
    timeout: Duration,
    /// Kinguin's bearer tokens, shared with the process's declarer.
    tokens: Arc<client::Tokens>,
}

/// An attempt's failure before Kinguin answered: try again later.
struct Later(String);

impl Uploader {
    /// An uploader whose every call to Kinguin takes at most `timeout`,
    /// committing through `placer` what a dead process left uncommitted.
    pub fn new(core: Arc<Core>, placer: Arc<dyn Placer>, timeout: Duration) -> Arc<Self> {
        let store = core.store().clone();
        let tokens = core.parts().kinguin_tokens.clone();
        Self::build(store, tokens, Some((core, placer)), timeout)
    }

    /// An uploader of a process that places no channel orders (the
    /// dispatcher): it sends the uploads whose key is committed.
    pub fn sending(parts: &crate::background::Parts, timeout: Duration) -> Arc<Self> {
        let tokens = parts.kinguin_tokens.clone();
        Self::build(parts.store.clone(), tokens, None, timeout)
    }

    fn build(
        store: Store,
        tokens: Arc<client::Tokens>,
        commits: Option<(Arc<Core>, Arc<dyn Placer>)>,
        timeout: Duration,
    ) -> Arc<Self> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        Arc::new(Self {
            store,
            commits,
            client,
            timeout,
            tokens,
        })
    }

    fn store(&self) -> &Store {
        &self.store
    }

    /// Sends due uploads until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let lease = lease_for(self.timeout);
        while !stop.is_cancelled() {
            let committed_only = self.commits.is_none();
            let next = match self
                .store()
                .lease_kinguin_upload(lease, committed_only)
                .await
            {
                Ok(Some(u)) => u,
                Ok(None) => {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(IDLE) => continue,
                    }
                }
                Err(e) => {
                    warn!(error = %e, "Kinguin uploads could not be read; trying again");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            let end = self.attempt(&next).await;
            if let Err(e) = self.store().end_kinguin_attempt(&next.id, &end).await {
                warn!(error = %e, reservation = %next.reservation_id, "a Kinguin upload's attempt was not recorded; its lease runs out and it is tried again");
            }
        }
    }

    /// One attempt of `u`: what it ended in.
    async fn attempt(&self, u: &UploadDoc) -> AttemptEnd {
        let c = match self.store().channel(&u.channel).await {
            Ok(Some(c)) if c.kind == Kind::Kinguin.as_str() => c,
            Ok(_) => return AttemptEnd::Failed("the channel was removed".into()),
            Err(e) => return self.later(u, None, e.to_string()),
        };
        let key = match self.key_of(&c, u).await {
            Ok(Ok(k)) => k,
            Ok(Err(why)) => {
                uploaded(&c, "failed");
                warn!(channel = %c.name, reservation = %u.reservation_id, why, "a Kinguin key is not uploaded");
                return AttemptEnd::Failed(why);
            }
            Err(Later(why)) => return self.later(u, Some(&c), why),
        };
        match self.upload(&c, u, &key).await {
            Ok(end) => {
                match &end {
                    AttemptEnd::Uploaded => {
                        uploaded(&c, "uploaded");
                        info!(channel = %c.name, reservation = %u.reservation_id, attempts = u.attempts, "a Kinguin key uploaded");
                    }
                    AttemptEnd::Failed(why) => {
                        uploaded(&c, "failed");
                        warn!(channel = %c.name, reservation = %u.reservation_id, key = %codepool_domain::code::mask(&key), why = %why, "a Kinguin upload failed for good");
                    }
                    AttemptEnd::Retry { .. } => uploaded(&c, "retried"),
                }
                end
            }
            Err(Later(why)) => self.later(u, Some(&c), why),
        }
    }

    /// Tries again after [`backoff`].
    fn later(&self, u: &UploadDoc, c: Option<&ChannelDoc>, error: String) -> AttemptEnd {
        if let Some(c) = c {
            uploaded(c, "retried");
        }
        let wait = backoff(u.attempts);
        tracing::debug!(reservation = %u.reservation_id, attempts = u.attempts, ?wait, error = %error, "a Kinguin upload is tried again");
        AttemptEnd::Retry {
            due: DateTime::from_millis(
                DateTime::now().timestamp_millis() + wait.as_millis() as i64,
            ),
            error: error.chars().take(300).collect(),
        }
    }

    /// The reservation's key: its order's code (committed now if the
    /// process that staged the upload died before). `Ok(Err)`: none will
    /// ever be sent.
    async fn key_of(&self, c: &ChannelDoc, u: &UploadDoc) -> Result<Result<String, String>, Later> {
        if u.replaced_from.is_some() && u.code_id.is_none() {
            let Some((core, _)) = &self.commits else {
                return Err(Later("the replacement's key is not recorded yet".into()));
            };
            return replace::key_of(core, c, u).await.map_err(Later);
        }
        let order_id = u
            .order_id
            .clone()
            .unwrap_or_else(|| super::order_id_of(c, &u.reservation_id));
        let codes = (self.store().grants_for_orders(&[order_id.as_str()]).await)
            .map_err(|e| Later(e.to_string()))?;
        let code = codes.get(&order_id).and_then(|cs| cs.first()).cloned();
        let code = match code {
            Some(code) => code,
            None => {
                let Some((core, placer)) = &self.commits else {
                    return Err(Later("the key is not committed yet".into()));
                };
                let via = format!("Kinguin upload {}", u.reservation_id);
                match super::provide(core, &**placer, c, &u.reservation_id, None, &via).await {
                    Ok(keys) => match keys.into_iter().next() {
                        Some(k) => {
                            let _ = self.store().set_kinguin_code(&u.id, &k.id).await;
                            return Ok(Ok(k.value));
                        }
                        None => return Ok(Err("the order has no key".into())),
                    },
                    Err(e @ (CallError::Cancelled | CallError::Expired)) => {
                        return Ok(Err(e.to_string()))
                    }
                    Err(e) => return Err(Later(e.to_string())),
                }
            }
        };
        if u.code_id
            .as_deref()
            .is_some_and(|id| id != code.id.to_string())
        {
            return Ok(Err("the order's key is not the one recorded".into()));
        }
        if code.status == CodeStatus::Void {
            return Ok(Err("the key was voided".into()));
        }
        // A sale's key not recorded yet is its order's first one: a key
        // given by a replacement since is the replacement's to upload.
        if u.code_id.is_none() && code.holder.as_ref().is_some_and(|h| h.replacement > 0) {
            return Ok(Err("the reservation's key was replaced".into()));
        }
        if u.code_id.is_none() {
            let _ = self
                .store()
                .set_kinguin_code(&u.id, &code.id.to_string())
                .await;
        }
        Ok(Ok(code.code))
    }

    fn base(c: &ChannelDoc) -> Result<String, Later> {
        client::base(c).map_err(Later)
    }

    /// A bearer token for Kinguin's API ([`client::Tokens`]): the one in
    /// hand unless Kinguin `refused` it.
    async fn token(&self, c: &ChannelDoc, refused: Option<&str>) -> Result<String, Later> {
        (self
            .tokens
            .get(&self.client, self.store(), c, refused)
            .await)
            .map_err(Later)
    }

    /// Sends `key`; a 401 fetches a new token and sends once more.
    async fn upload(&self, c: &ChannelDoc, u: &UploadDoc, key: &str) -> Result<AttemptEnd, Later> {
        let base = Self::base(c)?;
        let url = format!("{base}/api/v1/offers/{}/stock", u.offer_id);
        let body = json!({
            "body": key,
            "mimeType": "text/plain",
            "reservationId": u.reservation_id,
            "requestId": u.request_id.clone().unwrap_or_else(|| u.id.clone()),
        })
        .to_string();
        let mut refused = None;
        loop {
            let token = self.token(c, refused.as_deref()).await?;
            let res = self
                .client
                .post(&url)
                .bearer_auth(&token)
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .map_err(|e| Later(format!("upload: {e}")))?;
            let status = res.status().as_u16();
            let text = res.text().await.unwrap_or_default();
            let text: String = text.chars().take(300).collect();
            return match status {
                200..=299 => Ok(AttemptEnd::Uploaded),
                401 if refused.is_none() => {
                    refused = Some(token);
                    continue;
                }
                409 if text.to_ascii_lowercase().contains("already uploaded") => {
                    self.verify(c, u, key, &token).await
                }
                400 => Ok(AttemptEnd::Failed(format!(
                    "Kinguin refused the upload: {text}"
                ))),
                // 409 "being proceeded", 401 again, 429, 5xx.
                _ => Err(Later(format!("upload: {status} {text}"))),
            };
        }
    }

    /// "Stock already uploaded": a success only if the stock Kinguin
    /// holds for the reservation is `key`.
    async fn verify(
        &self,
        c: &ChannelDoc,
        u: &UploadDoc,
        key: &str,
        token: &str,
    ) -> Result<AttemptEnd, Later> {
        let base = Self::base(c)?;
        let url = format!("{base}/api/v1/offers/{}/stock", u.offer_id);
        let res = self
            .client
            .get(&url)
            .query(&[("reservationId", u.reservation_id.as_str())])
            .bearer_auth(token)
            .send()
            .await
            .map_err(|e| Later(format!("stock check: {e}")))?;
        let status = res.status();
        if !status.is_success() {
            return Err(Later(format!("stock check: {status}")));
        }
        let bytes = (res.bytes().await).map_err(|e| Later(format!("stock check: {e}")))?;
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| Later(format!("stock check: not JSON: {e}")))?;
        Ok(match holds_key(&v, &u.reservation_id, key) {
            Some(true) => AttemptEnd::Uploaded,
            Some(false) => {
                AttemptEnd::Failed("Kinguin holds another key for the reservation".into())
            }
            None => AttemptEnd::Failed(
                "Kinguin says the stock was uploaded but lists none for the reservation".into(),
            ),
        })
    }
}

/// Whether Kinguin's stock listing (an array, or a page with `content`)
/// holds `key` for `reservation`: `None` when it lists no stock of it.
pub fn holds_key(listing: &Value, reservation: &str, key: &str) -> Option<bool> {
    let items = listing
        .as_array()
        .or_else(|| listing["content"].as_array())?;
    let mine: Vec<&Value> = items
        .iter()
        .filter(|i| i["reservationId"].as_str().is_none_or(|r| r == reservation))
        .collect();
    if mine.is_empty() {
        return None;
    }
    Some(mine.iter().any(|i| i["body"].as_str() == Some(key)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_webhook_names_its_reservation_offer_and_status() {
        let h = read(br#"{"reservationId":"r-1","offerId":"off-9","orderId":"KO1","status":"bought","productId":"x"}"#).unwrap();
        assert_eq!(h.reservation, "r-1");
        assert_eq!(h.offer, "off-9");
        assert_eq!(h.order.as_deref(), Some("KO1"));
        assert_eq!(h.status, "BOUGHT");
        let d = read(
            br#"{"reservationId":17,"offerId":"o","status":"DELIVERED","releasedStockId":"s-5"}"#,
        )
        .unwrap();
        assert_eq!(d.reservation, "17");
        assert_eq!(d.released_stock_id.as_deref(), Some("s-5"));
        assert_eq!(d.replaced_from, None);
        let r = read(
            br#"{"reservationId":"r-2","offerId":"o","status":"BOUGHT","replacedFrom":"r-1"}"#,
        )
        .unwrap();
        assert_eq!(r.replaced_from.as_deref(), Some("r-1"));
        for bad in [
            &b"[1]"[..],
            br#"{"offerId":"o","status":"BUYING"}"#,
            br#"{"reservationId":"r","status":"BUYING"}"#,
            br#"{"reservationId":"r","offerId":"o"}"#,
            br#"{"reservationId":"r/1","offerId":"o","status":"BUYING"}"#,
            br#"{"reservationId":"r","offerId":"o","status":"BUY ING"}"#,
            br#"{"reservationId":"r","offerId":"o","status":"BOUGHT","replacedFrom":{"$ne":1}}"#,
        ] {
            assert!(read(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn already_uploaded_counts_only_when_kinguin_holds_the_same_key() {
        let list = json!([{"reservationId": "r-1", "body": "AAAA"}, {"reservationId": "r-2", "body": "BBBB"}]);
        assert_eq!(holds_key(&list, "r-1", "AAAA"), Some(true));
        assert_eq!(holds_key(&list, "r-1", "BBBB"), Some(false));
        assert_eq!(holds_key(&list, "r-3", "AAAA"), None);
        let page = json!({"content": [{"reservationId": "r-1", "body": "AAAA"}]});
        assert_eq!(holds_key(&page, "r-1", "AAAA"), Some(true));
        assert_eq!(holds_key(&json!({}), "r-1", "AAAA"), None);
    }

    #[test]
    fn retries_back_off_exponentially_up_to_a_minute() {
        assert!(backoff(1) <= Duration::from_millis(500));
        assert!(backoff(6) >= Duration::from_secs(8));
        assert!(backoff(100) <= Duration::from_secs(120));
    }
}
