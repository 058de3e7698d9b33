//! The TCP transport between cluster nodes (docs/cluster.md, "Transport").
//!
//! Frames: a 4-byte big-endian length, then that many bytes of JSON; a frame over
//! [`MAX_FRAME`] closes the connection. A connection starts with a mutual challenge-response
//! over a shared cluster secret (the secret itself never crosses the wire):
//!
//! 1. client -> server `Hello { version, from, nonce_c }`
//! 2. server -> client `Challenge { from, nonce_s, proof_s = HMAC(secret, "server" | nonce_c | nonce_s | from_s) }`
//! 3. client checks `proof_s` (constant time), sends `Proof { proof_c = HMAC(secret, "client" | nonce_s | nonce_c | from_c) }`
//! 4. server checks `proof_c` (constant time): the connection then carries RPCs.
//!
//! After that the client sends `Envelope { group, rpc }` frames and reads one reply frame per
//! request, in order. The brokers' mail (`Rpc::Mail`) goes as a binary frame instead when the
//! server's `Challenge` says `binary_mail` (every node of this version does): the same 4-byte
//! length, then the byte 0x00 (a JSON frame's body starts with `{`), then the batch's bytes
//! as they are; a server reads both forms, and a client of an older server (no
//! `binary_mail`) sends the JSON one. Each peer has one outgoing connection owned by one task that takes
//! requests from a bounded channel (openraft's replication waits when it is full: back-pressure)
//! and reconnects with exponential backoff after a failure.
//!
//! With [`ClusterTls`] (`--cluster-tls-cert/-key/-ca`) every connection is TLS 1.2/1.3 with
//! certificates checked both ways against the operator's CA, and the handshake above then
//! runs inside it (the secret still has to be known: defense in depth). The same code serves
//! both: connections are a boxed `AsyncRead + AsyncWrite` ([`Conn`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use openraft::BasicNode;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::{NodeId, Raft, TypeConfig};

/// The largest frame either side accepts: a snapshot chunk (1 MiB, `raft_config`) or an
/// append of up to `max_payload_entries` metadata entries fits with room to spare.
pub const MAX_FRAME: usize = 16 * 1024 * 1024;
/// The largest handshake frame: before a peer has proved the secret it cannot make this node
/// allocate more than this per connection (a 16 MiB frame times 256 connections would be 4 GiB).
pub const MAX_HANDSHAKE_FRAME: usize = 1024;
/// Protocol version in the handshake; a node of another version is refused.
pub const VERSION: u32 = 1;
/// Requests queued for one peer before callers wait.
pub const PEER_QUEUE: usize = 64;
/// Incoming connections served at once; more wait in the listen backlog.
pub const MAX_INCOMING: usize = 256;
/// The handshake must finish within this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// An incoming connection with no request for this long is closed (peers send heartbeats
/// many times a second).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest a request waits for its reply when openraft gives no deadline.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(10);
const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// At most this between attempts to reach a peer that is down or cut off: an attempt costs a
/// failed connect, and once a partition heals the nodes find each other within it (with 2 s
/// here, a healed leader heard of its successor up to 3 s late).
const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// Transport failures.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes is over the limit")]
    FrameTooBig(usize),
    #[error("bad frame: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("bad binary frame: {0}")]
    Encode(String),
    #[error("peer failed authentication (wrong cluster secret?)")]
    BadProof,
    #[error("peer speaks protocol version {0}, this node {VERSION}")]
    Version(u32),
    #[error("unexpected message during the handshake")]
    Protocol,
    #[error("timed out")]
    Timeout,
    #[error("no group {0} on this node")]
    NoGroup(u64),
    #[error("peer {0} unreachable (backing off)")]
    BackingOff(NodeId),
    #[error("transport closed")]
    Closed,
    #[error("the peer refused: {0}")]
    Remote(String),
    #[error("TLS: {0}")]
    Tls(std::io::Error),
    #[error("peer does not speak TLS (a node without --cluster-tls-*?); this node requires it")]
    NotTls,
    #[error("peer speaks TLS; this node has no --cluster-tls-* configured")]
    PeerTls,
}

/// Why the cluster TLS files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("cannot read {what} {path}: {reason}")]
    File {
        what: &'static str,
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("cluster TLS: {0}")]
    Invalid(String),
}

/// TLS of the cluster port: this node's certificate and key, and the CA every peer's
/// certificate must chain to (as a server it requires a client certificate; as a client it
/// checks the server's against the IP address it dials, so each node's certificate carries
/// its cluster IP as a subject alternative name). Clones share one configuration, which
/// [`ClusterTls::reload_from`] replaces for every clone: connections made afterwards (in
/// and out) use the new certificate and CA, open ones keep theirs.
#[derive(Clone)]
pub struct ClusterTls(Arc<std::sync::RwLock<TlsConfigs>>);

struct TlsConfigs {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls(..)")
    }
}

impl ClusterTls {
    fn server(&self) -> Arc<rustls::ServerConfig> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .server
            .clone()
    }

    fn client(&self) -> Arc<rustls::ClientConfig> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .client
            .clone()
    }

    /// Takes `fresh`'s certificate, key and CA (files read again, on SIGHUP): every clone of
    /// this one uses them for the connections it makes or accepts from now on.
    pub fn reload_from(&self, fresh: &ClusterTls) {
        if Arc::ptr_eq(&self.0, &fresh.0) {
            return;
        }
        let (server, client) = (fresh.server(), fresh.client());
        let mut me = self.0.write().unwrap_or_else(|p| p.into_inner());
        me.server = server;
        me.client = client;
    }

    /// Reads the PEM files: the certificate chain, its private key and the CA bundle.
    pub fn from_pem_files(
        cert: &std::path::Path,
        key: &std::path::Path,
        ca: &std::path::Path,
    ) -> Result<Self, TlsConfigError> {
        let read = |what: &'static str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| TlsConfigError::File {
                what,
                path: path.to_path_buf(),
                reason: e.to_string(),
            })
        };
        Self::from_pem(
            &read("certificate chain", cert)?,
            &read("private key", key)?,
            &read("CA bundle", ca)?,
        )
    }

    /// As [`ClusterTls::from_pem_files`] from the files' contents.
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8]) -> Result<Self, TlsConfigError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let invalid =
            |what: &str, e: &dyn std::fmt::Display| TlsConfigError::Invalid(format!("{what}: {e}"));
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<_, _>>()
            .map_err(|e| invalid("certificate chain", &e))?;
        if chain.is_empty() {
            return Err(invalid("certificate chain", &"no CERTIFICATE block"));
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| invalid("private key", &e))?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca) {
            let c = c.map_err(|e| invalid("CA bundle", &e))?;
            roots.add(c).map_err(|e| invalid("CA bundle", &e))?;
        }
        if roots.is_empty() {
            return Err(invalid("CA bundle", &"no CERTIFICATE block"));
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let versions: &[&rustls::SupportedProtocolVersion] =
            &[&rustls::version::TLS13, &rustls::version::TLS12];
        // Mutual: a peer without a certificate of the CA gets no connection.
        let client_verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| invalid("CA bundle", &e))?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(|e| invalid("protocol versions", &e))?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| invalid("certificate and key", &e))?;
        // Connections live long and reconnect rarely: no resumption tickets (which would
        // also be bytes after the handshake that nobody asked for).
        server.send_tls13_tickets = 0;
        let server_verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| invalid("CA bundle", &e))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .map_err(|e| invalid("protocol versions", &e))?
            .with_webpki_verifier(server_verifier)
            .with_client_auth_cert(chain, key)
            .map_err(|e| invalid("certificate and key", &e))?;
        Ok(Self(Arc::new(std::sync::RwLock::new(TlsConfigs {
            server: Arc::new(server),
            client: Arc::new(client),
        }))))
    }
}

