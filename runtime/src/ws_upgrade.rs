//! MQTT over WebSocket (`--mqtt-ws`, `--mqtt-wss`): the HTTP upgrade (path and subprotocol
//! `mqtt` checked, a clear HTTP error and one log line otherwise) and a byte stream over
//! binary messages, so the MQTT connection task runs unchanged on top. MQTT packets and
//! WebSocket messages are independent (MQTT-6.0.0-2): a packet may span messages and a
//! message may hold several packets; the byte stream makes both work.

pub use crate::ws::WsStream;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use warren_core::escape::Escaped;

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
        Ok(ws) => Some(WsStream::new(ws)),
        Err(e) => {
            let reason = refusal
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .unwrap_or_else(|| e.to_string());
            tracing::warn!(%peer, listener, "WebSocket upgrade refused: {}", Escaped(&reason));
            None
        }
    }
}
