//! RabbitMQ 4's management node over AMQP 1.0 (`/management`), sans-IO: HTTP over AMQP
//! requests in, core ops and encoded responses out. RabbitMQ's own 1.0 clients declare,
//! bind and delete through it (rabbit_amqp_management.erl is the model):
//!
//! - a request is a message whose `properties.subject` is the HTTP method, `properties.to`
//!   the path (`/queues/:q`, `/queues/:q/messages`, `/exchanges/:x`, `/bindings`,
//!   `/bindings/src=..;dstq=..;key=..;args=`), `reply-to` `$me`, the body an `amqp-value`;
//! - the response's `subject` is the HTTP status code as text, its `correlation-id` the
//!   request's `message-id`, an application property `http:response` = `1.1`, the body an
//!   `amqp-value` (a map for queues, the error text for failures, null for 204).
//!
//! Every operation is an ordinary core op on the link pair's own core channel, so it passes
//! the same checks and permissions as AMQP 0.9.1; core errors map to RabbitMQ's status
//! codes ([`Exchange::on_core`]). The tokio shell (`pairs.rs`, `connection.rs`) attaches the
//! links and does the admin look-ups an [`Exchange`] asks for.

use crate::address;
use crate::types::{DecodeError, Reader, Value};
use bytes::{Bytes, BytesMut};
use warren_core::admin::QueueInfo;
use warren_core::command::{Bind, ExchangeDeclare, ExchangeKind, Op, QueueDeclare};
use warren_core::effect::Reply;
use warren_core::error::ProtocolError;
use warren_core::message::{FieldTable, FieldValue};

pub use crate::descriptor::{AMQP_VALUE, APPLICATION_PROPERTIES, PROPERTIES};

/// The node's address, as both halves of the pair name it.
pub const ADDRESS: &str = "/management";
/// Credit on the request link, RabbitMQ's `MAX_MANAGEMENT_LINK_CREDIT`: it also bounds the
/// requests and responses a pair holds.
pub const MAX_CREDIT: u32 = 8;
/// Requests longer than this are refused (RabbitMQ refuses large management requests too):
/// a declare is a few hundred bytes.
pub const MAX_REQUEST: usize = 64 * 1024;

/// A request, as the client sent it.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Echoed as the response's `correlation-id` (any type the client chose).
    pub message_id: Value,
    /// `properties.subject`: GET, PUT, POST, DELETE.
    pub method: String,
    /// `properties.to`, e.g. `/queues/q`.
    pub path: String,
    /// `properties.reply-to`: RabbitMQ requires `$me` (Link Pair CS 01 2.1).
    pub reply_to: Option<String>,
    /// The `amqp-value` body (null without one).
    pub body: Value,
}

/// A request refused before or by the core: its status code and RabbitMQ-style text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{status} {text}")]
pub struct Failure {
    pub status: u16,
    pub text: String,
}

impl Failure {
    pub fn new(status: u16, text: impl Into<String>) -> Failure {
        Failure {
            status,
            text: text.into(),
        }
    }
}

/// A response: the status and the body.
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    pub status: u16,
    pub body: Value,
}

impl From<Failure> for Response {
    fn from(f: Failure) -> Response {
        Response {
            status: f.status,
            body: Value::String(f.text),
        }
    }
}

