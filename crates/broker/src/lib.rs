//! # codepool-broker
//!
//! The RabbitMQ adapter (AMQP 0-9-1 over `lapin`): the names and shape of
//! codepool's topology, connecting, and publishing with publisher confirms.
//!
//! Every message codepool publishes is persistent and confirmed: a publish
//! is done only when the broker has taken responsibility for it. Callers
//! get the confirmation as a future, so many publishes can be in flight
//! together and awaited at once.

pub mod consume;
pub mod dead_letters;
pub mod partitions;
pub mod publisher;
pub mod topology;

use lapin::{Connection, ConnectionProperties};

pub use consume::{
    consume, consume_purchases, subscribe, ConsumerHandle, ConsumerHandles, OpenConsumer,
    PurchaseConsumers, Standby,
};
pub use partitions::{partition_of, MAX_PARTITIONS};
pub use publisher::{amqp_message_id, confirmed, PendingConfirm, Publisher};
pub use topology::{QueueSettings, QueueType, Topology, DEFAULT_DELIVERY_LIMIT};

/// Header that carries why a purchase was dead-lettered.
pub const REASON_HEADER: &str = "x-codepool-reason";

/// How often `codepool dead-letters replay` sent a purchase back; carried
/// over when it is dead-lettered again, so a replay can tell its own output.
pub const REPLAYS_HEADER: &str = "x-codepool-replays";

/// The broker user that published a purchase, as codepool recorded it on
/// a dead letter and carries it on a replay: the user's name, or empty
/// when the purchase carried no `user_id`. Read only from a message whose
/// own `user_id` (which RabbitMQ checks against the connection's user) is
/// one of the operator's broker users: see [`publisher_of`].
pub const PUBLISHER_HEADER: &str = "x-codepool-publisher";

/// The broker user a purchase counts as published by. RabbitMQ vouches for
/// a message's `user_id` (it refuses any other than the connection's
/// user), so that is the publisher, unless the message carries
/// [`PUBLISHER_HEADER`]: a dead letter or a replay, whose publisher
/// codepool recorded. That record counts only when the message's own
/// `user_id` is one of `operators` (codepool's own broker user and the
/// operator's, who alone write dead letters and replays); anyone else's
/// record is a forgery and the message counts as published by no one.
/// `None`: no publisher is known.
pub fn publisher_of(properties: &lapin::BasicProperties, operators: &[String]) -> Option<String> {
    let user = properties.user_id().as_ref().map(|u| u.as_str());
    let recorded = properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(PUBLISHER_HEADER));
    match recorded {
        None => user.map(str::to_owned),
        Some(_) if !user.is_some_and(|u| operators.iter().any(|o| o == u)) => None,
        Some(lapin::types::AMQPValue::LongString(s)) => Some(s.to_string()),
        Some(lapin::types::AMQPValue::ShortString(s)) => Some(s.to_string()),
        Some(_) => None,
    }
    .filter(|u| !u.is_empty())
}

/// The operator's broker users: codepool's own (the user of `amqp_url`,
/// which its dispatchers, replays and `codepool publish` connect as) and
/// those `listed` (`CODEPOOL_OPERATOR_BROKER_USERS`), each once.
pub fn operator_users(amqp_url: &str, listed: &[String]) -> Vec<String> {
    let mut users = vec![Publisher::user_of(amqp_url)];
    for u in listed.iter().map(|u| u.trim()).filter(|u| !u.is_empty()) {
        if !users.iter().any(|x| x == u) {
            users.push(u.to_owned());
        }
    }
    users
}

/// The replay count a message carries (0 when it was never replayed).
pub fn replay_count(properties: &lapin::BasicProperties) -> u32 {
    let Some(headers) = properties.headers().as_ref() else {
        return 0;
    };
    match headers.inner().get(REPLAYS_HEADER) {
        Some(lapin::types::AMQPValue::LongUInt(n)) => *n,
        Some(lapin::types::AMQPValue::LongLongInt(n)) => u32::try_from(*n).unwrap_or(0),
        Some(lapin::types::AMQPValue::LongInt(n)) => u32::try_from(*n).unwrap_or(0),
        _ => 0,
    }
}

