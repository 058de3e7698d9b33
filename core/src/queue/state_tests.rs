//! `QueueState` on its own, against a model: what a queue hands out, in which order, to
//! whom, and what it holds, over random sequences of publishes, deliveries, settles,
//! consumers coming and going, and purges, with a small window so paging to and from
//! the store is exercised too.
use super::*;
use crate::ids::ChannelRef;
use crate::ids::VhostId;
use crate::store::MemoryStore;
use proptest::prelude::*;
use std::collections::BTreeMap;

/// The limits that span queues are not under test here.
struct NoSharedLimits;

impl Credit for NoSharedLimits {
    fn may_deliver(&self, _: &QueueConsumer) -> bool {
        true
    }

    fn take(&mut self, _: &QueueConsumer) -> bool {
        true
    }

    fn give_back(&mut self, _: &QueueConsumer) {}
}

#[derive(Clone, Debug)]
enum Step {
    Publish { persistent: bool, len: u8 },
    Deliver,
    Settle { pick: usize, how: u8 },
    Consume { prefetch: u8 },
    Cancel { pick: usize },
    Purge,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (any::<bool>(), 0u8..32).prop_map(|(persistent, len)| Step::Publish { persistent, len }),
        5 => Just(Step::Deliver),
        3 => (any::<usize>(), 0u8..3).prop_map(|(pick, how)| Step::Settle { pick, how }),
        1 => (0u8..4).prop_map(|prefetch| Step::Consume { prefetch }),
        1 => any::<usize>().prop_map(|pick| Step::Cancel { pick }),
        1 => Just(Step::Purge),
    ]
}

/// A message whose body starts with its id (the model's name for it).
fn message(id: u32, len: u8, persistent: bool) -> Arc<Message> {
    let mut body = id.to_be_bytes().to_vec();
    body.resize(4 + usize::from(len), 0);
    Arc::new(Message {
        exchange: Arc::from(""),
        routing_key: Arc::from("q"),
        properties: crate::message::Properties {
            delivery_mode: persistent.then_some(2),
            ..Default::default()
        },
        body: body.into(),
    })
}

fn id_of(m: &Message) -> u32 {
    let mut id = [0u8; 4];
    id.copy_from_slice(&m.body[..4]);
    u32::from_be_bytes(id)
}

fn new_queue(store: &mut MemoryStore) -> QueueState {
    let id = QueueId(1);
    let recovery = store.open_queue(id, "/", "q", true);
    let messages = MessageQueue::recovered(recovery, None);
    let mut q = QueueState::new(id, VhostId(0), Arc::from("q"), messages, 0);
    q.durable = true;
    q
}

