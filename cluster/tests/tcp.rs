//! The metadata group over the real TCP transport on loopback (127.0.0.1-3, ephemeral
//! ports): writes, the leader stopped and a new one elected, the old one restarted on its
//! files and caught up; a node with the wrong cluster secret is kept out. Prints the write
//! latency and throughput and the failover time it measured.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use openraft::ServerState;
use tokio::net::TcpListener;
use warren_cluster::NodeId;
use warren_cluster::definitions::{DefCommand, DefReply};
use warren_cluster::node::{ClusterNode, NodeError, NodeOptions};
use warren_cluster::transport::{ClusterTls, Secret};

const WAIT: Duration = Duration::from_secs(15);

async fn bind(id: NodeId) -> TcpListener {
    TcpListener::bind(format!("127.0.0.{id}:0"))
        .await
        .expect("bind loopback")
}

fn options(
    id: NodeId,
    addr: SocketAddr,
    members: &BTreeMap<NodeId, String>,
    secret: &[u8],
    dir: &Path,
) -> NodeOptions {
    let mut o = NodeOptions::new(
        id,
        addr,
        members.clone(),
        Secret::new(secret.to_vec()),
        dir.join(format!("n{id}")),
    );
    // LAN-like but quick: heartbeats every 50 ms, elections after 150-300 ms of silence.
    o.heartbeat_ms = 50;
    o.election_timeout_ms = 150;
    o
}

/// Starts nodes 1..=n; `secrets[i]` is node i+1's secret.
async fn cluster(
    secrets: &[&[u8]],
    dir: &Path,
) -> (BTreeMap<NodeId, ClusterNode>, BTreeMap<NodeId, String>) {
    cluster_tls(secrets, &vec![None; secrets.len()], dir).await
}

/// As [`cluster`], `tls[i]` node i+1's TLS (its certificate is for 127.0.0.{i+1}).
async fn cluster_tls(
    secrets: &[&[u8]],
    tls: &[Option<ClusterTls>],
    dir: &Path,
) -> (BTreeMap<NodeId, ClusterNode>, BTreeMap<NodeId, String>) {
    let mut listeners = BTreeMap::new();
    for id in 1..=secrets.len() as NodeId {
        listeners.insert(id, bind(id).await);
    }
    let members: BTreeMap<NodeId, String> = listeners
        .iter()
        .map(|(id, l)| (*id, l.local_addr().expect("addr").to_string()))
        .collect();
    let mut nodes = BTreeMap::new();
    for (id, l) in listeners {
        let addr = l.local_addr().expect("addr");
        let mut o = options(id, addr, &members, secrets[id as usize - 1], dir);
        o.tls = tls[id as usize - 1].clone();
        nodes.insert(id, ClusterNode::start_on(o, l).await.expect("start"));
    }
    (nodes, members)
}

/// Waits for a leader among `nodes` (as all of them see it) and returns its id.
async fn leader(nodes: &BTreeMap<NodeId, ClusterNode>) -> NodeId {
    let deadline = Instant::now() + WAIT;
    loop {
        // The highest term wins: a restarted node may briefly believe in its old term.
        let best = nodes
            .iter()
            .map(|(id, n)| (n.raft.metrics().borrow().clone(), *id))
            .filter(|(m, _)| m.state == ServerState::Leader)
            .max_by_key(|(m, _)| m.current_term);
        if let Some((_, id)) = best {
            return id;
        }
        assert!(Instant::now() < deadline, "no leader in {WAIT:?}");
        let any = nodes.values().next().expect("a node");
        let _ = any
            .raft
            .wait(Some(Duration::from_millis(50)))
            .metrics(|m| m.current_leader.is_some(), "leader")
            .await;
    }
}

fn put(i: u64) -> DefCommand {
    DefCommand::Put {
        key: format!("queue/{i}"),
        record: format!("record {i}").into_bytes(),
    }
}

async fn write(node: &ClusterNode, i: u64) -> Result<(), NodeError> {
    // Bounded: a write nobody commits (a lost leader, a forward to a stopped node) fails the
    // test naming it instead of hanging it.
    let Ok(reply) = tokio::time::timeout(WAIT, node.write(&put(i))).await else {
        panic!("write {i}: not committed or refused within {WAIT:?}");
    };
    match reply? {
        DefReply::Done { .. } => Ok(()),
        other => panic!("write {i}: {other:?}"),
    }
}

