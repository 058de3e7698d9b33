//! RabbitMQ's shovels, dynamic and static: a parameter of component `shovel` names a source (a queue,
//! or an exchange to bind a private queue to) and a destination on brokers reached by
//! AMQP 0.9.1 URIs; the shovel consumes from one and publishes to the other, settling the
//! source as its ack mode says. `config` is the parameter's format and validation, `uri`
//! the URIs, `link` the shovel's logic without I/O, `amqp` its I/O over lapin; `statics`
//! the config file's `[[shovel]]` tables, the same definitions without a parameter.

pub mod amqp;
pub mod config;
pub mod link;
pub mod statics;
pub mod uri;

pub use statics::{Shovels, StaticShovel};

/// The component name of shovel parameters.
pub const COMPONENT: &str = "shovel";

/// Where a shovel is defined: RabbitMQ's `type` in the status and `shovel-type` in the
/// forward headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A runtime parameter.
    Dynamic,
    /// A `[[shovel]]` table of the config file.
    Static,
}

impl Kind {
    /// RabbitMQ's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Dynamic => "dynamic",
            Kind::Static => "static",
        }
    }
}
