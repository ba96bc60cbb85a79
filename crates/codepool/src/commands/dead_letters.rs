//! `codepool dead-letters list|replay`: inspect invalid purchases, and send
//! them back through the queue once their cause is fixed.

use clap::{Args, Subcommand};
use codepool_broker::{dead_letters, Publisher};

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool dead-letters list
  codepool dead-letters list --json
  codepool dead-letters replay            (after e.g. importing codes into a missing pool)
  codepool dead-letters replay --reason unknown_pool

Replayed messages go back to the purchases queue (with --partitions, each
to its pool's partition, as `codepool publish` sends it); those still invalid come
back to the dead-letter queue with their reason. A replay takes at most the
messages that were dead-lettered when it started, so it never replays its own
output; each replayed message carries its replay count (x-codepool-replays),
kept when it is dead-lettered again and shown by `list`, and goes back as
the broker user that first published it (x-codepool-publisher), so a shop's
purchase is checked against its shop as that user's. With --wait SECS it
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

pub async fn run(cfg: &Config, args: DeadLettersArgs) -> anyhow::Result<u8> {
    let topology = cfg.topology();
    let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-dead-letters").await?;
    // A replay carries each purchase's first publisher, vouched for by
    // codepool's own broker user.
    let publisher = Publisher::new(&conn, topology.clone())
        .await?
        .as_user(&Publisher::user_of(&cfg.amqp_url));
    topology.declare_checked(&conn, publisher.channel()).await?;
    match args.action {
        Action::List { limit, json } => {
            let listed = dead_letters::peek(&conn, &topology, None, limit)
                .await?
                .letters;
            for d in &listed {
                if json {
                    say_json!(
                        serde_json::json!({"message_id": d.message_id, "reason": d.reason, "replays": d.replays, "body": d.body})
                            .to_string()
                    );
                } else {
                    say!(
                        "{}  reason: {}  replays: {}\n    body: {}",
                        d.message_id.as_deref().unwrap_or("-"),
                        d.reason,
                        d.replays,
                        d.body
                    );
                }
            }
            if !json {
                say!(
                    "{} dead-lettered purchase(s) shown (still queued)",
                    listed.len()
                );
            }
        }
        Action::Replay {
            reason,
            limit,
            wait,
        } => {
            let store = crate::context::store(cfg).await?;
            let actor = super::actor("dead-letters replay");
            let sent = codepool_issuance::controls::replay_dead_letters(
                &store,
                &conn,
                &publisher,
                reason.as_deref(),
                limit,
                &cfg.operator_users(),
                &actor,
            )
            .await?;
            say!(
                "replayed {} purchase(s) to {:?}{}",
                sent.len(),
                topology.purchases_exchange,
                match topology.is_partitioned() {
                    true => " (each to its pool's partition)",
                    false => "",
                }
            );
            if let Some(secs) = wait {
                let again = dead_letters::dead_again(&conn, &topology, &sent, secs).await?;
                say!("{again} of them came back dead (see `codepool dead-letters list`)");
            }
        }
    }
    codepool_broker::close(conn, "done").await;
    Ok(crate::exit::OK)
}
