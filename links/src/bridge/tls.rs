//! TLS to the remote broker, Mosquitto's `bridge_cafile` / `bridge_capath` (either turns TLS
//! on), `bridge_certfile` + `bridge_keyfile` (a client certificate), `bridge_insecure` (the
//! chain is verified, the name in it is not), `bridge_tls_version` and `bridge_alpn`: a
//! rustls client configuration (ring provider), made from the files at each session start
//! (a renewed certificate is picked up on the next connect) and checked once when the
//! config file is read.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, Error, SignatureScheme};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A bridge's TLS settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    pub cafile: Option<PathBuf>,
    pub capath: Option<PathBuf>,
    /// The client certificate chain and its key.
    pub client: Option<(PathBuf, PathBuf)>,
    pub insecure: bool,
    /// `None`: TLS 1.2 and 1.3; else Mosquitto's `tlsv1.2` or `tlsv1.3`.
    pub version: Option<String>,
    pub alpn: Option<String>,
}

/// Files in a CA directory read at most.
const CAPATH_FILES: usize = 1024;

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let all = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if all.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(all)
}

/// Mosquitto's `bridge_tls_version` values.
pub fn version(v: &str) -> Result<&'static rustls::SupportedProtocolVersion, String> {
    match v {
        "tlsv1.3" => Ok(&rustls::version::TLS13),
        "tlsv1.2" => Ok(&rustls::version::TLS12),
        other => Err(format!(
            "bridge_tls_version {other:?}: expected \"tlsv1.2\" or \"tlsv1.3\" (older versions are not supported)"
        )),
    }
}

/// The trusted roots.
fn roots(s: &TlsSettings) -> Result<rustls::RootCertStore, String> {
    let mut store = rustls::RootCertStore::empty();
    let mut add = |cs: Vec<CertificateDer<'static>>, from: &Path| {
        for c in cs {
            store
                .add(c)
                .map_err(|e| format!("{}: {e}", from.display()))?;
        }
        Ok::<(), String>(())
    };
    if let Some(f) = &s.cafile {
        add(certs(f).map_err(|e| format!("bridge_cafile {e}"))?, f)?;
    }
    if let Some(dir) = &s.capath {
        let entries =
            std::fs::read_dir(dir).map_err(|e| format!("bridge_capath {}: {e}", dir.display()))?;
        for entry in entries.take(CAPATH_FILES) {
            let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
            // Mosquitto's capath holds PEM certificates (and c_rehash links to them).
            if path.is_file()
                && let Ok(cs) = certs(&path)
            {
                add(cs, &path)?;
            }
        }
    }
    if store.is_empty() {
        return Err("bridge_cafile / bridge_capath: no CA certificate found".into());
    }
    Ok(store)
}

/// Verifies the chain as usual; a name that does not match is accepted (`bridge_insecure`).
#[derive(Debug)]
struct NoNameCheck(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for NoNameCheck {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The client configuration of `s`, from its files now.
pub fn client_config(s: &TlsSettings) -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let versions: Vec<&'static rustls::SupportedProtocolVersion> = match &s.version {
        Some(v) => vec![version(v)?],
        None => vec![&rustls::version::TLS13, &rustls::version::TLS12],
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&versions)
        .map_err(|e| format!("TLS: {e}"))?;
    let roots = Arc::new(roots(s)?);
    let builder = if s.insecure {
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider)
            .build()
            .map_err(|e| format!("TLS: {e}"))?;
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoNameCheck(verifier)))
    } else {
        builder.with_root_certificates(roots)
    };
    let mut config = match &s.client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = certs(cert).map_err(|e| format!("bridge_certfile {e}"))?;
            let key = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| format!("bridge_keyfile {}: {e}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("bridge_certfile / bridge_keyfile: {e}"))?
        }
    };
    if let Some(a) = &s.alpn {
        config.alpn_protocols = vec![a.as_bytes().to_vec()];
    }
    Ok(config)
}
