//! Links: Warren as a client of other brokers (and of itself), configured by runtime
//! parameters as RabbitMQ's plugins are. This slice serves RabbitMQ's dynamic shovels over
//! AMQP 0.9.1 (`shovel`); federation (`federation-upstream`) and MQTT bridges come beside
//! it, with the same pieces: a parameter's validation (`shovel::config`), the link's own
//! logic free of I/O (`shovel::link`), its I/O over a client library (`shovel::amqp`), and
//! the supervisor that follows the parameters, restarts links with backoff and keeps
//! their status (`supervisor`, `status`). MQTT bridges (`bridge`, Mosquitto's `connection`
//! blocks) come from the config file's `[[bridge]]` tables and run beside them, as do static
//! shovels (`[[shovel]]` tables, `shovel::statics`).
//! docs/bridges.md is the user's side.

pub mod backoff;
pub mod bridge;
pub mod erlang;
pub mod shovel;
pub mod status;
pub mod supervisor;

pub use bridge::Bridges;
pub use shovel::Shovels;
pub use supervisor::{LocalBroker, Supervisor};

/// The components whose parameters Warren knows (RabbitMQ refuses any other with
/// "component NAME not found").
pub const COMPONENTS: &[&str] = &["shovel"];

/// Validates a parameter's value for its component: `Ok` or RabbitMQ's text (the
/// "Validation failed" message as rabbitmqctl prints it).
pub fn validate(component: &str, name: &str, value: &serde_json::Value) -> Result<(), String> {
    match component {
        "shovel" => shovel::config::ShovelConfig::parse(name, value).map(|_| ()),
        other => Err(format!(
            "Validation failed\n\ncomponent {other} not found\n"
        )),
    }
}

/// Where a local end connects to a listener bound to `addr`: a wildcard address as loopback.
pub fn loopback(addr: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let ip = match addr.ip() {
        IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    std::net::SocketAddr::new(ip, addr.port())
}
