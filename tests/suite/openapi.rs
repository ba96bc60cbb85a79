//! The HTTP API's OpenAPI document against real traffic. Every answer the
//! API tests get on a documented route is checked here (through
//! `api::http`): its status must be documented for the route and method,
//! and a JSON body must validate against the documented schema, whose
//! objects refuse unknown members. The document itself must be a valid
//! OpenAPI 3.1 document (the reference validator), served as generated,
//! and cover every route the API serves.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::{json, Value};

use crate::api::{http, json_of};
use crate::common::TestEnv;
use crate::fixtures::api_with_key;

/// The document and the validators made from it so far.
pub(crate) struct Contract {
    doc: Value,
    validators: Mutex<HashMap<String, Arc<jsonschema::Validator>>>,
}

pub(crate) fn contract() -> &'static Contract {
    static CONTRACT: OnceLock<Contract> = OnceLock::new();
    CONTRACT.get_or_init(|| Contract {
        doc: serde_json::to_value(codepool_api::openapi_document()).unwrap(),
        validators: Mutex::default(),
    })
}

/// Does a concrete path (`/v1/orders/O-1`) fit a template
/// (`/v1/orders/{order_id}`)?
fn fits(template: &str, path: &str) -> bool {
    let (t, p): (Vec<&str>, Vec<&str>) = (template.split('/').collect(), path.split('/').collect());
    t.len() == p.len()
        && t.iter().zip(&p).all(|(t, p)| {
            if t.starts_with('{') {
                !p.is_empty()
            } else {
                t == p
            }
        })
}

impl Contract {
    /// The documented operation a request lands on: its template and
    /// description. `None` for a path no route documents.
    fn operation(&self, method: &str, path: &str) -> Option<(String, &Value)> {
        let path = path.split('?').next().unwrap_or(path);
        let (template, item) = self.doc["paths"]
            .as_object()?
            .iter()
            .find(|(t, _)| fits(t, path))?;
        Some((template.clone(), item.get(method.to_lowercase())?))
    }

    /// Checks one exchange against the document; the reason it breaks it.
    pub(crate) fn check(
        &self,
        method: &str,
        path: &str,
        status: u16,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Result<(), String> {
        let path_only = path.split('?').next().unwrap_or(path);
        if !self.doc["paths"]
            .as_object()
            .is_some_and(|paths| paths.keys().any(|t| fits(t, path_only)))
        {
            return Ok(()); // Not a route: the fallback's 404, checked elsewhere.
        }
        let Some((template, op)) = self.operation(method, path) else {
            // A documented path with a method it does not take.
            return if status == 405 {
                Ok(())
            } else {
                Err(format!(
                    "{method} {path}: method not documented, got {status}"
                ))
            };
        };
        let Some(response) = op["responses"].get(status.to_string()) else {
            return Err(format!(
                "{method} {template}: status {status} is not documented (body {})",
                String::from_utf8_lossy(body)
            ));
        };
        let ct = content_type
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim();
        if !ct.contains("json") || body.is_empty() {
            return Ok(());
        }
        let Some(schema) = response["content"].get(ct).map(|c| &c["schema"]) else {
            return Err(format!(
                "{method} {template} {status}: content type {ct} not documented"
            ));
        };
        if schema.is_null() {
            return Ok(());
        }
        let instance: Value = serde_json::from_slice(body)
            .map_err(|e| format!("{method} {template} {status}: not JSON ({e})"))?;
        let validator = self.validator(&format!("{method} {template} {status} {ct}"), schema);
        let errors: Vec<String> = validator
            .iter_errors(&instance)
            .map(|e| format!("{e} at {}", e.instance_path()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{method} {template} {status}: {errors:?} in {instance}"
            ))
        }
    }

    fn validator(&self, name: &str, schema: &Value) -> Arc<jsonschema::Validator> {
        let mut made = self.validators.lock().unwrap();
        made.entry(name.to_owned())
            .or_insert_with(|| {
                // The schema with the document's components beside it, so
                // `#/components/schemas/X` resolves.
                let whole = json!({
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "allOf": [schema],
                    "components": self.doc["components"],
                });
                Arc::new(jsonschema::validator_for(&whole).expect("a documented schema compiles"))
            })
            .clone()
    }
}

/// The document is valid OpenAPI 3.1 by the reference validator.
fn validate_with_reference(doc: &Value) {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), serde_json::to_vec(doc).unwrap()).unwrap();
    let python = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../.services/venv/bin/python"
    );
    let out = std::process::Command::new(python)
        .args([
            "-c",
            "import json,sys; from openapi_spec_validator import validate; validate(json.load(open(sys.argv[1]))); print('valid')",
        ])
        .arg(file.path())
        .output()
        .expect("the services venv (make services installs openapi-spec-validator)");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("valid"),
        "openapi-spec-validator: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A concrete path for a template, with ids that exist in the test (a
/// marketplace's route names a channel that does not: it answers in the
/// marketplace's shape).
fn concrete(template: &str) -> String {
    let path = template
        .replace("{order_id}", "OA-1")
        .replace("{pool}", "oa")
        .replace("{import_id}", "0123456789abcdef01234567");
    if !template.starts_with("/channels/") {
        return path;
    }
    path.replace("{name}", "oa-channel")
        .replace("{rid}", "r-1")
        .replace("{id}", "i-1")
}

