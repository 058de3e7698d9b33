//! One AMQP connection: the tokio shell around [`Session`]. Reads bytes and feeds them to the
//! session, writes what it produces, sends its ops to the broker, makes the login checks it
//! asks for, and wakes it at its deadline (heartbeats, handshake and close timeouts). All
//! protocol decisions are the session's; this file owns the socket, the clock and the task,
//! as `warren-mqtt`'s `connection.rs` does for its session.
//!
//! Generic over the byte stream, so the same code serves TCP sockets and in-process
//! (socketless) connections for benchmarks.

use crate::config::AmqpConfig;
use crate::handshake::Login;
use crate::session::{Ended, Session};
use bytes::BytesMut;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout, timeout_at};
use warren_core::command::Op;
use warren_core::escape::Escaped;
use warren_runtime::{BrokerHandle, EffectReceiver};

/// Who is on the other end, for authentication and logs.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub addr: String,
    pub is_loopback: bool,
    /// The subject CN of the client's TLS certificate, when it presented one the listener
    /// verified: the user name of certificate logins.
    pub identity: Option<String>,
    /// Whether the connection came through a TLS listener (the HTTP API's `ssl`).
    pub tls: bool,
}

/// A read buffer larger than this is released when it empties: idle connections hold no
/// big buffers.
const IDLE_BUFFER: usize = 64 * 1024;
/// After a client's connection.close, how long we keep reading (and discarding) until the
/// client closes the socket, and how much we read at most meanwhile.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
const CLOSE_LINGER_BYTES: usize = 1024 * 1024;
/// Read chunk for an active connection.
const READ_CHUNK: usize = 64 * 1024;
/// Read chunk for a connection that sends little.
const SMALL_READ: usize = 4 * 1024;
/// How long the last writes of an ended session (a refusal, a close-ok) may take.
const LAST_WRITE: Duration = Duration::from_secs(3);

/// How a connection ended.
enum End {
    Session(Ended),
    Io(std::io::Error),
    BrokerGone,
}

