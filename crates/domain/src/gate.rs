//! The gate: every move of a code, and the rules about who may get one,
//! stated once.
//!
//! A code moves between the statuses of [`CodeStatus`] by the named
//! [`Move`]s below. Whatever door a request came in by (AMQP, HTTP, the
//! console, the CLI) and whatever path gives a buyer a code (stock, a paid
//! hold, a bundle, a backorder), the guards of [`admit`] decide whether a
//! move that hands a code to someone may happen. A refusal is a value
//! ([`Refused`]), never prose: each door renders its own words.
//!
//! The store writes each move as one conditional update whose condition is
//! the move's `from` statuses plus, for a move that hands a code out, the
//! code's own guards (not expired). Its expiry and recall are moves too:
//! both also take codes out of live holds, so a held code never outlives
//! the rule that voided its stock.

use crate::{CodeStatus, PoolPolicy};

/// One move of a code. Every path that changes a code's status is one of
/// these, and nothing else changes a status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Move {
    /// An order receives an unissued code from stock.
    Claim,
    /// A checkout hold (or a bundle being put together) sets a code aside.
    Hold,
    /// A paid hold's code becomes its order's.
    Commit,
    /// A whole bundle's held codes become its order's.
    BundleCommit,
    /// A waiting order (backorder) receives a code after an import.
    Fulfil,
    /// A hold ends unpaid (released, expired, short): its code goes back.
    Release,
    /// An unissued or held code passed its `expires_at`.
    Expire,
    /// The import the code came in by was recalled (a leak).
    Recall,
    /// An operator voided the code (refund, leak).
    Void,
    /// The buyer used the code.
    Redeem,
    /// Support replaced a code that failed: the old one is void.
    Replace,
    /// The line whose code was replaced receives a fresh code from stock
    /// (at once, or once stock comes in). It gives a code, so the guards
    /// apply and a pause stops it (the line waits); it takes no per-user
    /// slot ([`Move::takes_slot`]): the order holds its own, and a
    /// replacement is not a second purchase.
    Reissue,
}

impl Move {
    pub const ALL: [Move; 12] = [
        Self::Claim,
        Self::Hold,
        Self::Commit,
        Self::BundleCommit,
        Self::Fulfil,
        Self::Release,
        Self::Expire,
        Self::Recall,
        Self::Void,
        Self::Redeem,
        Self::Replace,
        Self::Reissue,
    ];

    /// The statuses this move starts from.
    pub fn from(self) -> &'static [CodeStatus] {
        use CodeStatus::*;
        match self {
            Self::Claim | Self::Hold | Self::Fulfil | Self::Reissue => &[Unissued],
            Self::Commit | Self::BundleCommit | Self::Release => &[Held],
            // A code that can no longer be handed out leaves stock AND
            // every live hold: the hold's payment then takes another code.
            Self::Expire | Self::Recall => &[Unissued, Held],
            Self::Void => &[Unissued, Issued],
            Self::Redeem => &[Issued],
            Self::Replace => &[Issued],
        }
    }

    /// The status it ends in.
    pub fn to(self) -> CodeStatus {
        match self {
            Self::Claim | Self::Commit | Self::BundleCommit | Self::Fulfil | Self::Reissue => {
                CodeStatus::Issued
            }
            Self::Hold => CodeStatus::Held,
            Self::Release => CodeStatus::Unissued,
            Self::Expire | Self::Recall | Self::Void | Self::Replace => CodeStatus::Void,
            Self::Redeem => CodeStatus::Used,
        }
    }

    /// [`Move::from`] as the integers stored in MongoDB.
    pub fn from_codes(self) -> Vec<i32> {
        self.from().iter().map(|s| s.as_i32()).collect()
    }

    /// Whether this move hands a code to a buyer (or sets one aside for
    /// one): the moves the guards of [`admit`] apply to.
    pub fn gives(self) -> bool {
        matches!(
            self,
            Self::Claim
                | Self::Hold
                | Self::Commit
                | Self::BundleCommit
                | Self::Fulfil
                | Self::Reissue
        )
    }

    /// Whether this move counts against the buyer's per-user limit: every
    /// move that gives a code but a reissue, whose order took its slot
    /// when it was placed (a replacement is not a second purchase).
    pub fn takes_slot(self) -> bool {
        self.gives() && self != Self::Reissue
    }

    /// What a pause means for this move, stated once: a paused pool hands
    /// no code to anyone, held or not. Its orders wait; a paid hold of a
    /// paused pool is bound to the order that paid it, its codes go back
    /// to stock, and the order waits with the others. Moves that take a
    /// code away from buyers (expiry, recall, void, release) and the
    /// buyer's own use (redeem) go on.
    pub fn stopped_by_pause(self) -> bool {
        self.gives()
    }
}

