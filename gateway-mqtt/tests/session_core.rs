//! The sans-IO session driven against an in-process core broker, no sockets: persistent
//! sessions, QoS 2 state, topic aliases.

use bytes::Bytes;
use mqtt_proto::v5::{self, Packet};
use mqtt_proto::{Pid, Protocol, QoS, QosPid, TopicFilter, TopicName};
use std::sync::Arc;
use warren_core::Broker;
use warren_core::ids::{ChannelRef, ConnId};
use warren_mqtt::session::{ConnectInfo, Session, check_connect};

struct World {
    broker: Broker,
    config: Arc<warren_mqtt::MqttConfig>,
    now: u64,
}

impl World {
    fn new() -> World {
        World {
            broker: Broker::new(Default::default()),
            config: Arc::new(Default::default()),
            now: 1_000,
        }
    }

    fn info(&self, id: &str, level: u8, clean: bool) -> ConnectInfo {
        let protocol = if level == 5 {
            Protocol::V500
        } else {
            Protocol::V311
        };
        let mut c = v5::Connect::new(Arc::from(id), 30);
        c.protocol = protocol;
        c.clean_start = clean;
        c.properties.session_expiry_interval = Some(if clean { 0 } else { u32::MAX });
        check_connect(&c, true, &self.config, || "gen".into()).expect("accepted")
    }

    /// Applies the session's ops to the core and feeds the effects back until quiet.
    fn pump(&mut self, conn: u64, s: &mut Session) -> Vec<Packet> {
        let mut packets = Vec::new();
        loop {
            let ops = s.take_ops();
            packets.extend(
                s.take_packets()
                    .into_iter()
                    .map(|o| o.packet)
                    .collect::<Vec<_>>(),
            );
            if ops.is_empty() {
                return packets;
            }
            for (ch, op) in ops {
                self.broker
                    .handle(self.now, ChannelRef::new(ConnId(conn), ch), op);
            }
            let mut effects = Vec::new();
            self.broker.poll_effects(&mut effects);
            for e in effects {
                assert_eq!(
                    e.conn(),
                    ConnId(conn),
                    "effect for another connection: {e:?}"
                );
                s.handle_effect(self.now, e).expect("no error");
            }
            s.flushed();
            packets.extend(
                s.take_packets()
                    .into_iter()
                    .map(|o| o.packet)
                    .collect::<Vec<_>>(),
            );
        }
    }

    /// Routes effects to two sessions.
    fn pump2(
        &mut self,
        a: (u64, &mut Session),
        b: (u64, &mut Session),
    ) -> (Vec<Packet>, Vec<Packet>) {
        let (ca, sa) = a;
        let (cb, sb) = b;
        let mut pa = Vec::new();
        let mut pb = Vec::new();
        loop {
            let mut ops: Vec<(u64, u16, warren_core::command::Op)> = Vec::new();
            ops.extend(sa.take_ops().into_iter().map(|(c, o)| (ca, c, o)));
            ops.extend(sb.take_ops().into_iter().map(|(c, o)| (cb, c, o)));
            pa.extend(
                sa.take_packets()
                    .into_iter()
                    .map(|o| o.packet)
                    .collect::<Vec<_>>(),
            );
            pb.extend(
                sb.take_packets()
                    .into_iter()
                    .map(|o| o.packet)
                    .collect::<Vec<_>>(),
            );
            if ops.is_empty() {
                return (pa, pb);
            }
            for (conn, ch, op) in ops {
                self.broker
                    .handle(self.now, ChannelRef::new(ConnId(conn), ch), op);
            }
            let mut effects = Vec::new();
            self.broker.poll_effects(&mut effects);
            for e in effects {
                let target = if e.conn() == ConnId(ca) {
                    &mut *sa
                } else {
                    &mut *sb
                };
                target.handle_effect(self.now, e).expect("no error");
            }
            sa.flushed();
            sb.flushed();
        }
    }
}

fn subscribe(pid: u16, filter: &str, qos: QoS) -> Packet {
    Packet::Subscribe(v5::Subscribe::new(
        Pid::try_from(pid).expect("pid"),
        vec![(
            TopicFilter::try_from(filter).expect("filter"),
            v5::SubscriptionOptions {
                max_qos: qos,
                no_local: false,
                retain_as_published: false,
                retain_handling: v5::RetainHandling::SendAtSubscribe,
            },
        )],
    ))
}

