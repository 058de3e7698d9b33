//! An in-process network between groups in one process: RPCs are direct calls on the target's
//! [`Raft`] handle. Nodes can be removed (a crash) and links cut (a partition), for
//! deterministic tests of the state machines without sockets.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use openraft::BasicNode;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};

use crate::{NodeId, Raft, TypeConfig};

#[derive(Default)]
struct State {
    nodes: BTreeMap<NodeId, Raft>,
    /// Directed links that drop every RPC.
    cut: BTreeSet<(NodeId, NodeId)>,
}

/// The in-process network. Clones share it.
#[derive(Clone, Default)]
pub struct Router {
    state: Arc<Mutex<State>>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Down(String);

impl Router {
    pub fn new() -> Self {
        Self::default()
    }
    /// Makes `raft` reachable as node `id`.
    pub fn add(&self, id: NodeId, raft: Raft) {
        self.lock().nodes.insert(id, raft);
    }
    /// Makes node `id` unreachable (its process is gone); returns its handle.
    pub fn remove(&self, id: NodeId) -> Option<Raft> {
        self.lock().nodes.remove(&id)
    }
    /// Cuts `side` from every other node, both directions.
    pub fn partition(&self, side: &[NodeId], all: &[NodeId]) {
        let mut s = self.lock();
        for a in side {
            for b in all.iter().filter(|b| !side.contains(b)) {
                s.cut.insert((*a, *b));
                s.cut.insert((*b, *a));
            }
        }
    }
    pub fn heal(&self) {
        self.lock().cut.clear();
    }
    /// A network factory for node `from`.
    pub fn network(&self, from: NodeId) -> Network {
        Network {
            router: self.clone(),
            from,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn target(&self, from: NodeId, to: NodeId) -> Result<Raft, Unreachable> {
        let s = self.lock();
        if s.cut.contains(&(from, to)) {
            return Err(Unreachable::new(&Down(format!(
                "{from} -> {to} partitioned"
            ))));
        }
        s.nodes
            .get(&to)
            .cloned()
            .ok_or_else(|| Unreachable::new(&Down(format!("node {to} is down"))))
    }
}

/// The network factory of one node.
pub struct Network {
    router: Router,
    from: NodeId,
}

/// A client of one peer over the [`Router`].
pub struct Client {
    router: Router,
    from: NodeId,
    to: NodeId,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Client;
    async fn new_client(&mut self, target: NodeId, _node: &BasicNode) -> Client {
        Client {
            router: self.router.clone(),
            from: self.from,
            to: target,
        }
    }
}

type RpcErr<E = openraft::error::Infallible> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

impl Client {
    /// The target, and whether the reply may come back (the link may be cut meanwhile).
    fn target<E: std::error::Error>(&self) -> Result<Raft, RpcErr<E>> {
        self.router
            .target(self.from, self.to)
            .map_err(RPCError::Unreachable)
    }
    fn back<T, E: std::error::Error>(
        &self,
        r: Result<T, RaftError<NodeId, E>>,
    ) -> Result<T, RpcErr<E>> {
        // A reply crosses the link the other way: a partition that started during the call
        // loses it, as a real one would.
        if let Err(u) = self.router.target(self.to, self.from).map(|_| ()) {
            if !self.router.lock().nodes.contains_key(&self.from) {
                return Err(RPCError::Network(NetworkError::new(&Down(
                    "caller gone".into(),
                ))));
            }
            return Err(RPCError::Unreachable(u));
        }
        r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.to, e)))
    }
}

impl RaftNetwork<TypeConfig> for Client {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr> {
        let raft = self.target()?;
        let r = raft.append_entries(rpc).await;
        self.back(r)
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<InstallSnapshotError>> {
        let raft = self.target()?;
        let r = raft.install_snapshot(rpc).await;
        self.back(r)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        _option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RpcErr> {
        let raft = self.target()?;
        let r = raft.vote(rpc).await;
        self.back(r)
    }
}
