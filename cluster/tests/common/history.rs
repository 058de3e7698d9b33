//! A history of what clients saw (publishes and their confirms, deliveries with their
//! redelivered flag) and the checker over it, in the spirit of Jepsen: the broker is judged
//! only by what its clients observed. Message bodies are `P:SEQ`: publisher P's SEQ-th
//! publish, so every delivery names its publish.
//!
//! The checker asserts:
//! - **no loss**: every confirmed message is delivered at least once (during the run or by
//!   the final drain);
//! - **none invented**: every delivered body is one a publisher handed to `basic.publish`;
//! - **order**: within one consumer session, a publisher's confirmed messages seen for the
//!   first time (anywhere) and not flagged redelivered arrive in publish order. A message
//!   seen before is a requeue even if the broker lost the flag (a crash), so only first
//!   sightings count; unconfirmed messages are left out because a publish the client gave
//!   up on (a partitioned node) may still be enqueued after its successors.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

/// A publish's outcome as the publisher saw it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Outcome {
    /// Handed to `basic.publish`; no answer came (connection lost, timed out).
    Unknown,
    Confirmed,
    Nacked,
    /// Confirmed but returned unroutable (mandatory).
    Returned,
}

/// One delivery: which consumer session got it, and the message it names.
#[derive(Clone, Copy, Debug)]
pub struct Delivery {
    pub session: u32,
    pub publisher: u32,
    pub seq: u64,
    pub redelivered: bool,
}

/// What every client recorded, bounded by `max_ops` publishes (publishers stop there).
#[derive(Default)]
pub struct History {
    /// Per publisher, the outcome of each publish, indexed by sequence number.
    pub publishes: Vec<Vec<Outcome>>,
    pub deliveries: Vec<Delivery>,
    /// Bodies that are not `P:SEQ` (first few kept, all counted).
    pub malformed: Vec<String>,
    pub malformed_count: u64,
    /// Faults injected, by kind, in the order first used.
    pub faults: BTreeMap<String, u32>,
    pub sessions: u32,
    pub max_ops: u64,
    /// Client-side errors that ended a session (counted; first few kept for the report).
    pub session_errors: u64,
    pub first_errors: Vec<String>,
    /// Per publisher: when its last confirm came, and the longest time between two of its
    /// confirms (how long a fault kept it from publishing: the failover time it saw).
    pub confirm_gaps: Vec<(Option<std::time::Instant>, std::time::Duration)>,
}

impl History {
    pub fn new(publishers: usize, max_ops: u64) -> History {
        History {
            publishes: vec![Vec::new(); publishers],
            confirm_gaps: vec![(None, std::time::Duration::ZERO); publishers],
            max_ops,
            ..History::default()
        }
    }

    pub fn published(&self) -> u64 {
        self.publishes.iter().map(|p| p.len() as u64).sum()
    }

    /// Records that publisher `p` hands its next message to `basic.publish`; its sequence
    /// number, or `None` once the history is full.
    pub fn send(&mut self, p: usize) -> Option<u64> {
        if self.published() >= self.max_ops {
            return None;
        }
        let log = &mut self.publishes[p];
        log.push(Outcome::Unknown);
        Some(log.len() as u64 - 1)
    }

    pub fn settle(&mut self, p: usize, seq: u64, outcome: Outcome) {
        if let Some(o) = self.publishes[p].get_mut(seq as usize) {
            *o = outcome;
        }
        if outcome == Outcome::Confirmed
            && let Some((last, longest)) = self.confirm_gaps.get_mut(p)
        {
            let now = std::time::Instant::now();
            if let Some(last) = last {
                *longest = (*longest).max(now - *last);
            }
            *last = Some(now);
        }
    }

    /// A new consumer session's id (order is checked per session).
    pub fn session(&mut self) -> u32 {
        self.sessions += 1;
        self.sessions
    }

    pub fn deliver(&mut self, session: u32, body: &[u8], redelivered: bool) {
        let parsed = std::str::from_utf8(body).ok().and_then(|s| {
            let (p, seq) = s.split_once(':')?;
            Some((p.parse::<u32>().ok()?, seq.parse::<u64>().ok()?))
        });
        match parsed {
            Some((publisher, seq)) => self.deliveries.push(Delivery {
                session,
                publisher,
                seq,
                redelivered,
            }),
            None => {
                self.malformed_count += 1;
                if self.malformed.len() < 5 {
                    self.malformed
                        .push(String::from_utf8_lossy(&body[..body.len().min(64)]).into());
                }
            }
        }
    }

    pub fn fault(&mut self, kind: &str) {
        *self.faults.entry(kind.to_string()).or_default() += 1;
    }

    pub fn error(&mut self, e: String) {
        self.session_errors += 1;
        if self.first_errors.len() < 5 {
            self.first_errors.push(e);
        }
    }

