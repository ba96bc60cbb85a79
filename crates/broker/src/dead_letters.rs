//! The dead-letter queue as operators use it, from the CLI and the API:
//! peek at what is there (nothing is taken), and send it back to the
//! purchases queue once the cause is fixed.

use std::collections::HashSet;

use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use lapin::{Channel, Connection};

use crate::publisher::Publisher;
use crate::topology::Topology;
use crate::{dead_letter_reason, publisher_of, queue_depth, replay_count, BrokerError};

/// One dead-lettered purchase as shown: its id, reason, replays and the
/// start of its body (at most 200 characters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    pub message_id: Option<String>,
    pub reason: String,
    pub replays: u32,
    pub body: String,
}

/// The message ids and replay counts a replay sent.
pub type Replayed = HashSet<(Option<String>, u32)>;

fn reason_of(props: &lapin::BasicProperties) -> String {
    dead_letter_reason(props).unwrap_or_else(|| "(no reason header)".into())
}

/// Takes the next dead letter without acking it (None when the queue is empty).
async fn next(
    channel: &Channel,
    queue: &str,
) -> Result<Option<lapin::message::Delivery>, BrokerError> {
    Ok(channel
        .basic_get(queue, BasicGetOptions::default())
        .await?
        .map(|m| m.delivery))
}

/// Most dead letters one peek examines (more when `limit` is larger):
/// each is held unacked until the peek ends, and a filter that matches
/// nothing must not walk a queue of millions.
pub const MOST_SCANNED: usize = 1000;

/// What a peek found, and how far it looked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peeked {
    /// The letters that matched, oldest first.
    pub letters: Vec<DeadLetter>,
    /// Messages examined, matching or not.
    pub scanned: usize,
    /// The walk stopped at [`MOST_SCANNED`] with letters left unexamined
    /// (and fewer than `limit` found): older matches may lie beyond.
    pub stopped_early: bool,
}

/// Up to `limit` dead letters, oldest first, whose reason starts with
/// `reason` (all when `None`), among the first [`MOST_SCANNED`] (or
/// `limit`, if larger) of the queue. They stay queued: they are got on a
/// channel of their own, which is closed, so the broker puts them all back.
pub async fn peek(
    conn: &Connection,
    topology: &Topology,
    reason: Option<&str>,
    limit: usize,
) -> Result<Peeked, BrokerError> {
    let channel = conn.create_channel().await?;
    // What is there now, each message got once: the ones got are not
    // offered again on this channel, and the queue's depth bounds the walk.
    let depth = queue_depth(&channel, &topology.purchases_dead).await? as usize;
    let bound = depth.min(MOST_SCANNED.max(limit));
    let mut out = Peeked::default();
    while out.letters.len() < limit && out.scanned < bound {
        let Some(d) = next(&channel, &topology.purchases_dead).await? else {
            break;
        };
        out.scanned += 1;
        let why = reason_of(&d.properties);
        if reason.is_some_and(|r| !why.starts_with(r)) {
            continue;
        }
        out.letters.push(DeadLetter {
            message_id: d.properties.message_id().as_ref().map(|s| s.to_string()),
            reason: why,
            replays: replay_count(&d.properties),
            body: String::from_utf8_lossy(&d.data).chars().take(200).collect(),
        });
    }
    out.stopped_early = out.letters.len() < limit && out.scanned == bound && bound < depth;
    let _ = channel.close(200, "peeked").await;
    Ok(out)
}

/// Sends dead letters (those whose reason starts with `reason`, if given)
/// back to the purchases queue (the partition of each one's pool), each with its replay count one higher and
/// the broker user that first published it, as the dead letter recorded it
/// ([`publisher_of`], trusting only the records of `operators`); returns
/// the message ids and counts sent. `publisher` must publish as one of
/// `operators`, or the dispatchers would not trust its records. Only what
/// was dead when it started: messages that fail again land behind them
/// and are not taken again.
pub async fn replay(
    conn: &Connection,
    publisher: &Publisher,
    topology: &Topology,
    reason: Option<&str>,
    limit: usize,
    operators: &[String],
) -> Result<Replayed, BrokerError> {
    let own = publisher.user().unwrap_or_default();
    if !operators.iter().any(|o| o == own) {
        return Err(BrokerError::NotOperator(own.to_owned()));
    }
    let channel = conn.create_channel().await?;
    let budget = limit.min(queue_depth(&channel, &topology.purchases_dead).await? as usize);
    let mut sent = HashSet::new();
    let mut kept = Vec::new();
    while sent.len() + kept.len() < budget {
        let Some(d) = next(&channel, &topology.purchases_dead).await? else {
            break;
        };
        if reason.is_some_and(|r| !reason_of(&d.properties).starts_with(r)) {
            kept.push(d);
            continue;
        }
        let id = d.properties.message_id().as_ref().map(|s| s.to_string());
        let replays = replay_count(&d.properties).saturating_add(1);
        let first = publisher_of(&d.properties, operators);
        publisher
            .replay_purchase(&d.data, id.as_deref(), replays, first.as_deref())
            .await?
            .wait()
            .await?;
        d.acker.ack(BasicAckOptions::default()).await?;
        sent.insert((id, replays));
    }
    for d in kept {
        d.acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await?;
    }
    let _ = channel.close(200, "replayed").await;
    Ok(sent)
}

/// Waits up to `secs` for the replayed messages (`sent`) to be settled,
/// then counts those back in the dead-letter queue. It returns early once
/// every purchases queue is empty and the count stays the same for a second.
pub async fn dead_again(
    conn: &Connection,
    topology: &Topology,
    sent: &Replayed,
    secs: u64,
) -> Result<usize, BrokerError> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    let mut last = None;
    loop {
        let channel = conn.create_channel().await?;
        let mut found = 0;
        while let Some(d) = next(&channel, &topology.purchases_dead).await? {
            let id = d.properties.message_id().as_ref().map(|s| s.to_string());
            if sent.contains(&(id, replay_count(&d.properties))) {
                found += 1;
            }
        }
        let mut waiting = 0;
        for queue in topology.purchase_queues() {
            waiting += queue_depth(&channel, &queue).await?;
        }
        // Closing the channel puts every message it got back.
        let _ = channel.close(200, "counted").await;
        let settled = waiting == 0 && last == Some(found);
        if settled || found == sent.len() || tokio::time::Instant::now() >= deadline {
            return Ok(found);
        }
        last = Some(found);
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}
