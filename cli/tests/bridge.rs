//! MQTT bridges (`[[bridge]]` in warren.toml, Mosquitto's `connection` blocks) between real
//! brokers over real sockets: `warren serve` processes and Mosquitto 2.0 (`mosquitto` must
//! be installed: these tests fail without it, as CI installs it), rumqttc clients checking
//! what arrived; QoS 1 out and in, loop prevention with `both` (MQTT 3.1.1's echo filter
//! and MQTT 5's no_local), a kill -9 of the remote broker mid-stream, a restart of the
//! bridging broker, refused configurations, `warren ctl bridge-status`.

mod common;

use common::{BIN, Served, dies_with_test, scratch_dir};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A port nobody listens on now.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// Waits until something accepts on `port` (at most 20 s).
fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nothing listens on {port} after 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Mosquitto, killed when dropped.
struct Mosquitto {
    child: Child,
    port: u16,
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn mosquitto_bin() -> PathBuf {
    [
        "/usr/sbin/mosquitto",
        "/usr/bin/mosquitto",
        "/usr/local/sbin/mosquitto",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
    .expect("mosquitto is not installed (apt-get install mosquitto): the bridge tests need it")
}

/// Starts Mosquitto on `port` (loopback, anonymous) with `extra` configuration lines.
fn mosquitto(dir: &Path, port: u16, extra: &str) -> Mosquitto {
    let conf = dir.join(format!("mosquitto-{port}.conf"));
    std::fs::write(
        &conf,
        // No per-client queue limit: Mosquitto's default (1000 QoS 1 messages queued for a
        // client) drops what a slow test subscriber has not taken yet, which is Mosquitto's
        // choice about its own subscriber, not a loss by the bridge under test.
        format!(
            "listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n{extra}\n"
        ),
    )
    .expect("write mosquitto.conf");
    let child = dies_with_test(&mut Command::new(mosquitto_bin()))
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start mosquitto");
    wait_listening(port);
    Mosquitto { child, port }
}

/// A `warren serve` killed (SIGKILL) when dropped; its data directory stays.
struct Warren(Served);

impl Drop for Warren {
    fn drop(&mut self) {
        let _ = self.0.child.kill();
        let _ = self.0.child.wait();
    }
}

impl Warren {
    fn mqtt(&self) -> u16 {
        self.0.mqtt.expect("MQTT port")
    }

    /// The Prometheus text.
    fn metrics(&self) -> String {
        let port = self.0.prometheus.expect("Prometheus port");
        common::http::raw(port, "GET", "/metrics", &[], b"").text()
    }

    /// A metric's value (the first line starting with `series`).
    fn metric(&self, series: &str) -> Option<u64> {
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    }
}

/// Starts `warren serve` on `dir` with MQTT on `mqtt` (`127.0.0.1:0` for a free port),
/// Prometheus and the HTTP API on free ports, `config` as its warren.toml (if any); every other listener
/// off but AMQP on a free port. Waits until it logs its ports.
fn warren(dir: &Path, mqtt: &str, config: Option<&str>) -> Warren {
    let mut cmd = Command::new(BIN);
    dies_with_test(&mut cmd).args([
        "serve",
        "--amqp",
        "127.0.0.1:0",
        "--mqtt",
        mqtt,
        "--management",
        "127.0.0.1:0",
        "--prometheus",
        "127.0.0.1:0",
        "--stream",
        "none",
        "--data-dir",
    ]);
    std::fs::create_dir_all(dir).expect("create the data dir");
    cmd.arg(dir);
    if let Some(c) = config {
        let path = dir.join("warren.toml");
        std::fs::write(&path, c).expect("write warren.toml");
        cmd.arg("--config").arg(path);
    }
    let mut child = cmd
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start warren serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let log = Arc::new(Mutex::new(Vec::new()));
    let kept = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(mut kept) = kept.lock() {
                kept.push(line.clone());
            }
            if let Some(rest) = line.split("listening on 127.0.0.1:").nth(1) {
                let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                let kind = ["(AMQP", "(MQTT", "(Prometheus", "(HTTP"]
                    .iter()
                    .position(|k| rest.contains(k));
                let _ = tx.send((kind, port.parse::<u16>().ok()));
            }
        }
    });
    let mut ports: [Option<u16>; 4] = [None; 4];
    while ports.iter().any(Option::is_none) {
        let (kind, p) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("warren serve logs its ports within 20 s");
        if let Some(k) = kind {
            ports[k] = p;
        }
    }
    Warren(Served {
        child,
        amqp: ports[0].expect("AMQP"),
        mqtt: ports[1],
        management: ports[3],
        prometheus: ports[2],
        stream: None,
        log,
    })
}

/// Waits (at most 20 s) until the broker logged that bridge `name` runs.
fn bridge_running(w: &Warren, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !w.0.logged(&["bridge running", name]) {
        assert!(
            Instant::now() < deadline,
            "bridge {name} is not running after 20 s: {:?}",
            w.0.log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .filter(|l| l.contains("bridge"))
                .collect::<Vec<_>>()
        );
    }
}

/// What a subscriber received: payload -> times, and topics seen.
#[derive(Default)]
struct Got {
    times: BTreeMap<String, u32>,
    topics: BTreeMap<String, u32>,
}

type Seen = Arc<Mutex<Got>>;