/// Decodes a request message: its `properties` and `amqp-value` (other sections are
/// ignored, as RabbitMQ's `decode_req` does). Errors are the 400 the client gets.
pub fn parse_request(payload: &Bytes) -> Result<Request, Failure> {
    if payload.len() > MAX_REQUEST {
        return Err(Failure::new(400, "management request too large"));
    }
    let bad = |e: DecodeError| Failure::new(400, format!("undecodable request: {e}"));
    let mut r = Reader::new(payload);
    let mut props: Option<Vec<Value>> = None;
    let mut body = Value::Null;
    while !r.at_end() {
        let section = r.value().map_err(bad)?;
        let code = section.descriptor_code();
        let Value::Described(_, inner) = section else {
            return Err(Failure::new(
                400,
                "undecodable request: a section is not described",
            ));
        };
        match (code, *inner) {
            (Some(PROPERTIES), Value::List(items)) => props = Some(items),
            (Some(AMQP_VALUE), v) => body = v,
            _ => {}
        }
    }
    let mut props = props
        .ok_or_else(|| Failure::new(400, "request without properties"))?
        .into_iter();
    let message_id = props.next().unwrap_or_default();
    let _user_id = props.next();
    let to = props.next().unwrap_or_default();
    let subject = props.next().unwrap_or_default();
    let reply_to = props.next().unwrap_or_default();
    let (Value::String(path), Value::String(method)) = (to, subject) else {
        return Err(Failure::new(
            400,
            "request without string properties `to` (the path) and `subject` (the method)",
        ));
    };
    Ok(Request {
        message_id,
        method,
        path,
        reply_to: reply_to.text().map(str::to_string),
        body,
    })
}

/// The response message: `properties` (`subject` the status, `correlation-id`),
/// `application-properties` (`http:response` `1.1`) and the `amqp-value` body, as
/// RabbitMQ encodes it.
pub fn encode_response(correlation_id: &Value, response: &Response) -> Bytes {
    let mut props = vec![
        Value::Null,
        Value::Null,
        Value::Null,
        Value::String(response.status.to_string()),
    ];
    if !correlation_id.is_null() {
        props.extend([Value::Null, correlation_id.clone()]);
    }
    let sections = [
        Value::described(PROPERTIES, Value::List(props)),
        Value::described(
            APPLICATION_PROPERTIES,
            Value::Map(vec![(
                Value::String("http:response".into()),
                Value::String("1.1".into()),
            )]),
        ),
        Value::described(AMQP_VALUE, response.body.clone()),
    ];
    let mut out = BytesMut::new();
    for s in &sections {
        // Every value above has one type per array (the replicas are strings), so encoding
        // cannot fail; a failure would be a bug here, answered as an empty body.
        if s.encode(&mut out).is_err() {
            out.clear();
            break;
        }
    }
    out.freeze()
}

/// What a request asks of the core.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    QueueInfo(String),
    DeclareQueue(QueueDeclare),
    DeleteQueue(String),
    PurgeQueue(String),
    DeclareExchange(ExchangeDeclare),
    DeleteExchange(String),
    /// `to_exchange`: the destination is an exchange (`exchange.bind`).
    Bind {
        to_exchange: bool,
        bind: Bind,
    },
    Unbind {
        to_exchange: bool,
        bind: Bind,
    },
}

/// `queue 'q' in vhost '/'`, RabbitMQ's `rabbit_misc:rs/1`.
fn rs(kind: &str, name: &str, vhost: &str) -> String {
    format!("{kind} '{name}' in vhost '{vhost}'")
}

fn segment(s: &str) -> Result<String, Failure> {
    address::decode_segment(s)
        .ok_or_else(|| Failure::new(400, format!("bad percent-encoding in '{s}'")))
}

fn no_cr_lf(name: &str) -> Result<(), Failure> {
    if name.contains(['\r', '\n']) {
        return Err(Failure::new(
            400,
            format!("Bad name '{name}': line feed and carriage return characters not allowed"),
        ));
    }
    Ok(())
}

fn not_default_exchange(name: &str) -> Result<(), Failure> {
    if name.is_empty() {
        return Err(Failure::new(
            403,
            "operation not permitted on the default exchange",
        ));
    }
    Ok(())
}

fn not_reserved(kind: &str, name: &str, vhost: &str) -> Result<(), Failure> {
    if name.starts_with("amq.") {
        return Err(Failure::new(
            403,
            format!(
                "{} starts with reserved prefix 'amq.'",
                rs(kind, name, vhost)
            ),
        ));
    }
    Ok(())
}

