//! In-memory stand-ins for the ports, for unit tests of the claim engine.
//! They keep the rules that matter (the conditional claim, the unique
//! order index, distinct pops) and nothing else. They add to the
//! integration suite against real servers; they never replace it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use codepool_domain::{Code, CodeId, CodeStatus, Holder, Purchase, SmsRecord};
use codepool_hotpool::{HeldRefill, HotPoolError, RefillLock, Refilled};
use codepool_store::codes::ScanClaim;
use codepool_store::order_ids::{is_internal_key, Bound};
use codepool_store::{CandidateAsk, ClaimAssignment, ClaimWrite, StoreError};

use crate::claim::ClaimError;
use crate::ports::{Candidate, CandidatePool, ClaimStore, Numbering};

pub fn id(n: u64) -> CodeId {
    let mut b = [0u8; 12];
    b[4..].copy_from_slice(&n.to_be_bytes());
    CodeId::from_bytes(b)
}

/// The `codes` collection: conditional claims and a unique order index.
#[derive(Default)]
pub struct FakeStore {
    pub codes: Mutex<Vec<Code>>,
    /// This many `claim_candidates` calls fail as if MongoDB were away.
    pub outages: AtomicUsize,
    /// Read-backs return codes without their holder (corrupt data).
    pub drop_holders: AtomicBool,
    pub scans: AtomicUsize,
    /// Pools whose candidates were queried (refills).
    pub refills: AtomicUsize,
    /// Calls that queried candidates, of one pool or several.
    pub refill_queries: AtomicUsize,
    /// Orders read back by `grants_for_orders`.
    pub read_backs: AtomicUsize,
    /// The order-id guard: the first identity bound to each order id.
    pub bound: Mutex<HashMap<String, Bound>>,
}

impl FakeStore {
    /// A pool of `n` unissued codes with ids and seqs `from..from + n`.
    pub fn with_pool(pool: &str, from: u64, n: u64) -> Self {
        let s = Self::default();
        s.add(pool, from, n);
        s
    }

    pub fn add(&self, pool: &str, from: u64, n: u64) {
        let mut codes = self.codes.lock().unwrap();
        for i in from..from + n {
            codes.push(Code {
                id: id(i),
                pool: pool.into(),
                code: format!("CODE-{i:04}"),
                status: CodeStatus::Unissued,
                seq: i as i64,
                expires_at: None,
                holder: None,
                used_at: None,
                voided_at: None,
                void_reason: None,
                sms: SmsRecord::default(),
            });
        }
    }

    pub fn set_status(&self, code: CodeId, status: CodeStatus) {
        let mut codes = self.codes.lock().unwrap();
        if let Some(c) = codes.iter_mut().find(|c| c.id == code) {
            c.status = status;
        }
    }

    pub fn issued(&self) -> Vec<Code> {
        let codes = self.codes.lock().unwrap();
        codes
            .iter()
            .filter(|c| c.holder.is_some())
            .cloned()
            .collect()
    }

    fn issue(c: &mut Code, a: &ClaimAssignment) {
        c.status = CodeStatus::Issued;
        c.holder = Some(Holder {
            order_id: a.order_id.clone(),
            uid: a.uid.clone(),
            phone: a.phone.clone(),
            issued_at: Utc::now(),
            grant_no: a.grant_no.clone(),
            line: a.line,
            quantity: a.quantity,
            part: a.part,
            owner: None,
            replacement: 0,
        });
    }

    /// Like the unique `(order_id, line)` index.
    fn holds(codes: &[Code], order: &str, line: u32) -> bool {
        codes.iter().any(|c| {
            c.holder
                .as_ref()
                .is_some_and(|h| h.order_id == order && h.line == line)
        })
    }
}

