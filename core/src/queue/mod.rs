//! Queues. `classic` holds the ready messages of a classic queue in publish order; `args`
//! parses the RabbitMQ queue arguments that shape its behaviour (TTL, limits, dead-lettering,
//! single active consumer).

pub mod args;
pub mod classic;
