//! The core's one micro-batcher: concurrent requests of one kind (HTTP
//! orders, holds, redemptions, checks) share one database round.
//!
//! A request joins the queue with [`Batcher::ask`] and waits for its
//! answer. Tasks take up to [`Shape::max_batch`] of the queue at a time
//! and run the batch's work, which answers each request through its
//! [`Reply`]. At most [`Shape::in_flight`] batches run at once: the first
//! starts with the first request after a quiet spell; a second starts
//! beside it once [`Shape::second_at`] requests wait, or once the running
//! batch has been taken [`Shape::slow`] ago (a journal stall, a failover),
//! even if no request comes after. Fewer wait for the running batch and go
//! together in the next: every batch pays for its round, however few it
//! holds.
//!
//! Its failures are typed and shared ([`BatchError`]): a full queue
//! ([`Shape::max_waiting`] wait already) is refused at once rather than
//! queued behind minutes of work; a batch that ends without answering (it
//! panicked, or its runtime shut down) tells its requests so; and a
//! batcher that stops ([`Batcher::stop`]) refuses new requests, lets the
//! queued ones be answered, and waits for its batches to end. A batch
//! that fails as a whole answers each request with the same error, typed
//! ([`Shared`]), not turned into words.
//!
//! Metrics, by `batcher` (its [`Shape::name`]): `codepool_batcher_size`
//! (requests per batch) and `codepool_batcher_wait_seconds` (from a
//! request's arrival until its batch took it).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// How one kind of request is batched.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// What is batched, in the plural ("orders", "holds", "redemptions",
    /// "checks"): the metrics' `batcher` label and the errors' words.
    pub name: &'static str,
    /// Most requests in one batch.
    pub max_batch: usize,
    /// Most batches running at once.
    pub in_flight: usize,
    /// Most requests waiting: past it a request is refused at once
    /// ([`BatchError::Full`]).
    pub max_waiting: usize,
    /// Requests that must be waiting before a batch starts beside one that
    /// runs.
    pub second_at: usize,
    /// A batch taken this long ago is slow: a request that arrives then,
    /// or has waited this long, starts a batch beside it.
    pub slow: Duration,
}

impl Shape {
    /// One batch at a time, of up to `max_batch`, with room for four
    /// batches waiting.
    pub const fn one_at_a_time(name: &'static str, max_batch: usize) -> Shape {
        Shape {
            name,
            max_batch,
            in_flight: 1,
            max_waiting: max_batch * 4,
            second_at: usize::MAX,
            slow: Duration::MAX,
        }
    }
}

