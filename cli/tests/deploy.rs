//! `warren serve` deployed as operators run it: several listeners per protocol over IPv4 and
//! IPv6, AMQPS and MQTTS with certificates made here (rcgen), client certificates and
//! certificate logins, reloading certificates without dropping connections, MQTT over
//! WebSocket (plain and TLS), a config file with flags and WARREN_* variables over it; and
//! the bad input around all of it (plain clients on TLS ports, TLS clients on plain ports,
//! wrong-CA and expired certificates, wrong WebSocket subprotocols, typos in the file).

use futures_util::{SinkExt, StreamExt};
use lapin::options::{BasicPublishOptions, QueueBindOptions, QueueDeclareOptions};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

mod common;

use common::BIN;

fn data_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warren-deploy-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

/// In memory, AMQP and MQTT each plain and over TLS on free ports (4 listeners).
const PLAIN_AND_TLS: &[&str] = &[
    "--in-memory",
    "--amqp",
    "127.0.0.1:0",
    "--mqtt",
    "127.0.0.1:0",
    "--amqps",
    "127.0.0.1:0",
    "--mqtts",
    "127.0.0.1:0",
];

/// A running `warren serve` with every log line it printed so far.
struct Broker {
    child: Child,
    logs: Arc<Mutex<Vec<String>>>,
    /// (listener label, address) in the order logged.
    listening: Vec<(String, SocketAddr)>,
}

impl Broker {
    /// Starts `warren serve --data-dir DIR ARGS` and waits for `listeners` "listening on" lines.
    fn start(dir: &Path, args: &[&str], listeners: usize) -> Broker {
        Broker::start_env(dir, args, listeners, &[])
    }

    fn start_env(dir: &Path, args: &[&str], listeners: usize, env: &[(&str, &str)]) -> Broker {
        // The HTTP listeners' default ports would collide between tests running at once
        // (a config file sets its own).
        let mut off = Vec::new();
        for flag in ["--management", "--prometheus", "--stream"] {
            if !args.contains(&flag) && !args.contains(&"--config") {
                off.extend([flag, "none"]);
            }
        }
        let mut child = common::dies_with_test(&mut Command::new(BIN))
            .arg("serve")
            .arg("--data-dir")
            .arg(dir)
            .args(&off)
            .args(args)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start warren serve");
        let stdout = child.stdout.take().expect("stdout");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let (addr, label) = rest.split_once(' ').unwrap_or((rest, ""));
                    if let Ok(addr) = addr.parse::<SocketAddr>() {
                        let _ = tx.send((label.to_string(), addr));
                    }
                }
                sink.lock().expect("logs").push(line);
            }
        });
        let mut listening = Vec::new();
        while listening.len() < listeners {
            listening.push(
                rx.recv_timeout(Duration::from_secs(20))
                    .expect("warren serve logs its listeners within 20 s"),
            );
        }
        Broker {
            child,
            logs,
            listening,
        }
    }

    /// The addresses of the listeners whose label contains `label`.
    fn addrs(&self, label: &str) -> Vec<SocketAddr> {
        self.listening
            .iter()
            .filter(|(l, _)| l.contains(label))
            .map(|(_, a)| *a)
            .collect()
    }

    fn addr(&self, label: &str) -> SocketAddr {
        self.addrs(label)[0]
    }

    /// Log lines containing every one of `needles`, waiting up to 5 s for at least `count`.
    fn wait_logs(&self, needles: &[&str], count: usize) -> Vec<String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let found: Vec<String> = self
                .logs
                .lock()
                .expect("logs")
                .iter()
                .filter(|l| needles.iter().all(|n| l.contains(n)))
                .cloned()
                .collect();
            if found.len() >= count || std::time::Instant::now() > deadline {
                return found;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the pid of a child we started and still own.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Broker {
    /// `start` with TLS: `pki` issues the server's certificate for localhost
    /// (`server.pem`, `server.key` in `dir`), passed as `--tls-cert` and `--tls-key`.
    fn start_tls(dir: &Path, pki: &Pki, args: &[&str], listeners: usize) -> Broker {
        pki.issue("server", "localhost", false);
        let cert = dir.join("server.pem");
        let key = dir.join("server.key");
        let mut all = args.to_vec();
        all.extend([
            "--tls-cert",
            cert.to_str().expect("utf-8"),
            "--tls-key",
            key.to_str().expect("utf-8"),
        ]);
        Broker::start(dir, &all, listeners)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A CA and certificates it signs, as PEM files in `dir`.
struct Pki {
    dir: PathBuf,
    ca_cert: rcgen::Certificate,
    ca_params: rcgen::CertificateParams,
    ca_key: rcgen::KeyPair,
}

impl Pki {
    fn new(dir: &Path, name: &str) -> Pki {
        let mut params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} CA"));
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let ca_cert = params.self_signed(&ca_key).expect("ca");
        std::fs::write(dir.join(format!("{name}-ca.pem")), ca_cert.pem()).expect("write");
        Pki {
            dir: dir.to_path_buf(),
            ca_cert,
            ca_params: params,
            ca_key,
        }
    }

    /// Issues a certificate with subject CN `cn` (and SANs localhost, 127.0.0.1, ::1);
    /// writes `file.pem` and `file.key`; returns the DER of both.
    fn issue(
        &self,
        file: &str,
        cn: &str,
        expired: bool,
    ) -> (
        rustls::pki_types::CertificateDer<'static>,
        rustls::pki_types::PrivateKeyDer<'static>,
    ) {
        let mut params = rcgen::CertificateParams::new(vec![
            "localhost".to_string(),
            "127.0.0.1".to_string(),
            "::1".to_string(),
        ])
        .expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = rcgen::KeyPair::generate().expect("key");
        let issuer = rcgen::Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params.signed_by(&key, &issuer).expect("sign");
        std::fs::write(self.dir.join(format!("{file}.pem")), cert.pem()).expect("write");
        std::fs::write(self.dir.join(format!("{file}.key")), key.serialize_pem()).expect("write");
        (
            cert.der().clone(),
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
    }

    /// Issues a client certificate whose first subject alternative name is the DNS name
    /// `san` (and whose CN is something else); writes `file.pem` and `file.key`.
    fn issue_san(&self, file: &str, san: &str) {
        let mut params = rcgen::CertificateParams::new(vec![san.to_string()]).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "not-the-user");
        let key = rcgen::KeyPair::generate().expect("key");
        let issuer = rcgen::Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params.signed_by(&key, &issuer).expect("sign");
        std::fs::write(self.dir.join(format!("{file}.pem")), cert.pem()).expect("write");
        std::fs::write(self.dir.join(format!("{file}.key")), key.serialize_pem()).expect("write");
    }

    fn ca_pem(&self) -> String {
        self.ca_cert.pem()
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca_cert.der().clone()).expect("root");
        roots
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn client_config(
    roots: rustls::RootCertStore,
    identity: Option<(
        rustls::pki_types::CertificateDer<'static>,
        rustls::pki_types::PrivateKeyDer<'static>,
    )>,
    tls12_only: bool,
) -> Arc<rustls::ClientConfig> {
    let versions: &[&rustls::SupportedProtocolVersion] = if tls12_only {
        &[&rustls::version::TLS12]
    } else {
        &[&rustls::version::TLS13]
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)
        .expect("versions")
        .with_root_certificates(roots);
    Arc::new(match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(vec![cert], key)
            .expect("client cert"),
        None => builder.with_no_client_auth(),
    })
}

/// A TLS handshake with the server at `addr`; Err carries the client-side reason.
async fn tls_connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let handshake = async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let connector = tokio_rustls::TlsConnector::from(config);
        let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
        let mut stream = connector.connect(name, tcp).await?;
        // With TLS 1.3 a refused client certificate shows on the first read, not the
        // handshake.
        stream.write_all(b"AMQP\x00\x00\x09\x01").await?;
        let mut first = [0u8; 1];
        stream.read_exact(&mut first).await?;
        Ok(stream)
    };
    common::bounded_as(
        format!("TLS handshake and first AMQP byte from {addr}"),
        handshake,
    )
    .await
}