fn publish(topic: &str, qos_pid: QosPid, payload: &str) -> Packet {
    Packet::Publish(v5::Publish::new(
        qos_pid,
        TopicName::try_from(topic).expect("topic"),
        Bytes::copy_from_slice(payload.as_bytes()),
    ))
}

fn pid(n: u16) -> Pid {
    Pid::try_from(n).expect("pid")
}

fn payloads(packets: &[Packet]) -> Vec<(String, bool)> {
    packets
        .iter()
        .filter_map(|p| match p {
            Packet::Publish(p) => Some((String::from_utf8_lossy(&p.payload).into_owned(), p.dup)),
            _ => None,
        })
        .collect()
}

#[test]
fn persistent_session_queues_while_offline_and_resends_unacked_with_dup() {
    let mut w = World::new();
    let cfg = w.config.clone();
    let mut keeper = Session::new(w.info("keeper", 4, false), None, w.now, cfg.clone());
    w.pump(1, &mut keeper);
    keeper
        .handle_packet(w.now, subscribe(1, "p/#", QoS::Level1))
        .expect("subscribe");
    w.pump(1, &mut keeper);
    let mut publisher = Session::new(w.info("pub", 4, true), None, w.now, cfg.clone());
    w.pump(2, &mut publisher);
    // One message reaches the keeper but is never acked.
    publisher
        .handle_packet(w.now, publish("p/x", QosPid::Level1(pid(1)), "a"))
        .expect("publish");
    let (got, _) = w.pump2((1, &mut keeper), (2, &mut publisher));
    assert_eq!(payloads(&got), [("a".to_string(), false)]);
    keeper
        .handle_packet(w.now, Packet::Disconnect(v5::Disconnect::new_normal()))
        .expect("disconnect");
    let record = keeper.close(w.now).expect("persistent");
    w.pump(1, &mut keeper);
    w.broker.handle(
        w.now,
        ChannelRef::new(ConnId(1), 0),
        warren_core::command::Op::ConnectionClose,
    );
    let mut effects = Vec::new();
    w.broker.poll_effects(&mut effects);
    assert!(effects.is_empty(), "{effects:?}");
    // Offline: two more.
    for (i, m) in ["b", "c"].into_iter().enumerate() {
        publisher
            .handle_packet(w.now, publish("p/y", QosPid::Level1(pid(2 + i as u16)), m))
            .expect("publish");
    }
    let acks = w.pump(2, &mut publisher);
    assert_eq!(acks.len(), 2, "{acks:?}");
    assert_eq!(w.broker.queue_len("mqtt-subscription-keeperqos1"), Some(3));

    let mut back = Session::new(w.info("keeper", 4, false), Some(record), w.now, cfg);
    let got = w.pump(3, &mut back);
    assert!(
        matches!(&got[0], Packet::Connack(c) if c.session_present),
        "{got:?}"
    );
    assert_eq!(
        payloads(&got),
        [
            ("a".to_string(), true),
            ("b".to_string(), false),
            ("c".to_string(), false)
        ]
    );
}

#[test]
fn expired_session_starts_clean_and_drops_its_queue() {
    let mut w = World::new();
    let cfg = w.config.clone();
    let mut info = w.info("brief", 5, false);
    info.session_expiry_s = 2;
    let mut s = Session::new(info.clone(), None, w.now, cfg.clone());
    w.pump(1, &mut s);
    s.handle_packet(w.now, subscribe(1, "e/#", QoS::Level1))
        .expect("subscribe");
    w.pump(1, &mut s);
    let record = s.close(w.now).expect("persistent");
    w.pump(1, &mut s);
    w.broker.handle(
        w.now,
        ChannelRef::new(ConnId(1), 0),
        warren_core::command::Op::ConnectionClose,
    );
    assert!(!record.expired(w.now + 1_999));
    assert!(record.expired(w.now + 2_000));
    w.now += 2_000;
    let mut back = Session::new(info, Some(record), w.now, cfg);
    let got = w.pump(2, &mut back);
    assert!(
        matches!(&got[0], Packet::Connack(c) if !c.session_present),
        "{got:?}"
    );
    assert_eq!(w.broker.queue_len("mqtt-subscription-briefqos1"), None);
}

