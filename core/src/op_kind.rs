//! The kind of a request ([`crate::command::Op::kind`]): a vocabulary of its own so that
//! errors can name the failing method without importing the requests they describe
//! (`command` carries errors in `Op::Refuse`; an import both ways would be a circle).

/// The kind of an [`Op`](crate::command::Op), carried by errors so a gateway can name the failing method
/// (AMQP's class-id and method-id in `channel.close`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `connection.open`.
    ConnectionOpen,
    /// `connection.close`.
    ConnectionClose,
    /// `channel.open`.
    ChannelOpen,
    /// `channel.close`.
    ChannelClose,
    /// `channel.close-ok`.
    ChannelCloseOk,
    /// `exchange.declare`.
    ExchangeDeclare,
    /// `exchange.delete`.
    ExchangeDelete,
    /// `exchange.bind`.
    ExchangeBind,
    /// `exchange.unbind`.
    ExchangeUnbind,
    /// `queue.declare`.
    QueueDeclare,
    /// `queue.bind`.
    QueueBind,
    /// `queue.unbind`.
    QueueUnbind,
    /// `queue.purge`.
    QueuePurge,
    /// `queue.delete`.
    QueueDelete,
    /// `basic.qos`.
    Qos,
    /// `basic.consume`.
    Consume,
    /// `basic.cancel`.
    Cancel,
    /// `basic.get`.
    Get,
    /// `basic.publish`.
    Publish,
    /// `basic.ack`.
    Ack,
    /// `basic.nack`.
    Nack,
    /// `basic.reject`.
    Reject,
    /// `basic.recover`.
    Recover,
    /// `confirm.select`.
    ConfirmSelect,
    /// `tx.select`.
    TxSelect,
    /// `tx.commit`.
    TxCommit,
    /// `tx.rollback`.
    TxRollback,
    /// The host wrote `count` deliveries of this connection to its socket (write-window credit).
    Written,
}
