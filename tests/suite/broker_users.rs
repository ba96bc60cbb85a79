//! A shop names the broker users that may publish purchases for it, and a
//! purchase that names the shop from any other user (or with no validated
//! `user_id`) is dead-lettered `shop_not_yours` (issue 54, item 6). Shop
//! names are unique without regard to case (item 8). A shop's broker user
//! publishes its shop's purchases only, never the operator's, and its
//! permissions reach the purchases queue alone (issue 73, items 1 and 7).

use std::collections::HashMap;
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

/// The dead letters in `purchases.dead` by message id, with their reasons,
/// once there are `n`.
async fn dead_letters(env: &TestEnv, ch: &lapin::Channel, n: usize) -> HashMap<String, String> {
    let queue = env.topology().purchases_dead;
    let mut dead = HashMap::new();
    let started = std::time::Instant::now();
    while dead.len() < n {
        for d in drain(ch, &queue).await {
            let id = d.message_id.unwrap_or_default();
            dead.insert(id, d.reason.unwrap_or_default());
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{} of {n} dead letters: {dead:?}",
            dead.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    dead
}

/// Issue 73, item 1: a shop's broker user, with exactly the permissions
/// docs/shops.md gives it, publishes its own shop's purchases and nothing
/// else. Leaving `shop` out (or sending it null or empty) does not make
/// the purchase the operator's: only the operator's broker users publish
/// purchases of no shop.
#[tokio::test]
async fn a_shops_broker_user_cannot_act_as_the_operator_by_leaving_the_shop_out() {
    let env = TestEnv::with_pools("shop_not_operator", &[("mine", 10), ("theirs", 10)]).await;
    let permissions = documented_shop_permissions(&env);
    let (acme_user, acme_url) = broker_user(&env, "acme-backend", &permissions).await;
    create_shop(&env, "acme", "mine", &["--broker-users", &acme_user]).await;
    create_shop(&env, "bravo", "theirs", &[]).await;
    let daemon = start_daemon(env.command(&[])).await;

    // acme's backend: its own shop's purchase, one of no shop from
    // bravo's pool and from its own, and one naming bravo.
    let acme_conn = codepool_broker::connect(&acme_url, "acme").await.unwrap();
    let acme = Publisher::new(&acme_conn, env.topology())
        .await
        .unwrap()
        .as_user(&acme_user);
    let mut own = for_shop("AC-own");
    own.pool = "mine".into();
    let mut bravos = purchase("AC-bravo", "theirs");
    bravos.shop = Some("bravo".into());
    publish_confirmed(
        &acme,
        &[
            own,
            purchase("AC-noshop-theirs", "theirs"),
            purchase("AC-noshop-mine", "mine"),
            bravos,
        ],
    )
    .await;
    // The operator (codepool's own broker user): a purchase of no shop
    // is taken; `shop` null or empty is malformed, never "no shop".
    let (conn, operator) = env.amqp().await;
    publish_confirmed(&operator, &[purchase("OP-noshop", "theirs")]).await;
    for (id, shop) in [("OP-null", "null"), ("OP-empty", "\"\"")] {
        let body = format!(
            r#"{{"order_id":"{id}","uid":"u","phone":"+8613800000000","pool":"theirs","shop":{shop}}}"#
        );
        publish_bytes(&operator, body.as_bytes(), Some(id)).await;
    }
    // Without a user_id nobody vouches for the publisher.
    let anonymous = Publisher::new(&conn, env.topology()).await.unwrap();
    publish_confirmed(&anonymous, &[purchase("ANON-noshop", "theirs")]).await;

    let ch = conn.create_channel().await.unwrap();
    let dead = dead_letters(&env, &ch, 6).await;
    for id in [
        "AC-noshop-theirs",
        "AC-noshop-mine",
        "AC-bravo",
        "ANON-noshop",
    ] {
        let reason = &dead[id];
        assert!(reason.starts_with("shop_not_yours"), "{id}: {reason}");
    }
    assert!(
        dead["AC-noshop-theirs"].contains(&format!("{acme_user:?}")),
        "{}",
        dead["AC-noshop-theirs"]
    );
    for id in ["OP-null", "OP-empty"] {
        assert!(dead[id].starts_with("wrong_type"), "{id}: {}", dead[id]);
    }
    eventually(
        Duration::from_secs(30),
        "the shop's and the operator's purchases are granted",
        || async { granted(&env, "AC-own").await + granted(&env, "OP-noshop").await == 2 },
    )
    .await;
    for id in [
        "AC-noshop-theirs",
        "AC-noshop-mine",
        "AC-bravo",
        "ANON-noshop",
    ] {
        assert_eq!(granted(&env, id).await, 0, "{id} got a code");
    }
    let own = env
        .coll("codes")
        .find_one(doc! {"order_id": "AC-own"})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(own.get_str("owner").unwrap(), "shop:acme");
    assert_eq!(
        count_codes(&env, doc! {"pool": "theirs", "status": {"$ne": 0}}).await,
        1,
        "bravo's pool gave only the operator's code"
    );
    daemon.stop().await;
    let _ = acme_conn.close(200, "bye").await;
    let _ = conn.close(200, "bye").await;
    delete_broker_user(&acme_user).await;
    env.cleanup().await;
}

/// Issue 73, item 7: the permissions docs/shops.md gives a shop's backend
/// let it publish into `purchases` (through the purchases exchange) and
/// nowhere else: not into `sms.pending` (a forged text to any phone), not
/// into `purchases.dead` (which the operator replays), and not through
/// the default exchange at all.
#[tokio::test]
async fn a_shop_backend_with_the_documented_permissions_writes_into_purchases_only() {
    let env = TestEnv::new("shop_backend_perms").await;
    let t = env.topology();
    let (conn, operator) = env.amqp().await;
    t.declare(operator.channel()).await.unwrap();
    let permissions = documented_shop_permissions(&env);
    assert!(
        !permissions[1].contains("amq") && !permissions[1].contains("(|"),
        "a shop's backend is never granted the default exchange: {permissions:?}"
    );
    let (user, url) = broker_user(&env, "perms-backend", &permissions).await;
    let shop_conn = codepool_broker::connect(&url, "perms").await.unwrap();
    // Each refusal closes its channel: a publisher per attempt.
    let attempt = |exchange: String, key: String| {
        let (shop_conn, t, user) = (&shop_conn, t.clone(), user.clone());
        async move {
            let p = Publisher::new(shop_conn, t).await.unwrap().as_user(&user);
            let props = lapin::BasicProperties::default().with_user_id(user.as_str().into());
            match p
                .publish(&exchange, &key, br#"{"order_id":"X"}"#, props)
                .await
            {
                Ok(sent) => sent.wait().await.is_ok(),
                Err(_) => false,
            }
        }
    };
    let shop = Publisher::new(&shop_conn, t.clone())
        .await
        .unwrap()
        .as_user(&user);
    publish_confirmed(&shop, &[purchase("PERM-1", "p")]).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(queue_depth(&ch, &t.purchases).await, 1, "into purchases");
    for (exchange, key) in [
        (String::new(), t.sms_pending.clone()),
        (t.sms_exchange.clone(), "sms.pending".to_owned()),
        (String::new(), t.purchases_dead.clone()),
        (String::new(), t.purchases.clone()),
        (t.events_exchange.clone(), "code.redeemed".to_owned()),
    ] {
        assert!(
            !attempt(exchange.clone(), key.clone()).await,
            "a shop's backend wrote to {exchange:?} / {key:?}"
        );
    }
    assert_eq!(queue_depth(&ch, &t.sms_pending).await, 0);
    assert_eq!(queue_depth(&ch, &t.purchases_dead).await, 0);
    assert_eq!(queue_depth(&ch, &t.code_redeemed).await, 0);
    assert_eq!(queue_depth(&ch, &t.purchases).await, 1);
    let _ = shop_conn.close(200, "bye").await;
    let _ = conn.close(200, "bye").await;
    delete_broker_user(&user).await;
    env.cleanup().await;
}
