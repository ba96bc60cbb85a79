//! Set-up and reads the feature tests share, so that a test says what it
//! sets up rather than how: keys, shops and pool settings, request bodies,
//! an API server with its key, reads of the test's database, `codepool`
//! runs and imports, and raw HTTP exchanges. The servers, the namespace
//! and the processes themselves are in `common.rs`.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use bson::oid::ObjectId;
use bson::{doc, Document};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::api::{json_of, key, ApiServer};
use crate::common::{codepool_ok, TestEnv};

// ---------------------------------------------------------------- keys, shops and pools

/// A key of `shop` with `orders:write,orders:read`.
pub(crate) async fn shop_key(env: &TestEnv, name: &str, shop: &str) -> String {
    let args = [
        "api-keys",
        "create",
        "--name",
        name,
        "--shop",
        shop,
        "--scopes",
        "orders:write,orders:read",
    ];
    codepool_ok(env, &args).await.trim().to_owned()
}

/// `codepool shops create --name NAME --pools POOLS`, then `extra`.
pub(crate) async fn create_shop(env: &TestEnv, name: &str, pools: &str, extra: &[&str]) {
    let mut args = vec!["shops", "create", "--name", name, "--pools", pools];
    args.extend_from_slice(extra);
    codepool_ok(env, &args).await;
}

/// A shop whose purchases the suite publishes: the suite publishes as the
/// broker's guest user.
pub(crate) async fn shop(env: &TestEnv, name: &str, pools: &str) {
    create_shop(env, name, pools, &["--broker-users", "guest"]).await;
}

/// The permissions (configure, write, read) that docs/shops.md gives a
/// shop's backend, read from its `rabbitmqctl set_permissions` line, each
/// name in them scoped to this test's AMQP prefix.
pub(crate) fn documented_shop_permissions(env: &TestEnv) -> [String; 3] {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/shops.md");
    let doc = std::fs::read_to_string(path).expect("docs/shops.md");
    let line = (doc.lines())
        .find(|l| l.trim_start().starts_with("rabbitmqctl set_permissions"))
        .expect("docs/shops.md shows a shop backend's permissions");
    let quoted: Vec<&str> = line.split('\'').skip(1).step_by(2).collect();
    assert_eq!(quoted.len(), 3, "configure, write, read in {line:?}");
    let prefix = env.amqp_prefix.replace('.', "\\.");
    // codepool's names carry the prefix; the broker's own (amq.*) do not.
    let scoped = |r: &str| match r {
        "^$" => r.to_owned(),
        _ if r.contains("amq") => r.to_owned(),
        _ => r.replacen('^', &format!("^{prefix}"), 1),
    };
    [scoped(quoted[0]), scoped(quoted[1]), scoped(quoted[2])]
}

/// A RabbitMQ user of this test named `PREFIX` + `label` (a killed run's
/// are swept with its queues), with `permissions` (configure, write,
/// read) on vhost `/`. Returns its name and its AMQP URL; remove it with
/// [`delete_broker_user`].
pub(crate) async fn broker_user(
    env: &TestEnv,
    label: &str,
    permissions: &[String; 3],
) -> (String, String) {
    let name = format!("{}{label}", env.amqp_prefix);
    let password = format!("{:032x}", rand::random::<u128>());
    crate::common::rabbitmqctl(&["add_user", &name, &password]).await;
    let [configure, write, read] = permissions;
    crate::common::rabbitmqctl(&["set_permissions", "-p", "/", &name, configure, write, read])
        .await;
    let url = format!("amqp://{name}:{password}@127.0.0.1:5672/%2f");
    (name, url)
}

/// Removes a user [`broker_user`] made.
pub(crate) async fn delete_broker_user(name: &str) {
    crate::common::rabbitmqctl(&["delete_user", name]).await;
}

/// `codepool pool set --pool POOL`, then `settings`.
pub(crate) async fn pool_set(env: &TestEnv, pool: &str, settings: &[&str]) {
    let mut args = vec!["pool", "set", "--pool", pool];
    args.extend_from_slice(settings);
    codepool_ok(env, &args).await;
}

/// Adds `n` codes `PREFIX-000001`… to an existing pool.
pub(crate) async fn add_codes(env: &TestEnv, pool: &str, prefix: &str, n: usize) {
    let new: Vec<codepool_store::NewCode> = (1..=n)
        .map(|i| codepool_store::NewCode {
            code: format!("{prefix}-{i:06}"),
            line: None,
            expires_at: None,
        })
        .collect();
    let out = env
        .store
        .insert_codes(pool, bson::oid::ObjectId::new(), &new)
        .await
        .expect("insert");
    assert_eq!(out.inserted as usize, n);
}

// ---------------------------------------------------------------- request bodies

/// The phone number of the suite's purchases.
pub(crate) const PHONE: &str = "+8613800000000";

/// A hold's body: `quantity` codes of one pool for `uid`.
pub(crate) fn hold(id: &str, uid: &str, pool: &str, quantity: u32) -> Vec<u8> {
    json!({"hold_id": id, "uid": uid, "items": [{"pool": pool, "quantity": quantity}]})
        .to_string()
        .into_bytes()
}

