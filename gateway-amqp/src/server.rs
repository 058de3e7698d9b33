//! The TCP listener: accepts sockets and runs one connection task each.

use crate::config::AmqpConfig;
use crate::connection::{PeerInfo, serve_connection};
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use warren_runtime::BrokerHandle;
use warren_runtime::listener::{accept_loop, is_loopback};

/// Accepts AMQP connections until `shutdown` turns true, then closes them (320
/// CONNECTION_FORCED) and waits for them, bounded.
pub async fn serve(
    listener: TcpListener,
    broker: BrokerHandle,
    config: Arc<AmqpConfig>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let stop = shutdown.clone();
    accept_loop(listener, shutdown, move |socket, addr| {
        let peer = PeerInfo {
            addr: addr.to_string(),
            is_loopback: is_loopback(&addr),
            identity: None,
            tls: false,
        };
        serve_connection(socket, peer, broker.clone(), config.clone(), stop.clone())
    })
    .await
}
