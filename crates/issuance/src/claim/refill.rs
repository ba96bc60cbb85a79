//! Refilling the hot sets: how many candidates a pool's set loads (twice
//! its recent demand, within bounds), when (a claimer that finds it short,
//! or in the background below the low-water mark), and how many pools at
//! once (a batch refills its short pools together, each read bounded by
//! its own window). Redis only offers candidates: the claim (mod.rs) is
//! decided by MongoDB whatever a refill loads.

use std::time::{Duration, Instant};

use codepool_hotpool::{HeldRefill, HotPoolError, Refilled};
use codepool_store::{CandidateAsk, StoreError};
use tracing::debug;

use super::{stage, ClaimEngine, Dry};
use crate::ports::Candidate;

impl ClaimEngine {
    /// How many candidates a refill of `pool` loads: twice its recent
    /// demand per second, within `[min_refill, refill_batch]`, and at least
    /// what a waiting claimer needs. A pool that sells little keeps a small
    /// hot set; a busy one a set of a few seconds.
    pub(super) fn refill_size(&self, pool: &str, needed: usize) -> i64 {
        let max = self.config.refill_batch.max(1);
        let min = self.config.min_refill.clamp(1, max);
        let wanted = (2.0 * self.demand.per_sec(pool)).ceil() as i64;
        wanted.clamp(min, max).max(needed as i64)
    }

    /// Below this many candidates, `pool`'s set is topped up: the
    /// configured low-water mark, or half a refill if less.
    pub(super) fn low_water(&self, pool: &str) -> u64 {
        self.config
            .low_water
            .min(self.refill_size(pool, 0) as u64 / 2)
    }

    /// Tops the hot set up without making anyone wait. Skipped after any
    /// refill reached the end of the pool (found fewer than it asked for):
    /// the set then holds every candidate there is, and a pool that is
    /// fully loaded, or empty, costs no queries until new codes arrive
    /// ([`ClaimEngine::replenished`]) or [`DRY_BACKOFF`] has passed. A
    /// claimer that runs out still refills at once.
    pub(super) fn refill_in_background(&self, pool: &str) {
        if let Ok(mut dry) = self.dry.lock() {
            if dry.get(pool).is_some_and(Dry::recent) {
                metrics::counter!("codepool_refill_dry_skips_total").increment(1);
                return;
            }
            dry.remove(pool);
        }
        let engine = self.clone();
        let pool = pool.to_owned();
        tokio::spawn(async move {
            let started = Instant::now();
            let _ = engine.top_up(&pool).await;
            stage("background", started);
            metrics::counter!("codepool_refill_pools_total", "path" => "background").increment(1);
        });
    }

    /// Loads the next candidates of `pool` into its hot set: codes after
    /// the high-water mark, or, once the end is reached, a rescan from the
    /// start (which picks up candidates lost by crashed claimers). One
    /// refiller per pool at a time; the others get [`Refill::Busy`].
    pub async fn refill(&self, pool: &str) -> Result<Refill, RefillError> {
        let (refill, _) = self
            .refill_one(RefillAsk {
                pool,
                size: self.refill_size(pool, 0),
                enough: None,
                rescan: true,
                keep: 0,
            })
            .await?;
        Ok(refill)
    }

    /// [`ClaimEngine::refill`] for a claimer that needs `needed` more: none
    /// if the set holds that many by the time the lock is taken (a refill
    /// by another claimer, which this one waited for, already loaded them).
    /// The candidates it loaded for the claimer come with it.
    pub(super) async fn refill_for(
        &self,
        pool: &str,
        needed: usize,
    ) -> Result<(Refill, Vec<Candidate>), RefillError> {
        self.refill_one(self.ask_for(pool, needed)).await
    }

