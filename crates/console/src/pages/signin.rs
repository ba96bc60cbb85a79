//! `/console/signin` and `/console/signout`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::{Extension, Form};
use maud::html;
use serde::Deserialize;

use super::CsrfOnly;
use crate::failure::Failure;
use crate::layout;
use crate::sessions::{self, Session};
use crate::state::Console;
use crate::throttle::Refusal;
use codepool_issuance::operators;

#[derive(Debug, Default, Deserialize)]
pub struct Next {
    next: Option<String>,
}

/// Only a console page may be where sign-in leads: a local path under
/// `/console`, of visible ASCII (no control character that could split
/// the `Location` header), no `//`, `\\` or dot segment; anything else
/// leads to the pools.
fn safe_next(next: Option<&str>) -> &str {
    next.filter(|n| {
        (n.starts_with("/console/") || *n == "/console")
            && n.len() <= 2048
            && n.bytes().all(|b| b.is_ascii_graphic())
            && !n.contains("//")
            && !n.contains('\\')
            && !n.contains("/.")
            && !n.to_ascii_lowercase().contains("%2e")
    })
    .unwrap_or("/console/pools")
}

fn signin_page(status: StatusCode, next: &str, name: &str, problem: Option<&str>) -> Response {
    let body = layout::bare(
        "Sign in",
        html! {
            h1 { "codepool console" }
            @if let Some(p) = problem { p.problem role="alert" { (p) } }
            form.signin method="post" action="/console/signin" {
                input type="hidden" name="next" value=(next);
                label { "Name" input name="name" value=(name) autocomplete="username" required autofocus; }
                label { "Password" input name="password" type="password" autocomplete="current-password" required; }
                button type="submit" { "Sign in" }
            }
            p.hint { "Accounts come from " code { "codepool operators add" } "." }
        },
    );
    (status, Html(body.into_string())).into_response()
}

/// `GET /console/signin`.
pub async fn form(Query(q): Query<Next>) -> Response {
    signin_page(StatusCode::OK, safe_next(q.next.as_deref()), "", None)
}

#[derive(Debug, Deserialize)]
pub struct Credentials {
    #[serde(default)]
    name: String,
    #[serde(default)]
    password: String,
    next: Option<String>,
}

/// A sign-in posted from another site is refused (with `SameSite=Strict`
/// a cross-site form would not carry a session anyway; this stops login
/// CSRF, which needs none).
fn same_origin(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    match (
        headers.get(header::ORIGIN).and_then(|o| o.to_str().ok()),
        host,
    ) {
        (None, _) => true,
        // Sandboxed frames and data: pages send "null": not our page.
        (Some("null"), _) => false,
        (Some(origin), Some(host)) => origin
            .split_once("://")
            .is_some_and(|(_, rest)| rest == host),
        (Some(_), None) => false,
    }
}

/// An attempt refused before its password is checked: 429 or 503, with
/// `Retry-After`.
/// The refusal is logged with the client's address, so an operator kept
/// out by a stranger's guesses can block that address (docs/security.md).
fn refused(refusal: Refusal, next: &str, name: &str, client: Option<IpAddr>) -> Response {
    let (status, wait, text) = match refusal {
        Refusal::Throttled(wait) => {
            let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
            tracing::warn!(name = %name, client = ?client, wait_s = secs, "console sign-in refused: too many attempts");
            let text = format!("too many sign-in attempts for this name or from this address; wait {secs} seconds and try again");
            (StatusCode::TOO_MANY_REQUESTS, secs, text)
        }
        Refusal::Busy => {
            tracing::warn!(name = %name, client = ?client, "console sign-in refused: every password check is busy");
            let text =
                "the server is busy checking other sign-ins; try again in a second".to_owned();
            (StatusCode::SERVICE_UNAVAILABLE, 1, text)
        }
    };
    let mut res = signin_page(status, next, name, Some(&text));
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(wait));
    res
}

/// `POST /console/signin`: a session cookie, or the form again. Attempts
/// are rationed by client and by name before the password is checked
/// ([`crate::throttle`]).
pub async fn submit(
    State(console): State<Arc<Console>>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    Form(c): Form<Credentials>,
) -> Response {
    let next = safe_next(c.next.as_deref()).to_owned();
    if !same_origin(&headers) {
        return signin_page(
            StatusCode::FORBIDDEN,
            &next,
            "",
            Some("this sign-in came from another site; open the console's own page"),
        );
    }
    let client = peer.map(|Extension(ConnectInfo(addr))| addr.ip());
    let attempt = match console.throttle.attempt(&c.name, client) {
        Ok(a) => a,
        Err(refusal) => return refused(refusal, &next, &c.name, client),
    };
    let op = match console.core.authenticate(&c.name, &c.password).await {
        Ok(op) => op,
        Err(e) => return Failure::from(e).into_response(),
    };
    let Some(op) = op else {
        drop(attempt);
        tracing::warn!(name = %c.name, client = ?client, "console sign-in failed");
        return signin_page(
            StatusCode::UNAUTHORIZED,
            &next,
            &c.name,
            Some("wrong name or password, or the account is disabled"),
        );
    };
    attempt.succeeded();
    match open_session(&console, &op).await {
        Ok(cookie) => ([(header::SET_COOKIE, cookie)], Redirect::to(&next)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A new session for `op`, audited; its cookie.
async fn open_session(
    console: &Console,
    op: &operators::OperatorDoc,
) -> Result<HeaderValue, Failure> {
    let ttl = console.cfg.session_ttl;
    let token = console
        .core
        .sign_in(op, ttl, "console POST /console/signin")
        .await?;
    tracing::info!(operator = %op.name, "console sign-in");
    Ok(sessions::cookie(
        Some(&token),
        console.cfg.session_ttl,
        console.cfg.secure_cookie,
    ))
}

/// `POST /console/signout`: the session ends on the server, the cookie is
/// cleared.
pub async fn signout(
    State(console): State<Arc<Console>>,
    s: Session,
    Form(f): Form<CsrfOnly>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    console.core.end_session(&s.doc.id).await?;
    super::audit(
        &console,
        &s,
        codepool_issuance::model::AuditKind::SignOut,
        "POST /console/signout",
        "signed out".into(),
    )
    .await?;
    let cookie = sessions::cookie(None, console.cfg.session_ttl, console.cfg.secure_cookie);
    Ok((
        [(header::SET_COOKIE, cookie)],
        Redirect::to("/console/signin"),
    )
        .into_response())
}
