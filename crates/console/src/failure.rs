//! What a console page answers when it cannot do what was asked: one
//! type, rendered once as a page that says what to do next.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use maud::html;

use codepool_issuance::StoreError;

use codepool_issuance::operators::Role;

#[derive(Debug)]
pub enum Failure {
    /// The operator's role does not hold this.
    Forbidden(Role),
    /// A state-changing form without this session's CSRF token.
    Csrf,
    /// Nothing by that name or id.
    NotFound(String),
    /// The form says something the operation refuses; what to fix.
    Invalid(String),
    /// A part of the request is larger than the console reads.
    TooLarge(String),
    /// The change cannot apply to what it names now.
    Conflict(String),
    /// A server codepool needs is away: try again.
    Unavailable(String),
    /// Too much of this runs at once: try again in `wait` seconds.
    Busy { detail: String, wait: u64 },
    /// Anything else; logged.
    Internal(String),
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        if let Some(hint) = e.operator_hint() {
            // Operators read the console: they get what to do.
            Failure::Unavailable(format!("{e}; {hint}"))
        } else {
            Failure::Internal(e.to_string())
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let (status, title, detail) = match self {
            Failure::Forbidden(role) => (
                StatusCode::FORBIDDEN,
                "Not allowed",
                format!("this needs the {} role; ask an admin", role.as_str()),
            ),
            Failure::Csrf => (
                StatusCode::FORBIDDEN,
                "Form refused",
                "the form did not carry this session's CSRF token; go back, reload the page and send it again".to_owned(),
            ),
            Failure::NotFound(d) => (StatusCode::NOT_FOUND, "Not found", d),
            Failure::Invalid(d) => (StatusCode::UNPROCESSABLE_ENTITY, "Not done", d),
            Failure::TooLarge(d) => (StatusCode::PAYLOAD_TOO_LARGE, "Too large", d),
            Failure::Conflict(d) => (StatusCode::CONFLICT, "Not done", d),
            Failure::Unavailable(d) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Try again",
                format!("{d}; nothing was changed twice, try again in a moment"),
            ),
            Failure::Busy { detail, wait } => {
                let body = crate::frame::bare(
                    "Busy",
                    html! {
                        h1 { "Busy" }
                        p.problem role="alert" { (detail) "; try again in " (wait) " s." }
                        p { a href="/console/pools" { "Back to the pools" } }
                    },
                );
                let mut r = (StatusCode::TOO_MANY_REQUESTS, Html(body.into_string())).into_response();
                r.headers_mut()
                    .insert(axum::http::header::RETRY_AFTER, wait.into());
                return r;
            }
            Failure::Internal(d) => {
                tracing::error!(error = %d, "console request failed");
                (StatusCode::INTERNAL_SERVER_ERROR, "Failed", d)
            }
        };
        let body = crate::frame::bare(
            title,
            html! {
                h1 { (title) }
                p.problem role="alert" { (detail) }
                p { a href="/console/pools" { "Back to the pools" } }
            },
        );
        (status, Html(body.into_string())).into_response()
    }
}
