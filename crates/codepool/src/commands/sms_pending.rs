//! `codepool sms-pending`: look at the SMS-pending events waiting for the
//! SMS service, without taking them (codes masked unless --reveal).

use clap::Args;
use codepool_domain::{mask, SmsPending};
use lapin::options::BasicGetOptions;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool sms-pending
  codepool sms-pending --limit 5 --reveal

The events stay queued: this only peeks.")]
pub struct SmsPendingArgs {
    /// Most events to show.
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    /// Show codes in clear text.
    #[arg(long)]
    pub reveal: bool,
}

pub async fn run(cfg: &Config, args: SmsPendingArgs) -> anyhow::Result<u8> {
    let topology = cfg.topology();
    if args.reveal {
        let store = crate::context::store(cfg).await?;
        let what = format!(
            "up to {} SMS-pending event(s) in {:?}",
            args.limit, topology.sms_pending
        );
        super::reveal::record(
            &store,
            "sms-pending --reveal",
            what,
            Vec::new(),
            args.limit as u64,
        )
        .await?;
    }
    let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-sms-pending").await?;
    let channel = conn.create_channel().await?;
    topology.declare_checked(&conn, &channel).await?;
    let mut shown = 0;
    while shown < args.limit {
        let Some(msg) = channel
            .basic_get(&topology.sms_pending, BasicGetOptions::default())
            .await?
        else {
            break;
        };
        match serde_json::from_slice::<SmsPending>(&msg.delivery.data) {
            Ok(mut event) => {
                if !args.reveal {
                    event.code = event.code.as_deref().map(mask);
                    for c in &mut event.codes {
                        c.code = mask(&c.code);
                    }
                }
                say_json!(serde_json::to_string(&event)?);
            }
            Err(_) => say!(
                "(not an SMS-pending event: {} bytes)",
                msg.delivery.data.len()
            ),
        }
        shown += 1;
    }
    // Closing without acks puts every peeked event back.
    let _ = channel.close(200, "peeked").await;
    codepool_broker::close(conn, "done").await;
    say!(
        "{shown} event(s) shown from {:?} (still queued)",
        topology.sms_pending
    );
    Ok(crate::exit::OK)
}
