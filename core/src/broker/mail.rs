//! Mail between the queue side and the channel side of the broker: the messages that will
//! cross shards in the sharded design (ARCHITECTURE.md, "warren-runtime"). Publish,
//! dispatch, acks, consume, cancel, get, purge, queue deletion, flow control and dead letters
//! already go only this way; what the channel side still reads of a queue directly is listed
//! in ARCHITECTURE.md.
//!
//! A handler touches one side only (`Enqueue` runs on the queue's state, `Answered` on the
//! channel's). The synchronous composition delivers mail in FIFO order at the end of each
//! operation (`pump`), so effects come out in the order they did when the sides called each
//! other directly. With shards, mail may find its channel closed: the handlers give back
//! what it carried.

use super::Broker;
use crate::effect::{Effect, Reply};
use crate::error::ProtocolError;
use crate::ids::{ChannelRef, ConnId, QueueId};
use crate::message::Message;
use crate::queue::classic::QueuedMessage;
use crate::queue::state::{ConsumerId, Enqueued, Picked, QueueConsumer, Settle, Unacked};
use std::sync::Arc;

/// Who published a message being enqueued, as the queue needs to know it.
#[derive(Clone, Copy)]
pub(crate) struct Publisher {
    pub(crate) ch: ChannelRef,
    /// The publish's confirm sequence number, in confirm mode: the queue answers it.
    pub(crate) seq: Option<u64>,
    /// The publishing connection consumes itself, so flow control must not pause it (it
    /// could never drain what it waits for).
    pub(crate) consumes: bool,
}

pub(crate) enum Mail {
    /// Channel -> queue: a routed publish.
    Enqueue {
        queue: QueueId,
        message: Arc<Message>,
        /// `None` for a dead letter: nobody to answer or to pace.
        publisher: Option<Publisher>,
    },
    /// Queue -> channel: the queue's answer to publish `seq` (see `ChannelState::answered`).
    Answered {
        ch: ChannelRef,
        seq: u64,
        /// The queue took the message (not refused by its store or by `x-overflow`).
        taken: bool,
        /// Persistent on a durable queue: it waits for the sync of the current epoch.
        durable: bool,
    },
    /// Channel -> queue: deliveries of this queue settled on a channel, in delivery order.
    Settle {
        queue: QueueId,
        entries: Vec<Unacked>,
        how: Settle,
    },
    /// Channel -> queue: the channel freed credit the queue may be waiting for (its shared
    /// prefetch): dispatch.
    Dispatch { queue: QueueId },
    /// Channel -> queue: basic.consume (the channel checked the tag and the permission).
    Consume {
        queue: QueueId,
        consumer: Box<QueueConsumer>,
        nowait: bool,
    },
    /// Queue -> channel: the queue took the consumer.
    ConsumeOk {
        ch: ChannelRef,
        queue: QueueId,
        consumer: ConsumerId,
        tag: Arc<str>,
        nowait: bool,
    },
    /// Queue -> channel: the queue refused a request; a channel error.
    Refused {
        ch: ChannelRef,
        error: ProtocolError,
    },
    /// Channel -> queue: a consumer goes (basic.cancel, or its channel closed); `reply`:
    /// answer cancel-ok to this channel once it is gone.
    Cancel {
        queue: QueueId,
        consumer: ConsumerId,
        reply: Option<(ChannelRef, Arc<str>)>,
    },
    /// Queue -> channel: the consumer is gone (after every delivery the queue sent it).
    Cancelled {
        ch: ChannelRef,
        consumer_tag: Arc<str>,
    },
    /// Queue -> channel: the queue was deleted under this consumer (the client hears of it
    /// if it understands `basic.cancel` from the server).
    ConsumerGone {
        ch: ChannelRef,
        consumer_tag: Arc<str>,
    },
    /// Channel -> queue: basic.get.
    Get {
        queue: QueueId,
        ch: ChannelRef,
        no_ack: bool,
    },
    /// Queue -> channel: what basic.get found (the message and how many stay ready).
    Got {
        queue: QueueId,
        ch: ChannelRef,
        no_ack: bool,
        got: Option<(QueuedMessage, u32)>,
    },
    /// Channel -> queue: queue.purge (purge-ok unless `nowait`).
    Purge {
        queue: QueueId,
        ch: ChannelRef,
        nowait: bool,
    },
    /// Queue -> channel: purge-ok.
    Purged { ch: ChannelRef, message_count: u32 },
    /// Queue -> channel: a delivery the queue's dispatch picked, its credit taken.
    Deliver { queue: QueueId, picked: Picked },
    /// Queue -> connection: the queue has paused the publishing connection (flow control).
    Paused { conn: ConnId, queue: QueueId },
    /// Connection -> queue: a connection the queue paused is gone: forget it.
    PublisherGone { queue: QueueId, conn: ConnId },
    /// Queue -> connection: the queue lifted its pause (it drained, lost its consumers, or
    /// went away). Sent after the `Paused` it lifts, so the connection never stays paused by
    /// a queue that no longer pauses it.
    Resumed { conn: ConnId, queue: QueueId },
}