/// An MQTT 3.1.1 subscriber (QoS 1) to `filters` on `port`, kept polling (and reconnecting)
/// in a task; `clean`: a clean session, else a persistent one named `id`.
async fn subscriber(
    port: u16,
    id: &str,
    clean: bool,
    filters: &[&str],
) -> (rumqttc::AsyncClient, Seen) {
    let mut o = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
    o.set_clean_session(clean)
        .set_keep_alive(Duration::from_secs(30))
        .set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut el) = rumqttc::AsyncClient::new(o, 100);
    for f in filters {
        client
            .subscribe(*f, rumqttc::QoS::AtLeastOnce)
            .await
            .expect("subscribe");
    }
    let seen: Seen = Arc::default();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut tx = Some(tx);
    let kept = seen.clone();
    tokio::spawn(async move {
        loop {
            match el.poll().await {
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) => {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(());
                    }
                }
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => {
                    let mut g = kept
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let body = String::from_utf8_lossy(&p.payload).into_owned();
                    *g.times.entry(body).or_default() += 1;
                    *g.topics.entry(p.topic.clone()).or_default() += 1;
                }
                Ok(_) => {}
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(20), rx)
        .await
        .expect("SUBACK within 20 s")
        .expect("SUBACK");
    (client, seen)
}

/// Publishes `bodies` to `topic` on `port` with QoS 1 (MQTT 3.1.1) and returns those the
/// broker acknowledged, within `within` (or until the broker goes away).
async fn publish(port: u16, topic: &str, bodies: &[String], within: Duration) -> Vec<String> {
    let id = format!("pub-{}-{}", std::process::id(), free_port());
    let mut o = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(30))
        .set_inflight(100)
        .set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut el) = rumqttc::AsyncClient::new(o, 10);
    let all = bodies.to_vec();
    let topic = topic.to_string();
    tokio::spawn(async move {
        for b in all {
            if client
                .publish(
                    topic.as_str(),
                    rumqttc::QoS::AtLeastOnce,
                    false,
                    b.into_bytes(),
                )
                .await
                .is_err()
            {
                break;
            }
        }
    });
    // Packet ids are handed out in order: the nth outgoing publish is the nth body.
    let mut numbered: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    let mut next = 0usize;
    let mut acked = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while acked.len() < bodies.len() {
        let ev = tokio::time::timeout_at(deadline, el.poll()).await;
        match ev {
            Err(_) => break,
            Ok(Ok(rumqttc::Event::Outgoing(rumqttc::Outgoing::Publish(pkid)))) => {
                numbered.entry(pkid).or_default().push(next);
                next += 1;
            }
            Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(a)))) => {
                if let Some(list) = numbered.get_mut(&a.pkid)
                    && !list.is_empty()
                {
                    let i = list.remove(0);
                    acked.push(bodies[i].clone());
                }
            }
            Ok(Ok(_)) => {}
            // The broker went away (a kill): what it acknowledged so far.
            Ok(Err(_)) => break,
        }
    }
    acked
}

