//! RabbitMQ's dynamic shovels: a parameter of component `shovel` names a source (a queue,
//! or an exchange to bind a private queue to) and a destination on brokers reached by
//! AMQP 0.9.1 URIs; the shovel consumes from one and publishes to the other, settling the
//! source as its ack mode says. `config` is the parameter's format and validation, `uri`
//! the URIs, `link` the shovel's logic without I/O, `amqp` its I/O over lapin.

pub mod amqp;
pub mod config;
pub mod link;
pub mod uri;

/// The component name of shovel parameters.
pub const COMPONENT: &str = "shovel";
