//! Acks of one consumer channel, in as few frames as the broker's rules
//! allow. One ack per delivery cost a frame, a lapin round through its I/O
//! loop and, on a quorum queue, a settle command in the queue's log: as
//! much broker work as the delivery itself. A `multiple` ack settles every
//! unacked delivery up to its tag in one frame, so each batch ends with
//! one, where that is safe:
//!
//! - it may only reach up to the oldest delivery still being worked on
//!   (batches run side by side and finish in any order). A batch that
//!   finishes before an older one leaves its acks waiting, and the older
//!   batch's ack covers both;
//! - at most `defer_most` acks wait: beyond that (an older batch stuck in
//!   an outage, say) the waiting ones are acked one by one, so they never
//!   hold the prefetch window for long;
//! - requeues are nacked one by one first, so no `multiple` ack covers
//!   them;
//! - frames leave in tag order (one sender at a time): a `multiple` ack
//!   below one already sent would name an unknown tag, which closes the
//!   channel.
//!
//! A batch that never settles (stopped before its outcome was durable)
//! keeps its deliveries open, so nothing after it is acked past them;
//! [`AckWindow::flush`] acks the waiting ones one by one when the session
//! winds down, and the channel's close requeues the open ones.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use lapin::acker::Acker;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use tracing::debug;

use codepool_issuance::plan::Settlement;

/// The acks of one consumer channel; see the module docs.
pub struct AckWindow {
    state: Mutex<Window>,
    /// Held while frames are sent, so they leave in tag order.
    sending: tokio::sync::Mutex<()>,
}

impl AckWindow {
    /// `defer_most`: how many acks may wait for an older batch (half the
    /// prefetch window is a good bound).
    pub fn new(defer_most: usize) -> Self {
        Self {
            state: Mutex::new(Window::new(defer_most)),
            sending: tokio::sync::Mutex::new(()),
        }
    }

    /// Records deliveries taken from the consumer: no `multiple` ack may
    /// reach past them until they are settled.
    pub fn opened(&self, deliveries: &[Delivery]) {
        self.window()
            .open(deliveries.iter().map(|d| d.delivery_tag));
    }

