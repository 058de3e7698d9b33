//! One stream-protocol connection: the tokio shell around [`Session`]. Reads bytes into the
//! session, writes what it produces, awaits its [`Wait`]s on the backend (futures this task
//! polls itself; the session keeps at most one per stream and one per subscription
//! outstanding) and runs its timer. Stops reading while the session says so (back-pressure).

use crate::backend::{PeerInfo, StreamBackend, StreamError};
use crate::session::{OutPart, Session, StreamConfig, Wait};
use bytes::BytesMut;
use futures_util::future::{AbortHandle, abortable};
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::collections::HashMap;
use std::future::Future;
use std::os::unix::fs::FileExt;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use warren_runtime::sendfile;

/// Unix time in ms: the session's clock (chunk timestamps, heartbeats).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// How long closing writes may take.
const CLOSE_WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a closing connection reads (and drops) what its client still sends, after our
/// last frame and our FIN: a socket closed with unread input is reset, and a reset can reach
/// the client before it reads our Close (a client in the middle of a frame over the
/// frame-max met a broken pipe and never saw the Close). Ends at the client's EOF.
const CLOSE_DRAIN: Duration = Duration::from_secs(1);
/// The same while the server shuts down: short, since some clients never close their side.
const SHUTDOWN_DRAIN: Duration = Duration::from_millis(200);
/// Read chunk of a connection that sends little (most: consumers, idle publishers).
const SMALL_READ: usize = 4 * 1024;
/// Read chunk once a read filled what it had: a publisher streaming 1 KB messages got four
/// frames per `read` at 4 KiB (a system call per four messages), ~60 at this size.
const READ_CHUNK: usize = 64 * 1024;

enum Done {
    Durable {
        vhost: String,
        stream: String,
        offset: u64,
        result: Result<(), StreamError>,
    },
    Data {
        subscription_id: u8,
        generation: u64,
        result: Result<(), StreamError>,
    },
    Deleted {
        stream: String,
    },
}

/// A wait in flight: polled by the connection's own task (see [`serve_connection`]);
/// `None` when it was cancelled.
type WaitFuture = Pin<Box<dyn Future<Output = Option<Done>> + Send>>;

/// A connection's waits, polled by its own task. Bounded: the session keeps at most one
/// durability wait per stream it publishes to, and one data wait per subscription; a data
/// wait it left behind (the subscription was cancelled or replaced while waiting at the end of
/// an idle stream: its generation is stale) is aborted when the next one for the same
/// subscription id comes, rather than kept until data arrives that may never come.
struct Waits {
    futures: FuturesUnordered<WaitFuture>,
    data: HashMap<u8, AbortHandle>,
    /// The deletion waits, one per stream the session watches (it unwatches a stream it
    /// uses no more: bounded by its publishers and subscriptions).
    deleted: HashMap<String, AbortHandle>,
}

impl Waits {
    fn new() -> Waits {
        Waits {
            futures: FuturesUnordered::new(),
            data: HashMap::new(),
            deleted: HashMap::new(),
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.futures.len()
    }

    fn push<B: StreamBackend>(&mut self, backend: &Arc<B>, wait: Wait) {
        match wait {
            Wait::Durable {
                vhost,
                stream,
                offset,
            } => {
                let fut = backend.wait_durable(&vhost, &stream, offset);
                self.futures.push(Box::pin(async move {
                    Some(Done::Durable {
                        result: fut.await,
                        vhost,
                        stream,
                        offset,
                    })
                }));
            }
            Wait::Data {
                vhost,
                stream,
                from,
                subscription_id,
                generation,
            } => {
                let (fut, handle) = abortable(backend.wait_data(&vhost, &stream, from));
                if let Some(stale) = self.data.insert(subscription_id, handle) {
                    stale.abort();
                }
                self.futures.push(Box::pin(async move {
                    let result = fut.await.ok()?;
                    Some(Done::Data {
                        result,
                        subscription_id,
                        generation,
                    })
                }));
            }
            Wait::Deleted { vhost, stream } => {
                if self.deleted.contains_key(&stream) {
                    return;
                }
                let (fut, handle) = abortable(backend.wait_deleted(&vhost, &stream));
                self.deleted.insert(stream.clone(), handle);
                self.futures.push(Box::pin(async move {
                    fut.await.ok()?;
                    Some(Done::Deleted { stream })
                }));
            }
            Wait::Unwatch { stream } => {
                if let Some(h) = self.deleted.remove(&stream) {
                    h.abort();
                }
            }
        }
    }

    /// The next wait done (cancelled ones skipped); pending while none is.
    async fn next(&mut self) -> Done {
        loop {
            match self.futures.next().await {
                Some(Some(done)) => return done,
                Some(None) => continue,
                None => std::future::pending().await,
            }
        }
    }
}

/// A connection's byte stream. A plain TCP socket also takes file ranges with `sendfile`;
/// any other (TLS, in-process pipes) gets them read and written.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The socket whose bytes reach the peer as written, for `sendfile`.
    fn plain_tcp(&self) -> Option<&TcpStream> {
        None
    }
}

