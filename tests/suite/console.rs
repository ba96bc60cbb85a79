//! The operator console in a real browser: headless Debian chromium driven
//! through chromedriver (fantoccini), against a real `codepool api` process
//! on the real servers (`scripts/browser.sh` installs the browser). Every
//! page the tests visit is saved to target/console-screenshots/. Sign-in
//! is also tried over raw HTTP, as a hostile client would: bursts of wrong
//! passwords, one client trying many names, a `next` holding CR LF,
//! `Origin: null`, a name holding a newline, and an oversized form field.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::api::{order, ApiServer};
use crate::common::*;
use crate::fixtures::*;

const PASSWORD: &str = "a long enough password";

/// A chromedriver of this test's own and a headless chromium session.
struct Browser {
    client: Client,
    base: String,
    _driver: tokio::process::Child,
}

impl Browser {
    async fn start(api_addr: &str) -> Self {
        let port = free_port();
        let driver_bin = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        let driver = tokio::process::Command::new(&driver_bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver must be installed (scripts/browser.sh)");
        let addr = format!("127.0.0.1:{port}");
        eventually(Duration::from_secs(30), "chromedriver to listen", || {
            let addr = addr.clone();
            async move { tokio::net::TcpStream::connect(addr).await.is_ok() }
        })
        .await;
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({"args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                            "--disable-dev-shm-usage", "--window-size=1280,900"]}),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://{addr}"))
            .await
            .expect("a chromium session");
        Self {
            client,
            base: format!("http://{api_addr}"),
            _driver: driver,
        }
    }

    async fn goto(&self, path: &str) {
        self.client
            .goto(&format!("{}{path}", self.base))
            .await
            .expect("page loads");
    }

    /// Waits for an element (after a navigation) and returns its text. An
    /// element that htmx swapped out meanwhile is looked up again.
    async fn text(&self, css: &str) -> String {
        let mut last = None;
        for _ in 0..5 {
            let el = self
                .client
                .wait()
                .at_most(Duration::from_secs(20))
                .for_element(Locator::Css(css))
                .await
                .unwrap_or_else(|e| panic!("no {css} on the page: {e}"));
            match el.text().await {
                Ok(t) => return t,
                Err(e) => last = Some(e),
            }
        }
        panic!("{css} kept going stale: {last:?}")
    }

    /// Waits until an element's text contains `needle`: after a click the
    /// old page (and its old notice) can still be showing for a moment.
    async fn text_with(&self, css: &str, needle: &str) -> String {
        let until = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let t = self.text(css).await;
            if t.contains(needle) || std::time::Instant::now() > until {
                return t;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn has(&self, css: &str) -> bool {
        !self
            .client
            .find_all(Locator::Css(css))
            .await
            .expect("find")
            .is_empty()
    }

    async fn fill(&self, css: &str, value: &str) {
        let el = self.client.find(Locator::Css(css)).await.expect(css);
        el.clear().await.ok();
        el.send_keys(value).await.expect("typing");
    }

    async fn click(&self, css: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css}: {e}"))
            .click()
            .await
            .expect("click");
    }

    async fn shot(&self, name: &str) {
        let png = self.client.screenshot().await.expect("screenshot");
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/console-screenshots");
        std::fs::create_dir_all(&dir).expect("screenshot folder");
        std::fs::write(dir.join(format!("{name}.png")), png).expect("screenshot written");
    }

    async fn sign_in(&self, name: &str) {
        self.goto("/console/signin").await;
        self.fill("input[name=name]", name).await;
        self.fill("input[name=password]", PASSWORD).await;
        self.click("form.signin button").await;
        let who = self.text("header .who").await;
        assert!(who.starts_with(name), "signed in as {name}: {who}");
    }

    /// The session cookie chromium holds (HttpOnly: no script sees it).
    async fn session_cookie(&self) -> String {
        let cookies = self.client.get_all_cookies().await.expect("cookies");
        let c = cookies
            .iter()
            .find(|c| c.name() == "codepool_session")
            .expect("a session cookie");
        assert_eq!(c.http_only(), Some(true));
        assert_eq!(format!("{:?}", c.same_site()), "Some(Strict)");
        assert_eq!(c.path(), Some("/console"));
        format!("codepool_session={}", c.value())
    }

    async fn csrf(&self) -> String {
        let el = self
            .client
            .find(Locator::Css("input[name=csrf]"))
            .await
            .expect("a form with a CSRF token");
        el.attr("value").await.unwrap().expect("token")
    }

    async fn close(self) {
        let _ = self.client.close().await;
    }
}

/// `codepool operators add` with the password on standard input.
async fn operator(env: &TestEnv, name: &str, role: &str) {
    let args = ["operators", "add", "--name", name, "--role", role];
    let mut cmd = env.command(&args);
    let out = with_stdin(
        cmd.arg("--password-stdin"),
        format!("{PASSWORD}\n").as_bytes(),
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A form POST with a cookie, as a page (or a forger) would send it:
/// status, `location` and body.
async fn post_form(addr: &str, path: &str, cookie: &str, body: &str) -> (u16, String, String) {
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nCookie: {cookie}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (status, head, body) = raw_exchange(addr, req.as_bytes()).await;
    let location = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("location:")
                .map(|v| v.trim().to_owned())
        })
        .unwrap_or_default();
    (status, location, body)
}

async fn get_with(addr: &str, path: &str, cookie: &str) -> (u16, String) {
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nCookie: {cookie}\r\n\r\n"
    );
    let (status, head, body) = raw_exchange(addr, req.as_bytes()).await;
    (status, format!("{head}\r\n\r\n{body}"))
}

/// The audit page's kind filter takes the kinds by name and refuses
/// another, naming them; a record of a kind this build does not write
/// (an older one's) is listed, not an error.
async fn audit_kinds_filter_and_an_old_kind_lists(env: &TestEnv, addr: &str, cookie: &str) {
    let (status, text) = get_with(addr, "/console/audit?kind=voids", cookie).await;
    assert_eq!(status, 422, "{text}");
    assert!(
        text.contains("voids") && text.contains("void, redeem") && text.contains("sign-out"),
        "{text}"
    );
    env.coll("audit")
        .insert_one(bson::doc! {
            "kind": "retired-kind", "at": bson::DateTime::now(),
            "os_user": "operator:old", "command": "codepool old", "what": "an old change",
        })
        .await
        .unwrap();
    let (status, text) = get_with(addr, "/console/audit", cookie).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("retired-kind") && text.contains("an old change"),
        "{text}"
    );
    let (status, text) = get_with(addr, "/console/audit?kind=sign-in", cookie).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("operator:ada") && !text.contains("retired-kind"),
        "{text}"
    );
}

