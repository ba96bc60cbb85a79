//! Error messages that point at the real cause, and help that reads in
//! order: the command's own options first, the shared ones under
//! "Connection".

use crate::common::TestEnv;

async fn stderr_of(mut cmd: tokio::process::Command) -> (Option<i32>, String) {
    let out = cmd.output().await.expect("run codepool");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn an_empty_vhost_is_named_and_an_http_url_is_called_not_amqp() {
    let env = TestEnv::new("messages_amqp").await;
    let mut cmd = env.command(&["dead-letters", "list"]);
    cmd.env("CODEPOOL_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/");
    let (code, err) = stderr_of(cmd).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(r#"no vhost """#) && err.contains("%2f"),
        "{err}"
    );
    assert!(
        !err.contains("unreachable") && !err.contains("rabbitmq-server runs"),
        "{err}"
    );

    let mut cmd = env.command(&["dead-letters", "list"]);
    cmd.env("CODEPOOL_AMQP_URL", "http://guest:guest@127.0.0.1:15672/");
    let (code, err) = stderr_of(cmd).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not an amqp:// or amqps:// URL"), "{err}");
    assert!(!err.contains("unreachable"), "{err}");
    env.cleanup().await;
}

#[tokio::test]
async fn a_key_file_that_is_a_directory_is_called_a_directory() {
    let env = TestEnv::new("messages_keydir").await;
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = env.command(&["lookup", "--order", "O-1"]);
    cmd.env("CODEPOOL_KEY_FILE", dir.path());
    let (code, err) = stderr_of(cmd).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("is a directory"), "{err}");
    assert!(!err.contains("chmod"), "{err}");
    env.cleanup().await;
}

#[tokio::test]
async fn help_lists_the_command_options_before_the_connection_ones() {
    let out = std::process::Command::new(crate::common::bin())
        .args(["export", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let own = help.find("--since").expect("export's own option");
    let heading = help.find("Connection:").expect("a Connection heading");
    let redis = help.find("--redis-url").expect("the shared option");
    assert!(own < heading && heading < redis, "{help}");
}

#[tokio::test]
async fn a_silent_mongodb_gets_one_line_with_its_address_and_what_to_do() {
    let env = TestEnv::new("messages_mongo").await;
    let port = crate::common::free_port();
    let uri =
        format!("mongodb://127.0.0.1:{port}/?directConnection=true&serverSelectionTimeoutMS=500");
    let mut cmd = env.command(&["stats"]);
    cmd.env("CODEPOOL_MONGODB_URI", &uri);
    let (code, err) = stderr_of(cmd).await;
    assert_eq!(code, Some(1), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(lines[0].contains(&format!("127.0.0.1:{port}")), "{err}");
    assert!(lines[0].contains("make services"), "{err}");
    assert!(
        !err.contains("Topology") && !err.contains("labels"),
        "{err}"
    );
    env.cleanup().await;
}