fn kinds(packets: &[Packet]) -> Vec<String> {
    packets
        .iter()
        .map(|p| match p {
            Packet::Publish(p) => format!("publish {:?} dup={}", p.qos_pid, p.dup),
            Packet::Pubrec(r) => format!("pubrec {} {:?}", r.pid.value(), r.reason_code),
            Packet::Pubrel(r) => format!("pubrel {} {:?}", r.pid.value(), r.reason_code),
            Packet::Pubcomp(r) => format!("pubcomp {} {:?}", r.pid.value(), r.reason_code),
            Packet::Puback(r) => format!("puback {} {:?}", r.pid.value(), r.reason_code),
            other => format!("{:?}", other.get_type()),
        })
        .collect()
}

#[test]
fn exactly_once_inbound_and_outbound() {
    let mut w = World::new();
    let cfg = w.config.clone();
    let mut sub = Session::new(w.info("sub", 5, true), None, w.now, cfg.clone());
    w.pump(1, &mut sub);
    sub.handle_packet(w.now, subscribe(1, "q2/#", QoS::Level2))
        .expect("subscribe");
    w.pump(1, &mut sub);
    let mut publisher = Session::new(w.info("pub", 5, true), None, w.now, cfg);
    w.pump(2, &mut publisher);

    // The same QoS 2 packet id twice before PUBREL: routed once, PUBREC twice.
    for _ in 0..2 {
        publisher
            .handle_packet(w.now, publish("q2/a", QosPid::Level2(pid(9)), "once"))
            .expect("publish");
    }
    let (got, acks) = w.pump2((1, &mut sub), (2, &mut publisher));
    assert_eq!(payloads(&got), [("once".to_string(), false)]);
    assert_eq!(kinds(&acks), ["pubrec 9 Success", "pubrec 9 Success"]);
    publisher
        .handle_packet(w.now, Packet::Pubrel(v5::Pubrel::new_success(pid(9))))
        .expect("pubrel");
    publisher
        .handle_packet(w.now, Packet::Pubrel(v5::Pubrel::new_success(pid(9))))
        .expect("pubrel again");
    assert_eq!(
        kinds(
            &publisher
                .take_packets()
                .into_iter()
                .map(|o| o.packet)
                .collect::<Vec<_>>()
        ),
        ["pubcomp 9 Success", "pubcomp 9 PacketIdentifierNotFound"]
    );
    // After PUBREL the id is free again: a new message under it is routed.
    publisher
        .handle_packet(w.now, publish("q2/a", QosPid::Level2(pid(9)), "twice"))
        .expect("publish");
    let (got, _) = w.pump2((1, &mut sub), (2, &mut publisher));
    assert_eq!(payloads(&got), [("twice".to_string(), false)]);

    // Outbound: PUBREC acks the core and sends PUBREL; PUBCOMP frees the id.
    let Packet::Publish(p) = &got[0] else {
        panic!("{got:?}")
    };
    let out_pid = p.qos_pid.pid().expect("QoS 2 has a packet id");
    sub.handle_packet(w.now, Packet::Pubrec(v5::Pubrec::new_success(out_pid)))
        .expect("pubrec");
    let ops = sub.take_ops();
    assert!(
        matches!(ops[..], [(_, warren_core::command::Op::Ack { .. })]),
        "{ops:?}"
    );
    assert_eq!(
        kinds(
            &sub.take_packets()
                .into_iter()
                .map(|o| o.packet)
                .collect::<Vec<_>>()
        ),
        [format!("pubrel {} Success", out_pid.value())]
    );
    sub.handle_packet(w.now, Packet::Pubcomp(v5::Pubcomp::new_success(out_pid)))
        .expect("pubcomp");
    assert!(sub.take_packets().is_empty());
}

#[test]
fn receive_maximum_exceeded_closes_with_0x93() {
    let mut w = World::new();
    let cfg = Arc::new(warren_mqtt::MqttConfig {
        max_inflight: 2,
        ..Default::default()
    });
    w.config = cfg.clone();
    let mut s = Session::new(w.info("greedy", 5, true), None, w.now, cfg);
    for n in 1..=2 {
        s.handle_packet(w.now, publish("g", QosPid::Level1(pid(n)), "x"))
            .expect("within the limit");
    }
    let err = s
        .handle_packet(w.now, publish("g", QosPid::Level1(pid(3)), "x"))
        .expect_err("over the limit");
    assert_eq!(err.reason, v5::DisconnectReasonCode::ReceiveMaximumExceeded);
}

