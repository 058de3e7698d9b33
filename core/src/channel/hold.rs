//! What a channel holds while a request of it is unanswered (the handlers are the
//! composition's, `shard/hold.rs`).

use crate::command::Op;
use std::collections::VecDeque;

/// Operations one channel may pipeline behind an unanswered request. A client that sends
/// more loses its connection (506): a runtime with shards must stop reading such a
/// connection long before (its inbound batches are bounded), so this is the last line.
pub(crate) const MAX_HELD_OPS: usize = 1 << 16;

/// What a channel's client sent while a request of the channel was unanswered, in order.
/// Only channels that had to hold something have one: the flag that a request is out is
/// `ChannelState::awaiting`, so a request answered before the next op costs no allocation.
pub(crate) struct Hold {
    pub(crate) later: VecDeque<Op>,
}
