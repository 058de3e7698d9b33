//! MQTT sessions over real sockets (rumqttc v3.1.1 and v5) against `warren serve`, across
//! restarts: the session table (every change of session mode, with no restart, SIGTERM and
//! kill -9 between the connections), offline queues resumed after a restart without a new
//! SUBSCRIBE, session expiry counted from the disconnect (the broker's downtime included)
//! and ended by a timer when the client never returns, delayed wills across a restart.
//!
//! Expectations are MQTT's (3.1.1 §3.1.2.4, 5.0 §3.1.2.4 and §4.1), checked against Mosquitto
//! 2.0 with persistence on where the text leaves doubt: `WARREN_SESSIONS_MOSQUITTO=1` runs the
//! same table against a `mosquitto` it starts on port 28830 (`session_table_mosquitto`).

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Restart {
    None,
    Term,
    Kill,
}

/// How a client connects: protocol, clean session / clean start, session expiry (v5).
#[derive(Clone, Copy, Debug)]
struct Mode {
    v5: bool,
    clean: bool,
    expiry: u32,
}

impl Mode {
    /// Whether the session outlives the connection.
    fn persistent(self) -> bool {
        if self.v5 {
            self.expiry > 0
        } else {
            !self.clean
        }
    }

    /// The mode a client resuming its session uses.
    fn resume(v5: bool) -> Mode {
        Mode {
            v5,
            clean: false,
            expiry: 3600,
        }
    }

    fn name(self) -> String {
        if self.v5 {
            format!("v5c{}e{}", u8::from(self.clean), self.expiry)
        } else {
            format!("v3c{}", u8::from(self.clean))
        }
    }
}

fn modes() -> Vec<Mode> {
    let mut out = Vec::new();
    for clean in [false, true] {
        out.push(Mode {
            v5: false,
            clean,
            expiry: 0,
        });
        for expiry in [0, 3600] {
            out.push(Mode {
                v5: true,
                clean,
                expiry,
            });
        }
    }
    out
}

enum Ev {
    ConnAck(bool),
    SubAck(bool),
    PubAck,
    Publish(Vec<u8>),
    Error(String),
}

/// A rumqttc client of either version, its events forwarded to a channel.
struct Client {
    v4: Option<rumqttc::AsyncClient>,
    v5: Option<rumqttc::v5::AsyncClient>,
    events: mpsc::UnboundedReceiver<Ev>,
    /// PUBLISH payloads that arrived while waiting for something else, in order.
    received: std::collections::VecDeque<Vec<u8>>,
    task: tokio::task::JoinHandle<()>,
}

impl Client {
    /// Connects; returns the client and CONNACK's session-present.
    async fn connect(addr: SocketAddr, id: &str, mode: Mode) -> (Client, bool) {
        let (tx, events) = mpsc::unbounded_channel();
        let (v4, v5, task) = if mode.v5 {
            use rumqttc::v5::mqttbytes::v5::Packet;
            let mut o = rumqttc::v5::MqttOptions::new(id, addr.ip().to_string(), addr.port());
            o.set_keep_alive(Duration::from_secs(30));
            o.set_clean_start(mode.clean);
            o.set_session_expiry_interval((mode.expiry > 0).then_some(mode.expiry));
            let (client, mut el) = rumqttc::v5::AsyncClient::new(o, 2000);
            let task = tokio::spawn(async move {
                loop {
                    let ev = match el.poll().await {
                        Ok(rumqttc::v5::Event::Incoming(p)) => match p {
                            Packet::ConnAck(a) => Ev::ConnAck(a.session_present),
                            Packet::SubAck(s) => Ev::SubAck(matches!(
                                s.return_codes[..],
                                [rumqttc::v5::mqttbytes::v5::SubscribeReasonCode::Success(_)]
                            )),
                            Packet::PubAck(_) => Ev::PubAck,
                            Packet::Publish(p) => Ev::Publish(p.payload.to_vec()),
                            _ => continue,
                        },
                        Ok(_) => continue,
                        Err(e) => Ev::Error(format!("{e:?}")),
                    };
                    let stop = matches!(ev, Ev::Error(_));
                    if tx.send(ev).is_err() || stop {
                        return;
                    }
                }
            });
            (None, Some(client), task)
        } else {
            use rumqttc::Packet;
            let mut o = rumqttc::MqttOptions::new(id, addr.ip().to_string(), addr.port());
            o.set_keep_alive(Duration::from_secs(30));
            o.set_clean_session(mode.clean);
            let (client, mut el) = rumqttc::AsyncClient::new(o, 2000);
            let task = tokio::spawn(async move {
                loop {
                    let ev = match el.poll().await {
                        Ok(rumqttc::Event::Incoming(p)) => match p {
                            Packet::ConnAck(a) => Ev::ConnAck(a.session_present),
                            Packet::SubAck(s) => Ev::SubAck(matches!(
                                s.return_codes[..],
                                [rumqttc::SubscribeReasonCode::Success(_)]
                            )),
                            Packet::PubAck(_) => Ev::PubAck,
                            Packet::Publish(p) => Ev::Publish(p.payload.to_vec()),
                            _ => continue,
                        },
                        Ok(_) => continue,
                        Err(e) => Ev::Error(e.to_string()),
                    };
                    let stop = matches!(ev, Ev::Error(_));
                    if tx.send(ev).is_err() || stop {
                        return;
                    }
                }
            });
            (Some(client), None, task)
        };
        let mut c = Client {
            v4,
            v5,
            events,
            received: Default::default(),
            task,
        };
        let present = c
            .wait(|e| match e {
                Ev::ConnAck(p) => Some(*p),
                _ => None,
            })
            .await;
        (c, present)
    }

