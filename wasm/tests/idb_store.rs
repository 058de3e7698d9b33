//! The browser store against the core, natively: a broker over `IdbStore` whose sealed
//! batches are applied to a map standing for IndexedDB (only on "commit"), crashed (dropped)
//! and restored from the map. The JS side's own tests (wasm/js/test/persist.test.mjs) run
//! the same through fake-indexeddb; these pin the Rust half: what a batch holds, chunk
//! rewrites, the retry of a failed batch, and the records' checks.

use std::collections::BTreeMap;
use warren_core::command::{Op, Publish, QueueDeclare};
use warren_core::effect::Effect;
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::message::{FieldTable, Properties};
use warren_core::{Broker, BrokerConfig};
use warren_wasm::idb_store::{self, DEL, PUT, RANGE, SharedRef};
use warren_wasm::record;

type Db = BTreeMap<Vec<u8>, Vec<u8>>;

const CH: ChannelRef = ChannelRef {
    conn: ConnId(1),
    channel: 1,
};

/// Applies a sealed batch as one IndexedDB transaction would.
fn apply(db: &mut Db, batch: &[u8]) {
    let mut rest = batch;
    let field = |rest: &mut &[u8]| {
        let n = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        let f = rest[4..4 + n].to_vec();
        *rest = &rest[4 + n..];
        f
    };
    while let Some((&code, r)) = rest.split_first() {
        rest = r;
        let key = field(&mut rest);
        match code {
            PUT => {
                let v = field(&mut rest);
                db.insert(key, v);
            }
            DEL => {
                db.remove(&key);
            }
            RANGE => {
                let hi = field(&mut rest);
                db.retain(|k, _| !(*k >= key && *k <= hi));
            }
            _ => panic!("op {code}"),
        }
    }
}

/// Every record as put ops, in key order (what persist.js reads back).
fn records(db: &Db) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in db {
        out.push(PUT);
        for f in [k, v] {
            out.extend_from_slice(&(f.len() as u32).to_le_bytes());
            out.extend_from_slice(f);
        }
    }
    out
}

struct Tab {
    core: Broker,
    shared: SharedRef,
    effects: Vec<Effect>,
}

impl Tab {
    /// Restores from `db`, replaying the queue declares (persist.js replays every kind
    /// through the API; the queues are what these tests need).
    fn open(db: &Db) -> (Tab, usize) {
        let r = idb_store::restore(&records(db)).expect("batch framing");
        let mut core = Broker::with_store(BrokerConfig::default(), Box::new(r.store));
        core.handle(
            0,
            ChannelRef::new(ConnId(1), 0),
            Op::ConnectionOpen {
                vhost: "/".into(),
                user: "guest".into(),
                cancel_notify: true,
            },
        );
        core.handle(0, CH, Op::ChannelOpen);
        core.handle(0, CH, Op::ConfirmSelect { nowait: true });
        let mut tab = Tab {
            core,
            shared: r.shared,
            effects: Vec::new(),
        };
        for (kind, m) in r.definitions {
            if kind == record::QUEUE {
                tab.declare(&m.routing_key);
            }
        }
        idb_store::restored(&tab.shared);
        (tab, r.skipped_count)
    }

    fn declare(&mut self, name: &str) {
        self.op(Op::QueueDeclare(QueueDeclare {
            queue: name.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::new(),
        }));
    }

    fn op(&mut self, op: Op) {
        self.core.handle(0, CH, op);
        self.core.poll_effects(&mut self.effects);
    }

    fn publish(&mut self, queue: &str, body: &str) {
        self.op(Op::Publish(Box::new(Publish {
            exchange: "".into(),
            routing_key: queue.into(),
            mandatory: false,
            immediate: false,
            properties: Properties {
                delivery_mode: Some(2),
                ..Properties::default()
            },
            body: body.as_bytes().to_vec().into(),
            routed: None,
        })));
    }

    /// Starts a sync as the JS broker does (every change rides on it): the sealed batch.
    fn seal(&mut self) -> Option<(u64, Vec<u8>)> {
        if idb_store::lock(&self.shared).has_pending() {
            self.core.request_sync();
        }
        self.core.start_sync()?;
        idb_store::lock(&self.shared).take_sealed()
    }

    fn commit(&mut self, db: &mut Db) {
        if let Some((epoch, batch)) = self.seal() {
            apply(db, &batch);
            idb_store::lock(&self.shared).committed(epoch);
            self.core.synced(0, epoch);
            self.core.poll_effects(&mut self.effects);
        }
    }

    fn confirms(&mut self) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        for e in self.effects.drain(..) {
            if let Effect::Confirm { seq, ack, .. } = e {
                out.push((seq, ack));
            }
        }
        out
    }

    /// basic.get + ack of everything ready, bodies in order.
    fn drain(&mut self, queue: &str) -> Vec<String> {
        let mut got = Vec::new();
        loop {
            self.op(Op::Get {
                queue: queue.into(),
                no_ack: false,
            });
            let mut tag = None;
            for e in self.effects.drain(..) {
                if let Effect::Reply {
                    reply: warren_core::effect::Reply::GetOk { delivery, .. },
                    ..
                } = e
                {
                    got.push(String::from_utf8(delivery.message.body.to_vec()).unwrap());
                    tag = Some(delivery.delivery_tag);
                }
            }
            let Some(delivery_tag) = tag else { break };
            self.op(Op::Ack {
                delivery_tag,
                multiple: false,
            });
        }
        got
    }
}

