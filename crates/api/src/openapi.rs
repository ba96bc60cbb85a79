//! The API's OpenAPI 3.1 document, generated from the handlers'
//! `#[utoipa::path]` annotations and the schemas derived from the types
//! they read and answer (beside each handler), plus the few written out
//! below; served at `GET /openapi.json`. The suite holds real traffic to
//! it: every answer's status is documented for its route, and every JSON
//! body validates against the documented schema (which refuses unknown
//! members).

#![allow(dead_code)] // The shapes below exist to be documented.

use serde::Serialize;
use utoipa::openapi::path::{HttpMethod, Operation, PathItem};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{
    Content, ContentBuilder, OpenApi as Document, RefOr, Response, ResponseBuilder,
};
use utoipa::{Modify, OpenApi, ToSchema};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "codepool",
        description = "Pre-issued activation codes for shop backends: an order gets exactly its codes, once, however often it is sent. Every /v1 route needs `Authorization: Bearer cpk_…` with the route's scope (orders:write, orders:read, codes:reveal, codes:redeem, admin). Errors are RFC 9457 problems whose `detail` says what to do next. The /channels routes are the marketplaces' (tag channels).",
        license(name = "Apache-2.0"),
    ),
    tags(
        (name = "orders", description = "Place an order, read it, redeem, void, resend, replace one of its codes"),
        (name = "codes", description = "For the platform that honours the codes: check a code and redeem it exactly once, by value (`codes:redeem`)"),
        (name = "holds", description = "Checkout holds: codes set aside while a buyer pays, shown to no one, turned into the order's codes by `POST /v1/orders` with `hold_id`"),
        (name = "pools", description = "Pools, their stock and settings (admin)"),
        (name = "imports", description = "CSV uploads of a partner's codes (admin)"),
        (name = "generations", description = "Codes generated in a pool instead of imported: random Crockford base-32 of a pattern, as an import run of its own (admin)"),
        (name = "statements", description = "What became of every import run's codes in a period, each row checked to tie out; every move by the code's statement HMAC (admin)"),
        (name = "shops", description = "Shops: the pools each may order from (admin)"),
        (name = "webhooks", description = "A shop's webhook endpoints, deliveries and replays, to the Standard Webhooks specification (admin)"),
        (name = "dead-letters", description = "Purchases codepool could not take (admin)"),
        (name = "channels", description = "The marketplaces' own protocols on a shop's channels (docs/channels.md): Eneba's Declared Stock callbacks, G2A's Dropshipping API, Kinguin's reservation webhooks. No API key: each marketplace authenticates as its contract says, and every refusal has the marketplace's own error shape"),
        (name = "operations", description = "Health, readiness and metrics (no key)"),
    ),
    components(schemas(ProblemDoc)),
)]
pub(crate) struct ApiDoc;

// The two request bodies below stay written out by hand: their handlers
// read them with the core's own parsers (`Purchase::parse` in the domain,
// `HoldRequest::parse` in issuance), which check what serde cannot (a key
// sent twice, trimming and NFC, invisible characters, a bundle's `items`
// instead of `pool` and `quantity`, defaults), into types whose fields are
// not the body's (`Purchase.pool` is required there, optional here for a
// bundle; `HoldRequest.ttl_seconds` is always set). A schema derived from
// those types would document another body. `tests` below hold each
// documented field to the parser: it must read every one of them.

/// A purchase: the fields and rules of the AMQP purchase (docs/messages.md).
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PurchaseIn {
    /// The shop's order id: the same id is the same order.
    #[schema(min_length = 1, max_length = 128)]
    order_id: String,
    /// The buyer.
    #[schema(min_length = 1, max_length = 128)]
    uid: String,
    /// E.164 phone number the codes are texted to.
    #[schema(example = "+8613800000000")]
    phone: String,
    /// The pool the codes come from (leave out for a bundle).
    #[schema(nullable = false)]
    pool: Option<String>,
    /// RFC 3339 time of the purchase.
    #[schema(nullable = false)]
    purchased_at: Option<String>,
    /// How many distinct codes: 1 to 100 (default 1; leave out for a
    /// bundle).
    #[schema(minimum = 1, maximum = 100, nullable = false)]
    quantity: Option<u32>,
    /// The shop the order is for. A shop's key orders for its own shop
    /// only, and may leave this out.
    #[schema(nullable = false)]
    shop: Option<String>,
    /// A bundle instead of `pool` and `quantity`: 1 to 10 items of
    /// different pools, at most 100 codes in all. Granted whole, or
    /// waiting whole.
    #[schema(nullable = false, min_items = 1, max_items = 10)]
    items: Option<Vec<crate::items::Item>>,
    /// The checkout hold this order pays for: its held codes become the
    /// order's. Its items must be the order's. An expired or released
    /// hold's order is granted from stock or waits; it is never refused
    /// for that.
    #[schema(nullable = false, min_length = 1, max_length = 128)]
    hold_id: Option<String>,
}

