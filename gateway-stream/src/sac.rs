//! Single active consumer (RabbitMQ 3.11+, `rabbit_stream_sac_coordinator`): subscriptions
//! to one stream with `single-active-consumer=true` and the same `name` form a group, and
//! only one member at a time gets chunks. The others wait; when the active one leaves
//! (Unsubscribe, or its connection ends) the next takes over.
//!
//! - A plain group activates its oldest member.
//! - A super stream partition's group (`super-stream` property) activates member
//!   `partition index mod members`, so a super stream's partitions spread over its
//!   consumers. When a member joins or leaves and another should be active, the active one
//!   is told first that it is not (ConsumerUpdate `active=false`); the group activates the
//!   new one only once it answered (it may store its offset meanwhile, so the next one
//!   resumes from there), or left.
//!
//! This is broker state shared by every connection: sessions join and leave through it,
//! and it tells each member's connection through that connection's [`Mailbox`] (the shell
//! awaits the mailbox's [`Notify`] and hands the updates to its session). Each member has
//! at most one update in flight that it must act on before the group sends it another, so
//! a mailbox holds at most two per subscription.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// One connection's updates.
#[derive(Debug, Default)]
pub struct Mailbox {
    updates: Mutex<VecDeque<Update>>,
    notify: Notify,
}

impl Mailbox {
    /// The updates delivered so far, oldest first.
    pub fn take(&self) -> Vec<Update> {
        lock(&self.updates).drain(..).collect()
    }

    /// Resolves when an update may be waiting (a permit is kept if none waits, so a wake
    /// is never lost between [`Mailbox::take`] and the next await).
    pub async fn notified(&self) {
        self.notify.notified().await
    }

    fn push(&self, u: Update) {
        lock(&self.updates).push_back(u);
        self.notify.notify_one();
    }
}