    /// Checks the history.
    pub fn check(&self) -> Report {
        let mut r = Report {
            published: self.published(),
            delivered: self.deliveries.len() as u64,
            faults: self.faults.clone(),
            sessions: self.sessions,
            invented: self.malformed_count,
            session_errors: self.session_errors,
            longest_confirm_gap_ms: self
                .confirm_gaps
                .iter()
                .map(|(_, g)| g.as_millis() as u64)
                .collect(),
            ..Report::default()
        };
        for log in &self.publishes {
            for o in log {
                match o {
                    Outcome::Unknown => r.unknown += 1,
                    Outcome::Confirmed => r.confirmed += 1,
                    Outcome::Nacked => r.nacked += 1,
                    Outcome::Returned => r.returned += 1,
                }
            }
        }
        let confirmed = |p: u32, seq: u64| {
            self.publishes
                .get(p as usize)
                .and_then(|l| l.get(seq as usize))
                == Some(&Outcome::Confirmed)
        };
        let mut seen: HashSet<(u32, u64)> = HashSet::with_capacity(self.deliveries.len());
        // Per (session, publisher): the highest first-seen confirmed sequence so far.
        let mut last: HashMap<(u32, u32), u64> = HashMap::new();
        for d in &self.deliveries {
            let known = self
                .publishes
                .get(d.publisher as usize)
                .is_some_and(|l| d.seq < l.len() as u64);
            if !known {
                r.invented += 1;
                push_example(&mut r.invented_examples, (d.publisher, d.seq));
                continue;
            }
            let first = seen.insert((d.publisher, d.seq));
            if !first {
                r.duplicates += 1;
                continue;
            }
            if d.redelivered || !confirmed(d.publisher, d.seq) {
                continue;
            }
            let prev = last.entry((d.session, d.publisher)).or_insert(d.seq);
            if d.seq < *prev {
                r.out_of_order += 1;
                push_example(&mut r.out_of_order_examples, (d.publisher, d.seq));
            } else {
                *prev = d.seq;
            }
        }
        r.distinct = seen.len() as u64;
        for (p, log) in self.publishes.iter().enumerate() {
            for (seq, o) in log.iter().enumerate() {
                if *o == Outcome::Confirmed && !seen.contains(&(p as u32, seq as u64)) {
                    r.lost += 1;
                    push_example(&mut r.lost_examples, (p as u32, seq as u64));
                }
            }
        }
        r.malformed = self.malformed.clone();
        r.first_errors = self.first_errors.clone();
        r
    }
}

fn push_example(v: &mut Vec<(u32, u64)>, x: (u32, u64)) {
    if v.len() < 10 {
        v.push(x);
    }
}

/// The checker's verdict and counts (docs/cluster.md, "How we test").
#[derive(Default, Debug)]
pub struct Report {
    pub published: u64,
    pub confirmed: u64,
    pub nacked: u64,
    pub returned: u64,
    pub unknown: u64,
    pub delivered: u64,
    pub distinct: u64,
    pub duplicates: u64,
    pub lost: u64,
    pub lost_examples: Vec<(u32, u64)>,
    pub invented: u64,
    pub invented_examples: Vec<(u32, u64)>,
    pub malformed: Vec<String>,
    pub out_of_order: u64,
    pub out_of_order_examples: Vec<(u32, u64)>,
    pub faults: BTreeMap<String, u32>,
    pub sessions: u32,
    pub session_errors: u64,
    pub first_errors: Vec<String>,
    /// Per publisher, the longest time between two of its confirms, in ms.
    pub longest_confirm_gap_ms: Vec<u64>,
    /// Panics in the brokers' logs (filled in by the run, not from the history).
    pub broker_panics: Vec<String>,
}

impl Report {
    pub fn faults_total(&self) -> u32 {
        self.faults.values().sum()
    }

    /// What is wrong; empty when the history passes.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.lost > 0 {
            p.push(format!(
                "{} confirmed messages never delivered (lost), e.g. (publisher, seq) {:?}",
                self.lost, self.lost_examples
            ));
        }
        if self.invented > 0 {
            p.push(format!(
                "{} deliveries of messages never published (invented), e.g. {:?} {:?}",
                self.invented, self.invented_examples, self.malformed
            ));
        }
        if self.out_of_order > 0 {
            p.push(format!(
                "{} first deliveries out of publish order, e.g. (publisher, seq) {:?}",
                self.out_of_order, self.out_of_order_examples
            ));
        }
        if !self.broker_panics.is_empty() {
            p.push(format!(
                "{} broker panics, e.g. {:?}",
                self.broker_panics.len(),
                &self.broker_panics[..self.broker_panics.len().min(3)]
            ));
        }
        if self.confirmed == 0 {
            p.push("no message was confirmed: the run exercised nothing".into());
        }
        p
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        write!(
            f,
            "faults {} ({}); published {} confirmed {} (nacked {}, returned {}, unknown {}); \
             delivered {} ({} distinct, {} duplicates); lost {}, invented {}, out of order {}; \
             consumer sessions {}, client sessions ended by errors {}; longest wait between \
             two confirms per publisher {:?} ms",
            self.faults_total(),
            if faults.is_empty() {
                "none".to_string()
            } else {
                faults.join(", ")
            },
            self.published,
            self.confirmed,
            self.nacked,
            self.returned,
            self.unknown,
            self.delivered,
            self.distinct,
            self.duplicates,
            self.lost,
            self.invented,
            self.out_of_order,
            self.sessions,
            self.session_errors,
            self.longest_confirm_gap_ms,
        )
    }
}
