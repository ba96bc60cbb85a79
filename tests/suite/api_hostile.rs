//! Hostile requests against a real `codepool api`: each gets its 4xx with
//! a problem body that says what to do, never a 500 or a panic, and the
//! process keeps serving (checked after every one).

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::api::{key, ApiServer};
use crate::common::{http_get, TestEnv};

/// What a raw request got: status, content type, body.
struct Got {
    status: u16,
    content_type: String,
    body: Vec<u8>,
}

/// Sends `raw` bytes as they are (a head and maybe a body) and reads the
/// answer until the server closes.
async fn raw(addr: &str, bytes: &[u8]) -> Got {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await;
    parse(&out)
}

fn parse(out: &[u8]) -> Got {
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(out.len());
    let head = String::from_utf8_lossy(&out[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let content_type = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-type:")
                .map(|v| v.trim().to_owned())
        })
        .unwrap_or_default();
    Got {
        status,
        content_type,
        body: out.get(split + 4..).unwrap_or_default().to_vec(),
    }
}

/// A request with the usual head: `Connection: close`, the key, the body.
fn request(method: &str, path: &str, key: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {key}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// The head of a 10 MB order and its first 64 KiB: the server refuses it
/// by its length, without reading the rest.
fn ten_megabytes(key: &str) -> Vec<u8> {
    let mut r = format!(
        "POST /v1/orders HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        10 * 1024 * 1024
    )
    .into_bytes();
    r.extend(std::iter::repeat_n(b'{', 64 * 1024));
    r
}

fn post_order(key: &str, body: &[u8]) -> Vec<u8> {
    request("POST", "/v1/orders", key, "application/json", body)
}

/// Asserts a 4xx problem whose detail says something.
fn assert_problem(what: &str, got: &Got, status: u16) {
    assert_eq!(
        got.status,
        status,
        "{what}: {}",
        String::from_utf8_lossy(&got.body)
    );
    assert_eq!(got.content_type, "application/problem+json", "{what}");
    let p: Value = serde_json::from_slice(&got.body).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(p["status"], status, "{what}");
    assert!(
        p["detail"].as_str().is_some_and(|d| d.len() > 10),
        "{what}: {p}"
    );
    assert!(p["request_id"].is_string(), "{what}: {p}");
}

/// Hostile orders and requests: (what, bytes, the status it must get).
fn cases(k: &str) -> Vec<(&'static str, Vec<u8>, u16)> {
    let ok = |extra: &str| {
        format!(r#"{{"order_id":"H-1","uid":"u","phone":"+8613800000000","pool":"hp"{extra}}}"#)
    };
    let long = "x".repeat(5000);
    let mut non_utf8 = br#"{"order_id":"H-2","uid":""#.to_vec();
    non_utf8.extend_from_slice(&[0xff, 0xfe, 0xc0]);
    non_utf8.extend_from_slice(br#"","phone":"+8613800000000","pool":"hp"}"#);
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    vec![
        ("a wrong content type", request("POST", "/v1/orders", k, "text/plain", ok("").as_bytes()), 415),
        ("a form body", request("POST", "/v1/orders", k, "application/x-www-form-urlencoded", b"order_id=1"), 415),
        ("a 10 MB body", ten_megabytes(k), 413),
        ("duplicate JSON keys", post_order(k, br#"{"order_id":"a","order_id":"b","uid":"u","phone":"+8613800000000","pool":"hp"}"#), 422),
        ("{\"$ne\": …} as an id", post_order(k, br#"{"order_id":{"$ne":null},"uid":"u","phone":"+8613800000000","pool":"hp"}"#), 422),
        ("{\"$gt\": …} as a pool", post_order(k, br#"{"order_id":"H-3","uid":"u","phone":"+8613800000000","pool":{"$gt":""}}"#), 422),
        ("an overlong order id", post_order(k, format!(r#"{{"order_id":"{long}","uid":"u","phone":"+8613800000000","pool":"hp"}}"#).as_bytes()), 422),
        ("an overlong uid", post_order(k, format!(r#"{{"order_id":"H-4","uid":"{long}","phone":"+8613800000000","pool":"hp"}}"#).as_bytes()), 422),
        ("non-UTF-8 bytes in a field", post_order(k, &non_utf8), 422),
        ("a NUL in an id", post_order(k, br#"{"order_id":"H\u0000-5","uid":"u","phone":"+8613800000000","pool":"hp"}"#), 422),
        ("a right-to-left override in an id", post_order(k, "{\"order_id\":\"H-\u{202e}6\",\"uid\":\"u\",\"phone\":\"+8613800000000\",\"pool\":\"hp\"}".as_bytes()), 422),
        ("a quantity as a string", post_order(k, ok(r#","quantity":"2""#).as_bytes()), 422),
        ("a fractional quantity", post_order(k, ok(r#","quantity":2.5"#).as_bytes()), 422),
        ("a negative quantity", post_order(k, ok(r#","quantity":-1"#).as_bytes()), 422),
        ("a quantity of 1e400", post_order(k, ok(r#","quantity":1e400"#).as_bytes()), 422),
        ("a quantity over the maximum", post_order(k, ok(r#","quantity":101"#).as_bytes()), 422),
        ("a phone that is not one", post_order(k, br#"{"order_id":"H-7","uid":"u","phone":"+86 ' OR 1=1","pool":"hp"}"#), 422),
        ("path traversal as a pool", post_order(k, br#"{"order_id":"H-8","uid":"u","phone":"+8613800000000","pool":"../../etc"}"#), 422),
        ("an array body", post_order(k, b"[]"), 422),
        ("null", post_order(k, b"null"), 422),
        ("an empty body", post_order(k, b""), 422),
        ("JSON nested 5,000 deep", post_order(k, deep.as_bytes()), 422),
        ("not JSON at all", post_order(k, b"\x00\x01\x02binary"), 422),
        ("path traversal in an id", request("GET", "/v1/orders/..%2F..%2Fetc%2Fpasswd", k, "application/json", b""), 404),
        ("a dot-dot path", request("GET", "/v1/../../etc/passwd", k, "application/json", b""), 404),
        ("a bad percent escape in an id", request("GET", "/v1/orders/%ZZ%C0", k, "application/json", b""), 400),
        ("an unknown route", request("GET", "/v1/orders-and-more", k, "application/json", b""), 404),
        ("a method the route does not take", request("DELETE", "/v1/orders", k, "application/json", b""), 405),
        ("a key in the wrong scheme", request("POST", "/v1/orders", "x", "application/json", b"{}").replace_auth("Basic dXNlcjpwYXNz"), 401),
        ("a forged key", post_order("cpk_0000000000000000_ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff", ok("").as_bytes()), 401),
        ("a key of garbage", post_order("cpk_'--;DROP TABLE", ok("").as_bytes()), 401),
        ("a query that does not parse", request("GET", "/v1/orders/H-1?reveal=maybe", k, "application/json", b""), 400),
        ("a void without a reason", request("POST", "/v1/orders/H-1/void", k, "application/json", b"{}"), 422),
        ("an unknown pool", post_order(k, br#"{"order_id":"H-9","uid":"u","phone":"+8613800000000","pool":"nowhere"}"#), 422),
    ]
}

trait ReplaceAuth {
    fn replace_auth(self, with: &str) -> Vec<u8>;
}

impl ReplaceAuth for Vec<u8> {
    fn replace_auth(self, with: &str) -> Vec<u8> {
        String::from_utf8(self)
            .unwrap()
            .replace("Bearer x", with)
            .into_bytes()
    }
}

#[tokio::test]
async fn hostile_requests_get_their_problem_and_the_api_keeps_serving() {
    let env = TestEnv::new("api_hostile").await;
    env.fill_pool("hp", 5).await;
    let k = key(&env, "shop", "orders:write,orders:read").await;
    let api = ApiServer::start(
        &env,
        &["--rate-per-key", "100000", "--request-timeout", "3"],
    )
    .await;
    let all = cases(&k);
    assert!(all.len() >= 30, "{} hostile requests", all.len());
    for (what, bytes, status) in &all {
        let got = raw(&api.addr, bytes).await;
        assert_problem(what, &got, *status);
        let alive = http_get(&api.addr, "/healthz").await;
        assert_eq!(
            alive.map(|(s, _)| s),
            Some(200),
            "still serving after {what}"
        );
    }
    // A huge header: 431, as a problem.
    let mut big = format!("GET /v1/orders/H-1 HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {k}\r\nX-Junk: ").into_bytes();
    big.extend(std::iter::repeat_n(b'a', 64 * 1024));
    big.extend_from_slice(b"\r\n\r\n");
    assert_problem("a huge header", &raw(&api.addr, &big).await, 431);
    // A slow body: the request times out with 408, the server goes on.
    let mut s = tokio::net::TcpStream::connect(&api.addr).await.unwrap();
    let head = format!("POST /v1/orders HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {k}\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{{\"order_id\":");
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await;
    assert_problem("a slow body", &parse(&out), 408);
    // Nothing panicked, nothing answered 500.
    let (status, metrics) = http_get(&api.addr, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert!(!metrics.contains("status=\"500\""), "{metrics}");
    api.stop().await;
    env.cleanup().await;
}

/// An upload is imported while it is still arriving: the first rows are in
/// the pool before the client has sent the rest, so the body is streamed
/// through the importer, never held whole.
#[tokio::test]
async fn an_upload_is_imported_while_it_is_still_arriving() {
    let env = TestEnv::new("api_upload_stream").await;
    let k = key(&env, "ops", "admin").await;
    let api = ApiServer::start(&env, &[]).await;
    let rows = |range: std::ops::Range<u32>| -> String {
        range.map(|i| format!("ST-{i:07}-WXYZ\n")).collect()
    };
    let (first, rest) = (format!("code\n{}", rows(0..5_000)), rows(5_000..20_000));
    let total = first.len() + rest.len();
    let mut s = tokio::net::TcpStream::connect(&api.addr).await.unwrap();
    let head = format!("POST /v1/pools/st/imports?file=big.csv HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {k}\r\nContent-Type: text/csv\r\nContent-Length: {total}\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(first.as_bytes()).await.unwrap();
    // The request is open, three quarters of its body unsent: codes of the
    // first part must already be in the pool.
    crate::common::eventually(
        Duration::from_secs(30),
        "the first rows imported mid-upload",
        || {
            let codes = env.store.database().collection::<bson::Document>("codes");
            async move {
                codes
                    .count_documents(bson::doc! {"pool": "st"})
                    .await
                    .unwrap()
                    >= 1_000
            }
        },
    )
    .await;
    let mid = env
        .store
        .database()
        .collection::<bson::Document>("codes")
        .count_documents(bson::doc! {"pool": "st"})
        .await
        .unwrap();
    assert!(
        mid < 20_000,
        "not everything before the rest was sent: {mid}"
    );
    s.write_all(rest.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let got = parse(&out);
    assert_eq!(got.status, 201, "{}", String::from_utf8_lossy(&got.body));
    let summary: Value = serde_json::from_slice(&got.body).unwrap();
    assert_eq!(summary["inserted"], 20_000);
    api.stop().await;
    env.cleanup().await;
}