/// A connection between nodes: plain TCP or TLS over it.
pub trait Conn: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Conn for T {}

/// The first byte of a TLS connection (a handshake record). A plain one starts with the
/// top byte of a handshake frame's length (at most 1 KiB): 0.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Dials `addr` (IP:PORT), with TLS when `tls` is set (the server's certificate must name
/// the IP dialled).
async fn dial(addr: &str, tls: Option<&ClusterTls>) -> Result<Box<dyn Conn>, TransportError> {
    let s = TcpStream::connect(addr).await?;
    let _ = s.set_nodelay(true);
    let Some(tls) = tls else {
        return Ok(Box::new(s));
    };
    let name = rustls::pki_types::ServerName::IpAddress(s.peer_addr()?.ip().into());
    let s = tokio_rustls::TlsConnector::from(tls.client())
        .connect(name, s)
        .await
        .map_err(TransportError::Tls)?;
    Ok(Box::new(s))
}

/// The server side of a new connection: with `tls`, refuses a peer that does not start a
/// TLS handshake or has no certificate of the CA; without, one that does (each with its
/// own log line, so a misconfigured node is found quickly).
async fn accept(
    sock: TcpStream,
    tls: Option<&ClusterTls>,
) -> Result<Box<dyn Conn>, TransportError> {
    let _ = sock.set_nodelay(true);
    let mut first = [0u8; 1];
    if sock.peek(&mut first).await? == 0 {
        return Err(TransportError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    match tls {
        None if first[0] == TLS_HANDSHAKE_RECORD => Err(TransportError::PeerTls),
        None => Ok(Box::new(sock)),
        Some(_) if first[0] != TLS_HANDSHAKE_RECORD => Err(TransportError::NotTls),
        Some(tls) => Ok(Box::new(
            tokio_rustls::TlsAcceptor::from(tls.server())
                .accept(sock)
                .await
                .map_err(TransportError::Tls)?,
        )),
    }
}

/// Whether a connection idle between requests is still usable: no end-of-file, error or
/// stray bytes waiting (polled once, never waits).
async fn still_open(s: &mut Box<dyn Conn>) -> bool {
    let mut probe = [0u8; 1];
    std::future::poll_fn(|cx| {
        let mut buf = tokio::io::ReadBuf::new(&mut probe);
        match std::pin::Pin::new(&mut *s).poll_read(cx, &mut buf) {
            std::task::Poll::Pending => std::task::Poll::Ready(true),
            // End-of-file, an error, or bytes nobody asked for (out of step).
            std::task::Poll::Ready(_) => std::task::Poll::Ready(false),
        }
    })
    .await
}

/// The shared cluster secret (as RabbitMQ's Erlang cookie). Never logged, never sent.
#[derive(Clone)]
pub struct Secret(Arc<Vec<u8>>);

impl Secret {
    pub fn new(bytes: Vec<u8>) -> Self {
        Self(Arc::new(bytes))
    }
    fn proof(&self, role: &[u8], a: &[u8; 32], b: &[u8; 32], id: NodeId) -> [u8; 32] {
        // HMAC accepts keys of any length; new_from_slice cannot fail for it.
        let mut m = match Hmac::<Sha256>::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => return [0; 32],
        };
        m.update(b"warren-cluster-v1 ");
        m.update(role);
        m.update(a);
        m.update(b);
        m.update(&id.to_be_bytes());
        m.finalize().into_bytes().into()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

fn nonce() -> Result<[u8; 32], TransportError> {
    let mut n = [0u8; 32];
    getrandom::getrandom(&mut n).map_err(|e| TransportError::Io(std::io::Error::other(e)))?;
    Ok(n)
}

#[derive(Serialize, Deserialize)]
enum Handshake {
    Hello {
        version: u32,
        from: NodeId,
        nonce: [u8; 32],
    },
    Challenge {
        from: NodeId,
        nonce: [u8; 32],
        proof: [u8; 32],
        /// The server reads binary mail frames ([`MAIL_FRAME`]). Absent from an older
        /// server's challenge (false); an older client ignores it.
        #[serde(default)]
        binary_mail: bool,
        /// The server reads binary append frames ([`APPEND_FRAME`]); absent (false) from an
        /// older server.
        #[serde(default)]
        binary_append: bool,
    },
    Proof {
        proof: [u8; 32],
    },
    Welcome,
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    group: u64,
    rpc: Rpc,
}

#[derive(Serialize, Deserialize)]
enum Rpc {
    Append(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    Snapshot(InstallSnapshotRequest<TypeConfig>),
    /// A command a follower forwards to the leader (one hop: the leader proposes it itself
    /// and never forwards again).
    Write(crate::Command),
    /// Remove a member from the group (forwarded to the leader, as a write).
    Forget(NodeId),
    /// Add a member (id, cluster address): a learner first, a voter once caught up
    /// (forwarded to the leader).
    Join(NodeId, String),
    /// The brokers' mail between nodes (a batch, encoded by the host): publishes
    /// forwarded to a queue's home node and its answers (docs/cluster.md, "Queues live on
    /// one node"). Not a group's: the envelope's group is ignored. Sent on a connection of
    /// its own (`MAIL_LANE`), so a big batch never delays the Raft heartbeats.
    Mail(Vec<u8>),
    /// A question of the hosts' (its bytes are theirs), answered by the peer's
    /// [`AskHandler`]: what a node must know of another's broker before it proposes a change
    /// (a queue's consumers and messages there, for a conditional `queue.delete`). Not a
    /// group's, as `Mail`; sent on the mail connection.
    Ask(Vec<u8>),
}

#[derive(Serialize, Deserialize)]
enum RpcReply {
    Append(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    Snapshot(Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>),
    /// The forwarded write's reply, or why it failed (e.g. this node no longer leads).
    Write(Result<crate::Reply, String>),
    /// The envelope named a group this node does not run.
    NoGroup(u64),
    /// The mail was handed to this node's broker, whose incarnation it gives (or why not).
    Mail(Result<u64, String>),
    /// The answer to an `Ask` (bytes of the hosts'), or why there is none.
    Ask(Result<Vec<u8>, String>),
}

async fn write_frame<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), TransportError> {
    let body = serde_json::to_vec(msg)?;
    if body.len() > MAX_FRAME {
        return Err(TransportError::FrameTooBig(body.len()));
    }
    // Length and body in one write: one segment for small frames.
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf).await?;
    w.flush().await?;
    Ok(())
}

/// The first body byte of a binary mail frame (a JSON envelope's is `{`).
const MAIL_FRAME: u8 = 0;
/// The first body byte of a binary append request (`crate::codec::encode_append`): a
/// quorum queue's entries are mostly message bytes, which JSON would carry as base64.
const APPEND_FRAME: u8 = 1;

/// Which binary frames the server of a connection reads (its `Challenge` says so).
#[derive(Clone, Copy, Debug, Default)]
struct Frames {
    mail: bool,
    append: bool,
}

impl Frames {
    #[cfg(test)]
    const ALL: Frames = Frames {
        mail: true,
        append: true,
    };
}

/// Writes `env`: a binary frame for mail and append requests when the peer reads them,
/// else JSON.
async fn write_envelope<W: AsyncWrite + Unpin>(
    w: &mut W,
    env: &Envelope,
    frames: Frames,
) -> Result<(), TransportError> {
    let mut buf = Vec::new();
    buf.extend_from_slice(&[0; 4]);
    match &env.rpc {
        Rpc::Mail(batch) if frames.mail => {
            buf.reserve(1 + batch.len());
            buf.push(MAIL_FRAME);
            buf.extend_from_slice(batch);
        }
        Rpc::Append(r) if frames.append => {
            let size: usize = r
                .entries
                .iter()
                .map(|e| match &e.payload {
                    openraft::EntryPayload::Normal(c) => c.0.len() + 34,
                    _ => 64,
                })
                .sum();
            buf.reserve(80 + size);
            buf.push(APPEND_FRAME);
            crate::codec::encode_append(env.group, r, &mut buf)
                .map_err(|e| TransportError::Encode(e.to_string()))?;
        }
        _ => return write_frame(w, env).await,
    }
    let len = buf.len() - 4;
    if len > MAX_FRAME {
        return Err(TransportError::FrameTooBig(len));
    }
    buf[..4].copy_from_slice(&(len as u32).to_be_bytes());
    w.write_all(&buf).await?;
    w.flush().await?;
    Ok(())
}

/// Reads an envelope: a binary mail frame or JSON.
async fn read_envelope<R: AsyncRead + Unpin>(r: &mut R) -> Result<Envelope, TransportError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(TransportError::FrameTooBig(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    match body.first() {
        Some(&MAIL_FRAME) => {
            body.remove(0);
            return Ok(Envelope {
                group: 0,
                rpc: Rpc::Mail(body),
            });
        }
        Some(&APPEND_FRAME) => {
            let (group, r) = crate::codec::decode_append(&body[1..])
                .map_err(|e| TransportError::Encode(e.to_string()))?;
            return Ok(Envelope {
                group,
                rpc: Rpc::Append(r),
            });
        }
        _ => {}
    }
    Ok(serde_json::from_slice(&body)?)
}

async fn read_frame<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
) -> Result<T, TransportError> {
    read_frame_max(r, MAX_FRAME).await
}

/// A handshake frame: bounded by [`MAX_HANDSHAKE_FRAME`].
async fn read_hello<R: AsyncRead + Unpin>(r: &mut R) -> Result<Handshake, TransportError> {
    read_frame_max(r, MAX_HANDSHAKE_FRAME).await
}

async fn read_frame_max<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
    max: usize,
) -> Result<T, TransportError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(TransportError::FrameTooBig(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(serde_json::from_slice(&body)?)
}

/// Client side of the handshake; returns the server's node id, and the binary frames it
/// reads.
async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    me: NodeId,
    secret: &Secret,
) -> Result<(NodeId, Frames), TransportError> {
    let nonce_c = nonce()?;
    write_frame(
        s,
        &Handshake::Hello {
            version: VERSION,
            from: me,
            nonce: nonce_c,
        },
    )
    .await?;
    let Handshake::Challenge {
        from,
        nonce: nonce_s,
        proof,
        binary_mail,
        binary_append,
    } = read_hello(s).await?
    else {
        return Err(TransportError::Protocol);
    };
    let want = secret.proof(b"server", &nonce_c, &nonce_s, from);
    if !bool::from(want.ct_eq(&proof)) {
        return Err(TransportError::BadProof);
    }
    let proof = secret.proof(b"client", &nonce_s, &nonce_c, me);
    write_frame(s, &Handshake::Proof { proof }).await?;
    match read_hello(s).await? {
        Handshake::Welcome => Ok((
            from,
            Frames {
                mail: binary_mail,
                append: binary_append,
            },
        )),
        _ => Err(TransportError::Protocol),
    }
}

/// Server side of the handshake; returns the client's node id.
async fn server_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    me: NodeId,
    secret: &Secret,
) -> Result<NodeId, TransportError> {
    let Handshake::Hello {
        version,
        from,
        nonce: nonce_c,
    } = read_hello(s).await?
    else {
        return Err(TransportError::Protocol);
    };
    if version != VERSION {
        return Err(TransportError::Version(version));
    }
    let nonce_s = nonce()?;
    let proof = secret.proof(b"server", &nonce_c, &nonce_s, me);
    write_frame(
        s,
        &Handshake::Challenge {
            from: me,
            nonce: nonce_s,
            proof,
            binary_mail: true,
            binary_append: true,
        },
    )
    .await?;
    let Handshake::Proof { proof } = read_hello(s).await? else {
        return Err(TransportError::Protocol);
    };
    let want = secret.proof(b"client", &nonce_s, &nonce_c, from);
    if !bool::from(want.ct_eq(&proof)) {
        return Err(TransportError::BadProof);
    }
    write_frame(s, &Handshake::Welcome).await?;
    Ok(from)
}

/// What a node does with the brokers' mail a peer sent ([`Rpc::Mail`]): the peer's id and
/// the batch; answers once the broker took it (which paces the sender: one batch at a time
/// per peer connection), with the receiving broker's incarnation (a number drawn at its
/// start: a sender that sees it change knows answers it waited for were lost).
pub type MailHandler = Arc<
    dyn Fn(
            NodeId,
            Vec<u8>,
        )
            -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<u64, String>> + Send>>
        + Send
        + Sync,
>;

/// What a node answers to a peer's question ([`Rpc::Ask`]): the peer's id and the
/// question's bytes; the answer's bytes, or why there is none.
pub type AskHandler = Arc<
    dyn Fn(
            NodeId,
            Vec<u8>,
        )
            -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<u8>, String>> + Send>>
        + Send
        + Sync,
>;

/// The groups this node serves, by group id, and the handlers of the brokers' mail and of
/// the hosts' questions.
#[derive(Clone, Default)]
pub struct Groups(
    Arc<Mutex<HashMap<u64, Raft>>>,
    Arc<Mutex<Option<MailHandler>>>,
    Arc<Mutex<Option<AskHandler>>>,
);

impl Groups {
    /// Answers peers' questions with `handler` (until then they are refused).
    pub fn set_ask_handler(&self, handler: AskHandler) {
        *self.2.lock().unwrap_or_else(|p| p.into_inner()) = Some(handler);
    }
    fn ask_handler(&self) -> Option<AskHandler> {
        self.2.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    /// Serves the brokers' mail from peers with `handler` (until then it is refused).
    pub fn set_mail_handler(&self, handler: MailHandler) {
        *self.1.lock().unwrap_or_else(|p| p.into_inner()) = Some(handler);
    }
    fn mail_handler(&self) -> Option<MailHandler> {
        self.1.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    pub fn insert(&self, group: u64, raft: Raft) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(group, raft);
    }
    pub fn remove(&self, group: u64) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&group);
    }
    fn get(&self, group: u64) -> Option<Raft> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&group)
            .cloned()
    }
}

