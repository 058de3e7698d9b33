//! The sans-IO connection driven by frames a client would send (built with the codec, from
//! the spec's layout), checking what comes back: the handshake, limits, and each error on
//! its scope (link, session, connection) with the spec's condition.

use bytes::{Bytes, BytesMut};
use warren_amqp10::frame::{self, AMQP_HEADER, Body, SASL_HEADER, decode_frame};
use warren_amqp10::performatives::{
    Attach, Begin, DeliveryState, Error, Open, Performative, Role, Sasl, Source, Target, Transfer,
    condition,
};
use warren_amqp10::sasl::Login;
use warren_amqp10::session::{Config, Connection, Ended, Event};
use warren_amqp10::types::Value;

struct Client {
    conn: Connection,
    now: u64,
}

impl Client {
    fn new(config: Config) -> Self {
        Client {
            conn: Connection::new(config, None, 0),
            now: 0,
        }
    }
    fn raw(&mut self, bytes: &[u8]) {
        let mut input = BytesMut::from(bytes);
        self.conn.handle_input(self.now, &mut input);
    }
    fn send(&mut self, channel: u16, p: Performative, payload: &[u8]) {
        let mut out = BytesMut::new();
        let _ = frame::encode_frame(&mut out, channel, &p, payload);
        self.raw(&out);
    }
    fn sasl(&mut self, s: Sasl) {
        let mut out = BytesMut::new();
        let _ = frame::encode_sasl(&mut out, &s);
        self.raw(&out);
    }
    /// The frames the server sent since the last call (headers stripped by the caller).
    fn frames(&mut self) -> Vec<(u16, Body)> {
        let mut out = self.conn.take_output();
        let mut frames = Vec::new();
        while out.starts_with(b"AMQP") {
            let _ = out.split_to(8);
        }
        while let Some(raw) = decode_frame(&mut out, u32::MAX).expect("server frames decode") {
            frames.push((raw.channel, raw.body().expect("server body decodes")));
            while out.starts_with(b"AMQP") {
                let _ = out.split_to(8);
            }
        }
        frames
    }
    fn open(&mut self) {
        self.raw(&AMQP_HEADER);
        self.send(
            0,
            Performative::Open(Box::new(Open {
                container_id: "client".into(),
                hostname: Some("vhost:/".into()),
                max_frame_size: 4096,
                channel_max: 10,
                idle_time_out: Some(10_000),
                outgoing_locales: vec![],
                incoming_locales: vec![],
                offered_capabilities: vec![],
                desired_capabilities: vec![],
                properties: None,
            })),
            &[],
        );
    }
    fn begin(&mut self, channel: u16) {
        self.send(
            channel,
            Performative::Begin(Begin {
                remote_channel: None,
                next_outgoing_id: 0,
                incoming_window: 100,
                outgoing_window: 100,
                handle_max: u32::MAX,
                offered_capabilities: vec![],
                desired_capabilities: vec![],
                properties: None,
            }),
            &[],
        );
    }
    fn attach_sender(&mut self, channel: u16, handle: u32, address: &str) {
        self.send(
            channel,
            Performative::Attach(Box::new(Attach {
                name: format!("sender-{handle}"),
                handle,
                role: Role::Sender,
                snd_settle_mode: 2,
                rcv_settle_mode: 0,
                source: Some(Source::default()),
                target: Some(Target {
                    address: Some(address.into()),
                    ..Target::default()
                }),
                unsettled: None,
                incomplete_unsettled: false,
                initial_delivery_count: Some(0),
                max_message_size: None,
                offered_capabilities: vec![],
                desired_capabilities: vec![],
                properties: None,
            })),
            &[],
        );
    }
    fn transfer(&mut self, channel: u16, handle: u32, id: Option<u32>, more: bool, data: &[u8]) {
        self.send(
            channel,
            Performative::Transfer(Transfer {
                handle,
                delivery_id: id,
                delivery_tag: id.map(|i| Bytes::from(i.to_be_bytes().to_vec())),
                message_format: id.map(|_| 0),
                settled: id.map(|_| false),
                more,
                ..Transfer::default()
            }),
            data,
        );
    }
}

fn condition_of(e: &Option<Error>) -> &str {
    e.as_ref().map_or("", |e| e.condition.as_str())
}

/// Opens a connection, a session on channel 0 and a sender link 0 with `credit`.
fn opened_with_link(credit: u32) -> Client {
    let mut c = Client::new(Config {
        allow_anonymous: true,
        ..Config::default()
    });
    c.open();
    c.begin(0);
    c.attach_sender(0, 0, "/queues/q");
    let events = c.conn.take_events();
    assert!(
        events.iter().any(|e| matches!(
            e,
            Event::Attach {
                handle: 0,
                role: Role::Sender,
                ..
            }
        )),
        "{events:?}"
    );
    c.conn.accept_link(
        0,
        0,
        0,
        "sender-0".into(),
        None,
        Some(Target {
            address: Some("/queues/q".into()),
            ..Target::default()
        }),
        credit,
    );
    c.frames();
    c
}

