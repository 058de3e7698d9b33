//! What one queue type keeps beyond what every queue has (`queue::state::QueueState`): one
//! value per queue, so a queue is exactly one type and no state of another type can be
//! half-set beside it.

use crate::queue::quorum::{Fifo, QUORUM};
use crate::queue::stream::{STREAMS, StreamQueue};
use crate::queue_type::QueueType;

/// A queue's type-specific state. Boxed where large, so a classic queue (the common case,
/// and every MQTT QoS 1 session's queue) pays one word for the seam.
#[derive(Default)]
pub(crate) enum Variant {
    /// A classic queue: its messages are `QueueState::messages`.
    #[default]
    Classic,
    /// An `mqtt-qos0` queue: it holds nothing (`direct_delivery`); `messages` stays empty.
    Direct,
    /// A quorum queue's own state (`queue::quorum`).
    Quorum(Box<Fifo>),
    /// A stream's state (`x-queue-type: stream`): its log is the store's, and `messages`
    /// stays empty; the queue's behaviour hands every operation to it.
    Stream(Box<StreamQueue>),
}

impl Variant {
    /// The queue type this state is of.
    pub(crate) fn kind(&self) -> QueueType {
        match self {
            Variant::Classic => QueueType::Classic,
            Variant::Direct => QueueType::MqttQos0,
            Variant::Quorum(_) => QueueType::Quorum,
            Variant::Stream(_) => QueueType::Stream,
        }
    }

    pub(crate) fn is_direct(&self) -> bool {
        matches!(self, Variant::Direct)
    }

    // The quorum and stream accessors check the build's features first (`QUORUM`,
    // `STREAMS`: constants), so without a feature every path through that type's state is
    // dead code the compiler drops (the JS package's size budget, issue 39).

    pub(crate) fn is_quorum(&self) -> bool {
        QUORUM && matches!(self, Variant::Quorum(_))
    }

    pub(crate) fn is_stream(&self) -> bool {
        STREAMS && matches!(self, Variant::Stream(_))
    }

    pub(crate) fn quorum(&self) -> Option<&Fifo> {
        if !QUORUM {
            return None;
        }
        match self {
            Variant::Quorum(f) => Some(f),
            _ => None,
        }
    }

    pub(crate) fn quorum_mut(&mut self) -> Option<&mut Fifo> {
        if !QUORUM {
            return None;
        }
        match self {
            Variant::Quorum(f) => Some(f),
            _ => None,
        }
    }

    pub(crate) fn stream(&self) -> Option<&StreamQueue> {
        if !STREAMS {
            return None;
        }
        match self {
            Variant::Stream(s) => Some(s),
            _ => None,
        }
    }

    pub(crate) fn stream_mut(&mut self) -> Option<&mut StreamQueue> {
        if !STREAMS {
            return None;
        }
        match self {
            Variant::Stream(s) => Some(s),
            _ => None,
        }
    }
}
