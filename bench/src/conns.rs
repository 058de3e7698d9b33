//! `warren-bench conns`: how many idle MQTT connections a broker holds, and at what cost.
//!
//! Over sockets (any broker: Warren, Mosquitto, RabbitMQ): opens N MQTT 3.1.1 connections
//! from several source addresses 127.0.0.x (past the ~28k ephemeral ports of one address),
//! each CONNECT + keep-alive + optionally one SUBSCRIBE, and holds them while every client
//! pings at its keep-alive interval. Reports the broker's RSS growth per connection
//! (`--pid`), connects per second, the broker's CPU while holding them idle, publish ->
//! deliver latency on a live pair meanwhile, and whether every connection stayed alive.
//!
//! `--socketless`: an in-process broker and the real MQTT gateway
//! (`warren_mqtt::serve_connection`) over in-memory duplex streams, past the file-descriptor
//! cap. Heap is counted exactly (counting allocator); the duplex transport's own cost is
//! measured on its own first and subtracted.
//!
//! `--protocol amqp`: the same over AMQP 0.9.1 (`idle_amqp.rs`): each connection opens a
//! channel, an exclusive server-named queue bound to `amq.topic` and a consumer on it
//! (through `warren_amqp::serve_connection` when socketless).

use super::idle_amqp;
use anyhow::{Context, bail, ensure};
use indicatif::{ProgressBar, ProgressStyle};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::mqtt_client::{PUBLISH, handshake_bytes, packet, parse_header, publish_stamp, put_str};

/// Largest number of connections one run opens (bounds the client's own memory).
const MAX_CONNECTIONS: usize = 4_000_000;
/// How long one CONNECT/SUBSCRIBE exchange or one PINGREQ may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// The first connections pay for one-time allocations (maps, runtime); they are opened
/// before the "before" reading.
const WARM_UP: usize = 100;
/// Capacity of each direction of a socketless connection's duplex stream.
const DUPLEX_BUF: usize = 512;
/// Connections whose transport cost is measured alone (socketless), to subtract it.
const TRANSPORT_SAMPLE: usize = 10_000;
/// Topic of the live latency pair.
const LIVE_TOPIC: &str = "warren-bench/live";

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Mqtt,
    Amqp,
}

#[derive(clap::Args, Debug)]
pub struct ConnsArgs {
    /// The protocol of the idle connections.
    #[arg(long, value_enum, default_value = "mqtt")]
    protocol: Protocol,
    /// Connections to open and hold (besides 100 warm-up connections).
    #[arg(short = 'n', long, default_value_t = 1000)]
    connections: usize,
    /// The broker's MQTT address (sockets mode).
    #[arg(long, default_value = "127.0.0.1:1883")]
    mqtt: SocketAddr,
    /// The broker's AMQP address (sockets mode, `--protocol amqp`).
    #[arg(long, default_value = "127.0.0.1:5672")]
    amqp: SocketAddr,
    /// The broker's process id: its RSS and CPU are read from /proc (sockets mode).
    #[arg(long)]
    pid: Option<u32>,
    /// Source addresses 127.0.0.1 .. 127.0.0.<sources> the connections are spread over.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(1..=250))]
    sources: u8,
    /// QoS of each connection's one subscription.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=2))]
    qos: u8,
    /// Connect without subscribing.
    #[arg(long)]
    no_subscribe: bool,
    /// MQTT protocol version of the idle connections: 4 (3.1.1) or 5 (clean start, no
    /// session expiry, no properties).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(4..=5))]
    mqtt_version: u8,
    /// Keep-alive announced in CONNECT (AMQP: the heartbeat in tune-ok), seconds; each
    /// client pings (sends a heartbeat) at this interval (over sockets; socketless clients
    /// ping once at the end, so give them a keep-alive longer than the whole run, e.g. 600,
    /// or the broker rightly drops them).
    #[arg(long, default_value_t = 30)]
    keep_alive: u16,
    /// Seconds the idle connections are held while the broker's CPU is measured.
    #[arg(long, default_value_t = 60)]
    hold: u64,
    /// Seconds of publish -> deliver measurement on a live pair after the idle hold.
    #[arg(long, default_value_t = 10)]
    latency_secs: u64,
    /// Messages per second the live pair sends (QoS 0, 8-byte payloads).
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// Connection handshakes in flight at once.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Client id prefix (distinct prefixes let runs overlap on one broker).
    #[arg(long, default_value = "idle-")]
    prefix: String,
    /// In-process broker and gateway over in-memory streams instead of sockets.
    #[arg(long)]
    socketless: bool,
    /// Persistent sessions (MQTT): clean session 0 (3.1.1), or clean start 0 with a session
    /// expiry of `SESSION_EXPIRY_S` (5). Each run should use a client id prefix of its own
    /// (`--prefix`): a session left by an earlier run is resumed (CONNACK session present).
    #[arg(long)]
    persistent: bool,
}

