//! `codepool resend --order O`: publish an order's SMS-pending event again
//! (the buyer says the text never came). Same `event_id` as the first
//! time, so an SMS service that already sent it can tell.

use anyhow::Context;
use clap::Args;
use codepool_broker::Publisher;
use codepool_domain::{mask, CodeStatus};

use super::target::when;
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
    #[arg(long)]
    pub order: String,
}

pub async fn run(cfg: &Config, args: ResendArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    let order = args.order.as_str();
    let doc = store.grants_for_orders(&[order]).await?.remove(order);
    let Some(doc) = doc else {
        let backorders = store.backorders_for_orders(&[order]).await?;
        match backorders.first() {
            Some(b) => anyhow::bail!(
                "order {order} has no code yet (backorder {} since {}); it gets one, with its SMS, when codes are imported into pool {}",
                b.status,
                when(Some(b.created_at)),
                b.pool
            ),
            None => anyhow::bail!(
                "no code was granted to order {order}; check the id with `codepool lookup --order {order}`, or whether the purchase was dead-lettered (`codepool dead-letters list`)"
            ),
        }
    };
    match doc.status() {
        Some(CodeStatus::Issued) => {}
        Some(CodeStatus::Void) => anyhow::bail!(
            "the code of order {order} was voided at {} ({}); a void code is never sent again",
            when(doc.voided_at),
            doc.void_reason.as_deref().unwrap_or("no reason given")
        ),
        Some(CodeStatus::Used) => anyhow::bail!(
            "the code of order {order} was already redeemed at {}; there is nothing to re-send",
            when(doc.used_at)
        ),
        _ => anyhow::bail!(
            "order {order}'s code has status {}; only issued codes are sent",
            doc.status
        ),
    }
    let Some(grant) = doc.grant() else {
        anyhow::bail!("order {order}'s code document lacks its grant fields; inspect it with `codepool lookup --order {order} --json`");
    };
    let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-resend").await?;
    let publisher = Publisher::new(&conn, cfg.topology()).await?;
    cfg.topology().declare(publisher.channel()).await?;
    let Some(event) = grant.sms_pending() else {
        anyhow::bail!("order {order}'s code was revoked; it is never texted again");
    };
    publisher
        .publish_sms_pending(&event)
        .await?
        .wait()
        .await
        .context("RabbitMQ did not confirm the event; run the command again")?;
    codepool_broker::close(conn, "done").await;
    store.record_sms_resent(doc.id).await?;
    println!(
        "re-published the SMS-pending event of order {order} (event id {}, code {}, pool {})",
        event.event_id,
        mask(&grant.code),
        grant.pool
    );
    Ok(crate::exit::OK)
}
