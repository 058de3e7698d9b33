//! Message counters for operators (RabbitMQ's `message_stats`): plain `u64` increments in
//! records the message path already touches (a queue, a channel), so they cost nothing
//! measurable. Hosts compute rates from samples of them; the core has no clock of its own.

/// Monotonic message counts of one queue, channel, connection or vhost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MessageStats {
    /// Messages published (by a channel) or enqueued (into a queue).
    pub publish: u64,
    /// Messages handed to consumers or to basic.get.
    pub deliver_get: u64,
    /// Of those, messages delivered again after a requeue.
    pub redeliver: u64,
    /// Deliveries acknowledged by clients.
    pub ack: u64,
}

impl MessageStats {
    /// Adds `other`'s counts to these (a closed channel's to its connection's, ...).
    pub fn add(&mut self, other: &MessageStats) {
        self.publish += other.publish;
        self.deliver_get += other.deliver_get;
        self.redeliver += other.redeliver;
        self.ack += other.ack;
    }

    /// Counts one delivery (to a consumer or basic.get).
    pub(crate) fn delivered(&mut self, redelivered: bool) {
        self.deliver_get += 1;
        self.redeliver += u64::from(redelivered);
    }
}