async fn lapin_connect(
    uri: &str,
    tls: lapin::tcp::OwnedTLSConfig,
) -> lapin::Result<lapin::Connection> {
    tokio::time::timeout(
        Duration::from_secs(10),
        lapin::Connection::connect_with_config(
            uri,
            lapin::ConnectionProperties::default(),
            tls,
            lapin::runtime::default_runtime().expect("runtime"),
        ),
    )
    .await
    .expect("lapin connects or fails within 10 s")
}

fn mqtt_options(id: &str, addr: SocketAddr) -> rumqttc::MqttOptions {
    let mut o = rumqttc::MqttOptions::new(id, addr.ip().to_string(), addr.port());
    o.set_keep_alive(Duration::from_secs(30));
    o
}

/// Drives a rumqttc client until it is subscribed to `topic`; returns the event loop.
async fn mqtt_subscribed(
    options: rumqttc::MqttOptions,
    topic: &str,
) -> (rumqttc::AsyncClient, rumqttc::EventLoop) {
    let (client, mut events) = rumqttc::AsyncClient::new(options, 16);
    client
        .subscribe(topic, rumqttc::QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match events.poll().await {
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) => break,
                Ok(_) => {}
                Err(e) => panic!("MQTT subscriber failed: {e}"),
            }
        }
    })
    .await
    .expect("subscribed in time");
    (client, events)
}

/// The payload of the next PUBLISH the event loop receives.
async fn mqtt_next(events: &mut rumqttc::EventLoop) -> Vec<u8> {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match events.poll().await {
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => {
                    return p.payload.to_vec();
                }
                Ok(_) => {}
                Err(e) => panic!("MQTT client failed: {e}"),
            }
        }
    })
    .await
    .expect("a PUBLISH within 10 s")
}

/// Publishes `payload` to amq.topic with `key` over an AMQP connection.
async fn amqp_publish(conn: &lapin::Connection, key: &str, payload: &[u8]) {
    let ch = common::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    common::bounded_as(
        "basic.publish sent (held while the connection is blocked)",
        ch.basic_publish(
            "amq.topic".into(),
            key.into(),
            BasicPublishOptions::default(),
            payload,
            lapin::BasicProperties::default(),
        ),
    )
    .await
    .expect("publish");
}