#[test]
fn payload_announced_as_utf8_must_be() {
    let w = World::new();
    let cfg = w.config.clone();
    let mut s = Session::new(w.info("fmt", 5, true), None, w.now, cfg);
    s.take_packets();
    let bad = |qos_pid| {
        let mut p = v5::Publish::new(
            qos_pid,
            TopicName::try_from("f").expect("topic"),
            Bytes::from_static(b"\xff\xfe"),
        );
        p.properties.payload_is_utf8 = Some(true);
        Packet::Publish(p)
    };
    s.handle_packet(w.now, bad(QosPid::Level1(pid(1))))
        .expect("answered");
    s.handle_packet(w.now, bad(QosPid::Level2(pid(2))))
        .expect("answered");
    assert_eq!(
        kinds(
            &s.take_packets()
                .into_iter()
                .map(|o| o.packet)
                .collect::<Vec<_>>()
        ),
        [
            "puback 1 PayloadFormatInvalid",
            "pubrec 2 PayloadFormatInvalid"
        ]
    );
    assert!(
        s.take_ops()
            .iter()
            .all(|(_, op)| !matches!(op, warren_core::command::Op::Publish(_)))
    );
    let err = s
        .handle_packet(w.now, bad(QosPid::Level0))
        .expect_err("QoS 0 has no ack to refuse it with");
    assert_eq!(err.reason, v5::DisconnectReasonCode::PayloadFormatInvalid);
}

#[test]
fn suback_waits_for_its_bindings_and_what_follows_waits_with_it() {
    // Other connections route on the broker's published table, which holds a bind only once
    // the broker applied it: a SUBACK written when the binds were merely sent would let a
    // client's peer publish into a table without the subscription.
    let mut w = World::new();
    let cfg = w.config.clone();
    let mut s = Session::new(w.info("sub", 4, true), None, w.now, cfg);
    w.pump(1, &mut s);
    s.handle_packet(w.now, subscribe(1, "s/#", QoS::Level1))
        .expect("subscribe");
    s.handle_packet(w.now, Packet::Pingreq).expect("ping");
    let ops = s.take_ops();
    let binds: Vec<bool> = ops
        .iter()
        .filter_map(|(_, op)| match op {
            warren_core::command::Op::QueueBind(b) => Some(b.nowait),
            _ => None,
        })
        .collect();
    assert_eq!(binds, [false], "the bind asks for a bind-ok");
    assert!(s.take_packets().is_empty(), "SUBACK and PINGRESP wait");
    for (ch, op) in ops {
        w.broker.handle(w.now, ChannelRef::new(ConnId(1), ch), op);
    }
    let mut effects = Vec::new();
    w.broker.poll_effects(&mut effects);
    for e in effects {
        s.handle_effect(w.now, e).expect("no error");
    }
    assert_eq!(
        kinds(
            &s.take_packets()
                .into_iter()
                .map(|o| o.packet)
                .collect::<Vec<_>>()
        ),
        ["Suback", "Pingresp"]
    );

    // A SUBACK with nothing to bind (the filter is already bound) leaves at once.
    s.handle_packet(w.now, subscribe(2, "s/#", QoS::Level1))
        .expect("subscribe");
    // Only the retained messages are asked for (Retain Handling 0 sends them again).
    assert!(matches!(
        s.take_ops().as_slice(),
        [(_, warren_core::command::Op::RetainedGet { .. })]
    ));
    assert_eq!(
        kinds(
            &s.take_packets()
                .into_iter()
                .map(|o| o.packet)
                .collect::<Vec<_>>()
        ),
        ["Suback"]
    );
}

fn subscribe_with(
    pid: u16,
    filter: &str,
    qos: QoS,
    handling: v5::RetainHandling,
    rap: bool,
) -> Packet {
    Packet::Subscribe(v5::Subscribe::new(
        Pid::try_from(pid).expect("pid"),
        vec![(
            TopicFilter::try_from(filter).expect("filter"),
            v5::SubscriptionOptions {
                max_qos: qos,
                no_local: false,
                retain_as_published: rap,
                retain_handling: handling,
            },
        )],
    ))
}

fn retained_publish(topic: &str, qos_pid: QosPid, payload: &str) -> Packet {
    let mut p = v5::Publish::new(
        qos_pid,
        TopicName::try_from(topic).expect("topic"),
        Bytes::copy_from_slice(payload.as_bytes()),
    );
    p.retain = true;
    Packet::Publish(p)
}

