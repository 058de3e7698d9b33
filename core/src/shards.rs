//! K shards composed in one thread, with FIFO links between them: the one place that knows
//! how shards fit together (ARCHITECTURE.md, "warren-core"). A connection or queue with id
//! `n` is shard `n % k`'s; topology is shard 0's, and every other shard routes on the table
//! shard 0 publishes, adopting it before any mail shard 0 sent after publishing it. What one
//! shard sends another waits on the link `(from, to)`, delivered in the order sent.
//!
//! The deterministic tests and the restore use [`Shards`]; the runtime runs each shard on
//! its own task and links them with channels, applying the same rules: [`carry`]'s order
//! (routes first, then mail), [`restore`], and which operator request reaches which shard
//! ([`AdminRequest::gathered`], [`AdminRequest::replica`]).

use crate::admin::{AdminRequest, AdminResponse};
use crate::command::Op;
use crate::effect::Effect;
use crate::ids::{ChannelRef, ConnId};
use crate::shard::{Broker, ShardMail};
use crate::store::Definitions;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Rounds of mail between shards a sharded restore carries after one op: each round is a
/// hop (declare -> create -> created -> declare-ok is three), so this only catches a loop.
const MAX_SETTLE_ROUNDS: usize = 1 << 16;

/// Pieces of mail carried between shards within one call before it is called a loop.
const MAX_LINK_DELIVERIES: u32 = 1 << 20;

/// `k` shards in one thread and the FIFO links between them.
pub struct Shards {
    brokers: Vec<Broker>,
    /// Mail between shards, one link per (from, to) pair.
    links: BTreeMap<(u32, u32), VecDeque<ShardMail>>,
    /// Mail within each shard and on the links waits for `deliver_mail`.
    scheduled: bool,
}

impl Shards {
    /// Composes `brokers` (new ones, in shard order): broker `i` becomes shard `i` of
    /// `brokers.len()`, the memory alarm counts every shard's bytes, and the others adopt
    /// shard 0's routing table.
    ///
    /// # Panics
    /// If `brokers` is empty, or a broker was used before.
    pub fn new(mut brokers: Vec<Broker>) -> Shards {
        assert!(!brokers.is_empty(), "at least one shard");
        let k = brokers.len() as u32;
        if k > 1 {
            let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
            for (i, b) in brokers.iter_mut().enumerate() {
                b.set_shard(i as u32, k);
                b.share_memory_count(count.clone());
            }
            let routes = brokers[0].routes().clone();
            for b in &mut brokers[1..] {
                b.adopt_routes(routes.clone());
            }
        }
        Shards {
            brokers,
            links: BTreeMap::new(),
            scheduled: false,
        }
    }

    /// The number of shards.
    pub fn k(&self) -> u32 {
        self.brokers.len() as u32
    }

    /// Every shard, in order.
    pub fn brokers(&self) -> &[Broker] {
        &self.brokers
    }

    /// Every shard, in order, for a host that runs them on its own (after `restore`).
    pub fn into_brokers(self) -> Vec<Broker> {
        self.brokers
    }

    /// The shard of connection `conn`.
    pub fn shard_of(&self, conn: ConnId) -> u32 {
        (conn.0 % u64::from(self.k())) as u32
    }

    /// Restores stored definitions into every shard ([`restore`]).
    pub fn restore(&mut self, now: u64, definitions: &Definitions) -> Vec<String> {
        restore(now, definitions, &mut self.brokers)
    }

    /// Applies `op` of channel `ch` on its connection's shard, then carries the mail
    /// between shards (unless mail is scheduled).
    pub fn handle(&mut self, now: u64, ch: ChannelRef, op: Op) {
        let i = self.shard_of(ch.conn);
        self.brokers[i as usize].handle(now, ch, op);
        self.collect(i);
        self.drain_links(now);
    }

    /// `Broker::tick` on every shard, then carries the mail.
    pub fn tick(&mut self, now: u64) {
        for i in 0..self.k() {
            self.brokers[i as usize].tick(now);
            self.collect(i);
        }
        self.drain_links(now);
    }

    /// Carries what the shards sent outside an op (an admin op on shard 0, a sync) and,
    /// without scheduled mail, delivers it.
    pub fn settle(&mut self, now: u64) {
        for i in 0..self.k() {
            self.collect(i);
        }
        self.drain_links(now);
    }

    /// Every shard's effects, in shard order.
    pub fn poll_effects(&mut self, out: &mut Vec<Effect>) {
        for b in &mut self.brokers {
            b.poll_effects(out);
        }
    }

    /// Pieces of mail on the links between shards.
    pub fn links_pending(&self) -> usize {
        self.links.values().map(VecDeque::len).sum()
    }

    /// Mail not delivered yet, within shards and between them.
    pub fn mail_pending(&self) -> usize {
        self.brokers.iter().map(Broker::mail_pending).sum::<usize>() + self.links_pending()
    }

    /// `Broker::set_mail_scheduled` on every shard, and for the links between them: mail
    /// then waits for `deliver_mail`.
    pub fn set_mail_scheduled(&mut self, now: u64, on: bool) {
        self.scheduled = on;
        for i in 0..self.k() {
            self.brokers[i as usize].set_mail_scheduled(on);
            self.collect(i);
        }
        self.drain_links(now);
    }