async fn amqp_plain(addr: SocketAddr) -> lapin::Connection {
    common::bounded_as(
        "connection.open-ok",
        lapin::Connection::connect(
            &format!("amqp://guest:guest@{addr}/%2f"),
            lapin::ConnectionProperties::default(),
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("plain AMQP connects to {addr}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_listeners_per_protocol_over_ipv4_and_ipv6() {
    let dir = data_dir("listeners");
    let broker = Broker::start(
        &dir,
        &[
            "--in-memory",
            "--amqp",
            "127.0.0.1:0",
            "--amqp",
            "[::1]:0",
            "--mqtt",
            "127.0.0.1:0",
            "--mqtt",
            "[::1]:0",
        ],
        4,
    );
    let amqp = broker.addrs("(AMQP");
    let mqtt = broker.addrs("(MQTT");
    assert_eq!(amqp.len(), 2, "{:?}", broker.listening);
    assert_eq!(mqtt.len(), 2, "{:?}", broker.listening);
    assert!(amqp.iter().any(SocketAddr::is_ipv6) && mqtt.iter().any(SocketAddr::is_ipv6));
    // Subscribed over IPv6 MQTT; published over IPv4 AMQP and IPv4 MQTT.
    let v6 = mqtt.iter().find(|a| a.is_ipv6()).expect("v6");
    let v4 = mqtt.iter().find(|a| a.is_ipv4()).expect("v4");
    let (_sub, mut events) = mqtt_subscribed(mqtt_options("sub6", *v6), "dev/+/t").await;
    let amqp4 = amqp.iter().find(|a| a.is_ipv4()).expect("v4");
    let conn = amqp_plain(*amqp4).await;
    amqp_publish(&conn, "dev.a.t", b"over amqp").await;
    assert_eq!(mqtt_next(&mut events).await, b"over amqp");
    // lapin cannot parse an IPv6 literal in its URI: the IPv6 AMQP listener answers the
    // protocol header with connection.start (frame type 1, class 10, method 10).
    let amqp6 = amqp.iter().find(|a| a.is_ipv6()).expect("v6");
    let mut raw = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(amqp6))
        .await
        .expect("connect [::1]");
    raw.write_all(b"AMQP\x00\x00\x09\x01")
        .await
        .expect("header");
    let mut head = [0u8; 11];
    common::bounded_as("bytes from the broker", raw.read_exact(&mut head))
        .await
        .expect("connection.start");
    assert_eq!((head[0], &head[7..11]), (1, &[0, 10, 0, 10][..]));
    let (publisher, mut pub_events) = rumqttc::AsyncClient::new(mqtt_options("pub4", *v4), 16);
    common::bounded_as(
        "room in the client queue for PUBLISH",
        publisher.publish("dev/x/t", rumqttc::QoS::AtLeastOnce, false, "over mqtt v4"),
    )
    .await
    .expect("publish");
    tokio::spawn(async move { while pub_events.poll().await.is_ok() {} });
    assert_eq!(mqtt_next(&mut events).await, b"over mqtt v4");
}

#[test]
fn listener_flags_refuse_bad_addresses_and_none_alone_disables() {
    let dir = data_dir("badflags");
    for (args, want) in [
        (
            &["--amqp", "none", "--mqtt", "none", "--stream", "none"][..],
            "nothing to serve",
        ),
        (&["--amqp", "none", "--amqp", "127.0.0.1:0"][..], "`none`"),
        (&["--amqps", "127.0.0.1:0"][..], "--tls-cert"),
        (&["--mqtt-ws", "localhost:99999"][..], "--mqtt-ws"),
    ] {
        let out = Command::new(BIN)
            .args(["serve", "--in-memory", "--data-dir"])
            .arg(&dir)
            .args(args)
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}

/// AMQPS and MQTTS beside the plain listeners: lapin (TLS 1.3) and rumqttc (TLS 1.2) over
/// TLS, each other's messages across protocols, the plain ones unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_and_mqtts_with_lapin_and_rumqttc() {
    let dir = data_dir("tls");
    let pki = Pki::new(&dir, "main");
    let broker = Broker::start_tls(&dir, &pki, PLAIN_AND_TLS, 4);
    let amqps = broker.addr("amqps");
    let mqtts = broker.addr("mqtts");
    // rumqttc over TLS 1.2 subscribes.
    let mut options = mqtt_options("tls-sub", mqtts);
    options.set_transport(rumqttc::Transport::tls_with_config(
        rumqttc::TlsConfiguration::Rustls(client_config(pki.roots(), None, true)),
    ));
    let (_sub, mut events) = mqtt_subscribed(options, "secure/#").await;
    // lapin over amqps (TLS 1.3 negotiated by default) publishes.
    let conn = lapin_connect(
        &format!("amqps://guest:guest@localhost:{}/%2f", amqps.port()),
        lapin::tcp::OwnedTLSConfig {
            identity: None,
            cert_chain: Some(pki.ca_pem()),
        },
    )
    .await
    .expect("lapin over amqps");
    amqp_publish(&conn, "secure.a", b"from amqps").await;
    assert_eq!(mqtt_next(&mut events).await, b"from amqps");
    // A plain AMQP client on the same broker reaches the TLS subscriber too.
    let plain = amqp_plain(broker.addr("(AMQP")).await;
    amqp_publish(&plain, "secure.b", b"from plain").await;
    assert_eq!(mqtt_next(&mut events).await, b"from plain");
    // And the TLS AMQP connection consumes what an MQTT client publishes.
    let ch = common::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    common::bounded_as(
        "queue.declare answer",
        ch.queue_declare(
            "tlsq".into(),
            QueueDeclareOptions::default(),
            Default::default(),
        ),
    )
    .await
    .expect("declare");
    common::bounded_as(
        "queue.bind answer",
        ch.queue_bind(
            "tlsq".into(),
            "amq.topic".into(),
            "secure.c".into(),
            QueueBindOptions::default(),
            Default::default(),
        ),
    )
    .await
    .expect("bind");
    let mut plain_mqtt = mqtt_options("plain-pub", broker.addr("(MQTT"));
    plain_mqtt.set_clean_session(true);
    let (publisher, mut pub_events) = rumqttc::AsyncClient::new(plain_mqtt, 16);
    common::bounded_as(
        "room in the client queue for PUBLISH",
        publisher.publish("secure/c", rumqttc::QoS::AtLeastOnce, false, "from mqtt"),
    )
    .await
    .expect("publish");
    tokio::spawn(async move { while pub_events.poll().await.is_ok() {} });
    let got = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(m) = ch
                .basic_get(
                    "tlsq".into(),
                    lapin::options::BasicGetOptions { no_ack: true },
                )
                .await
                .expect("get")
            {
                return m.delivery.data.clone();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("message over amqps");
    assert_eq!(got, b"from mqtt");
}

/// The HTTP API's `ssl` of a connection is what its listener is: true for clients on the
/// AMQPS and MQTTS listeners, false for the same clients on the plain ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_api_shows_which_connections_are_tls() {
    let dir = data_dir("ssl-field");
    let pki = Pki::new(&dir, "main");
    let broker = Broker::start_tls(
        &dir,
        &pki,
        &[PLAIN_AND_TLS, &["--management", "127.0.0.1:0"]].concat(),
        5,
    );
    let amqp = |uri: String, name: &'static str, tls| async move {
        tokio::time::timeout(
            Duration::from_secs(10),
            lapin::Connection::connect_with_config(
                &uri,
                lapin::ConnectionProperties::default().with_connection_name(name.into()),
                tls,
                lapin::runtime::default_runtime().expect("runtime"),
            ),
        )
        .await
        .expect("lapin connects within 10 s")
        .unwrap_or_else(|e| panic!("{name} connects: {e}"))
    };
    let _tls_amqp = amqp(
        format!(
            "amqps://guest:guest@localhost:{}/%2f",
            broker.addr("amqps").port()
        ),
        "over-tls",
        lapin::tcp::OwnedTLSConfig {
            identity: None,
            cert_chain: Some(pki.ca_pem()),
        },
    )
    .await;
    let _plain_amqp = amqp(
        format!("amqp://guest:guest@{}/%2f", broker.addr("(AMQP")),
        "in-clear",
        lapin::tcp::OwnedTLSConfig::default(),
    )
    .await;
    let mut tls_mqtt = mqtt_options("mqtt-over-tls", broker.addr("mqtts"));
    tls_mqtt.set_transport(rumqttc::Transport::tls_with_config(
        rumqttc::TlsConfiguration::Rustls(client_config(pki.roots(), None, false)),
    ));
    let _tls_sub = mqtt_subscribed(tls_mqtt, "t/#").await;
    let _plain_sub =
        mqtt_subscribed(mqtt_options("mqtt-in-clear", broker.addr("(MQTT")), "t/#").await;

    let api = broker.addr("HTTP").port();
    let ssl_of = common::eventually("four connections in /api/connections", || {
        let list = common::http::call(api, "GET", "/api/connections", None).json();
        let by_name: std::collections::BTreeMap<String, serde_json::Value> = list
            .as_array()?
            .iter()
            .filter_map(|c| {
                let name = c["user_provided_name"]
                    .as_str()
                    .or(c["client_id"].as_str())?;
                Some((name.to_string(), c["ssl"].clone()))
            })
            .collect();
        (by_name.len() == 4).then_some(by_name)
    });
    assert_eq!(ssl_of["over-tls"], true, "{ssl_of:?}");
    assert_eq!(ssl_of["mqtt-over-tls"], true, "{ssl_of:?}");
    assert_eq!(ssl_of["in-clear"], false, "{ssl_of:?}");
    assert_eq!(ssl_of["mqtt-in-clear"], false, "{ssl_of:?}");
}

/// Bad input on the TLS and plain ports: each is one log line naming the peer and the
/// reason, and an established TLS connection carries on meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_bad_input_is_refused_with_one_log_line_and_others_carry_on() {
    let dir = data_dir("tlsbad");
    let pki = Pki::new(&dir, "good");
    let rogue = Pki::new(&dir, "rogue");
    let good_client = pki.issue("client", "alice", false);
    let rogue_client = rogue.issue("rogue-client", "alice", false);
    let expired_client = pki.issue("expired-client", "alice", true);
    let ca = dir.join("good-ca.pem");
    let broker = Broker::start_tls(
        &dir,
        &pki,
        &[
            "--in-memory",
            "--amqp",
            "127.0.0.1:0",
            "--mqtt",
            "127.0.0.1:0",
            "--amqps",
            "127.0.0.1:0",
            "--tls-ca",
            ca.to_str().expect("utf-8"),
            "--tls-verify-peer",
            "--tls-fail-if-no-peer-cert",
        ],
        3,
    );
    let amqps = broker.addr("amqps");
    // A connection that stays up through everything below.
    let mut identity = lapin::tcp::OwnedTLSConfig {
        identity: Some(lapin::tcp::OwnedIdentity::PKCS8 {
            pem: std::fs::read(dir.join("client.pem")).expect("pem"),
            key: std::fs::read(dir.join("client.key")).expect("key"),
        }),
        cert_chain: Some(pki.ca_pem()),
    };
    let steady = lapin_connect(
        &format!("amqps://guest:guest@localhost:{}/%2f", amqps.port()),
        identity.clone(),
    )
    .await
    .expect("client with a good certificate");
    let steady_ch = common::bounded_as("channel.open-ok", steady.create_channel())
        .await
        .expect("channel");
    common::bounded_as(
        "queue.declare answer",
        steady_ch.queue_declare(
            "steady".into(),
            QueueDeclareOptions::default(),
            Default::default(),
        ),
    )
    .await
    .expect("declare");

    // 1. A plain AMQP client on the TLS port.
    let mut plain = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(amqps))
        .await
        .expect("connect");
    plain
        .write_all(b"AMQP\x00\x00\x09\x01")
        .await
        .expect("write");
    let plain_local = plain.local_addr().expect("local").to_string();
    let mut buf = [0u8; 64];
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read(&mut buf)).await;
    let lines = broker.wait_logs(&["TLS handshake failed", &plain_local], 1);
    assert_eq!(lines.len(), 1, "{lines:?}");

    // 2. A TLS client on the plain AMQP port: AMQP's answer (its protocol header) and one line.
    let plain_port = broker.addr("(AMQP");
    let tcp = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(plain_port))
        .await
        .expect("connect");
    let tls_local = tcp.local_addr().expect("local").to_string();
    let connector = tokio_rustls::TlsConnector::from(client_config(pki.roots(), None, false));
    let refused = common::bounded_as(
        "TLS handshake",
        connector.connect(
            rustls::pki_types::ServerName::try_from("localhost").expect("name"),
            tcp,
        ),
    )
    .await;
    assert!(refused.is_err(), "no TLS on the plain port");
    let lines = broker.wait_logs(&[&tls_local], 1);
    assert_eq!(
        lines.len(),
        1,
        "one log line for the ClientHello: {lines:?}"
    );
    assert!(
        lines[0].contains("unsupported protocol header"),
        "{lines:?}"
    );

    // 2b. The same on the plain MQTT port: refused, one line naming the peer.
    let tcp = common::bounded_as(
        "TCP connect",
        tokio::net::TcpStream::connect(broker.addr("(MQTT")),
    )
    .await
    .expect("connect");
    let tls_local = tcp.local_addr().expect("local").to_string();
    let refused = common::bounded_as(
        "TLS handshake",
        connector.connect(
            rustls::pki_types::ServerName::try_from("localhost").expect("name"),
            tcp,
        ),
    )
    .await;
    assert!(refused.is_err(), "no TLS on the plain MQTT port");
    let lines = broker.wait_logs(&[&tls_local], 1);
    assert_eq!(
        lines.len(),
        1,
        "one log line for the ClientHello: {lines:?}"
    );

    // 3. Certificates the server refuses: none, another CA's, expired.
    for (what, client, reason) in [
        ("no certificate", None, "certificate"),
        ("wrong CA", Some(rogue_client), "UnknownIssuer"),
        ("expired", Some(expired_client), "certificate expired"),
    ] {
        let before = broker.wait_logs(&["TLS handshake failed"], 0).len();
        let result = tls_connect(amqps, client_config(pki.roots(), client, false)).await;
        assert!(result.is_err(), "{what}: refused");
        let lines = broker.wait_logs(&["TLS handshake failed"], before + 1);
        assert_eq!(lines.len(), before + 1, "{what}: one line each: {lines:?}");
        assert!(lines[before].contains(reason), "{what}: {}", lines[before]);
    }
    assert!(
        tls_connect(amqps, client_config(pki.roots(), Some(good_client), false))
            .await
            .is_ok()
    );

    // 4. A client that never finishes its handshake does not hold others up.
    let _stalled = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(amqps))
        .await
        .expect("connect");
    identity.cert_chain = Some(pki.ca_pem());
    let second = lapin_connect(
        &format!("amqps://guest:guest@localhost:{}/%2f", amqps.port()),
        identity,
    )
    .await
    .expect("another client while one stalls");
    drop(second);

    // The first connection was never disturbed.
    common::bounded_as(
        "basic.publish sent (held while the connection is blocked)",
        steady_ch.basic_publish(
            "".into(),
            "steady".into(),
            BasicPublishOptions::default(),
            b"still here",
            lapin::BasicProperties::default(),
        ),
    )
    .await
    .expect("publish");
    let m = common::bounded_as(
        "basic.get answer",
        steady_ch.basic_get(
            "steady".into(),
            lapin::options::BasicGetOptions { no_ack: true },
        ),
    )
    .await
    .expect("get")
    .expect("the message");
    assert_eq!(m.delivery.data, b"still here");
}