fn no_body(r: &Request) -> Result<(), Failure> {
    if !r.body.is_null() {
        return Err(Failure::new(
            400,
            format!("{} {} takes no body", r.method, r.path),
        ));
    }
    Ok(())
}

/// What the request asks for, checked as RabbitMQ checks it before the core sees it
/// (names, reserved prefixes, the body's fields). Unknown paths answer 404, known paths
/// with another method 405 (RabbitMQ has no clause for them and fails the session instead).
pub fn route(r: &Request, vhost: &str) -> Result<Action, Failure> {
    if r.reply_to.as_deref() != Some("$me") {
        return Err(Failure::new(
            400,
            "reply-to must be '$me' (the link pair's own receiving link)",
        ));
    }
    let (path, query) = r.path.split_once('?').unwrap_or((&r.path, ""));
    let Some(rest) = path.strip_prefix('/') else {
        return Err(Failure::new(400, format!("bad path '{}'", r.path)));
    };
    let segs: Vec<&str> = rest.split('/').collect();
    let method = r.method.as_str();
    match (method, segs.as_slice()) {
        ("GET", ["queues", q]) => {
            no_body(r)?;
            Ok(Action::QueueInfo(segment(q)?))
        }
        ("PUT", ["queues", q]) => {
            let name = segment(q)?;
            if name.is_empty() {
                return Err(Failure::new(
                    400,
                    "declare queue with empty name not allowed",
                ));
            }
            no_cr_lf(&name)?;
            not_reserved("queue", &name, vhost)?;
            queue_body(name, &r.body).map(Action::DeclareQueue)
        }
        ("DELETE", ["queues", q]) => {
            no_body(r)?;
            let name = segment(q)?;
            no_cr_lf(&name)?;
            Ok(Action::DeleteQueue(name))
        }
        ("DELETE", ["queues", q, "messages"]) => {
            no_body(r)?;
            Ok(Action::PurgeQueue(segment(q)?))
        }
        ("PUT", ["exchanges", x]) => {
            let name = segment(x)?;
            not_default_exchange(&name)?;
            no_cr_lf(&name)?;
            let d = exchange_body(name, &r.body)?;
            check_type(&d)?;
            Ok(Action::DeclareExchange(d))
        }
        ("DELETE", ["exchanges", x]) => {
            no_body(r)?;
            let name = segment(x)?;
            no_cr_lf(&name)?;
            not_default_exchange(&name)?;
            not_reserved("exchange", &name, vhost)?;
            Ok(Action::DeleteExchange(name))
        }
        ("POST", ["bindings"]) => {
            let (to_exchange, bind) = binding_body(&r.body)?;
            binding_checks(&bind)?;
            Ok(Action::Bind { to_exchange, bind })
        }
        ("DELETE", ["bindings", seg]) => {
            no_body(r)?;
            let (to_exchange, bind) = binding_segment(seg)?;
            binding_checks(&bind)?;
            Ok(Action::Unbind { to_exchange, bind })
        }
        ("GET", ["bindings"]) => Err(Failure::new(
            501,
            format!("listing bindings ({query}) is not implemented by Warren"),
        )),
        ("PUT", ["auth", "tokens"]) => Err(Failure::new(
            501,
            "token refresh is not implemented by Warren (no OAuth 2 backend)",
        )),
        (_, ["queues", _] | ["queues", _, "messages"] | ["exchanges", _] | ["bindings"])
        | (_, ["bindings", _] | ["auth", "tokens"]) => Err(Failure::new(
            405,
            format!("method {method} not allowed on {}", r.path),
        )),
        _ => Err(Failure::new(
            404,
            format!("no management resource at '{}'", r.path),
        )),
    }
}

fn map_entries<'a>(body: &'a Value, what: &str) -> Result<&'a [(Value, Value)], Failure> {
    match body {
        Value::Map(m) => Ok(m),
        other => Err(Failure::new(
            400,
            format!("bad {what} body {other:?}: a map expected"),
        )),
    }
}