/// Serves one connection until it closes.
pub async fn serve_connection<S>(
    stream: S,
    peer: PeerInfo,
    broker: BrokerHandle,
    config: Arc<AmqpConfig>,
    mut shutdown: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    // The session's clock: monotonic milliseconds since the connection was accepted.
    let epoch = Instant::now();
    let now = || epoch.elapsed().as_millis() as u64;
    let at = |ms: u64| epoch + Duration::from_millis(ms);
    let mut session = Session::new(config, peer.identity.clone(), peer.addr.as_str().into(), 0);
    let mut rbuf = BytesMut::with_capacity(SMALL_READ);
    let mut link: Option<warren_runtime::Connection> = None;
    let mut read_chunk = SMALL_READ;
    let mut watching_shutdown = true;
    let end = loop {
        // Write before returning write-window credit (`Op::Written` in the ops), so the core
        // never has more than one window of deliveries in flight to this socket.
        if !session.output().is_empty() {
            let written = if session.ended().is_some() {
                timeout(LAST_WRITE, write(&mut wr, session.output()))
                    .await
                    .unwrap_or(Ok(()))
            } else {
                write(&mut wr, session.output()).await
            };
            if let Err(e) = written {
                break End::Io(e);
            }
            session.output_written(now());
        }
        if let Some(opened) = session.take_opened() {
            tracing::info!(peer = %peer.addr, user = %Escaped(&opened.user), "accepted AMQP connection");
            let l = broker.connect();
            l.tx.describe(warren_runtime::ConnMeta {
                protocol: "AMQP 0-9-1",
                peer: peer.addr.as_str().into(),
                tls: peer.tls,
                client_properties: Some(Box::new(opened.client_properties)),
                client_id: None,
                heartbeat: opened.heartbeat_secs,
                frame_max: opened.frame_max,
                connected_at: warren_runtime::unix_ms(),
            });
            link = Some(l);
        }
        if let Some(l) = &link
            && l.tx.send(session.take_ops()).await.is_err()
        {
            break End::BrokerGone;
        }
        if let Some(login) = session.take_login() {
            let check = check_login(&broker, &login, peer.is_loopback);
            // The handshake's deadline bounds its login checks too.
            let answer = match session.deadline().filter(|_| !session.is_open()) {
                Some(deadline) => timeout_at(at(deadline), check).await,
                None => Ok(check.await),
            };
            match answer {
                Ok(Ok(answer)) => {
                    session.on_login(now(), answer);
                    // Then what the client sent behind it.
                    session.handle_input(now(), &mut rbuf);
                }
                Ok(Err(_)) => break End::BrokerGone,
                Err(_) => session.on_timeout(now()),
            }
            continue;
        }
        if let Some(ended) = session.ended() {
            break End::Session(ended.clone());
        }
        if rbuf.is_empty() && rbuf.capacity() > IDLE_BUFFER {
            rbuf = BytesMut::new();
        }
        if rbuf.capacity() - rbuf.len() < SMALL_READ {
            rbuf.reserve(read_chunk);
        }
        if *shutdown.borrow_and_update() && session.is_open() {
            session.shutdown(now());
            continue;
        }
        let deadline = session.deadline().map(at);
        // Not biased: under a steady stream of deliveries a biased select would never read
        // the socket, so the client's acks and heartbeats would go unread.
        tokio::select! {
            changed = shutdown.changed(), if watching_shutdown => {
                // A dropped sender means nobody can ask us to stop: stop watching (the
                // branch would otherwise be ready forever). A change is handled above.
                watching_shutdown = changed.is_ok();
            }
            batch = recv(link.as_mut().map(|l| &mut l.rx)), if link.is_some() => {
                let Some(batch) = batch else { break End::BrokerGone };
                if let Some(l) = link.as_mut() {
                    let rx = &mut l.rx;
                    session.handle_effects(now(), batch, || rx.try_recv());
                }
            }
            read = rd.read_buf(&mut rbuf), if !session.read_paused() => match read {
                Ok(0) => session.peer_gone(),
                Ok(n) => {
                    read_chunk = if n >= read_chunk { READ_CHUNK } else { SMALL_READ };
                    session.handle_input(now(), &mut rbuf);
                }
                Err(e) => {
                    session.peer_gone();
                    if session.ended() == Some(&Ended::Eof) {
                        break End::Io(e);
                    }
                }
            },
            _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                session.on_timeout(now());
            }
        }
    };
    let Some(link) = link else {
        log_refused(&peer, end);
        return;
    };
    let _ = link.tx.send(vec![(0, Op::ConnectionClose)]).await;
    if matches!(end, End::Session(Ended::ClientClosed)) {
        // The client closes the socket once it has our close-ok. Frames it wrote meanwhile
        // (an ack racing its own close, as PerfTest's consumers do) must not meet a closed
        // socket: the client would log a broken pipe. Read them away first, bounded.
        let _ = timeout(CLOSE_LINGER, async {
            let mut discard = [0u8; 4096];
            let mut read = 0;
            while read < CLOSE_LINGER_BYTES {
                match rd.read(&mut discard).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => read += n,
                }
            }
        })
        .await;
    }
    let addr = &peer.addr;
    match end {
        End::Session(Ended::ClientClosed) => {
            tracing::info!(peer = %addr, "connection closed by client")
        }
        End::Session(Ended::Eof) => {
            tracing::info!(peer = %addr, "client went away without closing")
        }
        End::Io(e) => {
            tracing::warn!(peer = %addr, "connection I/O error: {}", Escaped(&e.to_string()))
        }
        End::Session(Ended::Closed(code, text)) => tracing::warn!(
            peer = %addr,
            code,
            "connection closed by the server: {}",
            Escaped(&text)
        ),
        End::BrokerGone => tracing::debug!(peer = %addr, "broker stopped"),
        End::Session(Ended::MissedHeartbeats(secs)) => tracing::warn!(
            peer = %addr,
            "missed heartbeats from client, timeout: {secs}s"
        ),
        // Only the handshake ends these ways, before a link exists.
        End::Session(Ended::HandshakeTimeout | Ended::Refused(..)) => {}
    }
}

/// Logs a connection that ended before it was open.
fn log_refused(peer: &PeerInfo, end: End) {
    match end {
        End::Session(Ended::Refused(code, text)) => {
            tracing::warn!(peer = %peer.addr, code = code.code(), "handshake refused: {}", Escaped(&text))
        }
        End::Session(Ended::HandshakeTimeout) => {
            tracing::warn!(peer = %peer.addr, "handshake not completed in time; closing")
        }
        End::Io(e) => {
            tracing::debug!(peer = %peer.addr, "connection closed during handshake: {}", Escaped(&e.to_string()))
        }
        End::BrokerGone => {
            tracing::debug!(peer = %peer.addr, "connection closed during handshake: broker stopped")
        }
        End::Session(_) => {
            tracing::debug!(peer = %peer.addr, "connection closed during handshake")
        }
    }
}

async fn recv(rx: Option<&mut EffectReceiver>) -> Option<Vec<warren_core::effect::Effect>> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn write<W: AsyncWrite + Unpin>(wr: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    wr.write_all(bytes).await?;
    // A no-op on TCP; TLS streams send what they buffered only on flush.
    wr.flush().await
}

/// Checks the user (by password, or as certified by TLS) and, given a vhost, its access there.
async fn check_login(
    broker: &BrokerHandle,
    login: &Login,
    loopback: bool,
) -> Result<Result<(), String>, warren_runtime::BrokerGone> {
    let vhost = login.vhost.as_deref();
    let answer = match &login.password {
        Some(password) => {
            broker
                .authenticate(&login.user, password, loopback, vhost)
                .await?
        }
        None => {
            broker
                .authenticate_certified(&login.user, loopback, vhost)
                .await?
        }
    };
    Ok(answer.map(|_| ()).map_err(|e| e.to_string()))
}