/// Certificate logins: AMQP EXTERNAL (lapin with a client certificate) and MQTT
/// use_identity_as_username (rumqttc without credentials) log in as the certificate's CN;
/// a CN that is no user is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_logins_amqp_external_and_mqtt_identity() {
    let dir = data_dir("certlogin");
    let pki = Pki::new(&dir, "ca");
    let device = pki.issue("device", "device-42", false);
    pki.issue("stranger", "nobody-here", false);
    let ca = dir.join("ca-ca.pem");
    let broker = Broker::start_tls(
        &dir,
        &pki,
        &[
            "--amqp",
            "127.0.0.1:0",
            "--mqtt",
            "none",
            "--amqps",
            "127.0.0.1:0",
            "--mqtts",
            "127.0.0.1:0",
            "--tls-ca",
            ca.to_str().expect("utf-8"),
            "--tls-verify-peer",
            "--mqtt-use-identity-as-username",
        ],
        3,
    );
    let ctl = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["ctl", "--data-dir"])
            .arg(&dir)
            .args(args)
            .output()
            .expect("ctl");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ctl(&["add-user", "device-42", "unused-password"]);
    ctl(&["set-permissions", "device-42", ".*", ".*", ".*"]);
    let tls = |file: &str| lapin::tcp::OwnedTLSConfig {
        identity: Some(lapin::tcp::OwnedIdentity::PKCS8 {
            pem: std::fs::read(dir.join(format!("{file}.pem"))).expect("pem"),
            key: std::fs::read(dir.join(format!("{file}.key"))).expect("key"),
        }),
        cert_chain: Some(pki.ca_pem()),
    };
    let port = broker.addr("amqps").port();
    let uri = format!("amqps://localhost:{port}/%2f?auth_mechanism=external");
    let conn = lapin_connect(&uri, tls("device"))
        .await
        .expect("EXTERNAL login");
    let listed = ctl(&["list-connections"]);
    assert!(listed.contains("device-42"), "{listed}");
    // The TLS column (`ssl`) is in the default listing and true for this connection.
    assert!(
        listed.lines().next().is_some_and(|h| h.contains("ssl"))
            && listed
                .lines()
                .any(|l| l.contains("device-42") && l.split_whitespace().any(|w| w == "true")),
        "{listed}"
    );
    drop(conn);
    let refused = lapin_connect(&uri, tls("stranger")).await;
    assert!(refused.is_err(), "a CN that is no user is refused");
    let lines = broker.wait_logs(&["login refused", "nobody-here"], 1);
    assert_eq!(lines.len(), 1, "{lines:?}");

    // MQTT: no user name in CONNECT; the certificate's CN logs in.
    let mut options = mqtt_options("device-42-client", broker.addr("mqtts"));
    options.set_transport(rumqttc::Transport::tls_with_config(
        rumqttc::TlsConfiguration::Rustls(client_config(pki.roots(), Some(device), false)),
    ));
    let (_client, _events) = mqtt_subscribed(options, "a/b").await;
    let lines = broker.wait_logs(&["accepted MQTT connection", "device-42-client"], 1);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let listed = ctl(&["list-connections"]);
    assert!(listed.contains("device-42"), "{listed}");
}

