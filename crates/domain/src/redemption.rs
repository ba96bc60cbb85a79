//! `code.redeemed`: the platform telling codepool that a buyer used a code.
//! It names the code either by pool and code or by order, and may arrive
//! more than once; applying it twice changes nothing.

use serde::Deserialize;

use crate::code::validate_code;
use crate::pool::Pool;

/// Routing key of redemption events on the `codepool.events` exchange.
pub const CODE_REDEEMED: &str = "code.redeemed";

/// Which code was redeemed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redemption {
    Code { pool: String, code: String },
    Order { order_id: String },
}

/// Why a `code.redeemed` message cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid code.redeemed event: {0}; send {{\"pool\":…,\"code\":…}} or {{\"order_id\":…}}")]
pub struct InvalidRedemption(pub String);

#[derive(Deserialize)]
struct Wire {
    #[serde(default)]
    pool: Option<String>,
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    order_id: Option<String>,
}

impl Redemption {
    /// Parses a message body. An order id wins when both forms are present.
    pub fn parse(body: &[u8]) -> Result<Self, InvalidRedemption> {
        let wire: Wire = serde_json::from_slice(body)
            .map_err(|e| InvalidRedemption(format!("not a JSON object of strings ({e})")))?;
        if let Some(order_id) = wire.order_id.map(|o| o.trim().to_owned()) {
            if order_id.is_empty() || order_id.chars().count() > 128 {
                return Err(InvalidRedemption(
                    "order_id must be 1 to 128 characters".into(),
                ));
            }
            return Ok(Self::Order { order_id });
        }
        match (wire.pool, wire.code) {
            (Some(pool), Some(code)) => {
                Pool::new(&pool).map_err(|e| InvalidRedemption(e.to_string()))?;
                let code = validate_code(&code).map_err(|e| InvalidRedemption(e.to_string()))?;
                Ok(Self::Code {
                    pool,
                    code: code.to_owned(),
                })
            }
            _ => Err(InvalidRedemption(
                "neither order_id nor pool and code given".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redemption_names_a_code_or_an_order() {
        assert_eq!(
            Redemption::parse(br#"{"pool":"game-x","code":"QWER-1234"}"#),
            Ok(Redemption::Code {
                pool: "game-x".into(),
                code: "QWER-1234".into()
            })
        );
        assert_eq!(
            Redemption::parse(br#"{"order_id":"O-1"}"#),
            Ok(Redemption::Order {
                order_id: "O-1".into()
            })
        );
    }

    #[test]
    fn malformed_redemptions_say_what_to_send() {
        for body in [
            &b"nope"[..],
            br#"{"pool":"game-x"}"#,
            br#"{"order_id":7}"#,
            br#"{"pool":"a b","code":"X"}"#,
            br#"{"order_id":" "}"#,
        ] {
            let e = Redemption::parse(body).unwrap_err();
            assert!(e.to_string().contains("order_id"), "{e}");
        }
    }
}
