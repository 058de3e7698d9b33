//! Runtime parameters, as RabbitMQ has them: a component (`shovel`, later
//! `federation-upstream`, ...), a vhost, a name unique per component in the vhost, and a
//! JSON value. The core keeps them with the vhost (stored, exported, replicated like
//! policies) but does not read the value: the host validates it for its component before
//! asking the core to set it, and the component's runner (warren-links) interprets it.

/// A runtime parameter as operators define it (and as stores keep it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParameterDef {
    /// The component it configures (`shovel`).
    pub component: String,
    /// The vhost it belongs to.
    pub vhost: String,
    /// Its name, unique per component in its vhost.
    pub name: String,
    /// Its value, JSON text (validated by the host for the component).
    pub value: String,
}

/// The most parameters one vhost keeps (a bound on what operators can make it hold).
pub const MAX_PER_VHOST: usize = 10_000;

/// The largest value kept, in bytes of JSON.
pub const MAX_VALUE_BYTES: usize = 64 * 1024;
