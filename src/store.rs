//! The stores: where budgets live, each behind the seam of [`crate::budget::Store`].
//!
//! - [`memory`]: one instance's budgets in memory, kept across restarts in a state file;
//!   also the local fallback a shared store's failover paces on.
//! - [`postgres`]: every instance's budgets in one row per destination, with its SQL
//!   (`sql`), migrations, row mapping (`rows`), the database clock placed on this instance's
//!   (`clock`), and the fleet's membership (`membership`: heartbeats, rules compared).
//!
//! Only `app` (and the commands that talk to a store directly) names a concrete store.

pub mod memory;
pub mod postgres;
