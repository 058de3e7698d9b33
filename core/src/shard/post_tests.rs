//! The paths the synchronous composition never takes, since it delivers mail within
//! the operation that sent it: with shards, a channel may close while mail for it
//! travels. Each test stops the pump at the mail in question and closes the channel.
use super::*;
use crate::command::{Consume, Op, Publish, QueueDeclare};
use crate::effect::Reply;
use crate::ids::{ChannelRef, ConnId};
use crate::mail::Mail;
use crate::message::{FieldTable, Properties};
use crate::{Broker, BrokerConfig};

const CH: ChannelRef = ChannelRef::new(ConnId(1), 1);

fn ops(b: &mut Broker, ch: ChannelRef, ops: Vec<Op>) -> Vec<Effect> {
    for op in ops {
        b.handle(1, ch, op);
    }
    let mut out = Vec::new();
    b.poll_effects(&mut out);
    out
}

/// A broker with queue `q` holding one message, and channel `CH` open.
fn one_message() -> Broker {
    let mut b = Broker::new(BrokerConfig::default());
    let open = Op::ConnectionOpen {
        vhost: "/".into(),
        user: "guest".into(),
        cancel_notify: true,
    };
    ops(&mut b, ChannelRef::new(ConnId(1), 0), vec![open]);
    ops(
        &mut b,
        CH,
        vec![Op::ChannelOpen, declare_op(false), publish_op(b"hello")],
    );
    assert_eq!(b.queue_len("q"), Some(1));
    b
}

/// `one_message`, with mail that waits for `deliver_mail`.
fn scheduled() -> Broker {
    let mut b = one_message();
    b.set_mail_scheduled(true);
    b
}

fn consume(b: &mut Broker) {
    let consume = Consume {
        queue: "q".into(),
        consumer_tag: "c".into(),
        no_local: false,
        no_ack: false,
        exclusive: false,
        nowait: true,
        arguments: FieldTable::new(),
    };
    assert!(b.consume(CH, consume).is_ok());
}

/// Delivers mail until the next one matches `stop`.
fn pump_until(b: &mut Broker, stop: impl Fn(&Mail) -> bool) {
    while !b.mail.front().is_some_and(&stop) {
        let mail = b.mail.pop_front().expect("the awaited mail comes");
        b.deliver_one(mail);
    }
}

/// Closes `CH` (delivering the mail left) and checks that the message is back in its
/// queue with everything it held, and that nothing reached the closed channel.
fn close_and_check(b: &mut Broker) {
    let effects = ops(b, CH, vec![Op::ChannelClose]);
    let close_ok = Effect::Reply {
        ch: CH,
        reply: Reply::ChannelCloseOk,
    };
    assert_eq!(
        effects,
        vec![close_ok],
        "nothing but close-ok reaches the channel"
    );
    assert_eq!(
        b.queue_len("q"),
        Some(1),
        "the message is back in its queue"
    );
    assert_eq!(
        b.chans.conns[&ConnId(1)].in_flight.get(),
        0,
        "its write credit is back"
    );
    assert_eq!(b.stored_bytes(), 5);
    assert_eq!(b.check_invariants(), Ok(()));
}

#[test]
fn a_delivery_to_a_closed_channel_returns_to_its_queue() {
    let mut b = one_message();
    consume(&mut b);
    pump_until(&mut b, |m| matches!(m, Mail::Deliver { .. }));
    close_and_check(&mut b);
}

#[test]
fn a_consumer_taken_for_a_closed_channel_is_cancelled() {
    let mut b = one_message();
    consume(&mut b);
    pump_until(&mut b, |m| matches!(m, Mail::ConsumeOk { .. }));
    close_and_check(&mut b);
    assert!(b.qs.queues.values().all(|q| q.consumers.is_empty()));
}

#[test]
fn a_get_whose_connection_closed_returns_to_its_queue() {
    let mut b = one_message();
    assert!(b.get(CH, "q", false).is_ok());
    pump_until(&mut b, |m| matches!(m, Mail::Got { .. }));
    let effects = ops(
        &mut b,
        ChannelRef::new(ConnId(1), 0),
        vec![Op::ConnectionClose],
    );
    assert_eq!(effects, vec![], "nothing reaches the closed connection");
    assert_eq!(
        b.queue_len("q"),
        Some(1),
        "the message is back in its queue"
    );
    assert_eq!(b.stored_bytes(), 5);
    assert_eq!(b.check_invariants(), Ok(()));
}

/// queue.declare of `q`, durable or not.
fn declare_op(durable: bool) -> Op {
    declare_queue("q", durable, false)
}

