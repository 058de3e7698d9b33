//! The channel table of an open connection and what arrives on channels 1..=channel_max:
//! methods become core ops, publishes are assembled from their content frames, and a channel
//! we closed for an error drops everything but its close handshake.

use crate::codec;
use crate::confirms::Confirmed;
use crate::content::Content;
use crate::error::GatewayError;
use crate::methods::{self, Incoming, method_name};
use amq_protocol::frame::AMQPContentHeader;
use amq_protocol::protocol::AMQPClass;
use bytes::{Bytes, BytesMut};
use std::collections::HashMap;
use std::sync::Arc;
use warren_core::command::{Op, Publish};
use warren_core::error::ErrorCode;

#[derive(Default)]
pub(crate) struct ChannelState {
    /// We sent channel.close (a channel error) and wait for close-ok; frames are dropped.
    pub(crate) closing: bool,
    pub(crate) content: Option<Content>,
    /// Publisher confirms sent, for collapsing acks.
    pub(crate) confirmed: Confirmed,
    /// The exchange and routing key of the last publish: publishers mostly repeat them, and
    /// sharing the `Arc` saves two allocations and copies per message.
    last_address: Option<(Arc<str>, Arc<str>)>,
}

/// Where frames for the channels go: frames to the client, ops to the core.
pub(crate) struct Out<'a> {
    pub(crate) bytes: &'a mut BytesMut,
    pub(crate) ops: &'a mut Vec<(u16, Op)>,
    /// For log lines.
    pub(crate) peer: &'a str,
}

/// The open channels, by number.
pub(crate) struct Channels {
    map: HashMap<u16, ChannelState>,
    channel_max: u16,
    max_message_size: u64,
}

/// What a frame on a channel did that the connection must know.
#[derive(Debug, PartialEq)]
pub(crate) enum Done {
    Nothing,
    /// A message was published (the connection counts as a publisher from now on).
    Published,
}

impl Channels {
    pub(crate) fn new(channel_max: u16, max_message_size: u64) -> Channels {
        Channels {
            map: HashMap::new(),
            channel_max,
            max_message_size,
        }
    }

    pub(crate) fn get(&self, ch: u16) -> Option<&ChannelState> {
        self.map.get(&ch)
    }

    pub(crate) fn get_mut(&mut self, ch: u16) -> Option<&mut ChannelState> {
        self.map.get_mut(&ch)
    }

    pub(crate) fn remove(&mut self, ch: u16) {
        self.map.remove(&ch);
    }

    /// A method on channel `ch` (not 0).
    pub(crate) fn on_method(
        &mut self,
        ch: u16,
        method: AMQPClass,
        out: Out<'_>,
    ) -> Result<Done, GatewayError> {
        if ch > self.channel_max {
            return Err(GatewayError::Channel(format!(
                "channel {ch} exceeds the negotiated channel_max {}",
                self.channel_max
            )));
        }
        // Only error paths need the method's name: formatting it for every publish and ack
        // cost ~10% of the broker's CPU.
        let is_open = matches!(
            method,
            AMQPClass::Channel(amq_protocol::protocol::channel::AMQPMethod::Open(_))
        );
        let in_content = self.map.get(&ch).is_some_and(|s| s.content.is_some());
        if in_content || (!is_open && !self.map.contains_key(&ch)) {
            let name = method_name(&method);
            return Err(if in_content {
                GatewayError::Unexpected(format!(
                    "expected content header or body on channel {ch}, got {name}"
                ))
            } else {
                GatewayError::Channel(format!(
                    "expected 'channel.open' on channel {ch}, got {name}"
                ))
            });
        }
        let incoming = methods::incoming(method)?;
        let Some(state) = self.map.get_mut(&ch) else {
            // Checked above: only channel.open reaches here for an unknown channel.
            self.map.insert(ch, ChannelState::default());
            out.ops.push((ch, Op::ChannelOpen));
            return Ok(Done::Nothing);
        };
        if state.closing {
            // Only the close handshake matters on a channel we are closing.
            match incoming {
                Incoming::CloseOk => {
                    self.map.remove(&ch);
                    out.ops.push((ch, Op::ChannelCloseOk));
                }
                Incoming::Op(Op::ChannelClose) => {
                    // The closes crossed: the client's close-ok to ours is still to come
                    // (amqp091-go, pika and the Java client send it), so the channel stays
                    // until then, as in RabbitMQ; forgetting it now made that close-ok a
                    // frame on a channel that is not open, a connection error.
                    codec::encode_method(out.bytes, ch, methods::channel_close_ok());
                }
                _ => {}
            }
            return Ok(Done::Nothing);
        }
        match incoming {
            Incoming::Op(Op::ChannelOpen) => Err(GatewayError::Channel(format!(
                "second 'channel.open' seen on channel {ch}"
            ))),
            Incoming::Op(op) => {
                out.ops.push((ch, op));
                Ok(Done::Nothing)
            }
            Incoming::Publish(publish) => {
                state.content = Some(Content::new(publish));
                Ok(Done::Nothing)
            }
            Incoming::Flow(active) => {
                codec::encode_method(out.bytes, ch, methods::flow_ok(active));
                Ok(Done::Nothing)
            }
            Incoming::CloseOk => Ok(Done::Nothing),
        }
    }

