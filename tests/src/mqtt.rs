//! MQTT test harness: a broker with both the AMQP and the MQTT listener on ephemeral loopback
//! ports, and rumqttc clients (v3.1.1 and v5) whose event loops run in tasks and forward every
//! event, so tests await packets with a time bound.

use rumqttc::{AsyncClient, Event, MqttOptions, Packet, Publish, QoS};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

pub use crate::WAIT;

/// A running broker with AMQP and MQTT listeners; stops when dropped.
pub struct MqttBroker {
    pub mqtt: SocketAddr,
    pub amqp: crate::TestBroker,
}

/// Starts a broker on 127.0.0.1 with ephemeral ports for both protocols.
pub async fn start() -> MqttBroker {
    start_with(warren_mqtt::MqttConfig::default()).await
}

pub async fn start_with(config: warren_mqtt::MqttConfig) -> MqttBroker {
    let broker = warren_runtime::BrokerHandle::start(warren_core::BrokerConfig::default());
    serve(broker, config).await
}

/// Starts a broker of `shards` shards with both listeners.
pub async fn start_sharded(shards: u32) -> MqttBroker {
    let broker =
        warren_runtime::BrokerHandle::start_sharded(warren_core::BrokerConfig::default(), shards);
    serve(broker, warren_mqtt::MqttConfig::default()).await
}

async fn serve(
    broker: warren_runtime::BrokerHandle,
    config: warren_mqtt::MqttConfig,
) -> MqttBroker {
    let amqp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let mqtt = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let amqp_addr = amqp.local_addr().expect("local address");
    let mqtt_addr = mqtt.local_addr().expect("local address");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(warren_amqp::serve(
        amqp,
        broker.clone(),
        Arc::new(warren_amqp::AmqpConfig::default()),
        stopped.clone(),
    ));
    tokio::spawn(warren_mqtt::serve(
        mqtt,
        broker.clone(),
        Arc::new(config),
        stopped,
    ));
    MqttBroker {
        mqtt: mqtt_addr,
        amqp: crate::TestBroker {
            addr: amqp_addr,
            broker,
            uri: format!("amqp://guest:guest@{amqp_addr}/%2f"),
            stop,
        },
    }
}

/// A v3.1.1 client (rumqttc's default protocol) with its event stream.
pub struct Client {
    pub client: AsyncClient,
    pub events: mpsc::UnboundedReceiver<Result<Event, String>>,
    task: tokio::task::JoinHandle<()>,
}

impl MqttBroker {
    /// Adds the user `writer` (password `pw`), who may publish but not read `amq.topic`.
    pub async fn add_writer_only_user(&self) {
        use warren_core::access::{PermissionDef, UserDef, hash_password};
        use warren_runtime::AdminRequest;
        for request in [
            AdminRequest::AddUser(UserDef {
                name: "writer".into(),
                password_hash: hash_password([1, 2, 3, 4], "pw"),
                tags: vec![],
            }),
            AdminRequest::SetPermissions(PermissionDef {
                user: "writer".into(),
                vhost: "/".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: "^$".into(),
            }),
        ] {
            self.amqp.broker.admin(request).await.expect("admin");
        }
    }

    pub fn options(&self, id: &str) -> MqttOptions {
        let mut o = MqttOptions::new(id, self.mqtt.ip().to_string(), self.mqtt.port());
        o.set_keep_alive(Duration::from_secs(30));
        o
    }

    /// Connects with `options` and waits for the CONNACK; returns it with the client.
    pub async fn connect_with(&self, options: MqttOptions) -> (Client, rumqttc::ConnAck) {
        let (client, mut eventloop) = AsyncClient::new(options, 1000);
        let (tx, events) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                let ev = eventloop.poll().await;
                let stop = ev.is_err();
                if tx.send(ev.map_err(|e| e.to_string())).is_err() || stop {
                    return;
                }
            }
        });
        let mut c = Client {
            client,
            events,
            task,
        };
        let ack = c
            .wait(|p| match p {
                Packet::ConnAck(a) => Some(a.clone()),
                _ => None,
            })
            .await;
        (c, ack)
    }

    pub async fn connect(&self, id: &str) -> Client {
        let (c, ack) = self.connect_with(self.options(id)).await;
        assert_eq!(ack.code, rumqttc::ConnectReturnCode::Success);
        c
    }
}

