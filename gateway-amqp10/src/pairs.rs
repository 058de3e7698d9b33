//! The management node's link pairs on one connection (Link Pair CS 01, as RabbitMQ 4 runs
//! them): the client attaches a sender with target `/management` and a receiver with source
//! `/management`, both with the same link name and the link property `paired: true`, on one
//! session. Requests come in on the first, responses go out on the second.
//!
//! Sans-IO like the session: [`Pairs`] drives a [`Connection`] and pushes core ops; the
//! shell does the admin look-ups it lists ([`Pairs::take_lookups`]). Each pair has a core
//! channel of its own and serves its requests one at a time, in order; a core channel
//! error answers the request and the channel is reopened for the next one.
//!
//! Bounds: the request link's credit is [`MAX_CREDIT`] and is renewed only as requests are
//! answered, so a pair never holds more than that many requests and responses.

use crate::management::{self, ADDRESS, Exchange, MAX_CREDIT, Next, Response};
use crate::performatives::{DeliveryState, Error, Role, Source, Target, condition};
use crate::session::Connection;
use crate::types::Value;
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use warren_core::admin::QueueInfo;
use warren_core::command::Op;
use warren_core::effect::{Effect, Reply};
use warren_core::escape::Escaped;

/// Which half of a pair a link is, from the client's view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// The client's sender (target `/management`): requests.
    Requests,
    /// The client's receiver (source `/management`): responses.
    Responses,
}

/// The half of the management pair an attach asks for, if it names the node.
pub fn half(role: Role, source: Option<&Source>, target: Option<&Target>) -> Option<Half> {
    let is_node = |a: Option<&str>| a == Some(ADDRESS);
    match role {
        Role::Sender if is_node(target.and_then(|t| t.address.as_deref())) => Some(Half::Requests),
        Role::Receiver if is_node(source.and_then(|s| s.address.as_deref())) => {
            Some(Half::Responses)
        }
        _ => None,
    }
}

/// Whether the attach's properties carry `paired: true` (RabbitMQ's `check_paired`).
fn paired(properties: Option<&Value>) -> bool {
    match properties {
        Some(Value::Map(m)) => m
            .iter()
            .any(|(k, v)| k.text() == Some("paired") && *v == Value::Bool(true)),
        _ => false,
    }
}

type Key = (u16, String);

struct Pair {
    core: u16,
    requests: Option<u32>,
    responses: Option<u32>,
    /// Credit the client still has on the request link.
    request_credit: u32,
    /// What we may still send on the response link, and our delivery-count there.
    response_credit: u32,
    response_count: u32,
    /// Requests not yet started (their correlation id and action, or an early failure).
    waiting: VecDeque<(
        Value,
        Result<management::Action, management::Failure>,
        String,
    )>,
    /// The request being served, what it asked, and the method and path for the log.
    current: Option<(Value, Exchange, String)>,
    /// A look-up the shell must do for `current`.
    lookup: Option<String>,
    /// Responses waiting for credit on the response link.
    out: VecDeque<Bytes>,
    /// The core channel was closed by an error: reopen it before the next op.
    reopen: bool,
}

impl Pair {
    fn held(&self) -> u32 {
        let n = self.waiting.len() + usize::from(self.current.is_some()) + self.out.len();
        u32::try_from(n).unwrap_or(u32::MAX)
    }
}

/// The link pairs of one connection.
#[derive(Default)]
pub struct Pairs {
    pairs: HashMap<Key, Pair>,
    by_handle: HashMap<(u16, u32), Key>,
    by_core: HashMap<u16, Key>,
    /// The connection's vhost (texts, look-ups) and this broker's name in queue answers.
    vhost: String,
    node: String,
}

impl Pairs {
    pub fn new(vhost: &str, node: &str) -> Pairs {
        Pairs {
            vhost: vhost.to_string(),
            node: node.to_string(),
            ..Pairs::default()
        }
    }

    pub fn set_vhost(&mut self, vhost: &str) {
        self.vhost = vhost.to_string();
    }

    pub fn vhost(&self) -> &str {
        &self.vhost
    }

