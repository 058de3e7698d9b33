//! RabbitMQ 4's AMQP 1.0 addresses ("v2"), how a link names what it publishes to or consumes
//! from:
//!
//! | address                               | as a target (publish)                       | as a source |
//! |---------------------------------------|---------------------------------------------|-------------|
//! | `/exchanges/:exchange/:routing-key`   | that exchange, that routing key             | refused     |
//! | `/exchanges/:exchange`                | that exchange, each message's `subject` as the routing key (empty without one) | refused |
//! | `/queues/:queue`                      | the default exchange, routing key `:queue`  | that queue  |
//! | null                                  | each message's `to` property, one of the three above | refused |
//!
//! Each name is one percent-encoded path segment (RFC 3986): a `/` in a routing key is `%2F`.
//! The default exchange has no `/exchanges/` form (`amq.default` is refused there, as in
//! RabbitMQ): `/queues/:queue` names it. RabbitMQ 3's "v1" forms (`/queue/q`, `/exchange/x/k`,
//! bare names) are refused with the same error, `amqp:invalid-field`, rather than guessed at.

/// Why a string is not a v2 address.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("address {0:?} is not /exchanges/:exchange[/:routing-key] or /queues/:queue")]
    Format(String),
    #[error("address {0:?}: bad percent-encoding")]
    Encoding(String),
    #[error("address {0:?}: the default exchange is addressed as /queues/:queue")]
    DefaultExchange(String),
    #[error("address {0:?} cannot be consumed from: sources are /queues/:queue")]
    NotASource(String),
    #[error("a null target address needs each message's `to` property")]
    MissingTo,
}

impl AddressError {
    /// The AMQP 1.0 error condition a link is refused (or a message rejected) with.
    pub fn condition(&self) -> &'static str {
        crate::performatives::condition::INVALID_FIELD
    }
}

/// Where a sending link's messages go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// An exchange; `routing_key` `None` takes each message's `subject`.
    Exchange {
        exchange: String,
        routing_key: Option<String>,
    },
    /// A queue, through the default exchange.
    Queue(String),
    /// The null address: each message's `to` says (RabbitMQ's "anonymous terminus").
    PerMessage,
}

/// Where a receiving link's messages come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Queue(String),
}

/// A concrete destination: the exchange ("" is the default one) and routing key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub exchange: String,
    pub routing_key: String,
}

/// A `/exchanges/...` or `/queues/...` address.
fn node(address: &str) -> Result<Target, AddressError> {
    let bad = || AddressError::Format(address.to_string());
    let rest = address.strip_prefix('/').ok_or_else(bad)?;
    let mut parts = rest.split('/');
    let kind = parts.next().ok_or_else(bad)?;
    let first = parts.next().ok_or_else(bad)?;
    let second = parts.next();
    if parts.next().is_some() || first.is_empty() {
        return Err(bad());
    }
    let name = decode(first, address)?;
    match (kind, second) {
        ("queues", None) => Ok(Target::Queue(name)),
        ("exchanges", _) if name == "amq.default" => {
            Err(AddressError::DefaultExchange(address.to_string()))
        }
        ("exchanges", None) => Ok(Target::Exchange {
            exchange: name,
            routing_key: None,
        }),
        ("exchanges", Some(key)) => Ok(Target::Exchange {
            exchange: name,
            routing_key: Some(decode(key, address)?),
        }),
        _ => Err(bad()),
    }
}

/// A sending link's target address (`None`: the null address).
pub fn parse_target(address: Option<&str>) -> Result<Target, AddressError> {
    match address {
        None => Ok(Target::PerMessage),
        Some(a) => node(a),
    }
}

/// A receiving link's source address.
pub fn parse_source(address: Option<&str>) -> Result<Source, AddressError> {
    match address {
        Some(a) => match node(a)? {
            Target::Queue(q) => Ok(Source::Queue(q)),
            _ => Err(AddressError::NotASource(a.to_string())),
        },
        None => Err(AddressError::NotASource(String::new())),
    }
}

impl Target {
    /// Where one message goes, given its `to` and `subject` properties.
    pub fn route(&self, to: Option<&str>, subject: Option<&str>) -> Result<Route, AddressError> {
        match self {
            Target::Queue(q) => Ok(Route {
                exchange: String::new(),
                routing_key: q.clone(),
            }),
            Target::Exchange {
                exchange,
                routing_key,
            } => Ok(Route {
                exchange: exchange.clone(),
                routing_key: routing_key
                    .clone()
                    .or_else(|| subject.map(str::to_string))
                    .unwrap_or_default(),
            }),
            Target::PerMessage => match node(to.ok_or(AddressError::MissingTo)?)? {
                // A `to` of the null form cannot happen (it is a string); recursion depth 1.
                t @ (Target::Queue(_) | Target::Exchange { .. }) => t.route(None, subject),
                Target::PerMessage => Err(AddressError::MissingTo),
            },
        }
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// One percent-encoded segment, decoded (UTF-8).
fn decode(segment: &str, address: &str) -> Result<String, AddressError> {
    let bad = || AddressError::Encoding(address.to_string());
    let b = segment.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hi = b.get(i + 1).copied().and_then(hex).ok_or_else(bad)?;
            let lo = b.get(i + 2).copied().and_then(hex).ok_or_else(bad)?;
            out.push(hi << 4 | lo);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// One percent-encoded path segment, decoded (`None`: bad encoding or not UTF-8). The
/// management node's paths use the same encoding as addresses.
pub fn decode_segment(segment: &str) -> Option<String> {
    decode(segment, segment).ok()
}

/// `name` as one path segment: RFC 3986's unreserved characters stay, the rest is `%XX`
/// (what RabbitMQ's clients send).
pub fn encode(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The v2 address of a queue.
pub fn queue_address(queue: &str) -> String {
    format!("/queues/{}", encode(queue))
}

/// The v2 address of an exchange, with a routing key or without.
pub fn exchange_address(exchange: &str, routing_key: Option<&str>) -> String {
    match routing_key {
        Some(k) => format!("/exchanges/{}/{}", encode(exchange), encode(k)),
        None => format!("/exchanges/{}", encode(exchange)),
    }
}
