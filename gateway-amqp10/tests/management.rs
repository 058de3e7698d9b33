//! The management node (`/management`), sans-IO: requests as RabbitMQ's Python client
//! encodes them, the core's answers fed by hand, and every response pinned byte for byte
//! (insta snapshots of hex dumps). Then the link pair over the session: attach, a request,
//! its response on the paired link, and the bad cases on their scopes.

use bytes::{Bytes, BytesMut};
use warren_amqp10::descriptor::{AMQP_VALUE, APPLICATION_PROPERTIES, PROPERTIES};
use warren_amqp10::frame::{self, AMQP_HEADER, Body, decode_frame};
use warren_amqp10::management::{
    self, Action, Exchange, Failure, Next, Request, Response, encode_response, parse_request,
};
use warren_amqp10::pairs::{self, Pairs};
use warren_amqp10::performatives::{
    Attach, Begin, Detach, Flow, Open, Performative, Role, Source, Target, Transfer, condition,
};
use warren_amqp10::session::{Config, Connection, Event};
use warren_amqp10::types::Value;
use warren_core::admin::QueueInfo;
use warren_core::command::Op;
use warren_core::effect::{Effect, Reply};
use warren_core::error::{ErrorCode, ProtocolError};
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::message::{FieldTable, FieldValue};
use warren_core::op_kind::OpKind;
use warren_core::queue_type::QueueType;
use warren_core::stats::MessageStats;