/// Accepts peer connections on `listener` until the task is aborted; aborting it also ends
/// every connection it accepted (they live in its JoinSet), so a stopped node's address no
/// longer answers for it.
pub async fn serve(
    listener: TcpListener,
    me: NodeId,
    secret: Secret,
    tls: Option<ClusterTls>,
    groups: Groups,
) {
    let slots = Arc::new(Semaphore::new(MAX_INCOMING));
    let mut conns = tokio::task::JoinSet::new();
    loop {
        // Reap finished connections so the set stays as small as the live ones.
        while conns.try_join_next().is_some() {}
        // Wait for a free slot before accepting: excess peers wait in the backlog.
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let (sock, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "cluster listener: accept failed");
                // Out of file descriptors and the like: do not spin.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (secret, groups, tls) = (secret.clone(), groups.clone(), tls.clone());
        conns.spawn(async move {
            if let Err(e) = serve_peer(sock, addr, me, &secret, tls.as_ref(), &groups).await {
                tracing::info!(peer = %addr, error = %e, "cluster connection closed");
            }
            drop(permit);
        });
    }
}

async fn serve_peer(
    sock: TcpStream,
    addr: SocketAddr,
    me: NodeId,
    secret: &Secret,
    tls: Option<&ClusterTls>,
    groups: &Groups,
) -> Result<(), TransportError> {
    // TLS (when configured) and the secret's handshake, within one deadline.
    let handshake = async {
        let mut sock = accept(sock, tls).await?;
        let peer = server_handshake(&mut sock, me, secret).await?;
        Ok::<_, TransportError>((sock, peer))
    };
    let (mut sock, peer) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            tracing::warn!(peer = %addr, error = %e, "cluster peer refused");
            return Err(e);
        }
        Err(_) => return Err(TransportError::Timeout),
    };
    tracing::debug!(peer = %addr, node = peer, "cluster peer authenticated");
    loop {
        let env: Envelope = match tokio::time::timeout(IDLE_TIMEOUT, read_envelope(&mut sock)).await
        {
            Ok(Ok(e)) => e,
            Ok(Err(TransportError::Io(e))) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(());
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(TransportError::Timeout),
        };
        if let Rpc::Mail(bytes) = env.rpc {
            let reply = match groups.mail_handler() {
                Some(h) => RpcReply::Mail(h(peer, bytes).await),
                None => RpcReply::Mail(Err("this node takes no mail yet".into())),
            };
            write_frame(&mut sock, &reply).await?;
            continue;
        }
        if let Rpc::Ask(bytes) = env.rpc {
            let reply = match groups.ask_handler() {
                Some(h) => RpcReply::Ask(h(peer, bytes).await),
                None => RpcReply::Ask(Err("this node answers no questions yet".into())),
            };
            write_frame(&mut sock, &reply).await?;
            continue;
        }
        let reply = match groups.get(env.group) {
            None => RpcReply::NoGroup(env.group),
            Some(raft) => match env.rpc {
                Rpc::Append(r) => RpcReply::Append(raft.append_entries(r).await),
                Rpc::Vote(r) => RpcReply::Vote(raft.vote(r).await),
                Rpc::Snapshot(r) => RpcReply::Snapshot(raft.install_snapshot(r).await),
                Rpc::Forget(id) => RpcReply::Write(
                    crate::membership::forget_here(&raft, id)
                        .await
                        .map(|()| crate::Reply::default())
                        .map_err(|e| e.to_string()),
                ),
                Rpc::Join(id, addr) => RpcReply::Write(
                    crate::membership::join_here(&raft, id, &addr)
                        .await
                        .map(|()| crate::Reply::default())
                        .map_err(|e| e.to_string()),
                ),
                // Taken above.
                Rpc::Mail(_) => RpcReply::Mail(Err("mail".into())),
                Rpc::Ask(_) => RpcReply::Ask(Err("ask".into())),
                Rpc::Write(c) => RpcReply::Write(
                    raft.client_write(c)
                        .await
                        .map(|r| r.data)
                        .map_err(|e| e.to_string()),
                ),
            },
        };
        write_frame(&mut sock, &reply).await?;
    }
}