fn boolean(v: &Value, key: &str, what: &str) -> Result<bool, Failure> {
    match v {
        Value::Bool(b) => Ok(*b),
        other => Err(Failure::new(
            400,
            format!("bad {what} property {key}: {other:?}"),
        )),
    }
}

/// RabbitMQ's `decode_queue`: `durable` (default true), `exclusive`, `auto_delete`,
/// `arguments`; anything else is a 400.
fn queue_body(queue: String, body: &Value) -> Result<QueueDeclare, Failure> {
    let mut d = QueueDeclare {
        queue,
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: FieldTable::new(),
    };
    for (k, v) in map_entries(body, "queue")? {
        match k.text() {
            Some("durable") => d.durable = boolean(v, "durable", "queue")?,
            Some("exclusive") => d.exclusive = boolean(v, "exclusive", "queue")?,
            Some("auto_delete") => d.auto_delete = boolean(v, "auto_delete", "queue")?,
            Some("arguments") => d.arguments = arguments(v)?,
            _ => return Err(Failure::new(400, format!("bad queue property {k:?}"))),
        }
    }
    Ok(d)
}

/// RabbitMQ's `decode_exchange`: `type` (default direct), `durable` (default true),
/// `auto_delete`, `internal`, `arguments`.
fn exchange_body(exchange: String, body: &Value) -> Result<ExchangeDeclare, Failure> {
    let mut d = ExchangeDeclare {
        exchange,
        kind: "direct".into(),
        passive: false,
        durable: true,
        auto_delete: false,
        internal: false,
        nowait: false,
        arguments: FieldTable::new(),
    };
    for (k, v) in map_entries(body, "exchange")? {
        match (k.text(), v) {
            (Some("type"), Value::String(t)) => d.kind = t.clone(),
            (Some("durable"), v) => d.durable = boolean(v, "durable", "exchange")?,
            (Some("auto_delete"), v) => d.auto_delete = boolean(v, "auto_delete", "exchange")?,
            (Some("internal"), v) => d.internal = boolean(v, "internal", "exchange")?,
            (Some("arguments"), v) => d.arguments = arguments(v)?,
            _ => return Err(Failure::new(400, format!("bad exchange property {k:?}"))),
        }
    }
    Ok(d)
}

/// RabbitMQ's `check_type`, before the core sees the declare: 0.9.1 makes an unknown type
/// COMMAND_INVALID, a connection error, where RabbitMQ's management node answers 400.
fn check_type(d: &ExchangeDeclare) -> Result<(), Failure> {
    let unknown = |t: &str| Failure::new(400, format!("unknown exchange type '{t}'"));
    if d.kind == warren_core::routing::DELAYED_TYPE {
        // The delayed exchange's own type argument is checked the same way.
        return match d
            .arguments
            .get("x-delayed-type")
            .and_then(FieldValue::as_str)
        {
            Some(t) if ExchangeKind::parse(t).is_none() && t != d.kind => Err(unknown(t)),
            _ => Ok(()),
        };
    }
    match ExchangeKind::parse(&d.kind) {
        Some(_) => Ok(()),
        None => Err(unknown(&d.kind)),
    }
}

/// RabbitMQ's `decode_binding`: `source`, `destination_queue` or `destination_exchange`,
/// `binding_key`, `arguments`.
fn binding_body(body: &Value) -> Result<(bool, Bind), Failure> {
    let mut source = None;
    let mut dest = None;
    let mut key = None;
    let mut args = FieldTable::new();
    for (k, v) in map_entries(body, "binding")? {
        match (k.text(), v) {
            (Some("source"), Value::String(s)) => source = Some(s.clone()),
            (Some("destination_queue"), Value::String(s)) => dest = Some((false, s.clone())),
            (Some("destination_exchange"), Value::String(s)) => dest = Some((true, s.clone())),
            (Some("binding_key"), Value::String(s)) => key = Some(s.clone()),
            (Some("arguments"), v) => args = arguments(v)?,
            _ => return Err(Failure::new(400, format!("bad binding field {k:?}"))),
        }
    }
    let (Some(source), Some((to_exchange, destination)), Some(routing_key)) = (source, dest, key)
    else {
        return Err(Failure::new(
            400,
            "a binding needs source, binding_key and destination_queue or destination_exchange",
        ));
    };
    Ok((
        to_exchange,
        Bind {
            destination,
            source,
            routing_key,
            nowait: false,
            arguments: args,
        },
    ))
}