impl Client {
    /// Waits (bounded) for an incoming packet `f` accepts; panics on a connection error.
    /// A plain fn (not `async`) so that `#[track_caller]` holds: a timeout names the line
    /// that waited, and so which packet.
    #[track_caller]
    pub fn wait<T>(
        &mut self,
        mut f: impl FnMut(&Packet) -> Option<T>,
    ) -> impl std::future::Future<Output = T> {
        let at = std::panic::Location::caller();
        async move {
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                let ev = tokio::time::timeout_at(deadline, self.events.recv())
                    .await
                    .unwrap_or_else(|_| {
                        panic!("no expected packet within {WAIT:?}, awaited at {at}")
                    })
                    .expect("event loop running");
                match ev {
                    Ok(Event::Incoming(p)) => {
                        if let Some(t) = f(&p) {
                            return t;
                        }
                    }
                    Ok(Event::Outgoing(_)) => {}
                    Err(e) => panic!("connection error while waiting: {e}"),
                }
            }
        }
    }

    #[track_caller]
    pub fn suback(
        &mut self,
    ) -> impl std::future::Future<Output = Vec<rumqttc::SubscribeReasonCode>> + '_ {
        self.wait(|p| match p {
            Packet::SubAck(s) => Some(s.return_codes.clone()),
            _ => None,
        })
    }

    pub async fn subscribe(&mut self, filter: &str, qos: QoS) {
        // The request queue (1000) is full only while the event loop is stuck on the socket.
        crate::bounded_as(
            format!("room in the client's queue for SUBSCRIBE {filter}"),
            self.client.subscribe(filter, qos),
        )
        .await
        .expect("queue subscribe");
        let codes = self.suback().await;
        assert!(
            matches!(codes[..], [rumqttc::SubscribeReasonCode::Success(_)]),
            "{codes:?}"
        );
    }

    pub async fn publish(&self, topic: &str, qos: QoS, retain: bool, payload: &[u8]) {
        crate::bounded_as(
            format!("room in the client's queue for PUBLISH {topic}"),
            self.client.publish(topic, qos, retain, payload.to_vec()),
        )
        .await
        .expect("queue publish");
    }

    /// Waits for the next PUBACK (QoS 1 publish handled by the broker).
    #[track_caller]
    pub fn puback(&mut self) -> impl std::future::Future<Output = ()> + '_ {
        self.wait(|p| matches!(p, Packet::PubAck(_)).then_some(()))
    }

    /// The next PUBLISH.
    #[track_caller]
    pub fn next_publish(&mut self) -> impl std::future::Future<Output = Publish> + '_ {
        self.wait(|p| match p {
            Packet::Publish(p) => Some(p.clone()),
            _ => None,
        })
    }

    /// Asserts no PUBLISH arrives within `quiet`.
    pub async fn no_publish(&mut self, quiet: Duration) {
        let deadline = tokio::time::Instant::now() + quiet;
        while let Ok(Some(ev)) = tokio::time::timeout_at(deadline, self.events.recv()).await {
            if let Ok(Event::Incoming(Packet::Publish(p))) = ev {
                panic!("unexpected publish on {}: {:?}", p.topic, p.payload);
            }
        }
    }

    /// Waits for the connection to end; returns the error text.
    pub async fn closed(&mut self) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .expect("the connection closed in time")
            {
                Some(Err(e)) => return e,
                Some(Ok(_)) => {}
                None => return "event loop ended".into(),
            }
        }
    }

    /// Drops the socket without DISCONNECT (as a crashed device would).
    pub fn kill(self) {
        self.task.abort();
    }
}

/// A v5 client with its event stream.
pub struct Client5 {
    pub client: rumqttc::v5::AsyncClient,
    pub events: mpsc::UnboundedReceiver<Result<rumqttc::v5::Event, String>>,
    task: tokio::task::JoinHandle<()>,
}

