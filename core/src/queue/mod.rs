//! Queues. `classic` holds the ready messages of a classic queue in publish order; `args`
//! parses the RabbitMQ queue arguments that shape its behaviour (TTL, limits, dead-lettering,
//! single active consumer); `state` is one queue's whole state and the operations that need
//! nothing outside it.

pub mod args;
pub mod classic;
pub(crate) mod state;