fn unissued_of(text: &str) -> u64 {
    text.replace(',', "").trim().parse().unwrap_or(u64::MAX)
}

#[tokio::test]
async fn an_admin_signs_in_imports_a_csv_and_watches_stock_fall_while_orders_are_granted() {
    let env = TestEnv::new("console_stock").await;
    operator(&env, "ada", "admin").await;
    codepool_ok(&env, &["pool", "create", "--pool", "game-x"]).await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write").await;
    let b = Browser::start(&api.addr).await;

    b.goto("/console/pools").await;
    assert!(b.has("form.signin").await, "a page needs a session");
    b.shot("signin").await;
    b.sign_in("ada").await;

    // Upload a CSV with two bad rows; the summary names them by line.
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("partner.csv");
    let mut rows = String::from("code\n");
    for i in 0..40 {
        rows.push_str(&format!("GX-{i:06}\n"));
    }
    // Line 42 hides a bidi override, line 43 is far too long.
    rows.push_str(&format!("BAD\u{202e}CODE\n{}\n", "X".repeat(300)));
    std::fs::write(&csv, rows).unwrap();
    b.goto("/console/pools/game-x").await;
    b.shot("pool").await;
    let file = b
        .client
        .find(Locator::Css("form.upload input[type=file]"))
        .await
        .unwrap();
    file.send_keys(csv.to_str().unwrap()).await.unwrap();
    b.click("form.upload button").await;
    assert_eq!(b.text("#import-summary dd.inserted").await, "40");
    let invalid = b.text("table.invalid-rows").await;
    assert!(
        invalid.contains("42") && invalid.contains("43"),
        "invalid rows by line number: {invalid}"
    );
    b.shot("import-summary").await;

    // The pools page refreshes its numbers by itself while orders arrive.
    b.goto("/console/pools").await;
    let cell = "tr[data-pool=\"game-x\"] td.unissued";
    assert_eq!(unissued_of(&b.text(cell).await), 40);
    b.shot("pools").await;
    for i in 0..5 {
        let (status, _, body) = api
            .post("/v1/orders", &shop, &order(&format!("W-{i}"), "game-x", 1))
            .await;
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    }
    eventually(
        Duration::from_secs(30),
        "the pools page to show 35 unissued without a reload",
        || async { unissued_of(&b.text(cell).await) == 35 },
    )
    .await;
    assert_eq!(
        b.client.current_url().await.unwrap().path(),
        "/console/pools"
    );
    assert!(
        b.has("svg.chart polyline").await,
        "the stock chart is a picture"
    );
    b.shot("pools-live").await;

    // Every action is in the audit log with the operator's name.
    b.goto("/console/audit?who=operator:ada&kind=import").await;
    let audit = b.text("table.audit tbody").await;
    assert!(
        audit.contains("operator:ada") && audit.contains("40 inserted"),
        "{audit}"
    );
    b.shot("audit").await;

    // A pause, a resume and a recall from the console are audited by the
    // core with the operator, as the same changes from the CLI and the API.
    b.goto("/console/pools/game-x").await;
    let (cookie, csrf) = (b.session_cookie().await, b.csrf().await);
    let form = format!("csrf={csrf}");
    for action in ["pause", "resume"] {
        let path = format!("/console/pools/game-x/{action}");
        let (status, _, body) = post_form(&api.addr, &path, &cookie, &form).await;
        assert_eq!(status, 303, "{action}: {body}");
    }
    let import = env
        .coll("imports")
        .find_one(bson::doc! {"pool": "game-x"})
        .await
        .unwrap()
        .unwrap()
        .get_object_id("_id")
        .unwrap()
        .to_hex();
    let recall = format!("csrf={csrf}&reason=leak&confirm=yes");
    let path = format!("/console/imports/{import}/recall");
    let (status, _, body) = post_form(&api.addr, &path, &cookie, &recall).await;
    assert!(status == 200 || status == 303, "recall: {status} {body}");
    let kinds = audited_kinds(&env, "operator:ada").await;
    for kind in ["import", "pause", "resume", "recall"] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} in {kinds:?}");
    }
    b.close().await;
    api.stop().await;
    env.cleanup().await;
}

