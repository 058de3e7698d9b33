//! The transport performatives (open ... close), the SASL frames, and the composite types
//! they carry (error, source, target, delivery states), as typed structs. Each is a described
//! list; a missing trailing field and a `null` field both mean the spec's default, and the
//! encoder trims trailing nulls (as the spec permits) so frames stay small.

use crate::descriptor as d;
use crate::types::Value;
use bytes::Bytes;

/// Why a described value is not the performative or type it claims to be.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FieldError {
    #[error("not a described list")]
    NotDescribedList,
    #[error("unknown descriptor {0:?}")]
    UnknownDescriptor(Option<u64>),
    #[error("field `{0}` is missing or has the wrong type")]
    Field(&'static str),
}

type R<T> = Result<T, FieldError>;

/// The fields of a described list, each `Null` past the end.
struct Fields(Vec<Value>);

const NULL: Value = Value::Null;

impl Fields {
    fn of(v: Value) -> R<(u64, Fields)> {
        let code = v.descriptor_code();
        match v {
            Value::Described(_, inner) => match *inner {
                Value::List(items) => Ok((
                    code.ok_or(FieldError::UnknownDescriptor(None))?,
                    Fields(items),
                )),
                _ => Err(FieldError::NotDescribedList),
            },
            _ => Err(FieldError::NotDescribedList),
        }
    }
    fn get(&self, i: usize) -> &Value {
        self.0.get(i).unwrap_or(&NULL)
    }
    fn take(&mut self, i: usize) -> Value {
        self.0.get_mut(i).map(std::mem::take).unwrap_or(Value::Null)
    }
    fn u32_opt(&self, i: usize, name: &'static str) -> R<Option<u32>> {
        match self.get(i) {
            Value::Null => Ok(None),
            Value::UInt(x) => Ok(Some(*x)),
            _ => Err(FieldError::Field(name)),
        }
    }
    fn u32_req(&self, i: usize, name: &'static str) -> R<u32> {
        self.u32_opt(i, name)?.ok_or(FieldError::Field(name))
    }
    fn u16_opt(&self, i: usize, name: &'static str) -> R<Option<u16>> {
        match self.get(i) {
            Value::Null => Ok(None),
            Value::UShort(x) => Ok(Some(*x)),
            _ => Err(FieldError::Field(name)),
        }
    }
    fn u8_opt(&self, i: usize, name: &'static str) -> R<Option<u8>> {
        match self.get(i) {
            Value::Null => Ok(None),
            Value::UByte(x) => Ok(Some(*x)),
            _ => Err(FieldError::Field(name)),
        }
    }
    fn u64_opt(&self, i: usize, name: &'static str) -> R<Option<u64>> {
        match self.get(i) {
            Value::Null => Ok(None),
            Value::ULong(x) => Ok(Some(*x)),
            _ => Err(FieldError::Field(name)),
        }
    }
    fn bool_opt(&self, i: usize, name: &'static str) -> R<Option<bool>> {
        match self.get(i) {
            Value::Null => Ok(None),
            Value::Bool(b) => Ok(Some(*b)),
            _ => Err(FieldError::Field(name)),
        }
    }
    fn bool_or(&self, i: usize, name: &'static str, default: bool) -> R<bool> {
        Ok(self.bool_opt(i, name)?.unwrap_or(default))
    }
    fn string_opt(&self, i: usize, name: &'static str) -> R<Option<String>> {
        match self.get(i) {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(s.clone())),
            _ => Err(FieldError::Field(name)),
        }
    }
    fn symbol_opt(&self, i: usize, name: &'static str) -> R<Option<String>> {
        match self.get(i) {
            Value::Null => Ok(None),
            Value::Symbol(s) => Ok(Some(s.clone())),
            _ => Err(FieldError::Field(name)),
        }
    }
    fn binary_opt(&self, i: usize, name: &'static str) -> R<Option<Bytes>> {
        match self.get(i) {
            Value::Null => Ok(None),
            Value::Binary(b) => Ok(Some(b.clone())),
            _ => Err(FieldError::Field(name)),
        }
    }
    /// A `multiple="true"` symbol field: one symbol or an array of them.
    fn symbols(&self, i: usize, name: &'static str) -> R<Vec<String>> {
        match self.get(i) {
            Value::Null => Ok(Vec::new()),
            Value::Symbol(s) => Ok(vec![s.clone()]),
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::Symbol(s) => Ok(s.clone()),
                    _ => Err(FieldError::Field(name)),
                })
                .collect(),
            _ => Err(FieldError::Field(name)),
        }
    }
    /// A map-typed field (`fields`, `filter-set`, ...), kept as a value.
    fn map_opt(&mut self, i: usize, name: &'static str) -> R<Option<Value>> {
        match self.get(i) {
            Value::Null => Ok(None),
            Value::Map(_) => Ok(Some(self.take(i))),
            _ => Err(FieldError::Field(name)),
        }
    }
    fn error_opt(&mut self, i: usize) -> R<Option<Error>> {
        match self.take(i) {
            Value::Null => Ok(None),
            v => Error::from_value(v).map(Some),
        }
    }
}

