//! The outbox: the one path by which an SMS-pending event leaves codepool.
//! Publish every event with confirms in flight together, wait for each
//! confirm, and record the confirmed ones so the relay stops re-sending
//! them. The dispatcher, backorder fulfilment, the relay and `codepool
//! resend` all send through [`Outbox::send`].

use std::borrow::Borrow;
use std::sync::{Arc, Mutex};

use codepool_broker::BrokerError;
use codepool_domain::{CodeId, Grant};
use codepool_store::StoreError;
use tracing::debug;

use crate::ports::{EventSink, SmsLedger};

/// How confirmed events are recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marking {
    /// Recorded before `send` returns.
    Now,
    /// Queued and recorded by the next [`Outbox::flush`]: the dispatcher's
    /// hot path, where the mark is bookkeeping only (a lost mark costs one
    /// duplicate event with the same `event_id`).
    Deferred,
    /// Recorded as an operator's re-send (`codepool resend`).
    Resent,
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

/// See the module documentation. Cheap to share; holds the deferred marks.
pub struct Outbox {
    ledger: Arc<dyn SmsLedger>,
    deferred: Mutex<Vec<CodeId>>,
}

impl Outbox {
    pub fn new(ledger: Arc<dyn SmsLedger>) -> Self {
        Self {
            ledger,
            deferred: Mutex::new(Vec::new()),
        }
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
        let (ids, events): (Vec<CodeId>, Vec<_>) = grants
            .iter()
            .map(Borrow::borrow)
            .filter_map(|g: &Grant| Some((g.code_id, g.sms_pending()?)))
            .unzip();
        let mut published = sink.publish_sms(&events).await.into_iter();
        let mut confirmed = Vec::with_capacity(ids.len());
        let mut results = Vec::with_capacity(grants.len());
        for g in grants.iter().map(Borrow::borrow) {
            let g: &Grant = g;
            if g.revoked {
                results.push(Ok(()));
                continue;
            }
            let r = published.next().unwrap_or_else(|| {
                Err(BrokerError::Unavailable(
                    "the broker returned no confirm".into(),
                ))
            });
            if r.is_ok() {
                confirmed.push(g.code_id);
            } else if let Err(e) = &r {
                debug!(order_id = %g.order_id, error = %e, "SMS-pending event not confirmed");
            }
            results.push(r);
        }
        self.record(confirmed, marking).await?;
        Ok(Sent { results })
    }

    async fn record(&self, confirmed: Vec<CodeId>, marking: Marking) -> Result<(), StoreError> {
        match marking {
            Marking::Now => self.ledger.mark_published(&confirmed).await,
            Marking::Resent => self.ledger.mark_resent(&confirmed).await,
            Marking::Deferred => {
                if let Ok(mut d) = self.deferred.lock() {
                    d.extend(confirmed);
                }
                Ok(())
            }
        }
    }

    /// Records the deferred marks, in chunks. On error the unwritten marks
    /// are kept for the next flush.
    pub async fn flush(&self) -> Result<usize, StoreError> {
        let marks = match self.deferred.lock() {
            Ok(mut m) => std::mem::take(&mut *m),
            Err(_) => return Ok(0),
        };
        let mut written = 0;
        for (i, chunk) in marks.chunks(FLUSH_CHUNK).enumerate() {
            if let Err(e) = self.ledger.mark_published(chunk).await {
                if let Ok(mut d) = self.deferred.lock() {
                    d.extend_from_slice(&marks[i * FLUSH_CHUNK..]);
                }
                return Err(e);
            }
            written += chunk.len();
        }
        Ok(written)
    }
}

/// Marks written per update.
const FLUSH_CHUNK: usize = 5000;

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use chrono::Utc;
    use codepool_domain::SmsPending;

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
        async fn mark_published(&self, ids: &[CodeId]) -> Result<(), StoreError> {
            if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(StoreError::Unavailable("down".into()));
            }
            self.published.lock().unwrap().extend_from_slice(ids);
            Ok(())
        }
        async fn mark_resent(&self, ids: &[CodeId]) -> Result<(), StoreError> {
            self.resent.lock().unwrap().extend_from_slice(ids);
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
    async fn deferred_marks_wait_for_flush_and_survive_a_failed_flush() {
        let ledger = Arc::new(Ledger::default());
        let outbox = Outbox::new(ledger.clone());
        let grants = [grant(1, "O-1", false), grant(2, "O-2", false)];
        outbox
            .send(&sink(vec![]), &grants, Marking::Deferred)
            .await
            .unwrap();
        assert!(ledger.published.lock().unwrap().is_empty());
        ledger
            .fail
            .store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(outbox.flush().await.is_err());
        ledger
            .fail
            .store(false, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(outbox.flush().await.unwrap(), 2);
        assert_eq!(ledger.published.lock().unwrap().len(), 2);
        assert_eq!(outbox.flush().await.unwrap(), 0);
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
