//! A quorum queue's members: recorded in the metadata group, reconciled with the live groups,
//! changed by operators (`add_member`, `delete_member`, `grow`/`shrink`) and agreed when a
//! group starts.

use super::*;

impl Replication {
    /// Follows membership changes (`add_member`, `delete_member`, `grow`, `shrink`): each
    /// queue's members are a record of the metadata group, changed around the group's own
    /// membership change, so every node sees them in the same order. A node newly named
    /// starts the group uninitialized (its leader then brings it up to date, as a learner,
    /// and makes it a voter); a node no longer named stops it and deletes its files (the
    /// record changes only after the group committed the removal); every node keeps its
    /// `quorum-queues.json` in step.
    pub(super) async fn reconcile(&self, node: &Arc<ClusterNode>) {
        use warren_cluster::definitions::{Kind, key};
        let groups: Vec<Arc<Group>> = lock(&self.0.groups).values().cloned().collect();
        for g in groups {
            if !g.decided.load(Ordering::Acquire) || g.deleted.load(Ordering::Acquire) {
                continue;
            }
            let k = key(Kind::Queue, &["quorum-members", &g.vhost, &g.name]);
            let Some(members) = node.definitions.with(|d| {
                d.get(&k)
                    .and_then(|b| serde_json::from_slice::<BTreeMap<NodeId, String>>(b).ok())
            }) else {
                continue;
            };
            {
                let mut records = lock(&self.0.records);
                if records.get(&g.id).map(|r| &r.members) != Some(&members) {
                    records.insert(
                        g.id,
                        Record {
                            vhost: g.vhost.clone(),
                            name: g.name.clone(),
                            group: g.id,
                            members: members.clone(),
                        },
                    );
                    self.save_records(&records);
                }
            }
            let member = members.contains_key(&node.id());
            if !member && g.raft().is_none() {
                // Not a member: this node's broker forwards to the leader the metadata group
                // names (each new leader records itself there).
                let leader = node.definitions.with(|d| {
                    d.get(&leader_key(&g.vhost, &g.name))
                        .and_then(|b| std::str::from_utf8(b).ok()?.parse::<NodeId>().ok())
                });
                if let Some(l) = leader
                    && g.told.load(Ordering::Acquire) != l
                    && let Some(broker) = self.0.broker.get()
                {
                    let home = AdminRequest::QueueHome {
                        vhost: g.vhost.clone(),
                        queue: g.name.clone(),
                        node: u32::try_from(l).ok(),
                    };
                    let _ = broker.admin_local(home).await;
                    g.told.store(l, Ordering::Release);
                }
            }
            if member && !g.running.swap(true, Ordering::AcqRel) {
                tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), "quorum queue: this node was added to its group; catching up");
                let this = self.clone();
                let node = node.clone();
                self.0.runtime.spawn(async move {
                    this.run_group(&node, g, members, false, false).await;
                });
            } else if !member && let Some(raft) = g.raft() {
                tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), "quorum queue: this node was removed from its group; its copy is deleted");
                *lock(&g.raft) = None;
                *lock(&g.replica) = None;
                node.remove_group(g.id, &raft, &g.file()).await;
                if g.leading.swap(false, Ordering::AcqRel)
                    && let Some(broker) = self.0.broker.get()
                {
                    let reload = AdminRequest::ReloadQueue {
                        vhost: g.vhost.clone(),
                        name: g.name.clone(),
                    };
                    let _ = broker.admin_local(reload).await;
                }
                g.running.store(false, Ordering::Release);
                // Forward to the recorded leader from now on (next pass).
                g.told.store(NO_LEADER, Ordering::Release);
                self.0.changed.store(true, Ordering::Release);
            } else if !member && g.running.load(Ordering::Acquire) {
                // Still starting (a restart on a record from before its removal): look
                // again next tick, once it runs.
                self.0.changed.store(true, Ordering::Release);
            }
        }
    }

    /// Queue `name`'s members as the metadata group records them: the raw record (for a
    /// compare-and-set) and the map.
    pub(super) fn recorded_members(
        &self,
        node: &ClusterNode,
        vhost: &str,
        name: &str,
    ) -> Result<(Vec<u8>, BTreeMap<NodeId, String>), String> {
        use warren_cluster::definitions::{Kind, key};
        let k = key(Kind::Queue, &["quorum-members", vhost, name]);
        let raw = node
            .definitions
            .with(|d| d.get(&k).map(<[u8]>::to_vec))
            .ok_or_else(|| {
                format!("no quorum queue '{name}' in vhost '{vhost}' in this cluster")
            })?;
        let members = serde_json::from_slice(&raw)
            .map_err(|e| format!("quorum queue '{name}': unreadable members record: {e}"))?;
        Ok((raw, members))
    }

    /// Sets queue `name`'s members record from `expected` to `members` (compare-and-set).
    pub(super) async fn record_members(
        node: &ClusterNode,
        vhost: &str,
        name: &str,
        expected: Vec<u8>,
        members: &BTreeMap<NodeId, String>,
    ) -> Result<(), String> {
        use warren_cluster::definitions::{DefCommand, DefReply, Kind, key};
        let cmd = DefCommand::PutIf {
            key: key(Kind::Queue, &["quorum-members", vhost, name]),
            expected: Some(expected),
            record: serde_json::to_vec(members).map_err(|e| e.to_string())?,
        };
        match node.write(&cmd).await {
            Ok(DefReply::Done { .. }) => Ok(()),
            Ok(DefReply::Conflict { .. }) => Err(format!(
                "quorum queue '{name}': its members changed meanwhile (another membership change); try again"
            )),
            Ok(other) => Err(format!("quorum queue '{name}': {other:?}")),
            Err(e) => Err(format!(
                "quorum queue '{name}': metadata store unavailable: {e}"
            )),
        }
    }

    /// `warren ctl quorum add-member QUEUE NODE` (rabbitmq-queues add_member): node `id`
    /// becomes a member of queue `name`'s group: recorded (so it starts the group), then
    /// added by the group's leader as a learner, brought up to date (log or snapshot), and
    /// made a voter. Answered once it votes; on failure the record is set back.
    pub async fn add_member(&self, vhost: &str, name: &str, id: NodeId) -> Result<(), String> {
        let node: &ClusterNode = self.0.node.get().ok_or("this node is not in a cluster")?;
        let g = self.group(vhost, name)?;
        let addr = node
            .members()
            .get(&id)
            .cloned()
            .ok_or_else(|| format!("node {id} is not a member of the cluster"))?;
        let (raw, old) = self.recorded_members(node, vhost, name)?;
        if old.contains_key(&id) {
            return Err(format!(
                "node {id} is a member of quorum queue '{name}' already"
            ));
        }
        let mut new = old.clone();
        new.insert(id, addr.clone());
        Self::record_members(node, vhost, name, raw, &new).await?;
        let raft = g.raft();
        match node.group_join(g.id, raft.as_ref(), &old, id, &addr).await {
            Ok(()) => {
                tracing::info!(vhost, queue = name, node = id, "quorum queue: member added");
                Ok(())
            }
            Err(e) => {
                if let Ok((raw, _)) = self.recorded_members(node, vhost, name) {
                    let _ = Self::record_members(node, vhost, name, raw, &old).await;
                }
                Err(format!("quorum queue '{name}': adding node {id}: {e}"))
            }
        }
    }

    /// `warren ctl quorum delete-member QUEUE NODE` (rabbitmq-queues delete_member): node
    /// `id` leaves queue `name`'s group (joint consensus, on its leader), then the record
    /// changes and that node deletes its copy. The last member cannot leave.
    pub async fn delete_member(&self, vhost: &str, name: &str, id: NodeId) -> Result<(), String> {
        let node: &ClusterNode = self.0.node.get().ok_or("this node is not in a cluster")?;
        let g = self.group(vhost, name)?;
        let (_, old) = self.recorded_members(node, vhost, name)?;
        if !old.contains_key(&id) {
            return Err(format!(
                "node {id} is not a member of quorum queue '{name}'"
            ));
        }
        if old.len() == 1 {
            return Err(format!(
                "node {id} is the last member of quorum queue '{name}'; delete the queue instead"
            ));
        }
        let raft = g.raft();
        node.group_forget(g.id, raft.as_ref(), &old, id)
            .await
            .map_err(|e| format!("quorum queue '{name}': removing node {id}: {e}"))?;
        let mut new = old.clone();
        new.remove(&id);
        let (raw, _) = self.recorded_members(node, vhost, name)?;
        Self::record_members(node, vhost, name, raw, &new).await?;
        tracing::info!(
            vhost,
            queue = name,
            node = id,
            "quorum queue: member removed"
        );
        Ok(())
    }

    /// `warren ctl quorum grow NODE` (rabbitmq-queues grow): node `id` joins every quorum
    /// queue's group it is not a member of, one queue at a time; `shrink` (`grow` false):
    /// leaves every group it is a member of (except a group it is the last member of). Each
    /// queue's outcome.
    pub async fn grow_or_shrink(&self, id: NodeId, grow: bool) -> Vec<serde_json::Value> {
        let Some(node) = self.0.node.get() else {
            return Vec::new();
        };
        let mut queues: Vec<(String, String)> = lock(&self.0.groups).keys().cloned().collect();
        queues.sort();
        let mut out = Vec::new();
        for (vhost, name) in queues {
            let Ok((_, members)) = self.recorded_members(node, &vhost, &name) else {
                continue;
            };
            let r = match (grow, members.contains_key(&id)) {
                (true, false) => self.add_member(&vhost, &name, id).await,
                (false, true) if members.len() > 1 => self.delete_member(&vhost, &name, id).await,
                _ => continue,
            };
            out.push(serde_json::json!({
                "vhost": vhost,
                "queue": name,
                "result": match &r { Ok(()) => "ok".to_string(), Err(e) => e.clone() },
            }));
        }
        out
    }

    /// The members of new group `g`, agreed through the metadata group: this node proposes
    /// the set it computes (every node computes the same one from the same membership) with
    /// a compare-and-set on the queue's members key; if another node's proposal came first,
    /// that one. Without a metadata quorum within the bound, the computed set.
    pub(super) async fn agree_members(
        &self,
        node: &ClusterNode,
        g: &Group,
        size: usize,
    ) -> BTreeMap<NodeId, String> {
        use warren_cluster::definitions::{DefCommand, DefReply, Kind, key};
        let mine = choose_members(g.id, &node.members(), size);
        let cmd = DefCommand::PutIf {
            key: key(Kind::Queue, &["quorum-members", &g.vhost, &g.name]),
            expected: None,
            record: serde_json::to_vec(&mine).unwrap_or_default(),
        };
        let deadline = std::time::Instant::now() + warren_cluster::node::FORWARD_TIMEOUT;
        loop {
            match node.write(&cmd).await {
                Ok(DefReply::Done { .. }) => return mine,
                Ok(DefReply::Conflict {
                    current: Some(bytes),
                }) => match serde_json::from_slice::<BTreeMap<NodeId, String>>(&bytes) {
                    Ok(theirs) => return theirs,
                    Err(e) => {
                        tracing::error!(queue = %Escaped(&g.name), error = %e, "unreadable quorum queue members record; using this node's choice");
                        return mine;
                    }
                },
                Ok(other) => {
                    tracing::warn!(queue = %Escaped(&g.name), reply = ?other, "quorum queue members not recorded; using this node's choice");
                    return mine;
                }
                Err(e) if std::time::Instant::now() < deadline => {
                    tracing::debug!(queue = %Escaped(&g.name), error = %e, "recording quorum queue members: retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(e) => {
                    tracing::warn!(queue = %Escaped(&g.name), error = %e, "quorum queue members not recorded in the metadata group; using this node's choice");
                    return mine;
                }
            }
        }
    }
}
