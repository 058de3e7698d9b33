//! The TCP listener: one [`serve_connection`] task per socket.

use crate::backend::{PeerInfo, StreamBackend};
use crate::connection::serve_connection;
use crate::session::StreamConfig;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use warren_runtime::listener::{accept_loop, is_loopback};

/// Accepts stream-protocol connections until `shutdown` turns true, then closes them
/// (Close "server shutdown") and waits for them, bounded. The advertised host and port
/// default to the listener's address (what Metadata tells clients to connect to).
pub async fn serve<B: StreamBackend>(
    listener: TcpListener,
    backend: Arc<B>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    let config = StreamConfig {
        advertised_host: addr.ip().to_string(),
        advertised_port: addr.port(),
        ..StreamConfig::default()
    };
    serve_with(listener, backend, Arc::new(config), shutdown).await
}

/// As [`serve`], with a configuration of its own.
pub async fn serve_with<B: StreamBackend>(
    listener: TcpListener,
    backend: Arc<B>,
    config: Arc<StreamConfig>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let stop = shutdown.clone();
    accept_loop(listener, shutdown, move |socket, addr| {
        let peer = PeerInfo {
            addr: addr.to_string(),
            is_loopback: is_loopback(&addr),
        };
        serve_connection(socket, peer, backend.clone(), config.clone(), stop.clone())
    })
    .await
}
