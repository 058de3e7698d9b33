//! Membership changes of one Raft group, run where the group's leader is: the node's own
//! calls (`node`) and a peer's forwarded ones (`transport`) both come here, so neither of
//! those two modules needs the other for it.

use openraft::BasicNode;
use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};

use crate::{NodeId, Raft};

/// Why a member could not be removed here.
#[derive(Debug, thiserror::Error)]
pub enum ForgetError {
    #[error("node {0} is not a member")]
    NotMember(NodeId),
    #[error("node {0} is the last member")]
    LastMember(NodeId),
    #[error(transparent)]
    Raft(#[from] Box<RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>>),
}

/// How long a membership change waits for one already in progress before it fails.
/// openraft refuses a change while the group's last one is not committed ("already
/// undergoing a configuration change"): a new quorum queue's first membership right after
/// its declare, or another operator's change of the same group; each commits within an
/// election or two.
const IN_PROGRESS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

type WriteError = RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>;

/// Runs the membership change `change` again (every 50 ms, for up to `IN_PROGRESS_WAIT`)
/// while openraft refuses it because another one is still being committed.
async fn once_settled<T, F, Fut>(mut change: F) -> Result<T, WriteError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, WriteError>>,
{
    let deadline = tokio::time::Instant::now() + IN_PROGRESS_WAIT;
    loop {
        match change().await {
            Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(
                ChangeMembershipError::InProgress(p),
            ))) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(in_progress = %p, "membership change waits for the one in progress");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            r => return r,
        }
    }
}

/// Removes `id` from the voters of the group `raft` leads (the membership change is joint
/// consensus: the old and new majorities both agree).
pub(crate) async fn forget_here(raft: &Raft, id: NodeId) -> Result<(), ForgetError> {
    let membership = raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .clone();
    if !membership.nodes().any(|(n, _)| *n == id) {
        return Err(ForgetError::NotMember(id));
    }
    let voters: std::collections::BTreeSet<NodeId> =
        membership.voter_ids().filter(|v| *v != id).collect();
    if voters.is_empty() {
        return Err(ForgetError::LastMember(id));
    }
    // Relative to the membership when it runs (another change may commit first while this
    // one waits); retain = false: it does not stay on as a learner either.
    let remove = openraft::ChangeMembers::RemoveVoters([id].into());
    once_settled(|| raft.change_membership(remove.clone(), false))
        .await
        .map_err(Box::new)?;
    Ok(())
}

/// Why a member could not be added here.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("node {0} is a voter already")]
    Member(NodeId),
    #[error("node {0}: {1}")]
    AddLearner(
        NodeId,
        Box<RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>>,
    ),
    #[error(transparent)]
    Raft(#[from] Box<RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>>),
}

/// Adds `id` at `addr` to the group `raft` leads: a learner first, which the leader brings
/// up to date (log or snapshot), then a voter (joint consensus, as for `forget_here`).
pub(crate) async fn join_here(raft: &Raft, id: NodeId, addr: &str) -> Result<(), JoinError> {
    let membership = raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .clone();
    if membership.voter_ids().any(|v| v == id) {
        return Err(JoinError::Member(id));
    }
    // blocking = true: answered once the learner has caught up with the leader's log.
    once_settled(|| raft.add_learner(id, BasicNode::new(addr), true))
        .await
        .map_err(|e| JoinError::AddLearner(id, Box::new(e)))?;
    // Relative to the membership when it runs: another change may commit first while this
    // one waits (a concurrent join's), and must not be undone.
    let add = openraft::ChangeMembers::AddVoterIds([id].into());
    once_settled(|| raft.change_membership(add.clone(), false))
        .await
        .map_err(Box::new)?;
    Ok(())
}
