//! Console sessions: a random 256-bit token in an `HttpOnly`,
//! `SameSite=Strict` cookie scoped to `/console` (`Secure` under TLS); only
//! its SHA-256 is stored, with the operator, a CSRF token of its own, and
//! an expiry that a TTL index enforces (and every read checks). Signing
//! out deletes it; disabling an operator deletes all of theirs.

use std::sync::Arc;

use crate::failure::Failure;
use crate::state::Console;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Redirect, Response};
use codepool_issuance::operators::{OperatorDoc, Role};

pub use codepool_issuance::sessions::{SessionDoc, SESSIONS};
pub const COOKIE: &str = "codepool_session";

/// Equal in time that does not depend on where they differ.
pub(crate) fn same(a: &str, b: &str) -> bool {
    subtle::ConstantTimeEq::ct_eq(a.as_bytes(), b.as_bytes()).into()
}

/// The `Set-Cookie` value of a new session, or of its removal (`None`).
pub fn cookie(token: Option<&str>, ttl: std::time::Duration, secure: bool) -> HeaderValue {
    let max_age = if token.is_some() { ttl.as_secs() } else { 0 };
    let c = cookie::Cookie::build((COOKIE, token.unwrap_or("")))
        .http_only(true)
        .same_site(cookie::SameSite::Strict)
        .path("/console")
        .max_age(cookie::time::Duration::seconds(
            i64::try_from(max_age).unwrap_or(i64::MAX),
        ))
        .secure(secure)
        .build();
    HeaderValue::from_str(&c.to_string()).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The session token a request carries, if any.
fn token_of(parts: &Parts) -> Option<String> {
    parts
        .headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(cookie::Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|c| c.name() == COOKIE)
        .map(|c| c.value().to_owned())
}

/// A signed-in operator: handlers that take it are reached only with a
/// live session of an enabled operator; anyone else is sent to sign in.
#[derive(Debug, Clone)]
pub struct Session {
    pub doc: SessionDoc,
    pub operator: OperatorDoc,
}

impl Session {
    /// The operator's name as the audit log records it.
    pub fn who(&self) -> String {
        format!("operator:{}", self.operator.name)
    }

    /// Refuses (403) unless the operator's role holds `role`.
    pub fn need(&self, role: Role) -> Result<(), Failure> {
        if self.operator.may(role) {
            Ok(())
        } else {
            Err(Failure::Forbidden(role))
        }
    }

    /// Refuses (403) a form whose CSRF token is not this session's.
    pub fn check_csrf(&self, token: &str) -> Result<(), Failure> {
        if same(token, &self.doc.csrf) {
            Ok(())
        } else {
            Err(Failure::Csrf)
        }
    }

    pub fn csrf(&self) -> &str {
        &self.doc.csrf
    }
}

/// Where an unsigned request goes: the sign-in page, then back here.
fn to_signin(parts: &Parts) -> Response {
    let back = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .filter(|p| parts.method == axum::http::Method::GET && p.starts_with("/console/"))
        .unwrap_or("/console/pools");
    Redirect::to(&format!(
        "/console/signin?next={}",
        crate::frame::url_part(back)
    ))
    .into_response()
}

impl FromRequestParts<Arc<Console>> for Session {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &Arc<Console>,
    ) -> Result<Self, Self::Rejection> {
        let Some(token) = token_of(parts) else {
            return Err(to_signin(parts));
        };
        match console.core.signed_in(&token).await {
            Ok(Some((doc, operator))) => Ok(Session { doc, operator }),
            Ok(None) => Err(to_signin(parts)),
            Err(e) => Err(Failure::from(e).into_response()),
        }
    }
}