/// SIGHUP and `warren ctl reload-tls` swap the certificate for new connections; an open
/// connection keeps working; a broken file keeps the old certificate (with a warning).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_reload_on_sighup_without_dropping_connections() {
    let dir = data_dir("reload");
    let first = Pki::new(&dir, "first");
    let second = Pki::new(&dir, "second");
    let key = dir.join("server.key");
    let broker = Broker::start_tls(
        &dir,
        &first,
        &[
            "--in-memory",
            "--amqp",
            "none",
            "--mqtt",
            "none",
            "--mqtts",
            "127.0.0.1:0",
        ],
        1,
    );
    let mqtts = broker.addr("mqtts");
    let tls_options = |id: &str, pki: &Pki| {
        let mut o = mqtt_options(id, mqtts);
        o.set_transport(rumqttc::Transport::tls_with_config(
            rumqttc::TlsConfiguration::Rustls(client_config(pki.roots(), None, false)),
        ));
        o
    };
    let (_old, mut old_events) = mqtt_subscribed(tls_options("old", &first), "r/#").await;

    second.issue("server", "localhost", false);
    broker.signal(libc::SIGHUP);
    assert_eq!(
        broker
            .wait_logs(&["TLS certificate files reloaded"], 1)
            .len(),
        1
    );
    // New connections get the new certificate: trusting only the first CA fails now.
    let (_new, mut new_events) = mqtt_subscribed(tls_options("new", &second), "r/#").await;
    let (stale, mut stale_events) = rumqttc::AsyncClient::new(tls_options("stale", &first), 4);
    let failed = tokio::time::timeout(Duration::from_secs(10), stale_events.poll())
        .await
        .expect("answered");
    assert!(failed.is_err(), "the old CA no longer verifies the server");
    drop(stale);
    // The connection made before the reload still delivers.
    let (publisher, mut pub_events) = rumqttc::AsyncClient::new(tls_options("pub", &second), 4);
    common::bounded_as(
        "room in the client queue for PUBLISH",
        publisher.publish("r/x", rumqttc::QoS::AtLeastOnce, false, "after reload"),
    )
    .await
    .expect("publish");
    tokio::spawn(async move { while pub_events.poll().await.is_ok() {} });
    assert_eq!(mqtt_next(&mut old_events).await, b"after reload");
    assert_eq!(mqtt_next(&mut new_events).await, b"after reload");

    // A broken key file: the reload fails, the second certificate stays in use.
    std::fs::write(&key, "not a key").expect("write");
    let out = Command::new(BIN)
        .args(["ctl", "--data-dir"])
        .arg(&dir)
        .arg("reload-tls")
        .output()
        .expect("ctl");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("private key"));
    let (_again, _e) = mqtt_subscribed(tls_options("again", &second), "r/#").await;
    // Fixed again, ctl reload-tls reloads.
    first.issue("server", "localhost", false);
    let out = Command::new(BIN)
        .args(["ctl", "--data-dir"])
        .arg(&dir)
        .arg("reload-tls")
        .output()
        .expect("ctl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_back, _e) = mqtt_subscribed(tls_options("back", &first), "r/#").await;
}

/// CONNECT (3.1.1, clean session) with a two-byte client id.
fn ws_connect(id: [u8; 2]) -> Vec<u8> {
    vec![
        0x10, 14, 0, 4, b'M', b'Q', b'T', b'T', 4, 2, 0, 60, 0, 2, id[0], id[1],
    ]
}
const WS_SUBSCRIBE: &[u8] = &[0x82, 8, 0, 1, 0, 3, b'w', b'/', b'x', 0];
const WS_PINGREQ: &[u8] = &[0xc0, 0];

/// Reads binary messages until `want` bytes arrived.
async fn ws_read<S>(ws: &mut S, want: usize) -> Vec<u8>
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while got.len() < want {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => got.extend_from_slice(&b),
                Some(Ok(_)) => {}
                other => panic!("WebSocket ended: {other:?}"),
            }
        }
    })
    .await
    .expect("bytes within 10 s");
    got
}

/// MQTT over ws and wss with a raw WebSocket client: CONNECT split over two messages,
/// SUBSCRIBE and PINGREQ in one, then a message a native MQTT client publishes.
async fn ws_session<S>(
    ws: &mut tokio_tungstenite::WebSocketStream<S>,
    mqtt: SocketAddr,
    tag: &str,
    id: [u8; 2],
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let connect = ws_connect(id);
    common::bounded_as(
        "WebSocket frame sent",
        ws.send(Message::binary(connect[..5].to_vec())),
    )
    .await
    .expect("send");
    common::bounded_as(
        "WebSocket frame sent",
        ws.send(Message::binary(connect[5..].to_vec())),
    )
    .await
    .expect("send");
    assert_eq!(ws_read(ws, 4).await, [0x20, 2, 0, 0], "CONNACK accepted");
    let mut both = WS_SUBSCRIBE.to_vec();
    both.extend_from_slice(WS_PINGREQ);
    common::bounded_as("WebSocket frame sent", ws.send(Message::binary(both)))
        .await
        .expect("send");
    assert_eq!(
        ws_read(ws, 7).await,
        [0x90, 3, 0, 1, 0, 0xd0, 0],
        "SUBACK and PINGRESP"
    );
    let (publisher, mut events) =
        rumqttc::AsyncClient::new(mqtt_options(&format!("p-{tag}"), mqtt), 4);
    common::bounded_as(
        "room in the client queue for PUBLISH",
        publisher.publish("w/x", rumqttc::QoS::AtMostOnce, false, tag.to_string()),
    )
    .await
    .expect("publish");
    tokio::spawn(async move { while events.poll().await.is_ok() {} });
    let publish = ws_read(ws, 2 + 2 + 3 + tag.len()).await;
    assert_eq!(publish[0], 0x30);
    assert_eq!(&publish[7..], tag.as_bytes());
}