    pub(super) fn ask_for<'p>(&self, pool: &'p str, needed: usize) -> RefillAsk<'p> {
        RefillAsk {
            pool,
            size: self.refill_size(pool, needed),
            enough: Some(needed as u64),
            rescan: true,
            keep: needed,
        }
    }

    /// A refill that only moves forward past the high-water mark: for
    /// topping up in the background, where a rescan would re-add codes that
    /// other claimers hold right now. None if another top-up has already
    /// lifted the set above the low-water mark.
    pub(super) async fn top_up(&self, pool: &str) -> Result<Refill, RefillError> {
        let (refill, _) = self
            .refill_one(RefillAsk {
                pool,
                size: self.refill_size(pool, 0),
                enough: Some(self.low_water(pool)),
                rescan: false,
                keep: 0,
            })
            .await?;
        Ok(refill)
    }

    /// Lets background top-ups of `pool` run again: codes were imported
    /// into it (`pool.replenished`), so a set that held every candidate
    /// there was may now be short of new ones.
    pub fn replenished(&self, pool: &str) {
        if let Ok(mut dry) = self.dry.lock() {
            dry.remove(pool);
        }
    }

    pub(super) async fn refill_one(
        &self,
        ask: RefillAsk<'_>,
    ) -> Result<(Refill, Vec<Candidate>), RefillError> {
        let mut done = self.refill_pools(&[ask]).await?;
        Ok(done.pop().unwrap_or((Refill::Busy, Vec::new())))
    }

    /// Refills the pools of a batch that came up short, together, taking
    /// what each still needs from its load (or, where another refill had
    /// just stocked the set, popping it). A pool still short after this (its lock
    /// was busy, or a server failed) is left to [`ClaimEngine::complete`],
    /// which retries it alone. Returns, aligned with `wants`, which pools
    /// the refill found without a single candidate.
    pub(super) async fn refill_short(
        &self,
        wants: &[(&str, usize)],
        popped: &mut [(Vec<Candidate>, u64)],
    ) -> Vec<bool> {
        let mut empty = vec![false; wants.len()];
        let short: Vec<(usize, usize)> = wants
            .iter()
            .zip(popped.iter())
            .enumerate()
            .map(|(i, ((_, k), (got, _)))| (i, k.saturating_sub(got.len())))
            .filter(|&(_, needed)| needed > 0)
            .collect();
        if short.is_empty() {
            return empty;
        }
        let asks: Vec<RefillAsk> = short
            .iter()
            .map(|&(i, needed)| self.ask_for(wants[i].0, needed))
            .collect();
        metrics::counter!("codepool_refill_pools_total", "path" => "batch")
            .increment(asks.len() as u64);
        let refills = match self.refill_pools(&asks).await {
            Ok(r) => r,
            Err(e) => {
                debug!(error = %e, pools = asks.len(), "refill of short pools failed; retrying them one by one");
                return empty;
            }
        };
        let mut again: Vec<(usize, (&str, usize))> = Vec::new();
        for (&(i, needed), (refill, kept)) in short.iter().zip(refills) {
            empty[i] = refill == Refill::Added(0);
            match refill {
                Refill::Stocked => again.push((i, (wants[i].0, needed))),
                Refill::Added(n) => {
                    // The set holds the rest of the load (the count only
                    // decides a background top-up).
                    let installed = n - kept.len();
                    let still = needed - kept.len();
                    popped[i].1 = installed as u64;
                    popped[i].0.extend(kept);
                    if still > 0 && installed > 0 {
                        again.push((i, (wants[i].0, still)));
                    }
                }
                Refill::Busy => {}
            }
        }
        if again.is_empty() {
            return empty;
        }
        let wants_again: Vec<(&str, usize)> = again.iter().map(|(_, w)| *w).collect();
        let Ok(more) = self.hot.pop_many(&wants_again).await else {
            return empty;
        };
        for ((i, _), (got, left)) in again.into_iter().zip(more) {
            popped[i].0.extend(got);
            popped[i].1 = left;
        }
        empty
    }

    /// Refills the hot sets of several pools in four round trips whatever
    /// their number: their locks and states (Redis), their candidates (one
    /// MongoDB query, plus one for pools that rescan), and the loaded
    /// candidates with each lock's release (Redis). Results are aligned
    /// with `asks`; a pool whose lock someone else holds is
    /// [`Refill::Busy`]. Every lock taken here is released, also on error.
    /// Each result comes with the candidates its ask keeps (see
    /// [`RefillAsk::keep`]): only from a set that was empty when locked,
    /// so a load that reads the pool from the start does not hand the
    /// claimer a candidate the set still offers.
    pub(super) async fn refill_pools(
        &self,
        asks: &[RefillAsk<'_>],
    ) -> Result<Vec<(Refill, Vec<Candidate>)>, RefillError> {
        let pools: Vec<&str> = asks.iter().map(|a| a.pool).collect();
        let started = Instant::now();
        let held = self
            .hot
            .lock_refills(&pools, self.config.refill_lock_ttl)
            .await;
        stage("refill_lock", started);
        let held = held?;
        let mut out: Vec<(Refill, Vec<Candidate>)> =
            asks.iter().map(|_| (Refill::Busy, Vec::new())).collect();
        let mut fills = Vec::new();
        let mut loading = Vec::new();
        for (i, (ask, held)) in asks.iter().zip(held).enumerate() {
            let Some(held) = held else { continue };
            if ask.enough.is_some_and(|n| held.waiting >= n.max(1)) {
                out[i].0 = Refill::Stocked;
                fills.push(Refilled::release(ask.pool, held.lock));
            } else {
                loading.push((i, held));
            }
        }
        let found = match self.load_candidates(asks, &loading).await {
            Ok(found) => found,
            Err(e) => {
                fills.extend(
                    loading
                        .into_iter()
                        .map(|(i, held)| Refilled::release(asks[i].pool, held.lock)),
                );
                let _ = self.hot.finish_refills(fills).await;
                return Err(e.into());
            }
        };
        // Per pool loaded: whether the load reached its end, and found nothing.
        let mut loaded = Vec::new();
        for ((i, held), mut candidates) in loading.into_iter().zip(found) {
            let ask = &asks[i];
            // Fewer than asked: the end of the pool, the set (and the
            // claimer) hold every candidate there is.
            let ended = (candidates.len() as i64) < ask.size;
            loaded.push((ask.pool, ended, candidates.is_empty()));
            debug!(
                pool = ask.pool,
                added = candidates.len(),
                "hot pool refilled"
            );
            let high_water_mark = candidates.iter().map(|c| c.seq).fold(held.hwm, i64::max);
            // Oldest first: the caller's share is the front.
            let keep = if held.waiting == 0 { ask.keep } else { 0 };
            let rest = candidates.split_off(keep.min(candidates.len()));
            out[i] = (Refill::Added(candidates.len() + rest.len()), candidates);
            let candidates = rest;
            fills.push(Refilled {
                pool: ask.pool.to_owned(),
                candidates,
                high_water_mark,
                lock: held.lock,
            });
        }
        let started = Instant::now();
        let finished = self.hot.finish_refills(fills).await;
        stage("refill_finish", started);
        finished?;
        self.mark_dry(&loaded);
        Ok(out)
    }

    /// Records, per pool loaded (`pool`, reached its end, found nothing),
    /// which pools ran dry: their background refills pause
    /// ([`DRY_BACKOFF`]).
    fn mark_dry(&self, loaded: &[(&str, bool, bool)]) {
        let Ok(mut dry) = self.dry.lock() else {
            return;
        };
        let at = Instant::now();
        for &(pool, ended, empty) in loaded {
            if ended {
                let what = if empty { "empty" } else { "ended" };
                metrics::counter!("codepool_refill_dry_total", "what" => what).increment(1);
                dry.insert(pool.to_owned(), Dry { at, empty });
            } else if let Some(d) = dry.get_mut(pool) {
                // Codes were found: the pool is not sold out.
                d.empty = false;
            }
        }
    }

    /// The candidates of each pool being loaded: codes past its high-water
    /// mark, or, for a pool that has none there and may rescan, from the
    /// start. Aligned with `loading`.
    pub(super) async fn load_candidates(
        &self,
        asks: &[RefillAsk<'_>],
        loading: &[(usize, HeldRefill)],
    ) -> Result<Vec<Vec<Candidate>>, StoreError> {
        if loading.is_empty() {
            return Ok(Vec::new());
        }
        let first: Vec<CandidateAsk> = loading
            .iter()
            .map(|(i, held)| CandidateAsk {
                pool: asks[*i].pool,
                after_seq: held.hwm,
                limit: asks[*i].size,
            })
            .collect();
        let started = Instant::now();
        let found = self.store.candidates_after_many(&first).await;
        stage("candidates_query", started);
        let mut found = found?;
        let rescan: Vec<usize> = (0..first.len())
            .filter(|&k| found[k].is_empty() && first[k].after_seq > 0 && asks[loading[k].0].rescan)
            .collect();
        if !rescan.is_empty() {
            let from_start: Vec<CandidateAsk> = rescan
                .iter()
                .map(|&k| CandidateAsk {
                    after_seq: 0,
                    ..first[k]
                })
                .collect();
            let started = Instant::now();
            let again = self.store.candidates_after_many(&from_start).await;
            stage("candidates_rescan", started);
            let again = again?;
            for (k, codes) in rescan.into_iter().zip(again) {
                found[k] = codes;
            }
        }
        Ok(found)
    }
}

/// What a refill did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refill {
    /// This many candidates were loaded (0: the pool has none left),
    /// counting those handed to the claimer rather than the set.
    Added(usize),
    /// None were needed: by the time the lock was taken, the set held
    /// enough (another refill, which this one waited for, loaded them).
    Stocked,
    /// Another claimer is refilling this pool right now.
    Busy,
}

/// One pool's part of [`ClaimEngine::refill_pools`].
#[derive(Debug, Clone, Copy)]
pub(super) struct RefillAsk<'a> {
    pub(super) pool: &'a str,
    /// Candidates to load.
    pub(super) size: i64,
    /// Load none if the set holds this many when the lock is taken.
    pub(super) enough: Option<u64>,
    /// With nothing past the high-water mark, read the pool from the start.
    pub(super) rescan: bool,
    /// Of the candidates loaded, the oldest this many go to the caller
    /// instead of the set: a claimer that found the set short takes them
    /// without popping them again.
    pub(super) keep: usize,
}

/// Pools whose hot sets are refilled at once when a batch finds them short.
pub(super) const PARALLEL_REFILLS: usize = 16;

/// After a refill reaches the end of a pool, background refills of that
/// pool pause this long, or until `pool.replenished` says codes arrived.
/// Only a safety net for a lost event: a claimer that finds the set empty
/// refills at once whatever this says.
pub(super) const DRY_BACKOFF: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum RefillError {
    #[error(transparent)]
    Redis(#[from] HotPoolError),
    #[error(transparent)]
    Store(#[from] StoreError),
}