/// The session expiry interval a `--persistent` MQTT 5 connection asks for, seconds.
const SESSION_EXPIRY_S: u32 = 3600;

pub async fn run(args: ConnsArgs) -> anyhow::Result<()> {
    ensure!(
        (1..=MAX_CONNECTIONS).contains(&args.connections),
        "--connections must be 1..={MAX_CONNECTIONS}"
    );
    ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    if args.socketless {
        socketless(&args).await
    } else {
        sockets(&args).await
    }
}

/// Sends CONNECT (+ SUBSCRIBE) and checks CONNACK (+ SUBACK); returns the bytes each side
/// wrote.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    client_id: &str,
    keep_alive: u16,
    subscribe: Option<(&str, u8)>,
    version: u8,
    persistent: bool,
) -> anyhow::Result<(usize, usize)> {
    let hello = if version == 5 {
        handshake_bytes_v5(client_id, keep_alive, subscribe, persistent)
    } else {
        handshake_bytes(client_id, keep_alive, None, subscribe, persistent)
    };
    s.write_all(&hello).await?;
    // CONNACK: session-present flag (a persistent session left by an earlier run may be
    // resumed), then the return (v5: reason) code; v5 adds properties.
    let (first, connack, mut read) = read_packet(s).await.context("CONNACK")?;
    let present_ok = |p: u8| p == 0 || (persistent && p == 1);
    ensure!(
        first == 0x20
            && connack.first().is_some_and(|&p| present_ok(p))
            && connack.get(1) == Some(&0),
        "{client_id}: CONNACK {first:02x} {connack:02x?}"
    );
    if subscribe.is_some() {
        // SUBACK: packet id, (v5: properties,) one granted QoS per filter.
        let (first, suback, n) = read_packet(s).await.context("SUBACK")?;
        ensure!(
            first == 0x90 && suback.last().is_some_and(|&q| q <= 2),
            "{client_id}: SUBACK {suback:02x?}"
        );
        read += n;
    }
    Ok((hello.len(), read))
}

/// CONNECT (MQTT 5; clean start and no properties, or, `persistent`, no clean start and a
/// session expiry interval) followed by an optional SUBSCRIBE.
fn handshake_bytes_v5(
    client_id: &str,
    keep_alive: u16,
    subscribe: Option<(&str, u8)>,
    persistent: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + client_id.len());
    let mut body = vec![
        0,
        4,
        b'M',
        b'Q',
        b'T',
        b'T',
        5,
        if persistent { 0 } else { 0x02 },
    ];
    body.extend_from_slice(&keep_alive.to_be_bytes());
    if persistent {
        // Properties: 5 bytes, Session Expiry Interval (0x11, four-byte integer).
        body.extend_from_slice(&[5, 0x11]);
        body.extend_from_slice(&SESSION_EXPIRY_S.to_be_bytes());
    } else {
        body.push(0); // no properties
    }
    put_str(&mut body, client_id);
    packet(&mut out, 0x10, &body);
    if let Some((filter, qos)) = subscribe {
        let mut body = vec![0, 1, 0];
        put_str(&mut body, filter);
        body.push(qos);
        packet(&mut out, 0x82, &body);
    }
    out
}