/// `POST /v1/holds`.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct HoldIn {
    /// The shop's id for this checkout: the same id is the same hold.
    #[schema(min_length = 1, max_length = 128)]
    hold_id: String,
    /// The buyer.
    #[schema(min_length = 1, max_length = 128)]
    uid: String,
    /// 1 to 10 items of different pools, at most 100 codes in all.
    #[schema(min_items = 1, max_items = 10)]
    items: Vec<crate::items::Item>,
    /// Seconds until the hold expires: 1 to 3600 (default 900).
    #[schema(minimum = 1, maximum = 3600, nullable = false)]
    ttl_seconds: Option<u64>,
}

/// A generation run to start.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct GenerationIn {
    /// How many codes the run makes in all.
    #[schema(minimum = 1, maximum = 10_000_000)]
    count: u64,
    /// Fixed text, `{random:N}`, `{number}`, `{check}`; at least 40 random
    /// bits (8 symbols). Default `{random:4}-{random:4}-{random:4}-{random:4}`.
    pattern: Option<String>,
    /// End every code with a Crockford mod-37 check symbol.
    check_char: Option<bool>,
    /// When the codes expire (RFC 3339).
    expires_at: Option<String>,
    /// The run to make or finish (24 hexadecimal digits). When absent, the
    /// unfinished run of the same pool, pattern, count, check symbol and
    /// expiry is taken up, else a new one is made.
    run_id: Option<String>,
    /// A new run even when an unfinished run of the same kind exists (that
    /// one stays unfinished); not with `run_id`.
    new_run: Option<bool>,
}

/// A run just started.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct GenerationStarted {
    run_id: String,
    pool: String,
    count: u64,
    /// The pattern, `{check}` written out when codes carry one.
    pattern: String,
    /// `running`.
    status: String,
    /// True when an unfinished run of the same kind was taken up (no run id
    /// or `new_run` was sent).
    resumed: bool,
}

/// A generation run's record.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct GenerationOut {
    run_id: String,
    pool: String,
    pattern: String,
    count: u64,
    check_char: bool,
    expires_at: Option<String>,
    /// `running`, `done`, `interrupted` or `failed`.
    status: String,
    /// Codes the run holds so far.
    inserted: u64,
    /// Codes drawn again because they collided with existing ones.
    redrawn: u64,
    error: Option<String>,
    started_at: String,
    finished_at: Option<String>,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReasonIn {
    reason: String,
}

/// An RFC 9457 problem.
#[derive(Serialize, ToSchema)]
pub(crate) struct ProblemDoc {
    /// A URI naming the problem's kind.
    #[serde(rename = "type")]
    kind: String,
    title: String,
    status: u16,
    /// What to do next.
    detail: String,
    #[schema(nullable = false)]
    request_id: Option<String>,
    /// The request field at fault.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    field: Option<String>,
}

/// What every `/v1` route may also answer, whatever it does.
const COMMON: &[(&str, &str)] = &[
    (
        "400",
        "the request cannot be read (a path or query that does not parse)",
    ),
    (
        "401",
        "no key, or an unknown or revoked one (with `WWW-Authenticate: Bearer`)",
    ),
    ("403", "the key lacks the route's scope (named in `detail`)"),
    ("405", "the route does not take that method"),
    ("408", "the request took longer than `--request-timeout`"),
    ("413", "the body is over `--body-limit`"),
    ("415", "the body is not of the route's content type"),
    (
        "429",
        "the key is over its rate (`Retry-After` says when to come back)",
    ),
    (
        "500",
        "a fault; nothing was granted twice, send the request again",
    ),
    (
        "503",
        "MongoDB or RabbitMQ is away; send the request again (`Retry-After`)",
    ),
];

/// Adds the bearer scheme, the common problems of every `/v1` operation,
/// and the operations routes (health, readiness, metrics, this document).
struct Common;

impl Modify for Common {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("cpk_<id>_<secret>")
                    .build(),
            ),
        );
        for (path, item) in doc.paths.paths.iter_mut() {
            if path.starts_with("/v1/") {
                for op in operations(item) {
                    add_common(op);
                }
            }
        }
        for (path, id, what, content_type) in [
            ("/healthz", "healthz", "the process is alive", "text/plain"),
            (
                "/readyz",
                "readyz",
                "ready: MongoDB and RabbitMQ reachable (503 when not)",
                "text/plain",
            ),
            ("/metrics", "metrics", "Prometheus metrics", "text/plain"),
            (
                "/openapi.json",
                "openapi",
                "this document",
                "application/json",
            ),
        ] {
            let item = operations_item(id, what, content_type);
            doc.paths.paths.insert(path.to_owned(), item);
        }
    }
}

fn operations(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        item.get.as_mut(),
        item.post.as_mut(),
        item.patch.as_mut(),
        item.put.as_mut(),
        item.delete.as_mut(),
    ]
    .into_iter()
    .flatten()
}

fn problem_content() -> Content {
    ContentBuilder::new()
        .schema(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(
            "ProblemDoc",
        ))))
        .build()
}

