//! The TCP listener: accepts sockets and runs one connection task each.

use crate::config::AmqpConfig;
use crate::connection::{PeerInfo, serve_connection};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use warren_runtime::BrokerHandle;

/// How long shutdown waits for connections to say goodbye.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Accepts AMQP connections until `shutdown` turns true, then closes them (320
/// CONNECTION_FORCED) and waits for them, bounded.
pub async fn serve(
    listener: TcpListener,
    broker: BrokerHandle,
    config: Arc<AmqpConfig>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
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
                let peer = PeerInfo {
                    addr: addr.to_string(),
                    // Canonical: a dual-stack listener sees IPv4 loopback as ::ffff:127.0.0.1.
                    is_loopback: addr.ip().to_canonical().is_loopback(),
                };
                tasks.spawn(serve_connection(
                    socket,
                    peer,
                    broker.clone(),
                    config.clone(),
                    shutdown.clone(),
                ));
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