#[test]
fn sasl_plain_then_open_announces_rabbitmq_4() {
    let mut c = Client::new(Config::default());
    c.raw(&SASL_HEADER);
    let out = c.conn.take_output();
    assert_eq!(&out[..8], &SASL_HEADER);
    let mut rest = BytesMut::from(&out[8..]);
    let raw = decode_frame(&mut rest, 512)
        .expect("decodes")
        .expect("whole");
    match raw.body().expect("body") {
        Body::Sasl(Sasl::Mechanisms(m)) => assert_eq!(m, vec!["PLAIN".to_string()]),
        other => panic!("{other:?}"),
    }
    c.sasl(Sasl::Init {
        mechanism: "PLAIN".into(),
        initial_response: Some(Bytes::from_static(b"\0guest\0guest")),
        hostname: None,
    });
    assert_eq!(
        c.conn.take_events(),
        vec![Event::Login(Login::Plain {
            user: "guest".into(),
            password: "guest".into()
        })]
    );
    c.conn.on_login(true);
    let frames = c.frames();
    assert!(matches!(
        frames[0].1,
        Body::Sasl(Sasl::Outcome { code: 0, .. })
    ));
    c.open();
    let frames = c.frames();
    let Body::Amqp(Performative::Open(open), _) = &frames[0].1 else {
        panic!("{frames:?}");
    };
    let Some(Value::Map(props)) = &open.properties else {
        panic!("no properties");
    };
    let get = |k: &str| {
        props
            .iter()
            .find(|(key, _)| key == &Value::symbol(k))
            .map(|(_, v)| v.clone())
    };
    assert_eq!(get("product"), Some(Value::String("RabbitMQ".into())));
    assert_eq!(get("version"), Some(Value::String("4.0.0".into())));
    assert_eq!(get("warren-product"), Some(Value::String("Warren".into())));
    assert!(c.conn.take_events().contains(&Event::Opened {
        hostname: Some("vhost:/".into())
    }));
}

#[test]
fn bad_password_fails_sasl_with_auth_outcome() {
    let mut c = Client::new(Config::default());
    c.raw(&SASL_HEADER);
    c.conn.take_output();
    c.sasl(Sasl::Init {
        mechanism: "PLAIN".into(),
        initial_response: Some(Bytes::from_static(b"\0guest\0wrong")),
        hostname: None,
    });
    c.conn.on_login(false);
    let frames = c.frames();
    assert!(matches!(
        frames[0].1,
        Body::Sasl(Sasl::Outcome { code: 1, .. })
    ));
    assert!(matches!(c.conn.ended(), Some(Ended::Refused(_))));
}

#[test]
fn anonymous_needs_the_config() {
    let mut c = Client::new(Config::default());
    c.raw(&SASL_HEADER);
    c.conn.take_output();
    c.sasl(Sasl::Init {
        mechanism: "ANONYMOUS".into(),
        initial_response: None,
        hostname: None,
    });
    let frames = c.frames();
    assert!(matches!(
        frames[0].1,
        Body::Sasl(Sasl::Outcome { code: 1, .. })
    ));
    // Without SASL at all, the AMQP header is refused (answered with the SASL header).
    let mut c = Client::new(Config::default());
    c.raw(&AMQP_HEADER);
    assert_eq!(&c.conn.take_output()[..], &SASL_HEADER);
    assert!(matches!(c.conn.ended(), Some(Ended::Refused(_))));
}

#[test]
fn a_wrong_header_gets_ours_and_the_end() {
    let mut c = Client::new(Config::default());
    c.raw(b"AMQP\x00\x00\x09\x01");
    assert_eq!(&c.conn.take_output()[..], &SASL_HEADER);
    assert!(matches!(c.conn.ended(), Some(Ended::Refused(_))));
}

#[test]
fn multi_frame_transfer_is_one_message_and_settles() {
    let mut c = opened_with_link(5);
    c.transfer(0, 0, Some(0), true, b"hello ");
    assert!(
        c.conn.take_events().is_empty(),
        "incomplete message surfaced"
    );
    c.transfer(0, 0, None, false, b"world");
    assert_eq!(
        c.conn.take_events(),
        vec![Event::Message {
            channel: 0,
            handle: 0,
            delivery_id: 0,
            settled: false,
            payload: Bytes::from_static(b"hello world"),
        }]
    );
    c.conn.settle(0, 0, 0, 0, DeliveryState::Accepted);
    let frames = c.frames();
    let Body::Amqp(Performative::Disposition(d), _) = &frames[0].1 else {
        panic!("{frames:?}");
    };
    assert_eq!(d.state, Some(DeliveryState::Accepted));
    assert!(d.settled);
}

