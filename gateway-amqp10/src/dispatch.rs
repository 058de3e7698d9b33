//! The listener's protocol dispatch: as in RabbitMQ 4, the AMQP port serves both 0.9.1 and
//! 1.0, and the client's 8-byte protocol header decides. This crate cannot name the 0.9.1
//! gateway (no gateway depends on another), so the 0.9.1 side is a closure the binary gives,
//! handed the stream with the bytes already read replayed ([`Prefixed`]).

use crate::connection::{PeerInfo, is_amqp10_header, serve_connection};
use crate::session::Config;
use bytes::BytesMut;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use warren_runtime::BrokerHandle;

/// How long a new connection may take to send its protocol header (0.9.1's handshake
/// timeout): a silent client is handed to the 0.9.1 side, whose own timeout ends it.
const HEADER_WAIT: Duration = Duration::from_secs(10);

/// A stream whose first bytes were read already and are given again to the next reader.
pub struct Prefixed<S> {
    prefix: [u8; 8],
    len: usize,
    pos: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.pos < this.len {
            let rest = &this.prefix[this.pos..this.len];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

fn default_config() -> Arc<Config> {
    static CONFIG: OnceLock<Arc<Config>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            Arc::new(Config {
                check_open: true,
                ..Config::default()
            })
        })
        .clone()
}

/// Reads the protocol header: AMQP 1.0 (plain or SASL) is served here, anything else goes
/// to `other` with the header replayed.
pub async fn dispatch<S, F, Fut>(
    mut stream: S,
    peer: PeerInfo,
    broker: BrokerHandle,
    shutdown: watch::Receiver<bool>,
    other: F,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: FnOnce(Prefixed<S>) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut prefix = [0u8; 8];
    let mut len = 0;
    let read = tokio::time::timeout(HEADER_WAIT, async {
        while len < prefix.len() {
            match stream.read(&mut prefix[len..]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => len += n,
            }
        }
    });
    let _ = read.await;
    if len == prefix.len() && is_amqp10_header(&prefix) {
        // Boxed: a 0.9.1 connection's task is not laid out over the 1.0 one's state.
        let future = serve_connection(
            stream,
            BytesMut::from(&prefix[..]),
            peer,
            broker,
            default_config(),
            shutdown,
        );
        Box::pin(future).await;
    } else {
        // The 0.9.1 side has its own.
        drop(peer);
        other(Prefixed {
            prefix,
            len,
            pos: 0,
            inner: stream,
        })
        .await;
    }
}