/// Writes `i` through whichever node leads, following NotLeader hints; returns the node
/// that took it.
async fn settle(nodes: &BTreeMap<NodeId, ClusterNode>, i: u64) -> NodeId {
    let deadline = Instant::now() + WAIT;
    let mut at = leader(nodes).await;
    loop {
        match write(&nodes[&at], i).await {
            Ok(()) => return at,
            Err(NodeError::NotLeader(hint)) => {
                assert!(Instant::now() < deadline, "no write accepted in {WAIT:?}");
                at = match hint {
                    Some(h) if nodes.contains_key(&h) => h,
                    _ => leader(nodes).await,
                };
            }
            Err(e) => panic!("write {i}: {e}"),
        }
    }
}

/// Every node applies the same entries in the same order and has every acknowledged key.
async fn converged(nodes: &BTreeMap<NodeId, ClusterNode>, acked: &[u64]) {
    // A write acknowledged now was committed by the real leader in its term: all before it
    // is committed too, and that leader's log is the reference.
    let l = settle(nodes, u64::MAX).await;
    let last = nodes[&l].raft.metrics().borrow().last_log_index;
    for (id, n) in nodes {
        n.raft
            .wait(Some(WAIT))
            .applied_index_at_least(last, "converge")
            .await
            .unwrap_or_else(|e| panic!("node {id} did not catch up: {e}"));
    }
    let digest = nodes[&l].definitions.with(|d| d.digest());
    for (id, n) in nodes {
        n.definitions.with(|d| {
            assert_eq!(d.digest(), digest, "node {id} applied another history");
            for i in acked {
                assert!(
                    d.get(&format!("queue/{i}")).is_some(),
                    "node {id} lacks {i}"
                );
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_over_tcp_failover_and_catch_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret: &[u8] = b"a shared cluster secret";
    let (mut nodes, members) = cluster(&[secret, secret, secret], dir.path()).await;
    // All three start campaigning at once: the first leader may be replaced within a few
    // election rounds. One acknowledged write settles who leads.
    let l = settle(&nodes, 1_000_000).await;

    // Sequential writes: each waits for a majority's fsync and the leader's apply.
    let n_seq = 200u64;
    let t = Instant::now();
    let mut lat = Vec::new();
    for i in 0..n_seq {
        let s = Instant::now();
        write(&nodes[&l], i).await.expect("write");
        lat.push(s.elapsed());
    }
    let seq = t.elapsed();
    lat.sort();
    // Concurrent writers: the group commits several proposals per fsync round.
    let n_conc = 400u64;
    let t = Instant::now();
    let leader_node = &nodes[&l];
    let mut writers = Vec::new();
    for w in 0..8u64 {
        writers.push(async move {
            for i in 0..n_conc / 8 {
                write(leader_node, n_seq + w * 1000 + i)
                    .await
                    .expect("write");
            }
        });
    }
    futures_join_all(writers).await;
    let conc = t.elapsed();
    eprintln!(
        "3-node metadata group on loopback: sequential {n_seq} writes {:.0}/s, latency p50 {:?} p99 {:?}; 8 concurrent writers {:.0}/s",
        n_seq as f64 / seq.as_secs_f64(),
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100],
        n_conc as f64 / conc.as_secs_f64()
    );
    let mut acked: Vec<u64> = (0..n_seq).collect();
    acked.push(1_000_000);
    for w in 0..8u64 {
        acked.extend((0..n_conc / 8).map(|i| n_seq + w * 1000 + i));
    }

    // A follower takes writes too: it forwards them to the leader.
    let follower = *nodes.keys().find(|id| **id != l).expect("a follower");
    for i in 0..20 {
        write(&nodes[&follower], 20_000 + i)
            .await
            .expect("write through a follower");
        acked.push(20_000 + i);
    }

    // Stop the leader: the others elect one and take writes again.
    let old = nodes.remove(&l).expect("leader");
    let old_addr = old.addr;
    let t = Instant::now();
    old.shutdown().await;
    let elected_id = leader(&nodes).await;
    let elected = t.elapsed();
    let mut i = 10_000;
    let new = settle(&nodes, i).await;
    acked.push(i);
    let resumed = t.elapsed();
    eprintln!(
        "leader {l} stopped: node {elected_id} elected after {elected:?}, writes resumed after {resumed:?}"
    );
    assert_ne!(new, l);
    for j in 0..50 {
        i += 1;
        write(&nodes[&new], i)
            .await
            .expect("write on the new leader");
        acked.push(i);
        let _ = j;
    }

    // The old leader restarts on its files and address and catches up from the log.
    let l2 = TcpListener::bind(old_addr).await.expect("rebind");
    let o = options(l, old_addr, &members, secret, dir.path());
    nodes.insert(l, ClusterNode::start_on(o, l2).await.expect("restart"));
    converged(&nodes, &acked).await;
    let status = nodes[&new].status();
    assert_eq!(status.leader, Some(new));
    assert_eq!(status.members.len(), 3);
    assert!(status.members.iter().all(|m| m.lag.is_some()));

    // A member gone for good is forgotten (asked on a follower: forwarded to the leader);
    // the other two go on as a 2-node group.
    let gone = *nodes.keys().find(|id| **id != new).expect("a follower");
    let asker = *nodes
        .keys()
        .find(|id| **id != new && **id != gone)
        .unwrap_or(&new);
    nodes.remove(&gone).expect("member").shutdown().await;
    nodes[&asker].forget(gone).await.expect("forget-node");
    assert!(matches!(
        nodes[&asker].forget(gone).await,
        Err(NodeError::Raft(e)) | Err(NodeError::Forward(_, warren_cluster::transport::TransportError::Remote(e))) if e.contains("not a member")
    ));
    let st = nodes[&settle(&nodes, 30_000).await].status();
    assert_eq!(
        st.members.iter().map(|m| m.id).collect::<Vec<_>>(),
        nodes.keys().copied().collect::<Vec<_>>()
    );
    acked.push(30_000);
    converged(&nodes, &acked).await;
    for n in nodes.into_values() {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_the_wrong_secret_gets_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, _) = cluster(&[b"right", b"right", b"wrong"], dir.path()).await;
    let mut good: BTreeMap<NodeId, ClusterNode> = BTreeMap::new();
    let mut nodes = nodes;
    let intruder = nodes.remove(&3).expect("node 3");
    good.extend(nodes);
    let l = leader(&good).await;
    assert_ne!(l, 3);
    for i in 0..20 {
        write(&good[&l], i).await.expect("write");
    }
    converged(&good, &(0..20).collect::<Vec<_>>()).await;
    // Node 3 was never let in: it applied nothing and follows no leader.
    let m = intruder.raft.metrics().borrow().clone();
    assert!(intruder.definitions.with(|d| d.is_empty()));
    assert_eq!(m.last_applied, None);
    assert!(m.current_leader.is_none() || m.current_leader == Some(3));
    intruder.shutdown().await;
    for n in good.into_values() {
        n.shutdown().await;
    }
}

/// A CA that signs node certificates (PEM), as an operator's would.
struct Ca {
    params: rcgen::CertificateParams,
    key: rcgen::KeyPair,
    pem: String,
}

impl Ca {
    fn new(name: &str) -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} CA"));
        let key = rcgen::KeyPair::generate().expect("key");
        let pem = params.self_signed(&key).expect("ca").pem();
        Self { params, key, pem }
    }

    /// Node `id`'s TLS: this CA's certificate for its address 127.0.0.{id}, written as PEM
    /// files (what --cluster-tls-cert/-key/-ca read), trusting `trusted`.
    fn node(&self, id: NodeId, trusted: &Ca, dir: &Path) -> Option<ClusterTls> {
        let params = rcgen::CertificateParams::new(vec![format!("127.0.0.{id}")]).expect("params");
        let key = rcgen::KeyPair::generate().expect("key");
        let issuer = rcgen::Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).expect("sign");
        let (c, k, a) = (
            dir.join(format!("n{id}.pem")),
            dir.join(format!("n{id}.key")),
            dir.join(format!("n{id}-ca.pem")),
        );
        std::fs::write(&c, cert.pem()).expect("write");
        std::fs::write(&k, key.serialize_pem()).expect("write");
        std::fs::write(&a, &trusted.pem).expect("write");
        Some(ClusterTls::from_pem_files(&c, &k, &a).expect("tls files"))
    }
}

