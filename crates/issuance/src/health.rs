//! What `/healthz` and `/readyz` report: the daemon's own view of its
//! dependencies, updated as it talks to them.

use std::sync::atomic::{AtomicBool, Ordering};

/// Reachability of each dependency, as last observed.
#[derive(Debug, Default)]
pub struct Health {
    mongo: AtomicBool,
    amqp: AtomicBool,
    redis_degraded: AtomicBool,
    keys_missing: AtomicBool,
}

impl Health {
    pub fn set_mongo(&self, up: bool) {
        self.mongo.store(up, Ordering::Relaxed);
        self.export_ready();
    }

    pub fn set_amqp(&self, up: bool) {
        self.amqp.store(up, Ordering::Relaxed);
        self.export_ready();
    }

    /// `codepool_ready`: what `/readyz` answers, for alerting on.
    fn export_ready(&self) {
        metrics::gauge!("codepool_ready").set(if self.ready() { 1.0 } else { 0.0 });
    }

    /// The key file lacks a key codes are sealed with: unready.
    pub fn set_keys_missing(&self, missing: bool) {
        self.keys_missing.store(missing, Ordering::Relaxed);
        self.export_ready();
    }

    pub fn keys_missing(&self) -> bool {
        self.keys_missing.load(Ordering::Relaxed)
    }

    pub fn set_redis_degraded(&self, degraded: bool) {
        self.redis_degraded.store(degraded, Ordering::Relaxed);
        metrics::gauge!("codepool_redis_fallback_active").set(if degraded { 1.0 } else { 0.0 });
    }

    pub fn mongo(&self) -> bool {
        self.mongo.load(Ordering::Relaxed)
    }

    pub fn amqp(&self) -> bool {
        self.amqp.load(Ordering::Relaxed)
    }

    pub fn redis_degraded(&self) -> bool {
        self.redis_degraded.load(Ordering::Relaxed)
    }

    /// Ready to take purchases: MongoDB and RabbitMQ reachable. Redis down
    /// is degraded (slower claims), still ready.
    pub fn ready(&self) -> bool {
        self.mongo() && self.amqp() && !self.keys_missing()
    }
}