pub type Packet5 = rumqttc::v5::mqttbytes::v5::Packet;

impl MqttBroker {
    pub fn options5(&self, id: &str) -> rumqttc::v5::MqttOptions {
        let mut o = rumqttc::v5::MqttOptions::new(id, self.mqtt.ip().to_string(), self.mqtt.port());
        o.set_keep_alive(Duration::from_secs(30));
        o
    }

    pub async fn connect5_with(
        &self,
        options: rumqttc::v5::MqttOptions,
    ) -> (Client5, rumqttc::v5::mqttbytes::v5::ConnAck) {
        let (client, mut eventloop) = rumqttc::v5::AsyncClient::new(options, 1000);
        let (tx, events) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                let ev = eventloop.poll().await;
                let stop = ev.is_err();
                if tx.send(ev.map_err(|e| format!("{e:?}"))).is_err() || stop {
                    return;
                }
            }
        });
        let mut c = Client5 {
            client,
            events,
            task,
        };
        let ack = c
            .wait(|p| match p {
                Packet5::ConnAck(a) => Some(a.clone()),
                _ => None,
            })
            .await;
        (c, ack)
    }

    pub async fn connect5(&self, id: &str) -> Client5 {
        self.connect5_with(self.options5(id)).await.0
    }
}

impl Client5 {
    /// A plain fn (not `async`) so that `#[track_caller]` holds: a timeout names the line
    /// that waited, and so which packet.
    #[track_caller]
    pub fn wait<T>(
        &mut self,
        mut f: impl FnMut(&Packet5) -> Option<T>,
    ) -> impl std::future::Future<Output = T> {
        let at = std::panic::Location::caller();
        async move {
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                let ev = tokio::time::timeout_at(deadline, self.events.recv())
                    .await
                    .unwrap_or_else(|_| {
                        panic!("no expected packet within {WAIT:?}, awaited at {at}")
                    })
                    .expect("event loop running");
                match ev {
                    Ok(rumqttc::v5::Event::Incoming(p)) => {
                        if let Some(t) = f(&p) {
                            return t;
                        }
                    }
                    Ok(rumqttc::v5::Event::Outgoing(_)) => {}
                    Err(e) => panic!("connection error while waiting: {e}"),
                }
            }
        }
    }

    pub async fn subscribe(&mut self, filter: &str, qos: rumqttc::v5::mqttbytes::QoS) {
        // The request queue (1000) is full only while the event loop is stuck on the socket.
        crate::bounded_as(
            format!("room in the client's queue for SUBSCRIBE {filter}"),
            self.client.subscribe(filter, qos),
        )
        .await
        .expect("queue subscribe");
        self.wait(|p| matches!(p, Packet5::SubAck(_)).then_some(()))
            .await;
    }

    #[track_caller]
    pub fn next_publish(
        &mut self,
    ) -> impl std::future::Future<Output = rumqttc::v5::mqttbytes::v5::Publish> + '_ {
        self.wait(|p| match p {
            Packet5::Publish(p) => Some(p.clone()),
            _ => None,
        })
    }

    pub async fn no_publish(&mut self, quiet: Duration) {
        let deadline = tokio::time::Instant::now() + quiet;
        while let Ok(Some(ev)) = tokio::time::timeout_at(deadline, self.events.recv()).await {
            if let Ok(rumqttc::v5::Event::Incoming(Packet5::Publish(p))) = ev {
                panic!("unexpected publish on {:?}: {:?}", p.topic, p.payload);
            }
        }
    }

    /// Waits for the connection to end; returns the error text (v5 DISCONNECT reasons appear
    /// in it).
    pub async fn closed(&mut self) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .expect("the connection closed in time")
            {
                Some(Err(e)) => return e,
                Some(Ok(rumqttc::v5::Event::Incoming(Packet5::Disconnect(d)))) => {
                    return format!("{:?}", d.reason_code);
                }
                Some(Ok(_)) => {}
                None => return "event loop ended".into(),
            }
        }
    }

    pub fn kill(self) {
        self.task.abort();
    }
}
