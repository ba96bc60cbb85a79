//! The outbox: the one path by which an SMS-pending event leaves codepool.
//! Publish every event with confirms in flight together, wait for each
//! confirm, and record the confirmed ones where the relay owes them (so it
//! stops re-sending them). The dispatcher, backorder fulfilment, the relay
//! and `codepool resend` all send through [`Outbox::send`].

use std::borrow::Borrow;
use std::sync::Arc;

use codepool_broker::BrokerError;
use codepool_domain::{sms_events, CodeId, Grant};
use codepool_store::StoreError;
use tracing::{debug, info};

use crate::ports::{EventSink, SmsLedger};

/// How confirmed events are recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marking {
    /// Recorded before `send` returns: the grant is on the relay's list
    /// ([`crate::Resend::ByRelay`]) and leaves it now.
    Now,
    /// Not recorded: the caller's own input sends the event again until it
    /// is confirmed. The dispatcher acks a purchase only after its event
    /// is confirmed, and the broker redelivers it until then
    /// ([`crate::Resend::ByRedelivery`]): a mark would be a second write
    /// per grant that nothing reads.
    Unneeded,
    /// Recorded as an operator's re-send (`codepool resend`).
    Resent,
}

impl Marking {
    /// How a placed batch's confirmed events are recorded, by what owes
    /// them: the relay's mark is taken off; a redelivery or the batch's
    /// record needs no mark (the record goes whole once all are sent).
    pub fn after(resend: crate::Resend) -> Self {
        match resend {
            crate::Resend::ByRelay | crate::Resend::Backorder => Self::Now,
            crate::Resend::ByRedelivery | crate::Resend::ByRecord | crate::Resend::Nothing => {
                Self::Unneeded
            }
        }
    }
}

/// What one [`Outbox::send`] did, aligned with its input.
#[derive(Debug)]
pub struct Sent {
    /// Per grant: `Ok` once the broker confirmed its event. A revoked
    /// grant has no event and counts as `Ok` (nothing to send).
    pub results: Vec<Result<(), BrokerError>>,
}

impl Sent {
    pub fn confirmed(&self) -> usize {
        self.results.iter().filter(|r| r.is_ok()).count()
    }
}

/// See the module documentation. Cheap to share.
pub struct Outbox {
    ledger: Arc<dyn SmsLedger>,
}

impl Outbox {
    pub fn new(ledger: Arc<dyn SmsLedger>) -> Self {
        Self { ledger }
    }

    /// Sends the SMS-pending event of every grant through `sink` and
    /// records the confirmed ones as `marking` says. A store error while
    /// recording is returned: the events went out, and the relay will
    /// send them again (same `event_id`) until a mark lands.
    pub async fn send<G: Borrow<Grant>>(
        &self,
        sink: &dyn EventSink,
        grants: &[G],
        marking: Marking,
    ) -> Result<Sent, StoreError> {
        // One event per grant of a one-code order, one per part of an
        // order of several; each grant's result is its event's.
        let (events, carried): (Vec<_>, Vec<_>) = sms_events(grants).into_iter().unzip();
        let published = sink.publish_sms(&events).await;
        let mut results: Vec<Result<(), BrokerError>> = (0..grants.len()).map(|_| Ok(())).collect();
        for (k, carried) in carried.iter().enumerate() {
            let r = published.get(k).cloned().unwrap_or_else(|| {
                Err(BrokerError::Unavailable(
                    "the broker returned no confirm".into(),
                ))
            });
            if let Err(e) = &r {
                debug!(event_id = %events[k].event_id, error = %e, "SMS-pending event not confirmed");
            }
            for &i in carried {
                results[i] = r.clone();
            }
        }
        let confirmed: Vec<(&str, CodeId)> = grants
            .iter()
            .map(Borrow::borrow)
            .zip(&results)
            .filter(|(g, r)| !g.revoked && r.is_ok())
            .map(|(g, _)| (g.pool.as_str(), g.code_id))
            .collect();
        self.record(confirmed, marking).await?;
        Ok(Sent { results })
    }

    async fn record(
        &self,
        confirmed: Vec<(&str, CodeId)>,
        marking: Marking,
    ) -> Result<(), StoreError> {
        match marking {
            Marking::Now => self.ledger.mark_published(&confirmed).await,
            Marking::Resent => self.ledger.mark_resent(&confirmed).await,
            Marking::Unneeded => Ok(()),
        }
    }
}

