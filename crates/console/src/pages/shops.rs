//! `/console/shops` (admin): the shops and the pools each may order from,
//! as `codepool shops`: create, and replace a shop's pools.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Form;
use codepool_issuance::shops::ShopError;
use maud::{html, Markup};
use serde::Deserialize;

use crate::failure::Failure;
use crate::layout::{self, csrf, when};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

fn shop_failure(e: ShopError) -> Failure {
    match e {
        ShopError::Store(e) => e.into(),
        ShopError::Unknown(_) => Failure::NotFound(e.to_string()),
        ShopError::Exists(_) => Failure::Conflict(e.to_string()),
        other => Failure::Invalid(other.to_string()),
    }
}

#[derive(Debug, Deserialize)]
pub struct ShopForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    name: String,
    /// Comma-separated pools, or `*`.
    #[serde(default)]
    pools: String,
}

impl ShopForm {
    fn pools(&self) -> Vec<String> {
        self.pools.split(',').map(|p| p.trim().to_owned()).collect()
    }
}

/// `GET /console/shops`.
pub async fn list(State(console): State<Arc<Console>>, s: Session) -> Result<Response, Failure> {
    s.need(Role::Admin)?;
    page(&console, &s, html! {}).await
}

async fn page(console: &Console, s: &Session, top: Markup) -> Result<Response, Failure> {
    let all = console.core.shops().await?;
    let body = html! {
        h1 { "Shops" }
        (top)
        p.hint { "A shop's API keys order only from its pools, and see only its orders." }
        table.shops { thead { tr { th { "Name" } th { "Pools" } th { "Created" } th { "Change pools" } } }
            tbody { @for shop in &all { tr data-shop=(shop.name) {
                td.name { a href=(format!("/console/shops/{}", crate::frame::url_part(&shop.name))) { (shop.name) } }
                td.pools { (shop.pools.join(", ")) }
                td { (when(shop.created_at)) }
                td { form.inline method="post" action="/console/shops/pools" {
                    (csrf(s)) input type="hidden" name="name" value=(shop.name);
                    input name="pools" value=(shop.pools.join(",")) required aria-label="pools";
                    button type="submit" { "Set" }
                } }
            } } } }
        h2 { "New shop" }
        form.grid.new-shop method="post" action="/console/shops" {
            (csrf(s))
            label { "Name " input name="name" required maxlength="64"; }
            label { "Pools " input name="pools" required placeholder="game-x,game-y or *"; }
            button type="submit" { "Create shop" }
        }
    };
    Ok(layout::page(s, "Shops", body).into_response())
}

/// `POST /console/shops`.
pub async fn create(
    State(console): State<Arc<Console>>,
    s: Session,
    Form(f): Form<ShopForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let actor = super::actor(&s, "POST /console/shops");
    let shop = console
        .core
        .create_shop(f.name.trim(), &f.pools(), &actor)
        .await
        .map_err(shop_failure)?;
    let notice = format!(
        "Shop {:?} created; it orders from {}.",
        shop.name,
        shop.pools.join(", ")
    );
    page(&console, &s, layout::notice(&notice)).await
}

/// `POST /console/shops/pools`: replaces a shop's pools.
pub async fn set_pools(
    State(console): State<Arc<Console>>,
    s: Session,
    Form(f): Form<ShopForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let actor = super::actor(&s, "POST /console/shops/pools");
    let shop = console
        .core
        .set_shop_pools(&f.name, &f.pools(), &actor)
        .await
        .map_err(shop_failure)?;
    let notice = format!(
        "Shop {:?} now orders from {}.",
        shop.name,
        shop.pools.join(", ")
    );
    page(&console, &s, layout::notice(&notice)).await
}
