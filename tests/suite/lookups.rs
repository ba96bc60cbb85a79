//! What `codepool lookup` and `codepool dead-letters list` print: text a
//! producer or an old record holds (terminal controls, bidi overrides) is
//! escaped, never written raw to the operator's terminal, and the JSON
//! output stays valid JSON of the same text.

use crate::common::*;
use crate::fixtures::*;

#[tokio::test]
async fn lookup_and_dead_letters_list_escape_terminal_controls() {
    use lapin::options::BasicPublishOptions;
    let env = TestEnv::new("lookup_escapes").await;
    let codes = env.fill_pool("te", 2).await;
    // A reason stored before reasons were checked.
    let target = codepool_store::lifecycle::CodeRef::Code {
        pool: "te",
        code: &codes[0],
    };
    env.store.void(target, EVIL).await.unwrap();
    let (code, out, err) = codepool(&env, &["lookup", "--pool", "te", "--code", &codes[0]]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\\u{1b}"), "{out}");
    assert_no_raw_escapes(&out);

    // A dead letter whose message id and body carry terminal commands.
    let (conn, publisher) = env.amqp().await;
    env.topology().declare(publisher.channel()).await.unwrap();
    let props = lapin::BasicProperties::default().with_message_id(EVIL.into());
    (publisher.channel())
        .basic_publish(
            "",
            &env.topology().purchases_dead,
            BasicPublishOptions::default(),
            format!("{{\"order_id\":\"{EVIL}\"}}").as_bytes(),
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    codepool_broker::close(conn, "done").await;
    let (code, out, err) = codepool(&env, &["dead-letters", "list"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("gpj.exe"), "{out}");
    assert_no_raw_escapes(&out);
    let (code, out, err) = codepool(&env, &["dead-letters", "list", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    assert_no_raw_escapes(&out);
    let line: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(
        line["message_id"], EVIL,
        "JSON output stays valid JSON of the same text"
    );
    env.cleanup().await;
}