/// A checkout hold's state: held, then ended once, as committed (paid),
/// released or expired. Stored by these names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HoldState {
    /// Its codes are held.
    Held,
    /// Paid: its codes are an order's.
    Committed,
    /// Released by its owner before it expired (or bound to an order that
    /// paid it while its pool was paused, or refused by a per-user limit).
    Released,
    /// Expired unpaid.
    Expired,
}

impl HoldState {
    pub const ALL: [HoldState; 4] = [Self::Held, Self::Committed, Self::Released, Self::Expired];

    /// The name stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::Committed => "committed",
            Self::Released => "released",
            Self::Expired => "expired",
        }
    }
}

impl std::fmt::Display for HoldState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a held hold ends: the states it can end in, and no other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HoldEnd {
    /// Paid: its codes are an order's.
    Committed,
    /// Released by its owner, or bound to an order that could not take it.
    Released,
    /// Expired unpaid.
    Expired,
}

impl HoldEnd {
    /// The state the hold is left in.
    pub fn state(self) -> HoldState {
        match self {
            Self::Committed => HoldState::Committed,
            Self::Released => HoldState::Released,
            Self::Expired => HoldState::Expired,
        }
    }
}

/// Why the gate refused a move. The code stays where it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The pool is paused: nothing leaves it.
    Paused { pool: String },
    /// The buyer's per-user limit of the pool, holds counted.
    PerUserLimit { pool: String, limit: u32 },
    /// The actor is not the one who may pay or act on this hold or order
    /// (another key, another shop, or a shop's hold paid without it).
    NotTheOwner,
    /// The buyer, items or kind differ from the hold's.
    NotThisHold,
}

/// Who acts on a hold or an order: the owner recorded on it (`shop:NAME`
/// for a shop's, `api-key-id:ID` for a key's, none for the operator's),
/// and the payer's.
///
/// A shop's hold is paid only by that shop's orders, whichever door they
/// come by. A key's hold is paid by the same key, or by the operator's own
/// backend (an AMQP purchase that names no shop). The operator's hold
/// (no owner) is paid by anyone the operator lets order.
pub fn may_pay(hold_owner: Option<&str>, payer: Option<&str>) -> bool {
    match (hold_owner, payer) {
        (h, p) if h == p => true,
        (Some(h), _) if h.starts_with(crate::SHOP_OWNER_PREFIX) => false,
        (_, None) => true,
        (None, Some(_)) => true,
        (Some(_), Some(_)) => false,
    }
}

/// What the gate knows of a move that gives codes out of one pool.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub pool: &'a str,
    pub policy: PoolPolicy,
    /// Whether the buyer has (or just took) a per-user slot for these
    /// codes; `None` when the pool has no per-user limit.
    pub slot: Option<bool>,
}

