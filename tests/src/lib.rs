//! Test harness: a broker with its AMQP listener on an ephemeral loopback port inside the
//! test's runtime, plus bounded helpers so a broken server fails a test instead of hanging it.

pub mod mqtt;

use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, Consumer, ErrorKind, message::Delivery};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How long any single expected event may take.
pub const WAIT: Duration = Duration::from_secs(5);

/// A running broker; stops (connections get 320) when dropped.
pub struct TestBroker {
    pub addr: SocketAddr,
    /// The broker behind the listener, for admin requests (users, vhosts, permissions).
    pub broker: warren_runtime::BrokerHandle,
    pub uri: String,
    pub(crate) stop: tokio::sync::watch::Sender<bool>,
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// Starts a broker on 127.0.0.1 with an ephemeral port.
pub async fn start() -> TestBroker {
    serve(warren_runtime::BrokerHandle::start(
        warren_core::BrokerConfig::default(),
    ))
    .await
}

/// Starts a broker of `shards` shards (connections and their queues spread over them) on
/// 127.0.0.1 with an ephemeral port.
pub async fn start_sharded(shards: u32) -> TestBroker {
    serve(warren_runtime::BrokerHandle::start_sharded(
        warren_core::BrokerConfig::default(),
        shards,
    ))
    .await
}

async fn serve(broker: warren_runtime::BrokerHandle) -> TestBroker {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let addr = listener.local_addr().expect("local address");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(warren_amqp::serve(
        listener,
        broker.clone(),
        Arc::new(warren_amqp::AmqpConfig::default()),
        stopped,
    ));
    TestBroker {
        addr,
        broker,
        uri: format!("amqp://guest:guest@{addr}/%2f"),
        stop,
    }
}

impl TestBroker {
    pub async fn connect(&self) -> Connection {
        bounded_as(
            format!("connection.open-ok from {}", self.uri),
            Connection::connect(&self.uri, ConnectionProperties::default()),
        )
        .await
        .expect("connect")
    }