/// The mail of one operation is bounded by what it touches (the queues a publish reaches, the
/// unacked deliveries of a closing connection, the consumers of a deleted queue), each piece
/// answered at most once; this many means a handler loops.
const MAX_MAIL_PER_PUMP: usize = 1 << 24;

impl Broker {
    /// Delivers queued mail until none is left.
    pub(super) fn pump(&mut self) {
        let mut handled = 0usize;
        while let Some(mail) = self.mail.pop_front() {
            handled += 1;
            assert!(handled < MAX_MAIL_PER_PUMP, "mail loop");
            self.deliver_one(mail);
        }
    }

    /// Hands one piece of mail to its handler.
    fn deliver_one(&mut self, mail: Mail) {
        match mail {
            Mail::Enqueue {
                queue,
                message,
                publisher,
            } => self.enqueue_mail(queue, &message, publisher),
            Mail::Answered {
                ch,
                seq,
                taken,
                durable,
            } => {
                self.answer(ch, seq, taken, durable);
                self.send_confirms(ch);
            }
            Mail::Settle {
                queue,
                entries,
                how,
            } => self.settle_in_queue(queue, entries, how),
            Mail::Dispatch { queue } => self.dispatch(queue),
            Mail::Deliver { queue, picked } => self.deliver_mail(queue, picked),
            Mail::Consume {
                queue,
                consumer,
                nowait,
            } => self.consume_in_queue(queue, *consumer, nowait),
            Mail::ConsumeOk {
                ch,
                queue,
                consumer,
                tag,
                nowait,
            } => self.consume_ok(ch, queue, consumer, tag, nowait),
            Mail::Refused { ch, error } => self.fail(ch, error),
            Mail::Cancel {
                queue,
                consumer,
                reply,
            } => self.cancel_in_queue(queue, consumer, reply),
            Mail::Cancelled { ch, consumer_tag } => {
                self.reply(ch, Reply::CancelOk { consumer_tag });
            }
            Mail::ConsumerGone { ch, consumer_tag } => {
                self.forget_consumer(ch, &consumer_tag);
                if self.conns.get(&ch.conn).is_some_and(|c| c.cancel_notify) {
                    self.effects
                        .push(Effect::ConsumerCancelled { ch, consumer_tag });
                }
            }
            Mail::Get { queue, ch, no_ack } => self.get_in_queue(queue, ch, no_ack),
            Mail::Got {
                queue,
                ch,
                no_ack,
                got,
            } => self.got(queue, ch, no_ack, got),
            Mail::Purge { queue, ch, nowait } => self.purge_in_queue(queue, ch, nowait),
            Mail::Purged { ch, message_count } => {
                self.reply(ch, Reply::QueuePurgeOk { message_count });
            }
            Mail::Paused { conn, queue } => {
                if let Some(c) = self.conns.get_mut(&conn)
                    && c.paused_in.insert(queue)
                    && c.paused_in.len() == 1
                {
                    self.effects.push(Effect::FlowPaused { conn });
                }
            }
            Mail::PublisherGone { queue, conn } => {
                if let Some(q) = self.queues.get_mut(&queue) {
                    q.pausing.remove(conn);
                }
            }
            Mail::Resumed { conn, queue } => {
                if let Some(c) = self.conns.get_mut(&conn)
                    && c.paused_in.remove(&queue)
                    && c.paused_in.is_empty()
                {
                    self.effects.push(Effect::FlowResumed { conn });
                }
            }
        }
    }