    /// The first event `f` accepts, within [`WAIT`]; a timeout names the line that waited (a
    /// plain fn, not `async`, so that `#[track_caller]` holds).
    #[track_caller]
    fn wait<T>(
        &mut self,
        mut f: impl FnMut(&Ev) -> Option<T>,
    ) -> impl std::future::Future<Output = T> {
        let at = std::panic::Location::caller();
        async move {
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                let ev = tokio::time::timeout_at(deadline, self.events.recv())
                    .await
                    .unwrap_or_else(|_| {
                        panic!("no expected packet within {WAIT:?} (awaited at {at})")
                    })
                    .expect("event loop running");
                if let Ev::Error(e) = &ev {
                    panic!("connection error: {e}");
                }
                if let Some(t) = f(&ev) {
                    return t;
                }
                if let Ev::Publish(p) = ev {
                    self.received.push_back(p);
                }
            }
        }
    }

    /// The next PUBLISH payload.
    async fn next_publish(&mut self) -> Vec<u8> {
        if let Some(p) = self.received.pop_front() {
            return p;
        }
        self.wait(|e| match e {
            Ev::Publish(p) => Some(p.clone()),
            _ => None,
        })
        .await
    }

    async fn subscribe(&mut self, filter: &str) {
        if let Some(c) = &self.v4 {
            common::bounded_as(
                "room in the client queue for SUBSCRIBE",
                c.subscribe(filter, rumqttc::QoS::AtLeastOnce),
            )
            .await
            .expect("queue subscribe");
        } else if let Some(c) = &self.v5 {
            common::bounded_as(
                "room in the client queue for SUBSCRIBE",
                c.subscribe(filter, rumqttc::v5::mqttbytes::QoS::AtLeastOnce),
            )
            .await
            .expect("queue subscribe");
        }
        let ok = self
            .wait(|e| match e {
                Ev::SubAck(ok) => Some(*ok),
                _ => None,
            })
            .await;
        assert!(ok, "SUBACK grants {filter}");
    }

    /// Publishes at QoS 1 and waits for the PUBACK.
    async fn publish(&mut self, topic: &str, payload: &[u8]) {
        if let Some(c) = &self.v4 {
            common::bounded_as(
                "room in the client queue for PUBLISH",
                c.publish(topic, rumqttc::QoS::AtLeastOnce, false, payload.to_vec()),
            )
            .await
            .expect("queue publish");
        } else if let Some(c) = &self.v5 {
            common::bounded_as(
                "room in the client queue for PUBLISH",
                c.publish(
                    topic,
                    rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                    false,
                    payload.to_vec(),
                ),
            )
            .await
            .expect("queue publish");
        }
        self.wait(|e| matches!(e, Ev::PubAck).then_some(())).await;
    }

    /// Payloads received until (and without) `marker`.
    async fn until(&mut self, marker: &[u8]) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        loop {
            let p = self.next_publish().await;
            if p == marker {
                return got;
            }
            got.push(p);
        }
    }

    /// DISCONNECT (normal), then waits for the broker to close the socket.
    async fn disconnect(mut self) {
        if let Some(c) = &self.v4 {
            let _ =
                common::bounded_as("room in the client queue for DISCONNECT", c.disconnect()).await;
        } else if let Some(c) = &self.v5 {
            let _ =
                common::bounded_as("room in the client queue for DISCONNECT", c.disconnect()).await;
        }
        let _ = tokio::time::timeout(WAIT, async {
            while let Some(ev) = self.events.recv().await {
                if matches!(ev, Ev::Error(_)) {
                    return;
                }
            }
        })
        .await;
        self.task.abort();
    }
}

