//! The services every door shares, in one place: the store, the intake
//! (placing orders), the outbox (SMS-pending events), the hot pool and the
//! broker connection in use. The HTTP API and the console hold the same
//! [`Core`]; neither holds the other's state.

use std::sync::{Arc, RwLock};

use codepool_broker::Publisher;
use codepool_store::Store;

use crate::intake::Intake;
use crate::outbox::Outbox;
use crate::ports::CandidatePool;

/// A broker connection and the confirm-mode publisher on it.
#[derive(Clone)]
pub struct Broker {
    pub conn: Arc<lapin::Connection>,
    pub publisher: Publisher,
}

/// What every door's handlers share.
pub struct Core {
    store: Store,
    intake: Intake,
    outbox: Outbox,
    /// The hot pool, which a recall or a void clears of the codes it
    /// voids.
    hot: Arc<dyn CandidatePool>,
    /// Replaced after an outage ([`Core::set_broker`]).
    broker: RwLock<Broker>,
}

impl Core {
    pub fn new(
        store: Store,
        intake: Intake,
        hot: Arc<dyn CandidatePool>,
        conn: Arc<lapin::Connection>,
        publisher: Publisher,
    ) -> Arc<Self> {
        Arc::new(Self {
            outbox: Outbox::new(Arc::new(store.clone())),
            store,
            intake,
            hot,
            broker: RwLock::new(Broker { conn, publisher }),
        })
    }

    /// The store every door shares.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The intake (known pool, conflicting order, pause, limit, claim).
    pub fn intake(&self) -> &Intake {
        &self.intake
    }

    /// The outbox that sends SMS-pending events and marks them sent.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// The hot pool (a recall clears the codes it voids from it).
    pub fn hot(&self) -> &Arc<dyn CandidatePool> {
        &self.hot
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
