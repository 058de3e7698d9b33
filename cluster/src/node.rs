//! A cluster node: the metadata group over the TCP transport, with its files under a data
//! directory (`<data-dir>/cluster/meta.redb` and `meta.snapshot`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, ServerState};
use tokio::net::TcpListener;

use crate::definitions::{DefCommand, DefReply, Definitions};
use crate::log_store::LogStore;
pub use crate::membership::{ForgetError, JoinError};
use crate::membership::{forget_here, join_here};
use crate::state_machine::{SnapshotFileError, StateMachineStore};
use crate::transport::{self, Groups, Peers, Secret};
use crate::{META_GROUP, NodeId, Raft};

/// How to start a node.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub id: NodeId,
    /// Where the cluster listener binds (`--cluster`).
    pub listen: SocketAddr,
    /// Every member's cluster address by id, this node's included (`--peers` plus itself).
    pub members: BTreeMap<NodeId, String>,
    pub secret: Secret,
    /// TLS on the cluster port (`--cluster-tls-cert/-key/-ca`): every connection in and
    /// out; `None`: plain TCP.
    pub tls: Option<transport::ClusterTls>,
    pub data_dir: PathBuf,
    pub heartbeat_ms: u64,
    pub election_timeout_ms: u64,
    /// A snapshot after this many applied entries.
    pub snapshot_every: u64,
    /// A new member of an existing cluster (`--join`): it does not propose a first
    /// membership; a member adds it (`ClusterNode::join`).
    pub join: bool,
}

impl NodeOptions {
    /// Timings for a LAN (RabbitMQ's Ra uses similar): a dead leader is replaced within
    /// about a second.
    pub fn new(
        id: NodeId,
        listen: SocketAddr,
        members: BTreeMap<NodeId, String>,
        secret: Secret,
        data_dir: PathBuf,
    ) -> Self {
        Self {
            id,
            listen,
            members,
            secret,
            tls: None,
            data_dir,
            heartbeat_ms: 100,
            election_timeout_ms: 500,
            snapshot_every: 1000,
            join: false,
        }
    }
}