/// Retained messages live in the core: a session's retained publish is stored there
/// (`Op::Retain`) before its PUBACK, and a later session's SUBSCRIBE gets it after the SUBACK
/// with the retain flag, at the lower QoS, per Retain Handling (0 always, 1 only for a new
/// subscription, 2 never); an empty retained payload clears the topic.
#[test]
fn retained_messages_come_from_the_core_after_the_suback() {
    let mut w = World::new();
    let cfg = w.config.clone();
    let mut publisher = Session::new(w.info("pub", 5, true), None, w.now, cfg.clone());
    w.pump(1, &mut publisher);
    publisher
        .handle_packet(w.now, retained_publish("r/a", QosPid::Level1(pid(1)), "A"))
        .expect("publish");
    publisher
        .handle_packet(w.now, retained_publish("r/b", QosPid::Level0, "B"))
        .expect("publish");
    let acks = kinds(&w.pump(1, &mut publisher));
    assert_eq!(acks, ["puback 1 Success"]);
    assert_eq!(w.broker.retained_stats(), [("/".to_string(), 2, 2)]);

    let mut sub = Session::new(w.info("sub", 5, true), None, w.now, cfg.clone());
    w.pump(2, &mut sub);
    sub.handle_packet(w.now, subscribe(1, "r/#", QoS::Level0))
        .expect("subscribe");
    let got = w.pump(2, &mut sub);
    assert_eq!(
        kinds(&got),
        [
            "Suback",
            "publish Level0 dup=false",
            "publish Level0 dup=false"
        ]
    );
    for p in &got[1..] {
        let Packet::Publish(p) = p else {
            unreachable!()
        };
        assert!(p.retain, "sent because of a new subscription: retain set");
        assert_eq!(p.qos_pid, QosPid::Level0, "the lower QoS");
    }
    assert_eq!(payloads(&got), [("A".into(), false), ("B".into(), false)]);
    // Retain Handling 1: the subscription exists, nothing is sent; 2: never.
    sub.handle_packet(
        w.now,
        subscribe_with(
            2,
            "r/#",
            QoS::Level0,
            v5::RetainHandling::SendAtSubscribeIfNotExist,
            false,
        ),
    )
    .expect("subscribe");
    assert_eq!(kinds(&w.pump(2, &mut sub)), ["Suback"]);
    sub.handle_packet(
        w.now,
        subscribe_with(3, "r/a", QoS::Level0, v5::RetainHandling::DoNotSend, false),
    )
    .expect("subscribe");
    assert_eq!(kinds(&w.pump(2, &mut sub)), ["Suback"]);
    // Cleared by an empty retained payload.
    publisher
        .handle_packet(w.now, retained_publish("r/a", QosPid::Level0, ""))
        .expect("clear");
    w.pump2((1, &mut publisher), (2, &mut sub));
    let mut late = Session::new(w.info("late", 5, true), None, w.now, cfg);
    w.pump(3, &mut late);
    late.handle_packet(w.now, subscribe(1, "r/+", QoS::Level1))
        .expect("subscribe");
    let got = w.pump(3, &mut late);
    assert_eq!(kinds(&got), ["Suback", "publish Level0 dup=false"]);
    assert_eq!(payloads(&got), [("B".into(), false)]);
}

