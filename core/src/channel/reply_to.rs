//! A channel's direct reply-to consumer (`amq.rabbitmq.reply-to`; the handlers are the
//! composition's, `shard/reply_to.rs`).

use std::sync::Arc;

pub(crate) const REPLY_TO: &str = "amq.rabbitmq.reply-to";
pub(crate) const REPLY_TO_PREFIX: &str = "amq.rabbitmq.reply-to.";

/// A channel's direct reply-to consumer.
pub(crate) struct ReplyConsumer {
    pub(crate) tag: Arc<str>,
    /// The routing key replies use: `amq.rabbitmq.reply-to.<token>`.
    pub(crate) address: Arc<str>,
}