#[tokio::test]
async fn the_openapi_document_is_valid_served_as_generated_and_covers_every_route() {
    let env = TestEnv::with_pools("api_openapi", &[("oa", 5)]).await;
    let (api, admin) =
        api_with_key(&env, "ops", "orders:write,orders:read,codes:reveal,admin").await;

    let (status, _, body) = http(&api.addr, "GET", "/openapi.json", None, b"").await;
    assert_eq!(status, 200);
    let served = json_of(&body);
    assert_eq!(served, contract().doc, "served as generated");
    assert_eq!(served["openapi"], "3.1.0");
    validate_with_reference(&served);

    // Every documented operation is a route the server has (not the
    // fallback's "no such route", not 405); every /v1 one needs its key.
    let paths = served["paths"].as_object().unwrap();
    let mut operations = 0;
    for (template, item) in paths {
        for method in ["get", "post", "patch", "put", "delete"] {
            let Some(op) = item.get(method) else { continue };
            operations += 1;
            let path = concrete(template);
            // A body only where a route reads one: a route that answers
            // without reading it closes the connection on unread bytes,
            // and the reset can reach the client before the answer.
            let body: &[u8] = match method {
                "get" | "delete" => b"",
                _ => b"{}",
            };
            let (status, _, body) = api.call(&method.to_uppercase(), &path, &admin, body).await;
            let problem = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
            assert!(
                status != 405 && problem["title"].as_str() != Some("no such route"),
                "{method} {path}: {status} {problem}"
            );
            if template.starts_with("/v1/") {
                assert!(
                    op["security"].is_array(),
                    "{method} {template} names its scope"
                );
                let (status, headers, _) =
                    http(&api.addr, &method.to_uppercase(), &path, None, b"").await;
                assert_eq!(status, 401, "{method} {path} without a key");
                assert!(headers.contains_key("www-authenticate"));
            }
        }
    }
    assert!(operations >= 20, "{operations} operations");
    // And the other way: every route in the operator's reference is in it.
    let reference = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/http-api.md"
    ))
    .unwrap();
    for line in reference
        .lines()
        .filter(|l| l.starts_with("| `") && l.contains(" /"))
    {
        let route = line.split('`').nth(1).unwrap();
        let Some((method, template)) = route.split_once(' ') else {
            continue;
        };
        if !["GET", "POST", "PATCH", "PUT", "DELETE"].contains(&method) {
            continue;
        }
        let template = template.split('?').next().unwrap();
        let item = paths
            .get(template)
            .unwrap_or_else(|| panic!("{route} from docs/http-api.md is not in the document"));
        assert!(
            item.get(method.to_lowercase()).is_some(),
            "{route} not documented"
        );
    }
    api.stop().await;
    env.cleanup().await;
}

#[test]
fn the_contract_refuses_an_undocumented_status_and_a_body_off_its_schema() {
    let c = contract();
    let placed = br#"{"order_id":"O","pool":"p","uid":"u","quantity":1,"state":"granted","codes":[],"waiting_lines":[]}"#;
    c.check("POST", "/v1/orders", 201, Some("application/json"), placed)
        .unwrap();
    assert!(
        c.check("POST", "/v1/orders", 204, None, b"").is_err(),
        "204 is not documented"
    );
    let extra = br#"{"order_id":"O","pool":"p","uid":"u","quantity":1,"state":"granted","codes":[],"waiting_lines":[],"secret":1}"#;
    assert!(c
        .check("POST", "/v1/orders", 201, Some("application/json"), extra)
        .is_err());
    let missing = br#"{"order_id":"O"}"#;
    assert!(c
        .check(
            "GET",
            "/v1/orders/O",
            200,
            Some("application/json"),
            missing
        )
        .is_err());
    let problem =
        br#"{"type":"https://codepool.dev/problems/x","title":"t","status":409,"detail":"d"}"#;
    c.check(
        "POST",
        "/v1/orders",
        409,
        Some("application/problem+json"),
        problem,
    )
    .unwrap();
}

#[test]
fn the_contract_holds_each_marketplaces_answers_to_its_own_shape() {
    let c = contract();
    let json = Some("application/json");
    let provided = br#"{"action":"PROVIDE","orderId":"o-1","success":true,"auctions":[{"auctionId":"a","keys":[{"type":"TEXT","value":"K-1"}]}]}"#;
    c.check("POST", "/channels/en/eneba", 200, json, provided)
        .unwrap();
    let unread = br#"{"action":null,"orderId":null,"success":false,"message":"not JSON"}"#;
    c.check("POST", "/channels/en/eneba", 400, json, unread)
        .unwrap();
    // A problem document is not Eneba's shape, nor is a key of another kind.
    let problem =
        br#"{"type":"https://codepool.dev/problems/x","title":"t","status":400,"detail":"d"}"#;
    assert!(c
        .check("POST", "/channels/en/eneba", 400, json, problem)
        .is_err());
    let wrong_key = br#"{"action":"PROVIDE","orderId":"o-1","success":true,"auctions":[{"auctionId":"a","keys":[{"type":"TEXT"}]}]}"#;
    assert!(c
        .check("POST", "/channels/en/eneba", 200, json, wrong_key)
        .is_err());

    let exists = br#"{"code":"order_exists","message":"m"}"#;
    c.check("POST", "/channels/g2/g2a/order", 409, json, exists)
        .unwrap();
    assert!(c
        .check("POST", "/channels/g2/g2a/order", 402, json, exists)
        .is_err());
    let reservation =
        br#"{"reservation_id":"r-1","stock":[{"product_id":10000045532001,"inventory_size":7}]}"#;
    c.check(
        "POST",
        "/channels/g2/g2a/reservation",
        200,
        json,
        reservation,
    )
    .unwrap();
    c.check("DELETE", "/channels/g2/g2a/reservation/r-1", 204, None, b"")
        .unwrap();

    let refused = br#"{"reservationId":null,"status":null,"error":"unauthorized","message":"m"}"#;
    c.check("POST", "/channels/kg/kinguin", 401, json, refused)
        .unwrap();
    assert!(c
        .check("POST", "/channels/kg/kinguin", 200, json, refused)
        .is_err());
}