/// Builds a described list, trimming trailing nulls.
fn list(code: u64, mut fields: Vec<Value>) -> Value {
    while fields.last().is_some_and(Value::is_null) {
        fields.pop();
    }
    Value::described(code, Value::List(fields))
}

fn opt<T>(v: Option<T>, f: impl FnOnce(T) -> Value) -> Value {
    v.map_or(Value::Null, f)
}

fn symbols(s: &[String]) -> Value {
    if s.is_empty() {
        Value::Null
    } else {
        Value::Array(s.iter().map(|x| Value::Symbol(x.clone())).collect())
    }
}

fn string(s: &Option<String>) -> Value {
    opt(s.clone(), Value::String)
}

/// `amqp:error:list`: a condition symbol (`amqp:not-found`...), a description, info.
#[derive(Clone, Debug, PartialEq)]
pub struct Error {
    pub condition: String,
    pub description: Option<String>,
    pub info: Option<Value>,
}

impl Error {
    pub fn new(condition: &str, description: impl Into<String>) -> Self {
        Error {
            condition: condition.to_string(),
            description: Some(description.into()),
            info: None,
        }
    }
    pub fn from_value(v: Value) -> R<Self> {
        let (code, mut f) = Fields::of(v)?;
        if code != d::ERROR {
            return Err(FieldError::UnknownDescriptor(Some(code)));
        }
        Ok(Error {
            condition: f
                .symbol_opt(0, "condition")?
                .ok_or(FieldError::Field("condition"))?,
            description: f.string_opt(1, "description")?,
            info: f.map_opt(2, "info")?,
        })
    }
    pub fn to_value(&self) -> Value {
        list(
            d::ERROR,
            vec![
                Value::Symbol(self.condition.clone()),
                string(&self.description),
                self.info.clone().unwrap_or(Value::Null),
            ],
        )
    }
}

/// The spec's error conditions Warren sends (section 2.8.15 and following).
pub mod condition {
    pub const INTERNAL_ERROR: &str = "amqp:internal-error";
    pub const NOT_FOUND: &str = "amqp:not-found";
    pub const UNAUTHORIZED_ACCESS: &str = "amqp:unauthorized-access";
    pub const DECODE_ERROR: &str = "amqp:decode-error";
    pub const RESOURCE_LIMIT_EXCEEDED: &str = "amqp:resource-limit-exceeded";
    pub const NOT_ALLOWED: &str = "amqp:not-allowed";
    pub const INVALID_FIELD: &str = "amqp:invalid-field";
    pub const NOT_IMPLEMENTED: &str = "amqp:not-implemented";
    pub const RESOURCE_LOCKED: &str = "amqp:resource-locked";
    pub const PRECONDITION_FAILED: &str = "amqp:precondition-failed";
    pub const RESOURCE_DELETED: &str = "amqp:resource-deleted";
    pub const ILLEGAL_STATE: &str = "amqp:illegal-state";
    pub const FRAME_SIZE_TOO_SMALL: &str = "amqp:frame-size-too-small";
    pub const CONNECTION_FORCED: &str = "amqp:connection:forced";
    pub const FRAMING_ERROR: &str = "amqp:connection:framing-error";
    pub const REDIRECT: &str = "amqp:connection:redirect";
    pub const WINDOW_VIOLATION: &str = "amqp:session:window-violation";
    pub const ERRANT_LINK: &str = "amqp:session:errant-link";
    pub const HANDLE_IN_USE: &str = "amqp:session:handle-in-use";
    pub const UNATTACHED_HANDLE: &str = "amqp:session:unattached-handle";
    pub const DETACH_FORCED: &str = "amqp:link:detach-forced";
    pub const TRANSFER_LIMIT_EXCEEDED: &str = "amqp:link:transfer-limit-exceeded";
    pub const MESSAGE_SIZE_EXCEEDED: &str = "amqp:link:message-size-exceeded";
    pub const LINK_REDIRECT: &str = "amqp:link:redirect";
    pub const STOLEN: &str = "amqp:link:stolen";
}

