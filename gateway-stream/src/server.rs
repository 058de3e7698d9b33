//! The TCP listener: one [`serve_connection`] task per socket; [`serve_layered`] for a
//! listener whose connections run a handshake of their own first (TLS).

use crate::backend::{PeerInfo, StreamBackend};
use crate::connection::{Layered, serve_connection};
use crate::session::StreamConfig;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
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
            tls: false,
        };
        serve_connection(socket, peer, backend.clone(), config.clone(), stop.clone())
    })
    .await
}

/// As [`serve_with`], for connections that run `handshake` on their socket first, in their
/// own task (a TLS server handshake: bounded in time, logged by the caller when it fails,
/// which then returns `None`). `config` says what clients are told to connect to (Metadata):
/// this listener's port, usually.
pub async fn serve_layered<B, H, Fut, S>(
    listener: TcpListener,
    backend: Arc<B>,
    config: Arc<StreamConfig>,
    shutdown: watch::Receiver<bool>,
    handshake: H,
) -> std::io::Result<()>
where
    B: StreamBackend,
    H: Fn(TcpStream, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Option<S>> + Send + 'static,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let stop = shutdown.clone();
    accept_loop(listener, shutdown, move |socket, addr| {
        let peer = PeerInfo {
            addr: addr.to_string(),
            is_loopback: is_loopback(&addr),
            tls: true,
        };
        let (backend, config, stop) = (backend.clone(), config.clone(), stop.clone());
        let handshake = handshake.clone();
        async move {
            let Some(stream) = handshake(socket, addr).await else {
                return;
            };
            // Boxed: the serving future is not laid out over the handshake's.
            Box::pin(serve_connection(
                Layered(stream),
                peer,
                backend,
                config,
                stop,
            ))
            .await
        }
    })
    .await
}
