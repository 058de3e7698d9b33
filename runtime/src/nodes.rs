//! The seam a clustered host plugs into to carry `NodeMail` between nodes (docs/cluster.md,
//! "Queues live on one node"): the broker tasks hand what they forward to the host's
//! [`NodeLink`] after each turn, as they hand `ShardMail` to other shards, and stop taking
//! their connections' requests while the link is backlogged (the back-pressure); the host
//! hands what peers sent in with [`crate::BrokerHandle::receive_node_mail`], which returns
//! once the broker applied it (so a peer connection carries one batch at a time).

use warren_core::NodeMail;

/// A clustered host's link to the other nodes.
pub trait NodeLink: Send + Sync + 'static {
    /// Queues `mails` (in order) for node `node`; never blocks. Mail the host cannot hand
    /// to `node` makes it call `BrokerHandle::node_unreachable`.
    fn send(&self, node: u32, mails: Vec<NodeMail>);

    /// Whether so much mail waits for other nodes that the broker must stop taking
    /// requests until it drains.
    fn backlogged(&self) -> bool;
}

/// Splits a turn's node mail into one batch per node, in the order sent.
pub(crate) fn send_all(link: &dyn NodeLink, out: &mut Vec<(u32, NodeMail)>) {
    if out.is_empty() {
        return;
    }
    let mut batches: Vec<(u32, Vec<NodeMail>)> = Vec::new();
    for (node, mail) in out.drain(..) {
        match batches.iter_mut().find(|(n, _)| *n == node) {
            Some((_, b)) => b.push(mail),
            None => batches.push((node, vec![mail])),
        }
    }
    for (node, batch) in batches {
        link.send(node, batch);
    }
}