/// Acks of QoS 0 deliveries reach the core as one multiple ack per batch of ops, and never
/// cover a QoS 1 delivery still in flight (a multiple ack would have acknowledged it before
/// its PUBACK: lost if the connection then dropped).
#[test]
fn qos0_acks_merge_but_never_cover_a_held_delivery() {
    use warren_core::command::Op;
    let mut w = World::new();
    let cfg = w.config.clone();
    let mut sub = Session::new(w.info("merging", 4, true), None, w.now, cfg.clone());
    w.pump(1, &mut sub);
    sub.handle_packet(w.now, subscribe(1, "m/#", QoS::Level1))
        .expect("subscribe");
    w.pump(1, &mut sub);
    let mut publisher = Session::new(w.info("pub", 4, true), None, w.now, cfg.clone());
    w.pump(2, &mut publisher);
    let unacked = |w: &World| -> u64 {
        w.broker
            .list_queues()
            .iter()
            .map(|q| q.messages_unacked)
            .sum()
    };
    // Three QoS 0 messages, nothing held: one multiple ack for the three.
    for body in ["a", "b", "c"] {
        publisher
            .handle_packet(w.now, publish("m/x", QosPid::Level0, body))
            .expect("publish");
    }
    for (ch, op) in publisher.take_ops() {
        w.broker.handle(w.now, ChannelRef::new(ConnId(2), ch), op);
    }
    let mut effects = Vec::new();
    w.broker.poll_effects(&mut effects);
    for e in effects {
        let to = if e.conn() == ConnId(1) {
            &mut sub
        } else {
            &mut publisher
        };
        to.handle_effect(w.now, e).expect("no error");
    }
    let acks: Vec<Op> = sub
        .take_ops()
        .into_iter()
        .map(|(_, op)| op)
        .filter(|op| matches!(op, Op::Ack { .. }))
        .collect();
    assert!(
        matches!(acks[..], [Op::Ack { multiple: true, .. }]),
        "{acks:?}"
    );
    for (ch, op) in acks.into_iter().map(|op| (1u16, op)) {
        w.broker.handle(w.now, ChannelRef::new(ConnId(1), ch), op);
    }
    w.pump2((1, &mut sub), (2, &mut publisher));
    assert_eq!(unacked(&w), 0);

    // A QoS 1 message in flight, then QoS 0 ones: those are acked, it is not.
    publisher
        .handle_packet(w.now, publish("m/x", QosPid::Level1(pid(1)), "held"))
        .expect("publish");
    for body in ["d", "e"] {
        publisher
            .handle_packet(w.now, publish("m/x", QosPid::Level0, body))
            .expect("publish");
    }
    let (got, _) = w.pump2((1, &mut sub), (2, &mut publisher));
    assert_eq!(
        payloads(&got),
        [
            ("held".to_string(), false),
            ("d".to_string(), false),
            ("e".to_string(), false)
        ]
    );
    assert_eq!(unacked(&w), 1, "the QoS 1 message waits for its PUBACK");
    let Packet::Publish(p) = &got[0] else {
        panic!("{got:?}")
    };
    let out_pid = p.qos_pid.pid().expect("QoS 1 has a packet id");
    sub.handle_packet(w.now, Packet::Puback(v5::Puback::new_success(out_pid)))
        .expect("puback");
    w.pump2((1, &mut sub), (2, &mut publisher));
    assert_eq!(unacked(&w), 0);
}

/// Applies `publisher`'s ops (connection 2) and hands every effect to its session, without
/// ever telling the core that `sub`'s deliveries (connection 1) were written: a subscriber
/// whose socket does not drain. Returns the packets `sub` and `publisher` got.
fn publish_to_stalled(
    w: &mut World,
    publisher: &mut Session,
    sub: &mut Session,
) -> (Vec<Packet>, Vec<Packet>) {
    let mut to_publisher = Vec::new();
    loop {
        let ops = publisher.take_ops();
        to_publisher.extend(publisher.take_packets().into_iter().map(|o| o.packet));
        if ops.is_empty() {
            let to_sub = sub.take_packets().into_iter().map(|o| o.packet).collect();
            return (to_sub, to_publisher);
        }
        for (ch, op) in ops {
            w.broker.handle(w.now, ChannelRef::new(ConnId(2), ch), op);
        }
        let mut effects = Vec::new();
        w.broker.poll_effects(&mut effects);
        for e in effects {
            let s = if e.conn() == ConnId(1) {
                &mut *sub
            } else {
                &mut *publisher
            };
            s.handle_effect(w.now, e).expect("no error");
        }
        publisher.flushed();
    }
}

