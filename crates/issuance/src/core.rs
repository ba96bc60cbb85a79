//! The services every door shares, in one place: the process's [`Parts`]
//! (the store, the intake that places orders, the outbox, the hot pool,
//! the stock watch) and the broker connection in use. The HTTP API and
//! the console hold the same [`Core`]; neither holds the other's state.
//! The dispatcher holds the same [`Parts`] with its own sessions. The
//! doors read and change what the store keeps only through the views and
//! operations of [`crate::doors`]: the store is not theirs to hold.

use std::sync::{Arc, RwLock};

use codepool_broker::Publisher;
use codepool_store::Store;

use crate::background::Parts;
use crate::intake::Intake;
use crate::outbox::Outbox;
use crate::ports::CandidatePool;
use crate::stock::StockWatch;
use crate::webhooks::guard::AllowHosts;

/// A broker connection and the confirm-mode publisher on it.
#[derive(Clone)]
pub struct Broker {
    pub conn: Arc<lapin::Connection>,
    pub publisher: Publisher,
}

/// What every door's handlers share.
pub struct Core {
    parts: Parts,
    /// Replaced after an outage ([`Core::set_broker`]).
    broker: RwLock<Broker>,
}

impl Core {
    pub fn new(parts: Parts, conn: Arc<lapin::Connection>, publisher: Publisher) -> Arc<Self> {
        Arc::new(Self {
            parts,
            broker: RwLock::new(Broker { conn, publisher }),
        })
    }

    /// The services this core was built from (the background work takes
    /// them: [`crate::background::start`]).
    pub fn parts(&self) -> &Parts {
        &self.parts
    }

    /// The store behind the views and operations the doors call
    /// ([`crate::doors`]); no door holds it.
    pub(crate) fn store(&self) -> &Store {
        &self.parts.store
    }

    /// The intake (known pool, conflicting order, pause, limit, claim).
    pub fn intake(&self) -> &Intake {
        &self.parts.intake
    }

    /// The outbox that sends SMS-pending events and marks them sent.
    pub fn outbox(&self) -> &Outbox {
        &self.parts.outbox
    }

    /// Stock checks after grants ([`crate::placing::account`]).
    pub fn stock(&self) -> &Arc<StockWatch> {
        &self.parts.stock
    }

    /// The hot pool (a recall clears the codes it voids from it).
    pub fn hot(&self) -> &Arc<dyn CandidatePool> {
        &self.parts.hot
    }

    /// Webhook hosts let through whatever their address.
    pub fn allow_hosts(&self) -> &AllowHosts {
        &self.parts.allow_hosts
    }

    /// The broker connection and publisher in use now.
    pub fn broker(&self) -> Broker {
        self.broker
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Puts a new connection and publisher in use (after an outage).
    pub fn set_broker(&self, broker: Broker) {
        *self.broker.write().unwrap_or_else(|e| e.into_inner()) = broker;
    }
}