/// An order's body that pays the hold `hold_id`.
pub(crate) fn paid(order: &str, uid: &str, pool: &str, quantity: u32, hold_id: &str) -> Vec<u8> {
    json!({"order_id": order, "uid": uid, "phone": "+8613800000000", "pool": pool,
           "quantity": quantity, "hold_id": hold_id})
    .to_string()
    .into_bytes()
}

// ---------------------------------------------------------------- the api

/// A key `name` with `scopes`, then an API server to use it with.
pub(crate) async fn api_with_key(env: &TestEnv, name: &str, scopes: &str) -> (ApiServer, String) {
    let k = key(env, name, scopes).await;
    (ApiServer::start(env, &[]).await, k)
}

/// An API server without a rate limit to speak of, and a `checkout` key
/// with `orders:write,orders:read`.
pub(crate) async fn checkout_api(env: &TestEnv) -> (ApiServer, String) {
    let k = key(env, "checkout", "orders:write,orders:read").await;
    let api = ApiServer::start(env, &["--rate-per-key", "100000"]).await;
    (api, k)
}

/// `POST path` with `body` as `key`: the status and the JSON answer
/// (`null` for an empty one).
pub(crate) async fn post_json(api: &ApiServer, key: &str, path: &str, body: &[u8]) -> (u16, Value) {
    let (s, _, b) = api.post(path, key, body).await;
    (
        s,
        if b.is_empty() {
            Value::Null
        } else {
            json_of(&b)
        },
    )
}

// ---------------------------------------------------------------- the database

/// The `codes` collection of the test's database.
pub(crate) fn codes(env: &TestEnv) -> mongodb::Collection<Document> {
    env.coll("codes")
}

/// How many codes match `filter`.
pub(crate) async fn count_codes(env: &TestEnv, filter: Document) -> u64 {
    codes(env).count_documents(filter).await.unwrap()
}

/// How many documents of the collection `coll` match `filter`.
pub(crate) async fn count_docs(env: &TestEnv, coll: &str, filter: Document) -> u64 {
    env.coll(coll).count_documents(filter).await.unwrap()
}

/// The documents of the collection `coll` that match `filter`.
pub(crate) async fn find_docs(env: &TestEnv, coll: &str, filter: Document) -> Vec<Document> {
    use futures::TryStreamExt;
    let found = env.coll(coll).find(filter).await.unwrap();
    found.try_collect().await.unwrap()
}

/// The ids of the codes with `filter`.
pub(crate) async fn code_ids(env: &TestEnv, filter: Document) -> HashSet<ObjectId> {
    let mut out = HashSet::new();
    let mut cur = codes(env).find(filter).await.unwrap();
    while let Some(d) = cur.next().await {
        out.insert(d.unwrap().get_object_id("_id").unwrap());
    }
    out
}

/// How many codes of `pool` are in each status (0 unissued, 1 issued, 2
/// used, 3 void, 4 held).
pub(crate) async fn pool_statuses(env: &TestEnv, pool: &str) -> [u64; 5] {
    let mut out = [0; 5];
    for (s, n) in out.iter_mut().enumerate() {
        *n = count_codes(env, doc! {"pool": pool, "status": s as i32}).await;
    }
    out
}

/// Codes of `order` by status (0 unissued … 3 void).
pub(crate) async fn order_statuses(env: &TestEnv, order: &str) -> Vec<i32> {
    let found = find_docs(env, "codes", doc! {"order_id": order}).await;
    let mut s: Vec<i32> = found.iter().map(|d| d.get_i32("status").unwrap()).collect();
    s.sort();
    s
}

/// The hold document `id`.
pub(crate) async fn hold_doc(env: &TestEnv, id: &str) -> Document {
    (env.store.database())
        .collection::<Document>("holds")
        .find_one(doc! {"_id": id})
        .await
        .unwrap()
        .expect("the hold")
}

/// The audit records that match `filter`, oldest first.
pub(crate) async fn audit_docs(env: &TestEnv, filter: Document) -> Vec<Document> {
    use futures::TryStreamExt;
    let found = env.coll("audit").find(filter).sort(doc! {"at": 1}).await;
    found.unwrap().try_collect().await.unwrap()
}

/// The audit records of `who`, as (kind, command), oldest first.
pub(crate) async fn audited(env: &TestEnv, who: &str) -> Vec<(String, String)> {
    let records = audit_docs(env, doc! {"os_user": who}).await;
    let field = |d: &Document, f: &str| d.get_str(f).unwrap_or("").to_owned();
    (records.iter())
        .map(|d| (d.get_str("kind").unwrap().to_owned(), field(d, "command")))
        .collect()
}

// ---------------------------------------------------------------- the command line and imports

