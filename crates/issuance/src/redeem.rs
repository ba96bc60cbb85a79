//! Redemption by code, for the platform that honours the codes: `check`
//! tells what became of a code, `redeem` uses it, exactly once.
//!
//! A code is found by its keyed hashes only ([`Store::find_by_value`]),
//! never decrypted to be found, and only among the pools the platform's
//! key may see (its shop's, or every pool for a key of no shop). The
//! answer is never an oracle for guessing codes: a code the key may not
//! see, a code never issued (in stock, held, or expired or recalled before
//! it was sold) and a code that does not exist are one answer, `None`,
//! from the same single query. The redemption itself is the one core
//! function every door uses ([`ops::redeem`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use codepool_domain::{CodeStatus, LookAlikeRule};
use codepool_store::lifecycle::{CodeRef, LifecycleError, Redeemed, RedemptionTag, Sold};
use codepool_store::{Store, StoreError};
use tokio::sync::Mutex;

use crate::audit::Actor;
use crate::ops;

/// How long the pools and their look-alike rules are kept before they are
/// read again: a new pool (or a shop's new pool) is searched within this.
pub const POOLS_TTL: Duration = Duration::from_secs(2);

/// Longest redemption id accepted.
pub const MAX_REDEMPTION_ID_CHARS: usize = 128;

/// What a platform may know of a code it names: its state, its pool, its
/// grant number and line; never the buyer, the phone or the order.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub state: SeenState,
    pub pool: String,
    pub grant_no: Option<String>,
    pub line: u32,
    pub issued_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum SeenState {
    Issued,
    Used {
        at: Option<DateTime<Utc>>,
    },
    Void {
        at: Option<DateTime<Utc>>,
        reason: String,
    },
}

impl SeenState {
    pub fn as_str(&self) -> &'static str {
        match self {
            SeenState::Issued => "issued",
            SeenState::Used { .. } => "used",
            SeenState::Void { .. } => "void",
        }
    }
}

impl Seen {
    /// The code as a platform may see it; `None` for a code that was never
    /// issued to an order (in stock, held, void before it was sold).
    pub fn of(code: &Sold) -> Option<Seen> {
        let state = match code.status {
            CodeStatus::Issued => SeenState::Issued,
            CodeStatus::Used => SeenState::Used { at: code.used_at },
            CodeStatus::Void => SeenState::Void {
                at: code.voided_at,
                reason: code.void_reason.clone().unwrap_or_default(),
            },
            CodeStatus::Unissued | CodeStatus::Held => return None,
        };
        Some(Seen {
            state,
            pool: code.pool.clone(),
            grant_no: code.grant_no.clone(),
            line: code.line,
            issued_at: code.issued_at,
        })
    }
}

/// Why a redemption by code was refused. [`RedeemError::Unknown`] is one
/// answer for every code the key may not learn about.
#[derive(Debug, thiserror::Error)]
pub enum RedeemError {
    #[error("no code issued to an order matches; check that it was typed as printed")]
    Unknown,
    #[error("the code was already redeemed at {}", codepool_domain::when(*.at))]
    AlreadyRedeemed { at: Option<DateTime<Utc>> },
    #[error("the code was voided ({reason}); it cannot be redeemed")]
    Void {
        at: Option<DateTime<Utc>>,
        reason: String,
    },
    #[error("redemption id {0:?} already redeemed another code; send a new id for each code")]
    ConflictingId(String),
    #[error("a redemption id is 1 to {MAX_REDEMPTION_ID_CHARS} characters of plain visible text")]
    BadId,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Who asks: the key's owner (it tags the key's redemptions) and the shop
/// it belongs to, if any (whose pools it may see).
#[derive(Debug, Clone, Copy)]
pub struct Platform<'a> {
    pub owner: &'a str,
    pub shop: Option<&'a str>,
}

/// Finds codes by value among the pools a key may see. The pools and
/// shops are read at most every [`POOLS_TTL`] of its clock (the system's,
/// or a test's [`crate::clock::ManualClock`]).
pub struct Finder {
    store: Store,
    clock: Arc<dyn crate::clock::Clock>,
    cached: Mutex<Option<(Instant, Arc<Visible>)>>,
}

/// Every pool with its look-alike rule, and each shop's pools.
#[derive(Debug, Default)]
struct Visible {
    pools: Vec<(String, LookAlikeRule)>,
    shops: Vec<codepool_store::shops::ShopDoc>,
    /// The pools whose every code ends with a Crockford check symbol.
    checked: std::collections::HashSet<String>,
}

impl Visible {
    fn for_shop(&self, shop: Option<&str>) -> Vec<(String, LookAlikeRule)> {
        let Some(shop) = shop else {
            return self.pools.clone();
        };
        let Some(s) = self.shops.iter().find(|s| s.name == shop) else {
            return Vec::new();
        };
        let mut out = self.pools.clone();
        out.retain(|(p, _)| s.allows(p));
        out
    }
}

