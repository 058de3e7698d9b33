//! The core's effects on an open connection, as frames: replies, deliveries and returns
//! with their content, confirms (runs of acks collapsed), consumer cancels, channel and
//! connection errors, and the alarm and flow-control states that pause reading.

use super::Session;
use crate::codec;
use crate::handshake;
use crate::methods;
use warren_core::effect::{Effect, Reply};
use warren_core::escape::Escaped;

impl Session {
    fn flush_acks_of(&mut self, ch: u16) {
        if let Some((ch, first, last)) = self.pending_acks.take(ch) {
            self.emit_acks(ch, first, last);
        }
    }

    pub(super) fn emit_acks(&mut self, ch: u16, first: u64, last: u64) {
        if let Some(state) = self.channels.get_mut(ch) {
            state.confirmed.emit_acks(&mut self.out, ch, first, last);
        }
    }

    pub(super) fn encode_effect(&mut self, now: u64, effect: Effect, delivered: &mut u32) {
        if let Effect::Confirm {
            ch,
            seq,
            multiple: false,
            ack: true,
        } = effect
        {
            if let Some((c, first, last)) = self.pending_acks.add(ch.channel, seq) {
                self.emit_acks(c, first, last);
            }
            return;
        }
        if let Effect::Deliver { .. } = effect {
            // Counted even if dropped below: the core's write window must get it back.
            *delivered += 1;
        }
        let ch = match &effect {
            Effect::ConnectionError { .. }
            | Effect::Blocked { .. }
            | Effect::Unblocked { .. }
            | Effect::FlowPaused { .. }
            | Effect::FlowResumed { .. } => 0,
            Effect::Reply { ch, .. }
            | Effect::Deliver { ch, .. }
            | Effect::Return { ch, .. }
            | Effect::Confirm { ch, .. }
            | Effect::ConsumerCancelled { ch, .. }
            | Effect::ChannelError { ch, .. } => ch.channel,
        };
        self.flush_acks_of(ch);
        let closing = self.channels.get(ch).is_none_or(|s| s.closing);
        let frame_max = self.conn.frame_max;
        let out = &mut self.out;
        match effect {
            Effect::ConnectionError { error, .. } => {
                let ids = methods::method_ids(error.op);
                self.close_connection(now, error.code, error.text, ids);
            }
            Effect::Blocked { .. } => {
                self.blocked = true;
                // The broker logs the alarm once; per connection it is only a debug line.
                tracing::debug!(peer = %self.peer, "resource alarm: publishing blocked");
                self.notify_blocked();
            }
            Effect::FlowPaused { .. } => self.flow_paused = true,
            Effect::FlowResumed { .. } => self.flow_paused = false,
            Effect::Unblocked { .. } => {
                self.blocked = false;
                if self.blocked_sent {
                    codec::encode_method(out, 0, handshake::connection_unblocked());
                    self.blocked_sent = false;
                }
            }
            // The client's close crossed our channel.close and reached the core after the
            // error: it gets its close-ok, and the channel waits for the close-ok to ours.
            Effect::Reply {
                reply: Reply::ChannelCloseOk,
                ..
            } if closing && self.channels.get(ch).is_some() => {
                codec::encode_method(out, ch, methods::channel_close_ok());
            }
            // A channel we are closing gets nothing but the close handshake.
            _ if closing && ch != 0 => {}
            Effect::Reply { reply, .. } => match reply {
                Reply::GetOk {
                    delivery,
                    message_count,
                } => {
                    let m = &delivery.message;
                    codec::encode_method(
                        out,
                        ch,
                        methods::get_ok(
                            delivery.delivery_tag,
                            delivery.redelivered,
                            &m.exchange,
                            &m.routing_key,
                            message_count,
                        ),
                    );
                    codec::encode_content(out, ch, &m.properties, &m.body, frame_max);
                }
                Reply::ChannelCloseOk => {
                    self.channels.remove(ch);
                    codec::encode_method(out, ch, methods::channel_close_ok());
                }
                other => {
                    if let Some(method) = methods::reply_method(&other) {
                        codec::encode_method(out, ch, method);
                    }
                }
            },
            Effect::Deliver {
                consumer_tag,
                delivery,
                ..
            } => {
                let m = &delivery.message;
                codec::encode_deliver(
                    out,
                    ch,
                    &consumer_tag,
                    delivery.delivery_tag,
                    delivery.redelivered,
                    &m.exchange,
                    &m.routing_key,
                );
                codec::encode_content(out, ch, &m.properties, &m.body, frame_max);
            }
            Effect::Return {
                reply_code,
                reply_text,
                message,
                ..
            } => {
                codec::encode_method(
                    out,
                    ch,
                    methods::basic_return(
                        reply_code,
                        reply_text,
                        &message.exchange,
                        &message.routing_key,
                    ),
                );
                codec::encode_content(out, ch, &message.properties, &message.body, frame_max);
            }
            Effect::Confirm {
                seq, multiple, ack, ..
            } => {
                codec::encode_confirm(out, ch, seq, multiple, ack);
                if let Some(s) = self.channels.get_mut(ch) {
                    s.confirmed.mark(if multiple { 1 } else { seq }, seq);
                }
            }
            Effect::ConsumerCancelled { consumer_tag, .. } => {
                codec::encode_method(out, ch, methods::server_cancel(&consumer_tag));
            }
            Effect::ChannelError { error, .. } => {
                tracing::debug!(peer = %self.peer, channel = ch, "channel error: {}", Escaped(&error.text));
                codec::encode_method(
                    out,
                    ch,
                    methods::channel_close(
                        error.code.code(),
                        &error.text,
                        methods::method_ids(error.op),
                    ),
                );
                if let Some(s) = self.channels.get_mut(ch) {
                    s.closing = true;
                    s.content = None;
                }
            }
        }
    }
}