    /// The queue side of a publish: enqueue, answer, dispatch, pace.
    fn enqueue_mail(
        &mut self,
        queue: QueueId,
        message: &Arc<Message>,
        publisher: Option<Publisher>,
    ) {
        // A message the store failed to take is nacked: nothing is confirmed that was not
        // stored. A persistent message on a durable queue is confirmed once it is durable.
        let (taken, durable) = match self.enqueue(queue, message) {
            Enqueued::Memory => (true, false),
            Enqueued::Durable => (true, true),
            Enqueued::Failed | Enqueued::Rejected => (false, false),
        };
        if let Some(Publisher {
            ch, seq: Some(seq), ..
        }) = publisher
        {
            self.mail.push_back(Mail::Answered {
                ch,
                seq,
                taken,
                durable,
            });
        }
        self.dispatch(queue);
        if let Some(p) = publisher
            && !p.consumes
        {
            self.pace(p.ch.conn, queue);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The paths the synchronous composition never takes, since it delivers mail within
    //! the operation that sent it: with shards, a channel may close while mail for it
    //! travels. Each test stops the pump at the mail in question and closes the channel.
    use super::*;
    use crate::command::{Consume, Op, Publish, QueueDeclare};
    use crate::message::{FieldTable, Properties};
    use crate::{Broker, BrokerConfig};

    const CH: ChannelRef = ChannelRef::new(ConnId(1), 1);

    fn ops(b: &mut Broker, ch: ChannelRef, ops: Vec<Op>) -> Vec<Effect> {
        for op in ops {
            b.handle(1, ch, op);
        }
        let mut out = Vec::new();
        b.poll_effects(&mut out);
        out
    }

    /// A broker with queue `q` holding one message, and channel `CH` open.
    fn one_message() -> Broker {
        let mut b = Broker::new(BrokerConfig::default());
        let open = Op::ConnectionOpen {
            vhost: "/".into(),
            user: "guest".into(),
            cancel_notify: true,
        };
        ops(&mut b, ChannelRef::new(ConnId(1), 0), vec![open]);
        let declare = QueueDeclare {
            queue: "q".into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::new(),
        };
        let publish = Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: false,
            immediate: false,
            properties: Properties::default(),
            body: bytes::Bytes::from_static(b"hello"),
            routed: None,
        };
        ops(
            &mut b,
            CH,
            vec![
                Op::ChannelOpen,
                Op::QueueDeclare(declare),
                Op::Publish(Box::new(publish)),
            ],
        );
        assert_eq!(b.queue_len("q"), Some(1));
        b
    }

    fn consume(b: &mut Broker) {
        let consume = Consume {
            queue: "q".into(),
            consumer_tag: "c".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: true,
            arguments: FieldTable::new(),
        };
        assert!(b.consume(CH, consume).is_ok());
    }

    /// Delivers mail until the next one matches `stop`.
    fn pump_until(b: &mut Broker, stop: impl Fn(&Mail) -> bool) {
        while !b.mail.front().is_some_and(&stop) {
            let mail = b.mail.pop_front().expect("the awaited mail comes");
            b.deliver_one(mail);
        }
    }

    /// Closes `CH` (delivering the mail left) and checks that the message is back in its
    /// queue with everything it held, and that nothing reached the closed channel.
    fn close_and_check(b: &mut Broker) {
        let effects = ops(b, CH, vec![Op::ChannelClose]);
        let close_ok = Effect::Reply {
            ch: CH,
            reply: Reply::ChannelCloseOk,
        };
        assert_eq!(
            effects,
            vec![close_ok],
            "nothing but close-ok reaches the channel"
        );
        assert_eq!(
            b.queue_len("q"),
            Some(1),
            "the message is back in its queue"
        );
        assert_eq!(b.conns[&ConnId(1)].in_flight, 0, "its write credit is back");
        assert_eq!(b.stored_bytes(), 5);
        assert_eq!(b.check_invariants(), Ok(()));
    }

    #[test]
    fn a_delivery_to_a_closed_channel_returns_to_its_queue() {
        let mut b = one_message();
        consume(&mut b);
        pump_until(&mut b, |m| matches!(m, Mail::Deliver { .. }));
        close_and_check(&mut b);
    }

    #[test]
    fn a_consumer_taken_for_a_closed_channel_is_cancelled() {
        let mut b = one_message();
        consume(&mut b);
        pump_until(&mut b, |m| matches!(m, Mail::ConsumeOk { .. }));
        close_and_check(&mut b);
        assert!(b.queues.values().all(|q| q.consumers.is_empty()));
    }

    #[test]
    fn a_get_for_a_closed_channel_returns_to_its_queue() {
        let mut b = one_message();
        assert!(b.get(CH, "q", false).is_ok());
        pump_until(&mut b, |m| matches!(m, Mail::Got { .. }));
        close_and_check(&mut b);
    }
}