fn declare_queue(name: &str, durable: bool, exclusive: bool) -> Op {
    Op::QueueDeclare(QueueDeclare {
        queue: name.into(),
        passive: false,
        durable,
        exclusive,
        auto_delete: false,
        nowait: false,
        arguments: FieldTable::new(),
    })
}

/// queue.delete of `q`.
fn delete_op(if_unused: bool) -> Op {
    Op::QueueDelete {
        queue: "q".into(),
        if_unused,
        if_empty: false,
        nowait: false,
    }
}

/// Opens channel 2 of the connection of `CH`.
fn open_ch2(b: &mut Broker) -> ChannelRef {
    let ch2 = ChannelRef::new(ConnId(1), 2);
    ops(b, ch2, vec![Op::ChannelOpen]);
    ch2
}

/// A publish to queue `q` through the default exchange.
fn publish_op(body: &'static [u8]) -> Op {
    publish_to("q", false, body)
}

/// A publish to queue `queue` through the default exchange.
fn publish_to(queue: &str, mandatory: bool, body: &'static [u8]) -> Op {
    Op::Publish(Box::new(Publish {
        exchange: "".into(),
        routing_key: queue.into(),
        mandatory,
        immediate: false,
        properties: Properties::default(),
        body: bytes::Bytes::from_static(body),
        routed: None,
    }))
}

/// basic.qos with a per-consumer prefetch: an op with a reply and no other effect.
fn qos_op(prefetch_count: u16) -> Op {
    Op::Qos {
        prefetch_size: 0,
        prefetch_count,
        global: false,
    }
}

/// Whether `effects` is exactly one channel error with `code`.
fn channel_error(effects: &[Effect], code: u16) -> bool {
    matches!(effects, [Effect::ChannelError { error, .. }] if error.code.code() == code)
}

fn deliver_all(b: &mut Broker) -> Vec<Effect> {
    while b.deliver_mail(1, 0) {}
    let mut out = Vec::new();
    b.poll_effects(&mut out);
    out
}

fn reply(reply: Reply) -> Effect {
    Effect::Reply { ch: CH, reply }
}

/// With mail that takes time, a channel's later ops wait for its request's answer, so
/// replies keep request order.
#[test]
fn ops_after_a_request_wait_for_its_answer() {
    let mut b = scheduled();
    let get = Op::Get {
        queue: "q".into(),
        no_ack: true,
    };
    let qos = qos_op(5);
    assert_eq!(
        ops(&mut b, CH, vec![get, qos]),
        vec![],
        "qos-ok waits for get-ok"
    );
    let effects = deliver_all(&mut b);
    assert!(
        matches!(effects.as_slice(), [Effect::Reply { reply: Reply::GetOk { .. }, .. }, qos_ok] if *qos_ok == reply(Reply::QosOk)),
        "get-ok, then qos-ok: {effects:?}"
    );
    assert_eq!(b.held_channels(), 0);
    assert_eq!(b.check_invariants(), Ok(()));
}

/// queue.delete goes to the queue and back, and what the channel sends meanwhile waits;
/// `if-unused` is the queue's to check.
#[test]
fn queue_delete_is_answered_by_the_queue() {
    let mut b = scheduled();
    let delete = delete_op;
    consume(&mut b);
    deliver_all(&mut b);
    let qos = qos_op(5);
    assert_eq!(ops(&mut b, CH, vec![delete(true), qos]), vec![]);
    let effects = deliver_all(&mut b);
    assert!(
        channel_error(&effects, 406),
        "the queue refuses: it has a consumer; the qos after it is dropped: {effects:?}"
    );
    let ch2 = open_ch2(&mut b);
    assert_eq!(
        ops(
            &mut b,
            ch2,
            vec![
                delete(false),
                Op::Qos {
                    prefetch_size: 0,
                    prefetch_count: 1,
                    global: false
                }
            ]
        ),
        vec![]
    );
    let effects = deliver_all(&mut b);
    let delete_ok = Effect::Reply {
        ch: ch2,
        // The message went back when the failed channel's delivery was requeued.
        reply: Reply::QueueDeleteOk { message_count: 1 },
    };
    let qos_ok = Effect::Reply {
        ch: ch2,
        reply: Reply::QosOk,
    };
    assert_eq!(effects, vec![delete_ok, qos_ok], "delete-ok, then qos-ok");
    assert_eq!(b.queue_len("q"), None);
    assert_eq!(b.check_invariants(), Ok(()));
}