/// The kinds of the audit records of `who`, oldest first.
async fn audited_kinds(env: &TestEnv, who: &str) -> Vec<String> {
    let records = crate::fixtures::audited(env, who).await;
    records.into_iter().map(|(kind, _)| kind).collect()
}

#[tokio::test]
async fn support_finds_an_order_resends_and_voids_it_but_cannot_reveal_or_recall() {
    let env = TestEnv::with_pools("console_support", &[("game-y", 10)]).await;
    operator(&env, "sam", "support").await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write").await;
    let hostile = "<script>alert('uid')</script>";
    let body =
        json!({"order_id": "O-77", "uid": hostile, "phone": "+8613800000077", "pool": "game-y"});
    let (status, _, _) = api
        .post("/v1/orders", &shop, body.to_string().as_bytes())
        .await;
    assert_eq!(status, 201);
    let b = Browser::start(&api.addr).await;
    b.sign_in("sam").await;

    // Find it by uid: the uid shows as text, not as a script.
    b.goto(&format!("/console/orders?by=uid&q={}", crate_url(hostile)))
        .await;
    b.shot("orders-search").await;
    b.click("table.codes a").await;
    assert_eq!(b.text("dd.uid").await, hostile);
    assert!(b.client.get_alert_text().await.is_err(), "no script ran");
    assert!(b
        .client
        .source()
        .await
        .unwrap()
        .contains("&lt;script&gt;alert"));
    let masked = b.text("td.code").await;
    assert!(
        masked.contains('*') && !masked.contains("game-y-0000"),
        "masked: {masked}"
    );
    b.shot("order").await;

    // Resend its SMS, then void it with a reason.
    b.click("#resend").await;
    assert!(b
        .text_with("p.notice", "SMS sent again")
        .await
        .contains("SMS sent again"));
    b.shot("order-resent").await;
    let cookie = b.session_cookie().await;
    let csrf = b.csrf().await;
    // A POST without its CSRF token is refused, and changes nothing.
    let (status, _, _) = post_form(
        &api.addr,
        "/console/orders/O-77/void",
        &cookie,
        "reason=forged",
    )
    .await;
    assert_eq!(status, 403);
    let (status, _, _) = post_form(
        &api.addr,
        "/console/orders/O-77/void",
        &cookie,
        "reason=forged&csrf=0000",
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(b.text("dd.state").await, "granted");
    // Replace the line's code: void it, a fresh one texted.
    b.fill("td.replace input[name=reason]", "code rejected")
        .await;
    b.click("td.replace button").await;
    assert!(b
        .text_with("p.notice", "Line 0 replaced")
        .await
        .contains("Line 0 replaced"));
    assert_eq!(b.text("table.replacements td.state").await, "done");
    assert_eq!(b.text("dd.state").await, "granted");
    b.fill("form[action$='/void'] input[name=reason]", "refund")
        .await;
    b.click("#void").await;
    assert!(b
        .text_with("p.notice", "1 code(s) voided")
        .await
        .contains("1 code(s) voided"));
    assert_eq!(b.text("dd.state").await, "void");
    b.shot("order-voided").await;
    let kinds = audited_kinds(&env, "operator:sam").await;
    assert!(
        kinds.iter().any(|k| k == "void")
            && kinds.iter().any(|k| k == "resend")
            && kinds.iter().any(|k| k == "replace"),
        "{kinds:?}"
    );

    // Support may not reveal or recall: no button, and the POST is refused.
    assert!(!b.has("#reveal").await);
    let form = format!("csrf={csrf}");
    let (status, _, body) =
        post_form(&api.addr, "/console/orders/O-77/reveal", &cookie, &form).await;
    assert_eq!(status, 403, "{body}");
    assert!(!body.contains("game-y-0000"), "no code in a refusal");
    let import = bson::oid::ObjectId::new().to_hex();
    let recall = format!("csrf={csrf}&reason=leak&confirm=yes");
    let (status, _, _) = post_form(
        &api.addr,
        &format!("/console/imports/{import}/recall"),
        &cookie,
        &recall,
    )
    .await;
    assert_eq!(status, 403);
    b.goto("/console/pools/game-y").await;
    assert!(!b.has("form.recall").await && !b.has("form.upload").await);
    b.close().await;
    api.stop().await;
    env.cleanup().await;
}

fn crate_url(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test]
async fn a_signed_out_session_cannot_reach_a_page_and_admin_pages_render() {
    let env = TestEnv::with_pools("console_signout", &[("game-z", 5)]).await;
    operator(&env, "ada", "admin").await;
    let api = ApiServer::start(&env, &[]).await;
    let b = Browser::start(&api.addr).await;
    b.sign_in("ada").await;
    let cookie = b.session_cookie().await;

    // The admin pages render; a key's secret is shown once.
    b.goto("/console/api-keys").await;
    b.fill("form.grid input[name=name]", "shop-2").await;
    b.click("form.grid input[value=\"orders:read\"]").await;
    b.click("form.grid button").await;
    assert!(b.text("#new-secret").await.starts_with("cpk_"));
    b.shot("api-keys").await;
    b.goto("/console/operators").await;
    assert!(b.text("table.operators").await.contains("ada"));
    b.shot("operators").await;
    b.goto("/console/dead-letters").await;
    assert_eq!(b.text("h1").await, "Dead letters");
    b.shot("dead-letters").await;

    let (status, _) = get_with(&api.addr, "/console/pools", &cookie).await;
    assert_eq!(status, 200);
    audit_kinds_filter_and_an_old_kind_lists(&env, &api.addr, &cookie).await;
    b.click("form.signout button").await;
    assert!(b.has("form.signin").await || b.text("form.signin button").await == "Sign in");
    // The old cookie no longer opens a page: the session is gone on the server.
    let (status, text) = get_with(&api.addr, "/console/pools", &cookie).await;
    assert_eq!(status, 303, "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("location: /console/signin"),
        "{text}"
    );
    let (status, _, _) = post_form(&api.addr, "/console/pools", &cookie, "name=x").await;
    assert_eq!(status, 303);
    b.goto("/console/orders").await;
    assert!(b.has("form.signin").await);
    b.close().await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_admin_adds_a_shops_webhook_sees_its_deliveries_and_replays_one() {
    use crate::webhooks::{
        publisher, shop_purchase, verified_by_the_python_library, Answer, Receiver,
    };
    let env = TestEnv::with_pools("console_webhooks", &[("game-w", 5)]).await;
    shop(&env, "acme", "game-w").await;
    operator(&env, "ada", "admin").await;
    let receiver = Receiver::start(Answer::Ok).await;
    let api = ApiServer::start(&env, &[]).await;
    let b = Browser::start(&api.addr).await;
    b.sign_in("ada").await;
    b.goto("/console/shops").await;
    b.click("td.name a").await;
    assert_eq!(b.text("h1").await, "Shop acme");
    b.fill("form.new-endpoint input[name=url]", &receiver.url())
        .await;
    b.click("form.new-endpoint button").await;
    let secret = b.text("code.secret").await;
    assert!(secret.starts_with("whsec_"), "{secret}");
    assert!(b.text("table.endpoints").await.contains("enabled"));

    // An AMQP order of the shop, delivered by the API process.
    let (conn, publisher) = publisher(&env).await;
    crate::common::publish_confirmed(&publisher, &[shop_purchase("CW-1", "game-w", "acme")]).await;
    let daemon = crate::common::start_daemon(env.command(&[])).await;
    eventually(Duration::from_secs(20), "delivered", || async {
        !receiver.hits().is_empty()
    })
    .await;
    verified_by_the_python_library(&secret, &receiver.hits()[0])
        .await
        .unwrap();
    b.goto("/console/shops/acme").await;
    assert!(b.text("table.deliveries").await.contains("delivered"));
    b.shot("shop-webhooks").await;

    let event = receiver.hits()[0].id.clone();
    b.fill("form.replay input[name=what]", &event).await;
    b.click("form.replay button").await;
    assert!(b
        .text_with("p.notice", "1 deliveries due again")
        .await
        .contains("1 deliveries due again"));
    eventually(Duration::from_secs(20), "replayed", || async {
        receiver.hits().len() >= 2
    })
    .await;
    assert_eq!(receiver.hits()[1].id, event);
    b.click("table.endpoints button").await;
    assert!(b
        .text_with("p.notice", "disabled")
        .await
        .contains("disabled"));
    let kinds = audited_kinds(&env, "operator:ada").await;
    for kind in ["webhook-add", "webhook-replay", "webhook-disable"] {
        assert!(kinds.iter().any(|k| k == kind), "{kind}: {kinds:?}");
    }
    b.close().await;
    daemon.stop().await;
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_admin_generates_codes_from_the_pool_page_and_a_weak_pattern_is_refused() {
    let env = TestEnv::new("console_generate").await;
    operator(&env, "ada", "admin").await;
    codepool_ok(&env, &["pool", "create", "--pool", "game-g"]).await;
    let api = ApiServer::start(&env, &[]).await;
    let b = Browser::start(&api.addr).await;
    b.sign_in("ada").await;
    let codes = env.coll("codes");

    b.goto("/console/pools/game-g").await;
    b.fill("form.generate input[name=count]", "300").await;
    b.fill("form.generate input[name=pattern]", "GG-{random:4}")
        .await;
    b.click("form.generate button").await;
    let problem = b.text("p.problem").await;
    assert!(
        problem.contains("at least 40"),
        "the refusal says why: {problem}"
    );
    assert_eq!(codes.count_documents(bson::doc! {}).await.unwrap(), 0);

    b.goto("/console/pools/game-g").await;
    b.fill("form.generate input[name=count]", "300").await;
    b.fill("form.generate input[name=pattern]", "GG-{random:12}")
        .await;
    b.click("form.generate input[name=check_char]").await;
    b.click("form.generate button").await;
    eventually(Duration::from_secs(60), "the run's 300 codes", || {
        let codes = codes.clone();
        async move {
            codes
                .count_documents(bson::doc! {"pool": "game-g"})
                .await
                .unwrap()
                == 300
        }
    })
    .await;
    let docs: Vec<bson::Document> = futures::TryStreamExt::try_collect(
        codes.find(bson::doc! {"pool": "game-g"}).await.unwrap(),
    )
    .await
    .unwrap();
    for d in &docs {
        let code = env.plain_code(d);
        assert!(code.starts_with("GG-"), "{code}");
        assert!(codepool_domain::crockford::check_ok(&code), "{code}");
    }
    b.goto("/console/pools/game-g").await;
    assert!(b
        .text("table.imports")
        .await
        .contains("(generated GG-{random:12}{check})"));
    b.shot("pool-generated").await;
    b.close().await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_viewer_reads_a_pools_statement_that_ties_out_and_shows_no_code() {
    let env = TestEnv::new("console_statement").await;
    operator(&env, "vera", "viewer").await;
    let codes = env.fill_pool("game-s", 12).await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write").await;
    for i in 1..=4 {
        let (s, _, _) = api
            .post("/v1/orders", &shop, &order(&format!("S-{i}"), "game-s", 1))
            .await;
        assert_eq!(s, 201);
    }
    let b = Browser::start(&api.addr).await;
    b.sign_in("vera").await;
    b.goto("/console/pools/game-s").await;
    b.click("a[href='/console/pools/game-s/statement']").await;
    let table = b.text("table.statement").await;
    assert!(table.contains("ties out"), "{table}");
    assert!(!table.contains("off by"), "{table}");
    let total = b.text("table.statement tbody tr:last-child").await;
    assert!(total.starts_with("Total"), "{total}");
    let numbers: Vec<&str> = total.split_whitespace().collect();
    assert!(
        numbers
            .windows(7)
            .any(|w| w == ["12", "0", "8", "0", "4", "0", "0"]),
        "received 12, no duplicates, 8 in stock, none held, 4 issued, none used or void: {total}"
    );
    b.shot("pool-statement").await;
    let cookie = b.session_cookie().await;
    for path in [
        "/console/pools/game-s/statement",
        "/console/pools/game-s/statement?format=csv",
    ] {
        let (status, page) = get_with(&api.addr, path, &cookie).await;
        assert_eq!(status, 200, "{path}");
        for c in &codes {
            assert!(!page.contains(c.as_str()), "{path} shows code {c}");
        }
    }
    let (status, _) = get_with(
        &api.addr,
        "/console/pools/game-s/statement?from=last+week",
        &cookie,
    )
    .await;
    assert_eq!(status, 422);
    b.close().await;
    api.stop().await;
    env.cleanup().await;
}

/// The statement page shows a killed run's state (issue 73, item 12): its
/// row reads `killed` and "not finished", never "ties out", and a notice
/// names it.
#[tokio::test]
async fn a_statement_page_shows_a_killed_run_as_not_finished() {
    let env = TestEnv::new("console_statement_killed").await;
    operator(&env, "vic", "viewer").await;
    let killed = env
        .store
        .start_import("ks", "partner.csv", None)
        .await
        .unwrap();
    let codes: Vec<codepool_store::NewCode> = (0..3)
        .map(|i| codepool_store::NewCode {
            code: format!("KS-{i}"),
            expires_at: None,
            line: Some(i + 2),
        })
        .collect();
    env.store
        .insert_codes("ks", killed.id, &codes)
        .await
        .unwrap();
    env.store.ensure_pool("ks").await.unwrap();
    let api = ApiServer::start(&env, &[]).await;
    let cookie = signed_in(&api.addr, "vic").await;
    let (status, page) = get_with(&api.addr, "/console/pools/ks/statement", &cookie).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("killed: not finished"), "{page}");
    assert!(
        !page.contains("ties out<"),
        "no row nor total says it ties out: {page}"
    );
    assert!(
        page.contains(&killed.id.to_hex()) && page.contains("did not finish"),
        "{page}"
    );
    api.stop().await;
    env.cleanup().await;
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

async fn sign_in_from(addr: &str, from: Ipv4Addr, name: &str, password: &str) -> RawAnswer {
    exchange_from(addr, from, &sign_in_request(name, password, "", "")).await
}

/// The session cookie (`codepool_session=…`) an answer sets, if any.
fn session_cookie(a: &RawAnswer) -> Option<String> {
    a.headers
        .get("set-cookie")
        .and_then(|c| c.split(';').next())
        .filter(|c| c.starts_with("codepool_session=") && c.len() > "codepool_session=".len())
        .map(str::to_owned)
}

/// Signs `name` in from 127.0.0.1; its session cookie.
async fn signed_in(addr: &str, name: &str) -> String {
    let a = sign_in_from(addr, Ipv4Addr::LOCALHOST, name, PASSWORD).await;
    assert_eq!(a.status, 303, "{name} signs in: {}", a.body);
    session_cookie(&a).expect("a session cookie")
}

async fn sessions_of(env: &TestEnv, name: &str) -> u64 {
    count_docs(env, "console_sessions", bson::doc! {"operator": name}).await
}

/// Sign-ins sent all at once, each `(from, name, password)`: the answers.
async fn burst(addr: &str, tries: Vec<(Ipv4Addr, String, String)>) -> Vec<RawAnswer> {
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

fn retry_after(a: &RawAnswer) -> Duration {
    let secs = a.headers.get("retry-after").and_then(|v| v.parse().ok());
    Duration::from_secs(secs.expect("a Retry-After in seconds"))
}

/// Asserts every answer but the checked ones (401) was refused at once
/// with `Retry-After`; returns how many were checked.
fn checked_of(answers: &[RawAnswer]) -> usize {
    for a in answers.iter().filter(|a| a.status != 401) {
        assert!(matches!(a.status, 429 | 503), "{} {}", a.status, a.body);
        assert!(a.headers.contains_key("retry-after"), "{:?}", a.headers);
    }
    answers.iter().filter(|a| a.status == 401).count()
}

#[tokio::test]
async fn a_burst_of_wrong_passwords_is_refused_before_the_check_and_the_right_one_does_not_slip_in()
{
    let env = TestEnv::new("console_burst").await;
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
    let env = TestEnv::new("console_client").await;
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

/// A viewer's or admin's upload whose `csrf` field is 20 MB: the head and
/// the start of the field are sent; the rest only if the server reads on.
async fn huge_csrf_upload(addr: &str, cookie: &str) -> (Option<RawAnswer>, usize) {
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
    let answer = status.map(|status| RawAnswer {
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
    let env = TestEnv::new("console_upload").await;
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

#[tokio::test]
async fn a_sign_in_whose_next_holds_cr_lf_leads_to_the_pools_and_nowhere_else() {
    let env = TestEnv::new("console_next").await;
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
async fn a_sign_in_from_origin_null_is_refused() {
    let env = TestEnv::new("console_origin").await;
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
    let env = TestEnv::new("console_logforge").await;
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

/// The CSRF token of the page `path` shows `cookie`'s session (every
/// signed-in page has one, in its sign-out form).
async fn csrf_of(addr: &str, path: &str, cookie: &str) -> String {
    let (status, text) = get_with(addr, path, cookie).await;
    assert_eq!(status, 200, "{text}");
    let at = text.find("name=\"csrf\" value=\"").expect("a CSRF field") + 19;
    text[at..].split('"').next().unwrap().to_owned()
}

async fn channel_paused(env: &TestEnv, name: &str) -> bool {
    let c = find_docs(env, "channels", bson::doc! {"_id": name}).await;
    c[0].get_bool("paused").unwrap_or(false)
}

/// Eneba's RESERVE of `keys` keys for `order`: whether it held them.
async fn eneba_reserves(api: &ApiServer, order: &str, keys: u32) -> bool {
    use crate::channels::eneba;
    use crate::marketplaces::{reserve, success, ENEBA_TOKEN};
    let (status, _, body) = eneba(api, ENEBA_TOKEN, reserve(order, keys)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    success(&body) == json!(true)
}

/// A viewer reads the channels but cannot pause one; a pause without the
/// session's CSRF token is refused; nothing changes either way.
async fn a_viewer_and_a_forger_cannot_pause_a_channel(env: &TestEnv, addr: &str, admin: &str) {
    operator(env, "vic", "viewer").await;
    let viewer = signed_in(addr, "vic").await;
    let (status, text) = get_with(addr, "/console/channels/en", &viewer).await;
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("/pause\""), "no pause form for a viewer");
    let csrf = csrf_of(addr, "/console/channels/en", &viewer).await;
    let form = format!("csrf={csrf}");
    let (status, _, _) = post_form(addr, "/console/channels/en/pause", &viewer, &form).await;
    assert_eq!(status, 403);
    let (status, _, _) = post_form(addr, "/console/channels/en/pause", admin, "csrf=forged").await;
    assert_eq!(status, 403);
    let (status, _, _) = post_form(addr, "/console/channels/nope/pause", admin, &{
        format!("csrf={}", csrf_of(addr, "/console/channels", admin).await)
    })
    .await;
    assert_eq!(status, 404);
    assert!(!channel_paused(env, "en").await);
}

#[tokio::test]
async fn an_operator_sees_each_channels_stock_reservations_and_failures_and_an_admin_pauses_one() {
    use crate::channels::{eneba, selling};
    use crate::marketplaces::{keys_of, provide, AUCTION, ENEBA_TOKEN};
    // Pool game-c of 40 codes, sold by Eneba (`en`, half of the free codes
    // declared) and G2A (`g2`, all of them).
    let env = selling("console_channels", "game-c", 40, &["--share", "50"], &[]).await;
    operator(&env, "ada", "admin").await;
    let api = ApiServer::start(&env, &[]).await;
    // Eneba reserves 2 keys and gets them, reserves 3 more (held), and
    // asks 50 the pool does not have: 2 completed reservations, 1 failed,
    // 1 completed provision; 35 codes free, 3 held.
    assert!(eneba_reserves(&api, "o-1", 2).await);
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, provide("o-1")).await;
    assert_eq!(keys_of(&body).len(), 2);
    assert!(eneba_reserves(&api, "o-2", 3).await);
    assert!(!eneba_reserves(&api, "o-3", 50).await);

    let b = Browser::start(&api.addr).await;
    b.sign_in("ada").await;
    b.goto("/console/channels").await;
    let en = b.text("tr[data-channel=\"en\"]").await;
    for want in [
        "eneba",
        "acme",
        "active",
        AUCTION,
        "game-c",
        "may sell 17",
        "3 codes held",
    ] {
        assert!(en.contains(want), "{want} in {en}");
    }
    let reservations = b.text("tr[data-channel=\"en\"] dd.reservations").await;
    let provisions = b.text("tr[data-channel=\"en\"] dd.provisions").await;
    assert!(
        reservations.contains("1 failed of 3") && reservations.contains("hide 0.00 / 0.4"),
        "{reservations}"
    );
    assert!(
        provisions.contains("0 failed of 1") && provisions.contains("hide 0.00 / 0.2"),
        "{provisions}"
    );
    let g2 = b.text("tr[data-channel=\"g2\"]").await;
    assert!(g2.contains("g2a") && g2.contains("may sell 35"), "{g2}");
    b.shot("channels").await;

    b.click("tr[data-channel=\"en\"] td.name a").await;
    assert_eq!(b.text("h1").await, "Channel en");
    assert_eq!(b.text("td.declarable").await, "17");
    assert_eq!(b.text("strong.open-reservations").await, "1");
    assert_eq!(b.text("strong.held-codes").await, "3");
    assert_eq!(b.text("tr.reservations td.failed").await, "1");
    b.shot("channel").await;

    let cookie = b.session_cookie().await;
    a_viewer_and_a_forger_cannot_pause_a_channel(&env, &api.addr, &cookie).await;

    // The admin pauses it: it declares nothing and reserves nothing new
    // (a refusal Eneba counts), then resumes it; both audited.
    b.click("form.pause button").await;
    assert!(b.text_with("h1", "paused").await.contains("paused"));
    assert!(channel_paused(&env, "en").await);
    assert!(!eneba_reserves(&api, "o-4", 1).await);
    b.goto("/console/channels/en").await;
    assert_eq!(b.text("td.declarable").await, "0");
    assert_eq!(b.text("tr.reservations td.failed").await, "2");
    b.shot("channel-paused").await;
    b.click("form.resume button").await;
    assert_eq!(b.text_with("dd.state", "active").await, "active");
    assert!(eneba_reserves(&api, "o-5", 1).await);
    let audited = crate::fixtures::audited(&env, "operator:ada").await;
    let changes: Vec<&(String, String)> =
        audited.iter().filter(|(k, _)| k == "channel-set").collect();
    assert_eq!(changes.len(), 2, "{audited:?}");
    b.close().await;
    api.stop().await;
    env.cleanup().await;
}
