//! What the stream protocol's backends (`streams::DiskStreams` over a data directory,
//! `mem_streams::MemStreams` in memory) ask of the broker: logins through its users, and the
//! AMQP queue that each stream is for AMQP clients too (declared and deleted through its
//! admin channel), and the push that tells stream queues' consumers of appends.

use std::future::Future;
use std::sync::OnceLock;
use warren_core::escape::Escaped;
use warren_runtime::BrokerHandle;
use warren_stream::backend::{AuthError, Login, OpenedConnection, OperatorClose, PeerInfo};

/// The broker, set once it runs (a catalog opens before it: the restore reopens streams).
#[derive(Default)]
pub(crate) struct BrokerLink(OnceLock<BrokerHandle>);

/// Runs a broker call from a session's synchronous backend methods. The stream session is
/// sans-IO and asks its backend inline; the broker's user table lives in its task, so the
/// worker thread blocks for one round trip (the runtime is multi-threaded).
pub(crate) fn block_on<T>(f: impl Future<Output = T>) -> T {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

impl BrokerLink {
    pub(crate) fn set(&self, broker: BrokerHandle) {
        let _ = self.0.set(broker);
    }

    pub(crate) fn get(&self) -> Option<&BrokerHandle> {
        self.0.get()
    }

    /// SASL PLAIN through the broker's users (and its loopback rule).
    pub(crate) fn authenticate(&self, login: &Login, peer: &PeerInfo) -> Result<String, AuthError> {
        let Login::Plain { username, password } = login else {
            return Err(AuthError::Refused);
        };
        let broker = self.get().ok_or(AuthError::Refused)?;
        match block_on(broker.authenticate(username, password, peer.is_loopback, None)) {
            Ok(Ok(login)) => Ok(login.user),
            Ok(Err(warren_runtime::LoginError::LoopbackOnly(_))) => Err(AuthError::Loopback),
            Ok(Err(_)) | Err(_) => Err(AuthError::Refused),
        }
    }

    /// Whether `user` may open `vhost` (the password was checked at SASL, and the loopback
    /// rule with it).
    pub(crate) fn vhost_access(&self, user: &str, vhost: &str) -> bool {
        let Some(broker) = self.get() else {
            return false;
        };
        matches!(
            block_on(broker.authenticate_certified(user, true, Some(vhost))),
            Ok(Ok(_))
        )
    }

    /// Makes a stream connection one of the broker's (as RabbitMQ lists its stream
    /// connections with the others): listed by `GET /api/connections` and `warren ctl
    /// list_connections` (protocol `stream`, its PeerProperties as client properties), closed
    /// by them and by its vhost's deletion. The future holds the broker's connection: it
    /// resolves with the reason of a close from the broker, and leaves the listings when
    /// dropped.
    pub(crate) fn register_connection(&self, c: OpenedConnection<'_>) -> Option<OperatorClose> {
        use warren_core::command::Op;
        use warren_core::effect::Effect;
        use warren_core::message::{FieldTable, FieldValue};
        let broker = self.get()?;
        let link = broker.connect();
        let mut properties = FieldTable::new();
        for (k, v) in c.client_properties {
            properties.insert(k.as_str().into(), FieldValue::string(v));
        }
        link.tx.describe(warren_runtime::ConnMeta {
            protocol: "stream",
            peer: c.peer.addr.as_str().into(),
            tls: c.peer.tls,
            client_properties: Some(Box::new(properties)),
            client_id: None,
            heartbeat: u16::try_from(c.heartbeat_s).unwrap_or(u16::MAX),
            frame_max: c.frame_max,
            connected_at: warren_runtime::unix_ms(),
        });
        let open = Op::ConnectionOpen {
            vhost: c.vhost.to_string(),
            user: c.user.to_string(),
            cancel_notify: false,
        };
        Some(Box::pin(async move {
            let (tx, mut rx) = (link.tx, link.rx);
            if tx.send(vec![(0, open)]).await.is_ok() {
                while let Some(batch) = rx.recv().await {
                    for e in batch {
                        if let Effect::ConnectionError { error, .. } = e {
                            return error.text;
                        }
                    }
                }
            }
            // The broker is gone (shutting down): the connection ends with the listener.
            std::future::pending().await
        }))
    }

    /// Declares stream `stream` of `vhost` as a queue (a stream is a queue of its vhost for
    /// AMQP clients too, as in RabbitMQ) with the stream's kept `arguments`.
    pub(crate) fn declare_queue(&self, vhost: &str, stream: &str, arguments: &[(String, String)]) {
        use warren_core::message::{FieldTable, FieldValue};
        let Some(broker) = self.get() else {
            return;
        };
        let mut table = FieldTable::new();
        table.insert("x-queue-type".into(), FieldValue::string("stream"));
        for (k, v) in arguments {
            let value = match v.parse::<i64>() {
                Ok(n) if k != "max-age" => FieldValue::I64(n),
                _ => FieldValue::string(v),
            };
            table.insert(format!("x-{k}"), value);
        }
        let op = warren_core::command::Op::QueueDeclare(warren_core::command::QueueDeclare {
            queue: stream.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: table,
        });
        let asked = warren_core::admin::AdminRequest::Op {
            vhost: vhost.into(),
            op,
        };
        match block_on(broker.admin(asked)) {
            Ok(warren_core::admin::AdminResponse::Op(Ok(_))) => {}
            Ok(warren_core::admin::AdminResponse::Op(Err(e))) => {
                tracing::warn!(vhost = %Escaped(vhost), stream = %Escaped(stream), "the stream is not an AMQP queue too: {}", Escaped(&e.to_string()))
            }
            _ => {}
        }
    }

    /// Deletes the queue of stream `stream` (its log goes with it).
    pub(crate) fn delete_queue(&self, vhost: &str, stream: &str) {
        let Some(broker) = self.get() else {
            return;
        };
        let op = warren_core::command::Op::QueueDelete {
            queue: stream.into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        };
        let asked = warren_core::admin::AdminRequest::Op {
            vhost: vhost.into(),
            op,
        };
        let _ = block_on(broker.admin(asked));
    }

    /// The stream protocol appended to `stream`: its queue's AMQP consumers get it now.
    pub(crate) fn streams_grew(&self, vhost: &str, stream: &str) {
        if let Some(broker) = self.get() {
            broker.streams_grew(vhost, stream);
        }
    }
}