/// `src=e1;dstq=q2;key=my-key;args=` (RabbitMQ's binding path segment; names
/// percent-encoded). `args` is RabbitMQ's hash of the binding's arguments (Erlang's
/// `phash2`, which Warren cannot reproduce): only the empty hash, no arguments, is served.
fn binding_segment(seg: &str) -> Result<(bool, Bind), Failure> {
    let bad = || Failure::new(400, format!("bad binding path segment '{seg}'"));
    let mut parts = seg.split(';');
    let src = parts
        .next()
        .and_then(|p| p.strip_prefix("src="))
        .ok_or_else(bad)?;
    let dst = parts.next().ok_or_else(bad)?;
    let (to_exchange, dst) = match (dst.strip_prefix("dstq="), dst.strip_prefix("dste=")) {
        (Some(q), _) => (false, q),
        (_, Some(e)) => (true, e),
        _ => return Err(bad()),
    };
    let key = parts
        .next()
        .and_then(|p| p.strip_prefix("key="))
        .ok_or_else(bad)?;
    let args = parts
        .next()
        .and_then(|p| p.strip_prefix("args="))
        .ok_or_else(bad)?;
    if parts.next().is_some() || src.is_empty() || dst.is_empty() {
        return Err(bad());
    }
    if !args.is_empty() {
        return Err(Failure::new(
            400,
            format!("bindings with arguments (args={args}) cannot be deleted by path in Warren"),
        ));
    }
    Ok((
        to_exchange,
        Bind {
            source: address::decode_segment(src).ok_or_else(bad)?,
            destination: address::decode_segment(dst).ok_or_else(bad)?,
            routing_key: address::decode_segment(key).ok_or_else(bad)?,
            nowait: false,
            arguments: FieldTable::new(),
        },
    ))
}

/// RabbitMQ's `binding_checks`: neither end the default exchange, no CR/LF.
fn binding_checks(b: &Bind) -> Result<(), Failure> {
    not_default_exchange(&b.source)?;
    not_default_exchange(&b.destination)?;
    no_cr_lf(&b.source)?;
    no_cr_lf(&b.destination)
}

/// An `arguments` map (string or symbol keys) as a 0.9.1 field table (`mc_amqpl:to_091`).
fn arguments(v: &Value) -> Result<FieldTable, Failure> {
    let mut t = FieldTable::new();
    for (k, v) in map_entries(v, "arguments")? {
        let Some(k) = k.text() else {
            return Err(Failure::new(400, format!("unsupported argument {k:?}")));
        };
        t.insert(k.to_string(), to_field(v));
    }
    Ok(t)
}

fn to_field(v: &Value) -> FieldValue {
    match v {
        Value::Bool(b) => FieldValue::Bool(*b),
        Value::UByte(n) => FieldValue::U8(*n),
        Value::UShort(n) => FieldValue::U16(*n),
        Value::UInt(n) => FieldValue::U32(*n),
        Value::ULong(n) => i64::try_from(*n).map_or(FieldValue::Void, FieldValue::I64),
        Value::Byte(n) => FieldValue::I8(*n),
        Value::Short(n) => FieldValue::I16(*n),
        Value::Int(n) => FieldValue::I32(*n),
        Value::Long(n) => FieldValue::I64(*n),
        Value::Float(f) => FieldValue::F32(*f),
        Value::Double(f) => FieldValue::F64(*f),
        Value::Timestamp(ms) => FieldValue::Timestamp(u64::try_from(ms / 1000).unwrap_or(0)),
        Value::String(s) | Value::Symbol(s) => FieldValue::LongString(Bytes::from(s.clone())),
        Value::Binary(b) => FieldValue::ByteArray(b.clone()),
        Value::Char(c) => FieldValue::LongString(Bytes::from(c.to_string())),
        Value::Uuid(u) => FieldValue::ByteArray(Bytes::copy_from_slice(u)),
        Value::List(items) | Value::Array(items) => {
            FieldValue::Array(items.iter().map(to_field).collect())
        }
        Value::Map(entries) => FieldValue::Table(
            entries
                .iter()
                .filter_map(|(k, v)| Some((k.text()?.to_string(), to_field(v))))
                .collect(),
        ),
        Value::Described(_, v) => to_field(v),
        Value::Null | Value::Decimal32(_) | Value::Decimal64(_) | Value::Decimal128(_) => {
            FieldValue::Void
        }
    }
}