#[test]
fn transfer_beyond_credit_detaches_the_link_only() {
    let mut c = opened_with_link(1);
    c.transfer(0, 0, Some(0), false, b"one");
    c.transfer(0, 0, Some(1), false, b"two");
    let frames = c.frames();
    let detach = frames.iter().find_map(|(_, b)| match b {
        Body::Amqp(Performative::Detach(d), _) => Some(d.clone()),
        _ => None,
    });
    let detach = detach.expect("detached");
    assert_eq!(
        condition_of(&detach.error),
        condition::TRANSFER_LIMIT_EXCEEDED
    );
    // The session and connection go on: a new link attaches.
    c.attach_sender(0, 1, "/queues/q");
    assert!(
        c.conn
            .take_events()
            .iter()
            .any(|e| matches!(e, Event::Attach { handle: 1, .. }))
    );
    assert!(c.conn.ended().is_none());
}

#[test]
fn transfer_on_unattached_handle_ends_that_session_only() {
    let mut c = opened_with_link(5);
    c.begin(1);
    c.frames();
    c.transfer(1, 7, Some(0), false, b"x");
    let frames = c.frames();
    let Some((1, Body::Amqp(Performative::End(e), _))) = frames.first() else {
        panic!("{frames:?}");
    };
    assert_eq!(condition_of(e), condition::UNATTACHED_HANDLE);
    // Session 0 still takes messages.
    c.transfer(0, 0, Some(0), false, b"still here");
    assert!(
        c.conn
            .take_events()
            .iter()
            .any(|e| matches!(e, Event::Message { channel: 0, .. }))
    );
}

#[test]
fn frame_over_max_frame_size_closes_with_framing_error() {
    let mut c = opened_with_link(5);
    let big = vec![0u8; 200_000];
    c.transfer(0, 0, Some(0), false, &big);
    let frames = c.frames();
    let Some((0, Body::Amqp(Performative::Close(e), _))) = frames.last() else {
        panic!("{frames:?}");
    };
    assert_eq!(condition_of(e), condition::FRAMING_ERROR);
}

#[test]
fn garbage_body_closes_with_decode_error() {
    let mut c = opened_with_link(5);
    // A frame whose body is an unknown constructor.
    c.raw(&[0, 0, 0, 9, 2, 0, 0, 0, 0xff]);
    let frames = c.frames();
    let Some((0, Body::Amqp(Performative::Close(e), _))) = frames.last() else {
        panic!("{frames:?}");
    };
    assert_eq!(condition_of(e), condition::DECODE_ERROR);
}

#[test]
fn idle_peer_is_closed_and_heartbeats_are_sent() {
    let mut c = opened_with_link(5);
    // The client's idle-time-out is 10 s: we send something every 5 s.
    let d = c.conn.deadline().expect("deadline");
    assert_eq!(d, 5_000);
    c.conn.on_timeout(5_000);
    assert_eq!(&c.conn.take_output()[..], &[0, 0, 0, 8, 2, 0, 0, 0]);
    // Ours is 60 s: nothing for 120 s closes the connection.
    c.conn.on_timeout(120_000);
    let frames = c.frames();
    let Some((0, Body::Amqp(Performative::Close(e), _))) = frames.last() else {
        panic!("{frames:?}");
    };
    assert_eq!(condition_of(e), condition::RESOURCE_LIMIT_EXCEEDED);
}

#[test]
fn peer_close_is_answered() {
    let mut c = opened_with_link(5);
    c.send(0, Performative::Close(None), &[]);
    let frames = c.frames();
    assert!(matches!(
        frames[0].1,
        Body::Amqp(Performative::Close(None), _)
    ));
    assert_eq!(c.conn.ended(), Some(&Ended::PeerClosed(None)));
}

#[test]
fn checked_open_waits_for_the_shell_and_a_refusal_sends_nothing() {
    let mut c = Client::new(Config {
        allow_anonymous: true,
        check_open: true,
        ..Config::default()
    });
    c.open();
    assert!(c.frames().is_empty(), "our open waits for the vhost check");
    assert_eq!(
        c.conn.take_events(),
        vec![
            Event::Login(Login::Anonymous),
            Event::OpenRequested {
                hostname: Some("vhost:/".into())
            }
        ]
    );
    c.conn.answer_open(
        0,
        Err(Error::new(
            condition::UNAUTHORIZED_ACCESS,
            "vhost 'nope' not found",
        )),
    );
    // RabbitMQ's silent close: nothing sent, the connection is over.
    assert!(c.frames().is_empty());
    assert_eq!(
        c.conn.ended(),
        Some(&Ended::Refused("vhost 'nope' not found".into()))
    );

    let mut ok = Client::new(Config {
        allow_anonymous: true,
        check_open: true,
        ..Config::default()
    });
    ok.open();
    ok.conn.take_events();
    ok.conn.answer_open(0, Ok(()));
    assert!(matches!(
        ok.frames().as_slice(),
        [(_, Body::Amqp(Performative::Open(_), _))]
    ));
    assert_eq!(
        ok.conn.take_events(),
        vec![Event::Opened {
            hostname: Some("vhost:/".into())
        }]
    );
}
