//! Queues. `classic` holds the ready messages of a classic queue in publish order.

pub mod classic;