struct Request {
    group: u64,
    rpc: Rpc,
    deadline: Instant,
    reply: oneshot::Sender<Result<RpcReply, TransportError>>,
}

/// (Peer id, lane) -> (its address, the sender to its connection task). Lane 0 carries the
/// Raft groups' requests, `MAIL_LANE` the brokers' mail.
type PeerMap = HashMap<(NodeId, u8), (String, mpsc::Sender<Request>)>;

/// The lane (a connection of its own per peer) of the brokers' mail.
const MAIL_LANE: u8 = 1;

/// Outgoing connections of this node: one task and one connection per peer.
#[derive(Clone)]
pub struct Peers {
    me: NodeId,
    secret: Secret,
    tls: Option<ClusterTls>,
    peers: Arc<Mutex<PeerMap>>,
    /// Whether the Raft lane's connection to each peer worked at its last attempt (what
    /// `cluster-status` and the management API's `online` show).
    reachable: Arc<Mutex<HashMap<NodeId, bool>>>,
}

impl Peers {
    pub fn new(me: NodeId, secret: Secret) -> Self {
        Self {
            me,
            secret,
            tls: None,
            peers: Arc::default(),
            reachable: Arc::default(),
        }
    }

    /// Dials every peer over TLS with `tls` (its certificate, the CA the peers' chain to).
    pub fn with_tls(mut self, tls: Option<ClusterTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Whether this node reaches `peer` now (itself: always): its Raft connection worked at
    /// the last request. A peer never dialled yet reads as unreachable.
    pub fn reachable(&self, peer: NodeId) -> bool {
        peer == self.me
            || self
                .reachable
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&peer)
                .copied()
                .unwrap_or(false)
    }