/// A broker under test that can be restarted on the same data.
trait Broker {
    fn mqtt(&self) -> SocketAddr;
    fn restart(&mut self, how: Restart);
}

struct Warren {
    child: Child,
    dir: PathBuf,
    mqtt: SocketAddr,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Warren {
    fn start(dir: PathBuf) -> Warren {
        let served = common::serve(&dir, true, &[]);
        Warren {
            child: served.child,
            mqtt: SocketAddr::from(([127, 0, 0, 1], served.mqtt.expect("MQTT port"))),
            log: served.log,
            dir,
        }
    }

    fn fresh(tag: &str) -> Warren {
        let dir =
            std::env::temp_dir().join(format!("warren-mqtt-sessions-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Warren::start(dir)
    }

    /// Names of the queues (`warren ctl list-queues`).
    fn queues(&self) -> String {
        let out = std::process::Command::new(common::BIN)
            .args(["ctl", "--data-dir"])
            .arg(&self.dir)
            .arg("list-queues")
            .output()
            .expect("run warren ctl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

fn stop(child: &mut Child, how: Restart) {
    match how {
        Restart::None => return,
        Restart::Term => {
            let pid = libc::pid_t::try_from(child.id()).expect("pid");
            // SAFETY: signalling our own child process.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        Restart::Kill => {
            let _ = child.kill();
        }
    }
    // Bounded: a broker that does not stop fails the test instead of hanging it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the broker did not exit within 30 s of {how:?}");
}

impl Broker for Warren {
    fn mqtt(&self) -> SocketAddr {
        self.mqtt
    }

    fn restart(&mut self, how: Restart) {
        if how == Restart::None {
            return;
        }
        self.stop(how);
        *self = Warren::start(self.dir.clone());
    }
}

impl Warren {
    /// Stops the broker; a broker that does not stop fails the test with its log.
    fn stop(&mut self, how: Restart) {
        let child = &mut self.child;
        let log = self.log.clone();
        let stopped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stop(child, how)));
        if stopped.is_err() {
            let lines = log.lock().map(|l| l.join("\n")).unwrap_or_default();
            panic!("the broker did not stop after {how:?}; its log:\n{lines}");
        }
    }
}

impl Drop for Warren {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The session table over one broker and one kind of restart: for every (first mode, second
/// mode) of a protocol version, a client subscribes and leaves, three messages are published
/// to it, the broker restarts (or not), and the client comes back in the second mode:
/// session-present and the queued messages must follow MQTT's session rules; then it
/// subscribes and receives, and a third connection that resumes finds the second's session
/// exactly when that one was persistent.
async fn session_table(b: &mut dyn Broker, how: Restart, tag: &str) -> Vec<String> {
    let mut cases = Vec::new();
    for first in modes() {
        for second in modes() {
            if first.v5 == second.v5 {
                cases.push((first, second));
            }
        }
    }
    let id = |first: Mode, second: Mode| format!("{tag}-{}-{}", first.name(), second.name());
    let topic = |first: Mode, second: Mode| format!("t/{}", id(first, second));
    for &(first, second) in &cases {
        let (mut c, present) = Client::connect(b.mqtt(), &id(first, second), first).await;
        assert!(
            !present,
            "{}: a new client id has no session",
            id(first, second)
        );
        c.subscribe(&topic(first, second)).await;
        c.disconnect().await;
    }
    let off = Mode {
        v5: false,
        clean: true,
        expiry: 0,
    };
    let (mut publisher, _) = Client::connect(b.mqtt(), &format!("{tag}-pub"), off).await;
    for &(first, second) in &cases {
        for m in [&b"m1"[..], b"m2", b"m3"] {
            publisher.publish(&topic(first, second), m).await;
        }
    }
    publisher.disconnect().await;
    b.restart(how);
    let (mut publisher, _) = Client::connect(b.mqtt(), &format!("{tag}-pub2"), off).await;
    let mut rows = Vec::new();
    for &(first, second) in &cases {
        let name = id(first, second);
        let t = topic(first, second);
        let expect_present = first.persistent() && !second.clean;
        let (mut c, present) = Client::connect(b.mqtt(), &name, second).await;
        // The queued messages arrive without a new SUBSCRIBE when the session is present:
        // publish a marker through the (re)subscribed filter and see what came before it.
        c.subscribe(&t).await;
        publisher.publish(&t, b"m4").await;
        let before = c.until(b"m4").await;
        let expect: Vec<Vec<u8>> = if expect_present {
            vec![b"m1".to_vec(), b"m2".to_vec(), b"m3".to_vec()]
        } else {
            Vec::new()
        };
        c.disconnect().await;
        let (mut c, present3) = Client::connect(b.mqtt(), &name, Mode::resume(first.v5)).await;
        c.subscribe(&t).await;
        publisher.publish(&t, b"m5").await;
        let leftovers = c.until(b"m5").await;
        c.disconnect().await;
        rows.push(format!(
            "{how:?} {name}: present {present} (want {expect_present}), queued {} (want {}), third present {present3} (want {}), leftovers {}",
            before.len(),
            expect.len(),
            second.persistent(),
            leftovers.len()
        ));
        assert_eq!(present, expect_present, "{name}: session present");
        assert_eq!(before, expect, "{name}: queued messages");
        assert_eq!(present3, second.persistent(), "{name}: third connection");
        assert!(
            leftovers.is_empty(),
            "{name}: nothing left over: {leftovers:?}"
        );
    }
    publisher.disconnect().await;
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_table_without_restart() {
    let mut b = Warren::fresh("none");
    for row in session_table(&mut b, Restart::None, "n").await {
        println!("{row}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_table_across_sigterm() {
    let mut b = Warren::fresh("term");
    for row in session_table(&mut b, Restart::Term, "t").await {
        println!("{row}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_table_across_kill_9() {
    let mut b = Warren::fresh("kill");
    for row in session_table(&mut b, Restart::Kill, "k").await {
        println!("{row}");
    }
}

/// 1000 QoS 1 messages queued for an offline session come back after a restart with
/// session-present 1 and no new SUBSCRIBE (Mosquitto with persistence: 1000/1000 after a
/// clean stop), after SIGTERM and after kill -9, for v3.1.1 and v5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_queue_resumes_after_restart_without_resubscribe() {
    let mut b = Warren::fresh("resume");
    for (how, v5) in [
        (Restart::Term, false),
        (Restart::Kill, false),
        (Restart::Term, true),
        (Restart::Kill, true),
    ] {
        let id = format!("resume-{how:?}-{v5}");
        let mode = Mode::resume(v5);
        let (mut c, _) = Client::connect(b.mqtt(), &id, mode).await;
        c.subscribe(&format!("r/{id}")).await;
        c.disconnect().await;
        let off = Mode {
            v5: false,
            clean: true,
            expiry: 0,
        };
        let (mut publisher, _) = Client::connect(b.mqtt(), "resume-pub", off).await;
        for i in 0..1000u32 {
            publisher
                .publish(&format!("r/{id}"), &i.to_be_bytes())
                .await;
        }
        publisher.disconnect().await;
        b.restart(how);
        let (mut c, present) = Client::connect(b.mqtt(), &id, mode).await;
        assert!(present, "{id}: session present after {how:?}");
        for i in 0..1000u32 {
            let p = c.next_publish().await;
            assert_eq!(p, i.to_be_bytes(), "{id}: message {i} in order");
        }
        c.disconnect().await;
    }
}

/// Session expiry is counted from the disconnect, and a session whose client never returns
/// is ended by a timer (its queue deleted) while the broker runs; the broker's downtime
/// counts too (as Mosquitto): a session that expired while the broker was stopped is gone
/// after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_expiry_is_a_timer_and_counts_across_restarts() {
    let mut b = Warren::fresh("expiry");
    let short = Mode {
        v5: true,
        clean: false,
        expiry: 2,
    };
    // Ended by the timer, the client never coming back.
    let (mut c, _) = Client::connect(b.mqtt(), "exp-timer", short).await;
    c.subscribe("e/timer").await;
    c.disconnect().await;
    let left = std::time::Instant::now();
    assert!(
        b.queues().contains("mqtt-subscription-exp-timerqos1"),
        "queue while the session lives"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        b.queues().contains("mqtt-subscription-exp-timerqos1"),
        "still within the expiry"
    );
    let mut gone = false;
    while left.elapsed() < Duration::from_secs(5) {
        if !b.queues().contains("mqtt-subscription-exp-timerqos1") {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        gone,
        "the session queue is deleted when the session expires"
    );
    assert!(
        left.elapsed() >= Duration::from_secs(2),
        "not before the expiry: {:?}",
        left.elapsed()
    );

    // Expiring during the downtime.
    let (mut c, _) = Client::connect(b.mqtt(), "exp-down", short).await;
    c.subscribe("e/down").await;
    c.disconnect().await;
    // And one that does not expire over the same restart.
    let long = Mode {
        v5: true,
        clean: false,
        expiry: 60,
    };
    let (mut c, _) = Client::connect(b.mqtt(), "exp-kept", long).await;
    c.subscribe("e/kept").await;
    c.disconnect().await;
    // kill -9: the disconnect times were stored by the writer (milliseconds after each
    // DISCONNECT), so the count goes on from them through the downtime. (With SIGTERM here,
    // ~100 ms after the expiry above deleted a queue, `BrokerHandle::stop` did not return
    // under load, in main's stop path; reported, not worked around in the broker.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.stop(Restart::Kill);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let dir = b.dir.clone();
    drop(b);
    let b = Warren::start(dir);
    let (c, present) = Client::connect(b.mqtt(), "exp-down", short).await;
    assert!(!present, "expired while the broker was down");
    c.disconnect().await;
    let (c, present) = Client::connect(b.mqtt(), "exp-kept", long).await;
    assert!(present, "within its expiry across the restart");
    c.disconnect().await;
}

/// A will delay running when the broker stops is kept: the will is published when it was
/// due, by the restarted broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_will_survives_a_restart() {
    use rumqttc::v5::mqttbytes::v5::{LastWill, LastWillProperties};
    let mut b = Warren::fresh("will");
    // The watcher keeps a persistent session, so it gets the will whenever it comes back.
    let watch = Mode::resume(false);
    let (mut w, _) = Client::connect(b.mqtt(), "will-watch", watch).await;
    w.subscribe("wills/#").await;
    w.disconnect().await;

    let mut o = rumqttc::v5::MqttOptions::new("will-dev", "127.0.0.1", b.mqtt().port());
    o.set_keep_alive(Duration::from_secs(30));
    o.set_clean_start(false);
    o.set_session_expiry_interval(Some(60));
    o.set_last_will(LastWill::new(
        "wills/dev",
        "gone",
        rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
        false,
        Some(LastWillProperties {
            delay_interval: Some(3),
            payload_format_indicator: None,
            message_expiry_interval: None,
            content_type: None,
            response_topic: None,
            correlation_data: None,
            user_properties: vec![],
        }),
    ));
    let (client, mut el) = rumqttc::v5::AsyncClient::new(o, 10);
    let dev = tokio::spawn(async move {
        loop {
            if let Ok(rumqttc::v5::Event::Incoming(rumqttc::v5::mqttbytes::v5::Packet::ConnAck(
                _,
            ))) = el.poll().await
            {
                return el;
            }
        }
    });
    let el = tokio::time::timeout(WAIT, dev)
        .await
        .expect("CONNACK")
        .expect("task");
    // Gone without DISCONNECT: the will waits 3 s.
    drop(el);
    drop(client);
    tokio::time::sleep(Duration::from_millis(500)).await;
    b.restart(Restart::Term);
    let (mut w, present) = Client::connect(b.mqtt(), "will-watch", watch).await;
    assert!(present);
    let got = w.next_publish().await;
    assert_eq!(got, b"gone");
    w.disconnect().await;
}

/// The table against Mosquitto (persistence on, port 28830), to compare expectations:
/// `WARREN_SESSIONS_MOSQUITTO=1 cargo test -p warren-cli --test mqtt_sessions -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs mosquitto; run by hand to compare"]
async fn session_table_mosquitto() {
    if std::env::var_os("WARREN_SESSIONS_MOSQUITTO").is_none() {
        return;
    }
    let mut m = Mosquitto::start();
    for how in [Restart::None, Restart::Term] {
        for row in session_table(&mut m, how, &format!("mq{how:?}")).await {
            println!("{row}");
        }
    }
}

struct Mosquitto {
    child: Child,
    dir: PathBuf,
}

impl Mosquitto {
    fn start() -> Mosquitto {
        let dir = std::env::temp_dir().join(format!("warren-mosquitto-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        Mosquitto::run(dir)
    }

    fn run(dir: PathBuf) -> Mosquitto {
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "user root\nlistener 28830 127.0.0.1\nallow_anonymous true\npersistence true\npersistence_location {}/\nmax_queued_messages 100000\n",
                dir.display()
            ),
        )
        .expect("conf");
        let child = std::process::Command::new("mosquitto")
            .arg("-c")
            .arg(&conf)
            .spawn()
            .expect("start mosquitto");
        std::thread::sleep(Duration::from_millis(500));
        Mosquitto { child, dir }
    }
}

impl Broker for Mosquitto {
    fn mqtt(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 28830))
    }

    fn restart(&mut self, how: Restart) {
        if how == Restart::None {
            return;
        }
        stop(&mut self.child, how);
        *self = Mosquitto::run(self.dir.clone());
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Raw MQTT 3.1.1 over a blocking socket, for packet ids and flags rumqttc hides.
mod raw {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    pub struct Raw(TcpStream);

    pub fn str(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u16).to_be_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    impl Raw {
        /// CONNECT (3.1.1, keep-alive 60 s); returns the client and session-present.
        pub fn connect(addr: SocketAddr, id: &str, clean: bool) -> (Raw, bool) {
            let s = TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let mut r = Raw(s);
            let mut body = str("MQTT");
            body.extend_from_slice(&[4, if clean { 2 } else { 0 }, 0, 60]);
            body.extend(str(id));
            r.send(0x10, &body);
            let (kind, ack) = r.read();
            assert_eq!((kind, ack[1]), (0x20, 0), "CONNACK accepted");
            (r, ack[0] & 1 == 1)
        }

        pub fn send(&mut self, first: u8, body: &[u8]) {
            let mut p = vec![first];
            let mut n = body.len();
            loop {
                let mut b = (n % 128) as u8;
                n /= 128;
                if n > 0 {
                    b |= 0x80;
                }
                p.push(b);
                if n == 0 {
                    break;
                }
            }
            p.extend_from_slice(body);
            self.0.write_all(&p).expect("write");
        }

        /// The next packet: (first byte, body).
        pub fn read(&mut self) -> (u8, Vec<u8>) {
            let mut first = [0u8; 1];
            self.0.read_exact(&mut first).expect("a packet in time");
            let (mut len, mut shift) = (0usize, 0);
            loop {
                let mut b = [0u8; 1];
                self.0.read_exact(&mut b).expect("length");
                len |= usize::from(b[0] & 0x7f) << shift;
                shift += 7;
                if b[0] & 0x80 == 0 {
                    break;
                }
            }
            let mut body = vec![0u8; len];
            self.0.read_exact(&mut body).expect("body");
            (first[0], body)
        }

        /// A QoS 1/2 PUBLISH: (flags, topic, packet id, payload).
        pub fn publish_in(&mut self) -> (u8, String, u16, Vec<u8>) {
            let (first, body) = self.read();
            assert_eq!(first >> 4, 3, "a PUBLISH");
            let tl = usize::from(u16::from_be_bytes([body[0], body[1]]));
            let topic = String::from_utf8(body[2..2 + tl].to_vec()).expect("topic");
            let pid = u16::from_be_bytes([body[2 + tl], body[3 + tl]]);
            (first & 0x0f, topic, pid, body[4 + tl..].to_vec())
        }

        pub fn publish(&mut self, topic: &str, qos: u8, pid: u16, dup: bool, payload: &[u8]) {
            let mut body = str(topic);
            body.extend_from_slice(&pid.to_be_bytes());
            body.extend_from_slice(payload);
            self.send(0x30 | qos << 1 | u8::from(dup) << 3, &body);
        }

        pub fn subscribe(&mut self, filter: &str, qos: u8) {
            let mut body = vec![0, 1];
            body.extend(str(filter));
            body.push(qos);
            self.send(0x82, &body);
            let (kind, ack) = self.read();
            assert_eq!((kind, ack[2]), (0x90, qos), "SUBACK grants QoS {qos}");
        }

        pub fn disconnect(mut self) {
            self.send(0xE0, &[]);
            let mut rest = Vec::new();
            let _ = self.0.read_to_end(&mut rest);
        }
    }
}

/// The QoS 1/2 packet state of a session survives SIGTERM: an unacknowledged outbound
/// message comes back with DUP under its original packet id (MQTT-4.4.0-1), and an inbound
/// QoS 2 message that got PUBREC but no PUBREL is not routed again when the client resends it
/// (exactly once across the restart), then completes with PUBREL/PUBCOMP.
#[test]
fn qos_packet_state_survives_sigterm() {
    use raw::Raw;
    let mut b = Warren::fresh("pids");
    let (mut w, _) = Raw::connect(b.mqtt(), "pids-watch", false);
    w.subscribe("r/#", 1);
    w.disconnect();
    let (mut s, _) = Raw::connect(b.mqtt(), "pids-sub", false);
    s.subscribe("q/#", 1);
    let (mut p, _) = Raw::connect(b.mqtt(), "pids-pub", true);
    // Three acknowledged deliveries first, so the one left unacknowledged has id 4, not the
    // 1 a forgetful broker would give it again.
    for (i, m) in ["a", "b", "c", "one"].iter().enumerate() {
        p.publish("q/x", 1, i as u16 + 1, false, m.as_bytes());
        assert_eq!(p.read().0, 0x40, "PUBACK");
        let (_, _, pid, payload) = s.publish_in();
        assert_eq!(payload, m.as_bytes());
        if *m != "one" {
            s.send(0x40, &pid.to_be_bytes());
        } else {
            assert_eq!(pid, 4);
        }
    }
    // Inbound QoS 2: routed and PUBREC'd, never released before the restart.
    s.publish("r/b", 2, 9, false, b"two");
    let (kind, rec) = s.read();
    assert_eq!((kind, &rec[..]), (0x50, &[0, 9][..]), "PUBREC 9");
    s.disconnect();
    p.disconnect();

    b.restart(Restart::Term);
    let (mut s, present) = Raw::connect(b.mqtt(), "pids-sub", false);
    assert!(present);
    let (flags, topic, pid, payload) = s.publish_in();
    assert_eq!((topic.as_str(), &payload[..]), ("q/x", &b"one"[..]));
    assert_eq!(pid, 4, "the original packet id");
    assert_eq!(flags & 0x08, 0x08, "DUP");
    s.send(0x40, &pid.to_be_bytes());
    s.publish("r/b", 2, 9, true, b"two");
    let (kind, rec) = s.read();
    assert_eq!((kind, &rec[..]), (0x50, &[0, 9][..]), "PUBREC 9 again");
    s.send(0x62, &[0, 9]);
    let (kind, comp) = s.read();
    assert_eq!((kind, &comp[..]), (0x70, &[0, 9][..]), "PUBCOMP 9");
    s.publish("r/end", 1, 10, false, b"end");
    assert_eq!(s.read().0, 0x40, "PUBACK");
    s.disconnect();
    let (mut w, present) = Raw::connect(b.mqtt(), "pids-watch", false);
    assert!(present);
    let got: Vec<Vec<u8>> = (0..2)
        .map(|_| {
            let (_, _, pid, payload) = w.publish_in();
            w.send(0x40, &pid.to_be_bytes());
            payload
        })
        .collect();
    assert_eq!(got, [b"two".to_vec(), b"end".to_vec()], "QoS 2 routed once");
    w.disconnect();
}
