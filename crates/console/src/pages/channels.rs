//! `/console/channels` and `/console/channels/{name}`: a shop's accounts
//! on the key marketplaces (docs/channels.md), each with its marketplace,
//! shop and state, the products it sells and from which pool, what it
//! declared of each and may declare now, the reservations whose codes it
//! holds, and how its calls fared over the last hour, every API process's
//! (failed against completed, and Eneba's hide ratio against the line
//! where Eneba hides the auction). A channel's page pauses and resumes it
//! (admin), through the operation `codepool channels pause` uses.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use codepool_issuance::channels::outcomes::{self, ChannelView};
use codepool_issuance::channels::ChannelError;
use maud::{html, Markup};

use super::CsrfOnly;
use crate::failure::Failure;
use crate::layout::{self, count, csrf, url_part, when};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

fn channel_failure(e: ChannelError) -> Failure {
    match e {
        ChannelError::Store(e) => e.into(),
        ChannelError::Unknown(_) => Failure::NotFound(e.to_string()),
        other => Failure::Invalid(other.to_string()),
    }
}

fn page_of(name: &str) -> String {
    format!("/console/channels/{}", url_part(name))
}

/// "3 failed of 120 (2.5 %)", "none" when there was no call; marked when
/// any failed.
fn ratio(failed: u64, completed: u64) -> Markup {
    let all = failed + completed;
    html! {
        span.ratio.failing[failed > 0] {
            @if all == 0 { "none" }
            @else { (count(failed)) " failed of " (count(all)) " (" (share(failed, all)) ")" }
        }
    }
}

/// `part` of `all` in percent, one decimal.
fn share(part: u64, all: u64) -> String {
    if all == 0 {
        return "—".into();
    }
    format!("{:.1} %", part as f64 * 100.0 / all as f64)
}