/// The guards of a move that gives codes: the pool's pause, then the
/// buyer's per-user limit (for the moves that take a slot). Expiry and recall are guards of the code
/// itself, checked by the store in the same conditional write that moves
/// it (see [`Move::from`]): no other read can race them.
pub fn admit(mv: Move, ask: &Ask<'_>) -> Result<(), Refused> {
    if !mv.gives() {
        return Ok(());
    }
    if mv.stopped_by_pause() && ask.policy.paused {
        return Err(Refused::Paused {
            pool: ask.pool.to_owned(),
        });
    }
    if mv.takes_slot() && ask.policy.limits_users() && ask.slot == Some(false) {
        return Err(Refused::PerUserLimit {
            pool: ask.pool.to_owned(),
            limit: ask.policy.per_user,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_move_that_gives_a_code_starts_from_stock_or_a_hold() {
        for mv in Move::ALL {
            if mv.gives() {
                assert!(
                    mv.from()
                        .iter()
                        .all(|s| matches!(s, CodeStatus::Unissued | CodeStatus::Held)),
                    "{mv:?}"
                );
            }
        }
    }

    #[test]
    fn expiry_and_recall_reach_into_live_holds() {
        for mv in [Move::Expire, Move::Recall] {
            assert!(mv.from().contains(&CodeStatus::Held), "{mv:?}");
            assert_eq!(mv.to(), CodeStatus::Void);
        }
    }

    #[test]
    fn a_pause_stops_every_move_that_gives_and_no_other() {
        let paused = PoolPolicy {
            per_user: 0,
            paused: true,
        };
        for mv in Move::ALL {
            let r = admit(
                mv,
                &Ask {
                    pool: "p",
                    policy: paused,
                    slot: None,
                },
            );
            assert_eq!(r.is_err(), mv.gives(), "{mv:?}");
        }
    }

    #[test]
    fn a_missing_slot_refuses_with_the_limit() {
        let limited = PoolPolicy {
            per_user: 1,
            paused: false,
        };
        let ask = |slot| Ask {
            pool: "p",
            policy: limited,
            slot,
        };
        assert_eq!(
            admit(Move::Commit, &ask(Some(false))),
            Err(Refused::PerUserLimit {
                pool: "p".into(),
                limit: 1
            })
        );
        assert_eq!(admit(Move::Commit, &ask(Some(true))), Ok(()));
    }

    #[test]
    fn a_reissue_is_stopped_by_a_pause_but_takes_no_per_user_slot() {
        let policy = |paused| PoolPolicy {
            per_user: 1,
            paused,
        };
        let ask = |paused| Ask {
            pool: "p",
            policy: policy(paused),
            slot: Some(false),
        };
        assert_eq!(admit(Move::Reissue, &ask(false)), Ok(()));
        assert!(matches!(
            admit(Move::Reissue, &ask(true)),
            Err(Refused::Paused { .. })
        ));
        assert!(!Move::Reissue.takes_slot() && Move::Claim.takes_slot());
        assert_eq!(Move::Reissue.from(), &[CodeStatus::Unissued]);
        assert_eq!(Move::Replace.to(), CodeStatus::Void);
    }

    #[test]
    fn hold_states_keep_their_stored_names() {
        for s in HoldState::ALL {
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.as_str()));
            assert_eq!(serde_json::from_str::<HoldState>(&json).unwrap(), s);
        }
    }

    #[test]
    fn a_shops_hold_is_paid_only_by_that_shop() {
        assert!(may_pay(Some("shop:a"), Some("shop:a")));
        assert!(!may_pay(Some("shop:a"), Some("shop:b")));
        assert!(!may_pay(Some("shop:a"), None));
        assert!(!may_pay(Some("shop:a"), Some("api-key-id:k")));
        assert!(may_pay(Some("api-key-id:k"), Some("api-key-id:k")));
        assert!(may_pay(Some("api-key-id:k"), None));
        assert!(!may_pay(Some("api-key-id:k"), Some("api-key-id:j")));
        assert!(!may_pay(Some("api-key-id:k"), Some("shop:a")));
        assert!(may_pay(None, None));
    }
}