fn chunks(db: &Db) -> usize {
    db.keys().filter(|k| k[0] == record::MESSAGE).count()
}

#[test]
fn a_confirm_waits_for_the_commit_and_what_was_committed_survives_a_crash() {
    let mut db = Db::new();
    let (mut tab, _) = Tab::open(&db);
    tab.declare("q");
    tab.commit(&mut db);
    tab.confirms();
    for i in 0..5 {
        tab.publish("q", &format!("m{i}"));
    }
    assert!(tab.confirms().is_empty(), "confirmed before any write");
    let (epoch, batch) = tab.seal().expect("a sync starts");
    // Five publishes between two syncs: one chunk record.
    let mut staged = db.clone();
    apply(&mut staged, &batch);
    assert_eq!(chunks(&staged), 1);
    // Crash before the commit: nothing of it is kept, and nothing was confirmed.
    assert!(tab.confirms().is_empty());
    drop(tab);
    let (mut back, skipped) = Tab::open(&db);
    assert_eq!(skipped, 0);
    assert!(back.drain("q").is_empty());
    // Committed: confirmed, and kept.
    let _ = epoch;
    db = staged;
    let (mut again, _) = Tab::open(&db);
    assert_eq!(again.drain("q"), ["m0", "m1", "m2", "m3", "m4"]);
}

#[test]
fn acks_rewrite_a_chunk_and_the_last_one_deletes_it() {
    let mut db = Db::new();
    let (mut tab, _) = Tab::open(&db);
    tab.declare("q");
    for i in 0..3 {
        tab.publish("q", &format!("m{i}"));
    }
    tab.commit(&mut db);
    assert_eq!(tab.confirms(), [(1, true), (2, true), (3, true)]);
    assert_eq!(chunks(&db), 1);
    drop(tab);
    let (mut tab, _) = Tab::open(&db);
    // Get and ack the first two: the chunk is rewritten with the third.
    tab.op(Op::Get {
        queue: "q".into(),
        no_ack: false,
    });
    tab.op(Op::Ack {
        delivery_tag: 1,
        multiple: false,
    });
    tab.commit(&mut db);
    drop(tab);
    let (mut tab, _) = Tab::open(&db);
    assert_eq!(tab.drain("q"), ["m1", "m2"]);
    tab.commit(&mut db);
    assert_eq!(chunks(&db), 0, "the last ack deleted the chunk");
}

#[test]
fn a_failed_batch_is_written_again_before_the_newer_changes() {
    let mut db = Db::new();
    let (mut tab, _) = Tab::open(&db);
    tab.declare("q");
    tab.publish("q", "first");
    let (epoch, _) = tab.seal().expect("a sync");
    // The transaction failed (quota): nacked, and kept for the retry.
    idb_store::lock(&tab.shared).failed(epoch);
    tab.core.sync_failed(0, epoch);
    tab.core.poll_effects(&mut tab.effects);
    assert_eq!(tab.confirms(), [(1, false)]);
    assert!(
        tab.seal().is_none(),
        "paused: no write until the host retries"
    );
    tab.publish("q", "second");
    idb_store::lock(&tab.shared).paused = false;
    tab.commit(&mut db);
    assert_eq!(tab.confirms(), [(2, true)]);
    drop(tab);
    let (mut tab, _) = Tab::open(&db);
    assert_eq!(
        tab.drain("q"),
        ["first", "second"],
        "the failed write and the queue's declare came with the retry"
    );
}

#[test]
fn a_damaged_record_is_skipped_and_counted_never_half_read() {
    let mut db = Db::new();
    let (mut tab, _) = Tab::open(&db);
    tab.declare("q");
    tab.publish("q", "a");
    tab.commit(&mut db);
    tab.publish("q", "b");
    tab.commit(&mut db);
    drop(tab);
    let second = db
        .keys()
        .filter(|k| k[0] == record::MESSAGE)
        .nth(1)
        .unwrap()
        .clone();
    let value = db.get_mut(&second).unwrap();
    let last = value.len() - 1;
    value[last] ^= 1;
    let (mut tab, skipped) = Tab::open(&db);
    assert_eq!(skipped, 1);
    assert_eq!(tab.drain("q"), ["a"]);
    let r = idb_store::restore(&records(&db)).unwrap();
    assert!(
        r.skipped[0].ends_with("checksum mismatch"),
        "{:?}",
        r.skipped
    );
}

#[test]
fn crc32c_is_castagnoli_and_values_check_version_and_length() {
    // The check value of CRC-32C (RFC 3720, appendix B.4).
    assert_eq!(record::crc32c(b"1234", b"56789"), 0xe306_9283);
    let v = record::seal(b"k", b"payload");
    assert_eq!(record::open(b"k", &v), Ok(&b"payload"[..]));
    assert_eq!(record::open(b"other", &v), Err("checksum mismatch"));
    assert_eq!(record::open(b"k", &v[..3]), Err("truncated"));
    let mut w = v.clone();
    w[0] = 2;
    assert_eq!(record::open(b"k", &w), Err("unknown format version"));
}
