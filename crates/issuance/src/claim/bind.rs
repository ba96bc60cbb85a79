//! The order-id guard seen from the claim: an order's identity as
//! [`codepool_store::order_ids`] keeps it, and whether a purchase is the
//! order its id is bound to.

use codepool_domain::Purchase;
use codepool_store::order_ids::Bound;

/// The identity `p` binds its order id to: what a copy of the same order
/// repeats and a different order under that id does not.
pub(crate) fn bound_of(p: &Purchase) -> Bound {
    Bound {
        order_id: p.order_id.clone(),
        pool: p.pool.clone(),
        uid: p.uid.clone(),
        quantity: p.quantity,
        owner: p.owner.clone(),
        items: p.items(),
    }
}

/// Why `p` is not the order its id is bound to (`b`), if it is not: the
/// field that differs, as a conflict names it. An id bound from the codes
/// of an order placed before the guard has no items to compare: its
/// codes' pools are compared line by line, as before.
pub(crate) fn refused_by(p: &Purchase, b: &Bound) -> Option<&'static str> {
    p.conflicts_with(&b.pool, &b.uid, b.quantity, b.owner.as_deref())
        .or_else(|| (!b.items.is_empty() && p.items() != b.items).then_some("items (pool)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use codepool_domain::Item;

    fn order(pool: &str) -> Purchase {
        Purchase {
            order_id: "o-1".into(),
            uid: "u".into(),
            phone: "+15550000001".into(),
            pool: pool.into(),
            purchased_at: None,
            quantity: 2,
            owner: None,
            shop: None,
            hold_id: None,
            items: Vec::new(),
        }
    }

    /// A bundle of one code of pool `a` and one of pool `b`.
    fn bundle_of_a_and_b() -> Purchase {
        let mut p = order("a");
        p.items = ["a", "b"]
            .map(|pool| Item {
                pool: pool.into(),
                quantity: 1,
            })
            .to_vec();
        p
    }

    #[test]
    fn a_copy_is_its_order_and_another_pool_is_not() {
        let first = order("a");
        let b = bound_of(&first);
        assert_eq!(refused_by(&first, &b), None);
        assert_eq!(refused_by(&order("b"), &b), Some("pool"));
    }

    #[test]
    fn an_order_of_one_pool_is_not_a_bundle_of_the_same_size() {
        let plain = order("a");
        let bundle = bundle_of_a_and_b();
        assert_eq!(refused_by(&bundle, &bound_of(&plain)), Some("items (pool)"));
        assert_eq!(refused_by(&plain, &bound_of(&bundle)), Some("items (pool)"));
    }

    #[test]
    fn a_bundle_split_otherwise_is_another_order() {
        let one = bundle_of_a_and_b();
        let mut two = one.clone();
        two.items[1].pool = "c".into();
        assert_eq!(refused_by(&two, &bound_of(&one)), Some("items (pool)"));
        assert_eq!(refused_by(&one, &bound_of(&one)), None);
    }
}
