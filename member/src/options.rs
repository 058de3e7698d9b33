//! The cluster settings (`--node-id`, `--cluster`, `--peers`, `--cluster-secret-file`,
//! `--join`, `--cluster-tls-*`), checked before anything starts: each mistake is named, never
//! a panic or a silent single node.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use warren_cluster::node::NodeOptions;
use warren_cluster::transport::{ClusterTls, Secret};

/// A cluster setting the operator must fix (the binary exits 2 on it).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct OptionsError(pub String);

/// The cluster's settings as the operator gave them (flags or the config file).
#[derive(Clone, Debug, Default)]
pub struct ClusterArgs {
    /// `--node-id`: `None` is a single node.
    pub node_id: Option<u64>,
    /// `--cluster IP:PORT`: this node's cluster listener.
    pub cluster: Option<String>,
    /// `--peers ID=IP:PORT,...` (each entry may hold several, comma-separated).
    pub peers: Vec<String>,
    /// `--cluster-secret-file`: the secret every node shares.
    pub secret_file: Option<PathBuf>,
    /// `--join`: this node waits to be added (`warren ctl join`).
    pub join: bool,
    /// `--cluster-tls-cert`, `--cluster-tls-key`, `--cluster-tls-ca`: all three or none.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    /// `--in-memory`: a cluster node needs a data dir for its Raft log.
    pub in_memory: bool,
    pub data_dir: PathBuf,
    /// Tests only: a pause after a conditional delete's check passed, before it is proposed
    /// (`cluster/tests/conditional_delete.rs`; the binary reads
    /// `WARREN_TEST_CONDITIONAL_DELETE_DELAY_MS`).
    pub delete_delay: Option<Duration>,
}

/// The cluster port's TLS files, read again on SIGHUP and `warren ctl reload-tls`.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// A checked cluster configuration: what [`crate::Cluster::start`] takes.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub node: NodeOptions,
    pub tls_files: Option<TlsFiles>,
    pub delete_delay: Option<Duration>,
}

/// The cluster settings, checked; `None` when `--node-id` is not given (a single node).
pub fn options(s: &ClusterArgs) -> Result<Option<ClusterOptions>, OptionsError> {
    let Some(id) = s.node_id else {
        if s.cluster.is_some()
            || !s.peers.is_empty()
            || s.secret_file.is_some()
            || s.join
            || s.tls_cert.is_some()
            || s.tls_key.is_some()
            || s.tls_ca.is_some()
        {
            return Err(OptionsError(
                "--cluster, --peers, --cluster-secret-file, --cluster-tls-* and --join need --node-id".into(),
            ));
        }
        return Ok(None);
    };
    if s.in_memory {
        return Err(OptionsError(
            "--node-id: a cluster node keeps its Raft log in the data dir; not with --in-memory"
                .into(),
        ));
    }
    let listen: SocketAddr = s
        .cluster
        .as_deref()
        .ok_or_else(|| OptionsError("--node-id needs --cluster ADDR (this node's cluster listener, e.g. 10.0.0.1:25672)".into()))?
        .parse()
        .map_err(|e| OptionsError(format!("--cluster: {e}; expected IP:PORT")))?;
    if listen.ip().is_unspecified() {
        return Err(OptionsError(format!(
            "--cluster {listen}: peers dial this address, so it must be this node's own IP, not {}",
            listen.ip()
        )));
    }
    let members = members(id, listen, &s.peers)?;
    let file = s.secret_file.as_deref().ok_or_else(|| {
        OptionsError(
            "--node-id needs --cluster-secret-file FILE (the same secret on every node)".into(),
        )
    })?;
    let secret = read_secret(file)?;
    let mut node = NodeOptions::new(id, listen, members, Secret::new(secret), s.data_dir.clone());
    node.join = s.join;
    let mut tls_files = None;
    node.tls = match (&s.tls_cert, &s.tls_key, &s.tls_ca) {
        (None, None, None) => None,
        (Some(cert), Some(key), Some(ca)) => {
            let tls = ClusterTls::from_pem_files(cert, key, ca)
                .map_err(|e| OptionsError(format!("--cluster-tls-*: {e}")))?;
            tls_files = Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            });
            Some(tls)
        }
        _ => {
            return Err(OptionsError(
                "--cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca go together (TLS on the cluster port is mutual: every node has a certificate of the CA)".into(),
            ));
        }
    };
    Ok(Some(ClusterOptions {
        node,
        tls_files,
        delete_delay: s.delete_delay,
    }))
}

/// This node and its `--peers`, by id.
fn members(
    id: u64,
    listen: SocketAddr,
    peers: &[String],
) -> Result<BTreeMap<u64, String>, OptionsError> {
    let mut members = BTreeMap::new();
    members.insert(id, listen.to_string());
    for entry in peers
        .iter()
        .flat_map(|p| p.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let (pid, addr) = entry.split_once('=').ok_or_else(|| {
            OptionsError(format!(
                "--peers {entry:?}: expected ID=IP:PORT, e.g. 2=10.0.0.2:25672"
            ))
        })?;
        let pid: u64 = pid
            .parse()
            .map_err(|e| OptionsError(format!("--peers {entry:?}: node id: {e}")))?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|e| OptionsError(format!("--peers {entry:?}: address: {e}")))?;
        if members.insert(pid, addr.to_string()).is_some() {
            return Err(OptionsError(format!(
                "--peers: node {pid} given twice (or is this node)"
            )));
        }
    }
    Ok(members)
}