impl Transport for TcpStream {
    fn plain_tcp(&self) -> Option<&TcpStream> {
        Some(self)
    }
}

impl Transport for tokio::io::DuplexStream {}

/// A byte stream over another layer (TLS): file ranges are read and written, since the
/// bytes on the socket are not the file's.
pub struct Layered<S>(pub S);

impl<S: AsyncRead + Unpin> AsyncRead for Layered<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Layered<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> Transport for Layered<S> {}

/// Writes the session's output in order: bytes as they are, file ranges with `sendfile`
/// where allowed, else read (one `pread`) and written.
async fn write_parts<S: Transport>(
    stream: &mut S,
    parts: Vec<OutPart>,
    zero_copy: bool,
) -> std::io::Result<()> {
    for part in parts {
        match part {
            OutPart::Bytes(b) => stream.write_all(&b).await?,
            OutPart::File(r) => match stream.plain_tcp() {
                Some(tcp) if zero_copy && sendfile::SENDFILE => {
                    sendfile::send_file(tcp, &r.file, r.offset, u64::from(r.len)).await?
                }
                _ => {
                    let mut b = vec![0u8; r.len as usize];
                    r.file.read_exact_at(&mut b, r.offset)?;
                    stream.write_all(&b).await?
                }
            },
        }
    }
    Ok(())
}

/// Serves one connection until it closes.
pub async fn serve_connection<S, B>(
    mut stream: S,
    peer: PeerInfo,
    backend: Arc<B>,
    config: Arc<StreamConfig>,
    mut shutdown: watch::Receiver<bool>,
) where
    S: Transport,
    B: StreamBackend,
{
    let addr = peer.addr.clone();
    let zero_copy = config.zero_copy;
    // The waits are this task's own futures, not tasks of their own that report over a
    // channel: a group commit then wakes this task once, where a waiting task woke, sent and
    // woke this one (two scheduler hops, often a parked worker woken for each; with a
    // publisher that leaves the broker idle between its writes, as the Java client does,
    // those wake-ups were a large part of the broker's CPU per message). Bounded by the
    // session: one per stream with unconfirmed messages, one per subscription.
    let mut waits = Waits::new();
    let mut session = Session::new(backend.clone(), config, peer, now_ms());
    let mailbox = session.mailbox();
    let mut rbuf = BytesMut::with_capacity(SMALL_READ);
    let mut read_chunk = SMALL_READ;
    let mut shutting_down = false;
    // Set once the session is open, if the backend shows connections to operators.
    let mut operator_close: Option<crate::backend::OperatorClose> = None;
    // Whether the loop ends with the session closing (its last frames written), rather than
    // at the client's EOF or a socket error.
    let mut closed_by_session = false;
    loop {
        for w in session.take_waits() {
            waits.push(&backend, w);
        }
        if operator_close.is_none() {
            operator_close = session.take_operator_close();
        }
        if session.has_output() {
            let out = session.take_output();
            let written = if session.is_closing() {
                tokio::time::timeout(
                    CLOSE_WRITE_TIMEOUT,
                    write_parts(&mut stream, out, zero_copy),
                )
                .await
                .unwrap_or(Ok(()))
            } else {
                write_parts(&mut stream, out, zero_copy).await
            };
            if let Err(e) = written {
                tracing::debug!(peer = %addr, "stream connection write: {}", warren_core::escape::Escaped(&e.to_string()));
                break;
            }
            session.flushed(now_ms());
            // Frames left unread while the buffer was full.
            if !rbuf.is_empty() && session.wants_read() {
                session.handle_input(&mut rbuf, now_ms());
            }
            continue;
        }
        if session.is_closing() {
            closed_by_session = true;
            break;
        }
        if rbuf.is_empty() && rbuf.capacity() > READ_CHUNK {
            // A frame up to the frame-max made it grow: released once it is consumed.
            rbuf = BytesMut::new();
        }
        if rbuf.capacity() - rbuf.len() < SMALL_READ {
            rbuf.reserve(read_chunk);
        }
        let spare = rbuf.capacity() - rbuf.len();
        let sleep = session
            .next_deadline()
            .map(|d| Duration::from_millis(d.saturating_sub(now_ms())));
        tokio::select! {
            read = stream.read_buf(&mut rbuf), if session.wants_read() => {
                match read {
                    Ok(0) => break,
                    Ok(n) => {
                        read_chunk = if n >= spare { READ_CHUNK } else { SMALL_READ };
                        session.handle_input(&mut rbuf, now_ms())
                    }
                    Err(e) => {
                        tracing::debug!(peer = %addr, "stream connection read: {}", warren_core::escape::Escaped(&e.to_string()));
                        break;
                    }
                }
            }
            done = waits.next() => match done {
                Done::Durable { vhost, stream, offset, result } => {
                    session.durable(&vhost, &stream, offset, result)
                }
                Done::Data { subscription_id, generation, result } => {
                    session.data_ready(subscription_id, generation, result)
                }
                Done::Deleted { stream } => {
                    waits.deleted.remove(&stream);
                    session.stream_gone(&stream)
                }
            },
            reason = operator_closed(&mut operator_close) => {
                operator_close = None;
                session.closed_by_operator(&reason);
            }
            _ = mailbox.notified() => session.consumer_updates(),
            _ = tokio::time::sleep(sleep.unwrap_or(Duration::from_secs(3600))), if sleep.is_some() => {
                session.on_timer(now_ms());
            }
            changed = shutdown.changed(), if !shutting_down => {
                if changed.is_err() || *shutdown.borrow() {
                    shutting_down = true;
                    session.shutdown(now_ms());
                }
            }
        }
    }
    drop(waits);
    let _ = tokio::time::timeout(CLOSE_WRITE_TIMEOUT, stream.shutdown()).await;
    if closed_by_session {
        let bound = if shutting_down {
            SHUTDOWN_DRAIN
        } else {
            CLOSE_DRAIN
        };
        rbuf.clear();
        drain_input(&mut stream, rbuf, bound).await;
    }
}