/// A link's role: the sender or the receiver of its messages (`false` / `true` on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Sender,
    Receiver,
}

impl Role {
    fn from_bool(b: bool) -> Role {
        if b { Role::Receiver } else { Role::Sender }
    }
    fn to_value(self) -> Value {
        Value::Bool(self == Role::Receiver)
    }
}

/// A terminus's source (what a receiving link consumes from).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Source {
    pub address: Option<String>,
    pub durable: Option<u32>,
    pub expiry_policy: Option<String>,
    pub timeout: Option<u32>,
    pub dynamic: bool,
    pub dynamic_node_properties: Option<Value>,
    pub distribution_mode: Option<String>,
    pub filter: Option<Value>,
    pub default_outcome: Option<Value>,
    pub outcomes: Vec<String>,
    pub capabilities: Vec<String>,
}

/// An address may be any of the spec's `address-string` forms; Warren uses strings, and
/// takes symbols too since some clients send them.
fn address(f: &Fields, i: usize) -> R<Option<String>> {
    match f.get(i) {
        Value::Null => Ok(None),
        Value::String(s) | Value::Symbol(s) => Ok(Some(s.clone())),
        _ => Err(FieldError::Field("address")),
    }
}

impl Source {
    pub fn from_value(v: Value) -> R<Self> {
        let (code, mut f) = Fields::of(v)?;
        if code != d::SOURCE {
            return Err(FieldError::UnknownDescriptor(Some(code)));
        }
        Ok(Source {
            address: address(&f, 0)?,
            durable: f.u32_opt(1, "durable")?,
            expiry_policy: f.symbol_opt(2, "expiry-policy")?,
            timeout: f.u32_opt(3, "timeout")?,
            dynamic: f.bool_or(4, "dynamic", false)?,
            dynamic_node_properties: f.map_opt(5, "dynamic-node-properties")?,
            distribution_mode: f.symbol_opt(6, "distribution-mode")?,
            filter: f.map_opt(7, "filter")?,
            default_outcome: Some(f.take(8)).filter(|v| !v.is_null()),
            outcomes: f.symbols(9, "outcomes")?,
            capabilities: f.symbols(10, "capabilities")?,
        })
    }
    pub fn to_value(&self) -> Value {
        list(
            d::SOURCE,
            vec![
                string(&self.address),
                opt(self.durable, Value::UInt),
                opt(self.expiry_policy.clone(), Value::Symbol),
                opt(self.timeout, Value::UInt),
                if self.dynamic {
                    Value::Bool(true)
                } else {
                    Value::Null
                },
                self.dynamic_node_properties.clone().unwrap_or(Value::Null),
                opt(self.distribution_mode.clone(), Value::Symbol),
                self.filter.clone().unwrap_or(Value::Null),
                self.default_outcome.clone().unwrap_or(Value::Null),
                symbols(&self.outcomes),
                symbols(&self.capabilities),
            ],
        )
    }
}

/// A terminus's target (where a sending link's messages go).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Target {
    pub address: Option<String>,
    pub durable: Option<u32>,
    pub expiry_policy: Option<String>,
    pub timeout: Option<u32>,
    pub dynamic: bool,
    pub dynamic_node_properties: Option<Value>,
    pub capabilities: Vec<String>,
}

