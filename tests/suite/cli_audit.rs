//! Credential changes made through the CLI leave the same audit records
//! as the console's: API keys created and revoked, operators added, given
//! a new password and disabled, encryption keys added and rotated. Each is
//! recorded by the core with the OS user and host running the command,
//! and no record holds a secret. Every change (import, pause, resume,
//! void, recall) is audited with who made it, through the CLI or the API.

use bson::{doc, Document};

use crate::api::ApiServer;
use crate::common::*;
use crate::fixtures::*;

const USER: &str = "cli-auditor";
const FIRST_PASSWORD: &str = "first correct horse battery";
const SECOND_PASSWORD: &str = "second correct horse battery";

/// Runs `codepool args` as [`USER`] with `stdin` on standard input;
/// exit code and stdout.
async fn run(env: &TestEnv, args: &[&str], stdin: &str) -> (i32, String) {
    let out = with_stdin(env.command(args).env("USER", USER), stdin.as_bytes()).await;
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// [`run`] that must succeed; its stdout and stderr.
async fn run_ok(env: &TestEnv, args: &[&str], stdin: &str) -> String {
    let (code, out) = run(env, args, stdin).await;
    assert_eq!(code, 0, "codepool {args:?}: {out}");
    out
}

/// Every audit record, oldest first.
async fn audit_records(env: &TestEnv) -> Vec<Document> {
    audit_docs(env, doc! {}).await
}

#[tokio::test]
async fn cli_credential_changes_are_audited_with_the_os_user_and_no_secret() {
    let env = TestEnv::new("cli_audit").await;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let who = format!("os-user:{USER}@{}", host.trim());

    // An admin key: its secret is printed once, and never recorded.
    let out = run_ok(
        &env,
        &[
            "api-keys", "create", "--name", "ci-admin", "--scopes", "admin",
        ],
        "",
    )
    .await;
    let token = out
        .split_whitespace()
        .find(|w| w.starts_with("cpk_"))
        .unwrap_or_else(|| panic!("a token in {out}"))
        .to_owned();
    let (key_id, secret) = token["cpk_".len()..].split_once('_').unwrap();
    let (key_id, secret) = (key_id.to_owned(), secret.to_owned());
    run_ok(&env, &["api-keys", "revoke", "--name", "ci-admin"], "").await;
    // A change refused is no change: nothing to record.
    let (code, _) = run(&env, &["api-keys", "revoke", "--name", "nope"], "").await;
    assert_ne!(code, 0);

    let add = [
        "operators",
        "add",
        "--name",
        "audit-op",
        "--role",
        "admin",
        "--password-stdin",
    ];
    run_ok(&env, &add, &format!("{FIRST_PASSWORD}\n")).await;
    run_ok(
        &env,
        &[
            "operators",
            "passwd",
            "--name",
            "audit-op",
            "--password-stdin",
        ],
        &format!("{SECOND_PASSWORD}\n"),
    )
    .await;
    run_ok(&env, &["operators", "disable", "--name", "audit-op"], "").await;

    // Codes sealed under k1, re-encrypted under k2.
    env.fill_pool("ca", 5).await;
    run_ok(&env, &["keys", "add"], "").await;
    run_ok(&env, &["keys", "rotate"], "").await;
    // The key material of the file, none of which may be recorded.
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&env.key_file).unwrap()).unwrap();
    let mut key_material: Vec<String> = file["keys"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    key_material.push(file["hmac"].as_str().unwrap().to_owned());
    assert_eq!(file["active"], "k2", "{file}");

    let records = audit_records(&env).await;
    let seen: Vec<(&str, &str)> = records
        .iter()
        .map(|r| (r.get_str("kind").unwrap(), r.get_str("command").unwrap()))
        .collect();
    assert_eq!(
        seen,
        [
            ("api-key-create", "codepool api-keys create"),
            ("api-key-revoke", "codepool api-keys revoke"),
            ("operator-add", "codepool operators add"),
            ("operator-passwd", "codepool operators passwd"),
            ("operator-disable", "codepool operators disable"),
            ("key-add", "codepool keys add"),
            ("key-rotate", "codepool keys rotate"),
        ],
        "one record per change: {records:?}"
    );
    let what: Vec<&str> = records.iter().map(|r| r.get_str("what").unwrap()).collect();
    // The console's sentences, word for word.
    assert_eq!(what[0], "API key \"ci-admin\" created with scopes admin");
    assert_eq!(what[1], format!("API key \"ci-admin\" ({key_id}) revoked"));
    assert_eq!(what[2], "operator \"audit-op\" added as admin");
    assert!(what[3].contains("\"audit-op\""), "{}", what[3]);
    assert_eq!(what[4], "operator \"audit-op\" disabled");
    assert!(what[5].contains("k2"), "{}", what[5]);
    assert!(
        what[6].starts_with("5 code(s) re-encrypted under key k2"),
        "{}",
        what[6]
    );

    for r in &records {
        let by = r.get_str("os_user").unwrap();
        assert!(by.starts_with("os-user:") && by.contains('@'), "{r:?}");
        assert_eq!(by, who, "{r:?}");
        assert!(r.get_datetime("at").is_ok(), "{r:?}");
        let text = r.to_string();
        for s in [token.as_str(), &secret, FIRST_PASSWORD, SECOND_PASSWORD]
            .into_iter()
            .chain(key_material.iter().map(String::as_str))
        {
            assert!(!text.contains(s), "a secret in {text}");
        }
    }

    // Reading changes nothing, and records nothing.
    codepool_ok(&env, &["api-keys", "list"]).await;
    codepool_ok(&env, &["operators", "list"]).await;
    codepool_ok(&env, &["keys", "status"]).await;
    assert_eq!(audit_records(&env).await.len(), 7);
    env.cleanup().await;
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

/// One request to the console: status, head and body.
async fn console(
    addr: &str,
    method: &str,
    path: &str,
    cookie: &str,
    form: &[(&str, &str)],
) -> (u16, String, String) {
    let body = form
        .iter()
        .map(|(k, v)| format!("{k}={}", form_value(v)))
        .collect::<Vec<_>>()
        .join("&");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nCookie: {cookie}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    raw_exchange(addr, req.as_bytes()).await
}

/// The kind and words of each record of `who`, oldest first.
async fn changes_of(env: &TestEnv, who: &str) -> Vec<(String, String)> {
    audit_records(env)
        .await
        .iter()
        .filter(|r| r.get_str("os_user") == Ok(who))
        .filter(|r| r.get_str("kind") != Ok("sign-in"))
        .map(|r| {
            (
                r.get_str("kind").unwrap().to_owned(),
                r.get_str("what").unwrap().to_owned(),
            )
        })
        .collect()
}

/// The same changes through the console and through the CLI: the same
/// kinds, in the same words, each with its own door's actor.
#[tokio::test]
async fn the_cli_and_the_console_record_the_same_credential_changes_alike() {
    let env = TestEnv::new("cli_audit_alike").await;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let cli = format!("os-user:{USER}@{}", host.trim());
    let admin = [
        "operators",
        "add",
        "--name",
        "ada",
        "--role",
        "admin",
        "--password-stdin",
    ];
    run_ok(&env, &admin, &format!("{FIRST_PASSWORD}\n")).await;

    // Through the console, signed in as ada.
    let api = ApiServer::start(&env, &[]).await;
    let (status, head, body) = console(
        &api.addr,
        "POST",
        "/console/signin",
        "",
        &[("name", "ada"), ("password", FIRST_PASSWORD), ("next", "")],
    )
    .await;
    assert_eq!(status, 303, "{head}{body}");
    let cookie = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .starts_with("set-cookie:")
                .then(|| l[11..].trim())
        })
        .and_then(|c| c.split(';').next())
        .expect("a session cookie")
        .to_owned();
    let (status, _, page) = console(&api.addr, "GET", "/console/api-keys", &cookie, &[]).await;
    assert_eq!(status, 200, "{page}");
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .expect("a CSRF token")
        .to_owned();
    let posts: [(&str, &[(&str, &str)]); 4] = [
        (
            "/console/api-keys",
            &[("name", "k"), ("scopes", "admin"), ("shop", "")],
        ),
        ("/console/api-keys/revoke", &[("name", "k")]),
        (
            "/console/operators",
            &[
                ("name", "bea"),
                ("role", "support"),
                ("password", SECOND_PASSWORD),
            ],
        ),
        ("/console/operators/disable", &[("name", "bea")]),
    ];
    for (path, fields) in posts {
        let mut form = vec![("csrf", csrf.as_str())];
        form.extend_from_slice(fields);
        let (status, _, body) = console(&api.addr, "POST", path, &cookie, &form).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
    api.stop().await;

    // Through the CLI: the same changes.
    run_ok(
        &env,
        &["api-keys", "create", "--name", "k", "--scopes", "admin"],
        "",
    )
    .await;
    run_ok(&env, &["api-keys", "revoke", "--name", "k"], "").await;
    let add = [
        "operators",
        "add",
        "--name",
        "cid",
        "--role",
        "support",
        "--password-stdin",
    ];
    run_ok(&env, &add, &format!("{SECOND_PASSWORD}\n")).await;
    run_ok(&env, &["operators", "disable", "--name", "cid"], "").await;

    // Alike, but for the names and the key ids.
    let alike = |changes: Vec<(String, String)>| {
        changes
            .into_iter()
            .map(|(kind, what)| {
                let what = what.replace("\"bea\"", "NAME").replace("\"cid\"", "NAME");
                let what = match what.split_once(" (") {
                    Some((a, b)) => format!("{a} (ID){}", b.split_once(')').unwrap().1),
                    None => what,
                };
                (kind, what)
            })
            .collect::<Vec<_>>()
    };
    let by_console = changes_of(&env, "operator:ada").await;
    let by_cli = changes_of(&env, &cli).await;
    assert_eq!(by_console.len(), 4, "{by_console:?}");
    assert_eq!(
        by_cli.first().map(|(k, _)| k.as_str()),
        Some("operator-add"),
        "ada herself, added through the CLI: {by_cli:?}"
    );
    assert_eq!(alike(by_console), alike(by_cli[1..].to_vec()));
    for r in audit_records(&env).await {
        let text = r.to_string();
        assert!(
            !text.contains(FIRST_PASSWORD) && !text.contains(SECOND_PASSWORD),
            "a password in {text}"
        );
    }
    env.cleanup().await;
}

