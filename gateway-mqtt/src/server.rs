//! The TCP listener: accepts sockets and runs one connection task each.

use crate::config::MqttConfig;
use crate::connection::{PeerInfo, serve_connection};
use crate::registry::Registry;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use warren_runtime::BrokerHandle;
use warren_runtime::listener::{accept_loop, is_loopback};

/// Accepts MQTT connections until `shutdown` turns true, then closes them (v5: DISCONNECT
/// 0x8B server shutting down) and waits for them, bounded.
pub async fn serve(
    listener: TcpListener,
    broker: BrokerHandle,
    config: Arc<MqttConfig>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    serve_with(
        listener,
        broker,
        Arc::new(Registry::new()),
        config,
        shutdown,
    )
    .await
}

/// As [`serve`], with a registry shared with other listeners (or in-process connections).
pub async fn serve_with(
    listener: TcpListener,
    broker: BrokerHandle,
    registry: Arc<Registry>,
    config: Arc<MqttConfig>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let stop = shutdown.clone();
    accept_loop(listener, shutdown, move |socket, addr| {
        let peer = PeerInfo {
            addr: addr.to_string(),
            is_loopback: is_loopback(&addr),
            identity: None,
        };
        serve_connection(
            socket,
            peer,
            broker.clone(),
            registry.clone(),
            config.clone(),
            stop.clone(),
        )
    })
    .await
}
