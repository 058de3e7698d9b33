//! The accept loop every listener runs (AMQP, MQTT, plain or TLS or WebSocket): one task per
//! accepted socket, closed and drained when shutdown is asked.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How long shutdown waits for connections to say goodbye.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Accepts sockets until `shutdown` turns true and runs `connection(socket, peer)` for each
/// in its own task; then stops accepting and waits for those tasks (they watch `shutdown`
/// themselves and close with their protocol's goodbye), at most [`DRAIN_TIMEOUT`].
pub async fn accept_loop<F, Fut>(
    listener: TcpListener,
    mut shutdown: watch::Receiver<bool>,
    mut connection: F,
) -> std::io::Result<()>
where
    F: FnMut(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut tasks = JoinSet::new();
    loop {
        // Reap finished connection tasks so the set stays as large as the live connections.
        while tasks.try_join_next().is_some() {}
        tokio::select! {
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    break;
                }
            }
            accepted = listener.accept() => {
                let (socket, addr) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Running out of file descriptors must not end the listener.
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = socket.set_nodelay(true);
                tasks.spawn(connection(socket, addr));
            }
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    tasks.abort_all();
    Ok(())
}

/// Whether `addr` is the local machine (a dual-stack listener sees IPv4 loopback as
/// `::ffff:127.0.0.1`, hence canonical).
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}