/// Reads one whole packet: (first byte, body, bytes read).
async fn read_packet<S: AsyncRead + Unpin>(s: &mut S) -> anyhow::Result<(u8, Vec<u8>, usize)> {
    let mut head = [0u8; 5];
    s.read_exact(&mut head[..2]).await?;
    let mut have = 2;
    let (first, header, len) = loop {
        if let Some(h) = parse_header(&head[..have])? {
            break h;
        }
        ensure!(have < head.len(), "bad remaining length");
        s.read_exact(&mut head[have..have + 1]).await?;
        have += 1;
    };
    // Handshake answers are small; a large one is not what this bench sent for.
    ensure!(len <= 4096, "a {len}-byte answer to a handshake");
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    Ok((first, body, header + len))
}

/// One connection's greeting: MQTT CONNECT (+ SUBSCRIBE to `<id>/cmd`), or the AMQP
/// handshake (+ queue bound with key `<id>.cmd`, consumer). Returns the bytes each side
/// wrote per round trip.
async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    protocol: Protocol,
    id: &str,
    keep_alive: u16,
    subscribe: Option<u8>,
    version: u8,
    persistent: bool,
) -> anyhow::Result<idle_amqp::Exchange> {
    match protocol {
        Protocol::Mqtt => {
            let filter = format!("{id}/cmd");
            let sizes = handshake(
                s,
                id,
                keep_alive,
                subscribe.map(|q| (filter.as_str(), q)),
                version,
                persistent,
            )
            .await?;
            Ok(vec![sizes])
        }
        Protocol::Amqp => {
            let key = format!("{id}.cmd");
            idle_amqp::handshake(s, keep_alive, subscribe.map(|_| key.as_str())).await
        }
    }
}

/// A request the broker must answer: PINGREQ, or an AMQP basic.qos on the consumer's channel.
async fn check_alive<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    protocol: Protocol,
) -> anyhow::Result<()> {
    match protocol {
        Protocol::Mqtt => ping(s).await,
        Protocol::Amqp => idle_amqp::ping(s).await,
    }
}

/// One PINGREQ, answered by PINGRESP.
async fn ping<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> anyhow::Result<()> {
    s.write_all(&[0xC0, 0]).await?;
    let mut resp = [0u8; 2];
    tokio::time::timeout(EXCHANGE_TIMEOUT, s.read_exact(&mut resp))
        .await
        .context("no PINGRESP")??;
    ensure!(resp == [0xD0, 0], "PINGRESP {resp:02x?}");
    Ok(())
}

fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// VmRSS of a process in bytes.
fn rss(pid: Option<u32>) -> anyhow::Result<u64> {
    let path = pid.map_or_else(
        || "/proc/self/status".into(),
        |p| format!("/proc/{p}/status"),
    );
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no VmRSS in {path}"))?;
    Ok(kib * 1024)
}

/// The TCP line of /proc/net/sockstat: (sockets in use, pages of socket buffers). Kernel
/// memory is not in a broker's RSS; an idle socket holds no buffer pages, its cost is the
/// socket's slab objects (~3.8 KB each, docs/benchmarks.md), the same for every broker.
fn sockstat_tcp() -> Option<(i64, i64)> {
    let s = std::fs::read_to_string("/proc/net/sockstat").ok()?;
    let line = s.lines().find_map(|l| l.strip_prefix("TCP:"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let field = |name: &str| -> Option<i64> {
        let i = words.iter().position(|w| *w == name)?;
        words.get(i + 1)?.parse().ok()
    };
    Some((field("inuse")?, field("mem")?))
}

/// Bytes of the kernel's slab caches a TCP socket's objects live in (`TCP`, its inode, file,
/// dentry, epoll item), system-wide: active objects times object size, from /proc/slabinfo
/// (readable by root only; `None` otherwise).
fn socket_slabs() -> Option<i64> {
    const CACHES: [&str; 5] = ["TCP", "sock_inode_cache", "filp", "dentry", "eventpoll_epi"];
    let s = std::fs::read_to_string("/proc/slabinfo").ok()?;
    let mut total = 0;
    for line in s.lines() {
        let mut w = line.split_whitespace();
        if w.next().is_some_and(|name| CACHES.contains(&name)) {
            let active: i64 = w.next()?.parse().ok()?;
            let _num = w.next()?;
            let size: i64 = w.next()?.parse().ok()?;
            total += active * size;
        }
    }
    Some(total)
}

/// User + system CPU time a process has used.
fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // Fields after the command name (which may contain spaces) in parentheses.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("bad stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
    let ticks: u64 = fields
        .get(11..13)
        .context("short stat")?
        .iter()
        .map(|f| f.parse::<u64>().unwrap_or(0))
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_millis(ticks * 1000 / hz))
}