/// A 0.9.1 field value as AMQP 1.0 (`mc_amqpl:from_091`).
fn from_field(v: &FieldValue) -> Value {
    match v {
        FieldValue::Bool(b) => Value::Bool(*b),
        FieldValue::I8(n) => Value::Byte(*n),
        FieldValue::U8(n) => Value::UByte(*n),
        FieldValue::I16(n) => Value::Short(*n),
        FieldValue::U16(n) => Value::UShort(*n),
        FieldValue::I32(n) => Value::Int(*n),
        FieldValue::U32(n) => Value::UInt(*n),
        FieldValue::I64(n) => Value::Long(*n),
        FieldValue::F32(f) => Value::Float(*f),
        FieldValue::F64(f) => Value::Double(*f),
        FieldValue::Decimal { scale, value } => Value::String(format!("{value}e-{scale}")),
        FieldValue::ShortString(s) => Value::String(s.clone()),
        FieldValue::LongString(b) => match std::str::from_utf8(b) {
            Ok(s) => Value::String(s.to_string()),
            Err(_) => Value::Binary(b.clone()),
        },
        FieldValue::Array(items) => Value::List(items.iter().map(from_field).collect()),
        FieldValue::Timestamp(s) => {
            Value::Timestamp(i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX))
        }
        FieldValue::Table(t) => table(t),
        FieldValue::ByteArray(b) => Value::Binary(b.clone()),
        FieldValue::Void => Value::Null,
    }
}

fn table(t: &FieldTable) -> Value {
    Value::Map(
        t.iter()
            .map(|(k, v)| (Value::String(k.clone()), from_field(v)))
            .collect(),
    )
}

fn key(k: &str) -> Value {
    Value::String(k.into())
}

/// A queue as RabbitMQ's `encode_queue` answers it (its keys, types and order; `leader`
/// first, since RabbitMQ prepends it). A single Warren node leads all its queues and is
/// their one replica.
pub fn queue_map(q: &QueueInfo, node: &str, messages: u64, consumers: u32) -> Value {
    Value::Map(vec![
        (key("leader"), Value::String(node.into())),
        (key("message_count"), Value::ULong(messages)),
        (key("consumer_count"), Value::UInt(consumers)),
        (key("name"), Value::String(q.name.clone())),
        (key("vhost"), Value::String(q.vhost.clone())),
        (key("durable"), Value::Bool(q.durable)),
        (key("auto_delete"), Value::Bool(q.auto_delete)),
        (key("exclusive"), Value::Bool(q.exclusive)),
        (key("type"), Value::String(q.queue_type.name().into())),
        (key("arguments"), table(&q.arguments)),
        (
            key("replicas"),
            Value::Array(vec![Value::String(node.into())]),
        ),
    ])
}

fn count_map(messages: u32) -> Value {
    Value::Map(vec![(
        key("message_count"),
        Value::ULong(u64::from(messages)),
    )])
}

/// What the shell does next for an [`Exchange`].
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Send this op on the pair's core channel and answer with [`Exchange::on_core`].
    Op(Op),
    /// Look this queue of the vhost up (the admin listing) and answer with
    /// [`Exchange::on_queue`]: the core's replies do not carry a queue's type and flags.
    Lookup(String),
    /// The response to send.
    Done(Response),
}