/// Why a message was dead-lettered: its `x-codepool-reason` (set by the
/// dispatcher), else the broker's own (`x-first-death-reason`, e.g.
/// `delivery_limit` when a quorum queue gave up on it, with the queue it
/// came from).
pub fn dead_letter_reason(properties: &lapin::BasicProperties) -> Option<String> {
    let headers = properties.headers().as_ref()?.inner();
    let text = |key: &str| {
        Some(match headers.get(key)? {
            lapin::types::AMQPValue::LongString(s) => s.to_string(),
            lapin::types::AMQPValue::ShortString(s) => s.to_string(),
            other => format!("{other:?}"),
        })
    };
    if let Some(reason) = text(REASON_HEADER) {
        return Some(reason);
    }
    let reason = text("x-first-death-reason")?;
    Some(match text("x-first-death-queue") {
        Some(queue) => format!("{reason}: dead-lettered by RabbitMQ from queue {queue:?}"),
        None => format!("{reason}: dead-lettered by RabbitMQ"),
    })
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    #[error("RabbitMQ is unreachable ({0}); check that rabbitmq-server runs and CODEPOOL_AMQP_URL points at it (`make services` starts a local one)")]
    Unavailable(String),
    /// The broker refused the user or password: retrying cannot help.
    #[error("RabbitMQ refused the user or password in CODEPOOL_AMQP_URL ({0}); check them (`rabbitmqctl list_users`, `rabbitmqctl authenticate_user USER PASSWORD`) and start again")]
    AuthRefused(String),
    #[error("RabbitMQ refused the message (nack); it was not stored and will be retried")]
    Nacked,
    #[error("no queue is bound for {exchange:?} / {routing_key:?}; run `codepool dispatch` (or `codepool migrate`) once to declare the topology")]
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    #[error("RabbitMQ topology: {0}")]
    Topology(String),
    /// A replay would publish as a broker user the dispatchers do not
    /// trust to record who first published a purchase.
    #[error("this process publishes as broker user {0:?}, which is not one of the operator's broker users (codepool's own, the user of CODEPOOL_AMQP_URL, and CODEPOOL_OPERATOR_BROKER_USERS); replay with the dispatchers' CODEPOOL_AMQP_URL, or list the user in CODEPOOL_OPERATOR_BROKER_USERS of every codepool process")]
    NotOperator(String),
    /// CODEPOOL_AMQP_URL names something RabbitMQ will never accept (not
    /// an AMQP URL, a vhost that does not exist): retrying cannot help.
    #[error("{0}")]
    Url(String),
    #[error("RabbitMQ queue {queue:?} exists as a {existing} queue, but codepool is set to declare {wanted} queues, and a queue's type cannot change. \
Either keep {existing} queues: set CODEPOOL_QUEUE_TYPE={existing} (or --queue-type {existing}); \
or migrate: stop every dispatcher, let {queue:?} drain (or move its messages, e.g. with a shovel), delete it (rabbitmqctl delete_queue {queue}), \
do the same for codepool's other queues, and start codepool again: it declares {wanted} queues. See docs/scaling.md")]
    QueueType {
        queue: String,
        existing: &'static str,
        wanted: &'static str,
    },
    /// The broker's purchase queues are of another partition count than
    /// this process is set to (`found`, when it could be counted).
    #[error("{}", partitions::mismatch_message(*configured, *found, exchange))]
    Partitions {
        configured: u16,
        found: Option<u16>,
        exchange: String,
    },
}

impl BrokerError {
    /// True when retrying cannot help: the broker's topology contradicts
    /// the configuration until an operator changes one of them.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            BrokerError::QueueType { .. }
                | BrokerError::Url(_)
                | BrokerError::AuthRefused(_)
                | BrokerError::Partitions { .. }
        )
    }

    /// True when the process should stop rather than wait for a fix: the
    /// broker refused who we are, or its purchase queues are of another
    /// partition count (consuming on would leave a partition unserved, or
    /// serve it out of order beside the deployment's dispatchers).
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            BrokerError::AuthRefused(_) | BrokerError::Partitions { .. }
        )
    }
}

impl From<lapin::Error> for BrokerError {
    fn from(e: lapin::Error) -> Self {
        BrokerError::Unavailable(e.to_string())
    }
}

