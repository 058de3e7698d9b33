//! The TCP listener: accepts sockets and runs one connection task each.

use crate::config::MqttConfig;
use crate::connection::{PeerInfo, serve_connection};
use crate::registry::Registry;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use warren_runtime::BrokerHandle;

/// How long shutdown waits for connections to say goodbye.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

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
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut tasks = JoinSet::new();
    loop {
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
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = socket.set_nodelay(true);
                let peer = PeerInfo {
                    addr: addr.to_string(),
                    is_loopback: addr.ip().to_canonical().is_loopback(),
                };
                tasks.spawn(serve_connection(
                    socket,
                    peer,
                    broker.clone(),
                    registry.clone(),
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