fn ws_request(
    url: &str,
    protocol: &str,
) -> tokio_tungstenite::tungstenite::handshake::client::Request {
    let mut request = url.into_client_request().expect("request");
    request
        .headers_mut()
        .insert("sec-websocket-protocol", protocol.parse().expect("header"));
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_over_websocket_plain_and_tls() {
    let dir = data_dir("ws");
    let pki = Pki::new(&dir, "ws");
    let broker = Broker::start_tls(
        &dir,
        &pki,
        &[
            "--in-memory",
            "--amqp",
            "none",
            "--mqtt",
            "127.0.0.1:0",
            "--mqtt-ws",
            "127.0.0.1:0",
            "--mqtt-wss",
            "127.0.0.1:0",
        ],
        3,
    );
    let mqtt = broker.addr("(MQTT");
    let ws = broker.addr("mqtt-ws:");
    let wss = broker.addr("mqtt-wss");
    // Plain ws.
    let tcp = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(ws))
        .await
        .expect("connect");
    let (mut socket, response) =
        tokio_tungstenite::client_async(ws_request(&format!("ws://{ws}/mqtt"), "mqtt"), tcp)
            .await
            .expect("upgrade");
    assert_eq!(
        response
            .headers()
            .get("sec-websocket-protocol")
            .map(|v| v.as_bytes()),
        Some(&b"mqtt"[..])
    );
    ws_session(&mut socket, mqtt, "over-ws", *b"w1").await;
    // wss.
    let tcp = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(wss))
        .await
        .expect("connect");
    let tls = common::bounded_as(
        "TLS handshake",
        tokio_rustls::TlsConnector::from(client_config(pki.roots(), None, false)).connect(
            rustls::pki_types::ServerName::try_from("localhost").expect("name"),
            tcp,
        ),
    )
    .await
    .expect("TLS");
    let (mut secure, _) = common::bounded_as(
        "WebSocket handshake",
        tokio_tungstenite::client_async(
            ws_request(&format!("wss://localhost:{}/mqtt", wss.port()), "mqtt"),
            tls,
        ),
    )
    .await
    .expect("upgrade over TLS");
    ws_session(&mut secure, mqtt, "over-wss", *b"w2").await;
    // The ws subscriber got that publish too.
    let publish = ws_read(&mut socket, 2 + 2 + 3 + "over-wss".len()).await;
    assert_eq!(&publish[7..], b"over-wss");

    // A wrong subprotocol and a wrong path: HTTP errors, one log line each; the sessions
    // above carry on.
    for (path, protocol, status, log) in [
        ("/mqtt", "stomp", 400, "Sec-WebSocket-Protocol: mqtt"),
        ("/other", "mqtt", 404, "no MQTT WebSocket endpoint"),
    ] {
        let tcp = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(ws))
            .await
            .expect("connect");
        let local = tcp.local_addr().expect("local").to_string();
        match tokio_tungstenite::client_async(
            ws_request(&format!("ws://{ws}{path}"), protocol),
            tcp,
        )
        .await
        {
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
                assert_eq!(response.status().as_u16(), status)
            }
            other => panic!("{path} {protocol}: expected an HTTP error, got {other:?}"),
        }
        let lines = broker.wait_logs(&[&local], 1);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("WebSocket upgrade refused") && lines[0].contains(log),
            "{lines:?}"
        );
    }
    common::bounded_as(
        "WebSocket frame sent",
        socket.send(Message::binary(WS_PINGREQ.to_vec())),
    )
    .await
    .expect("send");
    assert_eq!(ws_read(&mut socket, 2).await, [0xd0, 0]);
    common::bounded_as(
        "WebSocket frame sent",
        secure.send(Message::binary(WS_PINGREQ.to_vec())),
    )
    .await
    .expect("send");
    assert_eq!(ws_read(&mut secure, 2).await, [0xd0, 0]);
}

/// `--config FILE`: listeners and settings from the file, a flag over a key, a WARREN_*
/// variable over both; a typo or a bad value stops the start with file, line and a hint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_file_with_flags_and_env_over_it() {
    let dir = data_dir("config");
    let file = dir.join("warren.toml");
    std::fs::write(
        &file,
        format!(
            "# a deployment\namqp = [\"127.0.0.1:0\"]\nmqtt = [\"127.0.0.1:0\", \"[::1]:0\"]\n\
             data_dir = {:?}\nshards = 1\nlog_format = \"json\"\nmqtt_max_packet_size = 1000\n\
             management = \"127.0.0.1:0\"\nprometheus = \"none\"\nstream = \"127.0.0.1:0\"\n\
             memory_high_watermark = \"64MiB\"\ndisk_free_limit = 0\n",
            dir.join("data")
        ),
    )
    .expect("write");
    let config = file.to_str().expect("utf-8");
    // The file alone: JSON logs, three listeners, the HTTP API and the stream listener, the
    // file's limits.
    let broker = Broker::start(&dir, &["--config", config], 5);
    let lines = broker.wait_logs(&["listening on", "\"level\":\"INFO\""], 5);
    assert_eq!(lines.len(), 5, "{lines:?}");
    assert_eq!(broker.addrs("(stream)").len(), 1, "the file's stream key");
    assert_eq!(
        broker
            .wait_logs(&["memory alarm at 64 MiB", "free disk limit 0 MB"], 1)
            .len(),
        1,
        "the file's memory_high_watermark and disk_free_limit"
    );
    let mut http = common::bounded_as(
        "TCP connect",
        tokio::net::TcpStream::connect(broker.addr("(HTTP management API)")),
    )
    .await
    .expect("connect to the file's management listener");
    http.write_all(
        b"GET /api/overview HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
          Authorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\r\n",
    )
    .await
    .expect("request");
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), http.read_to_end(&mut response)).await;
    assert!(
        response.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&response)
    );
    drop(broker);
    // A flag over the file's key, an environment variable over the flag.
    let broker = Broker::start_env(
        &dir,
        &["--config", config, "--log-format", "text", "--mqtt", "none"],
        3,
        &[
            ("WARREN_MQTT", "127.0.0.1:0"),
            ("WARREN_MQTT_MAX_PACKET_SIZE", "64"),
        ],
    );
    assert!(
        broker.wait_logs(&["\"level\""], 0).is_empty(),
        "--log-format text won"
    );
    assert_eq!(
        broker.addrs("(MQTT").len(),
        1,
        "WARREN_MQTT won over --mqtt none and the file"
    );
    // The packet limit from the environment: a 100-byte publish closes the connection.
    let mqtt = broker.addr("(MQTT");
    let mut tcp = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(mqtt))
        .await
        .expect("connect");
    tcp.write_all(&[0x10, 12, 0, 4, b'M', b'Q', b'T', b'T', 4, 2, 0, 60, 0, 0])
        .await
        .expect("connect");
    let mut connack = [0u8; 4];
    common::bounded_as("bytes from the broker", tcp.read_exact(&mut connack))
        .await
        .expect("connack");
    let mut publish = vec![0x30, 100, 0, 1, b't'];
    publish.resize(102, b'x');
    tcp.write_all(&publish).await.expect("publish");
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut rest)).await;
    assert!(
        broker.wait_logs(&["MQTT connection closed"], 1).len() == 1,
        "the 64-byte limit applies"
    );
    drop(broker);
    // Typos and bad values: exit 2, file and line, a hint.
    for (text, want) in [
        ("amqp = [\"127.0.0.1:0\"]\nshardz = 2\n", ":2"),
        ("fsync = \"sometimes\"\n", ":1"),
        ("amqps = [\"not an address\"]\n", ":1"),
        ("log_level = \"info,=[\"\n", ":1"),
        ("amqp = []\ndisk_free_limit = \"plenty\"\n", ":2"),
        ("memory_high_watermark = 2.5\n", ":1"),
    ] {
        std::fs::write(&file, text).expect("write");
        let out = Command::new(BIN)
            .args(["serve", "--config", config])
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {stderr}");
        assert!(
            stderr.contains(&format!("warren.toml{want}")),
            "{text}: {stderr}"
        );
    }
}

