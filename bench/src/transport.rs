//! How the bench clients reach a broker: plain TCP, TLS (`amqps://`, `mqtts://`), MQTT over
//! WebSocket (`ws://`) and over secure WebSocket (`wss://`). TLS trusts any server
//! certificate, as PerfTest does for `amqps://` (a load generator measures, it does not
//! authenticate), and resumes no session, so every connection pays a full handshake.

use anyhow::{Context, anyhow};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio_rustls::rustls::{self, pki_types};

/// Connecting, the TLS handshake and the WebSocket upgrade together must finish within this.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What runs over the TCP connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Tls,
    /// MQTT over WebSocket at this HTTP path.
    Ws(String),
    /// MQTT over WebSocket over TLS at this HTTP path.
    Wss(String),
}

impl Transport {
    /// The scheme's name, for result rows.
    pub fn name(&self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Tls => "tls",
            Transport::Ws(_) => "ws",
            Transport::Wss(_) => "wss",
        }
    }
}

/// Any connected byte stream.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

/// The reading half: TCP's own split (no lock) or a split of the layered stream.
pub enum ReadHalf {
    Tcp(OwnedReadHalf),
    Layered(tokio::io::ReadHalf<Box<dyn Io>>),
}

/// The writing half, as [`ReadHalf`].
pub enum WriteHalf {
    Tcp(OwnedWriteHalf),
    Layered(tokio::io::WriteHalf<Box<dyn Io>>),
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Tcp(r) => Pin::new(r).poll_read(cx, buf),
            ReadHalf::Layered(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => Pin::new(w).poll_write(cx, buf),
            WriteHalf::Layered(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => Pin::new(w).poll_flush(cx),
            WriteHalf::Layered(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => Pin::new(w).poll_shutdown(cx),
            WriteHalf::Layered(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}

/// Connects to `addr` (`host:port`) over `transport`.
pub async fn connect(addr: &str, transport: &Transport) -> anyhow::Result<(ReadHalf, WriteHalf)> {
    tokio::time::timeout(CONNECT_TIMEOUT, connect_inner(addr, transport))
        .await
        .map_err(|_| anyhow!("connecting to {addr} ({}) timed out", transport.name()))?
}

async fn connect_inner(addr: &str, transport: &Transport) -> anyhow::Result<(ReadHalf, WriteHalf)> {
    let tcp = TcpStream::connect(addr)
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    tcp.set_nodelay(true)?;
    let layered: Box<dyn Io> = match transport {
        Transport::Tcp => {
            let (rd, wr) = tcp.into_split();
            return Ok((ReadHalf::Tcp(rd), WriteHalf::Tcp(wr)));
        }
        Transport::Tls => Box::new(tls(addr, tcp).await?),
        Transport::Ws(path) => Box::new(ws(addr, path, "ws", tcp).await?),
        Transport::Wss(path) => {
            let secure = tls(addr, tcp).await?;
            Box::new(ws(addr, path, "wss", secure).await?)
        }
    };
    let (rd, wr) = tokio::io::split(layered);
    Ok((ReadHalf::Layered(rd), WriteHalf::Layered(wr)))
}

async fn tls(
    addr: &str,
    tcp: TcpStream,
) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let host = addr
        .rsplit_once(':')
        .map_or(addr, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let name = pki_types::ServerName::try_from(host.to_string())
        .with_context(|| format!("{host:?} is no TLS server name"))?;
    tokio_rustls::TlsConnector::from(client_config()?)
        .connect(name, tcp)
        .await
        .with_context(|| format!("TLS handshake with {addr}"))
}

async fn ws<S: AsyncRead + AsyncWrite + Unpin>(
    addr: &str,
    path: &str,
    scheme: &str,
    stream: S,
) -> anyhow::Result<warren_runtime::ws::WsStream<S>> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut request = format!("{scheme}://{addr}{path}").into_client_request()?;
    request
        .headers_mut()
        .insert("sec-websocket-protocol", "mqtt".parse()?);
    let (ws, _) = tokio_tungstenite::client_async(request, stream)
        .await
        .with_context(|| format!("WebSocket upgrade at {scheme}://{addr}{path}"))?;
    Ok(warren_runtime::ws::WsStream::new(ws))
}

/// One client configuration for every connection: TLS 1.3 or 1.2 as the server prefers, any
/// certificate, no resumption.
fn client_config() -> anyhow::Result<Arc<rustls::ClientConfig>> {
    static CONFIG: std::sync::OnceLock<Result<Arc<rustls::ClientConfig>, String>> =
        std::sync::OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth();
            config.resumption = rustls::client::Resumption::disabled();
            Ok(Arc::new(config))
        })
        .clone()
        .map_err(|e| anyhow!("TLS client configuration: {e}"))
}

/// Accepts any server certificate, but still checks the handshake's signatures (so the
/// server does the same work it does for a verifying client).
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &pki_types::CertificateDer<'_>,
        _intermediates: &[pki_types::CertificateDer<'_>],
        _server_name: &pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