/// A declare of an existing queue is the queue's to answer (its counts, equivalence),
/// after what the channel sent it before, and ahead of what the channel sends next.
#[test]
fn a_redeclare_is_answered_by_the_queue() {
    let mut b = scheduled();
    let publish = publish_op(b"again");
    let qos = qos_op(5);
    assert_eq!(
        ops(&mut b, CH, vec![publish, declare_op(false), qos]),
        vec![]
    );
    let declare_ok = reply(Reply::QueueDeclareOk {
        queue: "q".into(),
        message_count: 2,
        consumer_count: 0,
    });
    assert_eq!(
        deliver_all(&mut b),
        vec![declare_ok, reply(Reply::QosOk)],
        "the count includes the publish sent before; qos-ok waits"
    );
    ops(&mut b, CH, vec![declare_op(true)]);
    let effects = deliver_all(&mut b);
    assert!(
        channel_error(&effects, 406),
        "the queue finds the redeclare inequivalent: {effects:?}"
    );
    assert_eq!(b.check_invariants(), Ok(()));
}

/// A declare that reaches a queue deleted while it travelled creates the queue anew
/// (topology hears of the deletion first), instead of answering 404 to a declare that
/// would have created it a moment later.
#[test]
fn a_declare_racing_a_delete_creates_the_queue_anew() {
    let mut b = scheduled();
    let ch2 = open_ch2(&mut b);
    deliver_all(&mut b);
    ops(&mut b, ch2, vec![delete_op(false)]);
    ops(&mut b, CH, vec![declare_op(false)]);
    // The delete reaches the queue first; the declare reaches topology before the
    // queue's `QueueGone` does, so topology still sends it to the queue.
    let effects = deliver_all(&mut b);
    let delete_ok = Effect::Reply {
        ch: ch2,
        reply: Reply::QueueDeleteOk { message_count: 1 },
    };
    let declare_ok = reply(Reply::QueueDeclareOk {
        queue: "q".into(),
        message_count: 0,
        consumer_count: 0,
    });
    assert_eq!(effects, vec![delete_ok, declare_ok]);
    assert_eq!(b.queue_len("q"), Some(0), "a new, empty queue");
    assert_eq!(b.check_invariants(), Ok(()));
}

/// A new queue is routable only once its owner created it: a publish that races the
/// declare is unroutable (returned), never routed to a queue that does not exist yet;
/// one after declare-ok reaches it.
#[test]
fn a_new_queue_is_routable_once_it_exists() {
    let mut b = scheduled();
    let declare = declare_queue("n", false, false);
    let ch2 = open_ch2(&mut b);
    deliver_all(&mut b);
    ops(&mut b, CH, vec![declare]);
    // Topology names it and sends `CreateQueue`; the owner has not created it yet.
    assert!(b.deliver_mail(1, 0));
    assert!(matches!(b.mail.front(), Some(Mail::CreateQueue { .. })));
    let publish = |body| publish_to("n", true, body);
    let effects = ops(&mut b, ch2, vec![publish(b"early")]);
    assert!(
        matches!(effects.as_slice(), [Effect::Return { .. }]),
        "not routable before it exists: {effects:?}"
    );
    let effects = deliver_all(&mut b);
    assert_eq!(
        effects,
        vec![reply(Reply::QueueDeclareOk {
            queue: "n".into(),
            message_count: 0,
            consumer_count: 0,
        })]
    );
    ops(&mut b, ch2, vec![publish(b"later")]);
    deliver_all(&mut b);
    assert_eq!(b.queue_len("n"), Some(1));
    assert_eq!(b.check_invariants(), Ok(()));
}

/// An exclusive queue whose connection closed while its creation travelled is not
/// created (it would outlive its owner), and its name is free again.
#[test]
fn an_exclusive_queue_of_a_closed_connection_is_not_created() {
    let mut b = scheduled();
    let declare = declare_queue("x", false, true);
    ops(&mut b, CH, vec![declare]);
    assert!(b.deliver_mail(1, 0));
    assert!(matches!(b.mail.front(), Some(Mail::CreateQueue { .. })));
    ops(
        &mut b,
        ChannelRef::new(ConnId(1), 0),
        vec![Op::ConnectionClose],
    );
    deliver_all(&mut b);
    assert_eq!(b.queue_len("x"), None);
    assert_eq!(b.topo.queue_count(), 1, "only q is left in the directory");
    assert_eq!(b.check_invariants(), Ok(()));
}

