//! Fanout exchange: every bound destination matches, whatever the routing key and headers.

use super::DestIndex;

/// Bindings of a fanout exchange.
///
/// The destination index is the whole routing structure: its keys are exactly the bound
/// destinations, already ascending and unique, so routing is a walk over them with no
/// sorting, deduplication or allocation.
#[derive(Clone, Debug, Default)]
pub struct FanoutBindings {
    pub(super) index: DestIndex,
}