#[derive(Clone, Debug, PartialEq)]
enum Stage {
    /// Waiting for the core's answer to the op sent.
    Core,
    /// Waiting for a look-up before the declare: did the queue exist (200, else 201)?
    BeforeDeclare,
    /// Waiting for the look-up after the core answered.
    After {
        status: u16,
        messages: u32,
        consumers: u32,
    },
}

/// One request being served: the ops and look-ups it takes, then its response.
#[derive(Clone, Debug, PartialEq)]
pub struct Exchange {
    action: Action,
    vhost: String,
    node: String,
    stage: Stage,
    existed: bool,
}

impl Exchange {
    /// Starts serving `action` in `vhost`; `node` names this broker in queue answers.
    pub fn start(action: Action, vhost: &str, node: &str) -> (Exchange, Next) {
        let mut x = Exchange {
            action,
            vhost: vhost.to_string(),
            node: node.to_string(),
            stage: Stage::Core,
            existed: false,
        };
        let next = match &x.action {
            Action::DeclareQueue(d) => {
                x.stage = Stage::BeforeDeclare;
                Next::Lookup(d.queue.clone())
            }
            _ => Next::Op(x.op()),
        };
        (x, next)
    }

    /// The one core op of the action.
    fn op(&self) -> Op {
        match &self.action {
            // The same check as RabbitMQ's (and 0.9.1's passive declare): it exists and the
            // user may use it.
            Action::QueueInfo(q) => Op::QueueDeclare(QueueDeclare {
                queue: q.clone(),
                passive: true,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::new(),
            }),
            Action::DeclareQueue(d) => Op::QueueDeclare(d.clone()),
            Action::DeleteQueue(q) => Op::QueueDelete {
                queue: q.clone(),
                if_unused: false,
                if_empty: false,
                nowait: false,
            },
            Action::PurgeQueue(q) => Op::QueuePurge {
                queue: q.clone(),
                nowait: false,
            },
            Action::DeclareExchange(d) => {
                let mut d = d.clone();
                // RabbitMQ serves an existing `amq.` exchange (equivalent or not) and
                // refuses to create one: a passive declare says which, 0.9.1's refusal of
                // any `amq.` declare would not.
                d.passive = d.exchange.starts_with("amq.");
                Op::ExchangeDeclare(d)
            }
            Action::DeleteExchange(x) => Op::ExchangeDelete {
                exchange: x.clone(),
                if_unused: false,
                nowait: false,
            },
            Action::Bind {
                to_exchange: false,
                bind,
            } => Op::QueueBind(bind.clone()),
            Action::Bind {
                to_exchange: true,
                bind,
            } => Op::ExchangeBind(bind.clone()),
            Action::Unbind {
                to_exchange: false,
                bind,
            } => Op::QueueUnbind(bind.clone()),
            Action::Unbind {
                to_exchange: true,
                bind,
            } => Op::ExchangeUnbind(bind.clone()),
        }
    }

    fn internal(&self, what: &str) -> Next {
        Next::Done(Failure::new(500, format!("management node: unexpected {what}")).into())
    }