/// 172800 as "48 h", 1800 as "30 min", 90 as "90 s".
fn span_of(seconds: i64) -> String {
    match seconds.max(0) {
        s if s >= 3600 && s % 3600 == 0 => format!("{} h", s / 3600),
        s if s >= 60 && s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

/// What a product declared: a number, or that none was yet.
fn declared(d: Option<i64>) -> String {
    d.map_or("none yet".into(), |d| count(d.max(0) as u64))
}

/// Eneba's hide ratio against the line where Eneba hides the auction,
/// marked from where the alert fires.
fn hide(value: f64, warn_at: f64, hides_at: f64) -> Markup {
    let class = if value >= hides_at {
        "hidden"
    } else if value > warn_at {
        "warn"
    } else {
        "ok"
    };
    html! {
        span class={"hide " (class)} title={"log(failed)/log(completed); Eneba hides the auction at " (hides_at)} {
            "hide " (format!("{value:.2}")) " / " (hides_at)
        }
    }
}

fn state(v: &ChannelView) -> Markup {
    html! {
        @if v.channel.paused { span.badge.paused { "paused" } } @else { span.active { "active" } }
    }
}

fn products(v: &ChannelView) -> Markup {
    html! {
        @if v.products.is_empty() { span.hint { "no product mapped" } }
        @else { ul.products { @for p in &v.products { li data-product=(p.product) {
            code { (p.product) } " → " a href={"/console/pools/" (url_part(&p.pool))} { (p.pool) }
            br; small {
                "declared " span.declared { (declared(p.declared)) }
                " · may sell " span.declarable { (count(p.declarable)) }
            }
        } } } }
    }
}

/// The last hour of a channel, reservations and provisions, each with
/// Eneba's hide ratio for an Eneba channel.
fn last_hour(v: &ChannelView) -> Markup {
    let o = &v.last_hour;
    let eneba = v.channel.kind == "eneba";
    let (rh, ph) = v.hide_ratios();
    html! {
        dl.last-hour {
            dt { "Reservations" }
            dd.reservations { (ratio(o.reservations_failed, o.reservations_completed))
                @if eneba { " " (hide(rh, outcomes::WARN_AT.0, outcomes::ENEBA_HIDES_AT.0)) } }
            dt { "Provisions" }
            dd.provisions { (ratio(o.provisions_failed, o.provisions_completed))
                @if eneba { " " (hide(ph, outcomes::WARN_AT.1, outcomes::ENEBA_HIDES_AT.1)) } }
        }
    }
}

fn row(v: &ChannelView) -> Markup {
    let c = &v.channel;
    html! {
        tr data-channel=(c.name) class=[c.paused.then_some("paused")] {
            td.name { a href=(page_of(&c.name)) { (c.name) } }
            td.kind { (c.kind) }
            td.shop { (c.shop) }
            td.state { (state(v)) }
            td { (products(v)) }
            td.num.open { (count(v.open_reservations)) br; small { (count(v.held_codes)) " codes held" } }
            td.outcomes { (last_hour(v)) }
        }
    }
}

/// `GET /console/channels`.
pub async fn list(State(console): State<Arc<Console>>, s: Session) -> Result<Response, Failure> {
    s.need(Role::Viewer)?;
    let views = console.core.channel_views().await?;
    let body = html! {
        h1 { "Channels" }
        p.hint { "A channel is one marketplace account of a shop: Eneba, G2A and Kinguin reserve and "
            "provide the shop's codes through it. Failures are counted over the last hour, every API "
            "process's, as the marketplaces count them; Eneba hides an auction when "
            "log(failed)/log(completed) reaches 0.4 for reservations or 0.2 for provisions. "
            code { "codepool channels add" } " adds a channel." }
        @if views.is_empty() { p { "No channel yet." } }
        @else {
            div.table-wrap { table.channels {
                thead { tr {
                    th { "Channel" } th { "Marketplace" } th { "Shop" } th { "State" }
                    th { "Products → pools, stock" } th { "Open reservations" } th { "Last hour" }
                } }
                tbody { @for v in &views { (row(v)) } }
            } }
        }
    };
    Ok(layout::page(&s, "Channels", body).into_response())
}

fn settings(v: &ChannelView) -> Markup {
    let c = &v.channel;
    html! {
        dl.settings.channel-settings {
            dt { "Marketplace" } dd.kind { (c.kind) }
            dt { "Shop" } dd { (c.shop) }
            dt { "State" } dd.state { (state(v)) }
            dt { "A reservation holds its codes" } dd { (span_of(c.hold_ttl_seconds)) }
            dt { "A cancellation after provision" } dd { (c.after_provide) }
            dt { "Share of the pools' free codes" } dd { (c.share_percent.map_or("all".into(), |p| format!("{p} %"))) }
            dt { "Most declared a product" } dd { (c.max_stock.map_or("no cap".into(), |m| count(m.max(0) as u64))) }
            dt { "Added" } dd { (when(c.created_at)) }
        }
    }
}

fn outcomes_table(v: &ChannelView) -> Markup {
    let o = &v.last_hour;
    let eneba = v.channel.kind == "eneba";
    let (rh, ph) = v.hide_ratios();
    let rows = [
        (
            "reservations",
            "Reservations",
            o.reservations_completed,
            o.reservations_failed,
            rh,
            0,
        ),
        (
            "provisions",
            "Provisions",
            o.provisions_completed,
            o.provisions_failed,
            ph,
            1,
        ),
    ];
    html! {
        table.outcomes {
            thead { tr { th { "Last hour" } th.num { "Completed" } th.num { "Failed" } th.num { "Failed share" }
                @if eneba { th { "Eneba's hide ratio" } } } }
            tbody { @for (class, label, done, failed, ratio, i) in rows {
                tr class=(class) { td { (label) } td.num { (count(done)) }
                    td.num.failed { (count(failed)) } td.num { (share(failed, done + failed)) }
                    @if eneba { td { @if i == 0 { (hide(ratio, outcomes::WARN_AT.0, outcomes::ENEBA_HIDES_AT.0)) }
                        @else { (hide(ratio, outcomes::WARN_AT.1, outcomes::ENEBA_HIDES_AT.1)) } } } }
            } }
        }
    }
}

/// An admin's pause or resume of the channel.
fn pause_form(s: &Session, v: &ChannelView) -> Markup {
    let base = page_of(&v.channel.name);
    html! {
        @if v.channel.paused {
            form.inline.resume method="post" action={(base) "/resume"} { (csrf(s)) button type="submit" { "Resume the channel" }
                span.hint { "It takes reservations and declares its stock again." } }
        } @else {
            form.inline.pause method="post" action={(base) "/pause"} { (csrf(s)) button.danger type="submit" { "Pause the channel" }
                span.hint { "It reserves nothing new and declares no stock; what it reserved is still provided or cancelled." } }
        }
    }
}

/// `GET /console/channels/{name}`.
pub async fn show(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(name): Path<String>,
) -> Result<Response, Failure> {
    s.need(Role::Viewer)?;
    let v = console.core.channel_view(&name).await?.ok_or_else(|| {
        Failure::NotFound(format!("no channel {name:?}; the channels page lists them"))
    })?;
    let c = &v.channel;
    let body = html! {
        h1 { "Channel " (c.name) @if c.paused { " " span.badge { "paused" } } }
        (settings(&v))
        @if s.operator.may(Role::Admin) { (pause_form(&s, &v)) }
        h2 { "Last hour" }
        (outcomes_table(&v))
        h2 { "Products" }
        @if v.products.is_empty() { p.hint { "No product mapped: " code { "codepool channels map" } " maps one to a pool of the shop." } }
        @else { table.products {
            thead { tr { th { "Product" } th { "Pool" } th.num { "Declared" } th.num { "May sell now" } } }
            tbody { @for p in &v.products { tr data-product=(p.product) {
                td.code { (p.product) }
                td { a href={"/console/pools/" (url_part(&p.pool))} { (p.pool) } }
                td.num.declared { (declared(p.declared)) }
                td.num.declarable { (count(p.declarable)) }
            } } }
        } }
        p.hint { "Declared: what the channel last told its marketplace (or answered G2A). May sell now: the pool's free codes, capped by the channel's share and maximum." }
        h2 { "Open reservations" }
        p.open { strong.open-reservations { (count(v.open_reservations)) }
            (if v.open_reservations == 1 { " reservation holds " } else { " reservations hold " })
            strong.held-codes { (count(v.held_codes)) } " codes, shown to no one until provided." }
    };
    Ok(layout::page(&s, &format!("Channel {name}"), body).into_response())
}

/// `POST /console/channels/{name}/pause` (admin).
pub async fn pause(
    state: State<Arc<Console>>,
    s: Session,
    name: Path<String>,
    Form(f): Form<CsrfOnly>,
) -> Result<Response, Failure> {
    set_paused(state, s, name, f, true).await
}

/// `POST /console/channels/{name}/resume` (admin).
pub async fn resume(
    state: State<Arc<Console>>,
    s: Session,
    name: Path<String>,
    Form(f): Form<CsrfOnly>,
) -> Result<Response, Failure> {
    set_paused(state, s, name, f, false).await
}

async fn set_paused(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(name): Path<String>,
    f: CsrfOnly,
    paused: bool,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let kind = if paused { "pause" } else { "resume" };
    let actor = super::actor(&s, &format!("POST /console/channels/{{name}}/{kind}"));
    console
        .core
        .set_channel_paused(&name, paused, &actor)
        .await
        .map_err(channel_failure)?;
    Ok(Redirect::to(&page_of(&name)).into_response())
}