    /// Delivers one piece of scheduled mail: within a shard (`Broker::deliver_mail`) or on
    /// a link; `pick` chooses among the shards and links with mail. False if none was
    /// pending.
    pub fn deliver_mail(&mut self, now: u64, pick: usize) -> bool {
        let mut places: Vec<Result<u32, (u32, u32)>> = (0..self.k())
            .filter(|&i| self.brokers[i as usize].mail_pending() > 0)
            .map(Ok)
            .collect();
        places.extend(
            self.links
                .iter()
                .filter(|(_, l)| !l.is_empty())
                .map(|(k, _)| Err(*k)),
        );
        if places.is_empty() {
            return false;
        }
        match places[pick % places.len()] {
            Ok(i) => {
                let delivered = self.brokers[i as usize].deliver_mail(now, pick / places.len());
                debug_assert!(delivered, "shard {i} had mail");
                self.collect(i);
            }
            Err(link) => self.deliver_link(now, link),
        }
        true
    }

    /// Runs an operator's request as a sharded broker does: a `gathered` one on every
    /// shard, merged; a connection's close on its shard; anything else on shard 0, after
    /// its `replica` (if any) on every other shard, in the same order on each. Then the
    /// mail it caused is carried.
    pub fn admin(&mut self, now: u64, request: AdminRequest) -> AdminResponse {
        let answer = if self.k() > 1 && request.gathered().is_some() {
            let mut answers = Vec::with_capacity(self.brokers.len());
            for b in &mut self.brokers {
                if let Some(r) = request.gathered() {
                    answers.push(b.apply_admin(now, r));
                }
            }
            request.merge(answers)
        } else if let AdminRequest::CloseConnection { conn, .. } = &request {
            let i = self.shard_of(*conn) as usize;
            self.brokers[i].apply_admin(now, request)
        } else {
            for b in &mut self.brokers[1..] {
                let Some(replica) = request.replica() else {
                    break;
                };
                // The other shards' answers are shard 0's: nobody reads them.
                b.apply_admin(now, replica);
            }
            self.brokers[0].apply_admin(now, request)
        };
        self.settle(now);
        answer
    }

    /// The invariants across every shard ([`Broker::check_shards`]), once no mail
    /// travels between them.
    #[cfg(any(test, feature = "testing"))]
    pub fn check(&self) -> Result<(), String> {
        if self.links_pending() > 0 {
            return Ok(());
        }
        let all: Vec<&Broker> = self.brokers.iter().collect();
        Broker::check_shards(&all)
    }

    /// Moves shard `i`'s outbox onto the links; what shard 0 sends goes after the routing
    /// table it published (the other shards adopt it first, as the runtime does).
    fn collect(&mut self, i: u32) {
        if self.k() == 1 {
            return;
        }
        if i == 0 {
            let routes = self.brokers[0].routes().clone();
            for b in &mut self.brokers[1..] {
                b.adopt_routes(routes.clone());
            }
        }
        let mut out = Vec::new();
        self.brokers[i as usize].take_outbox(&mut out);
        for m in out {
            self.links.entry((i, m.shard())).or_default().push_back(m);
        }
    }

    /// Delivers the front of link `(from, to)`.
    fn deliver_link(&mut self, now: u64, link: (u32, u32)) {
        let Some(m) = self.links.get_mut(&link).and_then(VecDeque::pop_front) else {
            return;
        };
        self.brokers[link.1 as usize].receive_mail(now, m);
        self.collect(link.1);
    }

    /// Without scheduled mail, mail between shards arrives before the call returns.
    fn drain_links(&mut self, now: u64) {
        if self.scheduled {
            return;
        }
        let mut rounds = 0u32;
        while let Some(&link) = self
            .links
            .iter()
            .find(|(_, l)| !l.is_empty())
            .map(|(k, _)| k)
        {
            rounds += 1;
            assert!(rounds < MAX_LINK_DELIVERIES, "mail between shards loops");
            self.deliver_link(now, link);
        }
    }
}

impl std::ops::Index<usize> for Shards {
    type Output = Broker;

    fn index(&self, i: usize) -> &Broker {
        &self.brokers[i]
    }
}

impl std::ops::IndexMut<usize> for Shards {
    fn index_mut(&mut self, i: usize) -> &mut Broker {
        &mut self.brokers[i]
    }
}

/// Restores stored definitions into `brokers` (every shard, in order, before any serves):
/// every shard gets the vhosts, users, permissions and policies; shard 0 replays
/// exchanges, queues and bindings, and each restored queue is created by the shard that
/// owns it, with the messages of that shard's store. Returns what could not be restored,
/// as RabbitMQ-style texts, for the host to log.
pub fn restore(now: u64, definitions: &Definitions, brokers: &mut [Broker]) -> Vec<String> {
    match brokers.split_first_mut() {
        Some((first, others)) => first.restore_shards(now, definitions, others, carry),
        None => Vec::new(),
    }
}

/// Carries mail between `first` (shard 0) and `others` (shards 1.., in order) in one
/// thread until none is left, the other shards adopting shard 0's routing table first.
/// The sharded restore's stand-in for the runtime, which is not running yet.
pub fn carry(now: u64, first: &mut Broker, others: &mut [Broker]) {
    let mut out = Vec::new();
    // Each round moves what every shard sent; a round bounds by the restore's work.
    for _ in 0..MAX_SETTLE_ROUNDS {
        let routes = Arc::clone(first.routes());
        for b in others.iter_mut() {
            b.adopt_routes(Arc::clone(&routes));
        }
        first.take_outbox(&mut out);
        for b in others.iter_mut() {
            b.take_outbox(&mut out);
        }
        if out.is_empty() {
            return;
        }
        for m in out.drain(..) {
            match m.shard() {
                0 => first.receive_mail(now, m),
                i => match others.get_mut(i as usize - 1) {
                    Some(b) => b.receive_mail(now, m),
                    None => debug_assert!(false, "mail for shard {i}, which is not given"),
                },
            }
        }
    }
    debug_assert!(false, "mail between shards does not settle");
}