impl Finder {
    pub fn new(store: Store) -> Self {
        Self::with_clock(store, crate::clock::system())
    }

    /// A finder whose cache reads the time from `clock`.
    pub fn with_clock(store: Store, clock: Arc<dyn crate::clock::Clock>) -> Self {
        Finder {
            store,
            clock,
            cached: Mutex::new(None),
        }
    }

    async fn visible(&self) -> Result<Arc<Visible>, StoreError> {
        let mut cached = self.cached.lock().await;
        let now = self.clock.now();
        if let Some((at, v)) = cached.as_ref() {
            if now.saturating_duration_since(*at) < POOLS_TTL {
                return Ok(v.clone());
            }
        }
        let pools = self.store.pools().await?;
        let v = Arc::new(Visible {
            pools: pools
                .iter()
                .map(|p| (p.name.clone(), p.lookalike_rule()))
                .collect(),
            shops: self.store.shops().await?,
            checked: (pools.iter())
                .filter(|p| p.check_symbols)
                .map(|p| p.name.clone())
                .collect(),
        });
        *cached = Some((now, v.clone()));
        Ok(v)
    }

    /// The issued (or used, or void after issue) code `code` names among
    /// the pools `who` may see; `None` for anything else.
    ///
    /// A code whose check symbol fails is not searched for in the pools
    /// whose every code carries one: when those are all the key sees, the
    /// answer is `None` with no lookup at all.
    pub async fn find(&self, who: Platform<'_>, code: &str) -> Result<Option<Sold>, StoreError> {
        let visible = self.visible().await?;
        let mut pools = visible.for_shop(who.shop);
        if !visible.checked.is_empty() && !codepool_domain::crockford::check_ok(code) {
            pools.retain(|(p, _)| !visible.checked.contains(p));
        }
        if pools.is_empty() {
            return Ok(None);
        }
        let found = self.store.find_sold_by_value(code, &pools).await?;
        Ok(found.filter(|c| Seen::of(c).is_some()))
    }

    /// What became of the code `code` names; changes nothing.
    pub async fn check(&self, who: Platform<'_>, code: &str) -> Result<Seen, RedeemError> {
        let found = self.find(who, code).await?;
        found
            .as_ref()
            .and_then(Seen::of)
            .ok_or(RedeemError::Unknown)
    }

    /// Redeems the code `code` names, once: `redemption_id` again gets the
    /// same answer ([`Redeemed::Before`]); any other redemption of a used
    /// code is [`RedeemError::AlreadyRedeemed`] with the first time.
    /// Returns the code as it is now.
    pub async fn redeem(
        &self,
        who: Platform<'_>,
        code: &str,
        redemption_id: &str,
        actor: &Actor,
    ) -> Result<(Seen, bool), RedeemError> {
        let id = checked_id(redemption_id).ok_or(RedeemError::BadId)?;
        let Some(found) = self.find(who, code).await? else {
            return Err(RedeemError::Unknown);
        };
        let tag = RedemptionTag {
            id,
            by: who.owner.to_owned(),
        };
        let done = ops::redeem(&self.store, CodeRef::Id(found.id), Some(&tag), actor).await;
        let (at, now) = match done {
            Ok(Redeemed::Now(applied)) => (applied.first().map(|a| a.at.to_chrono()), true),
            Ok(Redeemed::Before(c)) => (c.used_at, false),
            Err(e) => return Err(refusal(e, &self.store, found.id).await),
        };
        let mut seen = Seen::of(&found).ok_or(RedeemError::Unknown)?;
        seen.state = SeenState::Used { at };
        Ok((seen, now))
    }
}

/// A redemption the store refused, in the platform's terms: the first
/// redemption's time, or the void reason, read from the code as it is.
async fn refusal(e: LifecycleError, store: &Store, id: codepool_domain::CodeId) -> RedeemError {
    match e {
        LifecycleError::Store(e) => RedeemError::Store(e),
        LifecycleError::ConflictingRedemption { id } => RedeemError::ConflictingId(id),
        LifecycleError::AlreadyUsed { .. } | LifecycleError::Void { .. } => {
            match store.find_code(CodeRef::Id(id)).await {
                Ok(Some(c)) if c.status == CodeStatus::Used => {
                    RedeemError::AlreadyRedeemed { at: c.used_at }
                }
                Ok(Some(c)) if c.status == CodeStatus::Void => RedeemError::Void {
                    at: c.voided_at,
                    reason: c.void_reason.unwrap_or_default(),
                },
                Ok(_) => RedeemError::Unknown,
                Err(e) => RedeemError::Store(e),
            }
        }
        _ => RedeemError::Unknown,
    }
}

/// A redemption id, trimmed and compared as NFC (as a replacement id);
/// `None` when empty, too long or unreadable.
pub fn checked_id(id: &str) -> Option<String> {
    codepool_domain::text::client_id(id, MAX_REDEMPTION_ID_CHARS)
}
