//! The accept loop every listener runs (AMQP, MQTT, plain or TLS or WebSocket): one task per
//! accepted socket, closed and drained when shutdown is asked.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

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
    let tasks = Arc::new(Tasks::default());
    loop {
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
                tokio::spawn(Counted {
                    served: connection(socket, addr),
                    _running: Running::new(&tasks),
                });
            }
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, tasks.all_done()).await;
    Ok(())
}

/// The connection tasks a listener started and that have not ended: a count, not a set of
/// handles. A `JoinSet` entry was 56 bytes (and an allocation) per idle connection, for
/// the shutdown's wait alone (issue 42). Tasks left after [`DRAIN_TIMEOUT`] are not
/// aborted: they watch the same shutdown and end with their own bounded close.
#[derive(Default)]
struct Tasks {
    running: AtomicUsize,
    /// Woken when `running` drops to zero.
    done: Notify,
}

impl Tasks {
    async fn all_done(&self) {
        loop {
            let done = self.done.notified();
            let mut done = std::pin::pin!(done);
            // Registered before the count is read, so a task ending in between wakes it.
            done.as_mut().enable();
            if self.running.load(Ordering::Acquire) == 0 {
                return;
            }
            done.await;
        }
    }
}

/// A connection's future counted in [`Tasks`] while it lives. A struct, not an `async move`
/// block awaiting the future: a block keeps its captured future and the awaited copy side
/// by side, doubling the task.
struct Counted<Fut> {
    served: Fut,
    _running: Running,
}

impl<Fut: Future> Future for Counted<Fut> {
    type Output = Fut::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Fut::Output> {
        // SAFETY: `served` is structurally pinned: nothing moves it out of a pinned
        // `Counted` (no method does, `Counted` has no `Drop` impl, and it is `Unpin` only
        // when `Fut` is).
        unsafe { self.map_unchecked_mut(|c| &mut c.served) }.poll(cx)
    }
}

/// Held by one connection task for its life (dropped also when the task is cancelled).
struct Running(Arc<Tasks>);

impl Running {
    fn new(tasks: &Arc<Tasks>) -> Running {
        tasks.running.fetch_add(1, Ordering::AcqRel);
        Running(tasks.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.done.notify_waiters();
        }
    }
}

/// Whether `addr` is the local machine (a dual-stack listener sees IPv4 loopback as
/// `::ffff:127.0.0.1`, hence canonical).
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}