/// `codepool ARGS`: (exit code, stdout, stderr).
pub(crate) async fn codepool(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
    let out = env.run(args).await;
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A temporary file holding `content`.
pub(crate) fn csv_file(content: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    f.write_all(content).expect("write");
    f
}

/// A CSV file of `n` codes `PREFIX-00000`….
pub(crate) fn codes_file(prefix: &str, n: usize) -> tempfile::NamedTempFile {
    let mut content = String::from("code\n");
    for i in 0..n {
        content.push_str(&format!("{prefix}-{i:05}\n"));
    }
    csv_file(content.as_bytes())
}

/// Imports `codes` into `pool` with `codepool import`; returns the run's
/// import id.
pub(crate) async fn import_codes<S: AsRef<str>>(env: &TestEnv, pool: &str, codes: &[S]) -> String {
    let rows: Vec<&str> = codes.iter().map(AsRef::as_ref).collect();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), format!("code\n{}\n", rows.join("\n"))).unwrap();
    let path = file.path().to_str().unwrap();
    let out = codepool_ok(env, &["import", path, "--pool", pool, "--json"]).await;
    let summary: Value = serde_json::from_str(&out).unwrap();
    summary["import_id"].as_str().unwrap().to_owned()
}

/// `codepool import PATH --pool POOL --json [EXTRA]`: (exit code, summary).
pub(crate) async fn import_json(
    env: &TestEnv,
    path: &std::path::Path,
    pool: &str,
    extra: &[&str],
) -> (i32, serde_json::Value) {
    let mut args = vec!["import", path.to_str().unwrap(), "--pool", pool, "--json"];
    args.extend_from_slice(extra);
    let (code, out, err) = codepool(env, &args).await;
    let json = serde_json::from_str(&out)
        .unwrap_or_else(|_| panic!("no JSON summary (exit {code}): {err}"));
    (code, json)
}

/// Terminal controls and a right-to-left override, as a hostile producer
/// would send them.
pub(crate) const EVIL: &str = "x\u{1b}]0;owned\u{7}\u{1b}[2J\u{202e}gpj.exe";

/// `out` holds no raw escape or bidi override.
pub(crate) fn assert_no_raw_escapes(out: &str) {
    assert!(
        !out.contains('\u{1b}') && !out.contains('\u{202e}'),
        "{out:?}"
    );
}

// ---------------------------------------------------------------- raw http

/// What one exchange got.
#[derive(Debug)]
pub(crate) struct RawAnswer {
    pub(crate) status: u16,
    pub(crate) headers: HashMap<String, String>,
    pub(crate) body: String,
}

/// A connection to `addr` from the loopback address `from` (the whole of
/// 127.0.0.0/8 is this host), so that a test can be many clients.
pub(crate) async fn connect_from(addr: &str, from: Ipv4Addr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(addr.parse().unwrap()).await.unwrap()
}

/// Reads one answer: its head, then `Content-Length` bytes (or up to the
/// close). `None` when the server closes without answering or nothing
/// comes within `within`.
pub(crate) async fn read_answer(s: &mut TcpStream, within: Duration) -> Option<RawAnswer> {
    let mut raw = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = [0u8; 8192];
    loop {
        if let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..split]).into_owned();
            let mut lines = head.lines();
            let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
            let headers: HashMap<String, String> = lines
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
                .collect();
            let len = headers.get("content-length").and_then(|v| v.parse().ok());
            if len.is_none_or(|n: usize| raw.len() >= split + 4 + n) {
                let end = len.map_or(raw.len(), |n| split + 4 + n);
                let body = String::from_utf8_lossy(&raw[split + 4..end]).into_owned();
                return Some(RawAnswer {
                    status,
                    headers,
                    body,
                });
            }
        }
        let n = tokio::time::timeout_at(deadline, s.read(&mut buf))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
        raw.extend_from_slice(&buf[..n]);
    }
}

/// Sends `bytes` on a new connection from `from` and reads the answer.
pub(crate) async fn exchange_from(addr: &str, from: Ipv4Addr, bytes: &[u8]) -> RawAnswer {
    let mut s = connect_from(addr, from).await;
    s.write_all(bytes).await.unwrap();
    read_answer(&mut s, Duration::from_secs(30))
        .await
        .expect("an answer within 30 s")
}

/// Sends the raw request `req` on a new connection to `addr` and reads the
/// answer to its end: status, head and body.
pub(crate) async fn raw_exchange(addr: &str, req: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(req).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head.to_owned(), body.to_owned())
}

/// One HTTP exchange that tolerates a server that is down or dies: the
/// status, the head and the body, or `None`.
pub(crate) async fn raw_http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Option<(u16, String, Vec<u8>)> {
    let go = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).await.ok()?;
        s.write_all(body).await.ok()?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.ok()?;
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let status = head.split_whitespace().nth(1)?.parse().ok()?;
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        let mut body = raw[split + 4..].to_vec();
        if chunked {
            body = dechunk(&body)?;
        }
        Some((status, head, body))
    };
    tokio::time::timeout(Duration::from_secs(20), go)
        .await
        .ok()
        .flatten()
}

/// A chunked body, whole.
fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&raw[..end]).ok()?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        raw = &raw[end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(raw.get(..size)?);
        raw = raw.get(size + 2..)?;
    }
}

/// Percent-encodes a form value.
pub(crate) fn form_value(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