/// One info line per order whose `sms.pending` event the broker
/// confirmed in `sent` (aligned with `grants`), naming the order and its
/// pool: grepping an order id shows its event's way out. The grants of an
/// order come together, so an order is told once without a set.
pub fn log_published<G: Borrow<Grant>>(grants: &[G], sent: &Sent) {
    if !tracing::enabled!(tracing::Level::INFO) {
        return;
    }
    let mut last: Option<&str> = None;
    for (g, r) in grants.iter().map(Borrow::borrow).zip(&sent.results) {
        if r.is_ok() && !g.revoked && last != Some(g.order_id.as_str()) {
            last = Some(g.order_id.as_str());
            info!(order_id = %g.order_id, pool = %g.pool, "sms.pending published");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use chrono::Utc;
    use codepool_domain::SmsPending;
    use std::sync::Mutex;

    /// Confirms every event except those of the orders in `refuse`.
    struct Sink {
        refuse: Vec<&'static str>,
        seen: Mutex<Vec<String>>,
    }

    #[async_trait]
    impl EventSink for Sink {
        async fn publish_sms(&self, events: &[SmsPending]) -> Vec<Result<(), BrokerError>> {
            let mut seen = self.seen.lock().unwrap();
            events
                .iter()
                .map(|e| {
                    seen.push(e.event_id.clone());
                    if self.refuse.contains(&e.order_id.as_str()) {
                        Err(BrokerError::Nacked)
                    } else {
                        Ok(())
                    }
                })
                .collect()
        }
    }

    #[derive(Default)]
    struct Ledger {
        published: Mutex<Vec<CodeId>>,
        resent: Mutex<Vec<CodeId>>,
        fail: std::sync::atomic::AtomicBool,
    }

    #[async_trait]
    impl SmsLedger for Ledger {
        async fn mark_published(&self, ids: &[(&str, CodeId)]) -> Result<(), StoreError> {
            if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(StoreError::Unavailable("down".into()));
            }
            self.published
                .lock()
                .unwrap()
                .extend(ids.iter().map(|(_, id)| *id));
            Ok(())
        }
        async fn mark_resent(&self, ids: &[(&str, CodeId)]) -> Result<(), StoreError> {
            self.resent
                .lock()
                .unwrap()
                .extend(ids.iter().map(|(_, id)| *id));
            Ok(())
        }
    }

    fn grant(n: u8, order: &str, revoked: bool) -> Grant {
        Grant {
            code_id: CodeId::from_bytes([n; 12]),
            pool: "x".into(),
            code: "QWER-1234".into(),
            order_id: order.into(),
            uid: "u".into(),
            phone: "+8613800000000".into(),
            grant_no: None,
            issued_at: Utc::now(),
            revoked,
            line: 0,
            quantity: 1,
            part: 0,
            owner: None,
            replacement: 0,
        }
    }

    fn sink(refuse: Vec<&'static str>) -> Sink {
        Sink {
            refuse,
            seen: Mutex::new(Vec::new()),
        }
    }

    #[tokio::test]
    async fn only_confirmed_events_are_marked_and_revoked_grants_send_nothing() {
        let ledger = Arc::new(Ledger::default());
        let outbox = Outbox::new(ledger.clone());
        let s = sink(vec!["O-2"]);
        let grants = [
            grant(1, "O-1", false),
            grant(2, "O-2", false),
            grant(3, "O-3", true),
        ];
        let sent = outbox.send(&s, &grants, Marking::Now).await.unwrap();
        assert!(sent.results[0].is_ok());
        assert!(sent.results[1].is_err());
        assert!(sent.results[2].is_ok());
        assert_eq!(*s.seen.lock().unwrap(), vec!["sms:O-1", "sms:O-2"]);
        assert_eq!(
            *ledger.published.lock().unwrap(),
            vec![CodeId::from_bytes([1; 12])]
        );
    }

    #[tokio::test]
    async fn events_a_purchase_carries_are_sent_and_not_marked() {
        let ledger = Arc::new(Ledger::default());
        let outbox = Outbox::new(ledger.clone());
        let s = sink(vec!["O-2"]);
        let grants = [grant(1, "O-1", false), grant(2, "O-2", false)];
        let sent = outbox.send(&s, &grants, Marking::Unneeded).await.unwrap();
        assert_eq!(sent.confirmed(), 1);
        assert!(sent.results[1].is_err(), "the caller requeues what failed");
        assert_eq!(*s.seen.lock().unwrap(), vec!["sms:O-1", "sms:O-2"]);
        assert!(ledger.published.lock().unwrap().is_empty());
        assert!(ledger.resent.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_mark_that_cannot_be_written_is_an_error_for_the_caller() {
        let ledger = Arc::new(Ledger::default());
        ledger
            .fail
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let outbox = Outbox::new(ledger.clone());
        let s = sink(vec![]);
        let sent = outbox
            .send(&s, &[grant(1, "O-1", false)], Marking::Now)
            .await;
        assert!(matches!(sent, Err(StoreError::Unavailable(_))));
        assert_eq!(s.seen.lock().unwrap().len(), 1, "the event went out");
    }

    #[tokio::test]
    async fn a_resend_is_recorded_as_a_resend() {
        let ledger = Arc::new(Ledger::default());
        let outbox = Outbox::new(ledger.clone());
        outbox
            .send(&sink(vec![]), &[grant(9, "O-9", false)], Marking::Resent)
            .await
            .unwrap();
        assert_eq!(ledger.resent.lock().unwrap().len(), 1);
        assert!(ledger.published.lock().unwrap().is_empty());
    }
}