impl Target {
    pub fn from_value(v: Value) -> R<Self> {
        let (code, mut f) = Fields::of(v)?;
        if code != d::TARGET {
            return Err(FieldError::UnknownDescriptor(Some(code)));
        }
        Ok(Target {
            address: address(&f, 0)?,
            durable: f.u32_opt(1, "durable")?,
            expiry_policy: f.symbol_opt(2, "expiry-policy")?,
            timeout: f.u32_opt(3, "timeout")?,
            dynamic: f.bool_or(4, "dynamic", false)?,
            dynamic_node_properties: f.map_opt(5, "dynamic-node-properties")?,
            capabilities: f.symbols(6, "capabilities")?,
        })
    }
    pub fn to_value(&self) -> Value {
        list(
            d::TARGET,
            vec![
                string(&self.address),
                opt(self.durable, Value::UInt),
                opt(self.expiry_policy.clone(), Value::Symbol),
                opt(self.timeout, Value::UInt),
                if self.dynamic {
                    Value::Bool(true)
                } else {
                    Value::Null
                },
                self.dynamic_node_properties.clone().unwrap_or(Value::Null),
                symbols(&self.capabilities),
            ],
        )
    }
}

/// A delivery's state: received (resume point) or one of the four outcomes.
#[derive(Clone, Debug, PartialEq)]
pub enum DeliveryState {
    Received {
        section_number: u32,
        section_offset: u64,
    },
    Accepted,
    Rejected {
        error: Option<Error>,
    },
    Released,
    Modified {
        delivery_failed: bool,
        undeliverable_here: bool,
        message_annotations: Option<Value>,
    },
    /// A state Warren does not act on (transactional states, say), kept as it came.
    Other(Value),
}