/// A consumer as the model sees it: id, prefetch, deliveries out.
struct ModelConsumer {
    id: ConsumerId,
    prefetch: u16,
    out: u32,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn behaves_as_its_model(steps in proptest::collection::vec(step(), 1..200)) {
        let config = BrokerConfig {
            queue_window: 3,
            ..BrokerConfig::default()
        };
        let mut store = MemoryStore::new();
        let mut q = new_queue(&mut store);
        // The model: ready ids with their body lengths (ids grow with publish order, so
        // a requeued message's original position is its id's), deliveries out (as a
        // channel holds them), consumers in arrival order.
        let mut ready: BTreeMap<u32, u64> = BTreeMap::new();
        let mut out: Vec<Unacked> = Vec::new();
        let mut consumers: Vec<ModelConsumer> = Vec::new();
        let (mut next_id, mut next_consumer) = (0u32, 0u64);
        let mut held: i64 = 0;
        for step in steps {
            let mut io = QueueIo::new(Some(&mut store), &config, 0, false);
            match step {
                Step::Publish { persistent, len } => {
                    let m = message(next_id, len, persistent);
                    let outcome = q.enqueue(&mut io, &m);
                    prop_assert_eq!(
                        matches!(outcome, Enqueued::Durable),
                        persistent,
                        "a persistent message on a durable queue waits for a sync"
                    );
                    ready.insert(next_id, m.body_len() as u64);
                    next_id += 1;
                }
                Step::Deliver => {
                    let eligible = consumers
                        .iter()
                        .any(|c| c.prefetch == 0 || c.out < u32::from(c.prefetch));
                    let picked = q.next_delivery(&mut io, &mut NoSharedLimits, false);
                    match (ready.first_key_value(), eligible, picked) {
                        (Some((&head, _)), true, Some(p)) => {
                            prop_assert_eq!(id_of(&p.message.message), head, "oldest first");
                            let c = consumers
                                .iter_mut()
                                .find(|c| c.id == p.consumer)
                                .ok_or_else(|| TestCaseError::fail("unknown consumer"))?;
                            prop_assert!(c.prefetch == 0 || c.out < u32::from(c.prefetch));
                            c.out += 1;
                            ready.remove(&head);
                            out.push(Unacked::of(q.id, &p.message, Some(p.consumer)));
                        }
                        (None, _, None) | (_, false, None) => {}
                        (head, eligible, picked) => {
                            return Err(TestCaseError::fail(format!(
                                "head {head:?}, a consumer with credit: {eligible}, \
                                 delivered: {}",
                                picked.is_some()
                            )));
                        }
                    }
                }
                Step::Settle { pick, how } => {
                    if out.is_empty() {
                        continue;
                    }
                    let u = out.remove(pick % out.len());
                    let (id, len) = (id_of(&u.message), u.message.body_len() as u64);
                    if let Some(c) = consumers.iter_mut().find(|c| Some(c.id) == u.consumer) {
                        c.out -= 1;
                    }
                    let settle = [Settle::Ack, Settle::Requeue, Settle::Discard][usize::from(how)];
                    let requeued = q.settle(&mut io, u, settle);
                    prop_assert_eq!(requeued, settle == Settle::Requeue);
                    if requeued {
                        ready.insert(id, len);
                    }
                    prop_assert_eq!(io.out.dead.len(), usize::from(settle == Settle::Discard));
                }
                Step::Consume { prefetch } => {
                    let id = ConsumerId(next_consumer);
                    next_consumer += 1;
                    q.add_consumer(0, QueueConsumer {
                        id,
                        tag: Arc::from("c"),
                        ch: ChannelRef::new(crate::ids::ConnId(1), 1),
                        serial: 0,
                        no_ack: false,
                        exclusive: false,
                        global_qos: false,
                        prefetch: u16::from(prefetch),
                        unacked: 0,
                        refilling: false,
                        priority: 0,
                        shared: None,
                    });
                    consumers.push(ModelConsumer { id, prefetch: u16::from(prefetch), out: 0 });
                }
                Step::Cancel { pick } => {
                    if consumers.is_empty() {
                        continue;
                    }
                    let c = consumers.remove(pick % consumers.len());
                    let removed = q.remove_consumer(0, c.id);
                    prop_assert_eq!(removed.map(|r| r.id), Some(c.id));
                }
                Step::Purge => {
                    let purged = q.purge(&mut io);
                    prop_assert_eq!(purged, ready.len() as u64);
                    ready.clear();
                }
            }
            let o = std::mem::take(&mut io.out);
            prop_assert!(!o.store_failed);
            held += o.held as i64 - o.released as i64;
            // What the queue holds in memory, plus what is out, is what it reported held.
            let out_bytes: u64 = out.iter().map(|u| u.message.body_len() as u64).sum();
            prop_assert_eq!(held, (q.messages.bytes() + out_bytes) as i64);
            prop_assert_eq!(q.messages.len(), ready.len());
            prop_assert_eq!(q.messages.total_bytes(), ready.values().sum::<u64>());
            prop_assert_eq!(q.unacked, out.len() as u64);
            prop_assert!(q.messages.in_memory() <= config.queue_window * 4 + 1);
            for c in &consumers {
                let queued = q.consumer(c.id).ok_or_else(|| TestCaseError::fail("consumer lost"))?;
                prop_assert_eq!(queued.unacked, c.out);
            }
        }
    }
}

/// The declared arguments of queues declared alike (every MQTT QoS 0 session's
/// `x-queue-type: mqtt-qos0`) are one allocation, not a ~700-byte B-tree node per queue.
#[test]
fn equal_declared_arguments_are_held_once() {
    let table = |kind: &str| {
        let mut t = FieldTable::new();
        t.insert(
            "x-queue-type".into(),
            crate::message::FieldValue::string(kind),
        );
        t
    };
    let queue = |n: u64| {
        QueueState::new(
            QueueId(n),
            VhostId(0),
            Arc::from(format!("q{n}")),
            MessageQueue::new(),
            0,
        )
    };
    let mut last = None;
    let (mut a, mut b, mut c, mut d) = (queue(1), queue(2), queue(3), queue(4));
    a.set_arguments(table("mqtt-qos0"), &mut last);
    b.set_arguments(table("mqtt-qos0"), &mut last);
    let (Some(x), Some(y)) = (&a.arguments, &b.arguments) else {
        panic!("non-empty arguments are held");
    };
    assert!(Arc::ptr_eq(x, y), "one allocation for both");
    c.set_arguments(table("classic"), &mut last);
    assert_eq!(c.arguments(), &table("classic"));
    assert_eq!(
        a.arguments(),
        &table("mqtt-qos0"),
        "the first queue's are unchanged"
    );
    d.set_arguments(FieldTable::new(), &mut last);
    assert!(d.arguments.is_none(), "no allocation for none");
}