/// Ready messages in `queue` right now (a passive declare: unacked
/// messages are not counted, and a missing queue is an error).
pub async fn queue_depth(channel: &lapin::Channel, queue: &str) -> Result<u32, BrokerError> {
    let q = channel
        .queue_declare(
            queue,
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await?;
    Ok(q.message_count())
}

/// How long [`close`] waits for a connection's I/O thread to end.
pub(crate) const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Closes a connection and waits for lapin's I/O thread to end, so that the
/// thread never outlives the tokio runtime (it would log `ERROR io_loop … A
/// Tokio 1.x context was found, but it is being shutdown` at exit). Best
/// effort and bounded: a connection that is already gone is fine.
///
/// The connection's close closes its channels. Closing them one by one
/// just before would race lapin: a channel's close removes it from the
/// connection in a task of its own, and the connection's close removes it
/// again if it comes first, which lapin logs as `ERROR Connection error
/// error=invalid channel`. So: cancel consumers
/// ([`ConsumerHandle::cancel`]), settle publishers ([`Publisher::settle`]),
/// keep every channel handle until this returns (a channel dropped while
/// open is closed by lapin in a task that races this close), then close.
pub async fn close(conn: Connection, reason: &str) {
    let _ = conn.close(200, reason).await;
    let (done, ended) = tokio::sync::oneshot::channel();
    // A plain thread, not spawn_blocking: the runtime must never wait on it.
    let joined = std::thread::Builder::new()
        .name("codepool-amqp-close".into())
        .spawn(move || {
            let _ = conn.run();
            let _ = done.send(());
        });
    if joined.is_ok() {
        let _ = tokio::time::timeout(CLOSE_WAIT, ended).await;
    }
}

/// How long one node may take to accept a connection before the next one
/// in the list is tried.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Connects to RabbitMQ on the tokio runtime. `urls` is one AMQP URL or a
/// comma-separated list of the nodes of a cluster: the first node that
/// answers wins, so after losing a node a reconnect lands on another one.
/// The vhost comes from the URL (`amqp://user:pass@host:5672/%2f` is the
/// default vhost `/`).
pub async fn connect(urls: &str, name: &str) -> Result<Connection, BrokerError> {
    let nodes: Vec<&str> = urls
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    let mut failures = Vec::new();
    for url in &nodes {
        if let Some(problem) = not_amqp(url) {
            return Err(BrokerError::Url(problem));
        }
        match connect_one(url, name).await {
            Ok(conn) => {
                if !failures.is_empty() {
                    tracing::info!(node = %redact(url), "connected to another RabbitMQ node");
                }
                return Ok(conn);
            }
            Err(Refusal::Login) => return Err(BrokerError::AuthRefused(redact(url))),
            Err(Refusal::Other(e)) if e.contains("vhost") => {
                return Err(BrokerError::Url(no_vhost(url, &e)))
            }
            Err(Refusal::Other(e)) => failures.push(format!("{}: {e}", redact(url))),
        }
    }
    Err(BrokerError::Unavailable(match failures.as_slice() {
        [] => "no AMQP URL given".to_owned(),
        [one] => one.clone(),
        all => format!("no node answered ({})", all.join("; ")),
    }))
}

/// Why one node did not take the connection.
enum Refusal {
    /// ACCESS_REFUSED at login: the user or password is wrong.
    Login,
    Other(String),
}

/// True for the broker's answer to a wrong user or password: an
/// ACCESS_REFUSED error while connecting (lapin asks RabbitMQ to say so
/// with `authentication_failure_close`).
fn is_login_refused(e: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    matches!(e, lapin::Error::ProtocolError(p)
        if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)))
}

async fn connect_one(url: &str, name: &str) -> Result<Connection, Refusal> {
    let mut props = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio)
        .with_connection_name(name.into());
    props.client_properties.insert(
        "product".into(),
        lapin::types::AMQPValue::LongString("codepool".into()),
    );
    match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(url, props)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) if is_login_refused(&e) => Err(Refusal::Login),
        Ok(Err(e)) => Err(Refusal::Other(e.to_string())),
        Err(_) => Err(Refusal::Other(format!(
            "connection timed out after {CONNECT_TIMEOUT:?}"
        ))),
    }
}