fn add_common(op: &mut Operation) {
    for (status, what) in COMMON {
        op.responses
            .responses
            .entry((*status).to_owned())
            .or_insert_with(|| {
                RefOr::T(
                    ResponseBuilder::new()
                        .description(*what)
                        .content("application/problem+json", problem_content())
                        .build(),
                )
            });
    }
}

fn operations_item(id: &str, what: &str, content_type: &str) -> PathItem {
    let ok: Response = ResponseBuilder::new()
        .description(what)
        .content(content_type, ContentBuilder::new().build())
        .build();
    let unready: Response = ResponseBuilder::new().description("not ready").build();
    let op = utoipa::openapi::path::OperationBuilder::new()
        .tag("operations")
        .summary(Some(what))
        .operation_id(Some(id))
        .response("200", ok)
        .response("503", unready)
        .build();
    PathItem::new(HttpMethod::Get, op)
}

/// The document the router's annotations made, completed: the key scheme,
/// the common problems of every `/v1` operation, the operations routes,
/// and the marketplaces' routes (`channels`, each with its own bodies,
/// error shape and authentication).
pub(crate) fn complete(mut doc: Document, channels: Document) -> Document {
    Common.modify(&mut doc);
    doc.merge(channels);
    let components = doc.components.get_or_insert_with(Default::default);
    for (name, scheme) in crate::channels::security_schemes() {
        components.add_security_scheme(name, scheme);
    }
    doc
}

#[cfg(test)]
mod tests {
    use codepool_domain::{Purchase, PurchaseError};
    use codepool_issuance::holds::HoldRequest;
    use serde_json::{json, Value};
    use utoipa::ToSchema;

    use super::{HoldIn, PurchaseIn};
    use crate::items::Item;

    /// A hand-written schema's properties, and which of them it requires.
    fn documented<T: ToSchema>() -> (Vec<String>, Vec<String>) {
        let schema = serde_json::to_value(T::schema()).unwrap();
        let names = |v: &Value| -> Vec<String> {
            match v {
                Value::Object(m) => m.keys().cloned().collect(),
                Value::Array(a) => a
                    .iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect(),
                _ => Vec::new(),
            }
        };
        (names(&schema["properties"]), names(&schema["required"]))
    }

    /// Why `body` is refused: the field it names.
    fn refused_on(parse: &dyn Fn(&[u8]) -> Result<(), PurchaseError>, body: &Value) -> String {
        match parse(&serde_json::to_vec(body).unwrap()) {
            Ok(()) => panic!("{body} parses: the parser does not read a documented field"),
            Err(e) => e.field().unwrap_or_default().to_owned(),
        }
    }

    /// Holds a hand-written body schema to its parser: `base`, the
    /// smallest valid body, parses; each required field left out, and
    /// each documented field sent as an object (wrong for every one of
    /// them), is refused naming that field.
    fn fields_read<T: ToSchema>(base: &Value, parse: &dyn Fn(&[u8]) -> Result<(), PurchaseError>) {
        parse(&serde_json::to_vec(base).unwrap()).expect("the smallest valid body");
        let (properties, required) = documented::<T>();
        for field in &required {
            let mut body = base.clone();
            body.as_object_mut().unwrap().remove(field);
            assert_eq!(&refused_on(parse, &body), field, "{body}");
        }
        for field in &properties {
            let mut body = base.clone();
            body[field] = json!({"not": "this"});
            assert_eq!(&refused_on(parse, &body), field, "{body}");
        }
    }

    /// The same for the fields of `base`'s first item (`items[0].pool`).
    fn item_fields_read(base: &Value, parse: &dyn Fn(&[u8]) -> Result<(), PurchaseError>) {
        let (properties, required) = documented::<Item>();
        assert_eq!(properties, required, "every field of an item is required");
        for field in &properties {
            let mut body = base.clone();
            body["items"][0][field] = json!({"not": "this"});
            assert_eq!(refused_on(parse, &body), format!("items[0].{field}"));
        }
    }

    #[test]
    fn every_documented_field_of_a_purchase_is_read_by_its_parser() {
        let parse = |b: &[u8]| Purchase::parse(b).map(drop);
        let base = json!({"order_id": "O-1", "uid": "u", "phone": "+8613800000000", "pool": "p"});
        fields_read::<PurchaseIn>(&base, &parse);
        let bundle = json!({"order_id": "O-1", "uid": "u", "phone": "+8613800000000",
            "items": [{"pool": "p", "quantity": 1}]});
        parse(&serde_json::to_vec(&bundle).unwrap()).expect("a bundle");
        item_fields_read(&bundle, &parse);
    }

    #[test]
    fn every_documented_field_of_a_hold_is_read_by_its_parser() {
        let parse = |b: &[u8]| HoldRequest::parse(b).map(drop);
        let base = json!({"hold_id": "H-1", "uid": "u", "items": [{"pool": "p", "quantity": 1}]});
        fields_read::<HoldIn>(&base, &parse);
        item_fields_read(&base, &parse);
    }
}