    /// Whether `(channel, handle)` is a half of a pair.
    pub fn owns_link(&self, channel: u16, handle: u32) -> bool {
        self.by_handle.contains_key(&(channel, handle))
    }

    /// Whether core channel `core` is a pair's.
    pub fn owns_core(&self, core: u16) -> bool {
        self.by_core.contains_key(&core)
    }

    /// A half attached; false when it was refused. `next_core` gives a new pair its core
    /// channel (`None`: the connection has none left).
    #[allow(clippy::too_many_arguments)]
    pub fn attach(
        &mut self,
        conn: &mut Connection,
        now: u64,
        channel: u16,
        handle: u32,
        name: String,
        half: Half,
        source: Option<Source>,
        target: Option<Target>,
        properties: Option<Value>,
        next_core: &mut dyn FnMut() -> Option<u16>,
        ops: &mut Vec<(u16, Op)>,
    ) -> bool {
        if !paired(properties.as_ref()) {
            tracing::info!(link = %Escaped(&name), "AMQP 1.0 management link refused: not paired");
            conn.refuse_link(
                now,
                channel,
                handle,
                name,
                Error::new(
                    condition::INVALID_FIELD,
                    "Link property 'paired' is not set to boolean value 'true'",
                ),
            );
            return false;
        }
        let key = (channel, name.clone());
        let pair = match self.pairs.get_mut(&key) {
            Some(p) => p,
            None => {
                let Some(core) = next_core() else {
                    conn.refuse_link(
                        now,
                        channel,
                        handle,
                        name,
                        Error::new(
                            condition::RESOURCE_LIMIT_EXCEEDED,
                            "too many links on this connection",
                        ),
                    );
                    return false;
                };
                ops.push((core, Op::ChannelOpen));
                self.by_core.insert(core, key.clone());
                self.pairs.entry(key.clone()).or_insert(Pair {
                    core,
                    requests: None,
                    responses: None,
                    request_credit: 0,
                    response_credit: 0,
                    response_count: 0,
                    waiting: VecDeque::new(),
                    current: None,
                    lookup: None,
                    out: VecDeque::new(),
                    reopen: false,
                })
            }
        };
        let slot = match half {
            Half::Requests => &mut pair.requests,
            Half::Responses => &mut pair.responses,
        };
        if slot.is_some() {
            // RabbitMQ: "received invalid attach ... for management link pair".
            tracing::info!(link = %Escaped(&name), "AMQP 1.0 management link refused: half already attached");
            conn.refuse_link(
                now,
                channel,
                handle,
                name,
                Error::new(
                    condition::PRECONDITION_FAILED,
                    "this half of the management link pair is already attached",
                ),
            );
            return false;
        }
        *slot = Some(handle);
        self.by_handle.insert((channel, handle), key);
        let credit = match half {
            Half::Requests => MAX_CREDIT,
            Half::Responses => 0,
        };
        if half == Half::Requests {
            pair.request_credit = MAX_CREDIT;
        }
        conn.accept_paired_link(
            now, channel, handle, name, source, target, credit, properties,
        );
        true
    }

    /// A request arrived on the request half.
    #[allow(clippy::too_many_arguments)]
    pub fn on_request(
        &mut self,
        conn: &mut Connection,
        now: u64,
        channel: u16,
        handle: u32,
        delivery_id: u32,
        settled: bool,
        payload: &Bytes,
        ops: &mut Vec<(u16, Op)>,
    ) {
        let Some(key) = self.by_handle.get(&(channel, handle)).cloned() else {
            return;
        };
        let Some(pair) = self.pairs.get_mut(&key) else {
            return;
        };
        if pair.requests != Some(handle) {
            // A transfer on the response half: the client sends where it receives.
            conn.end_session(
                now,
                channel,
                Error::new(
                    condition::UNATTACHED_HANDLE,
                    "transfer on the management pair's response link",
                ),
            );
            return;
        }
        if pair.responses.is_none() {
            tracing::info!(link = %Escaped(&key.1), "AMQP 1.0 management request on a half open link pair");
            // RabbitMQ's answer, on the session (its protocol_error).
            conn.end_session(
                now,
                channel,
                Error::new(
                    condition::PRECONDITION_FAILED,
                    "received transfer on half open management link pair",
                ),
            );
            return;
        }
        if !settled {
            // RabbitMQ takes only settled requests (its clients send them so); an
            // unsettled one is accepted here, since the response is the answer anyway.
            conn.settle(
                now,
                channel,
                delivery_id,
                delivery_id,
                DeliveryState::Accepted,
            );
        }
        pair.request_credit = pair.request_credit.saturating_sub(1);
        let (correlation, action, what) = match management::parse_request(payload) {
            Ok(r) => {
                let what = format!("{} {}", r.method, r.path);
                let action = management::route(&r, &self.vhost);
                (r.message_id, action, what)
            }
            Err(f) => (Value::Null, Err(f), "(undecodable)".to_string()),
        };
        pair.waiting.push_back((correlation, action, what));
        self.pump(conn, now, &key, ops);
    }

