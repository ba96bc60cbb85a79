//! `/v1/pools` (scope `admin`): stock and stats by page, a pool's detail,
//! create, settings, pause and resume, through the same operations as
//! `codepool pool` and `codepool stats`.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_domain::Pool;
use codepool_issuance::model::PoolDoc;
use codepool_issuance::model::{PoolSettings, PoolSettingsError};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::problem::Problem;
use crate::request::RequestId;
use crate::request::{need_admin as admin, Admin, AnyKey, Body, BodyDoc, Caller};
use crate::state::Api;
use codepool_issuance::api_keys::{KeyDoc, Scope};

/// Most pools one page returns.
pub const MAX_PAGE: i64 = 500;

fn failed(e: &codepool_issuance::StoreError, rid: &RequestId) -> Response {
    if e.is_unavailable() {
        return Problem::unavailable(e).at(&rid.0).into_response();
    }
    Problem::internal(e, "nothing was changed twice")
        .at(&rid.0)
        .into_response()
}

fn unknown(pool: &str, rid: &RequestId) -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-pool",
        "no such pool",
        format!(
            "pool {pool:?} does not exist; create it with POST /v1/pools or import codes into it"
        ),
    )
    .field("pool")
    .at(&rid.0)
    .into_response()
}

/// 404 for a pool `key` may not see: to a shop's key, what it can act on
/// (one answer for a pool of another shop and a pool that does not
/// exist); to an admin key, how to create it.
fn unknown_to(key: &KeyDoc, pool: &str, rid: &RequestId) -> Response {
    if key.shop.is_none() {
        return unknown(pool, rid);
    }
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-pool",
        "no such pool",
        format!(
            "pool {pool:?} is not one of this shop's pools; GET /v1/pools lists the pools this key may use. To use another, ask the operator to add it to the shop"
        ),
    )
    .field("pool")
    .at(&rid.0)
    .into_response()
}

/// A pool's stock, as `codepool stats` counts it.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PoolStats {
    unissued: u64,
    issued: u64,
    used: u64,
    void: u64,
    /// Codes held for checkouts: no one's yet.
    held: u64,
    expired: u64,
    backorders_waiting: u64,
    issued_last_hour: u64,
    issued_last_day: u64,
}

impl From<&codepool_issuance::model::PoolStats> for PoolStats {
    fn from(s: &codepool_issuance::model::PoolStats) -> Self {
        PoolStats {
            unissued: s.unissued,
            issued: s.issued,
            used: s.used,
            void: s.void,
            held: s.held,
            expired: s.expired,
            backorders_waiting: s.backorders_waiting,
            issued_last_hour: s.issued_last_hour,
            issued_last_day: s.issued_last_day,
        }
    }
}

/// A pool: its settings and stock.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PoolOut {
    name: String,
    paused: bool,
    /// Codes one buyer may hold (0: no limit).
    per_user: i64,
    low_stock: Option<i64>,
    low_stock_alerted: bool,
    grant_prefix: String,
    case_sensitive_codes: bool,
    /// O reads as 0, and I and L as 1, in look-alikes and redemptions.
    fold_confusables: bool,
    /// Every code ends with a Crockford check symbol (generated with one
    /// into an empty pool): a redemption refuses a code failing it unlooked.
    check_symbols: bool,
    /// Percent of the stock one buyer may hold in checkout holds.
    hold_share: u32,
    /// Open holds one buyer may have.
    holds_per_uid: u32,
    /// Percent of the stock one API key, or one shop's keys together, may
    /// hold in checkout holds; null: the default (50 for a shop, 100 for a
    /// key of no shop).
    hold_share_per_owner: Option<u32>,
    /// Codes of one order support may replace (`POST
    /// /v1/orders/{order_id}/lines/{line}/replace`).
    replacements_per_order: u32,
    created_at: String,
    stats: Option<PoolStats>,
}