/// Raises the soft open-file limit to the hard one (each connection is a descriptor).
fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for the duration of both calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    lim.rlim_cur
}

/// Prints rows of (name, value) aligned.
fn table(rows: &[(&str, String)]) {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        println!("  {k:<width$}  {v}");
    }
}

fn per_conn(delta: i64, n: usize) -> f64 {
    delta as f64 / n.max(1) as f64
}

/// What each connection holds, for the report.
fn what_each(args: &ConnsArgs) -> String {
    let version = match (args.mqtt_version, args.persistent) {
        (5, false) => "5",
        (5, true) => "5, persistent session",
        (_, false) => "3.1.1",
        (_, true) => "3.1.1, persistent session",
    };
    match (args.protocol, subscription(args)) {
        (Protocol::Mqtt, None) => format!("no subscription (MQTT {version})"),
        (Protocol::Amqp, None) => "no subscription".to_string(),
        (Protocol::Mqtt, Some(q)) => format!("one QoS {q} subscription each (MQTT {version})"),
        (Protocol::Amqp, Some(_)) => {
            "AMQP: a channel, an exclusive queue bound to amq.topic and a consumer each".to_string()
        }
    }
}

/// The QoS of each connection's subscription, `None` without one.
fn subscription(args: &ConnsArgs) -> Option<u8> {
    (!args.no_subscribe).then_some(args.qos)
}

/// The broker address the connections go to (sockets mode).
fn target(args: &ConnsArgs) -> SocketAddr {
    match args.protocol {
        Protocol::Mqtt => args.mqtt,
        Protocol::Amqp => args.amqp,
    }
}

// ---------------------------------------------------------------------------------------
// Sockets

async fn open_tcp(addr: SocketAddr, source: Ipv4Addr) -> anyhow::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(IpAddr::V4(source), 0))?;
    let stream = socket.connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

fn source_of(i: usize, sources: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 1 + (i % usize::from(sources)) as u8)
}

/// Holds one connection: pings at the keep-alive interval until `stop`, counting answers.
async fn hold(
    mut s: TcpStream,
    protocol: Protocol,
    first_ping: Duration,
    every: Duration,
    mut stop: watch::Receiver<bool>,
    pings: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let mut next = tokio::time::Instant::now() + first_ping;
    let mut got = [0u8; 64];
    loop {
        tokio::select! {
            _ = stop.changed() => return Ok(()),
            _ = tokio::time::sleep_until(next) => {
                match protocol {
                    Protocol::Mqtt => ping(&mut s).await?,
                    // AMQP heartbeats are not answered: the broker drops a silent client.
                    Protocol::Amqp => s.write_all(&idle_amqp::HEARTBEAT).await?,
                }
                pings.fetch_add(1, Relaxed);
                next += every;
            }
            // Nothing is expected between pings but AMQP heartbeats: anything else or EOF
            // means trouble.
            r = s.read(&mut got) => match r {
                Ok(0) => bail!("closed by the broker"),
                Ok(n) if protocol == Protocol::Amqp && idle_amqp::only_heartbeats(&got[..n]) => {}
                Ok(n) => bail!("unexpected bytes {:02x?} from the broker", &got[..n]),
                Err(e) => return Err(e.into()),
            },
        }
    }
}