/// A member is told it is now active, or no longer active.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Update {
    /// The member's token (see [`ConsumerGroups::join`]).
    pub token: u64,
    pub active: bool,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SacError {
    /// A group's members must agree on being a super stream partition's consumers (and on
    /// the partition).
    #[error("single active consumer group {0}: members disagree on its super stream")]
    Mismatch(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    Active,
    /// Told it is not active; not answered yet.
    Deactivating,
}

#[derive(Debug)]
struct Member {
    conn: u64,
    token: u64,
    state: State,
}

#[derive(Debug)]
struct Group {
    /// The partition's index in its super stream; `None`: a plain group.
    partition: Option<usize>,
    /// In join order.
    members: Vec<Member>,
}

impl Group {
    /// Moves the group toward its rule (see the module docs); the updates to send.
    fn settle(&mut self) -> Vec<(u64, Update)> {
        let n = self.members.len();
        if n == 0 || self.members.iter().any(|m| m.state == State::Deactivating) {
            // Empty, or a step-down is under way: its answer (or leave) settles again.
            return vec![];
        }
        let active = self.members.iter().position(|m| m.state == State::Active);
        let want = match self.partition {
            None => active.unwrap_or(0),
            Some(p) => p % n,
        };
        match active {
            Some(a) if a == want => vec![],
            Some(a) => {
                let m = &mut self.members[a];
                m.state = State::Deactivating;
                vec![(
                    m.conn,
                    Update {
                        token: m.token,
                        active: false,
                    },
                )]
            }
            None => {
                let m = &mut self.members[want];
                m.state = State::Active;
                vec![(
                    m.conn,
                    Update {
                        token: m.token,
                        active: true,
                    },
                )]
            }
        }
    }
}

/// (vhost, stream, consumer name)
type GroupKey = (String, String, String);

#[derive(Debug, Default)]
struct Inner {
    next_conn: u64,
    mailboxes: HashMap<u64, Arc<Mailbox>>,
    groups: HashMap<GroupKey, Group>,
    /// (connection, token) -> its group.
    membership: HashMap<(u64, u64), GroupKey>,
}

/// The groups of one broker (see the module docs).
#[derive(Debug, Default)]
pub struct ConsumerGroups {
    inner: Mutex<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every step below leaves the maps consistent, so a poisoned lock is used as is.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    fn deliver(&self, updates: Vec<(u64, Update)>) {
        for (conn, u) in updates {
            if let Some(m) = self.mailboxes.get(&conn) {
                m.push(u);
            }
        }
    }

    fn remove(&mut self, conn: u64, token: u64) {
        let Some(key) = self.membership.remove(&(conn, token)) else {
            return;
        };
        let Some(g) = self.groups.get_mut(&key) else {
            return;
        };
        g.members.retain(|m| !(m.conn == conn && m.token == token));
        let updates = g.settle();
        if g.members.is_empty() {
            self.groups.remove(&key);
        }
        self.deliver(updates);
    }
}

impl ConsumerGroups {
    pub fn new() -> ConsumerGroups {
        ConsumerGroups::default()
    }

    /// A new connection: its id and mailbox.
    pub fn connect(&self) -> (u64, Arc<Mailbox>) {
        let mut inner = lock(&self.inner);
        inner.next_conn += 1;
        let id = inner.next_conn;
        let mailbox = Arc::new(Mailbox::default());
        inner.mailboxes.insert(id, mailbox.clone());
        (id, mailbox)
    }

    /// The connection ended: its members leave their groups (the next ones take over).
    pub fn disconnect(&self, conn: u64) {
        let mut inner = lock(&self.inner);
        inner.mailboxes.remove(&conn);
        let mine: Vec<u64> = inner
            .membership
            .keys()
            .filter(|(c, _)| *c == conn)
            .map(|(_, t)| *t)
            .collect();
        for token in mine {
            inner.remove(conn, token);
        }
    }

    /// Member `token` (unique within its connection) of `conn` joins group `name` of
    /// `stream`, a partition of a super stream at index `partition` or not. Its updates
    /// (the first may be at once) arrive in `conn`'s mailbox.
    pub fn join(
        &self,
        conn: u64,
        token: u64,
        vhost: &str,
        stream: &str,
        name: &str,
        partition: Option<usize>,
    ) -> Result<(), SacError> {
        let mut inner = lock(&self.inner);
        let key = (vhost.to_string(), stream.to_string(), name.to_string());
        let g = inner.groups.entry(key.clone()).or_insert(Group {
            partition,
            members: Vec::new(),
        });
        if g.partition != partition {
            return Err(SacError::Mismatch(name.to_string()));
        }
        g.members.push(Member {
            conn,
            token,
            state: State::Waiting,
        });
        let updates = g.settle();
        inner.membership.insert((conn, token), key);
        inner.deliver(updates);
        Ok(())
    }

    /// The member left (Unsubscribe, or its stream is gone).
    pub fn leave(&self, conn: u64, token: u64) {
        lock(&self.inner).remove(conn, token);
    }

    /// The member answered being told it is not active: the group activates the next.
    pub fn stepped_down(&self, conn: u64, token: u64) {
        let mut inner = lock(&self.inner);
        let Some(key) = inner.membership.get(&(conn, token)).cloned() else {
            return;
        };
        let Some(g) = inner.groups.get_mut(&key) else {
            return;
        };
        let Some(m) = g
            .members
            .iter_mut()
            .find(|m| m.conn == conn && m.token == token)
        else {
            return;
        };
        if m.state != State::Deactivating {
            return;
        }
        m.state = State::Waiting;
        let updates = g.settle();
        inner.deliver(updates);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(token: u64, active: bool) -> Update {
        Update { token, active }
    }

    #[test]
    fn plain_group_activates_the_oldest_and_fails_over_in_join_order() {
        let g = ConsumerGroups::new();
        let (a, ma) = g.connect();
        let (b, mb) = g.connect();
        g.join(a, 1, "/", "s", "app", None).unwrap();
        g.join(b, 1, "/", "s", "app", None).unwrap();
        g.join(a, 2, "/", "s", "app", None).unwrap();
        assert_eq!(ma.take(), vec![up(1, true)]);
        assert_eq!(mb.take(), vec![]);
        // Another name, another group.
        g.join(b, 3, "/", "s", "other", None).unwrap();
        assert_eq!(mb.take(), vec![up(3, true)]);
        g.leave(a, 1);
        assert_eq!(mb.take(), vec![up(1, true)], "b joined second");
        g.disconnect(b);
        assert_eq!(ma.take(), vec![up(2, true)]);
        // A waiting member leaving changes nothing.
        let (c, mc) = g.connect();
        g.join(c, 1, "/", "s", "app", None).unwrap();
        g.leave(c, 1);
        assert_eq!((ma.take(), mc.take()), (vec![], vec![]));
    }

    #[test]
    fn partition_group_rebalances_through_a_step_down() {
        let g = ConsumerGroups::new();
        let (a, ma) = g.connect();
        let (b, mb) = g.connect();
        // Partition 1 of its super stream: with two members, member 1 is to be active.
        g.join(a, 7, "/", "p-1", "app", Some(1)).unwrap();
        assert_eq!(ma.take(), vec![up(7, true)]);
        g.join(b, 8, "/", "p-1", "app", Some(1)).unwrap();
        assert_eq!(ma.take(), vec![up(7, false)], "a steps down first");
        assert_eq!(mb.take(), vec![], "b waits for a's answer");
        g.stepped_down(a, 7);
        assert_eq!(mb.take(), vec![up(8, true)]);
        // b leaves: back to a (1 mod 1 = 0).
        g.leave(b, 8);
        assert_eq!(ma.take(), vec![up(7, true)]);
        assert_eq!(
            g.join(b, 9, "/", "p-1", "app", None),
            Err(SacError::Mismatch("app".into()))
        );
    }

    #[test]
    fn a_member_leaving_while_stepping_down_hands_over_at_once() {
        let g = ConsumerGroups::new();
        let (a, ma) = g.connect();
        let (b, mb) = g.connect();
        g.join(a, 1, "/", "p-0", "app", Some(1)).unwrap();
        g.join(b, 1, "/", "p-0", "app", Some(1)).unwrap();
        assert_eq!(ma.take(), vec![up(1, true), up(1, false)]);
        g.disconnect(a);
        assert_eq!(mb.take(), vec![up(1, true)]);
    }
}
