//! Fanout exchange: every bound destination matches, whatever the routing key and headers.

use super::DestIndex;
use std::sync::Arc;

/// Bindings of a fanout exchange.
///
/// The destination index is the whole routing structure: its keys are exactly the bound
/// destinations, already ascending and unique, so routing is a walk over them with no
/// sorting, deduplication or allocation. Shared (`Arc`) with routing snapshots: a change
/// while a snapshot lives copies the index, O(bindings), which is also what one publish to a
/// fanout exchange costs.
#[derive(Clone, Debug, Default)]
pub struct FanoutBindings {
    pub(super) index: Arc<DestIndex>,
}