/// Waits until `seen` holds every one of `bodies` (at most `within`).
async fn arrives(seen: &Seen, bodies: &[String], within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    loop {
        let missing = {
            let g = seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            bodies.iter().filter(|b| !g.times.contains_key(*b)).count()
        };
        if missing == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {missing} of {} messages missing after {within:?}",
            bodies.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn bodies(tag: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{tag}-{i}")).collect()
}

fn times(seen: &Seen, tag: &str) -> (usize, u32) {
    let g = seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mine: Vec<u32> = g
        .times
        .iter()
        .filter(|(b, _)| b.starts_with(tag))
        .map(|(_, n)| *n)
        .collect();
    (mine.len(), mine.iter().sum())
}

/// The issue's configuration as written, against Mosquitto 2.0: QoS 1 out (with the
/// forwarding rate), QoS 1 in, the retained notification on both brokers, the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warren_to_mosquitto_out_and_in() {
    let dir = scratch_dir("bridge", "mosq");
    let m = mosquitto(&dir, free_port(), "");
    let config = format!(
        "[[bridge]]\nname = \"edge\"\naddress = [\"127.0.0.1:{}\"]\n\
         topic = [\"sensors/# out 1\", \"commands/# in 1\"]\nremote_clientid = \"edge-test\"\n",
        m.port
    );
    let w = warren(&dir.join("w"), "127.0.0.1:0", Some(&config));
    bridge_running(&w, "edge");
    let (_c, remote) = subscriber(
        m.port,
        "far",
        true,
        &["sensors/#", "$SYS/broker/connection/#"],
    )
    .await;
    let (_c2, local) = subscriber(
        w.mqtt(),
        "near",
        true,
        &["commands/#", "$SYS/broker/connection/#"],
    )
    .await;

    let n = 2000;
    let out = bodies("out", n);
    let t0 = Instant::now();
    let acked = publish(w.mqtt(), "sensors/room1", &out, Duration::from_secs(60)).await;
    assert_eq!(acked.len(), n, "Warren acknowledged every publish");
    arrives(
        &remote,
        &out,
        Duration::from_secs(60),
        "Warren -> Mosquitto",
    )
    .await;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "QoS 1 Warren -> Mosquitto: {n} messages in {secs:.2} s ({:.0}/s)",
        n as f64 / secs
    );

    let inward = bodies("in", 500);
    let acked = publish(m.port, "commands/door", &inward, Duration::from_secs(60)).await;
    assert_eq!(acked.len(), inward.len());
    arrives(
        &local,
        &inward,
        Duration::from_secs(60),
        "Mosquitto -> Warren",
    )
    .await;

    // The state topic, retained "1", on both sides (Mosquitto's notifications).
    for (seen, side) in [(&remote, "Mosquitto"), (&local, "Warren")] {
        let g = seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        assert!(
            g.topics
                .contains_key("$SYS/broker/connection/edge-test/state")
                && g.times.contains_key("1"),
            "{side} has the bridge's state topic: {:?}",
            g.topics
                .keys()
                .filter(|t| t.starts_with('$'))
                .collect::<Vec<_>>()
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let o = w.metric("warren_bridge_messages_total{bridge=\"edge\",direction=\"out\"}");
        let i = w.metric("warren_bridge_messages_total{bridge=\"edge\",direction=\"in\"}");
        if o >= Some(n as u64) && i >= Some(500) {
            break;
        }
        assert!(Instant::now() < deadline, "metrics: {}", w.metrics());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        w.metric("warren_bridge_state{bridge=\"edge\",state=\"running\"}"),
        Some(1)
    );
    // Mosquitto's bridge knows the bridge is gone when Warren is: the will, retained "0".
    drop(w);
    let deadline = Instant::now() + Duration::from_secs(20);
    let (_c3, after) = subscriber(
        m.port,
        "far2",
        true,
        &["$SYS/broker/connection/edge-test/state"],
    )
    .await;
    loop {
        if after
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .times
            .contains_key("0")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the remote state topic says 0 once Warren is gone"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `both` against an MQTT 3.1.1 remote (Mosquitto sends a subscriber its own publishes
/// back): what Warren sends out is not taken back in, what comes in is not sent back out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_directions_no_loop_with_mosquitto() {
    let dir = scratch_dir("bridge", "loop311");
    let m = mosquitto(&dir, free_port(), "");
    let config = format!(
        "[[bridge]]\nname = \"loop\"\naddress = \"127.0.0.1:{}\"\ntopic = [\"chat/# both 1\"]\n\
         restart_timeout = 1\n",
        m.port
    );
    let w = warren(&dir.join("w"), "127.0.0.1:0", Some(&config));
    bridge_running(&w, "loop");
    let (_a, near) = subscriber(w.mqtt(), "near", true, &["chat/#"]).await;
    let (_b, far) = subscriber(m.port, "far", true, &["chat/#"]).await;
    let from_w = bodies("w", 300);
    let from_m = bodies("m", 300);
    assert_eq!(
        publish(w.mqtt(), "chat/w", &from_w, Duration::from_secs(30))
            .await
            .len(),
        300
    );
    assert_eq!(
        publish(m.port, "chat/m", &from_m, Duration::from_secs(30))
            .await
            .len(),
        300
    );
    arrives(&far, &from_w, Duration::from_secs(30), "out").await;
    arrives(&near, &from_m, Duration::from_secs(30), "in").await;
    // Time for any echo to go round.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (seen, side) in [(&near, "Warren"), (&far, "Mosquitto")] {
        for tag in ["w-", "m-"] {
            assert_eq!(
                times(seen, tag),
                (300, 300),
                "{side} got each {tag} message once"
            );
        }
    }
    let dropped = w.metric("warren_bridge_messages_dropped_total{bridge=\"loop\"}");
    assert_eq!(
        dropped,
        Some(300),
        "Mosquitto's echoes of the 300 sent out were dropped"
    );
}

/// Warren to Warren over MQTT 5 with prefixes, both directions, no loop (no_local on both
/// sides); then the bridging broker is killed and started again: the bridge comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warren_to_warren_both_with_prefixes_and_restart() {
    let dir = scratch_dir("bridge", "w2w");
    let b = warren(&dir.join("b"), "127.0.0.1:0", None);
    let config = format!(
        "[[bridge]]\nname = \"w2w\"\naddress = [\"127.0.0.1:{}\"]\n\
         topic = [\"# both 1 a/ b/\"]\nprotocol_version = \"mqttv50\"\nrestart_timeout = 1\n",
        b.mqtt()
    );
    let a_dir = dir.join("a");
    let a = warren(&a_dir, "127.0.0.1:0", Some(&config));
    bridge_running(&a, "w2w");
    let (_x, on_a) = subscriber(a.mqtt(), "sub-a", true, &["a/#"]).await;
    let (_y, on_b) = subscriber(b.mqtt(), "sub-b", true, &["b/#"]).await;
    let from_a = bodies("fa", 500);
    let from_b = bodies("fb", 500);
    assert_eq!(
        publish(a.mqtt(), "a/x", &from_a, Duration::from_secs(30))
            .await
            .len(),
        500
    );
    assert_eq!(
        publish(b.mqtt(), "b/y", &from_b, Duration::from_secs(30))
            .await
            .len(),
        500
    );
    arrives(&on_b, &from_a, Duration::from_secs(30), "A -> B").await;
    arrives(&on_a, &from_b, Duration::from_secs(30), "B -> A").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (seen, side) in [(&on_a, "A"), (&on_b, "B")] {
        for tag in ["fa-", "fb-"] {
            assert_eq!(
                times(seen, tag),
                (500, 500),
                "{side} got each {tag} message once"
            );
        }
    }
    {
        let g = on_b
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        assert_eq!(
            g.topics.get("b/x"),
            Some(&500),
            "a/x arrives on B as b/x: {:?}",
            g.topics
        );
    }
    assert_eq!(
        a.metric("warren_bridge_messages_dropped_total{bridge=\"w2w\"}"),
        Some(0)
    );

    // Kill -9 the broker running the bridge and start it again on its data.
    let a_port = a.mqtt();
    drop(a);
    let a = warren(&a_dir, &format!("127.0.0.1:{a_port}"), Some(&config));
    bridge_running(&a, "w2w");
    let again = bodies("again", 200);
    assert_eq!(
        publish(a.mqtt(), "a/z", &again, Duration::from_secs(30))
            .await
            .len(),
        200
    );
    arrives(
        &on_b,
        &again,
        Duration::from_secs(30),
        "A -> B after A's restart",
    )
    .await;
}