    /// The sender to `target`'s task, started (or restarted for a new address) as needed.
    fn sender(&self, target: NodeId, addr: &str) -> mpsc::Sender<Request> {
        self.lane_sender(target, addr, 0)
    }

    fn lane_sender(&self, target: NodeId, addr: &str, lane: u8) -> mpsc::Sender<Request> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((a, tx)) = peers.get(&(target, lane))
            && a == addr
            && !tx.is_closed()
        {
            return tx.clone();
        }
        let (tx, rx) = mpsc::channel(PEER_QUEUE);
        tokio::spawn(peer_task(
            self.me,
            target,
            addr.to_string(),
            self.secret.clone(),
            self.tls.clone(),
            rx,
            (lane == 0).then(|| self.reachable.clone()),
        ));
        peers.insert((target, lane), (addr.to_string(), tx.clone()));
        tx
    }

    /// Sends the brokers' mail `batch` to `target` at `addr` on its own connection, and
    /// waits until that node's broker took it (bounded by `timeout`); its incarnation.
    pub async fn send_mail(
        &self,
        target: NodeId,
        addr: &str,
        batch: Vec<u8>,
        timeout: Duration,
    ) -> Result<u64, TransportError> {
        let (tx, rx) = oneshot::channel();
        let req = Request {
            group: 0,
            rpc: Rpc::Mail(batch),
            deadline: Instant::now() + timeout,
            reply: tx,
        };
        let sender = self.lane_sender(target, addr, MAIL_LANE);
        match tokio::time::timeout(timeout, sender.send(req)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(TransportError::Closed),
            Err(_) => return Err(TransportError::Timeout),
        }
        match rx.await.map_err(|_| TransportError::Closed)?? {
            RpcReply::Mail(r) => r.map_err(TransportError::Remote),
            _ => Err(TransportError::Protocol),
        }
    }

    /// Asks `target` at `addr` the hosts' question `question` (on the mail connection) and
    /// waits for its answer, within `timeout`.
    pub async fn ask(
        &self,
        target: NodeId,
        addr: &str,
        question: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        let (tx, rx) = oneshot::channel();
        let req = Request {
            group: 0,
            rpc: Rpc::Ask(question),
            deadline: Instant::now() + timeout,
            reply: tx,
        };
        let sender = self.lane_sender(target, addr, MAIL_LANE);
        match tokio::time::timeout(timeout, sender.send(req)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(TransportError::Closed),
            Err(_) => return Err(TransportError::Timeout),
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(r) => match r.map_err(|_| TransportError::Closed)?? {
                RpcReply::Ask(r) => r.map_err(TransportError::Remote),
                _ => Err(TransportError::Protocol),
            },
            Err(_) => Err(TransportError::Timeout),
        }
    }

    /// Sends `command` to `target` (the group's leader) to propose; its reply once committed
    /// and applied there. Bounded by `timeout`.
    pub async fn forward(
        &self,
        group: u64,
        target: NodeId,
        addr: &str,
        command: crate::Command,
        timeout: Duration,
    ) -> Result<crate::Reply, TransportError> {
        self.forward_rpc(group, target, addr, Rpc::Write(command), timeout)
            .await
    }

    /// Asks `target` (the group's leader) to remove member `id`.
    pub async fn forward_forget(
        &self,
        group: u64,
        target: NodeId,
        addr: &str,
        id: NodeId,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        self.forward_rpc(group, target, addr, Rpc::Forget(id), timeout)
            .await
            .map(|_| ())
    }

    /// Asks `target` (the group's leader) to add member `id` at `member_addr`.
    pub async fn forward_join(
        &self,
        group: u64,
        target: NodeId,
        addr: &str,
        id: NodeId,
        member_addr: &str,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        self.forward_rpc(
            group,
            target,
            addr,
            Rpc::Join(id, member_addr.to_string()),
            timeout,
        )
        .await
        .map(|_| ())
    }

    async fn forward_rpc(
        &self,
        group: u64,
        target: NodeId,
        addr: &str,
        rpc: Rpc,
        timeout: Duration,
    ) -> Result<crate::Reply, TransportError> {
        let (tx, rx) = oneshot::channel();
        let req = Request {
            group,
            rpc,
            deadline: Instant::now() + timeout,
            reply: tx,
        };
        let sender = self.sender(target, addr);
        match tokio::time::timeout(timeout, sender.send(req)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(TransportError::Closed),
            Err(_) => return Err(TransportError::Timeout),
        }
        match rx.await.map_err(|_| TransportError::Closed)?? {
            RpcReply::Write(r) => r.map_err(TransportError::Remote),
            RpcReply::NoGroup(g) => Err(TransportError::NoGroup(g)),
            _ => Err(TransportError::Protocol),
        }
    }

    /// A network factory for the group `group`.
    pub fn network(&self, group: u64) -> Network {
        Network {
            peers: self.clone(),
            group,
        }
    }
}