    /// The client gave credit on a response half.
    #[allow(clippy::too_many_arguments)]
    pub fn on_credit(
        &mut self,
        conn: &mut Connection,
        now: u64,
        channel: u16,
        handle: u32,
        credit: u32,
        delivery_count: Option<u32>,
        ops: &mut Vec<(u16, Op)>,
    ) {
        let Some(key) = self.by_handle.get(&(channel, handle)).cloned() else {
            return;
        };
        let Some(pair) = self.pairs.get_mut(&key) else {
            return;
        };
        if pair.responses != Some(handle) {
            return;
        }
        // 2.6.7: what we may send is the receiver's count plus its credit minus ours.
        // A flow that has not seen all we sent yet counts ours out of its credit; one from
        // before our count (beyond its credit once wrapped) leaves none.
        let theirs = delivery_count.unwrap_or(0);
        let left = theirs
            .wrapping_add(credit)
            .wrapping_sub(pair.response_count);
        pair.response_credit = if left > credit { 0 } else { left };
        self.pump(conn, now, &key, ops);
    }

    /// A half detached (by the client or by us): a pair that loses both is gone, with its
    /// core channel.
    pub fn on_detached(&mut self, channel: u16, handle: u32, ops: &mut Vec<(u16, Op)>) {
        let Some(key) = self.by_handle.remove(&(channel, handle)) else {
            return;
        };
        let Some(pair) = self.pairs.get_mut(&key) else {
            return;
        };
        if pair.requests == Some(handle) {
            pair.requests = None;
        }
        if pair.responses == Some(handle) {
            pair.responses = None;
            // Nothing can be answered any more.
            pair.out.clear();
            pair.waiting.clear();
        }
        if pair.requests.is_none() && pair.responses.is_none() {
            let core = pair.core;
            self.pairs.remove(&key);
            self.by_core.remove(&core);
            ops.push((core, Op::ChannelClose));
        }
    }

    /// The session on `channel` ended: its pairs are gone.
    pub fn on_ended(&mut self, channel: u16, ops: &mut Vec<(u16, Op)>) {
        let handles: Vec<u32> = self
            .by_handle
            .keys()
            .filter(|(c, _)| *c == channel)
            .map(|(_, h)| *h)
            .collect();
        for h in handles {
            self.on_detached(channel, h, ops);
        }
    }

    /// An effect on a pair's core channel (see [`Pairs::owns_core`]).
    pub fn on_effect(
        &mut self,
        conn: &mut Connection,
        now: u64,
        effect: Effect,
        ops: &mut Vec<(u16, Op)>,
    ) {
        let (core, answer) = match effect {
            Effect::Reply { ch, reply } => match reply {
                // The channel's own life: not an answer to a request.
                Reply::ChannelOpenOk | Reply::ChannelCloseOk => return,
                r => (ch.channel, Ok(r)),
            },
            Effect::ChannelError { ch, error } => {
                // The host's half of the close; the pair reopens the channel when it
                // sends its next op.
                ops.push((ch.channel, Op::ChannelCloseOk));
                if let Some(key) = self.by_core.get(&ch.channel)
                    && let Some(pair) = self.pairs.get_mut(key)
                {
                    pair.reopen = true;
                }
                (ch.channel, Err(error))
            }
            _ => return,
        };
        let Some(key) = self.by_core.get(&core).cloned() else {
            return;
        };
        let Some(pair) = self.pairs.get_mut(&key) else {
            return;
        };
        let Some((correlation, mut exchange, what)) = pair.current.take() else {
            return;
        };
        let next = exchange.on_core(answer);
        pair.current = Some((correlation, exchange, what));
        self.advance(conn, now, &key, next, ops);
    }