/// The operator's reason once the connection is closed from outside; pending without a
/// registration.
async fn operator_closed(close: &mut Option<crate::backend::OperatorClose>) -> String {
    match close {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// Reads and drops input until EOF, an error or `bound` has passed (see [`CLOSE_DRAIN`]).
/// The buffer is reused, so memory stays at its capacity whatever the client sends.
async fn drain_input<S: Transport>(stream: &mut S, mut buf: BytesMut, bound: Duration) {
    if buf.capacity() < SMALL_READ {
        buf.reserve(SMALL_READ);
    }
    let _ = tokio::time::timeout(bound, async {
        loop {
            buf.clear();
            match stream.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryBackend;

    fn data_wait(subscription_id: u8, generation: u64) -> Wait {
        Wait::Data {
            vhost: "/".into(),
            stream: "idle".into(),
            from: 0,
            subscription_id,
            generation,
        }
    }

    /// A client that subscribes and unsubscribes over and over at the end of an idle stream
    /// leaves a data wait behind each time: only the newest per subscription id is kept.
    #[tokio::test]
    async fn stale_data_waits_are_dropped_not_kept_until_data_comes() {
        let backend = Arc::new(MemoryBackend::new());
        backend.create_stream("/", "idle", &[]).unwrap();
        let mut waits = Waits::new();
        for generation in 0..1000 {
            waits.push(&backend, data_wait(7, generation));
        }
        waits.push(&backend, data_wait(8, 0));
        // Polling drains the aborted ones; the two live ones wait for data.
        let polled = tokio::time::timeout(Duration::from_millis(50), waits.next()).await;
        assert!(polled.is_err(), "no data yet: nothing done");
        assert_eq!(waits.len(), 2, "one wait per subscription id");
        backend.delete_stream("/", "idle").unwrap();
        let mut got = Vec::new();
        for _ in 0..2 {
            match tokio::time::timeout(Duration::from_secs(5), waits.next()).await {
                Ok(Done::Data {
                    subscription_id,
                    generation,
                    result,
                }) => got.push((subscription_id, generation, result)),
                Ok(Done::Durable { .. } | Done::Deleted { .. }) => {
                    panic!("no durability or deletion wait was pushed")
                }
                Err(_) => panic!("the deletion ends every live wait within 5 s"),
            }
        }
        got.sort_by_key(|g| g.0);
        assert_eq!(
            got,
            vec![
                (7, 999, Err(StreamError::DoesNotExist)),
                (8, 0, Err(StreamError::DoesNotExist)),
            ]
        );
    }
}
