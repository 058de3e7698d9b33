//! TLS for the `--amqps`, `--mqtts` and `--mqtt-wss` listeners (rustls, ring provider): the
//! server configuration from PEM files, optional client certificates (RabbitMQ's
//! `verify_peer` / `fail_if_no_peer_cert`), reloading on SIGHUP, and the handshake each
//! connection task runs (bounded in time, one log line when it fails).

use crate::x509;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, ServerConfig, pki_types};

/// How long a client has to complete the TLS handshake (as plain connections have for theirs).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the operator gave: PEM files and the client-certificate policy.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The server's certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA bundle client certificates are verified against (PEM).
    pub ca: Option<PathBuf>,
    /// Ask clients for a certificate and verify it against `ca`.
    pub verify_peer: bool,
    /// With `verify_peer`: refuse clients that present none.
    pub fail_if_no_peer_cert: bool,
    /// Which name of a verified client certificate logs in.
    pub login_from: LoginFrom,
}

/// The name of a verified client certificate that is the user (RabbitMQ's
/// `ssl_cert_login_from`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoginFrom {
    /// The subject's common name (Mosquitto's `use_identity_as_username` too).
    CommonName,
    /// The first subject alternative name that is a DNS name, an email address or a URI
    /// (certificates for devices often carry no CN).
    SubjectAlternativeName,
}

impl std::str::FromStr for LoginFrom {
    type Err = String;

    /// RabbitMQ's names, as the flag and the config file write them.
    fn from_str(s: &str) -> Result<LoginFrom, String> {
        match s {
            "common_name" => Ok(LoginFrom::CommonName),
            "subject_alternative_name" => Ok(LoginFrom::SubjectAlternativeName),
            other => Err(format!(
                "'{other}': expected common_name or subject_alternative_name"
            )),
        }
    }
}

/// Why a TLS listener's configuration cannot be made (each names the file or flag).
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // the fields are the file and why; each variant's text says which
pub enum TlsError {
    /// The certificate chain cannot be read or parsed.
    #[error("cannot read TLS certificate chain {path}: {reason}")]
    Cert { path: PathBuf, reason: String },
    /// The private key cannot be read or parsed.
    #[error("cannot read TLS private key {path}: {reason}")]
    Key { path: PathBuf, reason: String },
    /// The CA bundle cannot be read or parsed.
    #[error("cannot read TLS CA bundle {path}: {reason}")]
    Ca { path: PathBuf, reason: String },
    /// Client certificates asked for without a CA to check them against.
    #[error(
        "--tls-verify-peer needs --tls-ca: the CA bundle client certificates are checked against"
    )]
    NoCa,
    /// rustls refused the combination (key and certificate, CA, versions).
    #[error("invalid TLS configuration: {0}")]
    Config(String),
    /// One listener's error, named by its flag.
    #[error("--{listener}: {source}")]
    Listener {
        listener: &'static str,
        source: Box<TlsError>,
    },
}