/// Two TLS nodes of one CA replicate with each other; the third (`third`'s TLS) never gets
/// in.
async fn tls_cluster_keeps_out(third: impl FnOnce(&Ca, &Path) -> Option<ClusterTls>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new("cluster");
    let tls = [
        ca.node(1, &ca, dir.path()),
        ca.node(2, &ca, dir.path()),
        third(&ca, dir.path()),
    ];
    let secret: &[u8] = b"a shared cluster secret";
    let (mut nodes, _) = cluster_tls(&[secret, secret, secret], &tls, dir.path()).await;
    let intruder = nodes.remove(&3).expect("node 3");
    let l = leader(&nodes).await;
    for i in 0..20 {
        write(&nodes[&l], i).await.expect("write");
    }
    converged(&nodes, &(0..20).collect::<Vec<_>>()).await;
    let m = intruder.raft.metrics().borrow().clone();
    assert!(intruder.definitions.with(|d| d.is_empty()));
    assert_eq!(m.last_applied, None);
    assert!(m.current_leader.is_none() || m.current_leader == Some(3));
    intruder.shutdown().await;
    for n in nodes.into_values() {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_tls_nodes_replicate_and_converge() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new("cluster");
    let tls: Vec<_> = (1..=3).map(|id| ca.node(id, &ca, dir.path())).collect();
    let secret: &[u8] = b"a shared cluster secret";
    let (nodes, _) = cluster_tls(&[secret, secret, secret], &tls, dir.path()).await;
    let l = settle(&nodes, 1_000_000).await;
    let t = Instant::now();
    for i in 0..200 {
        write(&nodes[&l], i).await.expect("write");
    }
    eprintln!(
        "3-node metadata group over TLS on loopback: sequential 200 writes {:.0}/s",
        200.0 / t.elapsed().as_secs_f64()
    );
    let mut acked: Vec<u64> = (0..200).collect();
    acked.push(1_000_000);
    converged(&nodes, &acked).await;
    for id in 1..=3 {
        assert!(nodes[&l].reachable(id), "node {id} unreachable");
    }
    for n in nodes.into_values() {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_certificate_of_another_ca_gets_nothing() {
    tls_cluster_keeps_out(|ca, dir| Ca::new("rogue").node(3, ca, dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_tls_gets_nothing_from_a_tls_cluster() {
    tls_cluster_keeps_out(|_, _| None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloaded_tls_files_let_in_a_node_of_a_newly_trusted_ca() {
    // Node 3's certificate is of another CA: nodes 1 and 2 refuse it. They read their files
    // again (SIGHUP: `ClusterNode::reload_tls`), now with a CA bundle that trusts both, and
    // the connections made from then on let node 3 in: it catches up.
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, other) = (Ca::new("cluster"), Ca::new("second"));
    let tls = [
        ca.node(1, &ca, dir.path()),
        ca.node(2, &ca, dir.path()),
        other.node(3, &ca, dir.path()),
    ];
    let secret: &[u8] = b"a shared cluster secret";
    let (mut nodes, _) = cluster_tls(&[secret, secret, secret], &tls, dir.path()).await;
    let third = nodes.remove(&3).expect("node 3");
    let l = leader(&nodes).await;
    for i in 0..10 {
        write(&nodes[&l], i).await.expect("write");
    }
    converged(&nodes, &(0..10).collect::<Vec<_>>()).await;
    assert_eq!(third.raft.metrics().borrow().last_applied, None);
    for id in [1, 2] {
        let bundle = dir.path().join(format!("n{id}-ca.pem"));
        std::fs::write(&bundle, format!("{}{}", ca.pem, other.pem)).expect("write");
        let fresh = ClusterTls::from_pem_files(
            &dir.path().join(format!("n{id}.pem")),
            &dir.path().join(format!("n{id}.key")),
            &bundle,
        )
        .expect("tls files");
        nodes[&id].reload_tls(&fresh).expect("reload");
    }
    nodes.insert(3, third);
    settle(&nodes, 10).await;
    converged(&nodes, &(0..=10).collect::<Vec<_>>()).await;
    for n in nodes.into_values() {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_through_a_follower_catches_up_votes_and_leaves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret: &[u8] = b"right";
    let (mut nodes, members) = cluster(&[secret, secret, secret], dir.path()).await;
    // Writes go through whichever node leads (a busy machine may see an election).
    for i in 0..30 {
        settle(&nodes, i).await;
    }
    // Node 4 starts in join mode: it proposes no membership of its own, so it stays out
    // (and elects nobody) until a member adds it.
    let listener = bind(4).await;
    let addr = listener.local_addr().expect("addr");
    let mut o = options(4, addr, &members, secret, dir.path());
    o.members = [(4, addr.to_string())].into();
    o.join = true;
    let newcomer = ClusterNode::start_on(o, listener)
        .await
        .expect("start node 4");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(newcomer.raft.metrics().borrow().current_leader, None);
    // Added through a follower (forwarded to the leader): it catches up and votes.
    let l = leader(&nodes).await;
    let follower = (1..=3).find(|i| *i != l).expect("a follower");
    nodes[&follower]
        .join(4, &addr.to_string())
        .await
        .expect("join node 4");
    let voters: Vec<NodeId> = nodes[&l]
        .raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .voter_ids()
        .collect();
    assert_eq!(voters, [1, 2, 3, 4]);
    // Adding it again is refused (by the follower itself, or by the leader it forwards to).
    let again = nodes[&follower].join(4, &addr.to_string()).await;
    assert!(
        matches!(&again, Err(e) if e.to_string().contains("voter already")),
        "{again:?}"
    );
    nodes.insert(4, newcomer);
    write(&nodes[&leader(&nodes).await], 30)
        .await
        .expect("write");
    converged(&nodes, &(0..=30).collect::<Vec<_>>()).await;
    // It leaves (forwarded to the leader): three voters again, and writes go on.
    nodes[&4].leave().await.expect("leave");
    let gone = nodes.remove(&4).expect("node 4");
    let l = leader(&nodes).await;
    let voters: Vec<NodeId> = nodes[&l]
        .raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .voter_ids()
        .collect();
    assert_eq!(voters, [1, 2, 3]);
    settle(&nodes, 31).await;
    converged(&nodes, &(0..=31).collect::<Vec<_>>()).await;
    gone.shutdown().await;
    for n in nodes.into_values() {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_joining_at_once_both_become_voters() {
    // openraft takes one membership change at a time ("already undergoing a configuration
    // change"): a change that meets another one in progress waits for it (bounded) instead
    // of failing, and adds to the membership as it is then (neither join undoes the other).
    let dir = tempfile::tempdir().expect("tempdir");
    let secret: &[u8] = b"right";
    let (mut nodes, members) = cluster(&[secret, secret, secret], dir.path()).await;
    settle(&nodes, 0).await;
    let mut newcomers = Vec::new();
    for id in [4, 5] {
        let listener = bind(id).await;
        let addr = listener.local_addr().expect("addr");
        let mut o = options(id, addr, &members, secret, dir.path());
        o.members = [(id, addr.to_string())].into();
        o.join = true;
        let node = ClusterNode::start_on(o, listener)
            .await
            .expect("start a newcomer");
        newcomers.push((id, addr.to_string(), node));
    }
    let l = leader(&nodes).await;
    let ((i4, a4, _), (i5, a5, _)) = (&newcomers[0], &newcomers[1]);
    let (a, b) = tokio::join!(
        tokio::time::timeout(WAIT, nodes[&l].join(*i4, a4)),
        tokio::time::timeout(WAIT, nodes[&l].join(*i5, a5))
    );
    a.expect("join 4 in time").expect("join node 4");
    b.expect("join 5 in time").expect("join node 5");
    let voters: Vec<NodeId> = nodes[&l]
        .raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .voter_ids()
        .collect();
    assert_eq!(voters, [1, 2, 3, 4, 5]);
    for (id, _, node) in newcomers {
        nodes.insert(id, node);
    }
    for n in nodes.into_values() {
        n.shutdown().await;
    }
}

/// Runs the futures concurrently to completion (no extra dependency for a join).
async fn futures_join_all<F: std::future::Future<Output = ()>>(futs: Vec<F>) {
    let mut futs: Vec<_> = futs.into_iter().map(Box::pin).map(Some).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for slot in futs.iter_mut() {
            if let Some(f) = slot {
                if f.as_mut().poll(cx).is_ready() {
                    *slot = None;
                } else {
                    pending = true;
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await
}