/// Owns the connection to one peer: requests one at a time, in order; reconnects after a
/// failure no sooner than the backoff allows (requests meanwhile fail at once, which tells
/// openraft the peer is unreachable so it backs off too). Ends when every sender is gone.
async fn peer_task(
    me: NodeId,
    target: NodeId,
    addr: String,
    secret: Secret,
    tls: Option<ClusterTls>,
    mut rx: mpsc::Receiver<Request>,
    shown: Option<Arc<Mutex<HashMap<NodeId, bool>>>>,
) {
    // The connection, and the binary frames its server reads.
    let mut conn: Option<(Box<dyn Conn>, Frames)> = None;
    let mut backoff = BACKOFF_MIN;
    let mut retry_at = Instant::now();
    // Logged on changes only: a peer that is down for an hour is one line, not thousands.
    let mut reachable: Option<bool> = None;
    let mut note = |now_up: bool, why: &dyn std::fmt::Display| {
        if reachable != Some(now_up) {
            if now_up {
                tracing::info!(node = target, %addr, "cluster peer connected");
            } else {
                tracing::warn!(node = target, %addr, error = %why, "cluster peer unreachable");
            }
            reachable = Some(now_up);
            if let Some(shown) = &shown {
                shown
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(target, now_up);
            }
        }
    };
    while let Some(req) = rx.recv().await {
        let now = Instant::now();
        if now >= req.deadline {
            let _ = req.reply.send(Err(TransportError::Timeout));
            continue;
        }
        // A connection the peer closed meanwhile (it restarted, or closed us as idle) reads
        // as end-of-file now; sending on it would fail only after the request was written.
        // Replace it before sending, so no request goes out on a dead connection.
        if let Some((s, _)) = &mut conn
            && !still_open(s).await
        {
            conn = None;
        }
        if conn.is_none() {
            if now < retry_at {
                let _ = req.reply.send(Err(TransportError::BackingOff(target)));
                continue;
            }
            let connect = async {
                let mut s = dial(&addr, tls.as_ref()).await?;
                let (peer, binary) = client_handshake(&mut s, me, &secret).await?;
                if peer != target {
                    tracing::warn!(%addr, expected = target, got = peer, "cluster peer has another node id");
                    return Err(TransportError::Protocol);
                }
                Ok::<_, TransportError>((s, binary))
            };
            match tokio::time::timeout(HANDSHAKE_TIMEOUT.min(req.deadline - now), connect).await {
                Ok(Ok(s)) => {
                    conn = Some(s);
                    backoff = BACKOFF_MIN;
                    note(true, &"");
                }
                Ok(Err(e)) => {
                    if matches!(e, TransportError::BadProof) {
                        tracing::warn!(%addr, node = target, "cluster peer failed authentication");
                    }
                    note(false, &e);
                    retry_at = Instant::now() + backoff;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    let _ = req.reply.send(Err(e));
                    continue;
                }
                Err(_) => {
                    retry_at = Instant::now() + backoff;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    note(false, &"connect timed out");
                    let _ = req.reply.send(Err(TransportError::Timeout));
                    continue;
                }
            }
        }
        let Some((s, binary)) = conn.as_mut() else {
            continue;
        };
        let binary = *binary;
        let exchange = async {
            write_envelope(
                s,
                &Envelope {
                    group: req.group,
                    rpc: req.rpc,
                },
                binary,
            )
            .await?;
            read_frame::<_, RpcReply>(s).await
        };
        let left = req.deadline.saturating_duration_since(Instant::now());
        let r = match tokio::time::timeout(left, exchange).await {
            Ok(r) => r,
            Err(_) => Err(TransportError::Timeout),
        };
        if r.is_err() {
            // The stream may hold half a frame or a late reply: never reuse it.
            conn = None;
        }
        let _ = req.reply.send(r);
    }
}

/// The network factory of one group over [`Peers`].
pub struct Network {
    peers: Peers,
    group: u64,
}

/// A client of one peer for one group.
pub struct Client {
    peers: Peers,
    group: u64,
    target: NodeId,
    addr: String,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Client;
    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Client {
        Client {
            peers: self.peers.clone(),
            group: self.group,
            target,
            addr: node.addr.clone(),
        }
    }
}

type RpcErr<E = openraft::error::Infallible> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

impl Client {
    async fn call(&self, rpc: Rpc, option: &RPCOption) -> Result<RpcReply, TransportError> {
        let ttl = option.hard_ttl().min(RPC_TIMEOUT);
        let (tx, rx) = oneshot::channel();
        let req = Request {
            group: self.group,
            rpc,
            deadline: Instant::now() + ttl,
            reply: tx,
        };
        let sender = self.peers.sender(self.target, &self.addr);
        // Bounded: waits while the peer's queue is full.
        match tokio::time::timeout(ttl, sender.send(req)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(TransportError::Closed),
            Err(_) => return Err(TransportError::Timeout),
        }
        rx.await.map_err(|_| TransportError::Closed)?
    }

    fn error<E: std::error::Error>(&self, e: TransportError) -> RpcErr<E> {
        match e {
            TransportError::Io(_) | TransportError::BackingOff(_) | TransportError::Timeout => {
                RPCError::Unreachable(Unreachable::new(&e))
            }
            _ => RPCError::Network(NetworkError::new(&e)),
        }
    }
}

fn unexpected<E: std::error::Error>(got: RpcReply) -> RpcErr<E> {
    let e = match got {
        RpcReply::NoGroup(g) => TransportError::NoGroup(g),
        _ => TransportError::Protocol,
    };
    RPCError::Network(NetworkError::new(&e))
}