fn hex(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .map(|row| {
            row.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn s(v: &str) -> Value {
    Value::String(v.into())
}

/// A request as rabbitmq-amqp-python-client's `Management._request` sends it: a string
/// message-id, `to` the path, `subject` the method, `reply-to` `$me`, an amqp-value body.
fn request_bytes(id: &str, method: &str, path: &str, body: Value) -> Bytes {
    let mut out = BytesMut::new();
    // header (durable false), as proton writes it.
    Value::described(0x70, Value::List(vec![Value::Bool(false)]))
        .encode(&mut out)
        .expect("encodes");
    Value::described(
        PROPERTIES,
        Value::List(vec![s(id), Value::Null, s(path), s(method), s("$me")]),
    )
    .encode(&mut out)
    .expect("encodes");
    Value::described(AMQP_VALUE, body)
        .encode(&mut out)
        .expect("encodes");
    out.freeze()
}

fn request(method: &str, path: &str, body: Value) -> Request {
    parse_request(&request_bytes("id-1", method, path, body)).expect("parses")
}

fn queue_info(name: &str, kind: QueueType, args: FieldTable) -> QueueInfo {
    QueueInfo {
        vhost: "/".into(),
        name: name.into(),
        queue_type: kind,
        durable: true,
        auto_delete: false,
        exclusive: false,
        arguments: args,
        messages_ready: 0,
        messages_unacked: 0,
        consumers: 0,
        memory: 0,
        paged_out: 0,
        messages_dlx: 0,
        stats: MessageStats::default(),
        policy: None,
    }
}

fn error(code: ErrorCode, op: OpKind, detail: &str) -> ProtocolError {
    ProtocolError::new(code, op, detail)
}

fn done(next: Next) -> Response {
    match next {
        Next::Done(r) => r,
        other => panic!("expected a response, got {other:?}"),
    }
}

/// The encoded response to request id `id-1`, checked to decode as RabbitMQ's shape.
fn wire(r: &Response) -> String {
    let bytes = encode_response(&s("id-1"), r);
    let mut rd = warren_amqp10::types::Reader::new(&bytes);
    let props = rd.value().expect("properties");
    assert_eq!(props.descriptor_code(), Some(PROPERTIES));
    let Value::Described(_, list) = props else {
        panic!("described")
    };
    let Value::List(items) = *list else {
        panic!("list")
    };
    assert_eq!(items[3], s(&r.status.to_string()), "subject is the status");
    assert_eq!(items[5], s("id-1"), "correlation-id is the message-id");
    let app = rd.value().expect("application-properties");
    assert_eq!(app.descriptor_code(), Some(APPLICATION_PROPERTIES));
    let body = rd.value().expect("body");
    assert_eq!(body.descriptor_code(), Some(AMQP_VALUE));
    assert!(rd.at_end());
    hex(&bytes)
}

#[test]
fn parses_what_the_python_client_sends() {
    let r = request(
        "PUT",
        "/queues/my%20q",
        Value::Map(vec![
            (s("durable"), Value::Bool(true)),
            (
                s("arguments"),
                Value::Map(vec![(s("x-queue-type"), s("quorum"))]),
            ),
        ]),
    );
    assert_eq!(r.method, "PUT");
    assert_eq!(r.path, "/queues/my%20q");
    assert_eq!(r.reply_to.as_deref(), Some("$me"));
    assert_eq!(r.message_id, s("id-1"));
    let Action::DeclareQueue(d) = management::route(&r, "/").expect("routes") else {
        panic!("declare")
    };
    assert_eq!(d.queue, "my q");
    assert!(d.durable && !d.exclusive && !d.auto_delete);
    assert_eq!(
        d.arguments.get("x-queue-type"),
        Some(&FieldValue::LongString(Bytes::from("quorum")))
    );
}

#[test]
fn declare_new_queue_answers_201_with_rabbitmq_queue_map() {
    let r = request(
        "PUT",
        "/queues/q1",
        Value::Map(vec![
            (s("durable"), Value::Bool(true)),
            (s("exclusive"), Value::Bool(false)),
            (s("auto_delete"), Value::Bool(false)),
            (
                s("arguments"),
                Value::Map(vec![
                    (s("x-queue-type"), s("quorum")),
                    (s("x-max-length"), Value::Long(10)),
                ]),
            ),
        ]),
    );
    let action = management::route(&r, "/").expect("routes");
    let (mut x, next) = Exchange::start(action, "/", "warren");
    assert_eq!(next, Next::Lookup("q1".into()));
    let Next::Op(Op::QueueDeclare(d)) = x.on_queue(None) else {
        panic!("declare op")
    };
    assert!(!d.passive);
    let next = x.on_core(Ok(Reply::QueueDeclareOk {
        queue: "q1".into(),
        message_count: 0,
        consumer_count: 0,
    }));
    assert_eq!(next, Next::Lookup("q1".into()));
    let info = queue_info("q1", QueueType::Quorum, d.arguments.clone());
    let resp = done(x.on_queue(Some(&info)));
    assert_eq!(resp.status, 201);
    insta::assert_snapshot!("declare_queue_201", wire(&resp));
}

#[test]
fn redeclare_answers_200_and_a_mismatch_409() {
    let body = Value::Map(vec![(s("durable"), Value::Bool(false))]);
    let action = management::route(&request("PUT", "/queues/q1", body), "/").expect("routes");
    let (mut x, _) = Exchange::start(action.clone(), "/", "warren");
    let info = queue_info("q1", QueueType::Classic, FieldTable::new());
    let _ = x.on_queue(Some(&info));
    let _ = x.on_core(Ok(Reply::QueueDeclareOk {
        queue: "q1".into(),
        message_count: 3,
        consumer_count: 1,
    }));
    let resp = done(x.on_queue(Some(&info)));
    assert_eq!(resp.status, 200);
    insta::assert_snapshot!("declare_queue_200", wire(&resp));

    let (mut x, _) = Exchange::start(action, "/", "warren");
    let _ = x.on_queue(Some(&info));
    let resp = done(x.on_core(Err(error(
        ErrorCode::PreconditionFailed,
        OpKind::QueueDeclare,
        "inequivalent arg 'durable' for queue 'q1' in vhost '/': received 'false' but current is 'true'",
    ))));
    assert_eq!(resp.status, 409);
    insta::assert_snapshot!("declare_queue_409", wire(&resp));
}

#[test]
fn queue_info_of_a_missing_queue_is_404() {
    let action =
        management::route(&request("GET", "/queues/nope", Value::Null), "/").expect("routes");
    let (mut x, next) = Exchange::start(action, "/", "warren");
    let Next::Op(Op::QueueDeclare(d)) = next else {
        panic!("passive declare")
    };
    assert!(d.passive, "GET is a passive declare: 0.9.1's checks");
    let resp = done(x.on_core(Err(error(
        ErrorCode::NotFound,
        OpKind::QueueDeclare,
        "no queue 'nope' in vhost '/'",
    ))));
    assert_eq!(
        resp,
        Response {
            status: 404,
            body: s("queue 'nope' in vhost '/' not found")
        }
    );
    insta::assert_snapshot!("queue_info_404", wire(&resp));
}

#[test]
fn purge_delete_and_exchanges() {
    let route = |m: &str, p: &str, b: Value| management::route(&request(m, p, b), "/");
    let (mut x, next) = Exchange::start(
        route("DELETE", "/queues/q1/messages", Value::Null).unwrap(),
        "/",
        "w",
    );
    assert!(matches!(next, Next::Op(Op::QueuePurge { ref queue, .. }) if queue == "q1"));
    let resp = done(x.on_core(Ok(Reply::QueuePurgeOk { message_count: 7 })));
    assert_eq!(resp.status, 200);
    insta::assert_snapshot!("purge_200", wire(&resp));

    // A missing queue's delete is RabbitMQ's 200 with no messages.
    let (mut x, _) = Exchange::start(
        route("DELETE", "/queues/gone", Value::Null).unwrap(),
        "/",
        "w",
    );
    let resp = done(x.on_core(Err(error(
        ErrorCode::NotFound,
        OpKind::QueueDelete,
        "no queue 'gone' in vhost '/'",
    ))));
    assert_eq!(resp.status, 200);

    // A purge of a missing queue is a 404.
    let (mut x, _) = Exchange::start(
        route("DELETE", "/queues/gone/messages", Value::Null).unwrap(),
        "/",
        "w",
    );
    let resp = done(x.on_core(Err(error(
        ErrorCode::NotFound,
        OpKind::QueuePurge,
        "no queue 'gone' in vhost '/'",
    ))));
    assert_eq!(
        resp,
        Response {
            status: 404,
            body: s("no queue 'gone' in vhost '/'")
        }
    );

    let body = Value::Map(vec![
        (s("durable"), Value::Bool(true)),
        (s("type"), s("topic")),
        (s("internal"), Value::Bool(false)),
        (s("arguments"), Value::Map(vec![])),
    ]);
    let (mut x, next) = Exchange::start(route("PUT", "/exchanges/e1", body).unwrap(), "/", "w");
    let Next::Op(Op::ExchangeDeclare(d)) = next else {
        panic!("exchange declare")
    };
    assert_eq!(
        (d.exchange.as_str(), d.kind.as_str(), d.passive),
        ("e1", "topic", false)
    );
    let resp = done(x.on_core(Ok(Reply::ExchangeDeclareOk)));
    assert_eq!(resp.status, 204);
    insta::assert_snapshot!("exchange_204", wire(&resp));

    // An unknown type never reaches the core (0.9.1 would close the connection).
    let bad_type = Value::Map(vec![(s("type"), s("nope"))]);
    let f = route("PUT", "/exchanges/e2", bad_type).unwrap_err();
    assert_eq!(f, Failure::new(400, "unknown exchange type 'nope'"));

    // An existing amq. exchange is checked passively; a new one is refused.
    let (mut x, next) = Exchange::start(
        route("PUT", "/exchanges/amq.new", Value::Map(vec![])).unwrap(),
        "/",
        "w",
    );
    assert!(matches!(next, Next::Op(Op::ExchangeDeclare(ref d)) if d.passive));
    let resp = done(x.on_core(Err(error(
        ErrorCode::NotFound,
        OpKind::ExchangeDeclare,
        "no exchange 'amq.new' in vhost '/'",
    ))));
    assert_eq!(resp.status, 403);

    // Access refused is a 403 response (the same check as 0.9.1's).
    let (mut x, _) = Exchange::start(
        route("DELETE", "/exchanges/e1", Value::Null).unwrap(),
        "/",
        "w",
    );
    let resp = done(x.on_core(Err(error(
        ErrorCode::AccessRefused,
        OpKind::ExchangeDelete,
        "access to exchange 'e1' in vhost '/' refused for user 'u'",
    ))));
    assert_eq!(resp.status, 403);
    insta::assert_snapshot!("access_refused_403", wire(&resp));
}

#[test]
fn bindings() {
    let body = Value::Map(vec![
        (s("binding_key"), s("k.#")),
        (s("source"), s("e1")),
        (s("destination_queue"), s("q1")),
        (s("arguments"), Value::Map(vec![])),
    ]);
    let action = management::route(&request("POST", "/bindings", body), "/").expect("routes");
    let (mut x, next) = Exchange::start(action, "/", "w");
    let Next::Op(Op::QueueBind(b)) = next else {
        panic!("queue bind")
    };
    assert_eq!(
        (
            b.source.as_str(),
            b.destination.as_str(),
            b.routing_key.as_str()
        ),
        ("e1", "q1", "k.#")
    );
    assert_eq!(done(x.on_core(Ok(Reply::QueueBindOk))).status, 204);

    let body = Value::Map(vec![
        (s("binding_key"), s("")),
        (s("source"), s("e1")),
        (s("destination_exchange"), s("e2")),
        (s("arguments"), Value::Map(vec![])),
    ]);
    let action = management::route(&request("POST", "/bindings", body), "/").expect("routes");
    let (_, next) = Exchange::start(action, "/", "w");
    assert!(matches!(next, Next::Op(Op::ExchangeBind(_))));

    // The path the Python client builds for an unbind.
    let action = management::route(
        &request(
            "DELETE",
            "/bindings/src=e1;dstq=q1;key=k.%23;args=",
            Value::Null,
        ),
        "/",
    )
    .expect("routes");
    let (mut x, next) = Exchange::start(action, "/", "w");
    let Next::Op(Op::QueueUnbind(b)) = next else {
        panic!("queue unbind")
    };
    assert_eq!(b.routing_key, "k.#");
    // Unbinding what is not there is RabbitMQ's 204.
    let resp = done(x.on_core(Err(error(
        ErrorCode::NotFound,
        OpKind::QueueUnbind,
        "no binding",
    ))));
    assert_eq!(resp.status, 204);

    let no_default = Value::Map(vec![
        (s("binding_key"), s("")),
        (s("source"), s("")),
        (s("destination_queue"), s("q1")),
    ]);
    let f = management::route(&request("POST", "/bindings", no_default), "/").unwrap_err();
    assert_eq!(
        f,
        Failure::new(403, "operation not permitted on the default exchange")
    );
}

#[test]
fn bad_requests_answer_rabbitmq_codes() {
    let route = |m: &str, p: &str, b: Value| management::route(&request(m, p, b), "/");
    let unknown = route("GET", "/nodes", Value::Null).unwrap_err();
    assert_eq!(unknown.status, 404);
    insta::assert_snapshot!("unknown_path_404", wire(&unknown.into()));
    assert_eq!(
        route("PATCH", "/queues/q", Value::Null).unwrap_err().status,
        405
    );
    assert_eq!(
        route("PUT", "/queues/", Value::Map(vec![])).unwrap_err(),
        Failure::new(400, "declare queue with empty name not allowed")
    );
    assert_eq!(
        route("PUT", "/queues/amq.q", Value::Map(vec![])).unwrap_err(),
        Failure::new(
            403,
            "queue 'amq.q' in vhost '/' starts with reserved prefix 'amq.'"
        )
    );
    assert_eq!(
        route("PUT", "/queues/a%0Ab", Value::Map(vec![]))
            .unwrap_err()
            .status,
        400
    );
    assert_eq!(
        route("PUT", "/queues/q", Value::Null).unwrap_err().status,
        400
    );
    assert_eq!(
        route(
            "PUT",
            "/queues/q",
            Value::Map(vec![(s("colour"), s("red"))])
        )
        .unwrap_err()
        .status,
        400
    );
    assert_eq!(
        route("PUT", "/queues/%zz", Value::Map(vec![]))
            .unwrap_err()
            .status,
        400
    );
    assert_eq!(
        route("DELETE", "/bindings/garbage", Value::Null)
            .unwrap_err()
            .status,
        400
    );
    assert_eq!(
        route("PUT", "/exchanges/", Value::Map(vec![]))
            .unwrap_err()
            .status,
        403
    );

    let mut no_reply_to = request("GET", "/queues/q", Value::Null);
    no_reply_to.reply_to = None;
    assert_eq!(
        management::route(&no_reply_to, "/").unwrap_err().status,
        400
    );

    // Not a message at all; without properties.
    assert_eq!(
        parse_request(&Bytes::from_static(b"\x00\x53"))
            .unwrap_err()
            .status,
        400
    );
    let mut only_body = BytesMut::new();
    Value::described(AMQP_VALUE, Value::Null)
        .encode(&mut only_body)
        .unwrap();
    assert_eq!(parse_request(&only_body.freeze()).unwrap_err().status, 400);
    // Garbage never panics.
    for n in 0..64u8 {
        let junk: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37).wrapping_add(n)).collect();
        let _ = parse_request(&Bytes::from(junk));
    }
}

// ---- the link pair over the session ----

struct Client {
    conn: Connection,
    pairs: Pairs,
    ops: Vec<(u16, Op)>,
    next_core: u16,
}

fn paired() -> Option<Value> {
    Some(Value::Map(vec![(
        Value::symbol("paired"),
        Value::Bool(true),
    )]))
}

impl Client {
    fn new() -> Client {
        let config = Config {
            allow_anonymous: true,
            ..Config::default()
        };
        let mut c = Client {
            conn: Connection::new(config, None, 0),
            pairs: Pairs::new("/", "warren"),
            ops: Vec::new(),
            next_core: 1,
        };
        c.raw(&AMQP_HEADER);
        c.send(
            0,
            Performative::Open(Box::new(Open {
                container_id: "client".into(),
                hostname: Some("vhost:/".into()),
                max_frame_size: 65536,
                channel_max: 10,
                idle_time_out: None,
                outgoing_locales: vec![],
                incoming_locales: vec![],
                offered_capabilities: vec![],
                desired_capabilities: vec![],
                properties: None,
            })),
        );
        c.send(
            0,
            Performative::Begin(Begin {
                remote_channel: None,
                next_outgoing_id: 0,
                incoming_window: 100,
                outgoing_window: 100,
                handle_max: 255,
                offered_capabilities: vec![],
                desired_capabilities: vec![],
                properties: None,
            }),
        );
        c.drive();
        c.frames();
        c
    }
    fn raw(&mut self, bytes: &[u8]) {
        let mut input = BytesMut::from(bytes);
        self.conn.handle_input(0, &mut input);
    }
    fn send(&mut self, channel: u16, p: Performative) {
        self.send_payload(channel, p, &[]);
    }
    fn send_payload(&mut self, channel: u16, p: Performative, payload: &[u8]) {
        let mut out = BytesMut::new();
        frame::encode_frame(&mut out, channel, &p, payload).expect("encodes");
        self.raw(&out);
        self.drive();
    }
    /// What the shell does with the session's events, for the pair alone.
    fn drive(&mut self) {
        while self.conn.has_events() {
            self.drive_once();
        }
    }
    fn drive_once(&mut self) {
        for e in self.conn.take_events() {
            match e {
                Event::Attach {
                    channel,
                    handle,
                    role,
                    name,
                    source,
                    target,
                    properties,
                    ..
                } => {
                    let half = pairs::half(role, source.as_ref(), target.as_ref())
                        .expect("a management attach");
                    let next = &mut self.next_core;
                    let mut alloc = || {
                        *next += 1;
                        Some(*next - 1)
                    };
                    self.pairs.attach(
                        &mut self.conn,
                        0,
                        channel,
                        handle,
                        name,
                        half,
                        source,
                        target,
                        properties,
                        &mut alloc,
                        &mut self.ops,
                    );
                }
                Event::Message {
                    channel,
                    handle,
                    delivery_id,
                    settled,
                    payload,
                } => self.pairs.on_request(
                    &mut self.conn,
                    0,
                    channel,
                    handle,
                    delivery_id,
                    settled,
                    &payload,
                    &mut self.ops,
                ),
                Event::Credit {
                    channel,
                    handle,
                    credit,
                    delivery_count,
                    ..
                } => self.pairs.on_credit(
                    &mut self.conn,
                    0,
                    channel,
                    handle,
                    credit,
                    delivery_count,
                    &mut self.ops,
                ),
                Event::Detached { channel, handle } => {
                    self.pairs.on_detached(channel, handle, &mut self.ops)
                }
                Event::Ended { channel } => self.pairs.on_ended(channel, &mut self.ops),
                _ => {}
            }
        }
    }
    fn frames(&mut self) -> Vec<(u16, Body)> {
        let mut out = self.conn.take_output();
        let mut frames = Vec::new();
        while out.starts_with(b"AMQP") {
            let _ = out.split_to(8);
        }
        while let Some(raw) = decode_frame(&mut out, u32::MAX).expect("server frames decode") {
            frames.push((raw.channel, raw.body().expect("server body decodes")));
        }
        frames
    }
    fn attach(&mut self, handle: u32, role: Role, properties: Option<Value>) {
        let node = || Some(management::ADDRESS.to_string());
        self.send(
            0,
            Performative::Attach(Box::new(Attach {
                name: "client-/management".into(),
                handle,
                role,
                snd_settle_mode: 1,
                rcv_settle_mode: 0,
                source: Some(Source {
                    address: node(),
                    ..Source::default()
                }),
                target: Some(Target {
                    address: node(),
                    ..Target::default()
                }),
                unsettled: None,
                incomplete_unsettled: false,
                initial_delivery_count: (role == Role::Sender).then_some(0),
                max_message_size: None,
                offered_capabilities: vec![],
                desired_capabilities: vec![],
                properties,
            })),
        );
    }
    fn flow(&mut self, handle: u32, credit: u32) {
        self.send(
            0,
            Performative::Flow(Flow {
                next_incoming_id: Some(0),
                incoming_window: 100,
                next_outgoing_id: 0,
                outgoing_window: 100,
                handle: Some(handle),
                delivery_count: Some(0),
                link_credit: Some(credit),
                ..Flow::default()
            }),
        );
    }
    fn request(&mut self, handle: u32, id: u32, payload: &[u8]) {
        self.send_payload(
            0,
            Performative::Transfer(Transfer {
                handle,
                delivery_id: Some(id),
                delivery_tag: Some(Bytes::from(id.to_be_bytes().to_vec())),
                message_format: Some(0),
                settled: Some(true),
                ..Transfer::default()
            }),
            payload,
        );
    }
    fn effect(&mut self, core: u16, e: impl FnOnce(ChannelRef) -> Effect) {
        let effect = e(ChannelRef::new(ConnId(1), core));
        self.pairs
            .on_effect(&mut self.conn, 0, effect, &mut self.ops);
    }
}

#[test]
fn a_request_over_the_link_pair() {
    let mut c = Client::new();
    c.attach(0, Role::Sender, paired());
    c.attach(1, Role::Receiver, paired());
    let frames = c.frames();
    // Two attaches echoing `paired`, and 8 credits on the request link.
    let attaches: Vec<&Attach> = frames
        .iter()
        .filter_map(|(_, b)| match b {
            Body::Amqp(Performative::Attach(a), _) => Some(a.as_ref()),
            _ => None,
        })
        .collect();
    assert_eq!(attaches.len(), 2, "{frames:?}");
    assert!(
        attaches
            .iter()
            .all(|a| a.properties == paired() && a.snd_settle_mode == 1)
    );
    assert!(frames.iter().any(|(_, b)| matches!(b,
        Body::Amqp(Performative::Flow(f), _) if f.handle == Some(0) && f.link_credit == Some(management::MAX_CREDIT))));
    assert_eq!(
        c.ops,
        vec![(1, Op::ChannelOpen)],
        "the pair's own core channel"
    );
    c.ops.clear();

    c.flow(1, 1);
    c.request(
        0,
        0,
        &request_bytes("id-1", "DELETE", "/queues/q1/messages", Value::Null),
    );
    assert_eq!(
        c.ops,
        vec![(
            1,
            Op::QueuePurge {
                queue: "q1".into(),
                nowait: false
            }
        )]
    );
    c.ops.clear();
    c.effect(1, |ch| Effect::Reply {
        ch,
        reply: Reply::QueuePurgeOk { message_count: 2 },
    });
    let frames = c.frames();
    let [(0, Body::Amqp(Performative::Transfer(t), payload))] = frames.as_slice() else {
        panic!("one transfer: {frames:?}")
    };
    assert_eq!(
        (t.handle, t.settled),
        (1, Some(true)),
        "on the response link, settled"
    );
    assert_eq!(
        payload.as_ref(),
        encode_response(
            &s("id-1"),
            &Response {
                status: 200,
                body: Value::Map(vec![(s("message_count"), Value::ULong(2))])
            }
        )
        .as_ref()
    );
    insta::assert_snapshot!("pair_purge_transfer", hex(payload));

    // A core channel error answers the request and the channel is reopened for the next.
    c.send(
        0,
        Performative::Flow(Flow {
            next_incoming_id: Some(1),
            incoming_window: 100,
            next_outgoing_id: 1,
            outgoing_window: 100,
            handle: Some(1),
            delivery_count: Some(1),
            link_credit: Some(1),
            ..Flow::default()
        }),
    );
    c.request(
        0,
        1,
        &request_bytes("id-2", "DELETE", "/queues/nope/messages", Value::Null),
    );
    c.ops.clear();
    c.effect(1, |ch| Effect::ChannelError {
        ch,
        error: error(
            ErrorCode::NotFound,
            OpKind::QueuePurge,
            "no queue 'nope' in vhost '/'",
        ),
    });
    assert_eq!(c.ops, vec![(1, Op::ChannelCloseOk)]);
    let frames = c.frames();
    assert!(
        matches!(
            frames.as_slice(),
            [(0, Body::Amqp(Performative::Transfer(_), _))]
        ),
        "{frames:?}"
    );
    c.ops.clear();
    c.send(
        0,
        Performative::Flow(Flow {
            next_incoming_id: Some(2),
            incoming_window: 100,
            next_outgoing_id: 2,
            outgoing_window: 100,
            handle: Some(1),
            delivery_count: Some(2),
            link_credit: Some(1),
            ..Flow::default()
        }),
    );
    c.request(
        0,
        2,
        &request_bytes("id-3", "DELETE", "/exchanges/e", Value::Null),
    );
    assert_eq!(
        c.ops,
        vec![
            (1, Op::ChannelOpen),
            (
                1,
                Op::ExchangeDelete {
                    exchange: "e".into(),
                    if_unused: false,
                    nowait: false
                }
            )
        ]
    );
}

#[test]
fn responses_wait_for_credit() {
    let mut c = Client::new();
    c.attach(0, Role::Sender, paired());
    c.attach(1, Role::Receiver, paired());
    c.frames();
    // An unknown path is answered at once, but not sent before the client gives credit.
    c.request(0, 0, &request_bytes("id-1", "GET", "/nodes", Value::Null));
    assert!(c.frames().is_empty());
    c.flow(1, 5);
    let frames = c.frames();
    let [(0, Body::Amqp(Performative::Transfer(_), payload))] = frames.as_slice() else {
        panic!("the held response: {frames:?}")
    };
    insta::assert_snapshot!("pair_unknown_path_transfer", hex(payload));
}

#[test]
fn unpaired_attach_is_refused_on_the_link() {
    let mut c = Client::new();
    c.attach(0, Role::Sender, None);
    let frames = c.frames();
    let detach = frames.iter().find_map(|(_, b)| match b {
        Body::Amqp(Performative::Detach(d), _) => Some(d.clone()),
        _ => None,
    });
    let d = detach.expect("detached");
    assert_eq!(
        d.error.map(|e| e.condition),
        Some(condition::INVALID_FIELD.to_string())
    );
    assert!(c.ops.is_empty(), "no core channel for a refused link");
    // The client's detach answers ours: not an unattached handle, the session goes on,
    // and the handle is free for a paired attach.
    c.send(
        0,
        Performative::Detach(Detach {
            handle: 0,
            closed: true,
            error: None,
        }),
    );
    assert!(c.frames().is_empty(), "nothing answers the answer");
    c.attach(0, Role::Sender, paired());
    let frames = c.frames();
    assert!(
        frames.iter().any(
            |(_, b)| matches!(b, Body::Amqp(Performative::Attach(a), _) if a.target.is_some())
        ),
        "{frames:?}"
    );
}

#[test]
fn a_request_on_a_half_open_pair_ends_the_session() {
    let mut c = Client::new();
    c.attach(0, Role::Sender, paired());
    c.frames();
    c.request(
        0,
        0,
        &request_bytes("id-1", "GET", "/queues/q", Value::Null),
    );
    let frames = c.frames();
    let end = frames.iter().find_map(|(_, b)| match b {
        Body::Amqp(Performative::End(e), _) => Some(e.clone()),
        _ => None,
    });
    assert_eq!(
        end.flatten().map(|e| e.condition),
        Some(condition::PRECONDITION_FAILED.to_string()),
        "{frames:?}"
    );
    // The session's end closed the pair's core channel; the connection goes on.
    assert!(c.ops.contains(&(1, Op::ChannelClose)), "{:?}", c.ops);
    assert!(c.conn.ended().is_none());
}

#[test]
fn a_request_on_an_unattached_handle_ends_the_session() {
    let mut c = Client::new();
    c.attach(0, Role::Sender, paired());
    c.attach(1, Role::Receiver, paired());
    c.frames();
    c.request(
        7,
        0,
        &request_bytes("id-1", "GET", "/queues/q", Value::Null),
    );
    let frames = c.frames();
    let end = frames.iter().find_map(|(_, b)| match b {
        Body::Amqp(Performative::End(e), _) => Some(e.clone()),
        _ => None,
    });
    assert_eq!(
        end.flatten().map(|e| e.condition),
        Some(condition::UNATTACHED_HANDLE.to_string())
    );
    assert!(c.conn.ended().is_none());
}

#[test]
fn a_second_attach_of_one_half_is_refused() {
    let mut c = Client::new();
    c.attach(0, Role::Sender, paired());
    c.attach(2, Role::Sender, paired());
    let frames = c.frames();
    let d = frames.iter().find_map(|(_, b)| match b {
        Body::Amqp(Performative::Detach(d), _) if d.handle == 2 => Some(d.clone()),
        _ => None,
    });
    assert_eq!(
        d.and_then(|d| d.error).map(|e| e.condition),
        Some(condition::PRECONDITION_FAILED.to_string())
    );
}

#[test]
fn a_transfer_on_the_response_link_ends_the_session() {
    let mut c = Client::new();
    c.attach(0, Role::Sender, paired());
    c.attach(1, Role::Receiver, paired());
    c.frames();
    c.request(
        1,
        0,
        &request_bytes("id-1", "GET", "/queues/q", Value::Null),
    );
    let frames = c.frames();
    let end = frames.iter().find_map(|(_, b)| match b {
        Body::Amqp(Performative::End(e), _) => Some(e.clone()),
        _ => None,
    });
    assert_eq!(
        end.flatten().map(|e| e.condition),
        Some(condition::UNATTACHED_HANDLE.to_string())
    );
    assert!(c.ops.contains(&(1, Op::ChannelClose)), "{:?}", c.ops);
}

#[test]
fn requests_beyond_the_credit_detach_the_request_link() {
    let mut c = Client::new();
    c.attach(0, Role::Sender, paired());
    c.attach(1, Role::Receiver, paired());
    c.frames();
    c.ops.clear();
    // No response credit: the answers are held, so the 8 credits are not renewed.
    for id in 0..management::MAX_CREDIT {
        c.request(
            0,
            id,
            &request_bytes(&format!("id-{id}"), "GET", "/nodes", Value::Null),
        );
    }
    assert!(
        c.frames().is_empty(),
        "answers wait for credit, no credit renewed"
    );
    c.request(0, 8, &request_bytes("id-8", "GET", "/nodes", Value::Null));
    let frames = c.frames();
    let detach = frames.iter().find_map(|(_, b)| match b {
        Body::Amqp(Performative::Detach(d), _) => Some(d.clone()),
        _ => None,
    });
    let d = detach.expect("detached");
    assert_eq!(d.handle, 0);
    assert_eq!(
        d.error.map(|e| e.condition),
        Some(condition::TRANSFER_LIMIT_EXCEEDED.to_string())
    );
    assert!(c.conn.ended().is_none());
}
