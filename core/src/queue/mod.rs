//! Queues. `classic` holds the ready messages of a classic queue in publish order; `args`
//! parses the RabbitMQ queue arguments that shape its behaviour (TTL, limits, dead-lettering,
//! single active consumer); `state` is one queue's whole state and the operations that need
//! nothing outside it.

/// The queue arguments (parsed where declares are decided, held by the queue).
pub use crate::queue_args as args;
pub mod classic;
pub mod dlx;
pub mod kind;
pub(crate) mod quorum;
pub(crate) mod side;
pub(crate) mod state;
pub(crate) mod stream;
pub(crate) mod variant;
pub use stream::StreamReaders;