async fn sockets(args: &ConnsArgs) -> anyhow::Result<()> {
    let fds = raise_fd_limit();
    let total = args.connections + WARM_UP + 2;
    if total as u64 + 64 > fds {
        bail!(
            "{total} connections need as many file descriptors; this process may open {fds} \
             (ulimit -n). Use fewer connections or --socketless."
        );
    }
    let (stop_tx, stop) = watch::channel(false);
    let pings = Arc::new(AtomicU64::new(0));
    let mut holders: JoinSet<anyhow::Result<()>> = JoinSet::new();
    let every = Duration::from_secs(u64::from(args.keep_alive.max(1)));

    let open = |i: usize| {
        let addr = target(args);
        let source = source_of(i, args.sources);
        let id = format!("{}{i}", args.prefix);
        let sub = subscription(args);
        let (keep_alive, protocol, version) = (args.keep_alive, args.protocol, args.mqtt_version);
        let persistent = args.persistent;
        async move {
            let mut s = open_tcp(addr, source)
                .await
                .with_context(|| format!("connecting from {source}"))?;
            tokio::time::timeout(
                EXCHANGE_TIMEOUT,
                greet(&mut s, protocol, &id, keep_alive, sub, version, persistent),
            )
            .await
            .context("handshake timed out")??;
            anyhow::Ok(s)
        }
    };
    let mut spread = 0u64;
    let mut start_holding = |s: TcpStream, holders: &mut JoinSet<anyhow::Result<()>>| {
        // Spread first pings over one interval so pings do not come in waves.
        spread = (spread + 7919) % every.as_millis().max(1) as u64;
        holders.spawn(hold(
            s,
            args.protocol,
            Duration::from_millis(spread),
            every,
            stop.clone(),
            pings.clone(),
        ));
    };

    for i in 0..WARM_UP {
        let s = open(i).await?;
        start_holding(s, &mut holders);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_before = args.pid.map(|p| rss(Some(p))).transpose()?;
    let sockstat_before = sockstat_tcp();
    let slabs_before = socket_slabs();

    let bar = progress(args.connections as u64, "connecting");
    // Where the connect time goes: on 2 shared cores the client may be the bottleneck.
    let own_pid = std::process::id();
    let cpu_at_start = (args.pid.map(cpu_time).transpose()?, cpu_time(own_pid)?);
    let started = Instant::now();
    let mut opening = JoinSet::new();
    let mut next = WARM_UP;
    let end = WARM_UP + args.connections;
    while next < end || !opening.is_empty() {
        while next < end && opening.len() < args.concurrency {
            opening.spawn(open(next));
            next += 1;
        }
        if let Some(done) = opening.join_next().await {
            let s = done.context("connect task")??;
            start_holding(s, &mut holders);
            bar.inc(1);
        }
    }
    let connect_time = started.elapsed();
    let cores = |used: Duration| used.as_secs_f64() / connect_time.as_secs_f64();
    let connect_cpu = format!(
        "client {:.2} cores{}",
        cores(cpu_time(own_pid)?.saturating_sub(cpu_at_start.1)),
        match (args.pid, cpu_at_start.0) {
            (Some(p), Some(b)) => format!(
                ", broker {:.2} cores",
                cores(cpu_time(p)?.saturating_sub(b))
            ),
            _ => String::new(),
        }
    );
    bar.finish_and_clear();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_after = args.pid.map(|p| rss(Some(p))).transpose()?;
    let sockstat_after = sockstat_tcp();
    let slabs_after = socket_slabs();

    // Idle hold: the broker's CPU while only keep-alive traffic flows.
    let cpu_before = args.pid.map(cpu_time).transpose()?;
    let bar = progress(args.hold, "holding idle");
    for _ in 0..args.hold {
        tokio::time::sleep(Duration::from_secs(1)).await;
        bar.inc(1);
        if let Some(r) = holders.try_join_next() {
            bar.finish_and_clear();
            r.context("holder task")?
                .context("a held connection failed")?;
        }
    }
    bar.finish_and_clear();
    let cpu_idle = match (args.pid, cpu_before) {
        (Some(p), Some(before)) => Some(cpu_time(p)?.saturating_sub(before)),
        _ => None,
    };

    // The live pair speaks MQTT (an AMQP-only broker has no MQTT port to pair on).
    let latency = if args.latency_secs > 0 && args.protocol == Protocol::Mqtt {
        Some(live_pair(args).await?)
    } else {
        None
    };

    // Every connection must still be alive: holders end only on error before `stop`.
    let mut failed = 0usize;
    let mut first_error = None;
    while let Some(r) = holders.try_join_next() {
        if let Err(e) = r.map_err(anyhow::Error::from).and_then(|r| r) {
            failed += 1;
            first_error.get_or_insert(e);
        }
    }
    let alive = total - 2 - failed;
    let _ = stop_tx.send(true);
    while holders.join_next().await.is_some() {}

    let n = args.connections;
    let mut rows = vec![
        ("broker", format!("{} (sockets)", target(args))),
        (
            "connections",
            format!(
                "{n} (+{WARM_UP} warm-up) from {} source addresses, {}",
                args.sources,
                what_each(args)
            ),
        ),
        (
            "connects/s",
            format!(
                "{:.0} ({n} in {:.2} s, {} in flight)",
                n as f64 / connect_time.as_secs_f64(),
                connect_time.as_secs_f64(),
                args.concurrency
            ),
        ),
        ("CPU connecting", connect_cpu),
    ];
    if let (Some(b), Some(a)) = (rss_before, rss_after) {
        rows.push((
            "broker RSS",
            format!(
                "{:.1} MiB -> {:.1} MiB: {:.0} bytes per connection",
                b as f64 / 1048576.0,
                a as f64 / 1048576.0,
                per_conn(a as i64 - b as i64, n)
            ),
        ));
    }
    if let (Some((s0, m0)), Some((s1, m1))) = (sockstat_before, sockstat_after) {
        // System-wide: both ends of each loopback connection are counted.
        rows.push((
            "kernel TCP (sockstat)",
            format!(
                "{:+} sockets in use (both ends), {:+} pages of socket buffers ({:.0} bytes per connection)",
                s1 - s0,
                m1 - m0,
                per_conn((m1 - m0) * 4096, n)
            ),
        ));
    }
    if let (Some(b), Some(a)) = (slabs_before, slabs_after) {
        rows.push((
            "kernel slabs (sockets)",
            format!(
                "{:.0} bytes per connection, both ends (TCP, inode, file, dentry, epoll item)",
                per_conn(a - b, n)
            ),
        ));
    }
    if let Some(cpu) = cpu_idle {
        rows.push((
            "idle CPU",
            format!(
                "{:.2} % of one core over {} s (keep-alive {} s, {} pings answered)",
                cpu.as_secs_f64() * 100.0 / args.hold.max(1) as f64,
                args.hold,
                args.keep_alive,
                pings.load(Relaxed)
            ),
        ));
    }
    if let Some(l) = &latency {
        rows.push(("publish->deliver", l.clone()));
    }
    rows.push(("alive at the end", format!("{alive}/{}", total - 2)));
    println!("warren-bench conns");
    table(&rows);
    if let Some(e) = first_error {
        bail!("{failed} connections died while held; first: {e:#}");
    }
    Ok(())
}

/// Publish -> deliver latency on a live QoS 0 pair, in-process timestamps in the payload.
async fn live_pair(args: &ConnsArgs) -> anyhow::Result<String> {
    let source = Ipv4Addr::LOCALHOST;
    let sub_id = format!("{}live-sub", args.prefix);
    let pub_id = format!("{}live-pub", args.prefix);
    let mut sub = open_tcp(args.mqtt, source).await?;
    handshake(&mut sub, &sub_id, 0, Some((LIVE_TOPIC, 0)), 4, false).await?;
    let mut publ = open_tcp(args.mqtt, source).await?;
    handshake(&mut publ, &pub_id, 0, None, 4, false).await?;
    let origin = Instant::now();
    let count = args.rate.max(1) as u64 * args.latency_secs;
    let interval = Duration::from_nanos(1_000_000_000 / u64::from(args.rate.max(1)));
    let publisher = async {
        let mut tick = tokio::time::interval(interval);
        for _ in 0..count {
            tick.tick().await;
            let mut body = Vec::with_capacity(32);
            put_str(&mut body, LIVE_TOPIC);
            body.extend_from_slice(&(origin.elapsed().as_nanos() as u64).to_be_bytes());
            let mut pkt = Vec::with_capacity(40);
            packet(&mut pkt, 0x30, &body);
            publ.write_all(&pkt).await?;
        }
        anyhow::Ok(())
    };
    let receiver = async {
        let mut lat = Vec::with_capacity(count as usize);
        let mut buf = Vec::with_capacity(4096);
        let deadline =
            tokio::time::Instant::now() + Duration::from_secs(args.latency_secs) + EXCHANGE_TIMEOUT;
        while (lat.len() as u64) < count {
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout_at(deadline, sub.read(&mut chunk))
                .await
                .context("live pair: deliveries stopped")??;
            ensure!(n > 0, "live pair: subscriber closed");
            buf.extend_from_slice(&chunk[..n]);
            let now = origin.elapsed().as_nanos() as u64;
            let used = parse_publishes(&buf, |sent| lat.push(now.saturating_sub(sent)))?;
            buf.drain(..used);
        }
        anyhow::Ok(lat)
    };
    let (p, lat) = tokio::join!(publisher, receiver);
    p?;
    let mut lat = lat?;
    lat.sort_unstable();
    let q = |f: f64| lat[((lat.len() - 1) as f64 * f) as usize] as f64 / 1e6;
    Ok(format!(
        "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} QoS 0 messages at {}/s)",
        q(0.5),
        q(0.99),
        q(1.0),
        lat.len(),
        args.rate
    ))
}

/// Calls `on` with the timestamp of each complete PUBLISH in `buf`; returns the bytes used.
fn parse_publishes(buf: &[u8], mut on: impl FnMut(u64)) -> anyhow::Result<usize> {
    let mut at = 0;
    while let Some((header, hl, len)) = parse_header(&buf[at..])? {
        let Some(body) = buf.get(at + hl..at + hl + len) else {
            break;
        };
        if header >> 4 == PUBLISH {
            on(publish_stamp(header, body).context("short PUBLISH")?);
        }
        at += hl + len;
    }
    Ok(at)
}

// ---------------------------------------------------------------------------------------
// Socketless

/// Opens `n` in-memory connections through `open` (a handshake each, `concurrency` at once).
async fn open_all<F, Fut>(
    n: usize,
    first: usize,
    concurrency: usize,
    bar: Option<&ProgressBar>,
    out: &mut Vec<DuplexStream>,
    open: F,
) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(DuplexStream, idle_amqp::Exchange)>>
        + Send
        + 'static,
{
    let mut set = JoinSet::new();
    let mut next = first;
    let end = first + n;
    while next < end || !set.is_empty() {
        while next < end && set.len() < concurrency {
            set.spawn(open(next));
            next += 1;
        }
        if let Some(done) = set.join_next().await {
            out.push(done.context("connect task")??.0);
            if let Some(b) = bar {
                b.inc(1);
            }
        }
    }
    Ok(())
}

/// Pings every connection once; returns how many answered.
async fn ping_all(
    conns: Vec<DuplexStream>,
    protocol: Protocol,
    concurrency: usize,
) -> (usize, Vec<DuplexStream>) {
    let mut ok = 0;
    let mut back = Vec::with_capacity(conns.len());
    let mut set = JoinSet::new();
    let mut it = conns.into_iter();
    loop {
        while set.len() < concurrency {
            let Some(mut s) = it.next() else { break };
            set.spawn(async move {
                let r = check_alive(&mut s, protocol).await;
                (r.is_ok(), s)
            });
        }
        let Some(done) = set.join_next().await else {
            break;
        };
        if let Ok((alive, s)) = done {
            ok += usize::from(alive);
            back.push(s);
        }
    }
    (ok, back)
}

/// The heap one duplex pair costs after carrying the bytes of one connection's handshake
/// (`steps`, as the real one wrote them, round trip by round trip).
async fn transport_cost(n: usize, steps: &[(usize, usize)]) -> anyhow::Result<f64> {
    let sample = n.min(TRANSPORT_SAMPLE);
    let largest = steps.iter().map(|&(a, b)| a.max(b)).max().unwrap_or(0);
    let bytes = vec![0u8; largest];
    let mut got = vec![0u8; largest];
    let mut held = Vec::with_capacity(sample);
    let before = crate::alloc::live();
    for _ in 0..sample {
        let (mut client, mut server) = tokio::io::duplex(DUPLEX_BUF);
        for &(up, down) in steps {
            // Concurrently: a step may exceed the duplex buffer.
            let (w, r) = tokio::join!(
                client.write_all(&bytes[..up]),
                server.read_exact(&mut got[..up])
            );
            w?;
            r?;
            let (w, r) = tokio::join!(
                server.write_all(&bytes[..down]),
                client.read_exact(&mut got[..down])
            );
            w?;
            r?;
        }
        held.push((client, server));
    }
    let cost = per_conn(crate::alloc::live() - before, sample);
    drop(held);
    Ok(cost)
}

async fn socketless(args: &ConnsArgs) -> anyhow::Result<()> {
    crate::alloc::enable();
    let broker = warren_runtime::BrokerHandle::start(warren_runtime::BrokerConfig::default());
    let registry = Arc::new(warren_mqtt::Registry::new());
    let mqtt_config = Arc::new(warren_mqtt::MqttConfig::default());
    let amqp_config = Arc::new(warren_amqp::AmqpConfig::default());
    let (stop_tx, stop) = watch::channel(false);
    let open = |i: usize| {
        let (mut client, server) = tokio::io::duplex(DUPLEX_BUF);
        let addr = "in-process".to_string();
        match args.protocol {
            Protocol::Mqtt => tokio::spawn(warren_mqtt::serve_connection(
                server,
                warren_mqtt::PeerInfo {
                    addr,
                    is_loopback: true,
                    identity: None,
                    tls: false,
                },
                broker.clone(),
                registry.clone(),
                mqtt_config.clone(),
                stop.clone(),
            )),
            Protocol::Amqp => tokio::spawn(warren_amqp::serve_connection(
                server,
                warren_amqp::PeerInfo {
                    addr,
                    is_loopback: true,
                    identity: None,
                    tls: false,
                },
                broker.clone(),
                amqp_config.clone(),
                stop.clone(),
            )),
        };
        let id = format!("{}{i}", args.prefix);
        let (protocol, sub, keep_alive) = (args.protocol, subscription(args), args.keep_alive);
        let (version, persistent) = (args.mqtt_version, args.persistent);
        async move {
            let steps = greet(
                &mut client,
                protocol,
                &id,
                keep_alive,
                sub,
                version,
                persistent,
            )
            .await?;
            anyhow::Ok((client, steps))
        }
    };

    let n = args.connections;
    let mut conns = Vec::with_capacity(n + WARM_UP);
    // The first connection shows what a handshake writes, so the transport's own cost can be
    // measured with the same bytes.
    let (first, steps) = open(0).await?;
    conns.push(first);
    let transport = transport_cost(n, &steps).await?;
    open_all(WARM_UP - 1, 1, args.concurrency, None, &mut conns, open).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let heap_before = crate::alloc::live();
    let rss_before = rss(None)?;

    let bar = progress(n as u64, "connecting");
    let started = Instant::now();
    open_all(n, WARM_UP, args.concurrency, Some(&bar), &mut conns, open).await?;
    let connect_time = started.elapsed();
    bar.finish_and_clear();
    // Let the broker task apply the last ops before reading.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let heap_after = crate::alloc::live();
    let rss_after = rss(None)?;

    let (alive, conns) = ping_all(conns, args.protocol, args.concurrency).await;
    let _ = stop_tx.send(true);
    let heap = per_conn(heap_after - heap_before, n);
    let rows = vec![
        (
            "broker",
            format!(
                "in-process, real {} gateway over in-memory streams",
                match args.protocol {
                    Protocol::Mqtt => "MQTT",
                    Protocol::Amqp => "AMQP",
                }
            ),
        ),
        (
            "connections",
            format!("{n} (+{WARM_UP} warm-up), {}", what_each(args)),
        ),
        (
            "connects/s",
            format!(
                "{:.0} ({n} in {:.2} s)",
                n as f64 / connect_time.as_secs_f64(),
                connect_time.as_secs_f64()
            ),
        ),
        (
            "heap per connection",
            format!(
                "{:.0} bytes broker ({heap:.0} counted - {transport:.0} in-memory transport)",
                heap - transport
            ),
        ),
        (
            "RSS per connection",
            format!(
                "{:.0} bytes incl. transport ({:.1} MiB -> {:.1} MiB)",
                per_conn(rss_after as i64 - rss_before as i64, n),
                rss_before as f64 / 1048576.0,
                rss_after as f64 / 1048576.0
            ),
        ),
        ("alive at the end", format!("{alive}/{}", n + WARM_UP)),
    ];
    println!("warren-bench conns --socketless");
    table(&rows);
    ensure!(
        alive == n + WARM_UP,
        "{} connections did not answer PINGREQ",
        n + WARM_UP - alive
    );
    // Dropping a million streams one by one takes a while and proves nothing more.
    std::mem::forget(conns);
    Ok(())
}
