//! RFC 9457 problem details: every error the API gives, as
//! `application/problem+json`, with a `detail` that says what to do next.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Where problem types are described.
const TYPES: &str = "https://codepool.dev/problems/";

/// One problem. `type` is a URI under [`TYPES`] named by a short slug
/// (the same word as the dead-letter reason where there is one).
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// The request's id, as in `x-request-id` and the logs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The request field at fault, for an invalid or unknown field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Extra members of some problems (e.g. the per-user limit).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
    #[serde(skip)]
    retry_after: Option<u64>,
    #[serde(skip)]
    challenge: bool,
}

impl Problem {
    pub fn new(status: StatusCode, slug: &str, title: &str, detail: impl Into<String>) -> Self {
        Self {
            kind: format!("{TYPES}{slug}"),
            title: title.to_owned(),
            status: status.as_u16(),
            detail: detail.into(),
            request_id: None,
            field: None,
            extra: serde_json::Map::new(),
            retry_after: None,
            challenge: false,
        }
    }

    /// The request this problem answers.
    pub fn at(mut self, request_id: &str) -> Self {
        self.request_id = Some(request_id.to_owned());
        self
    }

    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    pub fn with(mut self, key: &str, value: serde_json::Value) -> Self {
        self.extra.insert(key.to_owned(), value);
        self
    }

    /// Answered with `Retry-After: seconds`.
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// 401, with `WWW-Authenticate: Bearer`.
    pub fn unauthorized(detail: &str) -> Self {
        let mut p = Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "no valid API key",
            detail,
        );
        p.challenge = true;
        p
    }

    /// 403: the key lacks `scope`.
    pub fn forbidden(scope: &str) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "the API key lacks a scope",
            format!("this route needs the scope {scope}; ask an operator for a key with it (`codepool api-keys create --scopes {scope}`)"),
        )
        .with("scope", serde_json::Value::String(scope.to_owned()))
    }

    /// 429, with `Retry-After`.
    pub fn too_many(seconds: u64) -> Self {
        let mut p = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate-limited",
            "too many requests for this API key",
            format!("wait {seconds} s (Retry-After), then send the request again"),
        );
        p.retry_after = Some(seconds);
        p
    }

    /// 422 `invalid-body`: the body is not `what` this route takes; the
    /// detail shows what to send, then the parser's words.
    pub fn invalid_body(what: &str, send: &str, e: &serde_json::Error) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-body",
            &format!("the body is not {what}"),
            format!("send {send} ({e})"),
        )
    }

    /// 503: a server codepool needs is away; the request changed nothing
    /// that a retry would repeat. The body names no server, address or
    /// command; the cause is logged at debug (the outage itself shows in
    /// /readyz and the process's own log lines).
    pub fn unavailable(e: &dyn std::fmt::Display) -> Self {
        // Every request of a batch gets the same outage: one line per
        // request would flood the log, and /readyz already says it.
        tracing::debug!(error = %e, "answered 503");
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "a server codepool needs is unavailable",
            "send the request again in a few seconds (the same order id gets the same codes, the same redemption id the same answer)"
                .to_owned(),
        );
        p.retry_after = Some(2);
        p
    }

    /// 500: something failed that a retry may not fix. The cause is
    /// logged for the operator, under the request id the body carries;
    /// the body says what did not happen twice (`kept`) and no more.
    pub fn internal(e: &dyn std::fmt::Display, kept: &str) -> Self {
        tracing::error!(error = %e, "answered 500");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "codepool could not finish the request",
            format!("{kept}. Send the request again; if it fails again, give the request id (instance) to an operator"),
        )
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut res = (status, body).into_response();
        let h = res.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(s) = self.retry_after {
            h.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.challenge {
            h.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"codepool\""),
            );
        }
        res
    }
}