/// Why a request got no answer from its batch. Every one means "send the
/// same request again" (503), here or to another process.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BatchError {
    #[error(
        "{waiting} {what} are waiting for the database; send the request again in a few seconds"
    )]
    Full { what: &'static str, waiting: usize },
    #[error("this process is stopping and takes no more {what}; send the request again (another process takes it)")]
    Stopping { what: &'static str },
    #[error("the batch of {what} stopped before it answered; send the request again")]
    Ended { what: &'static str },
}

/// A failure of a whole batch, given to each of its requests: the same
/// typed error, shared.
#[derive(Debug)]
pub struct Shared<E>(pub Arc<E>);

impl<E> Clone for Shared<E> {
    fn clone(&self) -> Self {
        Shared(self.0.clone())
    }
}

impl<E: std::fmt::Display> std::fmt::Display for Shared<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<E: std::error::Error> std::error::Error for Shared<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl<E> std::ops::Deref for Shared<E> {
    type Target = E;
    fn deref(&self) -> &E {
        &self.0
    }
}

/// Where one request's answer goes.
pub struct Reply<T>(oneshot::Sender<T>);

impl<T> Reply<T> {
    pub fn send(self, answer: T) {
        let _ = self.0.send(answer);
    }

    /// The request went away (its client hung up): its work may be skipped.
    pub fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// One request in a batch: what it asks, and where its answer goes.
pub struct Pending<A, T> {
    pub ask: A,
    pub reply: Reply<T>,
    at: Instant,
}

type Work<A, T> =
    dyn Fn(Vec<Pending<A, T>>) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync;

/// Batches requests `A`, each answered with a `T` (see the module doc).
pub struct Batcher<A, T> {
    inner: Arc<Inner<A, T>>,
}

impl<A, T> Clone for Batcher<A, T> {
    fn clone(&self) -> Self {
        Batcher {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<A, T> {
    shape: Shape,
    state: Mutex<State<A, T>>,
    work: Box<Work<A, T>>,
    /// Woken when a task ends.
    ended: tokio::sync::Notify,
}

struct State<A, T> {
    waiting: Vec<Pending<A, T>>,
    /// Tasks taking the queue (counted before they first run).
    tasks: usize,
    /// When the last batch was taken.
    taken_at: Instant,
    stopping: bool,
}

/// What a queued request's caller does next.
#[derive(Debug, PartialEq)]
enum Pushed {
    /// Start a task (counted already).
    Start,
    /// Wait; one task runs, and if the request waits `slow` behind it, try
    /// [`Inner::kick`].
    MayKick,
    /// Wait; every task that may run does, and one takes the request.
    Behind,
}

impl<A: Send + 'static, T: Send + 'static> Batcher<A, T> {
    /// A batcher whose batches run `work`; `work` answers each request of
    /// its batch (a request it drops is told [`BatchError::Ended`]).
    pub fn new<F, Fut>(shape: Shape, work: F) -> Self
    where
        F: Fn(Vec<Pending<A, T>>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        assert!(shape.in_flight >= 1 && shape.max_batch >= 1);
        Batcher {
            inner: Arc::new(Inner {
                shape,
                state: Mutex::new(State {
                    waiting: Vec::new(),
                    tasks: 0,
                    taken_at: Instant::now(),
                    stopping: false,
                }),
                work: Box::new(move |batch| Box::pin(work(batch))),
                ended: tokio::sync::Notify::new(),
            }),
        }
    }

    /// Queues `ask` for the next batch and waits for its answer.
    pub async fn ask(&self, ask: A) -> Result<T, BatchError> {
        let inner = &self.inner;
        let what = inner.shape.name;
        let (tx, mut answer) = oneshot::channel();
        let pending = Pending {
            ask,
            reply: Reply(tx),
            at: Instant::now(),
        };
        match inner.push(pending)? {
            Pushed::Start => start(inner),
            Pushed::MayKick => {
                if let Ok(a) = tokio::time::timeout(inner.shape.slow, &mut answer).await {
                    return a.map_err(|_| BatchError::Ended { what });
                }
                if inner.kick() {
                    start(inner);
                }
            }
            Pushed::Behind => {}
        }
        answer.await.map_err(|_| BatchError::Ended { what })
    }

    /// Takes no more requests ([`BatchError::Stopping`]); the queued ones
    /// are still answered.
    pub fn stop(&self) {
        self.inner.lock().stopping = true;
    }

    /// Stops (see [`Batcher::stop`]) and waits, for up to `limit`, until
    /// every queued request was taken and every batch ended. Whether they
    /// were.
    pub async fn stopped(&self, limit: Duration) -> bool {
        self.stop();
        let idle = async {
            loop {
                let ended = self.inner.ended.notified();
                {
                    let s = self.inner.lock();
                    if s.tasks == 0 && s.waiting.is_empty() {
                        return;
                    }
                }
                ended.await;
            }
        };
        tokio::time::timeout(limit, idle).await.is_ok()
    }

    /// Requests waiting, and batches running.
    pub fn load(&self) -> (usize, usize) {
        let s = self.inner.lock();
        (s.waiting.len(), s.tasks)
    }
}

impl<A, T> Inner<A, T> {
    fn lock(&self) -> MutexGuard<'_, State<A, T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `p`: [`Pushed::Start`] when the caller must start a task to
    /// take it (none takes the queue, or fewer than `in_flight` do and
    /// `second_at` wait or the last batch was taken `slow` ago).
    fn push(&self, p: Pending<A, T>) -> Result<Pushed, BatchError> {
        let shape = &self.shape;
        let mut s = self.lock();
        if s.stopping {
            return Err(BatchError::Stopping { what: shape.name });
        }
        if s.waiting.len() >= shape.max_waiting {
            return Err(BatchError::Full {
                what: shape.name,
                waiting: s.waiting.len(),
            });
        }
        s.waiting.push(p);
        if s.tasks == 0 {
            // The first batch after a quiet spell starts now.
            s.taken_at = Instant::now();
        }
        let beside = s.waiting.len() >= shape.second_at || s.taken_at.elapsed() >= shape.slow;
        let more = s.tasks == 0 || (s.tasks < shape.in_flight && beside);
        s.tasks += usize::from(more);
        Ok(match more {
            true => Pushed::Start,
            false if s.tasks < shape.in_flight => Pushed::MayKick,
            false => Pushed::Behind,
        })
    }

    /// `true` (counted) when the caller must start a task beside the
    /// running batch: requests wait, fewer than `in_flight` take the
    /// queue, and the last batch was taken `slow` ago or more.
    fn kick(&self) -> bool {
        let mut s = self.lock();
        let more = !s.waiting.is_empty()
            && s.tasks < self.shape.in_flight
            && s.taken_at.elapsed() >= self.shape.slow;
        s.tasks += usize::from(more);
        more
    }

    /// Up to `max_batch` of the queue; `None` when it is empty, and the
    /// caller's task ends (uncounted).
    fn take(&self) -> Option<Vec<Pending<A, T>>> {
        let mut s = self.lock();
        if s.waiting.is_empty() {
            debug_assert!(s.tasks > 0, "only a counted task takes the queue");
            s.tasks = s.tasks.saturating_sub(1);
            return None;
        }
        s.taken_at = Instant::now();
        let n = s.waiting.len().min(self.shape.max_batch);
        Some(s.waiting.drain(..n).collect())
    }
}

/// Starts a task counted as taking the queue (its count raised already).
fn start<A: Send + 'static, T: Send + 'static>(inner: &Arc<Inner<A, T>>) {
    tokio::spawn(drain(Taking {
        inner: inner.clone(),
        ended: false,
    }));
}

/// A task counted as taking the queue. Dropped before it found the queue
/// empty (stopped mid-batch, or before it first ran, as its runtime shuts
/// down), it takes itself off the count, so the next request starts
/// another.
struct Taking<A, T> {
    inner: Arc<Inner<A, T>>,
    ended: bool,
}

impl<A, T> Drop for Taking<A, T> {
    fn drop(&mut self) {
        // A task that found the queue empty has said so, under the lock.
        if !self.ended {
            let mut s = self.inner.lock();
            s.tasks = s.tasks.saturating_sub(1);
        }
        self.inner.ended.notify_waiters();
    }
}

/// Runs batches of the queue, one after another, until it is empty. A
/// batch that panics answers its own requests [`BatchError::Ended`] (their
/// replies are dropped) and the task goes on with the next.
async fn drain<A, T>(mut taking: Taking<A, T>) {
    use futures::FutureExt;
    let name = taking.inner.shape.name;
    while let Some(batch) = taking.inner.take() {
        metrics::histogram!("codepool_batcher_size", "batcher" => name).record(batch.len() as f64);
        let waited = metrics::histogram!("codepool_batcher_wait_seconds", "batcher" => name);
        for p in &batch {
            waited.record(p.at.elapsed().as_secs_f64());
        }
        let run = std::panic::AssertUnwindSafe((taking.inner.work)(batch));
        if run.catch_unwind().await.is_err() {
            tracing::error!(
                batcher = name,
                "a batch panicked; its requests were answered 503, and the next batch goes on"
            );
        }
    }
    taking.ended = true;
}

#[cfg(test)]
mod tests {
    use super::*;

    type Gate = tokio::sync::watch::Receiver<bool>;
    type Doubler = Batcher<u32, u32>;

    const SECOND_AT: usize = 24;

    fn shape(second_at: usize, slow: Duration) -> Shape {
        Shape {
            name: "numbers",
            max_batch: 256,
            in_flight: 2,
            max_waiting: 1024,
            second_at,
            slow,
        }
    }

    /// Answers each ask with its number doubled; a batch with number 0
    /// waits for the gate to open, then panics.
    fn doubler(shape: Shape, gate: &Gate) -> Doubler {
        let gate = gate.clone();
        Batcher::new(shape, move |batch: Vec<Pending<u32, u32>>| {
            let mut gate = gate.clone();
            async move {
                if batch.iter().any(|p| p.ask == 0) {
                    let _ = gate.wait_for(|open| *open).await;
                    panic!("a batch that panics");
                }
                for p in batch {
                    let n = p.ask;
                    p.reply.send(n * 2);
                }
            }
        })
    }

    fn ask(b: &Doubler, n: u32) -> tokio::task::JoinHandle<Result<u32, BatchError>> {
        let b = b.clone();
        tokio::spawn(async move { b.ask(n).await })
    }

    async fn settle() {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }

    fn tasks(b: &Doubler) -> usize {
        b.load().1
    }

    /// Each of `asks` is answered (its number doubled) by a second batch
    /// while the first waits at the gate; then the gate opens, and the
    /// first batch ends with its ask unanswered.
    async fn answered_beside(
        asks: Vec<(u32, tokio::task::JoinHandle<Result<u32, BatchError>>)>,
        open: tokio::sync::watch::Sender<bool>,
        first: tokio::task::JoinHandle<Result<u32, BatchError>>,
    ) {
        for (n, rx) in asks {
            let answer = tokio::time::timeout(Duration::from_secs(5), rx).await;
            let answer = answer.expect("answered beside the waiting batch");
            assert_eq!(answer.unwrap(), Ok(2 * n));
        }
        open.send_replace(true);
        let ended = first.await.unwrap();
        assert_eq!(ended, Err(BatchError::Ended { what: "numbers" }));
    }

    /// Both tasks take a batch that panics while more asks wait behind
    /// them, and no request comes after: the waiting asks are answered all
    /// the same.
    #[tokio::test]
    async fn a_panicking_batch_fails_its_own_asks_and_the_queue_goes_on() {
        let (open, gate) = tokio::sync::watch::channel(false);
        let b = doubler(shape(SECOND_AT, Duration::from_secs(3600)), &gate);
        let mut failing = vec![ask(&b, 0)];
        settle().await;
        failing.extend((0..SECOND_AT).map(|_| ask(&b, 0)));
        settle().await;
        assert_eq!(b.load(), (0, 2), "both tasks took their batches");
        let waiting: Vec<_> = (1..=5).map(|n| ask(&b, n)).collect();
        settle().await;
        open.send_replace(true);
        for rx in failing {
            let ended = rx.await.unwrap();
            assert_eq!(ended, Err(BatchError::Ended { what: "numbers" }));
        }
        for (n, rx) in (1..=5).zip(waiting) {
            let answer = tokio::time::timeout(Duration::from_secs(5), rx).await;
            assert_eq!(answer.expect("answered, not stranded").unwrap(), Ok(2 * n));
        }
        assert!(b.stopped(Duration::from_secs(5)).await);
        assert_eq!(b.load(), (0, 0), "every task ended and said so");
    }

    /// One task takes the queue while fewer than `second_at` wait behind
    /// its batch; the request that makes `second_at` starts the second.
    #[tokio::test]
    async fn a_second_batch_starts_only_once_enough_wait() {
        let (open, gate) = tokio::sync::watch::channel(false);
        let b = doubler(shape(SECOND_AT, Duration::from_secs(3600)), &gate);
        let first = ask(&b, 0);
        settle().await;
        assert_eq!(tasks(&b), 1);
        let mut waiting: Vec<_> = (1..SECOND_AT as u32).map(|n| (n, ask(&b, n))).collect();
        settle().await;
        assert_eq!(b.load(), (SECOND_AT - 1, 1), "too few wait for a second");
        // The request that makes `second_at` starts a second batch, which
        // answers them all while the first still waits at its gate.
        waiting.push((SECOND_AT as u32, ask(&b, SECOND_AT as u32)));
        answered_beside(waiting, open, first).await;
    }

    /// An ask that has waited `slow` behind a batch that has run as long
    /// starts a batch beside it, though no request comes after.
    #[tokio::test]
    async fn an_ask_that_waits_behind_a_slow_batch_starts_one_beside_it() {
        // Long enough that a busy machine does not make the first batch slow
        // before the second ask is pushed.
        let slow = Duration::from_secs(1);
        let (open, gate) = tokio::sync::watch::channel(false);
        let b = doubler(shape(SECOND_AT, slow), &gate);
        let first = ask(&b, 0);
        settle().await;
        let early = ask(&b, 1);
        settle().await;
        assert_eq!(tasks(&b), 1, "a young batch is waited for");
        answered_beside(vec![(1, early)], open, first).await;
    }

    /// One at a time: a second batch never starts beside the first.
    #[tokio::test]
    async fn one_at_a_time_never_starts_a_second() {
        let (open, gate) = tokio::sync::watch::channel(false);
        let b = doubler(Shape::one_at_a_time("numbers", 8), &gate);
        let first = ask(&b, 0);
        settle().await;
        let waiting: Vec<_> = (1..=20).map(|n| (n, ask(&b, n))).collect();
        settle().await;
        assert_eq!(b.load(), (20, 1));
        open.send_replace(true);
        assert!(first.await.unwrap().is_err());
        for (n, rx) in waiting {
            assert_eq!(rx.await.unwrap(), Ok(2 * n), "in batches of 8 after");
        }
    }

    /// A full queue refuses at once; a stopping batcher refuses new asks
    /// but answers the queued ones, and `stopped` returns once they are.
    #[tokio::test]
    async fn a_full_or_stopping_batcher_refuses_and_answers_what_it_queued() {
        let (open, gate) = tokio::sync::watch::channel(false);
        let mut s = Shape::one_at_a_time("numbers", 4);
        s.max_waiting = 3;
        let b = doubler(s, &gate);
        let first = ask(&b, 0);
        settle().await;
        let queued: Vec<_> = (1..=3).map(|n| (n, ask(&b, n))).collect();
        settle().await;
        let full = b.ask(9).await;
        let want = BatchError::Full {
            what: "numbers",
            waiting: 3,
        };
        assert_eq!(full, Err(want));
        b.stop();
        let refused = b.ask(9).await;
        assert_eq!(refused, Err(BatchError::Stopping { what: "numbers" }));
        assert!(
            !b.stopped(Duration::from_millis(50)).await,
            "a batch still runs"
        );
        open.send_replace(true);
        assert!(b.stopped(Duration::from_secs(5)).await);
        assert!(first.await.unwrap().is_err());
        for (n, rx) in queued {
            assert_eq!(rx.await.unwrap(), Ok(2 * n), "queued before the stop");
        }
    }

    /// A task dropped before it first ran (its runtime shutting down)
    /// takes itself off the count: the next ask starts another.
    #[test]
    fn a_task_that_never_ran_is_not_counted() {
        let (_open, gate) = tokio::sync::watch::channel(true);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let b = rt.block_on(async { doubler(shape(SECOND_AT, Duration::MAX), &gate) });
        // A task spawned on a runtime that shuts down before it runs.
        rt.block_on(async {
            let b2 = b.clone();
            tokio::spawn(async move { b2.ask(1).await });
            tokio::task::yield_now().await;
        });
        drop(rt);
        assert_eq!(b.load().1, 0, "the task that never ran took itself off");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let waiting = b.load().0;
        let answer = rt.block_on(b.ask(2));
        assert_eq!(answer, Ok(4));
        assert!(waiting <= 1);
    }
}
