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
back to the dead-letter queue with their reason.")]
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
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"message_id": id, "reason": reason, "body": body})
                    );
                } else {
                    println!(
                        "{}  reason: {reason}\n    body: {body}",
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
        Action::Replay { reason, limit } => {
            let mut replayed = 0;
            let mut kept = Vec::new();
            while replayed + kept.len() < limit {
                let Some(d) = next_dead_letter(&channel, &topology.purchases_dead).await? else {
                    break;
                };
                if let Some(r) = &reason {
                    if !reason_of(&d.properties).starts_with(r.as_str()) {
                        kept.push(d);
                        continue;
                    }
                }
                let id = d.properties.message_id().as_ref().map(|s| s.to_string());
                publisher
                    .publish_purchase_bytes(&d.data, id.as_deref())
                    .await?
                    .wait()
                    .await?;
                d.acker.ack(BasicAckOptions::default()).await?;
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
        }
    }
    codepool_broker::close(conn, "done").await;
    Ok(crate::exit::OK)
}