/// Why a node could not start or a request failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cluster listener {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    #[error("cluster log: {0}")]
    Log(#[from] redb::Error),
    #[error(transparent)]
    Snapshot(#[from] SnapshotFileError),
    #[error("raft config: {0}")]
    Config(#[from] openraft::ConfigError),
    #[error("raft: {0}")]
    Raft(String),
    #[error("not the leader (leader: {0:?})")]
    NotLeader(Option<NodeId>),
    #[error("forwarding to the leader {0}: {1}")]
    Forward(NodeId, transport::TransportError),
    #[error("bad reply from the state machine: {0}")]
    Reply(#[from] serde_json::Error),
}

/// A membership change forwarded to a group's leader.
enum GroupChange {
    Join(NodeId, String),
    Forget(NodeId),
}

/// One member's view in [`Status`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct MemberStatus {
    pub id: NodeId,
    pub addr: String,
    /// A voter (counts for a majority); false for a learner still catching up.
    pub voter: bool,
    /// This node reaches it now (its cluster connection worked at the last request).
    pub online: bool,
    /// The last log index the leader knows this member has (leader only).
    pub matched: Option<u64>,
    /// Entries it is behind the leader's last log index (leader only).
    pub lag: Option<u64>,
}

/// What `warren ctl cluster-status` shows.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Status {
    pub id: NodeId,
    pub state: String,
    pub term: u64,
    pub leader: Option<NodeId>,
    pub last_log_index: Option<u64>,
    pub last_applied: Option<u64>,
    pub members: Vec<MemberStatus>,
}

/// Group `raft`'s status as this node sees it: its role, term, leader, log indexes, and
/// each member (voters and learners) with the last index the leader knows it has and its
/// lag (known on the leader only). The metadata group's and every quorum queue's.
pub fn raft_status(raft: &Raft, online: &dyn Fn(NodeId) -> bool) -> Status {
    let m = raft.metrics().borrow().clone();
    let last = m.last_log_index;
    let replication = m.replication.clone();
    let membership = m.membership_config.membership();
    let members = membership
        .nodes()
        .map(|(id, n)| {
            let matched = replication
                .as_ref()
                .and_then(|r| r.get(id).cloned())
                .map(|l| l.map(|l| l.index).unwrap_or(0));
            MemberStatus {
                id: *id,
                addr: n.addr.clone(),
                voter: membership.voter_ids().any(|v| v == *id),
                online: online(*id),
                matched,
                lag: matched.map(|x| last.unwrap_or(0).saturating_sub(x)),
            }
        })
        .collect();
    Status {
        id: m.id,
        state: match m.state {
            ServerState::Leader => "leader",
            ServerState::Follower => "follower",
            ServerState::Candidate => "candidate",
            ServerState::Learner => "learner",
            ServerState::Shutdown => "shutdown",
        }
        .into(),
        term: m.current_term,
        leader: m.current_leader,
        last_log_index: last,
        last_applied: m.last_applied.map(|l| l.index),
        members,
    }
}

/// A running cluster node.
pub struct ClusterNode {
    pub raft: Raft,
    pub definitions: StateMachineStore<Definitions>,
    pub addr: SocketAddr,
    id: NodeId,
    server: tokio::task::JoinHandle<()>,
    peers: Peers,
    /// Every group this node serves (the metadata group and quorum queues' groups), for the
    /// listener to route each envelope by its group id.
    groups: Groups,
    data_dir: PathBuf,
    heartbeat_ms: u64,
    election_timeout_ms: u64,
    snapshot_every: u64,
    /// The cluster port's TLS, shared with the listener and every peer connection
    /// (`reload_tls` replaces it for the connections made afterwards).
    tls: Option<transport::ClusterTls>,
}

/// How long a write forwarded to the leader may take (a commit is a few milliseconds; an
/// election in between is under a second with the default timings).
pub const FORWARD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long adding a member may take: it catches up first (a snapshot and the log since).
pub const JOIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

impl ClusterNode {
    /// Serves the brokers' mail from peers (`transport::Rpc::Mail`) with `handler`.
    pub fn set_mail_handler(&self, handler: transport::MailHandler) {
        self.groups.set_mail_handler(handler);
    }

    /// Answers peers' questions ([`ClusterNode::ask`]) with `handler`.
    pub fn set_ask_handler(&self, handler: transport::AskHandler) {
        self.groups.set_ask_handler(handler);
    }

    /// Asks member `target` the hosts' question `question` and waits for its answer,
    /// within `timeout`.
    pub async fn ask(
        &self,
        target: NodeId,
        question: Vec<u8>,
        timeout: std::time::Duration,
    ) -> Result<Vec<u8>, NodeError> {
        let addr = self
            .members()
            .remove(&target)
            .ok_or_else(|| NodeError::Raft(format!("node {target} is not a member")))?;
        self.peers
            .ask(target, &addr, question, timeout)
            .await
            .map_err(|e| NodeError::Raft(format!("question to node {target}: {e}")))
    }

    /// Sends the brokers' mail `batch` to member `target` (at its address in the metadata
    /// group's membership) and waits until its broker took it, within `timeout`; the
    /// incarnation of its broker.
    pub async fn send_mail(
        &self,
        target: NodeId,
        batch: Vec<u8>,
        timeout: std::time::Duration,
    ) -> Result<u64, NodeError> {
        let addr = {
            let m = self.raft.metrics();
            let m = m.borrow();
            m.membership_config
                .membership()
                .get_node(&target)
                .map(|n| n.addr.clone())
        };
        let addr = addr.ok_or_else(|| NodeError::Raft(format!("node {target} is not a member")))?;
        self.peers
            .send_mail(target, &addr, batch, timeout)
            .await
            .map_err(|e| NodeError::Raft(format!("mail to node {target}: {e}")))
    }

    /// Opens the node's files, binds the cluster listener and starts the metadata group.
    /// A node with an empty log proposes the configured members as the first membership
    /// (every fresh node proposes the same one; openraft accepts that).
    pub async fn start(opts: NodeOptions) -> Result<Self, NodeError> {
        let listener = TcpListener::bind(opts.listen)
            .await
            .map_err(|e| NodeError::Listen(opts.listen, e))?;
        Self::start_on(opts, listener).await
    }

    /// As [`ClusterNode::start`] on a listener already bound (tests bind port 0 first to
    /// learn every member's address).
    pub async fn start_on(opts: NodeOptions, listener: TcpListener) -> Result<Self, NodeError> {
        let dir = opts.data_dir.join("cluster");
        // A group stopped in this process a moment ago may still have a task of its old
        // Raft holding the file (openraft's tasks end asynchronously after shutdown).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let log = loop {
            match LogStore::open(&dir.join("meta.redb")) {
                Ok(log) => break log,
                Err(redb::Error::DatabaseAlreadyOpen) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let sm = StateMachineStore::open(Some(&dir.join("meta.snapshot")), Definitions::new())?;
        let config = crate::raft_config(
            opts.heartbeat_ms,
            opts.election_timeout_ms,
            opts.snapshot_every,
        )?;
        let addr = listener
            .local_addr()
            .map_err(|e| NodeError::Listen(opts.listen, e))?;
        let peers = Peers::new(opts.id, opts.secret.clone()).with_tls(opts.tls.clone());
        let raft = Raft::new(opts.id, config, peers.network(META_GROUP), log, sm.clone())
            .await
            .map_err(|e| NodeError::Raft(e.to_string()))?;
        let groups = Groups::default();
        groups.insert(META_GROUP, raft.clone());
        let server = tokio::spawn(transport::serve(
            listener,
            opts.id,
            opts.secret.clone(),
            opts.tls.clone(),
            groups.clone(),
        ));
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|e| NodeError::Raft(e.to_string()))?;
        if !initialized && !opts.join {
            let members: BTreeMap<NodeId, BasicNode> = opts
                .members
                .iter()
                .map(|(id, a)| (*id, BasicNode::new(a)))
                .collect();
            match raft.initialize(members).await {
                Ok(())
                | Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => {}
                Err(e) => return Err(NodeError::Raft(e.to_string())),
            }
        }
        Ok(Self {
            raft,
            definitions: sm,
            addr,
            id: opts.id,
            server,
            peers,
            groups,
            data_dir: opts.data_dir.clone(),
            heartbeat_ms: opts.heartbeat_ms,
            election_timeout_ms: opts.election_timeout_ms,
            snapshot_every: opts.snapshot_every,
            tls: opts.tls.clone(),
        })
    }

    /// Uses `fresh` (the TLS files read again: SIGHUP) for the cluster connections made and
    /// accepted from now on; open ones keep their certificate. An error if this node was
    /// started without TLS (a plain node cannot turn TLS on while it runs).
    pub fn reload_tls(&self, fresh: &transport::ClusterTls) -> Result<(), String> {
        match &self.tls {
            Some(tls) => {
                tls.reload_from(fresh);
                Ok(())
            }
            None => Err("this node was started without --cluster-tls-*".into()),
        }
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The longest a follower waits without hearing its leader before it calls an
    /// election (openraft waits between the minimum and twice it): a leader that has not
    /// heard from a majority for that long may have been replaced.
    pub fn election_timeout_max(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.election_timeout_ms * 2)
    }

    /// Starts (or restarts, on its files) group `group` on this node with state machine
    /// `sm`, over the same transport and timings as the metadata group, its log in
    /// `<data-dir>/cluster/<file>.redb` and snapshot in `<file>.snapshot`. A group with an
    /// empty log proposes `members` (id -> cluster address) as its first membership: every
    /// member proposes the same one, and openraft accepts that. `max_entries`: entries per
    /// append request (their total must stay under the transport's frame limit).
    pub async fn start_group<S: crate::state_machine::StateMachine>(
        &self,
        group: u64,
        file: &str,
        members: &BTreeMap<NodeId, String>,
        sm: S,
        max_entries: u64,
    ) -> Result<(Raft, StateMachineStore<S>), NodeError> {
        let dir = self.data_dir.join("cluster");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let log = loop {
            match LogStore::open(&dir.join(format!("{file}.redb"))) {
                Ok(log) => break log,
                Err(redb::Error::DatabaseAlreadyOpen) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let sm = StateMachineStore::open(Some(&dir.join(format!("{file}.snapshot"))), sm)?;
        let mut config = (*crate::raft_config(
            self.heartbeat_ms,
            self.election_timeout_ms,
            self.snapshot_every,
        )?)
        .clone();
        // One append request must fit a frame (transport::MAX_FRAME): a group whose entries
        // are large sends fewer at a time.
        config.max_payload_entries = max_entries.max(1);
        let config = std::sync::Arc::new(config.validate()?);
        let raft = Raft::new(self.id, config, self.peers.network(group), log, sm.clone())
            .await
            .map_err(|e| NodeError::Raft(e.to_string()))?;
        self.groups.insert(group, raft.clone());
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|e| NodeError::Raft(e.to_string()))?;
        if !initialized && members.contains_key(&self.id) {
            let members: BTreeMap<NodeId, BasicNode> = members
                .iter()
                .map(|(id, a)| (*id, BasicNode::new(a)))
                .collect();
            match raft.initialize(members).await {
                Ok(())
                | Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => {}
                Err(e) => return Err(NodeError::Raft(e.to_string())),
            }
        }
        Ok((raft, sm))
    }

    /// Stops group `group` on this node and deletes its files (its queue was deleted).
    pub async fn remove_group(&self, group: u64, raft: &Raft, file: &str) {
        self.groups.remove(group);
        let _ = raft.shutdown().await;
        let dir = self.data_dir.join("cluster");
        for ext in ["redb", "snapshot"] {
            let path = dir.join(format!("{file}.{ext}"));
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "could not remove a deleted group's file");
            }
        }
    }

    /// The metadata group's members (id -> cluster address), as this node knows them.
    pub fn members(&self) -> BTreeMap<NodeId, String> {
        self.raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .nodes()
            .map(|(id, n)| (*id, n.addr.clone()))
            .collect()
    }

    /// Proposes a change to the definitions on any node: the leader proposes it, a follower
    /// forwards it to the leader it knows (one hop). Answered once committed and applied on
    /// the leader. `NotLeader` when no leader is known (an election is on): retry.
    pub async fn write(&self, cmd: &DefCommand) -> Result<DefReply, NodeError> {
        match self.raft.client_write(cmd.encode()).await {
            Ok(r) => Ok(DefReply::decode(&r.data)?),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                match (f.leader_id, f.leader_node) {
                    (Some(id), Some(node)) if id != self.id => {
                        // A leader cut off by a partition does not reset the connection:
                        // the forward would stall for its whole timeout while the others
                        // elect a new leader in about a second. Once this node knows the
                        // leader is no longer `id`, give up so the caller retries there
                        // (as after any failed forward, the change may have reached `id`
                        // and commit later).
                        let mut metrics = self.raft.metrics();
                        let moved = async move {
                            while metrics.changed().await.is_ok() {
                                if metrics.borrow().current_leader != Some(id) {
                                    return;
                                }
                            }
                            std::future::pending::<()>().await
                        };
                        let forward = self.peers.forward(
                            META_GROUP,
                            id,
                            &node.addr,
                            cmd.encode(),
                            FORWARD_TIMEOUT,
                        );
                        let reply = tokio::select! {
                            r = forward => r.map_err(|e| NodeError::Forward(id, e))?,
                            () = moved => return Err(NodeError::NotLeader(None)),
                        };
                        Ok(DefReply::decode(&reply)?)
                    }
                    (leader, _) => Err(NodeError::NotLeader(leader)),
                }
            }
            Err(e) => Err(NodeError::Raft(e.to_string())),
        }
    }

    /// Removes member `id` from the group (rabbitmqctl's forget_cluster_node): a member gone
    /// for good, so the rest no longer count it for a majority nor keep log for it. Runs on
    /// the leader, forwarded there from a follower. The removed node, if it runs, stops
    /// receiving entries.
    pub async fn forget(&self, id: NodeId) -> Result<(), NodeError> {
        // A follower's view of the membership may lag (a member just added): only the
        // leader's decides, so a follower forwards at once.
        if let Some((l, addr)) = self.leader_elsewhere()? {
            return self
                .peers
                .forward_forget(META_GROUP, l, &addr, id, FORWARD_TIMEOUT)
                .await
                .map_err(|e| NodeError::Forward(l, e));
        }
        match forget_here(&self.raft, id).await {
            Ok(()) => Ok(()),
            Err(ForgetError::Raft(e))
                if matches!(
                    *e,
                    RaftError::APIError(ClientWriteError::ForwardToLeader(_))
                ) =>
            {
                let RaftError::APIError(ClientWriteError::ForwardToLeader(f)) = *e else {
                    return Err(NodeError::NotLeader(None));
                };
                match (f.leader_id, f.leader_node) {
                    (Some(l), Some(node)) if l != self.id => self
                        .peers
                        .forward_forget(META_GROUP, l, &node.addr, id, FORWARD_TIMEOUT)
                        .await
                        .map_err(|e| NodeError::Forward(l, e)),
                    (leader, _) => Err(NodeError::NotLeader(leader)),
                }
            }
            Err(e) => Err(NodeError::Raft(e.to_string())),
        }
    }

    /// Adds node `id`, started with `join` at cluster address `addr`, as a voter
    /// (rabbitmqctl's join_cluster, seen from the cluster). Runs on the leader, forwarded
    /// there from a follower; answered once the new member has caught up and votes.
    pub async fn join(&self, id: NodeId, addr: &str) -> Result<(), NodeError> {
        if let Some((l, leader_addr)) = self.leader_elsewhere()? {
            return self
                .peers
                .forward_join(META_GROUP, l, &leader_addr, id, addr, JOIN_TIMEOUT)
                .await
                .map_err(|e| NodeError::Forward(l, e));
        }
        let not_leader = |e: &JoinError| {
            matches!(
                e,
                JoinError::AddLearner(_, e) | JoinError::Raft(e)
                    if matches!(**e, RaftError::APIError(ClientWriteError::ForwardToLeader(_)))
            )
        };
        match join_here(&self.raft, id, addr).await {
            Ok(()) => Ok(()),
            Err(e) if not_leader(&e) => {
                let leader = self.raft.metrics().borrow().current_leader;
                let node = leader.and_then(|l| {
                    self.raft
                        .metrics()
                        .borrow()
                        .membership_config
                        .membership()
                        .get_node(&l)
                        .cloned()
                });
                match (leader, node) {
                    (Some(l), Some(node)) if l != self.id => self
                        .peers
                        .forward_join(META_GROUP, l, &node.addr, id, addr, JOIN_TIMEOUT)
                        .await
                        .map_err(|e| NodeError::Forward(l, e)),
                    (leader, _) => Err(NodeError::NotLeader(leader)),
                }
            }
            Err(e) => Err(NodeError::Raft(e.to_string())),
        }
    }

    /// Adds node `id` (cluster address `addr`, running the group already: it starts it
    /// uninitialized when it learns it is a member) to group `group` as a voter, on the
    /// group's leader: a learner first, brought up to date from the log or a snapshot, then a
    /// voter (joint consensus). `raft`: this node's copy of the group, if it is a member;
    /// `members`: the group's members, tried in turn (the leader this node knows first) when
    /// this node does not lead it. Answered once the new member votes (bounded by
    /// `JOIN_TIMEOUT`).
    pub async fn group_join(
        &self,
        group: u64,
        raft: Option<&Raft>,
        members: &BTreeMap<NodeId, String>,
        id: NodeId,
        addr: &str,
    ) -> Result<(), NodeError> {
        let join = GroupChange::Join(id, addr.to_string());
        self.on_group_leader(group, raft, members, join).await
    }

    /// Removes node `id` from group `group`'s voters (joint consensus), on its leader (as
    /// [`ClusterNode::group_join`] finds it).
    pub async fn group_forget(
        &self,
        group: u64,
        raft: Option<&Raft>,
        members: &BTreeMap<NodeId, String>,
        id: NodeId,
    ) -> Result<(), NodeError> {
        self.on_group_leader(group, raft, members, GroupChange::Forget(id))
            .await
    }

    /// Forwards a membership change of group `group` to its leader: the one this node knows
    /// first, then every other member until one takes it. A member that does not lead
    /// refuses it at once (openraft's forward-to-leader error); while every member does (an
    /// election: a leader that removed itself stepped down), it asks again, for up to
    /// `FORWARD_TIMEOUT`.
    async fn on_group_leader(
        &self,
        group: u64,
        raft: Option<&Raft>,
        members: &BTreeMap<NodeId, String>,
        change: GroupChange,
    ) -> Result<(), NodeError> {
        let deadline = tokio::time::Instant::now() + FORWARD_TIMEOUT;
        loop {
            let hint = raft.and_then(|r| r.metrics().borrow().current_leader);
            if let Some(raft) = raft.filter(|_| hint == Some(self.id)) {
                return match &change {
                    GroupChange::Join(id, addr) => {
                        match tokio::time::timeout(JOIN_TIMEOUT, join_here(raft, *id, addr)).await {
                            Ok(r) => r.map_err(|e| NodeError::Raft(e.to_string())),
                            Err(_) => Err(NodeError::Raft(format!(
                                "node {id} did not catch up within {} s",
                                JOIN_TIMEOUT.as_secs()
                            ))),
                        }
                    }
                    GroupChange::Forget(id) => forget_here(raft, *id)
                        .await
                        .map_err(|e| NodeError::Raft(e.to_string())),
                };
            }
            let mut order: Vec<(NodeId, &String)> = members
                .iter()
                .filter(|(id, _)| **id != self.id)
                .map(|(id, a)| (*id, a))
                .collect();
            order.sort_by_key(|(id, _)| Some(*id) != hint);
            let mut error = NodeError::NotLeader(hint);
            for (target, addr) in order {
                let r = match &change {
                    GroupChange::Join(id, member_addr) => {
                        self.peers
                            .forward_join(group, target, addr, *id, member_addr, JOIN_TIMEOUT)
                            .await
                    }
                    GroupChange::Forget(id) => {
                        self.peers
                            .forward_forget(group, target, addr, *id, FORWARD_TIMEOUT)
                            .await
                    }
                };
                match r {
                    Ok(()) => return Ok(()),
                    // Not the leader: try the next.
                    Err(transport::TransportError::Remote(why))
                        if why.contains("forward request to") => {}
                    // The leader's answer: final.
                    Err(e @ transport::TransportError::Remote(_)) => {
                        return Err(NodeError::Forward(target, e));
                    }
                    // Unreachable: another may lead.
                    Err(e) => error = NodeError::Forward(target, e),
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(error);
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// `None` when this node leads; else the leader and its address, or `NotLeader` when
    /// no leader is known (an election) or its address is not (this node's view lags).
    fn leader_elsewhere(&self) -> Result<Option<(NodeId, String)>, NodeError> {
        let m = self.raft.metrics().borrow().clone();
        match m.current_leader {
            Some(l) if l == self.id => Ok(None),
            Some(l) => match m.membership_config.membership().get_node(&l) {
                Some(node) => Ok(Some((l, node.addr.clone()))),
                None => Err(NodeError::NotLeader(Some(l))),
            },
            None => Err(NodeError::NotLeader(None)),
        }
    }

    /// Removes this node from the group (rabbitmqctl's reset, first half): the others stop
    /// counting it; it gets no more entries. Stop it and clear its data dir afterwards.
    pub async fn leave(&self) -> Result<(), NodeError> {
        self.forget(self.id).await
    }

    /// Members, leader, log indexes and each member's lag.
    pub fn status(&self) -> Status {
        self.group_status(&self.raft)
    }

    /// Group `raft`'s status (one of this node's groups), with which members it reaches.
    pub fn group_status(&self, raft: &Raft) -> Status {
        raft_status(raft, &|id| self.peers.reachable(id))
    }

    /// Whether this node reaches node `id` now (itself: always).
    pub fn reachable(&self, id: NodeId) -> bool {
        self.peers.reachable(id)
    }

    /// Stops the group and the listener (the files stay).
    pub async fn shutdown(&self) {
        self.server.abort();
        let _ = self.raft.shutdown().await;
    }
}