/// Every change is audited by the core, whichever door made it: an
/// import, a pause and a resume, a void and a recall, through the CLI
/// (with the OS user) and through the API (with the key's name). The
/// console's are checked by its own tests.
#[tokio::test]
async fn changes_through_the_cli_and_the_api_are_audited_with_who_made_them() {
    use crate::api::{json_of, key, order};
    let env = TestEnv::new("audit_audit").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("codes.csv");
    let csv: String = "code\n".to_owned()
        + &(0..20)
            .map(|i| format!("AU-{i:04}-XYZ\n"))
            .collect::<String>();
    std::fs::write(&file, &csv).unwrap();
    let run = |args: Vec<String>| {
        let mut c = env.command(&args.iter().map(String::as_str).collect::<Vec<_>>());
        c.env("USER", "alice");
        async move {
            let out = c.output().await.unwrap();
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    let f = file.to_str().unwrap().to_owned();
    let out = run(vec![
        "import".into(),
        f,
        "--pool".into(),
        "au".into(),
        "--json".into(),
    ])
    .await;
    let import_id = serde_json::from_str::<serde_json::Value>(&out).unwrap()["import_id"]
        .as_str()
        .unwrap()
        .to_owned();
    run(vec![
        "pool".into(),
        "pause".into(),
        "--pool".into(),
        "au".into(),
    ])
    .await;
    run(vec![
        "pool".into(),
        "resume".into(),
        "--pool".into(),
        "au".into(),
    ])
    .await;
    let shop = key(&env, "shop", "orders:write,orders:read").await;
    let (api, admin) = api_with_key(&env, "ops", "admin,orders:write").await;
    let (status, _, _) = api.post("/v1/orders", &shop, &order("AU-1", "au", 1)).await;
    assert_eq!(status, 201);
    run(vec![
        "void".into(),
        "--order".into(),
        "AU-1".into(),
        "--reason".into(),
        "refund".into(),
    ])
    .await;
    run(vec![
        "void".into(),
        "--import".into(),
        import_id.clone(),
        "--reason".into(),
        "leak".into(),
    ])
    .await;

    let (status, _, _) = api.post("/v1/orders", &shop, &order("AU-2", "au", 1)).await;
    assert_eq!(status, 202, "the pool is recalled: AU-2 waits");
    let (status, _, _) = api
        .post("/v1/orders/AU-2/void", &shop, br#"{"reason":"refund"}"#)
        .await;
    assert_eq!(status, 200);
    let csv2: String = "code\n".to_owned()
        + &(0..5)
            .map(|i| format!("AV-{i:04}-XYZ\n"))
            .collect::<String>();
    let (status, _, body) = api
        .post_as(
            "/v1/pools/au/imports?file=more.csv",
            &admin,
            "text/csv",
            csv2.as_bytes(),
        )
        .await;
    assert_eq!(status, 201);
    let second = json_of(&body)["import_id"].as_str().unwrap().to_owned();
    for p in ["pause", "resume"] {
        let (status, _, _) = api.post(&format!("/v1/pools/au/{p}"), &admin, b"").await;
        assert_eq!(status, 200);
    }
    let (status, _, _) = api
        .post(
            &format!("/v1/imports/{second}/recall"),
            &admin,
            br#"{"reason":"leak"}"#,
        )
        .await;
    assert_eq!(status, 200);
    api.stop().await;

    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let cli = audited(&env, &format!("os-user:alice@{}", host.trim())).await;
    let kinds: Vec<&str> = cli.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        ["import", "pause", "resume", "void", "recall"],
        "{cli:?}"
    );
    assert!(
        cli.iter().all(|(_, c)| c.starts_with("codepool ")),
        "{cli:?}"
    );
    let kinds = |v: Vec<(String, String)>| v.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
    assert_eq!(kinds(audited(&env, "api-key:shop").await), ["void"]);
    assert_eq!(
        kinds(audited(&env, "api-key:ops").await),
        ["import", "pause", "resume", "recall"]
    );
    env.cleanup().await;
}
