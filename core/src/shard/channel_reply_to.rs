//! Direct reply-to (`amq.rabbitmq.reply-to`), as RabbitMQ implements it: an RPC client
//! consumes (no-ack) from the pseudo-queue `amq.rabbitmq.reply-to` and publishes requests with
//! `reply_to = "amq.rabbitmq.reply-to"`; the broker rewrites that to
//! `amq.rabbitmq.reply-to.<token>`, and a reply published to the default exchange with that
//! routing key goes straight to the client's consumer, with no queue in between. A reply for a
//! consumer that has gone is dropped (or returned, if mandatory).

use super::Broker;
use crate::channel::reply_to::{REPLY_TO, REPLY_TO_PREFIX, ReplyConsumer};
use crate::command::{Consume, OpKind};
use crate::effect::{Delivery, Effect, Reply};
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::ChannelRef;
use crate::message::Message;
use std::sync::Arc;

impl Broker {
    /// basic.consume on `amq.rabbitmq.reply-to`.
    pub(super) fn consume_reply_to(
        &mut self,
        ch: ChannelRef,
        c: Consume,
    ) -> Result<(), ProtocolError> {
        let op = OpKind::Consume;
        if !c.no_ack {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                op,
                "reply consumer cannot acknowledge",
            ));
        }
        let tag: Arc<str> = if c.consumer_tag.is_empty() {
            Arc::from(self.names.name("amq.ctag-"))
        } else {
            Arc::from(c.consumer_tag.as_str())
        };
        let token = self.names.name(REPLY_TO_PREFIX);
        // With shards, the address names the connection, so that a reply published on
        // another shard finds the one that holds the consumer.
        let address: Arc<str> = match token.strip_prefix(REPLY_TO_PREFIX) {
            Some(rest) if self.shards > 1 => {
                Arc::from(format!("{REPLY_TO_PREFIX}{}.{rest}", ch.conn.0))
            }
            _ => Arc::from(token),
        };
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return Ok(());
        };
        if channel.reply_consumer.is_some() || channel.consumers.contains_key(&tag) {
            return Err(ProtocolError::new(
                ErrorCode::NotAllowed,
                op,
                format!("attempt to reuse consumer tag '{tag}'"),
            ));
        }
        channel.reply_consumer = Some(Box::new(ReplyConsumer {
            tag: tag.clone(),
            address: address.clone(),
        }));
        self.chans.reply_addresses.insert(address, ch);
        if !c.nowait {
            self.reply(ch, Reply::ConsumeOk { consumer_tag: tag });
        }
        Ok(())
    }

    /// basic.cancel of a channel's reply consumer; false when `tag` is not it.
    pub(super) fn cancel_reply_to(&mut self, ch: ChannelRef, tag: &str) -> bool {
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return false;
        };
        if channel
            .reply_consumer
            .as_ref()
            .is_none_or(|r| &*r.tag != tag)
        {
            return false;
        }
        if let Some(r) = channel.reply_consumer.take() {
            self.chans.reply_addresses.remove(&r.address);
        }
        true
    }

    /// Forgets a closing channel's reply consumer.
    pub(super) fn release_reply_to(&mut self, ch: ChannelRef) {
        if let Some(r) = self
            .chans
            .channels
            .get_mut(&ch)
            .and_then(|c| c.reply_consumer.take())
        {
            self.chans.reply_addresses.remove(&r.address);
        }
    }

    /// The `reply_to` a publish carries, rewritten when it asks for direct reply-to: the
    /// channel must consume from the pseudo-queue first (406 otherwise, as RabbitMQ).
    pub(super) fn rewrite_reply_to(
        &self,
        ch: ChannelRef,
        reply_to: &str,
    ) -> Result<Option<String>, ProtocolError> {
        if reply_to != REPLY_TO {
            return Ok(None);
        }
        match self
            .chans
            .channels
            .get(&ch)
            .and_then(|c| c.reply_consumer.as_ref())
        {
            Some(r) => Ok(Some(r.address.to_string())),
            None => Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                OpKind::Publish,
                "fast reply consumer does not exist",
            )),
        }
    }

    /// Delivers a reply published to the default exchange with a reply-to address; false when
    /// `routing_key` is no live address (the caller treats the message as unroutable).
    pub(super) fn deliver_reply(&mut self, routing_key: &str, message: &Arc<Message>) -> bool {
        let Some(rest) = routing_key.strip_prefix(REPLY_TO_PREFIX) else {
            return false;
        };
        if self.shards > 1
            && let Some(conn) = rest
                .split_once('.')
                .and_then(|(conn, _)| conn.parse::<u64>().ok())
                .map(crate::ids::ConnId)
            && self.conn_shard(conn) != self.shard
        {
            // Its shard delivers it, or drops it if the consumer has gone (a mandatory
            // reply is not returned then: this shard cannot know).
            self.mail.push_back(super::mail::Mail::Reply {
                conn,
                address: Arc::from(routing_key),
                message: message.clone(),
            });
            return true;
        }
        self.deliver_reply_here(routing_key, message)
    }

    /// Delivers a reply to the reply consumer of this shard that `address` names; false if
    /// there is none.
    pub(super) fn deliver_reply_here(&mut self, address: &str, message: &Arc<Message>) -> bool {
        let Some(&ch) = self.chans.reply_addresses.get(address) else {
            return false;
        };
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return false;
        };
        let Some(tag) = channel.reply_consumer.as_ref().map(|r| r.tag.clone()) else {
            return false;
        };
        let delivery_tag = channel.next_delivery_tag;
        channel.next_delivery_tag += 1;
        if let Some(conn) = self.chans.conns.get_mut(&ch.conn) {
            conn.in_flight.add(1);
        }
        self.effects.push(Effect::Deliver {
            ch,
            consumer_tag: tag,
            delivery: Delivery {
                delivery_tag,
                redelivered: false,
                message: message.clone(),
            },
        });
        true
    }
}
