//! A shop names the broker users that may publish purchases for it, and a
//! purchase that names the shop from any other user (or with no validated
//! `user_id`) is dead-lettered `shop_not_yours` (issue 54, item 6). Shop
//! names are unique without regard to case (item 8).

use std::time::Duration;

use bson::doc;
use codepool_broker::Publisher;

use crate::common::*;
use crate::fixtures::*;

async fn granted(env: &TestEnv, order: &str) -> u64 {
    count_codes(env, doc! {"order_id": order, "status": 1}).await
}

fn for_shop(order: &str) -> codepool_domain::Purchase {
    let mut p = purchase(order, "bu");
    p.shop = Some("acme".into());
    p
}

#[tokio::test]
async fn a_purchase_naming_a_shop_from_a_broker_user_the_shop_does_not_name_is_dead_lettered() {
    let env = TestEnv::with_pools("broker_users", &[("bu", 10)]).await;
    let args = [
        "shops",
        "create",
        "--name",
        "acme",
        "--pools",
        "bu",
        "--broker-users",
        "acme-backend",
    ];
    codepool_ok(&env, &args).await;
    let daemon = start_daemon(env.command(&[])).await;
    let conn = codepool_broker::connect(AMQP_URL, "broker-users")
        .await
        .unwrap();
    let as_guest = Publisher::new(&conn, env.topology())
        .await
        .unwrap()
        .as_user("guest");
    let anonymous = Publisher::new(&conn, env.topology()).await.unwrap();
    publish_confirmed(&as_guest, &[for_shop("BU-guest")]).await;
    publish_confirmed(&anonymous, &[for_shop("BU-anon")]).await;
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    let mut dead = Vec::new();
    let started = std::time::Instant::now();
    while dead.len() < 2 {
        dead.extend(drain(&ch, &t.purchases_dead).await);
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{} dead letters",
            dead.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for d in &dead {
        let reason = d.reason.clone().unwrap_or_default();
        assert!(reason.starts_with("shop_not_yours"), "{reason}");
        assert!(reason.contains("--broker-users"), "{reason}");
    }
    assert_eq!(
        granted(&env, "BU-guest").await + granted(&env, "BU-anon").await,
        0
    );
    daemon.stop().await;
    // Once the shop names the user, its purchases are the shop's.
    codepool_ok(
        &env,
        &["shops", "set", "--name", "acme", "--broker-users", "guest"],
    )
    .await;
    let shown = codepool_ok(&env, &["shops", "show", "--name", "acme", "--json"]).await;
    assert!(shown.contains("\"guest\""), "{shown}");
    let daemon = start_daemon(env.command(&[])).await;
    publish_confirmed(&as_guest, &[for_shop("BU-ok")]).await;
    eventually(
        Duration::from_secs(30),
        "the shop's purchase is granted",
        || async { granted(&env, "BU-ok").await == 1 },
    )
    .await;
    let owner = env
        .coll("codes")
        .find_one(doc! {"order_id": "BU-ok"})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(owner.get_str("owner").unwrap(), "shop:acme");
    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn shop_names_are_unique_without_regard_to_case() {
    let env = TestEnv::new("shop_case").await;
    create_shop(&env, "acme", "*", &[]).await;
    for name in ["ACME", "Acme"] {
        let out = env
            .run(&["shops", "create", "--name", name, "--pools", "*"])
            .await;
        assert!(!out.status.success(), "{name} was created beside acme");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("exists"), "{err}");
    }
    let list = codepool_ok(&env, &["shops", "list", "--json"]).await;
    let shops: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(shops.as_array().unwrap().len(), 1, "{list}");
    env.cleanup().await;
}
