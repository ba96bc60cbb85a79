//! `codepool dead-letters list|replay`: inspect invalid purchases, and send
//! them back through the queue once their cause is fixed.

use clap::{Args, Subcommand};
use codepool_broker::Publisher;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool dead-letters list
  codepool dead-letters list --json
  codepool dead-letters replay            (after e.g. importing codes into a missing pool)
  codepool dead-letters replay --reason unknown_pool

Replayed messages go back to the purchases queue; those still invalid come
back to the dead-letter queue with their reason. A replay takes at most the
messages that were dead-lettered when it started, so it never replays its own
output; each replayed message carries its replay count (x-codepool-replays),
kept when it is dead-lettered again and shown by `list`. With --wait SECS it
then waits and reports how many of the replayed came back dead.")]
pub struct DeadLettersArgs {
    #[command(subcommand)]
    pub action: Action,
}

#[derive(Debug, Subcommand)]
pub enum Action {
    /// Show dead-lettered purchases with their reasons (they stay queued).
    List {
        /// Most messages to show.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Move dead-lettered purchases back to the purchases queue.
    Replay {
        /// Only messages whose reason starts with this (e.g. unknown_pool).
        #[arg(long)]
        reason: Option<String>,
        /// Most messages to replay.
        #[arg(long, default_value_t = 100_000)]
        limit: usize,
        /// After replaying, wait up to SECS for the dispatchers and report
        /// how many of the replayed messages came back dead.
        #[arg(long, value_name = "SECS")]
        wait: Option<u64>,
    },
}

fn reason_of(props: &lapin::BasicProperties) -> String {
    codepool_broker::dead_letter_reason(props).unwrap_or_else(|| "(no reason header)".into())
}

/// Takes the next dead letter without acking it (None when the queue is empty).
async fn next_dead_letter(
    channel: &lapin::Channel,
    queue: &str,
) -> anyhow::Result<Option<lapin::message::Delivery>> {
    Ok(channel
        .basic_get(queue, BasicGetOptions::default())
        .await?
        .map(|m| m.delivery))
}

pub async fn run(cfg: &Config, args: DeadLettersArgs) -> anyhow::Result<u8> {
    let topology = cfg.topology();
    let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-dead-letters").await?;
    let publisher = Publisher::new(&conn, topology.clone()).await?;
    topology.declare(publisher.channel()).await?;
    let channel = conn.create_channel().await?;
    match args.action {
        Action::List { limit, json } => {
            // Get without ack; closing the channel puts them all back.
            let mut shown = 0;
            while shown < limit {
                let Some(d) = next_dead_letter(&channel, &topology.purchases_dead).await? else {
                    break;
                };
                let reason = reason_of(&d.properties);
                let body = String::from_utf8_lossy(&d.data);
                let body: String = body.chars().take(200).collect();
                let id = d.properties.message_id().as_ref().map(|s| s.to_string());
                let replays = codepool_broker::replay_count(&d.properties);
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"message_id": id, "reason": reason, "replays": replays, "body": body})
                    );
                } else {
                    println!(
                        "{}  reason: {reason}  replays: {replays}\n    body: {body}",
                        id.as_deref().unwrap_or("-")
                    );
                }
                shown += 1;
            }
            let _ = channel.close(200, "listed").await;
            if !json {
                println!("{shown} dead-lettered purchase(s) shown (still queued)");
            }
        }
        Action::Replay {
            reason,
            limit,
            wait,
        } => {
            let sent = replay(&channel, &publisher, &topology, reason.as_deref(), limit).await?;
            if let Some(secs) = wait {
                let again = dead_again(&conn, &topology, &sent, secs).await?;
                println!("{again} of them came back dead (see `codepool dead-letters list`)");
            }
        }
    }
    codepool_broker::close(conn, "done").await;
    Ok(crate::exit::OK)
}

/// Waits up to `secs` for the replayed messages (`sent`: message id and
/// replay count) to be settled, then counts those back in the dead-letter
/// queue. It returns early once the purchases queue is empty and the
/// count stays the same for a second.
async fn dead_again(
    conn: &lapin::Connection,
    topology: &codepool_broker::Topology,
    sent: &std::collections::HashSet<(Option<String>, u32)>,
    secs: u64,
) -> anyhow::Result<usize> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    let mut last = None;
    loop {
        let channel = conn.create_channel().await?;
        let mut found = 0;
        while let Some(d) = next_dead_letter(&channel, &topology.purchases_dead).await? {
            let id = d.properties.message_id().as_ref().map(|s| s.to_string());
            if sent.contains(&(id, codepool_broker::replay_count(&d.properties))) {
                found += 1;
            }
        }
        let waiting = codepool_broker::queue_depth(&channel, &topology.purchases).await?;
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

/// Sends dead letters (those whose reason starts with `reason`, if given)
/// back to the purchases queue, each with its replay count one higher;
/// returns the message ids and counts sent. Only what was dead when it
/// started: messages that fail again land behind them and are not taken
/// again.
async fn replay(
    channel: &lapin::Channel,
    publisher: &Publisher,
    topology: &codepool_broker::Topology,
    reason: Option<&str>,
    limit: usize,
) -> anyhow::Result<std::collections::HashSet<(Option<String>, u32)>> {
    let budget =
        limit.min(codepool_broker::queue_depth(channel, &topology.purchases_dead).await? as usize);
    let mut sent = std::collections::HashSet::new();
    let mut kept = Vec::new();
    let mut replayed = 0;
    while replayed + kept.len() < budget {
        let Some(d) = next_dead_letter(channel, &topology.purchases_dead).await? else {
            break;
        };
        if reason.is_some_and(|r| !reason_of(&d.properties).starts_with(r)) {
            kept.push(d);
            continue;
        }
        let id = d.properties.message_id().as_ref().map(|s| s.to_string());
        let replays = codepool_broker::replay_count(&d.properties).saturating_add(1);
        publisher
            .replay_purchase(&d.data, id.as_deref(), replays)
            .await?
            .wait()
            .await?;
        d.acker.ack(BasicAckOptions::default()).await?;
        sent.insert((id, replays));
        replayed += 1;
    }
    for d in kept {
        d.acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await?;
    }
    println!(
        "replayed {replayed} purchase(s) to {:?}",
        topology.purchases
    );
    Ok(sent)
}