/// `warren ctl bridge-status` lists a running Warren-to-Warren bridge as `GET
/// /api/bridges` gives it: the table's default columns, and JSON rows.
#[test]
fn ctl_bridge_status_lists_a_running_bridge() {
    let dir = scratch_dir("bridge", "ctl");
    let b = warren(&dir.join("b"), "127.0.0.1:0", None);
    let config = format!(
        "[[bridge]]\nname = \"to-b\"\naddress = [\"127.0.0.1:{}\"]\ntopic = [\"t/# out 1\"]\n",
        b.mqtt()
    );
    let a_dir = dir.join("a");
    let a = warren(&a_dir, "127.0.0.1:0", Some(&config));
    bridge_running(&a, "to-b");
    let ctl = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["ctl", "--data-dir"])
            .arg(&a_dir)
            .args(args)
            .output()
            .expect("ctl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let rows: serde_json::Value =
        serde_json::from_str(&ctl(&["--format", "json", "bridge-status"])).expect("json");
    let api = common::http::call(a.0.management.expect("API"), "GET", "/api/bridges", None);
    let address = format!("127.0.0.1:{}", b.mqtt());
    assert_eq!(rows[0]["name"], "to-b", "{rows}");
    assert_eq!(rows[0]["type"], "mqtt-bridge", "{rows}");
    assert_eq!(rows[0]["state"], "running", "{rows}");
    assert_eq!(rows[0]["address"], address.as_str(), "{rows}");
    assert_eq!(rows[0]["name"], api.json()[0]["name"], "the API's rows");
    let text = ctl(&["bridge_status"]);
    let mut lines = text.lines();
    let head: Vec<&str> = lines.next().unwrap_or("").split_whitespace().collect();
    assert_eq!(
        head,
        [
            "name",
            "state",
            "address",
            "messages_out",
            "messages_in",
            "messages_dropped",
            "reconnects",
            "reason"
        ],
        "{text}"
    );
    let row = lines.next().unwrap_or("");
    assert!(
        row.starts_with("to-b") && row.contains("running") && row.contains(&address),
        "{text}"
    );
}