/// tx.commit-ok comes once every queue the transaction touched has what it sent.
#[test]
fn commit_ok_waits_for_the_queues() {
    let mut b = scheduled();
    let publish = publish_op(b"in tx");
    let effects = ops(&mut b, CH, vec![Op::TxSelect, publish, Op::TxCommit]);
    assert_eq!(effects, vec![reply(Reply::TxSelectOk)], "commit-ok waits");
    let mut committed = false;
    while b.deliver_mail(1, 0) {
        let mut effects = Vec::new();
        b.poll_effects(&mut effects);
        if effects.contains(&reply(Reply::TxCommitOk)) {
            assert_eq!(b.queue_len("q"), Some(2), "the queue has the message");
            committed = true;
        }
    }
    assert!(committed, "commit-ok came");
    assert_eq!(b.check_invariants(), Ok(()));
}

/// What a channel may pipeline behind an unanswered request is bounded: past
/// `MAX_HELD_OPS` the connection is closed with 506, and nothing stays held.
#[test]
fn a_channel_holds_a_bounded_number_of_ops() {
    let mut b = scheduled();
    let get = Op::Get {
        queue: "q".into(),
        no_ack: false,
    };
    assert_eq!(ops(&mut b, CH, vec![get]), vec![]);
    let qos = qos_op(1);
    for _ in 0..crate::channel::hold::MAX_HELD_OPS {
        b.handle(1, CH, qos.clone());
    }
    let mut effects = Vec::new();
    b.poll_effects(&mut effects);
    assert_eq!(effects, vec![], "up to the bound, ops wait");
    let effects = ops(&mut b, CH, vec![qos]);
    assert!(
        matches!(effects.as_slice(), [Effect::ConnectionError { error, .. }] if error.code.code() == 506),
        "one more closes the connection: {effects:?}"
    );
    assert_eq!(b.held_channels(), 0);
    assert_eq!(
        deliver_all(&mut b),
        vec![],
        "the get's answer finds no channel"
    );
    assert_eq!(
        b.queue_len("q"),
        Some(1),
        "the message is back in its queue"
    );
    assert_eq!(b.check_invariants(), Ok(()));
}

/// A delivery that travelled while its channel closed and the client opened the same
/// channel number again goes back to its queue, and takes nothing of the new opening.
#[test]
fn a_delivery_for_a_reopened_channel_returns_to_its_queue() {
    let mut b = scheduled();
    consume(&mut b);
    // Consume, then consume-ok and the delivery, in that order.
    assert!(b.deliver_mail(1, 0));
    assert!(b.deliver_mail(1, 0));
    assert!(matches!(b.mail.front(), Some(Mail::Deliver { .. })));
    let effects = ops(&mut b, CH, vec![Op::ChannelClose, Op::ChannelOpen]);
    assert_eq!(
        effects,
        vec![reply(Reply::ChannelCloseOk), reply(Reply::ChannelOpenOk)]
    );
    assert_eq!(deliver_all(&mut b), vec![], "the new opening gets nothing");
    assert_eq!(
        b.queue_len("q"),
        Some(1),
        "the message is back in its queue"
    );
    assert_eq!(b.chans.channels[&CH].consumer_unacked.get(), 0);
    assert_eq!(b.chans.conns[&ConnId(1)].in_flight.get(), 0);
    assert_eq!(b.check_invariants(), Ok(()));
}

/// A queue's answer to a publish of a closed opening of the channel does not confirm the
/// publish with the same number on the new opening.
#[test]
fn an_answer_for_a_closed_opening_confirms_nothing() {
    let mut b = scheduled();
    let select = Op::ConfirmSelect { nowait: true };
    let publish = || publish_op(b"again");
    ops(&mut b, CH, vec![select.clone(), publish()]);
    // The queue takes the old publish; its answer travels.
    assert!(b.deliver_mail(1, 0));
    assert!(matches!(b.mail.front(), Some(Mail::Answered { .. })));
    ops(
        &mut b,
        CH,
        vec![Op::ChannelClose, Op::ChannelOpen, select, publish()],
    );
    // Deliver the old answer only (mail to the connection, ahead of the new enqueue).
    assert!(b.deliver_mail(1, 0));
    let mut effects = Vec::new();
    b.poll_effects(&mut effects);
    assert!(
        !effects.iter().any(|e| matches!(e, Effect::Confirm { .. })),
        "publish 1 of the new opening is not confirmed before its queue answered: {effects:?}"
    );
    let effects = deliver_all(&mut b);
    assert_eq!(
        effects
            .iter()
            .filter(|e| matches!(e, Effect::Confirm { .. }))
            .count(),
        1,
        "the new publish is confirmed once its queue answered: {effects:?}"
    );
    assert_eq!(b.check_invariants(), Ok(()));
}