    /// A content header on channel `ch`.
    pub(crate) fn on_header(
        &mut self,
        ch: u16,
        header: AMQPContentHeader,
        out: Out<'_>,
    ) -> Result<Done, GatewayError> {
        let max = self.max_message_size;
        let Some(state) = self.map.get_mut(&ch) else {
            return Err(GatewayError::Unexpected(format!(
                "content header on channel {ch}, which is not open"
            )));
        };
        if state.closing {
            return Ok(Done::Nothing);
        }
        let Some(content) = state.content.as_mut().filter(|c| c.header.is_none()) else {
            return Err(GatewayError::Unexpected(format!(
                "content header on channel {ch} without a preceding basic.publish"
            )));
        };
        if header.class_id != 60 {
            return Err(GatewayError::Unexpected(format!(
                "content header of class {} on channel {ch}; expected 60 (basic)",
                header.class_id
            )));
        }
        if header.body_size > max {
            state.content = None;
            state.closing = true;
            let text = format!(
                "PRECONDITION_FAILED - message size {} is larger than configured max size {max}",
                header.body_size
            );
            tracing::warn!(peer = %out.peer, channel = ch, "{text}");
            codec::encode_method(
                out.bytes,
                ch,
                methods::channel_close(ErrorCode::PreconditionFailed.code(), &text, (60, 40)),
            );
            return Ok(Done::Nothing);
        }
        content.header = Some((
            header.body_size,
            crate::convert::properties_from_amqp(&header.properties),
        ));
        if header.body_size == 0 {
            return Ok(complete_publish(state, ch, out.ops));
        }
        Ok(Done::Nothing)
    }

    /// A content body frame on channel `ch`.
    pub(crate) fn on_body(
        &mut self,
        ch: u16,
        chunk: Bytes,
        out: Out<'_>,
    ) -> Result<Done, GatewayError> {
        let Some(state) = self.map.get_mut(&ch) else {
            return Err(GatewayError::Unexpected(format!(
                "content body on channel {ch}, which is not open"
            )));
        };
        if state.closing {
            return Ok(Done::Nothing);
        }
        let Some(content) = state.content.as_mut() else {
            return Err(GatewayError::Unexpected(format!(
                "content body on channel {ch} without a preceding basic.publish"
            )));
        };
        let Some((size, _)) = content.header else {
            return Err(GatewayError::Unexpected(format!(
                "content body on channel {ch} before its content header"
            )));
        };
        if content.body.len() + chunk.len() as u64 > size {
            return Err(GatewayError::Unexpected(format!(
                "content body on channel {ch} longer than the {size} bytes its header announced"
            )));
        }
        content.body.push(chunk, size);
        if content.body.len() == size {
            return Ok(complete_publish(state, ch, out.ops));
        }
        Ok(Done::Nothing)
    }

    /// A method with a short string that is not UTF-8 (a queue or exchange name, a
    /// routing key): a bad argument, so its channel's error (406) as any other bad
    /// argument is, and the connection and its other channels carry on. On channel 0, on
    /// a channel that is not open or inside a message's content, it stays a connection
    /// error.
    pub(crate) fn on_not_utf8(
        &mut self,
        ch: u16,
        ids: (u16, u16),
        text: String,
        out: Out<'_>,
    ) -> Result<(), GatewayError> {
        let Some(state) = self
            .map
            .get_mut(&ch)
            .filter(|s| ch != 0 && s.content.is_none())
        else {
            return Err(GatewayError::NotUtf8 {
                channel: ch,
                ids,
                text,
            });
        };
        if state.closing {
            // Only the close handshake matters on a channel we are closing.
            return Ok(());
        }
        state.closing = true;
        let text = format!("PRECONDITION_FAILED - {text}");
        tracing::warn!(peer = %out.peer, channel = ch, "{}", warren_core::escape::Escaped(&text));
        codec::encode_method(
            out.bytes,
            ch,
            methods::channel_close(ErrorCode::PreconditionFailed.code(), &text, ids),
        );
        Ok(())
    }
}

/// The message of `state` is complete: it becomes a publish op.
fn complete_publish(state: &mut ChannelState, ch: u16, ops: &mut Vec<(u16, Op)>) -> Done {
    let Some(content) = state.content.take() else {
        return Done::Nothing;
    };
    let (e, k) = (
        content.publish.exchange.as_str(),
        content.publish.routing_key.as_str(),
    );
    let (exchange, routing_key) = match &state.last_address {
        Some((le, lk)) if **le == *e && **lk == *k => (le.clone(), lk.clone()),
        _ => {
            let address = (Arc::<str>::from(e), Arc::<str>::from(k));
            state.last_address = Some(address.clone());
            address
        }
    };
    let properties = content.header.map(|(_, p)| p).unwrap_or_default();
    ops.push((
        ch,
        Op::Publish(Box::new(Publish {
            exchange,
            routing_key,
            mandatory: content.publish.mandatory,
            immediate: content.publish.immediate,
            properties,
            body: content.body.freeze(),
            routed: None,
        })),
    ));
    Done::Published
}
