//! Bad input at the HTTP doors, round three, against a real `codepool api`
//! (and a real `codepool dispatch`) on the real servers: sign-in bursts,
//! slow clients, oversized form fields, curl's bodiless POSTs, the
//! bearer scheme's case, redirects after sign-in, long dead-letter walks,
//! caching of plaintext codes, and `Origin: null`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Stdio;
use std::time::{Duration, Instant};

use codepool_broker::Publisher;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::api::{http, json_of, key, order, ApiServer};
use crate::common::{eventually, queue_depth, start_daemon, TestEnv, AMQP_URL};

const PASSWORD: &str = "a long enough password";

/// What one exchange got.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

/// A connection to `addr` from the loopback address `from` (the whole of
/// 127.0.0.0/8 is this host), so that a test can be many clients.
async fn connect_from(addr: &str, from: Ipv4Addr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(addr.parse().unwrap()).await.unwrap()
}

/// Reads one answer: its head, then `Content-Length` bytes (or up to the
/// close). `None` when the server closes without answering or nothing
/// comes within `within`.
async fn read_answer(s: &mut TcpStream, within: Duration) -> Option<Answer> {
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
                return Some(Answer {
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
async fn exchange_from(addr: &str, from: Ipv4Addr, bytes: &[u8]) -> Answer {
    let mut s = connect_from(addr, from).await;
    s.write_all(bytes).await.unwrap();
    read_answer(&mut s, Duration::from_secs(30))
        .await
        .expect("an answer within 30 s")
}

/// Percent-encodes a form value.
fn form_value(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A sign-in form POST, with `extra` header lines (each ending in CRLF).
fn sign_in_request(name: &str, password: &str, next: &str, extra: &str) -> Vec<u8> {
    let body = format!(
        "name={}&password={}&next={}",
        form_value(name),
        form_value(password),
        form_value(next)
    );
    format!(
        "POST /console/signin HTTP/1.1\r\nHost: console\r\nConnection: close\r\n{extra}Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn sign_in_from(addr: &str, from: Ipv4Addr, name: &str, password: &str) -> Answer {
    exchange_from(addr, from, &sign_in_request(name, password, "", "")).await
}

/// The session cookie (`codepool_session=…`) an answer sets, if any.
fn session_cookie(a: &Answer) -> Option<String> {
    a.headers
        .get("set-cookie")
        .and_then(|c| c.split(';').next())
        .filter(|c| c.starts_with("codepool_session=") && c.len() > "codepool_session=".len())
        .map(str::to_owned)
}

/// `codepool operators add` with the password on standard input.
async fn operator(env: &TestEnv, name: &str, role: &str) {
    let mut child = env
        .command(&[
            "operators",
            "add",
            "--name",
            name,
            "--role",
            role,
            "--password-stdin",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(format!("{PASSWORD}\n").as_bytes())
        .await
        .unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Signs `name` in from 127.0.0.1; its session cookie.
async fn signed_in(addr: &str, name: &str) -> String {
    let a = sign_in_from(addr, Ipv4Addr::LOCALHOST, name, PASSWORD).await;
    assert_eq!(a.status, 303, "{name} signs in: {}", a.body);
    session_cookie(&a).expect("a session cookie")
}

async fn sessions_of(env: &TestEnv, name: &str) -> u64 {
    env.store
        .database()
        .collection::<bson::Document>("console_sessions")
        .count_documents(bson::doc! {"operator": name})
        .await
        .unwrap()
}

/// Sign-ins sent all at once, each `(from, name, password)`: the answers.
async fn burst(addr: &str, tries: Vec<(Ipv4Addr, String, String)>) -> Vec<Answer> {
    let tasks: Vec<_> = tries
        .into_iter()
        .map(|(from, name, password)| {
            let addr = addr.to_owned();
            tokio::spawn(async move { sign_in_from(&addr, from, &name, &password).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn retry_after(a: &Answer) -> Duration {
    let secs = a.headers.get("retry-after").and_then(|v| v.parse().ok());
    Duration::from_secs(secs.expect("a Retry-After in seconds"))
}

/// Asserts every answer but the checked ones (401) was refused at once
/// with `Retry-After`; returns how many were checked.
fn checked_of(answers: &[Answer]) -> usize {
    for a in answers.iter().filter(|a| a.status != 401) {
        assert!(matches!(a.status, 429 | 503), "{} {}", a.status, a.body);
        assert!(a.headers.contains_key("retry-after"), "{:?}", a.headers);
    }
    answers.iter().filter(|a| a.status == 401).count()
}

#[tokio::test]
async fn a_burst_of_wrong_passwords_is_refused_before_the_check_and_the_right_one_does_not_slip_in()
{
    let env = TestEnv::new("http3_burst").await;
    operator(&env, "alice", "support").await;
    let api = ApiServer::start(&env, &[]).await;
    // 40 guesses at once for one name, each from an address of its own.
    let guesses = (0..40)
        .map(|i| {
            (
                Ipv4Addr::new(127, 0, 1, i + 1),
                "alice".into(),
                format!("wrong guess {i}"),
            )
        })
        .collect();
    let answers = burst(&api.addr, guesses).await;
    let checked = checked_of(&answers);
    // Three failures are free; a burst slower than a second may get a
    // fourth or fifth through after the first waits.
    assert!(checked <= 5, "{checked} of 40 passwords were checked");
    // Two more failures, each after its wait: the name then waits 4 s or more.
    let mut failures = 0;
    for i in 50..60 {
        let a = sign_in_from(
            &api.addr,
            Ipv4Addr::new(127, 0, 1, i),
            "alice",
            "wrong again",
        )
        .await;
        match a.status {
            401 => failures += 1,
            429 => tokio::time::sleep(retry_after(&a) + Duration::from_millis(100)).await,
            s => panic!("{s}: {}", a.body),
        }
        if failures == 2 {
            break;
        }
    }
    assert_eq!(failures, 2);
    // While it waits, the right password among wrong ones signs no one in.
    let tries = (0..10)
        .map(|i| {
            let pw = if i == 4 {
                PASSWORD.into()
            } else {
                format!("wrong {i}")
            };
            (Ipv4Addr::new(127, 0, 2, i + 1), "alice".into(), pw)
        })
        .collect();
    let answers = burst(&api.addr, tries).await;
    for a in &answers {
        assert_eq!(a.status, 429, "{}", a.body);
        assert_eq!(session_cookie(a), None);
    }
    assert_eq!(sessions_of(&env, "alice").await, 0);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn one_client_trying_many_names_is_throttled_whether_the_names_exist_or_not() {
    let env = TestEnv::new("http3_client").await;
    operator(&env, "bob", "viewer").await;
    let api = ApiServer::start(&env, &[]).await;
    let from = Ipv4Addr::new(127, 0, 3, 1);
    let tries = (0..25)
        .map(|i| (from, format!("nobody-{i}"), "wrong password".into()))
        .collect();
    let answers = burst(&api.addr, tries).await;
    let checked = checked_of(&answers);
    assert!(checked <= 10, "{checked} of 25 checked");
    let throttled = answers.iter().filter(|a| a.status == 429).count();
    assert!(throttled >= 14, "{throttled} of 25 throttled");
    // A real name with its right password waits too, from that client.
    let a = sign_in_from(&api.addr, from, "bob", PASSWORD).await;
    assert_eq!(a.status, 429, "{}", a.body);
    // Another client is not held up by it.
    let a = sign_in_from(&api.addr, Ipv4Addr::new(127, 0, 3, 2), "bob", PASSWORD).await;
    assert_eq!(a.status, 303, "{}", a.body);
    api.stop().await;
    env.cleanup().await;
}

/// Sends `head` and then one byte of its body, never the rest; the answer
/// and how long it took, or `None` if the connection is still open after
/// `within`.
async fn stalled(addr: &str, head: &str, within: Duration) -> (Option<Answer>, Duration) {
    let started = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(b"n").await.unwrap();
    let got = read_answer(&mut s, within).await;
    (got, started.elapsed())
}

/// Whether the server closes `s` within `within` (reading whatever comes).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut sink = Vec::new();
    tokio::time::timeout(within, s.read_to_end(&mut sink))
        .await
        .is_ok()
}

#[tokio::test]
async fn a_slow_console_post_and_a_slow_probe_are_cut_at_the_request_timeout() {
    let env = TestEnv::new("http3_slow").await;
    let api = ApiServer::start(&env, &["--request-timeout", "2"]).await;
    let head = "POST /console/signin HTTP/1.1\r\nHost: console\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\n";
    let (got, took) = stalled(&api.addr, head, Duration::from_secs(15)).await;
    let got = got.expect("a slow sign-in is answered, not held");
    assert_eq!(got.status, 408, "{}", got.body);
    assert!(took < Duration::from_secs(8), "took {took:?}");
    let head = "GET /healthz HTTP/1.1\r\nHost: api\r\nContent-Length: 100\r\n\r\n";
    let mut s = TcpStream::connect(&api.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(b"n").await.unwrap();
    assert!(
        closed_within(&mut s, Duration::from_secs(8)).await,
        "a probe whose body never ends is closed"
    );
    // The dispatcher's probe port cuts idle and half-sent clients too.
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_HTTP_TIMEOUT", "2");
    let daemon = start_daemon(cmd).await;
    let mut idle = TcpStream::connect(&daemon.addr).await.unwrap();
    let mut half = TcpStream::connect(&daemon.addr).await.unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: d")
        .await
        .unwrap();
    assert!(
        closed_within(&mut idle, Duration::from_secs(8)).await,
        "an idle connection is closed"
    );
    assert!(
        closed_within(&mut half, Duration::from_secs(8)).await,
        "a half-sent head is closed"
    );
    daemon.stop().await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let env = TestEnv::new("http3_cap").await;
    let api = ApiServer::start(&env, &["--max-connections", "2", "--header-timeout", "30"]).await;
    let mut held = [
        TcpStream::connect(&api.addr).await.unwrap(),
        TcpStream::connect(&api.addr).await.unwrap(),
    ];
    // Both are taken by the server, however long that takes: each has
    // answered a request, and stays open.
    for s in &mut held {
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n")
            .await
            .unwrap();
        let answer = read_answer(s, Duration::from_secs(10)).await;
        assert_eq!(answer.map(|a| a.status), Some(200), "a held connection");
    }
    let mut third = TcpStream::connect(&api.addr).await.unwrap();
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let waited = read_answer(&mut third, Duration::from_millis(1500)).await;
    assert!(
        waited.is_none(),
        "a third connection is not served while two are open: {waited:?}"
    );
    drop(held);
    let got = read_answer(&mut third, Duration::from_secs(10)).await;
    assert_eq!(got.map(|a| a.status), Some(200));
    api.stop().await;
    env.cleanup().await;
}

/// A viewer's or admin's upload whose `csrf` field is 20 MB: the head and
/// the start of the field are sent; the rest only if the server reads on.
async fn huge_csrf_upload(addr: &str, cookie: &str) -> (Option<Answer>, usize) {
    let boundary = "XhugeX";
    let start = format!("--{boundary}\r\nContent-Disposition: form-data; name=\"csrf\"\r\n\r\n");
    let total = start.len() + 20 * 1024 * 1024;
    let head = format!(
        "POST /console/pools/p/imports HTTP/1.1\r\nHost: console\r\nConnection: close\r\nCookie: {cookie}\r\nContent-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {total}\r\n\r\n{start}"
    );
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let (mut reader, mut writer) = s.into_split();
    // Send the field slowly, a chunk every 50 ms, while waiting for an answer.
    let writing = tokio::spawn(async move {
        let chunk = vec![b'a'; 64 * 1024];
        let mut sent = 0;
        while sent < 20 * 1024 * 1024 {
            if writer.write_all(&chunk).await.is_err() {
                break;
            }
            sent += chunk.len();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        sent
    });
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), reader.read_to_end(&mut raw)).await;
    writing.abort();
    let sent = writing.await.unwrap_or(0);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    let answer = status.map(|status| Answer {
        status,
        headers: HashMap::new(),
        body: text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    });
    (answer, sent)
}

#[tokio::test]
async fn an_upload_form_field_is_never_buffered_beyond_its_cap() {
    let env = TestEnv::new("http3_upload").await;
    operator(&env, "vera", "viewer").await;
    operator(&env, "ada", "admin").await;
    let api = ApiServer::start(&env, &[]).await;
    let viewer = signed_in(&api.addr, "vera").await;
    let (got, _) = huge_csrf_upload(&api.addr, &viewer).await;
    let got = got.expect("a viewer's upload is answered before its 20 MB are sent");
    assert_eq!(got.status, 403, "{}", got.body);
    assert!(got.body.contains("admin role"), "{}", got.body);
    let admin = signed_in(&api.addr, "ada").await;
    let (got, _) = huge_csrf_upload(&api.addr, &admin).await;
    let got = got.expect("an admin's oversized field is answered before its 20 MB are sent");
    assert_eq!(got.status, 413, "{}", got.body);
    assert!(got.body.contains("csrf"), "{}", got.body);
    api.stop().await;
    env.cleanup().await;
}

/// A POST as `curl -X POST URL -H "Authorization: Bearer KEY"` sends it:
/// no body, no `Content-Length`, no `Content-Type`.
fn curl_post(path: &str, key: &str) -> Vec<u8> {
    format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\nAuthorization: Bearer {key}\r\n\r\n").into_bytes()
}

#[tokio::test]
async fn curl_s_bodiless_posts_resend_redeem_pause_and_resume() {
    let env = TestEnv::new("http3_curl").await;
    env.fill_pool("cp", 5).await;
    let k = key(&env, "shop", "orders:write,orders:read,admin").await;
    let api = ApiServer::start(&env, &[]).await;
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &order("C-1", "cp", 1),
    )
    .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    for path in [
        "/v1/orders/C-1/resend",
        "/v1/orders/C-1/redeem",
        "/v1/pools/cp/pause",
        "/v1/pools/cp/resume",
    ] {
        let a = exchange_from(&api.addr, Ipv4Addr::LOCALHOST, &curl_post(path, &k)).await;
        assert_eq!(a.status, 200, "{path}: {}", a.body);
    }
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_bearer_scheme_is_read_in_any_case_and_scopes_are_stored_once() {
    let env = TestEnv::new("http3_bearer").await;
    env.fill_pool("bp", 2).await;
    let k = key(
        &env,
        "shop",
        "orders:read,orders:write,orders:read,orders:write",
    )
    .await;
    let api = ApiServer::start(&env, &[]).await;
    for scheme in ["bearer", "BEARER", "BeArEr"] {
        let req = format!("GET /v1/orders/none HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: {scheme} {k}\r\n\r\n");
        let a = exchange_from(&api.addr, Ipv4Addr::LOCALHOST, req.as_bytes()).await;
        assert_eq!(a.status, 404, "{scheme}: {}", a.body);
    }
    let out = env
        .command(&["api-keys", "list", "--json"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let listed: Value = serde_json::from_slice(&out.stdout).expect("the keys as JSON");
    let scopes = listed[0]["scopes"].clone();
    assert_eq!(
        scopes,
        serde_json::json!(["orders:read", "orders:write"]),
        "{listed}"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_sign_in_whose_next_holds_cr_lf_leads_to_the_pools_and_nowhere_else() {
    let env = TestEnv::new("http3_next").await;
    operator(&env, "nia", "viewer").await;
    let api = ApiServer::start(&env, &[]).await;
    for next in [
        "/console/pools\r\nSet-Cookie: evil=1",
        "/console/pools\n",
        "https://evil.example/console/",
        "/console/../../etc",
    ] {
        let req = sign_in_request("nia", PASSWORD, next, "");
        let a = exchange_from(&api.addr, Ipv4Addr::LOCALHOST, &req).await;
        assert_eq!(a.status, 303, "{next:?}: {}", a.body);
        assert_eq!(
            a.headers.get("location").map(String::as_str),
            Some("/console/pools"),
            "{next:?}"
        );
        assert!(!a.headers.contains_key("evil"), "{:?}", a.headers);
    }
    let req = sign_in_request("nia", PASSWORD, "/console/orders?q=O-1", "");
    let a = exchange_from(&api.addr, Ipv4Addr::LOCALHOST, &req).await;
    assert_eq!(
        a.headers.get("location").map(String::as_str),
        Some("/console/orders?q=O-1")
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_dead_letter_walk_stops_at_its_bound_and_says_so() {
    let env = TestEnv::new("http3_dead").await;
    let admin = key(&env, "ops", "admin").await;
    let api = ApiServer::start(&env, &[]).await;
    let conn = codepool_broker::connect(AMQP_URL, "test-http3")
        .await
        .unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    let mut pending = Vec::new();
    for i in 0..3000 {
        let reason = if i < 2990 {
            "invalid_json"
        } else {
            "unknown_pool"
        };
        pending.push(
            publisher
                .dead_letter(b"junk", None, reason, 0)
                .await
                .unwrap(),
        );
    }
    for p in pending {
        p.wait().await.unwrap();
    }
    let ch = conn.create_channel().await.unwrap();
    let q = env.topology().purchases_dead;
    eventually(Duration::from_secs(20), "3000 dead letters", || {
        let (ch, q) = (ch.clone(), q.clone());
        async move { queue_depth(&ch, &q).await == 3000 }
    })
    .await;
    let started = Instant::now();
    let (status, _, body) = http(
        &api.addr,
        "GET",
        "/v1/dead-letters?reason=unknown_pool",
        Some(&admin),
        b"",
    )
    .await;
    assert_eq!(status, 200);
    let got = json_of(&body);
    assert_eq!(got["scanned"], 1000, "{got}");
    assert_eq!(got["stopped_early"], true, "{got}");
    assert_eq!(
        got["dead_letters"].as_array().map(Vec::len),
        Some(0),
        "{got}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // Without a filter the limit ends the walk, and nothing is left out.
    let (_, _, body) = http(
        &api.addr,
        "GET",
        "/v1/dead-letters?limit=5",
        Some(&admin),
        b"",
    )
    .await;
    let got = json_of(&body);
    assert_eq!(
        (got["scanned"].clone(), got["stopped_early"].clone()),
        (5.into(), false.into()),
        "{got}"
    );
    eventually(
        Duration::from_secs(20),
        "every letter back in the queue",
        || {
            let (ch, q) = (ch.clone(), q.clone());
            async move { queue_depth(&ch, &q).await == 3000 }
        },
    )
    .await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn answers_that_carry_plaintext_codes_are_never_stored_by_caches() {
    let env = TestEnv::new("http3_cache").await;
    env.fill_pool("cc", 5).await;
    let k = key(&env, "shop", "orders:write,orders:read,codes:reveal").await;
    let api = ApiServer::start(&env, &[]).await;
    let placed = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &order("N-1", "cc", 2),
    )
    .await;
    let again = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &order("N-1", "cc", 2),
    )
    .await;
    let revealed = http(
        &api.addr,
        "GET",
        "/v1/orders/N-1?reveal=true",
        Some(&k),
        b"",
    )
    .await;
    let missing = http(&api.addr, "GET", "/v1/orders/nothing", Some(&k), b"").await;
    for (what, (status, headers, _), want) in [
        ("the first answer", placed, 201),
        ("the repeat", again, 200),
        ("the reveal", revealed, 200),
        ("a 404", missing, 404),
    ] {
        assert_eq!(status, want, "{what}");
        assert_eq!(
            headers.get("cache-control").map(String::as_str),
            Some("no-store"),
            "{what}"
        );
    }
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_sign_in_from_origin_null_is_refused() {
    let env = TestEnv::new("http3_origin").await;
    operator(&env, "omar", "viewer").await;
    let api = ApiServer::start(&env, &[]).await;
    let req = sign_in_request("omar", PASSWORD, "", "Origin: null\r\n");
    let a = exchange_from(&api.addr, Ipv4Addr::LOCALHOST, &req).await;
    assert_eq!(a.status, 403, "{}", a.body);
    assert_eq!(session_cookie(&a), None);
    assert_eq!(sessions_of(&env, "omar").await, 0);
    // The console's own page makes browsers send its origin (under
    // no-referrer they would send null), and from there sign-in works.
    let page = b"GET /console/signin HTTP/1.1\r\nHost: console\r\nConnection: close\r\n\r\n";
    let a = exchange_from(&api.addr, Ipv4Addr::LOCALHOST, page).await;
    assert_eq!(
        a.headers.get("referrer-policy").map(String::as_str),
        Some("same-origin")
    );
    let req = sign_in_request("omar", PASSWORD, "", "Origin: http://console\r\n");
    let a = exchange_from(&api.addr, Ipv4Addr::LOCALHOST, &req).await;
    assert_eq!(a.status, 303, "{}", a.body);
    api.stop().await;
    env.cleanup().await;
}

/// A sign-in name holding CR and LF cannot write a log line of its own:
/// the text log escapes them inside the one line the event makes.
#[tokio::test]
async fn a_sign_in_name_holding_a_newline_cannot_forge_a_log_line() {
    let env = TestEnv::new("h3_logforge").await;
    let api = ApiServer::start(&env, &[]).await;
    let forged = "x\n2026-11-25T00:00:00.000000Z  INFO console sign-in operator=admin1\r";
    let a = sign_in_from(&api.addr, Ipv4Addr::new(127, 0, 3, 1), forged, "wrong").await;
    assert!(
        a.status == 200 || a.status == 401 || a.status == 403,
        "{}",
        a.status
    );
    eventually(
        Duration::from_secs(10),
        "the failed sign-in is logged",
        || async { api.log_text().contains("console sign-in failed") },
    )
    .await;
    let log = api.log_text();
    assert!(
        !log.lines()
            .any(|l| l.contains("INFO console sign-in operator=admin1")
                && !l.contains("sign-in failed")),
        "a forged line:\n{log}"
    );
    assert!(
        log.contains("x\\u{a}2026"),
        "the newline is escaped in place:\n{log}"
    );
    api.stop().await;
    env.cleanup().await;
}