#[async_trait]
impl ClaimStore for FakeStore {
    async fn claim_candidates(&self, claims: &[ClaimAssignment]) -> Result<ClaimWrite, StoreError> {
        if self
            .outages
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(StoreError::Unavailable("fake outage".into()));
        }
        let mut codes = self.codes.lock().unwrap();
        let mut out = ClaimWrite::default();
        let mut granted = HashMap::new();
        let mut lost = false;
        for (k, a) in claims.iter().enumerate() {
            if Self::holds(&codes, &a.order_id, a.line) {
                out.order_taken.push(k);
                continue;
            }
            match codes
                .iter_mut()
                .find(|c| c.id == a.code_id && c.pool == a.pool && c.status == CodeStatus::Unissued)
            {
                Some(c) => {
                    Self::issue(c, a);
                    granted.insert(a.slot(), c.clone());
                }
                None => lost = true,
            }
        }
        // Like the server: a write knows its grants only when every
        // statement it was not refused landed.
        out.granted = (!lost).then_some(granted);
        Ok(out)
    }

    async fn claim_by_scan(
        &self,
        pool: &str,
        claim: &ClaimAssignment,
    ) -> Result<ScanClaim, StoreError> {
        self.scans.fetch_add(1, Ordering::SeqCst);
        let mut codes = self.codes.lock().unwrap();
        if Self::holds(&codes, &claim.order_id, claim.line) {
            return Ok(ScanClaim::OrderAlreadyGranted);
        }
        let oldest = codes
            .iter_mut()
            .filter(|c| c.pool == pool && c.status == CodeStatus::Unissued)
            .min_by_key(|c| c.seq);
        Ok(match oldest {
            Some(c) => {
                Self::issue(c, claim);
                ScanClaim::Granted(Box::new(c.clone()))
            }
            None => ScanClaim::Empty,
        })
    }

    async fn bind_orders(&self, orders: &[Bound]) -> Result<Vec<Bound>, StoreError> {
        let mut bound = self.bound.lock().unwrap();
        Ok(orders
            .iter()
            .map(|o| match is_internal_key(&o.order_id) {
                true => o.clone(),
                false => (bound.entry(o.order_id.clone()))
                    .or_insert_with(|| o.clone())
                    .clone(),
            })
            .collect())
    }

    async fn grants_for_orders(
        &self,
        orders: &[&str],
    ) -> Result<HashMap<String, Vec<Code>>, StoreError> {
        self.read_backs.fetch_add(orders.len(), Ordering::SeqCst);
        let codes = self.codes.lock().unwrap();
        let drop = self.drop_holders.load(Ordering::SeqCst);
        let mut out: HashMap<String, Vec<Code>> = HashMap::new();
        for c in codes.iter() {
            let Some(h) = &c.holder else { continue };
            if orders.contains(&h.order_id.as_str()) {
                let mut c = c.clone();
                if drop {
                    c.holder = None;
                }
                out.entry(h.order_id.clone()).or_default().push(c);
            }
        }
        Ok(out)
    }

    async fn candidates_after_many(
        &self,
        asks: &[CandidateAsk<'_>],
    ) -> Result<Vec<Vec<Candidate>>, StoreError> {
        self.refills.fetch_add(asks.len(), Ordering::SeqCst);
        self.refill_queries.fetch_add(1, Ordering::SeqCst);
        let codes = self.codes.lock().unwrap();
        Ok(asks
            .iter()
            .map(|ask| {
                let mut found: Vec<Candidate> = codes
                    .iter()
                    .filter(|c| {
                        c.pool == ask.pool
                            && c.status == CodeStatus::Unissued
                            && c.seq > ask.after_seq
                    })
                    .map(|c| Candidate {
                        id: c.id,
                        seq: c.seq,
                    })
                    .collect();
                found.sort_by_key(|c| c.seq);
                found.truncate(ask.limit as usize);
                found
            })
            .collect())
    }
}

/// The Redis hot sets: one ordered set per pool, a high-water mark, locks.
#[derive(Default)]
pub struct FakeHot {
    pub sets: Mutex<HashMap<String, BTreeMap<i64, CodeId>>>,
    hwm: Mutex<HashMap<String, i64>>,
    locks: Mutex<HashMap<String, String>>,
    pub down: AtomicBool,
    /// Candidates another refiller loads (with the high-water mark moved
    /// to the last one) just before the next refill lock is taken: what a
    /// claimer that waited for someone else's refill finds.
    pub loaded_meanwhile: Mutex<Vec<Candidate>>,
    /// Pops asked of the set (one per pool per round trip).
    pub pops: AtomicUsize,
}

