//! One pool and quantity of a bundle or a hold, as the API shows it (and
//! documents it: `ItemIn`). Apart from the handlers that answer with it
//! and the hand-written body schemas that name it, so neither imports the
//! other.

use serde::Serialize;
use utoipa::ToSchema;

/// One pool of a bundle or a hold.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ItemIn)]
pub(crate) struct Item {
    pool: String,
    #[schema(minimum = 1, maximum = 100)]
    quantity: u32,
}

impl From<&codepool_domain::Item> for Item {
    fn from(i: &codepool_domain::Item) -> Self {
        Item {
            pool: i.pool.clone(),
            quantity: i.quantity,
        }
    }
}