    /// Settles a batch: requeues are nacked at once, acks are sent (or
    /// left waiting for an older batch). Failures are logged: an unsent
    /// ack only means a redelivery.
    pub async fn settle(&self, deliveries: &[Delivery], settlements: &[Settlement]) {
        let _sending = self.sending.lock().await;
        let mut requeued = Vec::new();
        let sends = {
            let mut w = self.window();
            for (d, s) in deliveries.iter().zip(settlements) {
                match s {
                    Settlement::Ack => w.settled(d.delivery_tag, Some(d.acker.clone())),
                    Settlement::Requeue => {
                        w.settled(d.delivery_tag, None);
                        requeued.push(&d.acker);
                    }
                }
            }
            w.due()
        };
        // Nacked before any `multiple` ack that would reach past them.
        let nacks = requeued.into_iter().map(|acker| async move {
            let requeue = BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            };
            if let Err(e) = acker.nack(requeue).await {
                debug!(error = %e, "nack failed; the broker will redeliver");
            }
        });
        futures::future::join_all(nacks).await;
        send(sends).await;
    }

    /// Acks, one by one, every ack still waiting (the session is ending).
    pub async fn flush(&self) {
        let _sending = self.sending.lock().await;
        let sends = self.window().all_waiting();
        send(sends).await;
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn send(sends: Sends) {
    if let Some(acker) = sends.up_to {
        if let Err(e) = acker.ack(BasicAckOptions { multiple: true }).await {
            debug!(error = %e, "ack failed; the broker will redeliver");
        }
    }
    // Handed to the connection together: one wake-up of its I/O loop.
    let singles = sends.one_by_one.into_iter().map(|acker| async move {
        if let Err(e) = acker.ack(BasicAckOptions::default()).await {
            debug!(error = %e, "ack failed; the broker will redeliver");
        }
    });
    futures::future::join_all(singles).await;
}

/// Frames to send: one `multiple` ack, then single ones.
struct Sends<A = Acker> {
    up_to: Option<A>,
    one_by_one: Vec<A>,
}

/// The bookkeeping, kept apart from lapin so it can be tested alone.
/// Generic over what is sent for a tag (an [`Acker`] in use).
struct Window<A = Acker> {
    /// Delivered, not yet settled.
    open: BTreeSet<u64>,
    /// Settled by an ack that has not been sent.
    waiting: BTreeMap<u64, A>,
    defer_most: usize,
}

impl<A> Window<A> {
    fn new(defer_most: usize) -> Self {
        Self {
            open: BTreeSet::new(),
            waiting: BTreeMap::new(),
            defer_most: defer_most.max(1),
        }
    }

    fn open(&mut self, tags: impl IntoIterator<Item = u64>) {
        self.open.extend(tags);
    }

    /// `ack`: the acker when settled by an ack, `None` for a requeue.
    fn settled(&mut self, tag: u64, ack: Option<A>) {
        self.open.remove(&tag);
        if let Some(a) = ack {
            self.waiting.insert(tag, a);
        }
    }

    /// What may be sent now: every waiting ack below the oldest open
    /// delivery, as one `multiple` ack at the highest of them; and, when
    /// more than `defer_most` still wait, those one by one.
    fn due(&mut self) -> Sends<A> {
        let oldest_open = self.open.first().copied().unwrap_or(u64::MAX);
        let still_waiting = self.waiting.split_off(&oldest_open);
        let below = std::mem::replace(&mut self.waiting, still_waiting);
        let up_to = below.into_values().next_back();
        if self.waiting.len() > self.defer_most {
            return Sends {
                up_to,
                one_by_one: self.all_waiting().one_by_one,
            };
        }
        Sends {
            up_to,
            one_by_one: Vec::new(),
        }
    }

    fn all_waiting(&mut self) -> Sends<A> {
        Sends {
            up_to: None,
            one_by_one: std::mem::take(&mut self.waiting).into_values().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The window with each ack standing for its own tag.
    fn window(defer_most: usize, open: impl IntoIterator<Item = u64>) -> Window<u64> {
        let mut w = Window::new(defer_most);
        w.open(open);
        w
    }

    fn ack_all(
        w: &mut Window<u64>,
        tags: impl IntoIterator<Item = u64>,
    ) -> (Option<u64>, Vec<u64>) {
        for t in tags {
            w.settled(t, Some(t));
        }
        let s = w.due();
        (s.up_to, s.one_by_one)
    }

    #[test]
    fn a_batch_in_order_is_one_multiple_ack_at_its_highest_tag() {
        let mut w = window(512, 1..=10);
        assert_eq!(ack_all(&mut w, 1..=10), (Some(10), vec![]));
        assert!(w.waiting.is_empty() && w.open.is_empty());
    }

    #[test]
    fn a_newer_batch_finishing_first_waits_for_the_older_one() {
        let mut w = window(512, 1..=20);
        assert_eq!(ack_all(&mut w, 11..=20), (None, vec![]));
        // The older batch's ack covers both.
        assert_eq!(ack_all(&mut w, 1..=10), (Some(20), vec![]));
    }

    #[test]
    fn acks_never_reach_past_an_open_or_requeued_delivery() {
        let mut w = window(512, 1..=10);
        // 4 is still open (another batch): only 1..=3 may go.
        assert_eq!(ack_all(&mut w, [1, 2, 3, 5, 6]), (Some(3), vec![]));
        // 4 is requeued (nacked on its own): 5 and 6 may go now, and the
        // next multiple ack is above every earlier one.
        w.settled(4, None);
        let s = w.due();
        assert_eq!((s.up_to, s.one_by_one), (Some(6), vec![]));
        assert_eq!(ack_all(&mut w, 7..=10), (Some(10), vec![]));
    }

    #[test]
    fn past_the_deferral_bound_waiting_acks_go_one_by_one() {
        let mut w = window(3, 1..=10);
        // 1 is stuck; 2..=4 wait (3, at the bound); the fourth tips it over.
        assert_eq!(ack_all(&mut w, 2..=4), (None, vec![]));
        assert_eq!(ack_all(&mut w, [5]), (None, vec![2, 3, 4, 5]));
        // What was sent one by one is not sent again.
        assert_eq!(ack_all(&mut w, [1]), (Some(1), vec![]));
    }

    #[test]
    fn flush_sends_every_waiting_ack_and_forgets_them() {
        let mut w = window(512, 1..=5);
        ack_all(&mut w, 3..=5);
        let s = w.all_waiting();
        assert_eq!((s.up_to, s.one_by_one), (None, vec![3, 4, 5]));
        assert!(w.waiting.is_empty());
        assert_eq!(w.open, BTreeSet::from([1, 2]));
    }
}
