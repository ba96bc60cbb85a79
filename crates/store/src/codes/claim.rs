//! The claim: the one journaled `update` that hands candidates to the lines of orders (built below), its reply read as wins and strays, the scan that claims in MongoDB alone, and what orders already hold.

use super::*;

pub(crate) fn issue_set(a: &ClaimAssignment, now: DateTime) -> Document {
    crate::moves::holder_update(a.mv, now, holder_doc(a))
}

/// The fields [`holder_fields`] sets, as a document.
pub(crate) fn holder_doc(a: &ClaimAssignment) -> Document {
    holder_fields(a)
        .into_iter()
        .filter(|(_, value)| *value != Bson::Null)
        .map(|(field, value)| (field.to_owned(), value))
        .collect()
}

/// What a claim records of its holder, field by field; `Null` for a field
/// the claim leaves unset (no grant number; no relay owed; line 0 of an
/// order of one, as every code was before quantities). The one list both
/// claim writes ([`issue_set`], [`claim_statement`]) take their fields
/// from.
pub(crate) fn holder_fields(a: &ClaimAssignment) -> [(&'static str, Bson); 10] {
    let unless = |n: u32, default: u32| {
        if n == default {
            Bson::Null
        } else {
            Bson::Int64(i64::from(n))
        }
    };
    [
        ("order_id", Bson::String(a.order_id.clone())),
        ("uid", Bson::String(a.uid.clone())),
        ("phone", Bson::String(a.phone.clone())),
        (
            "grant_no",
            a.grant_no.clone().map_or(Bson::Null, Bson::String),
        ),
        (
            "sms_pending",
            if a.resend.relays() {
                Bson::Boolean(true)
            } else {
                Bson::Null
            },
        ),
        (
            "hook_pending",
            if a.resend.owes_hook()
                && a.owner
                    .as_deref()
                    .is_some_and(|o| o.starts_with(SHOP_OWNER_PREFIX))
            {
                Bson::Boolean(true)
            } else {
                Bson::Null
            },
        ),
        ("order_line", unless(a.line, 0)),
        ("order_qty", unless(a.quantity, 1)),
        ("order_part", unless(a.part, 0)),
        ("owner", a.owner.clone().map_or(Bson::Null, Bson::String)),
    ]
}

/// The codes among `ids`: the move adds its statuses and guards.
fn among(ids: Bson) -> Document {
    doc! {"_id": ids}
}

/// One claim as its own update statement: code `_id`, of the order's
/// pool, still claimable.
fn claim_each(a: &ClaimAssignment, now: DateTime) -> Document {
    let mut q = among(Bson::ObjectId(object_id(a.code_id)));
    q.insert("pool", a.pool.as_str());
    q.extend(crate::moves::movable(a.mv, now));
    doc! {"q": q, "u": issue_set(a, now)}
}

/// Every claim of a batch as ONE multi-document update statement: each
/// claimable document among `ids` takes the holder at its own position
/// (`$indexOfArray`), so it sets exactly what [`issue_set`] would. Fields
/// an assignment leaves empty (no grant number, no relay) are not set.
fn claim_statement(assignments: &[ClaimAssignment], ids: &[ObjectId], now: DateTime) -> Document {
    let id_list: Vec<Bson> = ids.iter().copied().map(Bson::ObjectId).collect();
    let q = among(Bson::Document(doc! {"$in": id_list}));
    merge_statement(assignments, ids, now, q, false)
}

/// The one multi-document statement of [`claim_statement`], on the
/// documents `target` names among `ids`, written by the move the batch
/// shares ([`crate::moves::merged_statement`]). `recommit` first takes off
/// the line, quantity and part a held code carries from its hold, so each
/// takes its order's value, or none at its default, exactly as a claim
/// writes it (the unique `(order_id, line)` index sees line 0 as absent).
pub(crate) fn merge_statement(
    assignments: &[ClaimAssignment],
    ids: &[ObjectId],
    now: DateTime,
    target: Document,
    recommit: bool,
) -> Document {
    // The holders' fields as columns, one value per assignment.
    let mut columns: Vec<(&'static str, Vec<Bson>)> = Vec::new();
    for (r, row) in assignments.iter().map(holder_fields).enumerate() {
        for (k, (field, value)) in row.into_iter().enumerate() {
            if r == 0 {
                columns.push((field, Vec::with_capacity(assignments.len())));
            }
            columns[k].1.push(value);
        }
    }
    // One call claims by one move: every assignment shares it.
    let mv = assignments[0].mv;
    debug_assert!(assignments.iter().all(|a| a.mv == mv));
    // A field no holder of the batch sets (no grant numbers, no relay, no
    // shop's webhook, no owner) costs the server nothing per document.
    columns.retain(|(_, column)| column.iter().any(|v| *v != Bson::Null));
    let pools: Vec<Bson> = assignments
        .iter()
        .map(|a| Bson::String(a.pool.clone()))
        .collect();
    crate::moves::merged_statement(mv, ids, now, target, columns, pools, recommit)
}

/// True when a unique index stopped a statement of an `update` reply: on
/// a claim, the `(order_id, line)` index (some line of the batch already
/// holds a code); on a redemption, the redemption id's.
pub(crate) fn stopped_by_a_unique_index(reply: &Document) -> bool {
    reply.get_array("writeErrors").is_ok_and(|errors| {
        errors
            .iter()
            .filter_map(Bson::as_document)
            .any(|e| e.get_i32("code") == Ok(DUPLICATE_KEY))
    })
}

/// What an `update` reply says of a batch of claims: the positions whose
/// order already holds a code, or the error that leaves the outcome
/// unknown (the caller reads grants back by order).
fn claim_reply(reply: &Document) -> Result<ClaimWrite, StoreError> {
    if let Ok(wce) = reply.get_document("writeConcernError") {
        return Err(StoreError::Unavailable(format!(
            "claim write concern not satisfied: {}",
            wce.get_str("errmsg").unwrap_or("unknown")
        )));
    }
    let mut out = ClaimWrite::default();
    for e in reply
        .get_array("writeErrors")
        .into_iter()
        .flatten()
        .filter_map(Bson::as_document)
    {
        let code = e.get_i32("code").unwrap_or(-1);
        let index = e.get_i32("index").unwrap_or(-1);
        let message = e.get_str("errmsg").unwrap_or("unknown");
        if code == DUPLICATE_KEY && index >= 0 {
            out.order_taken.push(index as usize);
        } else if is_transient_code(code) {
            return Err(StoreError::Unavailable(message.to_owned()));
        } else {
            return Err(StoreError::Rejected(format!("claim refused: {message}")));
        }
    }
    Ok(out)
}

/// The positions of an unordered `update` command's statements that a
/// unique index refused; any other error is an error.
pub(crate) fn duplicate_positions(reply: &Document) -> Result<Vec<usize>, StoreError> {
    claim_reply(reply).map(|w| w.order_taken)
}

impl Store {
    /// Runs `updates` on `codes` as ONE unordered, journaled `update`
    /// command (majority write concern) and returns the server's reply, so
    /// the caller reads its per-statement write errors.
    pub(crate) async fn update_codes(
        &self,
        updates: Vec<Document>,
    ) -> Result<Document, StoreError> {
        Ok(self
            .database()
            .run_command(doc! {
                "update": CODES,
                "updates": updates,
                "ordered": false,
                "writeConcern": durable_doc(),
            })
            .await?)
    }

    /// Applies a batch of claims in ONE journaled `update` command: each is
    /// "give code `_id` to this order if it is still unissued and unexpired".
    /// This is the only write that moves a code from 0 to 1 besides
    /// [`Store::claim_by_scan`]; MongoDB's condition, checked per document
    /// as it is written, is the sole arbiter.
    ///
    /// The claims go as one multi-document statement ([`claim_statement`]):
    /// a third of the server's work of one statement per claim, which it
    /// parses, plans and commits one by one. An order that already holds a
    /// code (a redelivery) stops that statement at the unique index, so the
    /// batch is then written again one statement per claim, which names
    /// each refused order; claims that landed before the stop no longer
    /// match, and are read back by order.
    pub async fn claim_candidates(
        &self,
        assignments: &[ClaimAssignment],
    ) -> Result<ClaimWrite, StoreError> {
        if assignments.is_empty() {
            return Ok(ClaimWrite::default());
        }
        let now = DateTime::now();
        // The candidates' sealed codes are read while the journaled write is
        // in flight: a code's value, pool, seq and expiry never change, so
        // the read need not follow the write, and a fully landed write
        // needs no read-back by order afterwards.
        let ids: Vec<ObjectId> = assignments.iter().map(|a| object_id(a.code_id)).collect();
        let one = vec![claim_statement(assignments, &ids, now)];
        let (reply, read) = futures::join!(self.update_codes(one), self.codes_by_id(&ids));
        let mut reply = reply?;
        if stopped_by_a_unique_index(&reply) {
            tracing::debug!("an order of the batch already holds a code; claiming one by one");
            let each = assignments.iter().map(|a| claim_each(a, now)).collect();
            reply = self.update_codes(each).await?;
        }
        let mut out = claim_reply(&reply)?;
        // Every statement the index did not refuse matched: every claim won
        // (in a second write, a claim that landed in the first no longer
        // matches, so this holds only when the second write did it all).
        let landed = crate::collections::as_u64(reply.get("n"));
        match read {
            Ok(codes) if landed == (assignments.len() - out.order_taken.len()) as u64 => {
                out.granted = issued_by(codes, assignments, &out.order_taken, now);
            }
            Ok(codes) => out.strays = strays_among(&codes, assignments, &out.order_taken, now),
            Err(_) => {}
        }
        Ok(out)
    }

    /// The codes with these ids, opened, by id.
    pub(super) async fn codes_by_id(
        &self,
        ids: &[ObjectId],
    ) -> Result<HashMap<CodeId, Code>, StoreError> {
        let codes = self
            .opened_codes(doc! {"_id": {"$in": ids}}, ids.len())
            .await?;
        Ok(codes.into_iter().map(|c| (c.id, c)).collect())
    }

    /// The codes matching `filter`, at most `most` of them (in one reply),
    /// opened with the store's keys; one that does not open (or is
    /// corrupt) is an error, never skipped.
    pub(super) async fn opened_codes(
        &self,
        filter: Document,
        most: usize,
    ) -> Result<Vec<Code>, StoreError> {
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(filter)
            .batch_size(crate::one_batch_for(most))
            .await?
            .try_collect()
            .await?;
        docs.into_iter().map(|d| d.into_code(&self.keys)).collect()
    }

    /// Claims the oldest unissued, unexpired code of `pool` for one order by
    /// scanning `(pool, status, seq)` with `findOneAndUpdate`. The path used
    /// when Redis is unavailable, and the final word on "the pool is empty".
    /// `claim.code_id` is ignored: the scan picks the code.
    pub async fn claim_by_scan(
        &self,
        pool: &str,
        claim: &ClaimAssignment,
    ) -> Result<ScanClaim, StoreError> {
        let result = (self.write_status_oldest::<CodeDoc>(claim.mv, pool, holder_doc(claim))).await;
        match result {
            Ok(Some(doc)) => Ok(ScanClaim::Granted(Box::new(doc.into_code(&self.keys)?))),
            Ok(None) => Ok(ScanClaim::Empty),
            Err(e) if is_duplicate_key(&e) => Ok(ScanClaim::OrderAlreadyGranted),
            Err(e) => Err(e.into()),
        }
    }

    /// The codes held by these orders, keyed by order id, each order's
    /// codes by line: on a line whose code was replaced, the code its
    /// latest replacement gave it (or the void one, while that waits).
    pub async fn grants_for_orders(
        &self,
        order_ids: &[&str],
    ) -> Result<HashMap<String, Vec<Code>>, StoreError> {
        if order_ids.is_empty() {
            return Ok(HashMap::new());
        }
        let codes = self
            .opened_codes(doc! {"order_id": {"$in": order_ids}}, order_ids.len())
            .await?;
        // The filter matched on order_id, so a holder is always there;
        // `into_code` has already refused one without issued_at.
        let mut out: HashMap<String, Vec<Code>> = HashMap::new();
        for c in codes {
            if let Some(h) = &c.holder {
                out.entry(h.order_id.clone()).or_default().push(c);
            }
        }
        for codes in out.values_mut() {
            *codes = current_by_line(std::mem::take(codes)).0;
        }
        Ok(out)
    }
}