impl DeliveryState {
    pub fn from_value(v: Value) -> R<Self> {
        let code = v.descriptor_code();
        let Some(code @ (d::RECEIVED | d::ACCEPTED | d::REJECTED | d::RELEASED | d::MODIFIED)) =
            code
        else {
            return Ok(DeliveryState::Other(v));
        };
        let (_, mut f) = Fields::of(v)?;
        Ok(match code {
            d::RECEIVED => DeliveryState::Received {
                section_number: f.u32_req(0, "section-number")?,
                section_offset: f
                    .u64_opt(1, "section-offset")?
                    .ok_or(FieldError::Field("section-offset"))?,
            },
            d::ACCEPTED => DeliveryState::Accepted,
            d::REJECTED => DeliveryState::Rejected {
                error: f.error_opt(0)?,
            },
            d::RELEASED => DeliveryState::Released,
            _ => DeliveryState::Modified {
                delivery_failed: f.bool_or(0, "delivery-failed", false)?,
                undeliverable_here: f.bool_or(1, "undeliverable-here", false)?,
                message_annotations: f.map_opt(2, "message-annotations")?,
            },
        })
    }
    pub fn to_value(&self) -> Value {
        match self {
            DeliveryState::Received {
                section_number,
                section_offset,
            } => list(
                d::RECEIVED,
                vec![Value::UInt(*section_number), Value::ULong(*section_offset)],
            ),
            DeliveryState::Accepted => list(d::ACCEPTED, vec![]),
            DeliveryState::Rejected { error } => list(
                d::REJECTED,
                vec![error.as_ref().map_or(Value::Null, Error::to_value)],
            ),
            DeliveryState::Released => list(d::RELEASED, vec![]),
            DeliveryState::Modified {
                delivery_failed,
                undeliverable_here,
                message_annotations,
            } => list(
                d::MODIFIED,
                vec![
                    Value::Bool(*delivery_failed),
                    Value::Bool(*undeliverable_here),
                    message_annotations.clone().unwrap_or(Value::Null),
                ],
            ),
            DeliveryState::Other(v) => v.clone(),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Open {
    pub container_id: String,
    pub hostname: Option<String>,
    /// Defaults to u32::MAX (no limit beyond the 512-byte minimum).
    pub max_frame_size: u32,
    /// Defaults to 65535.
    pub channel_max: u16,
    /// Milliseconds.
    pub idle_time_out: Option<u32>,
    pub outgoing_locales: Vec<String>,
    pub incoming_locales: Vec<String>,
    pub offered_capabilities: Vec<String>,
    pub desired_capabilities: Vec<String>,
    pub properties: Option<Value>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Begin {
    pub remote_channel: Option<u16>,
    pub next_outgoing_id: u32,
    pub incoming_window: u32,
    pub outgoing_window: u32,
    /// Defaults to u32::MAX.
    pub handle_max: u32,
    pub offered_capabilities: Vec<String>,
    pub desired_capabilities: Vec<String>,
    pub properties: Option<Value>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Attach {
    pub name: String,
    pub handle: u32,
    pub role: Role,
    /// 0 unsettled, 1 settled, 2 mixed (the default).
    pub snd_settle_mode: u8,
    /// 0 first (the default), 1 second.
    pub rcv_settle_mode: u8,
    pub source: Option<Source>,
    pub target: Option<Target>,
    pub unsettled: Option<Value>,
    pub incomplete_unsettled: bool,
    pub initial_delivery_count: Option<u32>,
    pub max_message_size: Option<u64>,
    pub offered_capabilities: Vec<String>,
    pub desired_capabilities: Vec<String>,
    pub properties: Option<Value>,
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Flow {
    pub next_incoming_id: Option<u32>,
    pub incoming_window: u32,
    pub next_outgoing_id: u32,
    pub outgoing_window: u32,
    pub handle: Option<u32>,
    pub delivery_count: Option<u32>,
    pub link_credit: Option<u32>,
    pub available: Option<u32>,
    pub drain: bool,
    pub echo: bool,
    pub properties: Option<Value>,
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Transfer {
    pub handle: u32,
    pub delivery_id: Option<u32>,
    pub delivery_tag: Option<Bytes>,
    pub message_format: Option<u32>,
    pub settled: Option<bool>,
    pub more: bool,
    pub rcv_settle_mode: Option<u8>,
    pub state: Option<DeliveryState>,
    pub resume: bool,
    pub aborted: bool,
    pub batchable: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Disposition {
    pub role: Role,
    pub first: u32,
    pub last: Option<u32>,
    pub settled: bool,
    pub state: Option<DeliveryState>,
    pub batchable: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Detach {
    pub handle: u32,
    pub closed: bool,
    pub error: Option<Error>,
}

/// One transport performative: a frame body's first value.
#[derive(Clone, Debug, PartialEq)]
pub enum Performative {
    Open(Box<Open>),
    Begin(Begin),
    Attach(Box<Attach>),
    Flow(Flow),
    Transfer(Transfer),
    Disposition(Disposition),
    Detach(Detach),
    End(Option<Error>),
    Close(Option<Error>),
}

fn bool_field(b: bool) -> Value {
    if b { Value::Bool(true) } else { Value::Null }
}

fn state_opt(v: Value) -> R<Option<DeliveryState>> {
    if v.is_null() {
        Ok(None)
    } else {
        DeliveryState::from_value(v).map(Some)
    }
}

impl Performative {
    pub fn name(&self) -> &'static str {
        match self {
            Performative::Open(_) => "open",
            Performative::Begin(_) => "begin",
            Performative::Attach(_) => "attach",
            Performative::Flow(_) => "flow",
            Performative::Transfer(_) => "transfer",
            Performative::Disposition(_) => "disposition",
            Performative::Detach(_) => "detach",
            Performative::End(_) => "end",
            Performative::Close(_) => "close",
        }
    }

    pub fn from_value(v: Value) -> R<Self> {
        let (code, mut f) = Fields::of(v)?;
        Ok(match code {
            d::OPEN => Performative::Open(Box::new(Open {
                container_id: f
                    .string_opt(0, "container-id")?
                    .ok_or(FieldError::Field("container-id"))?,
                hostname: f.string_opt(1, "hostname")?,
                max_frame_size: f.u32_opt(2, "max-frame-size")?.unwrap_or(u32::MAX),
                channel_max: f.u16_opt(3, "channel-max")?.unwrap_or(u16::MAX),
                idle_time_out: f.u32_opt(4, "idle-time-out")?,
                outgoing_locales: f.symbols(5, "outgoing-locales")?,
                incoming_locales: f.symbols(6, "incoming-locales")?,
                offered_capabilities: f.symbols(7, "offered-capabilities")?,
                desired_capabilities: f.symbols(8, "desired-capabilities")?,
                properties: f.map_opt(9, "properties")?,
            })),
            d::BEGIN => Performative::Begin(Begin {
                remote_channel: f.u16_opt(0, "remote-channel")?,
                next_outgoing_id: f.u32_req(1, "next-outgoing-id")?,
                incoming_window: f.u32_req(2, "incoming-window")?,
                outgoing_window: f.u32_req(3, "outgoing-window")?,
                handle_max: f.u32_opt(4, "handle-max")?.unwrap_or(u32::MAX),
                offered_capabilities: f.symbols(5, "offered-capabilities")?,
                desired_capabilities: f.symbols(6, "desired-capabilities")?,
                properties: f.map_opt(7, "properties")?,
            }),
            d::ATTACH => Performative::Attach(Box::new(Attach {
                name: f.string_opt(0, "name")?.ok_or(FieldError::Field("name"))?,
                handle: f.u32_req(1, "handle")?,
                role: Role::from_bool(f.bool_opt(2, "role")?.ok_or(FieldError::Field("role"))?),
                snd_settle_mode: f.u8_opt(3, "snd-settle-mode")?.unwrap_or(2),
                rcv_settle_mode: f.u8_opt(4, "rcv-settle-mode")?.unwrap_or(0),
                source: match f.take(5) {
                    Value::Null => None,
                    v => Some(Source::from_value(v)?),
                },
                target: match f.take(6) {
                    Value::Null => None,
                    v => Some(Target::from_value(v)?),
                },
                unsettled: f.map_opt(7, "unsettled")?,
                incomplete_unsettled: f.bool_or(8, "incomplete-unsettled", false)?,
                initial_delivery_count: f.u32_opt(9, "initial-delivery-count")?,
                max_message_size: f.u64_opt(10, "max-message-size")?,
                offered_capabilities: f.symbols(11, "offered-capabilities")?,
                desired_capabilities: f.symbols(12, "desired-capabilities")?,
                properties: f.map_opt(13, "properties")?,
            })),
            d::FLOW => Performative::Flow(Flow {
                next_incoming_id: f.u32_opt(0, "next-incoming-id")?,
                incoming_window: f.u32_req(1, "incoming-window")?,
                next_outgoing_id: f.u32_req(2, "next-outgoing-id")?,
                outgoing_window: f.u32_req(3, "outgoing-window")?,
                handle: f.u32_opt(4, "handle")?,
                delivery_count: f.u32_opt(5, "delivery-count")?,
                link_credit: f.u32_opt(6, "link-credit")?,
                available: f.u32_opt(7, "available")?,
                drain: f.bool_or(8, "drain", false)?,
                echo: f.bool_or(9, "echo", false)?,
                properties: f.map_opt(10, "properties")?,
            }),
            d::TRANSFER => Performative::Transfer(Transfer {
                handle: f.u32_req(0, "handle")?,
                delivery_id: f.u32_opt(1, "delivery-id")?,
                delivery_tag: f.binary_opt(2, "delivery-tag")?,
                message_format: f.u32_opt(3, "message-format")?,
                settled: f.bool_opt(4, "settled")?,
                more: f.bool_or(5, "more", false)?,
                rcv_settle_mode: f.u8_opt(6, "rcv-settle-mode")?,
                state: state_opt(f.take(7))?,
                resume: f.bool_or(8, "resume", false)?,
                aborted: f.bool_or(9, "aborted", false)?,
                batchable: f.bool_or(10, "batchable", false)?,
            }),
            d::DISPOSITION => Performative::Disposition(Disposition {
                role: Role::from_bool(f.bool_opt(0, "role")?.ok_or(FieldError::Field("role"))?),
                first: f.u32_req(1, "first")?,
                last: f.u32_opt(2, "last")?,
                settled: f.bool_or(3, "settled", false)?,
                state: state_opt(f.take(4))?,
                batchable: f.bool_or(5, "batchable", false)?,
            }),
            d::DETACH => Performative::Detach(Detach {
                handle: f.u32_req(0, "handle")?,
                closed: f.bool_or(1, "closed", false)?,
                error: f.error_opt(2)?,
            }),
            d::END => Performative::End(f.error_opt(0)?),
            d::CLOSE => Performative::Close(f.error_opt(0)?),
            other => return Err(FieldError::UnknownDescriptor(Some(other))),
        })
    }

    pub fn to_value(&self) -> Value {
        match self {
            Performative::Open(o) => list(
                d::OPEN,
                vec![
                    Value::String(o.container_id.clone()),
                    string(&o.hostname),
                    if o.max_frame_size == u32::MAX {
                        Value::Null
                    } else {
                        Value::UInt(o.max_frame_size)
                    },
                    if o.channel_max == u16::MAX {
                        Value::Null
                    } else {
                        Value::UShort(o.channel_max)
                    },
                    opt(o.idle_time_out, Value::UInt),
                    symbols(&o.outgoing_locales),
                    symbols(&o.incoming_locales),
                    symbols(&o.offered_capabilities),
                    symbols(&o.desired_capabilities),
                    o.properties.clone().unwrap_or(Value::Null),
                ],
            ),
            Performative::Begin(b) => list(
                d::BEGIN,
                vec![
                    opt(b.remote_channel, Value::UShort),
                    Value::UInt(b.next_outgoing_id),
                    Value::UInt(b.incoming_window),
                    Value::UInt(b.outgoing_window),
                    if b.handle_max == u32::MAX {
                        Value::Null
                    } else {
                        Value::UInt(b.handle_max)
                    },
                    symbols(&b.offered_capabilities),
                    symbols(&b.desired_capabilities),
                    b.properties.clone().unwrap_or(Value::Null),
                ],
            ),
            Performative::Attach(a) => list(
                d::ATTACH,
                vec![
                    Value::String(a.name.clone()),
                    Value::UInt(a.handle),
                    a.role.to_value(),
                    if a.snd_settle_mode == 2 {
                        Value::Null
                    } else {
                        Value::UByte(a.snd_settle_mode)
                    },
                    if a.rcv_settle_mode == 0 {
                        Value::Null
                    } else {
                        Value::UByte(a.rcv_settle_mode)
                    },
                    a.source.as_ref().map_or(Value::Null, Source::to_value),
                    a.target.as_ref().map_or(Value::Null, Target::to_value),
                    a.unsettled.clone().unwrap_or(Value::Null),
                    bool_field(a.incomplete_unsettled),
                    opt(a.initial_delivery_count, Value::UInt),
                    opt(a.max_message_size, Value::ULong),
                    symbols(&a.offered_capabilities),
                    symbols(&a.desired_capabilities),
                    a.properties.clone().unwrap_or(Value::Null),
                ],
            ),
            Performative::Flow(fl) => list(
                d::FLOW,
                vec![
                    opt(fl.next_incoming_id, Value::UInt),
                    Value::UInt(fl.incoming_window),
                    Value::UInt(fl.next_outgoing_id),
                    Value::UInt(fl.outgoing_window),
                    opt(fl.handle, Value::UInt),
                    opt(fl.delivery_count, Value::UInt),
                    opt(fl.link_credit, Value::UInt),
                    opt(fl.available, Value::UInt),
                    bool_field(fl.drain),
                    bool_field(fl.echo),
                    fl.properties.clone().unwrap_or(Value::Null),
                ],
            ),
            Performative::Transfer(t) => list(
                d::TRANSFER,
                vec![
                    Value::UInt(t.handle),
                    opt(t.delivery_id, Value::UInt),
                    opt(t.delivery_tag.clone(), Value::Binary),
                    opt(t.message_format, Value::UInt),
                    opt(t.settled, Value::Bool),
                    bool_field(t.more),
                    opt(t.rcv_settle_mode, Value::UByte),
                    t.state
                        .as_ref()
                        .map_or(Value::Null, DeliveryState::to_value),
                    bool_field(t.resume),
                    bool_field(t.aborted),
                    bool_field(t.batchable),
                ],
            ),
            Performative::Disposition(di) => list(
                d::DISPOSITION,
                vec![
                    di.role.to_value(),
                    Value::UInt(di.first),
                    opt(di.last, Value::UInt),
                    bool_field(di.settled),
                    di.state
                        .as_ref()
                        .map_or(Value::Null, DeliveryState::to_value),
                    bool_field(di.batchable),
                ],
            ),
            Performative::Detach(de) => list(
                d::DETACH,
                vec![
                    Value::UInt(de.handle),
                    bool_field(de.closed),
                    de.error.as_ref().map_or(Value::Null, Error::to_value),
                ],
            ),
            Performative::End(e) => list(
                d::END,
                vec![e.as_ref().map_or(Value::Null, Error::to_value)],
            ),
            Performative::Close(e) => list(
                d::CLOSE,
                vec![e.as_ref().map_or(Value::Null, Error::to_value)],
            ),
        }
    }
}

/// The SASL frames (frame type 1).
#[derive(Clone, Debug, PartialEq)]
pub enum Sasl {
    Mechanisms(Vec<String>),
    Init {
        mechanism: String,
        initial_response: Option<Bytes>,
        hostname: Option<String>,
    },
    Challenge(Bytes),
    Response(Bytes),
    /// 0 ok, 1 auth, 2 sys, 3 sys-perm, 4 sys-temp.
    Outcome {
        code: u8,
        additional_data: Option<Bytes>,
    },
}

impl Sasl {
    pub fn from_value(v: Value) -> R<Self> {
        let (code, f) = Fields::of(v)?;
        Ok(match code {
            d::SASL_MECHANISMS => Sasl::Mechanisms(f.symbols(0, "sasl-server-mechanisms")?),
            d::SASL_INIT => Sasl::Init {
                mechanism: f
                    .symbol_opt(0, "mechanism")?
                    .ok_or(FieldError::Field("mechanism"))?,
                initial_response: f.binary_opt(1, "initial-response")?,
                hostname: f.string_opt(2, "hostname")?,
            },
            d::SASL_CHALLENGE => Sasl::Challenge(
                f.binary_opt(0, "challenge")?
                    .ok_or(FieldError::Field("challenge"))?,
            ),
            d::SASL_RESPONSE => Sasl::Response(
                f.binary_opt(0, "response")?
                    .ok_or(FieldError::Field("response"))?,
            ),
            d::SASL_OUTCOME => Sasl::Outcome {
                code: f.u8_opt(0, "code")?.ok_or(FieldError::Field("code"))?,
                additional_data: f.binary_opt(1, "additional-data")?,
            },
            other => return Err(FieldError::UnknownDescriptor(Some(other))),
        })
    }

    pub fn to_value(&self) -> Value {
        match self {
            Sasl::Mechanisms(m) => list(
                d::SASL_MECHANISMS,
                // Mandatory: an array even when empty.
                vec![Value::Array(
                    m.iter().map(|s| Value::Symbol(s.clone())).collect(),
                )],
            ),
            Sasl::Init {
                mechanism,
                initial_response,
                hostname,
            } => list(
                d::SASL_INIT,
                vec![
                    Value::Symbol(mechanism.clone()),
                    opt(initial_response.clone(), Value::Binary),
                    string(hostname),
                ],
            ),
            Sasl::Challenge(b) => list(d::SASL_CHALLENGE, vec![Value::Binary(b.clone())]),
            Sasl::Response(b) => list(d::SASL_RESPONSE, vec![Value::Binary(b.clone())]),
            Sasl::Outcome {
                code,
                additional_data,
            } => list(
                d::SASL_OUTCOME,
                vec![
                    Value::UByte(*code),
                    opt(additional_data.clone(), Value::Binary),
                ],
            ),
        }
    }
}
