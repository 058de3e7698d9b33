//! A quorum queue's Raft group on this node: started, run, and watched for leadership (the
//! broker reloads the queue where its leader is).

use super::*;

impl Replication {
    /// Starts group `g` on this node (its members: recorded, or chosen now from the
    /// cluster's members), and its leader watch.
    pub(super) fn start(&self, g: Arc<Group>) {
        let Some(node) = self.0.node.get().cloned() else {
            return;
        };
        let recorded = lock(&self.0.records).get(&g.id).map(|r| r.members.clone());
        let size = lock(&self.0.sizes)
            .remove(&(g.vhost.clone(), g.name.clone()))
            .unwrap_or(DEFAULT_GROUP_SIZE);
        let this = self.clone();
        self.0.runtime.spawn(async move {
            let members = match recorded.clone() {
                Some(m) => m,
                None => {
                    let members = this.agree_members(&node, &g, size).await;
                    let mut records = lock(&this.0.records);
                    records.insert(
                        g.id,
                        Record {
                            vhost: g.vhost.clone(),
                            name: g.name.clone(),
                            group: g.id,
                            members: members.clone(),
                        },
                    );
                    this.save_records(&records);
                    members
                }
            };
            let member = members.contains_key(&node.id());
            // Claimed before `decided` is set, so `reconcile` never starts it uninitialized.
            let claimed = member && !g.running.swap(true, Ordering::AcqRel);
            g.decided.store(true, Ordering::Release);
            if !member {
                // Not a member: the queue is served by its members only (until an
                // add-member makes it one: `reconcile`).
                tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), ?members, "quorum queue: this node is not a member of its group");
                return;
            }
            this.0.changed.store(true, Ordering::Release);
            if claimed {
                // Only a new group's members propose its first membership: a member
                // restarting on an empty log (it never got an entry, or it was added later)
                // waits for the leader instead of proposing one of its own.
                let new = recorded.is_none();
                this.run_group(&node, g, members, new, new).await;
            }
        });
    }

    /// Runs group `g` here until it stops (the caller claimed `Group::running`). `initialize`: as one of
    /// the members it was declared with (`members`, every one of them proposing the same
    /// first membership); otherwise as a member being added, which waits, uninitialized,
    /// for the leader to bring it up to date. `new`: the group was just declared.
    pub(super) async fn run_group(
        &self,
        node: &ClusterNode,
        g: Arc<Group>,
        members: BTreeMap<NodeId, String>,
        initialize: bool,
        new: bool,
    ) {
        // The caller claimed `g.running`.
        let first = if initialize {
            members.clone()
        } else {
            BTreeMap::new()
        };
        match node
            .start_group(
                g.id,
                &g.file(),
                &first,
                QueueReplica::new(),
                warren_cluster::queue::MAX_ENTRIES,
            )
            .await
        {
            Ok((raft, sm)) => {
                *lock(&g.replica) = Some(sm);
                *lock(&g.raft) = Some(raft.clone());
                if g.deleted.load(Ordering::Acquire) {
                    node.remove_group(g.id, &raft, &g.file()).await;
                    return;
                }
                tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), group = g.id, members = ?members.keys().collect::<Vec<_>>(), added = !initialize, "quorum queue group started");
                // A new group: one member, the one its id picks (so first leaders spread
                // over the cluster), calls the election at once instead of after an
                // election timeout; the declare-ok waits for it (`wait_ready`).
                if new && first_candidate(g.id, &members) == Some(node.id()) {
                    let _ = raft.trigger().elect().await;
                }
                self.watch(g, raft).await;
            }
            Err(e) => {
                g.running.store(false, Ordering::Release);
                tracing::error!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), error = %e, "quorum queue group could not start");
            }
        }
    }

    /// Follows group `g`'s leadership: when this node becomes its leader, waits until its copy
    /// has applied everything committed, then has the broker serve the queue from it; when
    /// it stops leading, has the broker drop the queue's messages.
    pub(super) async fn watch(&self, g: Arc<Group>, raft: Raft) {
        let mut metrics = raft.metrics();
        // openraft 0.9 keeps a leader cut off by a partition Leader (in its old term) until
        // it hears a higher one after the heal, while the other side elects another after
        // an election timeout: a leader that heard from no majority for that long stops
        // serving here (the lease is lost), so its publishes are nacked and its consumers
        // go, instead of waiting unanswered for the heal; it serves again, in a new
        // session, once a majority answers it and it still leads.
        let lease = self
            .0
            .node
            .get()
            .map_or(std::time::Duration::from_secs(1), |n| {
                n.election_timeout_max()
            });
        let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
        // The term this node's broker serves the queue in (`None`: it does not serve it).
        // Compared by term, not as a flag: a node that lost the leadership and won it back
        // between two looks must still reload (another leader may have served meanwhile).
        let mut serving: Option<u64> = None;
        // The node this node's broker forwards the queue's publishes to (h-xnode's homes):
        // the group's leader when it is another node; none when it is this one or unknown
        // (then a publish here is refused: nacked).
        let mut home: Option<Option<u32>> = None;
        loop {
            let (leads, leader, me, term) = {
                let m = metrics.borrow_and_update();
                let leader = m.state == warren_cluster::openraft::ServerState::Leader
                    && m.current_leader == Some(m.id);
                let lease_held = m.millis_since_quorum_ack.is_none_or(|ms| ms <= lease_ms);
                if leader && !lease_held && serving.is_some() {
                    tracing::warn!(vhost = %g.vhost, queue = %g.name, term = m.current_term, since_ms = ?m.millis_since_quorum_ack, "quorum queue: no majority answers this leader; it stops serving until one does");
                }
                (
                    leader && lease_held,
                    // Whoever another node elects meanwhile is unknown here: no home.
                    m.current_leader.filter(|_| lease_held || !leader),
                    m.id,
                    m.current_term,
                )
            };
            let want_serving = leads.then_some(term);
            if g.deleted.load(Ordering::Acquire) {
                return;
            }
            let want = leader
                .filter(|l| *l != me)
                .and_then(|l| u32::try_from(l).ok());
            if home != Some(want) {
                home = Some(want);
                if let Some(broker) = self.0.broker.get() {
                    let at = AdminRequest::QueueHome {
                        vhost: g.vhost.clone(),
                        queue: g.name.clone(),
                        node: want,
                    };
                    let _ = broker.admin_local(at).await;
                }
            }
            g.told.store(leader.unwrap_or(NO_LEADER), Ordering::Release);
            if want_serving != serving {
                // A new serving session: committed (and so applied here, with everything
                // before it) before the broker loads the queue, so the copy it loads holds
                // every write of earlier sessions that will ever apply, and every one that
                // reaches the log after it is refused (a write the old session's broker made
                // whose proposal was still on its way: its sequence numbers could name
                // other messages by now).
                let session = if leads {
                    g.leading.store(false, Ordering::Release);
                    // Bounded: a leader cut off right after its election would wait for the
                    // heal here, blind to everything Raft does meanwhile. Given up, the
                    // session start may still commit: a later one supersedes it.
                    let start = raft.client_write(QueueCommand::encode_session_start());
                    match tokio::time::timeout(lease, start).await {
                        Ok(Ok(resp)) if resp.data.0.is_empty() => Some(resp.log_id.index),
                        Ok(_) => None,
                        Err(_) => {
                            tracing::info!(vhost = %g.vhost, queue = %g.name, term, "quorum queue: a new serving session was not committed in time; trying again");
                            None
                        }
                    }
                } else {
                    Some(0)
                };
                // No new session: the broker stops serving the old one meanwhile (its
                // writes would be refused anyway), and this loop tries again.
                let (session, leads, want_serving) = match session {
                    None if serving.is_some() => (Some(0), false, None),
                    s => (s, leads, want_serving),
                };
                if let Some(session) = session {
                    if serving.is_some() && leads {
                        tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), term, session, "quorum queue: this node leads it in a new session; reloading");
                    }
                    g.session.store(session, Ordering::Release);
                    g.leading.store(leads, Ordering::Release);
                    let reload = AdminRequest::ReloadQueue {
                        vhost: g.vhost.clone(),
                        name: g.name.clone(),
                    };
                    if let Some(broker) = self.0.broker.get() {
                        let _ = broker.admin_local(reload).await;
                    }
                    serving = want_serving;
                    tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), leader = leads, term, session, "quorum queue: {}", if leads { "this node leads and serves it" } else { "this node no longer leads it" });
                    if let Some(sm) = g.replica() {
                        let (held, next_seq, applied) =
                            sm.with(|r| (r.messages.len(), r.next_seq, r.applied));
                        tracing::debug!(target: "warren::qq::trace", queue = %Escaped(&g.name), leads, term, session, held, next_seq, applied, "quorum queue: reloaded");
                    }
                    if leads {
                        // An empty command: once a member applies it, it knows a leader
                        // served the group (`wait_ready` on the other members).
                        let marker = raft.clone();
                        // And the leader in the metadata group (as RabbitMQ's queue record
                        // names its leader): nodes that are not members forward there.
                        let node = self.0.node.get().cloned();
                        let k = leader_key(&g.vhost, &g.name);
                        self.0.runtime.spawn(async move {
                            let _ = marker.client_write(QueueCommand(Vec::new()).encode()).await;
                            if let Some(node) = node {
                                let put = warren_cluster::definitions::DefCommand::Put {
                                    key: k,
                                    record: me.to_string().into_bytes(),
                                };
                                if let Err(e) = node.write(&put).await {
                                    tracing::debug!(error = %e, "quorum queue leader not recorded");
                                }
                            }
                        });
                    }
                    continue;
                }
            }
            // Ends when the group shuts down (its metrics sender is dropped).
            if tokio::time::timeout(std::time::Duration::from_millis(500), metrics.changed())
                .await
                .is_ok_and(|r| r.is_err())
            {
                return;
            }
        }
    }
}