/// The secret file's contents without surrounding whitespace (a trailing newline from an
/// editor or `echo` must not change the secret).
fn read_secret(path: &Path) -> Result<Vec<u8>, OptionsError> {
    let text = std::fs::read(path)
        .map_err(|e| OptionsError(format!("--cluster-secret-file {}: {e}", path.display())))?;
    let trimmed = text.trim_ascii();
    if trimmed.len() < 16 {
        return Err(OptionsError(format!(
            "--cluster-secret-file {}: the secret must be at least 16 bytes (e.g. `head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'`)",
            path.display()
        )));
    }
    Ok(trimmed.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(dir: &Path, secret: &str) -> ClusterArgs {
        let file = dir.join("secret");
        std::fs::write(&file, secret).expect("write secret");
        ClusterArgs {
            node_id: Some(1),
            cluster: Some("10.0.0.1:25672".into()),
            peers: vec!["2=10.0.0.2:25672".into(), "3=10.0.0.3:25672".into()],
            secret_file: Some(file),
            data_dir: dir.to_path_buf(),
            ..ClusterArgs::default()
        }
    }

    #[test]
    fn cluster_options_are_checked() {
        let dir = std::env::temp_dir().join(format!("warren-cluster-opts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let s = args(&dir, "0123456789abcdef0123\n");
        let o = options(&s).expect("valid").expect("a cluster node");
        assert_eq!(o.node.id, 1);
        assert_eq!(o.node.members.len(), 3);
        assert_eq!(o.node.members[&3], "10.0.0.3:25672");

        // Each mistake is named, never a panic or a silent single node.
        let mut bad = s.clone();
        bad.peers = vec!["2:10.0.0.2:25672".into()];
        assert!(options(&bad).unwrap_err().0.contains("ID=IP:PORT"));
        let mut bad = s.clone();
        bad.peers = vec!["1=10.0.0.9:25672".into()];
        assert!(options(&bad).unwrap_err().0.contains("twice"));
        let mut bad = s.clone();
        bad.cluster = Some("0.0.0.0:25672".into());
        assert!(options(&bad).unwrap_err().0.contains("own IP"));
        let mut bad = s.clone();
        bad.secret_file = None;
        assert!(
            options(&bad)
                .unwrap_err()
                .0
                .contains("--cluster-secret-file")
        );
        let mut bad = s.clone();
        bad.node_id = None;
        assert!(options(&bad).unwrap_err().0.contains("need --node-id"));
        let mut bad = s.clone();
        bad.in_memory = true;
        assert!(options(&bad).unwrap_err().0.contains("--in-memory"));
        // --join is passed to the node (it then proposes no membership of its own).
        let mut joining = s.clone();
        joining.join = true;
        assert!(options(&joining).expect("valid").expect("a node").node.join);
        assert!(!o.node.join);
        let short = args(&dir, "short\n");
        assert!(options(&short).unwrap_err().0.contains("at least 16 bytes"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cluster_tls_files_are_checked() {
        let dir =
            std::env::temp_dir().join(format!("warren-cluster-tls-opts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let key = rcgen::KeyPair::generate().expect("key");
        let mut ca = rcgen::CertificateParams::new(vec!["10.0.0.1".into()]).expect("params");
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = ca.self_signed(&key).expect("cert");
        let (c, k) = (dir.join("node.pem"), dir.join("node.key"));
        std::fs::write(&c, cert.pem()).expect("write");
        std::fs::write(&k, key.serialize_pem()).expect("write");
        let mut s = args(&dir, "0123456789abcdef0123");
        (s.tls_cert, s.tls_key, s.tls_ca) = (Some(c.clone()), Some(k.clone()), Some(c.clone()));
        let o = options(&s).expect("valid").expect("a node");
        assert!(o.node.tls.is_some());
        assert!(o.tls_files.is_some_and(|f| f.key == k));
        let mut plain = s.clone();
        (plain.tls_cert, plain.tls_key, plain.tls_ca) = (None, None, None);
        let o = options(&plain).expect("valid").expect("a node");
        assert!(o.node.tls.is_none() && o.tls_files.is_none());
        // All three or none: a node half-configured for TLS is refused, not run in plain TCP.
        let mut bad = s.clone();
        bad.tls_ca = None;
        assert!(options(&bad).unwrap_err().0.contains("go together"));
        // Unreadable files are named.
        let mut bad = s.clone();
        bad.tls_key = Some(dir.join("missing.key"));
        let e = options(&bad).unwrap_err().0;
        assert!(
            e.contains("--cluster-tls-*") && e.contains("missing.key"),
            "{e}"
        );
        // A key that is not the certificate's.
        let mut bad = s.clone();
        let other = dir.join("other.key");
        std::fs::write(
            &other,
            rcgen::KeyPair::generate().expect("key").serialize_pem(),
        )
        .expect("write");
        bad.tls_key = Some(other);
        assert!(options(&bad).unwrap_err().0.contains("certificate and key"));
        let mut bad = s.clone();
        bad.node_id = None;
        assert!(options(&bad).unwrap_err().0.contains("need --node-id"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