    pub async fn channel(&self) -> (Connection, Channel) {
        let conn = self.connect().await;
        let ch = bounded_as("channel.open-ok", conn.create_channel())
            .await
            .expect("open channel");
        (conn, ch)
    }
}

/// Awaits `f` for at most [`WAIT`]. A plain fn (not `async`) so that `#[track_caller]` holds:
/// the panic names the test's line, that is what was waited for.
#[track_caller]
pub fn bounded<F: Future>(f: F) -> impl Future<Output = F::Output> {
    bounded_as("an answer", f)
}

/// Awaits `f` for at most [`WAIT`]; the panic names `what` and the caller's line.
#[track_caller]
pub fn bounded_as<F: Future>(
    what: impl std::fmt::Display,
    f: F,
) -> impl Future<Output = F::Output> {
    let at = std::panic::Location::caller();
    async move {
        match tokio::time::timeout(WAIT, f).await {
            Ok(v) => v,
            Err(_) => panic!("no {what} within {WAIT:?} (awaited at {at})"),
        }
    }
}

/// Declares a plain queue.
pub async fn declare(ch: &Channel, name: &str) -> lapin::Queue {
    bounded_as(
        format!("queue.declare-ok for {name:?}"),
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("queue.declare")
}

pub async fn consume(ch: &Channel, queue: &str, no_ack: bool) -> Consumer {
    bounded_as(
        format!("basic.consume-ok on {queue:?}"),
        ch.basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions {
                no_ack,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("basic.consume")
}

/// The next delivery of `consumer` (the panic names the caller's line).
#[track_caller]
pub fn next(consumer: &mut Consumer) -> impl Future<Output = Delivery> + '_ {
    let delivery = bounded_as("delivery", consumer.next());
    async move {
        delivery
            .await
            .expect("consumer still open")
            .expect("a delivery")
    }
}

/// Asserts no delivery arrives within `quiet`.
pub async fn nothing_within(consumer: &mut Consumer, quiet: Duration) {
    if let Ok(Some(d)) = tokio::time::timeout(quiet, consumer.next()).await {
        panic!("unexpected delivery: {:?}", d.map(|d| d.data));
    }
}

/// The AMQP reply code of a broker-reported error.
pub fn code(err: &lapin::Error) -> u16 {
    match err.kind() {
        ErrorKind::ProtocolError(e) => e.get_id(),
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

pub fn body(d: &Delivery) -> String {
    String::from_utf8_lossy(&d.data).into_owned()
}

/// Takes every ready message of `queue` with basic.get (no-ack); returns the bodies in order.
pub async fn drain(ch: &Channel, queue: &str) -> Vec<String> {
    let mut got = Vec::new();
    while let Some(m) = bounded_as(
        format!("basic.get-ok/get-empty on {queue:?}"),
        ch.basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
        ),
    )
    .await
    .expect("basic.get")
    {
        got.push(body(&m.delivery));
    }
    got
}

/// The next `n` deliveries of `consumer`, each within [`WAIT`].
pub async fn take(consumer: &mut Consumer, n: usize) -> Vec<Delivery> {
    let mut got = Vec::with_capacity(n);
    for _ in 0..n {
        got.push(next(consumer).await);
    }
    got
}

/// A broker-reported error: reply code, reply text, and whether it was a connection
/// (hard) error rather than a channel (soft) one.
pub fn reply(err: &lapin::Error) -> (u16, String, bool) {
    match err.kind() {
        ErrorKind::ProtocolError(e) => (
            e.get_id(),
            e.get_message().to_string(),
            matches!(e.kind(), lapin::protocol::AMQPErrorKind::Hard(_)),
        ),
        other => panic!("expected a protocol error from the broker, got {other:?}"),
    }
}

/// Runs `op` on a fresh channel of `conn` and checks that the broker closed that channel, and
/// only it, with `code`; the reply text must start with `name - ` and mention `mentions`.
pub async fn channel_error<T, F, Fut>(
    conn: &Connection,
    code: u16,
    name: &str,
    mentions: &str,
    op: F,
) where
    T: std::fmt::Debug,
    F: FnOnce(Channel) -> Fut,
    Fut: Future<Output = lapin::Result<T>>,
{
    let ch = bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("open channel");
    let mut events = Box::pin(conn.events_listener());
    let res = bounded_as(
        format!("answer (expected {code} {name}) to the operation"),
        op(ch.clone()),
    )
    .await;
    let err = match res {
        Ok(v) => panic!("expected {code} {name} ({mentions}), got success: {v:?}"),
        Err(e) if e.is_amqp_error() => e,
        // A method without a reply (basic.ack) fails later: the operation after it finds the
        // channel already closing, and the broker's reason comes as a connection event (the
        // first one on that connection: use a fresh connection for such cases).
        Err(_) => {
            bounded_as(
                format!("channel.close {code} {name} from the broker"),
                async {
                    loop {
                        match events.next().await {
                            Some(lapin::Event::Error(e)) if e.is_amqp_error() => break e,
                            Some(_) => continue,
                            None => panic!("no channel.close from the broker"),
                        }
                    }
                },
            )
            .await
        }
    };
    let (got_code, text, hard) = reply(&err);
    assert_eq!(
        (got_code, hard),
        (code, false),
        "expected channel error {code} {name} ({mentions}); got {got_code} {text:?} (hard={hard})"
    );
    assert!(
        text.starts_with(&format!("{name} - ")),
        "reply text {text:?} should start with `{name} - `"
    );
    assert!(
        text.contains(mentions),
        "reply text {text:?} should mention {mentions:?}"
    );
    eventually("the failed channel is closed", || !ch.status().connected()).await;
    assert!(
        conn.status().connected(),
        "a channel error ({code} {name}) must not close the connection"
    );
}

/// Waits (bounded) until `done()` holds; panics with `what` otherwise.
pub async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
