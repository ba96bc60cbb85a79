//! Sequence generators for business numbers, safe across many processes and
//! machines, over MongoDB (and Redis for the daily numbers).
//!
//! | generator | values | how |
//! |---|---|---|
//! | [`SegmentAllocator`] | `1, 2, 3, …` (`u64`) | reserves `step` ids with one atomic `$inc`, hands them out from memory, reserves the next range in the background (double buffer) |
//! | [`DailyNumbers`] | `G202611200001` | Redis counts inside leases reserved in MongoDB; MongoDB serves directly when Redis is away; never repeats (see [`daily`]) |
//! | [`CyclicCounter`] | `0..=max`, wrapping | one atomic update-pipeline `findOneAndUpdate` |
//! | [`TimeId`] | `2026112015595912345607` | UTC time to the microsecond + 2-digit cyclic serial |
//!
//! Every counter lives in one document of the MongoDB collection
//! [`COLLECTION`] (`sequences`), changed only by single-document atomic
//! updates: no read-then-write retry loops, no server-side JavaScript, no
//! locks. Errors are [`SequenceError`]s whose messages say what to do next.

pub mod clock;
mod counters;
pub mod cyclic;
pub mod daily;
mod error;
pub mod segment;
pub mod time_id;

pub use clock::{Clock, SystemClock};
pub use counters::COLLECTION;
pub use cyclic::CyclicCounter;
pub use daily::DailyNumbers;
pub use error::SequenceError;
pub use segment::SegmentAllocator;
pub use time_id::TimeId;
