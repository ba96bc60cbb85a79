//! What one request carries to its handler, as axum extractors: its id,
//! the caller's key holding the route's scope ([`Caller`]), and its JSON
//! body ([`Body`]). A request they refuse is answered with a problem
//! (RFC 9457) naming what to send, before the handler runs.

use std::marker::PhantomData;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use codepool_issuance::api_keys::{KeyDoc, Scope};
use serde::de::DeserializeOwned;

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

/// The scope a route needs, as a type: `Caller<Admin>` is a key with the
/// `admin` scope.
pub(crate) trait Needs {
    /// `None`: any valid key (the handler decides, e.g. by the order's
    /// owner).
    const SCOPE: Option<Scope>;
}

macro_rules! scopes {
    ($($name:ident => $scope:expr),* $(,)?) => {$(
        pub(crate) struct $name;
        impl Needs for $name {
            const SCOPE: Option<Scope> = $scope;
        }
    )*};
}

scopes! {
    AnyKey => None,
    OrdersWrite => Some(Scope::OrdersWrite),
    OrdersRead => Some(Scope::OrdersRead),
    Admin => Some(Scope::Admin),
    CodesRedeem => Some(Scope::CodesRedeem),
}

/// The caller: its key (checked by the `authenticate` layer) holding the
/// scope `S` needs, and the request's id. A key without it is answered
/// 403 naming the scope.
pub(crate) struct Caller<S> {
    pub key: KeyDoc,
    pub rid: RequestId,
    needs: PhantomData<S>,
}

fn request_id(parts: &Parts) -> RequestId {
    parts
        .extensions
        .get::<RequestId>()
        .cloned()
        .unwrap_or_else(|| RequestId(String::new()))
}

impl<S: Needs, St: Send + Sync> FromRequestParts<St> for Caller<S> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Self, Response> {
        let rid = request_id(parts);
        let Some(key) = parts.extensions.get::<KeyDoc>().cloned() else {
            return Err(
                Problem::unauthorized("send an API key: Authorization: Bearer cpk_…")
                    .at(&rid.0)
                    .into_response(),
            );
        };
        if let Some(scope) = S::SCOPE.filter(|s| !key.allows(*s)) {
            return Err(Problem::forbidden(scope.as_str())
                .at(&rid.0)
                .into_response());
        }
        Ok(Caller {
            key,
            rid,
            needs: PhantomData,
        })
    }
}

/// A JSON body the route documents: what it is, and an example to send,
/// for the 422 that answers a body it cannot read.
pub(crate) trait BodyDoc: DeserializeOwned {
    /// "a replacement", "a pool's settings", …
    const WHAT: &'static str;
    /// A body to send instead, e.g. `{"reason": "refund"}`.
    const SEND: &'static str;
}

/// The request's JSON body as `T`; a body that is not `T` is answered 422
/// `invalid-body`, naming what to send and what the parser said.
pub(crate) struct Body<T>(pub T);

impl<T: BodyDoc, St: Send + Sync> FromRequest<St> for Body<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &St) -> Result<Self, Response> {
        let rid = req
            .extensions()
            .get::<RequestId>()
            .cloned()
            .unwrap_or_else(|| RequestId(String::new()));
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        serde_json::from_slice::<T>(&bytes).map(Body).map_err(|e| {
            Problem::invalid_body(T::WHAT, T::SEND, &e)
                .at(&rid.0)
                .into_response()
        })
    }
}