impl PoolOut {
    /// A pool as the API shows it: its settings and its stats.
    fn of(d: &PoolDoc, s: Option<&codepool_issuance::model::PoolStats>) -> Self {
        PoolOut {
            name: d.name.clone(),
            paused: d.paused,
            per_user: d.per_user.unwrap_or(0),
            low_stock: d.low_stock,
            low_stock_alerted: d.low_stock_alerted,
            grant_prefix: d.grant_prefix.clone().unwrap_or_else(|| "G".into()),
            case_sensitive_codes: d.case_sensitive_codes,
            fold_confusables: d.fold_confusables,
            check_symbols: d.check_symbols,
            hold_share: d.hold_share(),
            holds_per_uid: d.holds_per_uid(),
            hold_share_per_owner: d.hold_share_per_owner(),
            replacements_per_order: d.replacements_per_order(),
            created_at: d.created_at.to_chrono().to_rfc3339(),
            stats: s.map(PoolStats::from),
        }
    }
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PoolPage {
    pools: Vec<PoolOut>,
    /// The `after` of the next page; null on the last.
    next: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Page {
    after: Option<String>,
    limit: Option<i64>,
}

/// `GET /v1/pools?after=NAME&limit=N`: pools by name with their stats; `next`
/// is the `after` of the next page (null on the last).
#[utoipa::path(
    get, path = "/v1/pools", tag = "pools",
    operation_id = "list_pools",
    params(("after" = Option<String>, Query, description = "the `next` of the previous page"),
           ("limit" = Option<i64>, Query, description = "pools per page, 1 to 500 (default 100)")),
    responses(
        (status = 200, description = "a page of pools by name, with their stock", body = PoolPage),
        (status = 422, description = "an invalid `limit`", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]), ("api_key" = ["orders:read"]))
)]
pub(crate) async fn list(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<AnyKey>,
    Query(page): Query<Page>,
) -> Response {
    let only = match shop_pools(&api, &key, &rid).await {
        Ok(only) => only,
        Err(r) => return r,
    };
    let limit = page.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-limit",
            "the page size is out of range",
            format!("limit must be 1 to {MAX_PAGE}; follow `next` for more"),
        )
        .field("limit")
        .at(&rid.0)
        .into_response();
    }
    let docs = match api
        .pools_page_of(page.after.as_deref(), limit, only.as_deref())
        .await
    {
        Ok(d) => d,
        Err(e) => return failed(&e, &rid),
    };
    let names: Vec<&str> = docs.iter().map(|d| d.name.as_str()).collect();
    let stats = match api.stats_of(&names).await {
        Ok(s) => s,
        Err(e) => return failed(&e, &rid),
    };
    let pools: Vec<PoolOut> = docs
        .iter()
        .map(|d| PoolOut::of(d, stats.iter().find(|s| s.pool == d.name)))
        .collect();
    let next = (docs.len() as i64 == limit).then(|| docs.last().map(|d| d.name.clone()));
    let next = next.flatten();
    Json(PoolPage { pools, next }).into_response()
}

/// `GET /v1/pools/{pool}`.
#[utoipa::path(
    get, path = "/v1/pools/{pool}", tag = "pools",
    operation_id = "show_pool",
    params(("pool" = String, Path, description = "the pool's name")),
    responses(
        (status = 200, description = "the pool's settings and stock", body = PoolOut),
        (status = 404, description = "no such pool", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]), ("api_key" = ["orders:read"]))
)]
pub(crate) async fn show(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<AnyKey>,
    Path(pool): Path<String>,
) -> Response {
    pool_answer(&api, &key, &rid, pool).await
}

/// The pool as `key` may see it.
async fn pool_answer(api: &Api, key: &KeyDoc, rid: &RequestId, pool: String) -> Response {
    match shop_pools(api, key, rid).await {
        Ok(Some(only)) if !only.contains(&pool) => return unknown_to(key, &pool, rid),
        Ok(_) => {}
        Err(r) => return r,
    }
    let doc = match api.pool(&pool).await {
        Ok(Some(d)) => d,
        Ok(None) => return unknown_to(key, &pool, rid),
        Err(e) => return failed(&e, rid),
    };
    match api.stats_of(&[pool.as_str()]).await {
        Ok(stats) => Json(PoolOut::of(&doc, stats.first())).into_response(),
        Err(e) => failed(&e, rid),
    }
}