impl FakeHot {
    fn check(&self) -> Result<(), HotPoolError> {
        if self.down.load(Ordering::SeqCst) {
            Err(HotPoolError::Unavailable("fake outage".into()))
        } else {
            Ok(())
        }
    }

    pub fn len(&self, pool: &str) -> usize {
        self.sets.lock().unwrap().get(pool).map_or(0, BTreeMap::len)
    }

    /// Adds candidates loaded by a refill and raises the high-water mark.
    fn load(&self, pool: &str, candidates: &[Candidate], hwm: i64) {
        self.offer(pool, candidates);
        let mut marks = self.hwm.lock().unwrap();
        let mark = marks.entry(pool.into()).or_default();
        *mark = (*mark).max(hwm);
    }

    /// Offers these candidates directly (a stale set, as after a crash).
    pub fn offer(&self, pool: &str, candidates: &[Candidate]) {
        let mut sets = self.sets.lock().unwrap();
        let set = sets.entry(pool.into()).or_default();
        for c in candidates {
            set.insert(c.seq, c.id);
        }
    }
}

#[async_trait]
impl CandidatePool for FakeHot {
    async fn pop(&self, pool: &str, k: usize) -> Result<(Vec<Candidate>, u64), HotPoolError> {
        self.check()?;
        self.pops.fetch_add(1, Ordering::SeqCst);
        let mut sets = self.sets.lock().unwrap();
        let set = sets.entry(pool.into()).or_default();
        let mut out = Vec::new();
        while out.len() < k {
            let Some((seq, id)) = set.pop_first() else {
                break;
            };
            out.push(Candidate { id, seq });
        }
        Ok((out, set.len() as u64))
    }

    async fn put_back(&self, pool: &str, candidates: &[Candidate]) -> Result<(), HotPoolError> {
        self.check()?;
        self.offer(pool, candidates);
        Ok(())
    }

    async fn remove(&self, pool: &str, ids: &[CodeId]) -> Result<(), HotPoolError> {
        self.check()?;
        if let Some(set) = self.sets.lock().unwrap().get_mut(pool) {
            set.retain(|_, id| !ids.contains(id));
        }
        Ok(())
    }

    async fn lock_refills(
        &self,
        pools: &[&str],
        _ttl: Duration,
    ) -> Result<Vec<Option<HeldRefill>>, HotPoolError> {
        self.check()?;
        let mut out = Vec::with_capacity(pools.len());
        for pool in pools {
            let meanwhile = std::mem::take(&mut *self.loaded_meanwhile.lock().unwrap());
            if let Some(last) = meanwhile.last() {
                self.load(pool, &meanwhile, last.seq);
            }
            if self
                .locks
                .lock()
                .unwrap()
                .insert(pool.to_string(), "t".into())
                .is_some()
            {
                out.push(None);
                continue;
            }
            out.push(Some(HeldRefill {
                lock: RefillLock {
                    key: pool.to_string(),
                    token: "t".into(),
                },
                hwm: self.hwm.lock().unwrap().get(*pool).copied().unwrap_or(0),
                waiting: self.len(pool) as u64,
            }));
        }
        Ok(out)
    }

    async fn finish_refills(&self, fills: Vec<Refilled<Candidate>>) -> Result<(), HotPoolError> {
        self.check()?;
        for f in fills {
            self.load(&f.pool, &f.candidates, f.high_water_mark);
            self.locks.lock().unwrap().remove(&f.lock.key);
        }
        Ok(())
    }

    fn is_degraded(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }
}

/// Grant numbers `G1`, `G2`, … in call order.
#[derive(Default)]
pub struct FakeNumbers(AtomicU64);

impl FakeNumbers {
    /// Numbers handed out so far.
    pub fn issued(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Numbering for FakeNumbers {
    async fn for_purchases(
        &self,
        purchases: &[&Purchase],
    ) -> Result<Vec<Option<String>>, ClaimError> {
        Ok(purchases
            .iter()
            .map(|_| Some(format!("G{}", self.0.fetch_add(1, Ordering::SeqCst) + 1)))
            .collect())
    }
}