/// Per-listener TLS files in the config file: amqps serves the shared `tls_cert` (CA "a"),
/// mqtts its own `mqtts_tls_cert` (CA "m"), so each client verifies only with its CA; a
/// flag overrides a listener's key; a listener's unreadable file stops the start naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_listener_tls_files_from_the_config_file() {
    let dir = data_dir("tls-per-listener");
    let a = Pki::new(&dir, "a");
    let m = Pki::new(&dir, "m");
    a.issue("shared-server", "localhost", false);
    m.issue("mqtts-server", "localhost", false);
    let path = |f: &str| dir.join(f).to_str().expect("utf-8").to_string();
    let file = dir.join("warren.toml");
    let config = format!(
        "in_memory = true\ndata_dir = {:?}\namqp = []\nmqtt = []\nmanagement = \"none\"\n\
         prometheus = \"none\"\nstream = \"none\"\namqps = [\"127.0.0.1:0\"]\n\
         mqtts = [\"127.0.0.1:0\"]\ntls_cert = {:?}\ntls_key = {:?}\n\
         mqtts_tls_cert = {:?}\nmqtts_tls_key = {:?}\n",
        dir.join("data"),
        path("shared-server.pem"),
        path("shared-server.key"),
        path("mqtts-server.pem"),
        path("mqtts-server.key"),
    );
    std::fs::write(&file, &config).expect("write");
    let file_arg = file.to_str().expect("utf-8");
    let broker = Broker::start(&dir, &["--config", file_arg], 2);
    let amqps = broker.addr("amqps");
    let mqtts = broker.addr("mqtts");
    let amqps_uri = format!("amqps://guest:guest@localhost:{}/%2f", amqps.port());
    let amqps_with = |pki: &Pki| {
        lapin_connect(
            &amqps_uri,
            lapin::tcp::OwnedTLSConfig {
                identity: None,
                cert_chain: Some(pki.ca_pem()),
            },
        )
    };
    let mqtts_with = |id: &str, pki: &Pki, at: SocketAddr| {
        let mut o = mqtt_options(id, at);
        o.set_transport(rumqttc::Transport::tls_with_config(
            rumqttc::TlsConfiguration::Rustls(client_config(pki.roots(), None, false)),
        ));
        o
    };
    let conn = amqps_with(&a)
        .await
        .expect("amqps serves the shared certificate");
    assert!(
        amqps_with(&m).await.is_err(),
        "amqps does not serve mqtts's certificate"
    );
    let (_sub, mut events) = mqtt_subscribed(mqtts_with("m-sub", &m, mqtts), "per/#").await;
    let (_wrong, mut wrong_events) = rumqttc::AsyncClient::new(mqtts_with("a-sub", &a, mqtts), 4);
    let failed = tokio::time::timeout(Duration::from_secs(10), wrong_events.poll())
        .await
        .expect("answered");
    assert!(
        failed.is_err(),
        "mqtts serves its own certificate, not CA a's"
    );
    amqp_publish(&conn, "per.x", b"across listeners").await;
    assert_eq!(mqtt_next(&mut events).await, b"across listeners");
    drop(broker);

    // A flag over the file's key: --mqtts-tls-cert/--mqtts-tls-key give mqtts CA a's.
    let broker = Broker::start(
        &dir,
        &[
            "--config",
            file_arg,
            "--mqtts-tls-cert",
            &path("shared-server.pem"),
            "--mqtts-tls-key",
            &path("shared-server.key"),
        ],
        2,
    );
    let (_sub, _events) =
        mqtt_subscribed(mqtts_with("a-sub2", &a, broker.addr("mqtts")), "per/#").await;
    drop(broker);

    // A listener's unreadable key: exit 2, the listener and the file named.
    std::fs::write(
        &file,
        config.replace(&path("mqtts-server.key"), &path("missing.key")),
    )
    .expect("write");
    let out = Command::new(BIN)
        .args(["serve", "--config", file_arg])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--mqtts") && stderr.contains("missing.key"),
        "{stderr}"
    );
}

/// A client that opens a TLS or WebSocket connection and then says nothing is dropped after
/// the 10 s handshake bound, with one line each; a connection made meanwhile works. The
/// WebSocket path is the one configured (`--mqtt-ws-path /ws`, RabbitMQ's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_are_dropped_after_10_s() {
    let dir = data_dir("stalled");
    let pki = Pki::new(&dir, "main");
    let broker = Broker::start_tls(
        &dir,
        &pki,
        &[
            "--in-memory",
            "--amqp",
            "none",
            "--mqtt",
            "127.0.0.1:0",
            "--mqtts",
            "127.0.0.1:0",
            "--mqtt-ws",
            "127.0.0.1:0",
            "--mqtt-ws-path",
            "/ws",
        ],
        3,
    );
    let started = std::time::Instant::now();
    let mut tls = common::bounded_as(
        "TCP connect",
        tokio::net::TcpStream::connect(broker.addr("mqtts")),
    )
    .await
    .expect("connect");
    let tls_local = tls.local_addr().expect("local").to_string();
    let ws_addr = broker.addr("mqtt-ws:");
    let mut ws = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(ws_addr))
        .await
        .expect("connect");
    let ws_local = ws.local_addr().expect("local").to_string();
    // Half an upgrade request, never finished.
    ws.write_all(b"GET /ws HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    // Meanwhile the configured path serves MQTT and the default one is not found.
    let tcp = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(ws_addr))
        .await
        .expect("connect");
    let (mut socket, _) =
        tokio_tungstenite::client_async(ws_request(&format!("ws://{ws_addr}/ws"), "mqtt"), tcp)
            .await
            .expect("upgrade at /ws");
    ws_session(&mut socket, broker.addr("(MQTT"), "at-ws", *b"w3").await;
    let tcp = common::bounded_as("TCP connect", tokio::net::TcpStream::connect(ws_addr))
        .await
        .expect("connect");
    match tokio_tungstenite::client_async(ws_request(&format!("ws://{ws_addr}/mqtt"), "mqtt"), tcp)
        .await
    {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 404)
        }
        other => panic!("/mqtt with --mqtt-ws-path /ws: expected 404, got {other:?}"),
    }
    // Both stalled sockets are closed by the broker, at the bound and not before.
    for (what, socket) in [("TLS", &mut tls), ("WebSocket", &mut ws)] {
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(15), socket.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("{what}: still open after 15 s"));
        assert!(matches!(read, Ok(0) | Err(_)), "{what}: closed: {read:?}");
    }
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(9), "dropped after {waited:?}");
    for (needles, what) in [
        (
            ["TLS handshake not completed within 10s", &tls_local],
            "TLS",
        ),
        (
            ["WebSocket upgrade not completed within 10s", &ws_local],
            "WebSocket",
        ),
    ] {
        let lines = broker.wait_logs(&needles, 1);
        assert_eq!(lines.len(), 1, "{what}: {lines:?}");
    }
    // The session made meanwhile is still served.
    common::bounded_as(
        "WebSocket frame sent",
        socket.send(Message::binary(WS_PINGREQ.to_vec())),
    )
    .await
    .expect("send");
    assert_eq!(ws_read(&mut socket, 2).await, [0xd0, 0]);
}