    /// The look-ups to do, as (pair, queue name): answer each with [`Pairs::on_lookup`].
    pub fn take_lookups(&mut self) -> Vec<(Key, String)> {
        self.pairs
            .iter_mut()
            .filter_map(|(k, p)| p.lookup.take().map(|q| (k.clone(), q)))
            .collect()
    }

    pub fn on_lookup(
        &mut self,
        conn: &mut Connection,
        now: u64,
        key: &Key,
        info: Option<&QueueInfo>,
        ops: &mut Vec<(u16, Op)>,
    ) {
        let Some(pair) = self.pairs.get_mut(key) else {
            return;
        };
        let Some((correlation, mut exchange, what)) = pair.current.take() else {
            return;
        };
        let next = exchange.on_queue(info);
        pair.current = Some((correlation, exchange, what));
        self.advance(conn, now, key, next, ops);
    }

    fn advance(
        &mut self,
        conn: &mut Connection,
        now: u64,
        key: &Key,
        next: Next,
        ops: &mut Vec<(u16, Op)>,
    ) {
        let Some(pair) = self.pairs.get_mut(key) else {
            return;
        };
        match next {
            Next::Op(op) => {
                if pair.reopen {
                    pair.reopen = false;
                    ops.push((pair.core, Op::ChannelOpen));
                }
                ops.push((pair.core, op));
            }
            Next::Lookup(q) => pair.lookup = Some(q),
            Next::Done(response) => {
                if let Some((correlation, _, what)) = pair.current.take() {
                    Self::respond(pair, &correlation, &what, &response);
                }
                self.pump(conn, now, key, ops);
            }
        }
    }

    fn respond(pair: &mut Pair, correlation: &Value, what: &str, response: &Response) {
        if response.status >= 400 {
            let text = match &response.body {
                Value::String(s) => s.as_str(),
                _ => "",
            };
            // RabbitMQ's log line: "request ~ts ~ts failed: ~ts".
            tracing::warn!(
                request = %Escaped(what),
                status = response.status,
                "AMQP 1.0 management request failed: {}",
                Escaped(text)
            );
        }
        pair.out
            .push_back(management::encode_response(correlation, response));
    }

    /// Sends what credit allows, starts the next request when none is in progress, and
    /// renews the request link's credit as room frees.
    fn pump(&mut self, conn: &mut Connection, now: u64, key: &Key, ops: &mut Vec<(u16, Op)>) {
        loop {
            let Some(pair) = self.pairs.get_mut(key) else {
                return;
            };
            let (channel, _) = key;
            if let Some(responses) = pair.responses {
                while pair.response_credit > 0
                    && let Some(payload) = pair.out.pop_front()
                {
                    pair.response_credit -= 1;
                    pair.response_count = pair.response_count.wrapping_add(1);
                    conn.send_message(now, *channel, responses, Bytes::new(), true, &payload);
                }
            }
            if pair.current.is_none()
                && let Some((correlation, action, what)) = pair.waiting.pop_front()
            {
                match action {
                    Ok(action) => {
                        let (exchange, next) = Exchange::start(action, &self.vhost, &self.node);
                        pair.current = Some((correlation, exchange, what));
                        self.advance(conn, now, key, next, ops);
                        // `advance` pumps again when the answer is immediate.
                        continue;
                    }
                    Err(f) => {
                        Self::respond(pair, &correlation, &what, &f.into());
                        continue;
                    }
                }
            }
            if let Some(requests) = pair.requests
                && pair.request_credit + pair.held() <= MAX_CREDIT / 2
            {
                pair.request_credit = MAX_CREDIT - pair.held().min(MAX_CREDIT);
                conn.grant_credit(now, *channel, requests, pair.request_credit);
            }
            return;
        }
    }
}