#[test]
fn a_clean_qos0_subscriber_is_served_straight_and_its_backlog_is_bounded() {
    let mut w = World::new();
    w.broker = Broker::new(warren_core::BrokerConfig {
        write_window: 4,
        flow_ready_high: 2,
        ..Default::default()
    });
    let cfg = w.config.clone();
    let mut sub = Session::new(w.info("zero", 4, true), None, w.now, cfg.clone());
    sub.handle_packet(w.now, subscribe(1, "t/#", QoS::Level0))
        .expect("subscribe");
    w.pump(1, &mut sub);
    assert_eq!(w.broker.queue_len("mqtt-subscription-zeroqos0"), Some(0));
    assert_eq!(w.broker.queue_len("mqtt-subscription-zeroqos1"), None);
    let mut publisher = Session::new(w.info("pub", 4, true), None, w.now, cfg);
    w.pump(2, &mut publisher);
    for i in 0..10 {
        // QoS 1 publishes too: a QoS 0 subscription gets them at QoS 0.
        let qos = if i % 2 == 0 {
            QosPid::Level0
        } else {
            QosPid::Level1(pid(i))
        };
        publisher
            .handle_packet(w.now, publish("t/x", qos, &format!("m{i}")))
            .expect("publish");
    }
    let (got, acks) = publish_to_stalled(&mut w, &mut publisher, &mut sub);
    // The write window (4) went out at once; four wait (twice the flow-control mark) and
    // the publisher is paused; the two beyond were dropped, not kept.
    assert_eq!(
        payloads(&got),
        ["m0", "m1", "m2", "m3"].map(|m| (m.to_string(), false))
    );
    assert_eq!(w.broker.queue_len("mqtt-subscription-zeroqos0"), Some(4));
    assert_eq!(w.broker.qos0_dropped(), 2);
    assert!(publisher.read_paused());
    // The QoS 1 publishes were confirmed all the same, dropped or not.
    let pubacks = acks
        .iter()
        .filter(|p| matches!(p, Packet::Puback(_)))
        .count();
    assert_eq!(pubacks, 5, "{acks:?}");
    // Once written, the window opens again: what waited goes out, the publisher goes on.
    sub.flushed();
    for (ch, op) in sub.take_ops() {
        w.broker.handle(w.now, ChannelRef::new(ConnId(1), ch), op);
    }
    let mut effects = Vec::new();
    w.broker.poll_effects(&mut effects);
    for e in effects {
        let s = if e.conn() == ConnId(1) {
            &mut sub
        } else {
            &mut publisher
        };
        s.handle_effect(w.now, e).expect("no error");
    }
    let got: Vec<Packet> = sub.take_packets().into_iter().map(|o| o.packet).collect();
    assert_eq!(
        payloads(&got),
        ["m4", "m5", "m6", "m7"].map(|m| (m.to_string(), false))
    );
    assert!(!publisher.read_paused());
    assert_eq!(w.broker.queue_len("mqtt-subscription-zeroqos0"), Some(0));
}

#[test]
fn a_qos1_subscription_moves_a_clean_session_to_a_classic_queue_keeping_its_filters() {
    let mut w = World::new();
    let cfg = w.config.clone();
    let mut sub = Session::new(w.info("mover", 5, true), None, w.now, cfg.clone());
    sub.handle_packet(w.now, subscribe(1, "a/#", QoS::Level0))
        .expect("subscribe");
    w.pump(1, &mut sub);
    assert_eq!(w.broker.queue_len("mqtt-subscription-moverqos0"), Some(0));
    sub.handle_packet(w.now, subscribe(2, "b/#", QoS::Level1))
        .expect("subscribe");
    let got = w.pump(1, &mut sub);
    assert!(
        got.iter().any(|p| matches!(p, Packet::Suback(_))),
        "{got:?}"
    );
    assert_eq!(w.broker.queue_len("mqtt-subscription-moverqos0"), None);
    assert_eq!(w.broker.queue_len("mqtt-subscription-moverqos1"), Some(0));
    let mut publisher = Session::new(w.info("pub2", 5, true), None, w.now, cfg);
    w.pump(2, &mut publisher);
    publisher
        .handle_packet(w.now, publish("a/x", QosPid::Level1(pid(1)), "to-a"))
        .expect("publish");
    publisher
        .handle_packet(w.now, publish("b/y", QosPid::Level1(pid(2)), "to-b"))
        .expect("publish");
    let (got, acks) = w.pump2((1, &mut sub), (2, &mut publisher));
    let qos: Vec<(String, QoS)> = got
        .iter()
        .filter_map(|p| match p {
            Packet::Publish(p) => Some((
                String::from_utf8_lossy(&p.payload).into_owned(),
                p.qos_pid.qos(),
            )),
            _ => None,
        })
        .collect();
    // The QoS 0 filter still matches, now through the classic queue, once per message.
    assert_eq!(
        qos,
        [
            ("to-a".to_string(), QoS::Level0),
            ("to-b".to_string(), QoS::Level1)
        ]
    );
    assert_eq!(acks.len(), 2, "{acks:?}");
}