/// Logs to a file (`--log-file`), at per-module levels (`--log-level`); at `info` both
/// protocols log each connection's open and close at INFO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_to_a_file_with_per_module_levels_and_connection_lines_for_both_protocols() {
    let dir = data_dir("logfile");
    for (level, amqp_logged) in [("info", true), ("info,warren_amqp=warn", false)] {
        let log = dir.join(format!("warren-{amqp_logged}.log"));
        let mut child = common::dies_with_test(&mut Command::new(BIN))
            .args(["serve", "--in-memory", "--data-dir"])
            .arg(dir.join("data"))
            .args([
                "--amqp",
                "127.0.0.1:0",
                "--mqtt",
                "127.0.0.1:0",
                "--management",
                "none",
                "--prometheus",
                "none",
                "--stream",
                "none",
                "--log-level",
                level,
                "--log-file",
            ])
            .arg(&log)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start");
        let lines = |needle: &str| -> Vec<String> {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(needle))
                .map(str::to_string)
                .collect()
        };
        let wait = |needle: &str, n: usize| {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while lines(needle).len() < n && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            lines(needle)
        };
        let listening = wait("listening on", 2);
        assert_eq!(listening.len(), 2, "{listening:?}");
        let port = |label: &str| -> SocketAddr {
            let line = listening
                .iter()
                .find(|l| l.contains(label))
                .expect("listener");
            line.split("listening on ").nth(1).expect("addr")[..]
                .split(' ')
                .next()
                .expect("addr")
                .parse()
                .expect("addr")
        };
        let conn = amqp_plain(port("(AMQP")).await;
        common::bounded_as("close-ok", conn.close(200, "bye".into()))
            .await
            .expect("close");
        let (client, mut events) =
            rumqttc::AsyncClient::new(mqtt_options("logged", port("(MQTT")), 4);
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_))) =
                    events.poll().await
                {
                    break;
                }
            }
        })
        .await
        .expect("CONNACK");
        common::bounded_as(
            "room in the client queue for DISCONNECT",
            client.disconnect(),
        )
        .await
        .expect("disconnect");
        let _ = tokio::time::timeout(Duration::from_secs(2), events.poll()).await;
        // The AMQP connection closed before the MQTT one opened: once the MQTT lines are
        // in, the AMQP ones are too, or filtered out.
        for (needle, want) in [
            ("accepted MQTT connection", true),
            ("MQTT client disconnected", true),
            ("accepted AMQP connection", amqp_logged),
            ("connection closed by client", amqp_logged),
        ] {
            let found = if want { wait(needle, 1) } else { lines(needle) };
            if want {
                assert_eq!(found.len(), 1, "{level}: {needle}");
                assert!(found[0].contains(" INFO "), "{level}: {found:?}");
            } else {
                assert!(found.is_empty(), "{level}: {needle}: {found:?}");
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        let stdout = child.stdout.take().map(|mut s| {
            let mut out = String::new();
            let _ = std::io::Read::read_to_string(&mut s, &mut out);
            out
        });
        assert_eq!(
            stdout.as_deref(),
            Some(""),
            "nothing on stdout with --log-file"
        );
    }
}

/// `--tls-login-from subject_alternative_name`: the certificate's first SAN is the user, for
/// AMQP EXTERNAL and MQTT use_identity_as_username alike; its CN is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_logins_by_subject_alternative_name() {
    let dir = data_dir("sanlogin");
    let pki = Pki::new(&dir, "ca");
    pki.issue_san("sensor", "sensor-7.devices");
    let ca = dir.join("ca-ca.pem");
    let broker = Broker::start_tls(
        &dir,
        &pki,
        &[
            "--in-memory",
            "--amqp",
            "none",
            "--mqtt",
            "none",
            "--amqps",
            "127.0.0.1:0",
            "--mqtts",
            "127.0.0.1:0",
            "--tls-ca",
            ca.to_str().expect("utf-8"),
            "--tls-verify-peer",
            "--tls-login-from",
            "subject_alternative_name",
            "--mqtt-use-identity-as-username",
        ],
        2,
    );
    let ctl = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["ctl", "--data-dir"])
            .arg(&dir)
            .args(args)
            .output()
            .expect("ctl");
        assert!(out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ctl(&["add-user", "sensor-7.devices", "unused-password"]);
    ctl(&["set-permissions", "sensor-7.devices", ".*", ".*", ".*"]);
    let uri = format!(
        "amqps://localhost:{}/%2f?auth_mechanism=external",
        broker.addr("amqps").port()
    );
    let tls = lapin::tcp::OwnedTLSConfig {
        identity: Some(lapin::tcp::OwnedIdentity::PKCS8 {
            pem: std::fs::read(dir.join("sensor.pem")).expect("pem"),
            key: std::fs::read(dir.join("sensor.key")).expect("key"),
        }),
        cert_chain: Some(pki.ca_pem()),
    };
    let _conn = lapin_connect(&uri, tls)
        .await
        .expect("EXTERNAL login by SAN");
    let mut options = mqtt_options("sensor-client", broker.addr("mqtts"));
    let pem = std::fs::read(dir.join("sensor.pem")).expect("pem");
    let key = std::fs::read(dir.join("sensor.key")).expect("key");
    use rustls::pki_types::pem::PemObject;
    let cert = rustls::pki_types::CertificateDer::from_pem_slice(&pem).expect("cert");
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(&key).expect("key");
    options.set_transport(rumqttc::Transport::tls_with_config(
        rumqttc::TlsConfiguration::Rustls(client_config(pki.roots(), Some((cert, key)), false)),
    ));
    let (_client, _events) = mqtt_subscribed(options, "s/#").await;
    let listed = ctl(&["--format", "json", "list-connections"]);
    let users: Vec<String> = serde_json::from_str::<Vec<serde_json::Value>>(&listed)
        .expect("json")
        .iter()
        .filter_map(|c| c["user"].as_str().map(str::to_string))
        .collect();
    assert_eq!(users, ["sensor-7.devices", "sensor-7.devices"], "{listed}");
}

/// `--default-user` and `WARREN_DEFAULT_PASS` (RabbitMQ's default_user/default_pass): a new
/// data directory starts with that administrator instead of guest; later starts keep the
/// stored users whatever the flags say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_user_is_configurable_on_the_first_start() {
    let dir = data_dir("defaultuser");
    let login = |addr: SocketAddr, user: &str, pass: &str| {
        let uri = format!("amqp://{user}:{pass}@{addr}/%2f");
        async move {
            tokio::time::timeout(
                Duration::from_secs(10),
                lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
            )
            .await
            .expect("answered within 10 s")
        }
    };
    // Broker::start passes --data-dir `dir`: a store, not --in-memory.
    let args = ["--amqp", "127.0.0.1:0", "--mqtt", "none"];
    let broker = Broker::start_env(
        &dir,
        &[&args[..], &["--default-user", "admin"]].concat(),
        1,
        &[("WARREN_DEFAULT_PASS", "s3cret")],
    );
    let addr = broker.addr("(AMQP");
    login(addr, "admin", "s3cret")
        .await
        .expect("the default user");
    assert!(login(addr, "guest", "guest").await.is_err(), "no guest");
    // A clean stop (SIGTERM), as an operator restarts.
    let mut broker = broker;
    broker.signal(libc::SIGTERM);
    let status = common::exited(&mut broker.child, Duration::from_secs(30), "SIGTERM");
    assert_eq!(status.code(), Some(0));
    drop(broker);
    let broker = Broker::start(
        &dir,
        &[
            &args[..],
            &["--default-user", "admin", "--default-pass", "other"],
        ]
        .concat(),
        1,
    );
    let addr = broker.addr("(AMQP");
    login(addr, "admin", "s3cret")
        .await
        .expect("the stored user and password");
    assert!(
        login(addr, "admin", "other").await.is_err(),
        "first start only"
    );
}