/// `url` without its password, for logs and errors.
/// Why `url` is not an AMQP URL at all, if it is not.
fn not_amqp(url: &str) -> Option<String> {
    let scheme = url.split("://").next().unwrap_or("").to_ascii_lowercase();
    (scheme != "amqp" && scheme != "amqps").then(|| {
        format!(
            "{} is not an amqp:// or amqps:// URL; set CODEPOOL_AMQP_URL to RabbitMQ's AMQP address, e.g. amqp://guest:guest@127.0.0.1:5672/%2f",
            redact(url)
        )
    })
}

/// The vhost an AMQP URL names: its path, percent-decoded; "/" when it has
/// none, "" when it is a bare "/".
fn vhost_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.split(['?', '#']).next().unwrap_or("");
    let Some((_, path)) = rest.split_once('/') else {
        return "/".to_owned();
    };
    let mut out = Vec::with_capacity(path.len());
    let bytes = path.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The message for a vhost RabbitMQ does not have.
fn no_vhost(url: &str, error: &str) -> String {
    let vhost = vhost_of(url);
    let hint = if vhost.is_empty() {
        "the URL ends with '/', which names the empty vhost; the default vhost \"/\" is written %2f, e.g. amqp://guest:guest@127.0.0.1:5672/%2f"
    } else {
        "create it (rabbitmqctl add_vhost NAME, then set_permissions) or fix the URL's path; the default vhost \"/\" is written %2f"
    };
    format!(
        "RabbitMQ at {} has no vhost {vhost:?} ({error}); {hint}",
        redact(url)
    )
}

fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod url_tests {
    use super::*;

    #[test]
    fn the_vhost_is_the_decoded_path() {
        assert_eq!(vhost_of("amqp://g:g@h:5672/%2f"), "/");
        assert_eq!(vhost_of("amqp://g:g@h:5672/"), "");
        assert_eq!(vhost_of("amqp://g:g@h:5672"), "/");
        assert_eq!(vhost_of("amqp://h/shop%2Dx?heartbeat=10"), "shop-x");
    }

    #[test]
    fn only_amqp_urls_pass() {
        assert!(not_amqp("amqp://h").is_none() && not_amqp("AMQPS://h").is_none());
        let e = not_amqp("http://guest:secret@h:15672/").unwrap();
        assert!(
            e.contains("not an amqp:// or amqps:// URL") && !e.contains("secret"),
            "{e}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_logs() {
        assert_eq!(
            redact("amqp://guest:guest@127.0.0.1:5701/%2f"),
            "amqp://guest:***@127.0.0.1:5701/%2f"
        );
        assert_eq!(redact("amqp://127.0.0.1"), "amqp://127.0.0.1");
    }

    #[tokio::test]
    async fn an_empty_list_is_an_error_that_says_so() {
        let e = connect(" , ", "test").await.err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("no AMQP URL")));
    }
}

#[cfg(test)]
mod publisher_tests {
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::BasicProperties;

    use super::*;

    fn message(user: Option<&str>, recorded: Option<&str>) -> BasicProperties {
        let mut props = BasicProperties::default();
        if let Some(u) = user {
            props = props.with_user_id(u.into());
        }
        if let Some(r) = recorded {
            let mut headers = FieldTable::default();
            headers.insert(PUBLISHER_HEADER.into(), AMQPValue::LongString(r.into()));
            props = props.with_headers(headers);
        }
        props
    }

    #[test]
    fn a_recorded_publisher_counts_only_from_the_operators_users() {
        let operators = operator_users("amqp://codepool:pw@h/%2f", &[" ops ".into(), "".into()]);
        assert_eq!(operators, vec!["codepool", "ops"]);
        let of = |user, recorded| publisher_of(&message(user, recorded), &operators);
        assert_eq!(of(Some("acme"), None).as_deref(), Some("acme"));
        assert_eq!(of(None, None), None);
        // codepool's replay of acme's purchase, and of one with no user_id
        assert_eq!(of(Some("codepool"), Some("acme")).as_deref(), Some("acme"));
        assert_eq!(of(Some("ops"), Some("acme")).as_deref(), Some("acme"));
        assert_eq!(of(Some("codepool"), Some("")), None);
        // a shop forging a record: published by no one, not by itself
        assert_eq!(of(Some("acme"), Some("codepool")), None);
        assert_eq!(of(None, Some("codepool")), None);
    }
}
