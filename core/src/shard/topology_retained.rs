//! The topology side of MQTT retained messages: one `RetainedTopics` per vhost (in its
//! `Vhost` record), set by `Op::Retain`, read by `Op::RetainedGet`, stored through the
//! `Store` (`DefinitionChange::RetainedSet` / `RetainedCleared`) and restored with the
//! definitions. Topology is shard 0's, so with shards every connection's requests meet
//! here, in the order each link carried them.

use super::*;
use crate::mqtt::{RetainOutcome, RetainedMessage};
use crate::store::DefinitionChange;

impl Broker {
    /// Sets (or clears) a retained message of vhost `vh`; false when the vhost's bound
    /// refused it.
    pub(super) fn retain(&mut self, vh: VhostId, message: RetainedMessage, durable: bool) -> bool {
        let (max_messages, max_bytes) = (
            self.config.max_retained_messages,
            self.config.max_retained_bytes,
        );
        let mut expired = Vec::new();
        let topic = message.topic.clone();
        let stored = durable.then(|| message.clone());
        let Some(topics) = self.topo.retained_mut(vh) else {
            return false;
        };
        let outcome = topics.set(message, durable, max_messages, max_bytes, &mut expired);
        let vhost = self.topo.vhost_name_arc(vh);
        self.forget_retained(&vhost, &expired);
        match outcome {
            RetainOutcome::Stored { replaced_durable } => {
                if let Some(m) = &stored {
                    self.define(DefinitionChange::RetainedSet {
                        vhost: &vhost,
                        message: m,
                    });
                } else if replaced_durable {
                    self.define(DefinitionChange::RetainedCleared {
                        vhost: &vhost,
                        topic: &topic,
                    });
                }
                true
            }
            RetainOutcome::Cleared { durable: true } => {
                self.define(DefinitionChange::RetainedCleared {
                    vhost: &vhost,
                    topic: &topic,
                });
                true
            }
            RetainOutcome::Cleared { durable: false } | RetainOutcome::Unchanged => true,
            RetainOutcome::Full => false,
        }
    }

    /// The retained messages of vhost `vh` that `filter` matches (at most `max`).
    pub(super) fn retained_get(
        &mut self,
        vh: VhostId,
        filter: &str,
        max: u32,
    ) -> Vec<RetainedMessage> {
        let now = self.now;
        let mut expired = Vec::new();
        let Some(topics) = self.topo.retained_mut(vh) else {
            return Vec::new();
        };
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        let found = topics.matching(filter, now, max, &mut expired);
        let vhost = self.topo.vhost_name_arc(vh);
        self.forget_retained(&vhost, &expired);
        found
    }

    /// Removes from the store the durable ones among retained messages dropped from
    /// memory (expired, or their vhost deleted).
    pub(super) fn forget_retained(&mut self, vhost: &str, dropped: &[(Arc<str>, bool)]) {
        for (topic, durable) in dropped {
            if *durable {
                self.define(DefinitionChange::RetainedCleared { vhost, topic });
            }
        }
    }

    /// Restores stored retained messages into their vhosts (shard 0 only: topology's);
    /// expired ones, and ones over a bound lowered since, are dropped from the store too.
    pub(super) fn restore_retained(
        &mut self,
        retained: &[(String, RetainedMessage)],
        errors: &mut Vec<String>,
    ) {
        if self.shard != 0 {
            return;
        }
        let mut dropped: Vec<(String, Arc<str>)> = Vec::new();
        for (vhost, m) in retained {
            let Some(vh) = self.topo.vhost_id(vhost) else {
                errors.push(format!(
                    "retained message of '{}': vhost '{vhost}' does not exist",
                    crate::escape::Escaped(&m.topic)
                ));
                continue;
            };
            if m.expired(self.now) {
                dropped.push((vhost.clone(), m.topic.clone()));
                continue;
            }
            let (max_messages, max_bytes) = (
                self.config.max_retained_messages,
                self.config.max_retained_bytes,
            );
            let mut expired = Vec::new();
            let Some(topics) = self.topo.retained_mut(vh) else {
                continue;
            };
            if topics.set(m.clone(), true, max_messages, max_bytes, &mut expired)
                == RetainOutcome::Full
            {
                errors.push(format!(
                    "retained message of '{}' in vhost '{vhost}': over the vhost's bound, dropped",
                    crate::escape::Escaped(&m.topic)
                ));
                dropped.push((vhost.clone(), m.topic.clone()));
            }
            dropped.extend(expired.into_iter().map(|(t, _)| (vhost.clone(), t)));
        }
        let restoring = std::mem::replace(&mut self.restoring, false);
        for (vhost, topic) in &dropped {
            self.define(DefinitionChange::RetainedCleared { vhost, topic });
        }
        self.restoring = restoring;
    }

    /// Every vhost's retained messages: (vhost, messages, payload bytes).
    pub fn retained_stats(&self) -> Vec<(String, u64, u64)> {
        self.topo.retained_stats()
    }
}