/// The pools `key` may see: every pool for an admin key (`None`), its
/// shop's for a shop's key with `orders:read` (only the pools that exist
/// are listed, `*` is every pool); a 403 for any other.
async fn shop_pools(
    api: &Api,
    key: &KeyDoc,
    rid: &RequestId,
) -> Result<Option<Vec<String>>, Response> {
    let Some(shop) = key
        .shop
        .as_deref()
        .filter(|_| key.allows(Scope::OrdersRead))
    else {
        return match admin(key, rid) {
            Some(r) => Err(r),
            None => Ok(None),
        };
    };
    match api.shop(shop).await {
        Ok(Some(s)) if s.every_pool() => Ok(None),
        Ok(Some(s)) => Ok(Some(s.pools)),
        Ok(None) => Ok(Some(Vec::new())),
        Err(e) => Err(failed(&e, rid)),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewPool {
    name: String,
}

impl BodyDoc for NewPool {
    const WHAT: &'static str = "a pool";
    const SEND: &'static str = r#"{"name": "game-x"}"#;
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Created {
    name: String,
    created: bool,
}

/// `POST /v1/pools` with `{"name": …}`: 201 created, 200 if it existed.
#[utoipa::path(
    post, path = "/v1/pools", tag = "pools",
    operation_id = "create_pool",
    request_body(content = NewPool, content_type = "application/json"),
    responses(
        (status = 201, description = "the pool was created", body = Created),
        (status = 200, description = "the pool already existed", body = Created),
        (status = 422, description = "an unusable name (`field`: name)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn create(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    Body(NewPool { name }): Body<NewPool>,
) -> Response {
    if let Err(e) = Pool::new(&name) {
        return Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-pool",
            "the pool name is not usable",
            e.to_string(),
        )
        .field("name")
        .at(&rid.0)
        .into_response();
    }
    let actor = codepool_issuance::audit::Actor::api_key(&key.name, "POST /v1/pools");
    let created = match api.create_pool(&name, &actor).await {
        Ok(c) => c,
        Err(e) => return failed(&e, &rid),
    };
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (status, Json(Created { name, created })).into_response()
}

/// Any of the settings; the others stay.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct SettingsIn {
    #[schema(nullable = false)]
    low_stock: Option<i64>,
    #[schema(nullable = false)]
    grant_prefix: Option<String>,
    #[schema(nullable = false)]
    per_user: Option<i64>,
    #[schema(nullable = false)]
    case_sensitive_codes: Option<bool>,
    /// O reads as 0, and I and L as 1: only before the pool's first import.
    #[schema(nullable = false)]
    fold_confusables: Option<bool>,
    /// Percent of the pool's stock (free plus held) one buyer may hold at
    /// once: 1 to 100.
    #[schema(nullable = false, minimum = 1, maximum = 100)]
    hold_share: Option<i64>,
    /// Open holds one buyer may have: 1 or more.
    #[schema(nullable = false, minimum = 1)]
    holds_per_uid: Option<i64>,
    /// Percent of the pool's stock (free plus held) one API key, or one
    /// shop's keys together, may hold at once: 1 to 100.
    #[schema(nullable = false, minimum = 1, maximum = 100)]
    hold_share_per_owner: Option<i64>,
    /// Codes of one order support may replace: 0 (none) to 100 (default 3).
    #[schema(nullable = false, minimum = 0, maximum = 100)]
    replacements_per_order: Option<i64>,
}

impl BodyDoc for SettingsIn {
    const WHAT: &'static str = "a pool's settings";
    const SEND: &'static str = "any of low_stock, grant_prefix, per_user, case_sensitive_codes, fold_confusables, hold_share, holds_per_uid, hold_share_per_owner, replacements_per_order";
}

/// `PATCH /v1/pools/{pool}` with any of `low_stock`, `grant_prefix`,
/// `per_user`, `case_sensitive_codes`, `fold_confusables`, the hold caps and
/// `replacements_per_order`.
#[utoipa::path(
    patch, path = "/v1/pools/{pool}", tag = "pools",
    operation_id = "set_pool",
    params(("pool" = String, Path, description = "the pool's name")),
    request_body(content = SettingsIn, content_type = "application/json"),
    responses(
        (status = 200, description = "the pool with its new settings", body = PoolOut),
        (status = 404, description = "no such pool", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "an invalid setting (named in `field`)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn settings(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    Path(pool): Path<String>,
    Body(s): Body<SettingsIn>,
) -> Response {
    let settings = PoolSettings {
        low_stock: s.low_stock,
        grant_prefix: s.grant_prefix,
        per_user: s.per_user,
        case_sensitive_codes: s.case_sensitive_codes,
        fold_confusables: s.fold_confusables,
        hold_share: s.hold_share,
        holds_per_uid: s.holds_per_uid,
        hold_share_per_owner: s.hold_share_per_owner,
        replacements_per_order: s.replacements_per_order,
    };
    let what = format!("{settings:?}");
    let actor = codepool_issuance::audit::Actor::api_key(&key.name, "PATCH /v1/pools/{name}");
    match api.set_pool_settings(&pool, &settings, &what, &actor).await {
        Ok(()) => pool_answer(&api, &key, &rid, pool).await,
        Err(codepool_issuance::controls::PauseError::Pool(e)) => settings_error(e, &pool, &rid),
        Err(e) => Problem::unavailable(&e).at(&rid.0).into_response(),
    }
}

fn settings_error(e: PoolSettingsError, pool: &str, rid: &RequestId) -> Response {
    match &e {
        PoolSettingsError::UnknownPool(_) => return unknown(pool, rid),
        PoolSettingsError::Store(s) => return failed(s, rid),
        _ => {}
    }
    let field = e.setting().map(|s| s.field());
    let status = if matches!(e, PoolSettingsError::CaseRuleFixed { .. }) {
        StatusCode::CONFLICT
    } else {
        StatusCode::UNPROCESSABLE_ENTITY
    };
    let detail = e.in_words(|s| s.field().to_owned());
    let mut p = Problem::new(
        status,
        "invalid-settings",
        "the settings were not changed",
        detail,
    )
    .at(&rid.0);
    if let Some(f) = field {
        p = p.field(f);
    }
    p.into_response()
}

/// `POST /v1/pools/{pool}/pause` and `/resume`: announced with
/// `pool.paused` / `pool.resumed`, like `codepool pool pause`.
#[utoipa::path(
    post, path = "/v1/pools/{pool}/pause", tag = "pools",
    operation_id = "pause_pool",
    params(("pool" = String, Path, description = "the pool's name")),
    responses(
        (status = 200, description = "the pool is paused: its orders wait as backorders", body = Paused),
        (status = 404, description = "no such pool", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn pause(
    State(api): State<Arc<Api>>,
    caller: Caller<Admin>,
    Path(pool): Path<String>,
) -> Response {
    set_paused(&api, caller, pool, true).await
}

#[utoipa::path(
    post, path = "/v1/pools/{pool}/resume", tag = "pools",
    operation_id = "resume_pool",
    params(("pool" = String, Path, description = "the pool's name")),
    responses(
        (status = 200, description = "the pool is resumed: its backorders are served", body = Paused),
        (status = 404, description = "no such pool", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn resume(
    State(api): State<Arc<Api>>,
    caller: Caller<Admin>,
    Path(pool): Path<String>,
) -> Response {
    set_paused(&api, caller, pool, false).await
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Paused {
    name: String,
    paused: bool,
    changed: bool,
}

async fn set_paused(api: &Api, caller: Caller<Admin>, pool: String, paused: bool) -> Response {
    let Caller { key, rid, .. } = caller;
    use codepool_issuance::controls::PauseError;
    let route = if paused {
        "POST /v1/pools/{name}/pause"
    } else {
        "POST /v1/pools/{name}/resume"
    };
    let actor = codepool_issuance::audit::Actor::api_key(&key.name, route);
    match api.set_paused(&pool, paused, &actor).await {
        Ok(changed) => Json(Paused {
            name: pool,
            paused,
            changed,
        })
        .into_response(),
        Err(PauseError::Pool(e)) => settings_error(e, &pool, &rid),
        Err(e @ (PauseError::Unconfirmed { .. } | PauseError::Audit(_))) => {
            Problem::unavailable(&e).at(&rid.0).into_response()
        }
    }
}