/// A kill -9 of the remote broker mid-stream: every message the local publisher got a
/// PUBACK for reaches the far side's durable subscriber at least once after the remote
/// restarts (persistent sessions: `cleansession = false` on the bridge, a durable
/// subscriber with a persistent session on the remote Warren).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_remote_mid_stream_loses_nothing_acked() {
    let dir = scratch_dir("bridge", "kill");
    let b_dir = dir.join("b");
    let b_port = free_port();
    let b_addr = format!("127.0.0.1:{b_port}");
    let b = warren(&b_dir, &b_addr, None);
    let config = format!(
        "[[bridge]]\nname = \"k\"\naddress = [\"{b_addr}\"]\ntopic = [\"k/# out 1\", \"j/# in 1\"]\n\
         cleansession = false\nrestart_timeout = 1\nremote_clientid = \"k-remote\"\n"
    );
    let a = warren(&dir.join("a"), "127.0.0.1:0", Some(&config));
    bridge_running(&a, "k");
    let (_s, far) = subscriber(b_port, "durable", false, &["k/#"]).await;
    let state = format!("$SYS/broker/connection/{}/state", "k-remote");
    let (_t, on_a) = subscriber(a.mqtt(), "state", true, &[state.as_str()]).await;
    let (_u, near) = subscriber(a.mqtt(), "near", false, &["j/#"]).await;
    let all = bodies("k", 3000);
    let a_port = a.mqtt();
    let sent = all.clone();
    let publisher =
        tokio::spawn(async move { publish(a_port, "k/t", &sent, Duration::from_secs(90)).await });
    // And the other way: published on B, through the bridge's persistent session there.
    let inward = bodies("j", 3000);
    let sent = inward.clone();
    let publisher_b =
        tokio::spawn(async move { publish(b_port, "j/t", &sent, Duration::from_secs(90)).await });
    // Kill B once part of the stream went across.
    let deadline = Instant::now() + Duration::from_secs(30);
    while times(&far, "k-").0 < 500 || times(&near, "j-").0 < 100 {
        assert!(Instant::now() < deadline, "the stream started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(b);
    let moved_before = times(&far, "k-").0;
    // The local state topic says 0 while the remote is away (the local end's will).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !on_a
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .times
        .contains_key("0")
    {
        assert!(Instant::now() < deadline, "the local state topic says 0");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b = warren(&b_dir, &b_addr, None);
    let acked = publisher.await.expect("publisher");
    assert_eq!(
        acked.len(),
        all.len(),
        "Warren A acknowledged every publish"
    );
    arrives(&far, &acked, Duration::from_secs(90), "after B's restart").await;
    let (distinct, total) = times(&far, "k-");
    println!(
        "kill -9 of the remote after {moved_before} messages: {distinct} distinct, {total} deliveries"
    );
    assert_eq!(distinct, all.len(), "nothing invented");
    let acked_b = publisher_b.await.expect("publisher on B");
    arrives(
        &near,
        &acked_b,
        Duration::from_secs(90),
        "in, after B's restart",
    )
    .await;
    let (distinct, total) = times(&near, "j-");
    println!(
        "in: {} of 3000 acknowledged by B before its kill; {distinct} distinct arrived, {total} deliveries",
        acked_b.len()
    );
    assert!(distinct <= inward.len(), "nothing invented");
    assert!(acked_b.len() >= 100, "B acknowledged some before its kill");
    assert!(a.metric("warren_bridge_reconnects_total{bridge=\"k\"}") >= Some(1));
    drop(b);
}

/// A kill -9 of the broker running the bridge mid-stream: what it acknowledged to its
/// publisher waits in the persistent session of the bridge's local end and goes out once
/// it is started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_bridging_broker_mid_stream_loses_nothing_acked() {
    let dir = scratch_dir("bridge", "killa");
    let b_addr = format!("127.0.0.1:{}", free_port());
    let b = warren(&dir.join("b"), &b_addr, None);
    let (_s, far) = subscriber(b.mqtt(), "durable", false, &["k/#"]).await;
    let config = format!(
        "[[bridge]]\nname = \"ka\"\naddress = [\"127.0.0.1:{}\"]\ntopic = [\"k/# out 1\"]\n\
         restart_timeout = 1\n",
        b.mqtt()
    );
    let a_dir = dir.join("a");
    let a_addr = format!("127.0.0.1:{}", free_port());
    let a = warren(&a_dir, &a_addr, Some(&config));
    bridge_running(&a, "ka");
    let all = bodies("k", 3000);
    let a_port = a.mqtt();
    let sent = all.clone();
    let publisher =
        tokio::spawn(async move { publish(a_port, "k/t", &sent, Duration::from_secs(90)).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while times(&far, "k-").0 < 300 {
        assert!(Instant::now() < deadline, "the stream started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(a);
    let acked = publisher.await.expect("publisher");
    let moved_before = times(&far, "k-").0;
    let a = warren(&a_dir, &a_addr, Some(&config));
    bridge_running(&a, "ka");
    arrives(&far, &acked, Duration::from_secs(90), "after A's restart").await;
    let (distinct, total) = times(&far, "k-");
    println!(
        "kill -9 of the bridging broker: {} acknowledged to the publisher, {moved_before} across \
         before the kill; {distinct} distinct arrived, {total} deliveries",
        acked.len()
    );
    assert!(distinct <= all.len(), "nothing invented");
    assert!(acked.len() > moved_before / 2, "the kill came mid-stream");

    // A backlog: the remote is down, A takes 1,000 messages for it and is killed; B and
    // then A start again and the backlog goes across.
    drop(b);
    let backlog = bodies("backlog", 1000);
    assert_eq!(
        publish(a.mqtt(), "k/t", &backlog, Duration::from_secs(30))
            .await
            .len(),
        1000
    );
    drop(a);
    let b = warren(&dir.join("b"), &b_addr, None);
    let a = warren(&a_dir, &a_addr, Some(&config));
    bridge_running(&a, "ka");
    arrives(
        &far,
        &backlog,
        Duration::from_secs(90),
        "the backlog after both restarts",
    )
    .await;
    assert_eq!(times(&far, "backlog-").0, 1000);
    drop((a, b));
}

/// Mosquitto's own bridge into Warren with its defaults (`try_private true`: the bridge bit
/// in CONNECT's protocol level, 0x84) and `both`: Warren takes the bit as Mosquitto does, so
/// the bridge's subscription on Warren is no-local and nothing loops. Each message arrives
/// once on the other side, and the publisher's own side sees its message once (no echo).
/// Before Warren took the bit, Mosquitto reconnected without it and every message came
/// back round once (600 copies of 300).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mosquittos_default_bridge_into_warren_both_ways_without_a_loop() {
    let dir = scratch_dir("bridge", "mosqprivate");
    let w = warren(&dir.join("w"), "127.0.0.1:0", None);
    let extra = format!(
        "connection towarren\naddress 127.0.0.1:{}\ntopic p/# both 1\n\
         cleansession true\nrestart_timeout 1\nremote_clientid mosq-private\n",
        w.mqtt()
    );
    let m = mosquitto(&dir, free_port(), &extra);
    let (_s, on_w) = subscriber(w.mqtt(), "sub-w", true, &["p/#"]).await;
    let (_t, on_m) = subscriber(m.port, "sub-m", true, &["p/#"]).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while times(&on_w, "probe").0 == 0 {
        assert!(
            Instant::now() < deadline,
            "Mosquitto's default bridge reached Warren"
        );
        publish(
            m.port,
            "p/probe",
            &["probe".to_string()],
            Duration::from_secs(5),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let from_m = bodies("fromm", 300);
    let from_w = bodies("fromw", 300);
    assert_eq!(
        publish(m.port, "p/m", &from_m, Duration::from_secs(30))
            .await
            .len(),
        300
    );
    assert_eq!(
        publish(w.mqtt(), "p/w", &from_w, Duration::from_secs(30))
            .await
            .len(),
        300
    );
    arrives(
        &on_w,
        &from_m,
        Duration::from_secs(30),
        "Mosquitto -> Warren",
    )
    .await;
    arrives(
        &on_m,
        &from_w,
        Duration::from_secs(30),
        "Warren -> Mosquitto",
    )
    .await;
    // A loop would bring copies back round: wait for any, then count.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(times(&on_w, "fromm"), (300, 300), "each once on Warren");
    assert_eq!(times(&on_m, "fromw"), (300, 300), "each once on Mosquitto");
    assert_eq!(
        times(&on_m, "fromm"),
        (300, 300),
        "no echo back to Mosquitto"
    );
    assert_eq!(times(&on_w, "fromw"), (300, 300), "no echo back to Warren");
    drop((w, m));
}

/// Mosquitto's own bridge into Warren (Warren as the remote broker of a Mosquitto
/// `connection` block, with `try_private false`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mosquittos_bridge_into_warren() {
    let dir = scratch_dir("bridge", "mosqbridge");
    let w = warren(&dir.join("w"), "127.0.0.1:0", None);
    let extra = format!(
        "connection towarren\naddress 127.0.0.1:{}\ntopic m/# out 1\ntry_private false\n\
         cleansession true\nrestart_timeout 1\nremote_clientid mosq-tw\n",
        w.mqtt()
    );
    let m = mosquitto(&dir, free_port(), &extra);
    let (_s, on_w) = subscriber(w.mqtt(), "sub", true, &["m/#"]).await;
    // Mosquitto's bridge connects on its own schedule: publish until the first arrives.
    let deadline = Instant::now() + Duration::from_secs(30);
    while times(&on_w, "probe").0 == 0 {
        assert!(
            Instant::now() < deadline,
            "Mosquitto's bridge reached Warren"
        );
        publish(
            m.port,
            "m/p",
            &["probe".to_string()],
            Duration::from_secs(5),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let all = bodies("mb", 500);
    assert_eq!(
        publish(m.port, "m/x", &all, Duration::from_secs(30))
            .await
            .len(),
        500
    );
    arrives(
        &on_w,
        &all,
        Duration::from_secs(30),
        "Mosquitto's bridge -> Warren",
    )
    .await;
}

/// The far side refuses some copies (MQTT 5 PUBACK 0x87, a topic permission on the remote
/// Warren): they are dropped and counted, the bridge goes on, the others arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_the_remote_refuses_are_dropped_and_the_bridge_goes_on() {
    let dir = scratch_dir("bridge", "refused");
    let b = warren(&dir.join("b"), "127.0.0.1:0", None);
    let put = common::http::call(
        b.0.management.expect("API"),
        "PUT",
        "/api/topic-permissions/%2F/guest",
        Some(serde_json::json!({"exchange": "amq.topic", "write": "^ok\\.", "read": ".*"})),
    );
    assert!(put.status < 300, "topic permission set: {}", put.status);
    let config = format!(
        "[[bridge]]\nname = \"r\"\naddress = [\"127.0.0.1:{}\"]\n\
         topic = [\"ok/# out 1\", \"no/# out 1\"]\nprotocol_version = \"mqttv50\"\n\
         restart_timeout = 1\n",
        b.mqtt()
    );
    let a = warren(&dir.join("a"), "127.0.0.1:0", Some(&config));
    bridge_running(&a, "r");
    let (_s, far) = subscriber(b.mqtt(), "far", true, &["ok/#", "no/#"]).await;
    let no = bodies("no", 50);
    let ok = bodies("ok", 50);
    assert_eq!(
        publish(a.mqtt(), "no/x", &no, Duration::from_secs(10))
            .await
            .len(),
        50
    );
    assert_eq!(
        publish(a.mqtt(), "ok/x", &ok, Duration::from_secs(10))
            .await
            .len(),
        50
    );
    arrives(&far, &ok, Duration::from_secs(20), "the allowed ones").await;
    assert_eq!(times(&far, "no-"), (0, 0), "the refused ones are not there");
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.metric("warren_bridge_messages_dropped_total{bridge=\"r\"}") != Some(50) {
        assert!(Instant::now() < deadline, "50 dropped: {}", a.metrics());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        a.metric("warren_bridge_reconnects_total{bridge=\"r\"}"),
        Some(0)
    );
    assert!(a.0.logged(&["refused", "dropped"]), "one warning says so");
}

/// A remote that stops reading (SIGSTOP) while large QoS 1 messages stream: the bridge's
/// writes wait on the socket (back-pressure, its in-flight window full), nothing is lost or
/// broken, everything arrives once the remote runs again (SIGCONT).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_remote_pushes_back_and_nothing_is_lost() {
    let dir = scratch_dir("bridge", "stall");
    let m = mosquitto(
        &dir,
        free_port(),
        "max_queued_messages 0\nmessage_size_limit 0\n",
    );
    let config = format!(
        "[[bridge]]\nname = \"s\"\naddress = [\"127.0.0.1:{}\"]\ntopic = [\"big/# out 1\"]\n\
         restart_timeout = 1\n",
        m.port
    );
    let w = warren(&dir.join("w"), "127.0.0.1:0", Some(&config));
    bridge_running(&w, "s");
    let (_s, far) = subscriber(m.port, "far", true, &["big/#"]).await;
    let pad = "p".repeat(32 * 1024);
    let all: Vec<String> = (0..800).map(|i| format!("big-{i}-{pad}")).collect();
    let port = w.mqtt();
    let sent = all.clone();
    let publisher =
        tokio::spawn(async move { publish(port, "big/x", &sent, Duration::from_secs(60)).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while times(&far, "big-").0 < 50 {
        assert!(Instant::now() < deadline, "the stream started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let pid = libc::pid_t::try_from(m.child.id()).expect("pid");
    let signal = |sig: libc::c_int| {
        // SAFETY: kill(2) on the Mosquitto this test started (and still owns).
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "signal {sig} to mosquitto");
    };
    signal(libc::SIGSTOP);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = times(&far, "big-").0;
    signal(libc::SIGCONT);
    let acked = publisher.await.expect("publisher");
    assert_eq!(acked.len(), all.len(), "Warren took every publish");
    arrives(
        &far,
        &all,
        Duration::from_secs(60),
        "after the remote runs again",
    )
    .await;
    println!("stalled remote: {during} of 800 across when it stopped, all 800 after");
    assert_eq!(times(&far, "big-"), (800, 800), "each once");
    assert_eq!(
        w.metric("warren_bridge_reconnects_total{bridge=\"s\"}"),
        Some(0)
    );
}

/// The local state topic holds the `1` of a process before (killed while the bridge ran);
/// the remote is unreachable after the restart: the bridge says `0` there anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_state_topic_says_0_when_the_remote_is_unreachable() {
    let dir = scratch_dir("bridge", "stale");
    let m = mosquitto(&dir, free_port(), "");
    let config = |port: u16| {
        format!(
            "[[bridge]]\nname = \"st\"\naddress = [\"127.0.0.1:{port}\"]\ntopic = [\"t/# out 1\"]\n\
             restart_timeout = 1\nnotification_topic = \"state/st\"\n"
        )
    };
    let w_dir = dir.join("w");
    let w = warren(&w_dir, "127.0.0.1:0", Some(&config(m.port)));
    bridge_running(&w, "st");
    let (_s, seen) = subscriber(w.mqtt(), "s", true, &["state/st"]).await;
    arrives(
        &seen,
        &["1".to_string()],
        Duration::from_secs(10),
        "running: 1",
    )
    .await;
    drop(seen);
    let w_port = w.mqtt();
    drop(w);
    drop(m);
    let w = warren(
        &w_dir,
        &format!("127.0.0.1:{w_port}"),
        Some(&config(free_port())),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    for n in 0.. {
        let (_s, now) = subscriber(w.mqtt(), &format!("s2-{n}"), true, &["state/st"]).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let g = now
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if g.times.contains_key("0") && !g.times.contains_key("1") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the retained state is 0: {:?}",
            g.times
        );
    }
}

/// Two addresses, `round_robin` false: the primary is down, the bridge runs on the
/// secondary; once the primary is up the bridge moves back to it (Mosquitto's rule).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secondary_address_then_back_to_the_primary() {
    let dir = scratch_dir("bridge", "addrs");
    let primary = free_port();
    let secondary = mosquitto(&dir, free_port(), "");
    let config = format!(
        "[[bridge]]\nname = \"two\"\naddress = [\"127.0.0.1:{primary}\", \"127.0.0.1:{}\"]\n\
         topic = [\"t/# out 1\"]\nrestart_timeout = 1\n",
        secondary.port
    );
    let w = warren(&dir.join("w"), "127.0.0.1:0", Some(&config));
    let on_secondary = format!("connected to 127.0.0.1:{}", secondary.port);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !w.0.logged(&["bridge running", &on_secondary]) {
        assert!(Instant::now() < deadline, "runs on the secondary");
    }
    let (_s, far2) = subscriber(secondary.port, "s2", true, &["t/#"]).await;
    let first = bodies("first", 50);
    assert_eq!(
        publish(w.mqtt(), "t/x", &first, Duration::from_secs(10))
            .await
            .len(),
        50
    );
    arrives(&far2, &first, Duration::from_secs(10), "via the secondary").await;
    let p = mosquitto(&dir, primary, "");
    let on_primary = format!("connected to 127.0.0.1:{primary}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !w.0.logged(&["bridge running", &on_primary]) {
        assert!(Instant::now() < deadline, "moves back to the primary");
    }
    let (_s, far1) = subscriber(p.port, "s1", true, &["t/#"]).await;
    let second = bodies("second", 50);
    assert_eq!(
        publish(w.mqtt(), "t/x", &second, Duration::from_secs(10))
            .await
            .len(),
        50
    );
    arrives(&far1, &second, Duration::from_secs(10), "via the primary").await;
}

/// A CA (PEM in `dir/NAME-ca.pem`) that signs certificates for `names`.
struct Ca {
    params: rcgen::CertificateParams,
    key: rcgen::KeyPair,
}

impl Ca {
    fn new(dir: &Path, name: &str) -> Ca {
        let mut params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} CA"));
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("CA");
        std::fs::write(dir.join(format!("{name}-ca.pem")), cert.pem()).expect("write");
        Ca { params, key }
    }

    /// Writes `dir/FILE.pem` and `dir/FILE.key`, a certificate for `names`.
    fn issue(&self, dir: &Path, file: &str, names: &[&str]) {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, file);
        let key = rcgen::KeyPair::generate().expect("key");
        let issuer = rcgen::Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).expect("sign");
        std::fs::write(dir.join(format!("{file}.pem")), cert.pem()).expect("write");
        std::fs::write(dir.join(format!("{file}.key")), key.serialize_pem()).expect("write");
    }
}

/// TLS to Mosquitto: mutual TLS with `bridge_cafile` + `bridge_certfile`/`bridge_keyfile`;
/// a CA that did not sign the server's certificate is refused; a certificate for another
/// name is refused unless `bridge_insecure` (which still checks the chain).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_mosquitto() {
    let dir = scratch_dir("bridge", "tls");
    let ca = Ca::new(&dir, "good");
    Ca::new(&dir, "other");
    ca.issue(&dir, "server", &["localhost", "127.0.0.1"]);
    ca.issue(&dir, "elsewhere", &["elsewhere.example"]);
    ca.issue(&dir, "client", &["bridge-client"]);
    let d = dir.display();
    // Each Mosquitto: a TLS listener for the bridges, a plain one for the test's subscriber.
    let (plain1, plain2) = (free_port(), free_port());
    let mtls = mosquitto(
        &dir,
        free_port(),
        &format!(
            "cafile {d}/good-ca.pem\ncertfile {d}/server.pem\nkeyfile {d}/server.key\n\
             require_certificate true\nlistener {plain1} 127.0.0.1\n"
        ),
    );
    let named = mosquitto(
        &dir,
        free_port(),
        &format!(
            "certfile {d}/elsewhere.pem\nkeyfile {d}/elsewhere.key\nlistener {plain2} 127.0.0.1\n"
        ),
    );
    wait_listening(plain1);
    wait_listening(plain2);
    let bridge = |name: &str, port: u16, topic: &str, extra: &str| {
        format!(
            "[[bridge]]\nname = \"{name}\"\naddress = [\"127.0.0.1:{port}\"]\n\
             topic = [\"{topic}/# out 1\"]\nrestart_timeout = 1\n{extra}\n"
        )
    };
    let good = format!("bridge_cafile = \"{d}/good-ca.pem\"\n");
    let client =
        format!("bridge_certfile = \"{d}/client.pem\"\nbridge_keyfile = \"{d}/client.key\"\n");
    let config = [
        bridge("mtls", mtls.port, "a", &format!("{good}{client}")),
        bridge(
            "wrongca",
            mtls.port,
            "b",
            &format!("bridge_cafile = \"{d}/other-ca.pem\"\n"),
        ),
        bridge("strict", named.port, "c", &good),
        bridge(
            "insecure",
            named.port,
            "d",
            &format!("{good}bridge_insecure = true\n"),
        ),
    ]
    .concat();
    let w = warren(&dir.join("w"), "127.0.0.1:0", Some(&config));
    bridge_running(&w, "mtls");
    bridge_running(&w, "insecure");
    for name in ["wrongca", "strict"] {
        assert!(
            w.0.logged(&["bridge terminated", name, "certificate"]),
            "{name} is refused for its certificate: {:?}",
            w.0.log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        );
        let running = format!("warren_bridge_state{{bridge=\"{name}\",state=\"running\"}}");
        assert_eq!(w.metric(&running), Some(0));
    }
    let (_a, on_m1) = subscriber(plain1, "s1", true, &["a/#"]).await;
    let (_d, on_m2) = subscriber(plain2, "s2", true, &["d/#"]).await;
    let a = bodies("tls-a", 100);
    let d_ = bodies("tls-d", 100);
    assert_eq!(
        publish(w.mqtt(), "a/x", &a, Duration::from_secs(10))
            .await
            .len(),
        100
    );
    assert_eq!(
        publish(w.mqtt(), "d/x", &d_, Duration::from_secs(10))
            .await
            .len(),
        100
    );
    arrives(&on_m1, &a, Duration::from_secs(20), "over mutual TLS").await;
    arrives(
        &on_m2,
        &d_,
        Duration::from_secs(20),
        "over TLS, bridge_insecure",
    )
    .await;
}

/// `warren serve --config` with `toml`: exits 2 with a message containing every `says`.
fn refused(tag: &str, toml: &str, says: &[&str]) {
    let dir = scratch_dir("bridge-conf", tag);
    let path = dir.join("warren.toml");
    std::fs::write(&path, toml).expect("write");
    let out = Command::new(BIN)
        .args(["serve", "--amqp", "127.0.0.1:0", "--mqtt", "127.0.0.1:0"])
        .args([
            "--management",
            "none",
            "--prometheus",
            "none",
            "--stream",
            "none",
        ])
        .arg("--data-dir")
        .arg(&dir)
        .arg("--config")
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("run warren serve");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "{tag}: a configuration error: {text}"
    );
    for s in says {
        assert!(text.contains(s), "{tag}: says {s:?}: {text}");
    }
}

#[test]
fn bad_bridge_configurations_are_refused() {
    let head = "[[bridge]]\nname = \"edge\"\naddress = [\"127.0.0.1:1884\"]\n";
    refused(
        "unknown",
        &format!("{head}topic = [\"a out 1\"]\nbogus_key = 1\n"),
        &["bogus_key", "warren.toml:"],
    );
    refused(
        "topic",
        &format!("{head}topic = [\"a sideways 1\"]\n"),
        &["a sideways 1", "direction", "warren.toml:4"],
    );
    refused("qos2", &format!("{head}topic = [\"a in 2\"]\n"), &["QoS"]);
    refused(
        "tls",
        &format!("{head}topic = [\"a\"]\nbridge_cafile = \"/nonexistent/ca.pem\"\n"),
        &["bridge_cafile /nonexistent/ca.pem"],
    );
    refused(
        "psk",
        &format!("{head}topic = [\"a\"]\nbridge_psk = \"00\"\n"),
        &["bridge_psk", "not supported"],
    );
    refused(
        "twice",
        &format!("{head}topic = [\"a\"]\n{head}topic = [\"b\"]\n"),
        &["\"edge\"", "twice"],
    );
    refused(
        "protocol",
        &format!("{head}topic = [\"a\"]\nprotocol_version = \"mqttv31\"\n"),
        &["protocol_version"],
    );
    refused(
        "address",
        "[[bridge]]\nname = \"x\"\ntopic = [\"a\"]\n",
        &["address"],
    );
}
