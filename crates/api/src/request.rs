//! What one request carries to its handler: its id, and the key checks
//! every handler shares.

use axum::response::{IntoResponse, Response};
use codepool_issuance::api_keys::{KeyDoc, Scope};

use crate::problem::Problem;

/// The id of the request being served (also in `x-request-id`).
#[derive(Debug, Clone)]
pub(crate) struct RequestId(pub String);

/// The 403 for a key without the `admin` scope, if `key` lacks it.
pub(crate) fn need_admin(key: &KeyDoc, rid: &RequestId) -> Option<Response> {
    (!key.allows(Scope::Admin)).then(|| {
        Problem::forbidden(Scope::Admin.as_str())
            .at(&rid.0)
            .into_response()
    })
}
