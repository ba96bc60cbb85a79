//! `codepool resend --order O`: publish an order's SMS-pending event again
//! (the buyer says the text never came). Same `event_id` as the first
//! time, so an SMS service that already sent it can tell.

use std::sync::Arc;

use clap::Args;
use codepool_issuance::{ops, Outbox};

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool resend --order O-1001
  codepool lookup --order O-1001      (SMS status and history, before and after)

The event is published persistent and confirmed by RabbitMQ before this
returns. Void and used codes are not re-sent.")]
pub struct ResendArgs {
    /// The order whose SMS-pending event to publish again.
    #[arg(long, value_parser = super::target::order_id)]
    pub order: String,
}

pub async fn run(cfg: &Config, args: ResendArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    let (conn, publisher) = crate::context::publisher(cfg, "codepool-resend").await?;
    let outbox = Outbox::new(Arc::new(store.clone()));
    let actor = super::actor("resend");
    let result = ops::resend(&store, &outbox, &publisher, &args.order, &actor).await;
    codepool_broker::close(conn, "done").await;
    let (events, codes) = result?;
    for event in &events {
        let lines: Vec<u32> = event.all_codes().iter().map(|c| c.line).collect();
        let masked: Vec<String> = (codes.iter())
            .filter(|c| c.holder.as_ref().is_some_and(|h| lines.contains(&h.line)))
            .map(|c| c.masked())
            .collect();
        say!(
            "re-published the SMS-pending event of order {} (event id {}, {} {}, pool {})",
            args.order,
            event.event_id,
            if masked.len() == 1 { "code" } else { "codes" },
            masked.join(" "),
            event.pool
        );
    }
    Ok(crate::exit::OK)
}
