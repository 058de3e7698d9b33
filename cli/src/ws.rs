//! MQTT over WebSocket (`--mqtt-ws`, `--mqtt-wss`): the HTTP upgrade (path and subprotocol
//! `mqtt` checked, a clear HTTP error and one log line otherwise) and a byte stream over
//! binary messages, so the MQTT connection task runs unchanged on top. MQTT packets and
//! WebSocket messages are independent (MQTT-6.0.0-2): a packet may span messages and a
//! message may hold several packets; the byte stream makes both work.

use bytes::{Buf, Bytes};
use futures_util::{Sink, Stream};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

/// A WebSocket message may be this much larger than the largest MQTT packet: a client may
/// pack several packets into one message.
pub const SLACK: usize = 64 * 1024;

/// The subprotocols MQTT clients offer: `mqtt` (3.1.1 and 5.0) and `mqttv3.1` (3.1).
const SUBPROTOCOLS: [&str; 2] = ["mqtt", "mqttv3.1"];

/// Upgrades `stream` if the request asks for `path` and offers an MQTT subprotocol; `None`
/// after one warning naming the peer and the reason (the client got an HTTP error).
// The handshake callback's error type is tungstenite's (an HTTP response), not ours.
#[allow(clippy::result_large_err)]
pub async fn accept<S>(
    stream: S,
    path: &str,
    max_message: usize,
    peer: SocketAddr,
    listener: &str,
) -> Option<WsStream<S>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let refusal: Arc<Mutex<Option<String>>> = Arc::default();
    let refused = refusal.clone();
    let check = move |request: &Request, mut response: Response| {
        let refuse = |status: StatusCode, reason: String| {
            let mut error = ErrorResponse::new(Some(format!("{reason}\n")));
            *error.status_mut() = status;
            *refused.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
            error
        };
        if request.uri().path() != path {
            return Err(refuse(
                StatusCode::NOT_FOUND,
                format!(
                    "no MQTT WebSocket endpoint at {:?}; this listener serves {path:?}",
                    request.uri().path()
                ),
            ));
        }
        let offered: Vec<&str> = request
            .headers()
            .get_all("sec-websocket-protocol")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect();
        let Some(chosen) = offered
            .iter()
            .find(|p| SUBPROTOCOLS.contains(&p.to_ascii_lowercase().as_str()))
        else {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                format!(
                    "WebSocket subprotocol {offered:?} offered; MQTT over WebSocket needs \
                     Sec-WebSocket-Protocol: mqtt"
                ),
            ));
        };
        if let Ok(value) = HeaderValue::from_str(chosen) {
            response
                .headers_mut()
                .insert("sec-websocket-protocol", value);
        }
        Ok(response)
    };
    let mut config = WebSocketConfig::default();
    // Bounded: one message never holds more than the largest MQTT packet plus some slack
    // for a client that packs several packets into one message.
    config.max_message_size = Some(max_message);
    config.max_frame_size = Some(max_message);
    let upgrade = tokio_tungstenite::accept_hdr_async_with_config(stream, check, Some(config));
    // Bounded as every other handshake: a client that stalls the upgrade is dropped.
    let Ok(upgraded) = tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, upgrade).await else {
        tracing::warn!(
            %peer,
            listener,
            "WebSocket upgrade not completed within {:?}; closing",
            crate::tls::HANDSHAKE_TIMEOUT
        );
        return None;
    };
    match upgraded {
        Ok(ws) => Some(WsStream {
            ws,
            read: Bytes::new(),
        }),
        Err(e) => {
            let reason = refusal
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .unwrap_or_else(|| e.to_string());
            tracing::warn!(%peer, listener, "WebSocket upgrade refused: {reason}");
            None
        }
    }
}

/// The bytes of the binary messages of a WebSocket, as a stream; each write is one binary
/// message.
pub struct WsStream<S> {
    ws: WebSocketStream<S>,
    /// The rest of the last message received.
    read: Bytes,
}

fn io_error(e: WsError) -> std::io::Error {
    match e {
        WsError::Io(e) => e,
        other => std::io::Error::other(other),
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            if !self.read.is_empty() {
                let n = self.read.len().min(buf.remaining());
                buf.put_slice(&self.read[..n]);
                self.read.advance(n);
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut self.ws).poll_next(cx)) {
                Some(Ok(Message::Binary(data))) => self.read = data,
                // Answered by tungstenite itself on the next read or write.
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                // MQTT-6.0.0-1: anything but binary data closes the connection.
                Some(Ok(Message::Text(_))) => {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "text WebSocket message: MQTT needs binary messages",
                    )));
                }
                Some(Ok(Message::Close(_))) | None => return Poll::Ready(Ok(())),
                Some(Err(e)) => return Poll::Ready(Err(io_error(e))),
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let mut ws = Pin::new(&mut self.ws);
        ready!(ws.as_mut().poll_ready(cx)).map_err(io_error)?;
        ws.start_send(Message::Binary(Bytes::copy_from_slice(buf)))
            .map_err(io_error)?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.ws).poll_flush(cx).map_err(io_error)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match ready!(Pin::new(&mut self.ws).poll_close(cx)) {
            Ok(()) | Err(WsError::ConnectionClosed | WsError::AlreadyClosed) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(io_error(e))),
        }
    }
}