impl RaftNetwork<TypeConfig> for Client {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr> {
        match self.call(Rpc::Append(rpc), &option).await {
            Ok(RpcReply::Append(r)) => {
                r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            Ok(other) => Err(unexpected(other)),
            Err(e) => Err(self.error(e)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<InstallSnapshotError>> {
        match self.call(Rpc::Snapshot(rpc), &option).await {
            Ok(RpcReply::Snapshot(r)) => {
                r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            Ok(other) => Err(unexpected(other)),
            Err(e) => Err(self.error(e)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RpcErr> {
        match self.call(Rpc::Vote(rpc), &option).await {
            Ok(RpcReply::Vote(r)) => {
                r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            Ok(other) => Err(unexpected(other)),
            Err(e) => Err(self.error(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(
        a: Secret,
        b: Secret,
    ) -> (
        Result<NodeId, TransportError>,
        Result<NodeId, TransportError>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            server_handshake(&mut s, 1, &a).await
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        let client = client_handshake(&mut c, 2, &b).await.map(|(id, frames)| {
            assert!(
                frames.mail && frames.append,
                "a server of this version reads binary mail and appends"
            );
            id
        });
        // A refused client hangs up; the server must see that rather than wait for a proof.
        drop(c);
        (server.await.unwrap(), client)
    }

    #[tokio::test]
    async fn handshake_needs_the_same_secret_on_both_sides() {
        let s = Secret::new(b"cookie".to_vec());
        let (server, client) = pair(s.clone(), s).await;
        assert_eq!((server.unwrap(), client.unwrap()), (2, 1));
        // A client with another secret is refused by the server's check of its challenge:
        // the client itself notices first (the server's proof does not verify).
        let (_, client) = pair(
            Secret::new(b"cookie".to_vec()),
            Secret::new(b"other".to_vec()),
        )
        .await;
        assert!(matches!(client, Err(TransportError::BadProof)));
    }

    #[tokio::test]
    async fn server_refuses_a_client_that_cannot_prove_the_secret() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let secret = Secret::new(b"cookie".to_vec());
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            server_handshake(&mut s, 1, &secret).await
        });
        // A client that skips checking the server and answers with a made-up proof (say,
        // replaying one from another connection): refused, no Welcome.
        let mut c = TcpStream::connect(addr).await.unwrap();
        write_frame(
            &mut c,
            &Handshake::Hello {
                version: VERSION,
                from: 2,
                nonce: [7; 32],
            },
        )
        .await
        .unwrap();
        let _: Handshake = read_frame(&mut c).await.unwrap();
        write_frame(&mut c, &Handshake::Proof { proof: [0; 32] })
            .await
            .unwrap();
        assert!(matches!(
            server.await.unwrap(),
            Err(TransportError::BadProof)
        ));
        assert!(read_frame::<_, Handshake>(&mut c).await.is_err());
    }

    #[tokio::test]
    async fn handshake_frames_are_small_before_the_peer_is_authenticated() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            server_handshake(&mut s, 1, &Secret::new(b"cookie".to_vec())).await
        });
        // An unauthenticated client announcing a 1 MiB hello: refused from the length alone.
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(&(1u32 << 20).to_be_bytes()).await.unwrap();
        // Hang up: a server that waited for the body would see end-of-file instead.
        drop(c);
        assert!(matches!(
            server.await.unwrap(),
            Err(TransportError::FrameTooBig(n)) if n == 1 << 20
        ));
    }

    #[tokio::test]
    async fn mail_goes_binary_to_a_server_that_reads_it_and_json_otherwise() {
        let batch: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let mail = Envelope {
            group: 0,
            rpc: Rpc::Mail(batch.clone()),
        };
        // Binary: the length, 0x00, the bytes as they are.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_envelope(&mut a, &mail, Frames::ALL).await.unwrap();
        drop(a);
        let mut wire = Vec::new();
        b.read_to_end(&mut wire).await.unwrap();
        assert_eq!(wire.len(), 4 + 1 + batch.len());
        assert_eq!(wire[..4], ((1 + batch.len()) as u32).to_be_bytes());
        assert_eq!(wire[4], MAIL_FRAME);
        assert_eq!(wire[5..], batch[..]);
        let env = read_envelope(&mut &wire[..]).await.unwrap();
        assert!(matches!(env.rpc, Rpc::Mail(m) if m == batch));
        // JSON (for an older server): a number array, ~3.6 bytes a byte here; still read.
        let (mut a, mut b) = tokio::io::duplex(1 << 17);
        write_envelope(&mut a, &mail, Frames::default())
            .await
            .unwrap();
        drop(a);
        let mut json = Vec::new();
        b.read_to_end(&mut json).await.unwrap();
        assert_eq!(json[4], b'{');
        assert!(json.len() > 3 * batch.len(), "{}", json.len());
        let env = read_envelope(&mut &json[..]).await.unwrap();
        assert!(matches!(env.rpc, Rpc::Mail(m) if m == batch));
        // Other envelopes stay JSON, whatever the flag.
        let (mut a, mut b) = tokio::io::duplex(1 << 10);
        let forget = Envelope {
            group: 7,
            rpc: Rpc::Forget(3),
        };
        write_envelope(&mut a, &forget, Frames::ALL).await.unwrap();
        drop(a);
        let mut out = Vec::new();
        b.read_to_end(&mut out).await.unwrap();
        assert_eq!(out[4], b'{');
        let env = read_envelope(&mut &out[..]).await.unwrap();
        assert!(env.group == 7 && matches!(env.rpc, Rpc::Forget(3)));
        // An empty batch is a frame of one byte.
        let empty = Envelope {
            group: 0,
            rpc: Rpc::Mail(Vec::new()),
        };
        let mut buf = Vec::new();
        write_envelope(&mut buf, &empty, Frames::ALL).await.unwrap();
        assert_eq!(buf, [0, 0, 0, 1, MAIL_FRAME]);
    }

    #[tokio::test]
    async fn appends_go_binary_to_a_server_that_reads_them_and_json_otherwise() {
        use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Vote};
        let message: Vec<u8> = (0..=255u8).cycle().take(1024).collect();
        let req = AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new_committed(4, 1),
            prev_log_id: Some(LogId::new(CommittedLeaderId::new(4, 1), 10)),
            leader_commit: Some(LogId::new(CommittedLeaderId::new(4, 1), 9)),
            entries: vec![Entry {
                log_id: LogId::new(CommittedLeaderId::new(4, 1), 11),
                payload: EntryPayload::Normal(crate::Command(message.clone())),
            }],
        };
        let env = Envelope {
            group: 9,
            rpc: Rpc::Append(req.clone()),
        };
        let same = |got: Envelope| {
            let Rpc::Append(r) = got.rpc else {
                panic!("an append");
            };
            assert_eq!(got.group, 9);
            assert_eq!(
                serde_json::to_value(&r).unwrap(),
                serde_json::to_value(&req).unwrap()
            );
        };
        // Binary: the message's bytes as they are, plus ~100 bytes of ids and lengths.
        let mut wire = Vec::new();
        write_envelope(&mut wire, &env, Frames::ALL).await.unwrap();
        assert_eq!(wire[4], APPEND_FRAME);
        assert!(wire.len() < 4 + message.len() + 120, "{}", wire.len());
        same(read_envelope(&mut &wire[..]).await.unwrap());
        // An older server reads JSON: base64, a third bigger.
        let mut json = Vec::new();
        let old = Frames {
            mail: true,
            append: false,
        };
        write_envelope(&mut json, &env, old).await.unwrap();
        assert_eq!(json[4], b'{');
        assert!(json.len() > message.len() * 4 / 3, "{}", json.len());
        same(read_envelope(&mut &json[..]).await.unwrap());
        // A damaged binary frame is an error, not a panic.
        let mut bad = wire.clone();
        bad.truncate(bad.len() - 1);
        let len = (bad.len() - 4) as u32;
        bad[..4].copy_from_slice(&len.to_be_bytes());
        assert!(read_envelope(&mut &bad[..]).await.is_err());
    }

    #[test]
    fn an_older_servers_challenge_reads_as_no_binary_mail() {
        let old = r#"{"Challenge":{"from":1,"nonce":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],"proof":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]}}"#;
        let Ok(Handshake::Challenge {
            binary_mail,
            binary_append,
            ..
        }) = serde_json::from_str(old)
        else {
            panic!("an older challenge parses");
        };
        assert!(!binary_mail && !binary_append);
    }

    /// A CA (PEM) that signs node certificates for 127.0.0.1.
    pub(crate) struct TestCa {
        params: rcgen::CertificateParams,
        key: rcgen::KeyPair,
        pub(crate) pem: String,
    }

    impl TestCa {
        pub(crate) fn new(name: &str) -> Self {
            let mut params = rcgen::CertificateParams::new(Vec::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, format!("{name} CA"));
            let key = rcgen::KeyPair::generate().unwrap();
            let pem = params.self_signed(&key).unwrap().pem();
            Self { params, key, pem }
        }

        /// A node's TLS: a certificate of this CA for `ip`, trusting `trusted`'s CA.
        pub(crate) fn node(&self, ip: &str, trusted: &TestCa) -> ClusterTls {
            let params = rcgen::CertificateParams::new(vec![ip.to_string()]).unwrap();
            let key = rcgen::KeyPair::generate().unwrap();
            let issuer = rcgen::Issuer::from_params(&self.params, &self.key);
            let cert = params.signed_by(&key, &issuer).unwrap();
            ClusterTls::from_pem(
                cert.pem().as_bytes(),
                key.serialize_pem().as_bytes(),
                trusted.pem.as_bytes(),
            )
            .unwrap()
        }
    }

    /// A server (node 1) and a client (node 2) over loopback, each with or without TLS,
    /// through the same connection setup and handshakes as `serve` and `peer_task`.
    async fn tls_pair(
        server_tls: Option<ClusterTls>,
        client_tls: Option<ClusterTls>,
    ) -> (
        Result<NodeId, TransportError>,
        Result<NodeId, TransportError>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let secret = Secret::new(b"cookie".to_vec());
        let s2 = secret.clone();
        let server = tokio::spawn(async move {
            let (sock, _) = l.accept().await.unwrap();
            let mut c = accept(sock, server_tls.as_ref()).await?;
            let id = server_handshake(&mut c, 1, &s2).await?;
            // Then an envelope each way, as a connection carries after the handshake.
            let env = read_envelope(&mut c).await?;
            assert!(matches!(env.rpc, Rpc::Mail(ref m) if m == b"over tls"));
            write_frame(&mut c, &RpcReply::Mail(Ok(42))).await?;
            Ok(id)
        });
        let client = async {
            let mut c = dial(&addr.to_string(), client_tls.as_ref()).await?;
            let (id, binary) = client_handshake(&mut c, 2, &secret).await?;
            let mail = Envelope {
                group: 0,
                rpc: Rpc::Mail(b"over tls".to_vec()),
            };
            write_envelope(&mut c, &mail, binary).await?;
            match read_frame::<_, RpcReply>(&mut c).await? {
                RpcReply::Mail(Ok(42)) => Ok(id),
                _ => Err(TransportError::Protocol),
            }
        };
        let client = tokio::time::timeout(Duration::from_secs(10), client)
            .await
            .expect("client done in time");
        let server = tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("server done in time")
            .unwrap();
        (server, client)
    }

    #[tokio::test]
    async fn tls_peers_of_one_ca_authenticate_both_ways_and_talk() {
        let ca = TestCa::new("cluster");
        let (server, client) = tls_pair(
            Some(ca.node("127.0.0.1", &ca)),
            Some(ca.node("127.0.0.1", &ca)),
        )
        .await;
        assert_eq!((server.unwrap(), client.unwrap()), (2, 1));
        // Plain TCP still works between nodes without TLS.
        let (server, client) = tls_pair(None, None).await;
        assert_eq!((server.unwrap(), client.unwrap()), (2, 1));
    }

    #[tokio::test]
    async fn a_client_certificate_of_another_ca_is_refused() {
        let ca = TestCa::new("cluster");
        let rogue = TestCa::new("rogue");
        // The client trusts the cluster's CA, but its own certificate is the rogue CA's.
        let (server, client) = tls_pair(
            Some(ca.node("127.0.0.1", &ca)),
            Some(rogue.node("127.0.0.1", &ca)),
        )
        .await;
        assert!(matches!(server, Err(TransportError::Tls(_))), "{server:?}");
        assert!(client.is_err());
    }

    #[tokio::test]
    async fn a_server_certificate_of_another_ca_or_ip_is_refused() {
        let ca = TestCa::new("cluster");
        let rogue = TestCa::new("rogue");
        let (server, client) = tls_pair(
            Some(rogue.node("127.0.0.1", &ca)),
            Some(ca.node("127.0.0.1", &ca)),
        )
        .await;
        assert!(matches!(client, Err(TransportError::Tls(_))), "{client:?}");
        assert!(server.is_err());
        // The CA's certificate for another node's address does not pass for this one.
        let (server, client) = tls_pair(
            Some(ca.node("10.87.0.9", &ca)),
            Some(ca.node("127.0.0.1", &ca)),
        )
        .await;
        assert!(matches!(client, Err(TransportError::Tls(_))), "{client:?}");
        assert!(server.is_err());
    }

    #[tokio::test]
    async fn a_plaintext_peer_and_a_tls_node_refuse_each_other() {
        let ca = TestCa::new("cluster");
        let (server, client) = tls_pair(Some(ca.node("127.0.0.1", &ca)), None).await;
        assert!(matches!(server, Err(TransportError::NotTls)), "{server:?}");
        assert!(client.is_err());
        let (server, client) = tls_pair(None, Some(ca.node("127.0.0.1", &ca))).await;
        assert!(matches!(server, Err(TransportError::PeerTls)), "{server:?}");
        assert!(client.is_err());
    }

    #[tokio::test]
    async fn cluster_tls_files_are_checked() {
        let ca = TestCa::new("cluster");
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        assert!(matches!(
            ClusterTls::from_pem_files(&missing, &missing, &missing),
            Err(TlsConfigError::File { .. })
        ));
        assert!(matches!(
            ClusterTls::from_pem(ca.pem.as_bytes(), b"", ca.pem.as_bytes()),
            Err(TlsConfigError::Invalid(_))
        ));
        assert!(matches!(
            ClusterTls::from_pem(b"", b"", ca.pem.as_bytes()),
            Err(TlsConfigError::Invalid(_))
        ));
    }

    #[tokio::test]
    async fn oversized_frame_is_refused_before_reading_it() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&((MAX_FRAME as u32) + 1).to_be_bytes())
            .await
            .unwrap();
        let r: Result<Handshake, _> = read_frame(&mut b).await;
        assert!(matches!(r, Err(TransportError::FrameTooBig(_))));
    }
}