    /// The core answered the op: its reply, or the channel error it raised (the shell has
    /// closed the core channel and reopens it before the next op).
    pub fn on_core(&mut self, answer: Result<Reply, ProtocolError>) -> Next {
        if self.stage != Stage::Core {
            return self.internal("core answer");
        }
        let error = match answer {
            Ok(reply) => return self.on_reply(reply),
            Err(e) => e,
        };
        let code = error.code.code();
        // The core's text is `NAME - detail` (0.9.1's reply-text); RabbitMQ's responses
        // carry the detail alone.
        let detail = error
            .text
            .split_once(" - ")
            .map_or(error.text.as_str(), |(_, d)| d)
            .to_string();
        let response = match (&self.action, code) {
            // RabbitMQ answers these for what is already gone.
            (Action::DeleteQueue(_), 404) => Response {
                status: 200,
                body: count_map(0),
            },
            (Action::DeleteExchange(_), 404) | (Action::Unbind { .. }, 404) => Response {
                status: 204,
                body: Value::Null,
            },
            (Action::QueueInfo(q), 404) => {
                Failure::new(404, format!("{} not found", rs("queue", q, &self.vhost))).into()
            }
            (Action::DeclareExchange(d), 404) if d.exchange.starts_with("amq.") => Failure::new(
                403,
                format!(
                    "{} starts with reserved prefix 'amq.'",
                    rs("exchange", &d.exchange, &self.vhost)
                ),
            )
            .into(),
            // RabbitMQ's binding_action turns every error into a 400.
            (Action::Bind { .. }, 404) => Failure::new(400, detail).into(),
            (_, 404) => Failure::new(404, detail).into(),
            (_, 403) => Failure::new(403, detail).into(),
            (_, 406) => Failure::new(409, detail).into(),
            // RESOURCE_LOCKED (another connection's exclusive queue), COMMAND_INVALID
            // (unknown exchange type), NOT_ALLOWED...: RabbitMQ's `amqp_error` catch-all.
            _ => Failure::new(400, detail).into(),
        };
        Next::Done(response)
    }

    fn on_reply(&mut self, reply: Reply) -> Next {
        match (&self.action, reply) {
            (
                Action::QueueInfo(q) | Action::DeclareQueue(QueueDeclare { queue: q, .. }),
                Reply::QueueDeclareOk {
                    message_count,
                    consumer_count,
                    ..
                },
            ) => {
                let status = match (&self.action, self.existed) {
                    (Action::DeclareQueue(_), false) => 201,
                    _ => 200,
                };
                self.stage = Stage::After {
                    status,
                    messages: message_count,
                    consumers: consumer_count,
                };
                Next::Lookup(q.clone())
            }
            (Action::DeleteQueue(_), Reply::QueueDeleteOk { message_count })
            | (Action::PurgeQueue(_), Reply::QueuePurgeOk { message_count }) => {
                Next::Done(Response {
                    status: 200,
                    body: count_map(message_count),
                })
            }
            (Action::DeclareExchange(_), Reply::ExchangeDeclareOk)
            | (Action::DeleteExchange(_), Reply::ExchangeDeleteOk)
            | (Action::Bind { .. }, Reply::QueueBindOk | Reply::ExchangeBindOk)
            | (Action::Unbind { .. }, Reply::QueueUnbindOk | Reply::ExchangeUnbindOk) => {
                Next::Done(Response {
                    status: 204,
                    body: Value::Null,
                })
            }
            (_, other) => self.internal(&format!("reply {other:?}")),
        }
    }

    /// The look-up asked for: the queue of the vhost, if it exists.
    pub fn on_queue(&mut self, info: Option<&QueueInfo>) -> Next {
        match (&self.stage, info) {
            (Stage::BeforeDeclare, info) => {
                self.existed = info.is_some();
                self.stage = Stage::Core;
                Next::Op(self.op())
            }
            (
                Stage::After {
                    status,
                    messages,
                    consumers,
                },
                Some(q),
            ) => Next::Done(Response {
                status: *status,
                body: queue_map(q, &self.node, u64::from(*messages), *consumers),
            }),
            // Deleted between the core's answer and the look-up (or an exclusive queue
            // whose owner went away): gone, as RabbitMQ would find it.
            (Stage::After { .. }, None) => {
                let name = match &self.action {
                    Action::QueueInfo(q) => q.as_str(),
                    Action::DeclareQueue(d) => d.queue.as_str(),
                    _ => "",
                };
                Next::Done(
                    Failure::new(404, format!("{} not found", rs("queue", name, &self.vhost)))
                        .into(),
                )
            }
            (Stage::Core, _) => self.internal("queue look-up"),
        }
    }
}