impl TlsError {
    /// The error as one listener's: which of the TLS listeners' files are wrong.
    fn of(self, listener: &'static str) -> TlsError {
        TlsError::Listener {
            listener,
            source: Box::new(self),
        }
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads the files and builds a server configuration (TLS 1.2 and 1.3).
pub fn load(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    use pki_types::pem::PemObject;
    let chain: Vec<pki_types::CertificateDer<'static>> =
        pki_types::CertificateDer::pem_file_iter(&files.cert)
            .and_then(|certs| certs.collect::<Result<_, _>>())
            .map_err(|e| TlsError::Cert {
                path: files.cert.clone(),
                reason: e.to_string(),
            })?;
    if chain.is_empty() {
        return Err(TlsError::Cert {
            path: files.cert.clone(),
            reason: "no CERTIFICATE block in it".into(),
        });
    }
    let key = pki_types::PrivateKeyDer::from_pem_file(&files.key).map_err(|e| TlsError::Key {
        path: files.key.clone(),
        reason: e.to_string(),
    })?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = if files.verify_peer {
        let ca = files.ca.as_ref().ok_or(TlsError::NoCa)?;
        let ca_error = |reason: String| TlsError::Ca {
            path: ca.clone(),
            reason,
        };
        let mut roots = rustls::RootCertStore::empty();
        for cert in
            pki_types::CertificateDer::pem_file_iter(ca).map_err(|e| ca_error(e.to_string()))?
        {
            let cert = cert.map_err(|e| ca_error(e.to_string()))?;
            roots.add(cert).map_err(|e| ca_error(e.to_string()))?;
        }
        if roots.is_empty() {
            return Err(ca_error("no CERTIFICATE block in it".into()));
        }
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        );
        let verifier = if files.fail_if_no_peer_cert {
            verifier
        } else {
            verifier.allow_unauthenticated()
        };
        let verifier = verifier
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let config = builder
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(format!("certificate and key do not go together: {e}")))?;
    Ok(Arc::new(config))
}

/// The server configurations of the TLS listeners, one per listener kind (`amqps`, `mqtts`,
/// `mqtt-wss`: each may have its own files, as Mosquitto's per-listener `certfile`), which
/// SIGHUP (or `warren ctl reload-tls`) replaces: connections accepted afterwards use the new
/// certificates, open ones keep theirs.
pub struct Reloadable {
    listeners: Vec<(&'static str, TlsFiles, RwLock<Arc<ServerConfig>>)>,
}

impl Reloadable {
    /// Reads every listener's files; the first that fails names its listener.
    pub fn new(listeners: Vec<(&'static str, TlsFiles)>) -> Result<Reloadable, TlsError> {
        let mut loaded = Vec::with_capacity(listeners.len());
        for (listener, files) in listeners {
            let config = load(&files).map_err(|e| e.of(listener))?;
            loaded.push((listener, files, RwLock::new(config)));
        }
        Ok(Reloadable { listeners: loaded })
    }

    /// Reads all the files again; if any fails, every listener keeps its configuration (a
    /// half-applied reload would leave the operator guessing which certificate is served).
    pub fn reload(&self) -> Result<(), TlsError> {
        let mut fresh = Vec::with_capacity(self.listeners.len());
        for (listener, files, _) in &self.listeners {
            fresh.push(load(files).map_err(|e| e.of(listener))?);
        }
        for ((_, _, current), config) in self.listeners.iter().zip(fresh) {
            // A poisoned lock only means a panic elsewhere while replacing an Arc: the
            // value is still a whole configuration.
            *current.write().unwrap_or_else(|p| p.into_inner()) = config;
        }
        Ok(())
    }

    /// Which certificate name of the listener kind's clients logs in.
    pub fn login_from(&self, listener: &str) -> LoginFrom {
        self.listeners
            .iter()
            .find(|(l, _, _)| *l == listener)
            .map_or(LoginFrom::CommonName, |(_, files, _)| files.login_from)
    }

    /// The acceptor of the listener kind's current configuration.
    pub fn acceptor(&self, listener: &str) -> Option<TlsAcceptor> {
        let (_, _, current) = self.listeners.iter().find(|(l, _, _)| *l == listener)?;
        Some(TlsAcceptor::from(
            current.read().unwrap_or_else(|p| p.into_inner()).clone(),
        ))
    }
}

/// Runs the server side of the handshake on `socket` (in the connection's own task), at most
/// [`HANDSHAKE_TIMEOUT`]. `None` after one warning naming the peer and the reason.
pub async fn accept(
    tls: &Reloadable,
    socket: TcpStream,
    peer: SocketAddr,
    listener: &str,
) -> Option<(tokio_rustls::server::TlsStream<TcpStream>, Option<String>)> {
    let login_from = tls.login_from(listener);
    let Some(acceptor) = tls.acceptor(listener) else {
        tracing::error!(%peer, listener, "no TLS configuration for this listener; closing");
        return None;
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(socket)).await {
        Ok(Ok(stream)) => {
            let identity = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|cert| match login_from {
                    LoginFrom::CommonName => x509::subject_cn(cert.as_ref()),
                    LoginFrom::SubjectAlternativeName => x509::subject_alt_name(cert.as_ref()),
                });
            Some((stream, identity))
        }
        Ok(Err(e)) => {
            tracing::warn!(%peer, listener, "TLS handshake failed: {}", warren_core::escape::Escaped(&e.to_string()));
            None
        }
        Err(_) => {
            tracing::warn!(
                %peer,
                listener,
                "TLS handshake not completed within {HANDSHAKE_TIMEOUT:?}; closing"
            );
            None
        }
    }
}
