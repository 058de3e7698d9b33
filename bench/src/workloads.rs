//! The AMQP workloads: each is a plan (queues, producers, consumers) run for a fixed time
//! with the lean client, measured into one report row.

use super::client::{self, CH, Conn, PublishTemplate, Uri, check_close};
use super::report::{Histogram, Row};
use super::runner::{self, Counters, Pace, Recorder, Task, Timeline, now_nanos};
use amq_protocol::protocol::{AMQPClass, basic, connection};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};
use warren_amqp::codec::Frame;

/// Publish batches stop growing at this many bytes: large writes without unbounded buffers.
pub const BATCH_BYTES: usize = 64 * 1024;
/// fivers publishes at PerfTest's `-r 10000` per producer unless `--rate` says otherwise.
const FIVERS_RATE: u64 = 10_000;
/// many-queues' confirm window per producer unless `--confirm` says otherwise.
const MANY_QUEUES_CONFIRM: u32 = 100;

/// What every workload takes from the command line.
#[derive(Clone)]
pub struct Options {
    pub uri: Uri,
    pub seconds: u64,
    pub size: usize,
    pub confirm: u32,
    pub autoack: bool,
    pub prefetch: u16,
    pub persistent: bool,
    pub broker_pid: Option<u32>,
    /// Messages per second per producer (0: as fast as possible).
    pub rate: u64,
    /// Messages per producer (0: until the deadline).
    pub count: u64,
    /// Queues of many-queues.
    pub queues: usize,
    /// Consumers' acks: 0 = one per message (PerfTest's default), N = one `multiple` ack
    /// per N messages and at the end of each socket read.
    pub multi_ack_every: u64,
    /// Messages per socket write (0: as many as fit 64 KiB). The Java client flushes after
    /// every publish: 1 loads a broker as PerfTest does.
    pub flush_every: u64,
}

/// One run: which queues, who publishes where, who consumes what.
struct Plan {
    name: String,
    queues: Vec<String>,
    bind_to: Option<&'static str>,
    /// One producer per entry: (exchange, routing key).
    producers: Vec<(&'static str, String)>,
    /// How many producers' messages each consumer gets (for `--count`).
    fan_in: u64,
    rate: u64,
    confirm: u32,
    consumers: Vec<String>,
    prefetch: u16,
    autoack: bool,
    /// drain: stop once this many messages arrived.
    until: Option<u64>,
    latency: bool,
    keep_queues: bool,
}

fn queue_name(workload: &str, i: usize) -> String {
    format!("warren-bench-{workload}-{}-{i}", std::process::id())
}

/// The queue two-publishers fills and drain empties (shared between the two runs).
const BACKLOG: &str = "warren-bench-backlog";

fn one_fast(name: String, prefetch: u16, autoack: bool, confirm: u32, rate: u64) -> Plan {
    let q = queue_name("one-fast", 0);
    Plan {
        name,
        queues: vec![q.clone()],
        bind_to: None,
        producers: vec![("", q.clone())],
        fan_in: 1,
        rate,
        confirm,
        consumers: vec![q],
        prefetch,
        autoack,
        until: None,
        latency: true,
        keep_queues: false,
    }
}

pub async fn run(workload: &str, o: &Options) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let all = workload == "all";
    if all || workload == "one-fast" {
        let p = one_fast("one-fast".into(), o.prefetch, o.autoack, o.confirm, o.rate);
        rows.push(execute(p, o).await?);
    }
    if all || workload == "two-publishers" {
        rows.push(execute(two_publishers(o, "two-publishers"), o).await?);
    }
    if all || workload == "drain" {
        rows.push(drain(o).await?);
    }
    if all || workload == "fanout10" {
        let mut p = queue_per_producer("fanout10", 10, o.rate, o);
        p.bind_to = Some("amq.fanout");
        p.producers = vec![("amq.fanout", String::new())];
        rows.push(execute(p, o).await?);
    }
    if all || workload == "fivers" {
        // PerfTest's fivers, as the brief describes it: five queues, a producer and a
        // consumer each, 10k msg/s per producer (latency at 50k msg/s in all).
        let rate = if o.rate > 0 { o.rate } else { FIVERS_RATE };
        rows.push(execute(queue_per_producer("fivers", 5, rate, o), o).await?);
    }
    if all || workload == "many-queues" {
        // Without confirms, 100 unthrottled producers only fill their sockets' kernel
        // buffers (hundreds of MB "sent" that no broker has seen): confirm windows make the
        // producers move at the broker's pace.
        let mut p = queue_per_producer("many-queues", o.queues, o.rate, o);
        if p.confirm == 0 {
            p.confirm = MANY_QUEUES_CONFIRM;
        }
        rows.push(execute(p, o).await?);
    }
    if all || workload == "one-one-one" {
        // One message in flight: confirm window 1, acks (PerfTest's -c 1).
        let p = one_fast("one-one-one".into(), o.prefetch, false, 1, o.rate);
        rows.push(execute(p, o).await?);
    }
    if all || workload == "prefetch-sweep" {
        for prefetch in [1u16, 10, 100, 1000, 0] {
            let label = if prefetch == 0 {
                "unlimited".to_string()
            } else {
                prefetch.to_string()
            };
            let p = one_fast(
                format!("prefetch-sweep {label}"),
                prefetch,
                false,
                o.confirm,
                o.rate,
            );
            rows.push(execute(p, o).await?);
        }
    }
    Ok(rows)
}

/// `n` queues, each with its own producer and consumer.
fn queue_per_producer(name: &str, n: usize, rate: u64, o: &Options) -> Plan {
    let queues: Vec<String> = (0..n).map(|i| queue_name(name, i)).collect();
    Plan {
        name: name.into(),
        queues: queues.clone(),
        bind_to: None,
        producers: queues.iter().map(|q| ("", q.clone())).collect(),
        fan_in: 1,
        rate,
        confirm: o.confirm,
        consumers: queues,
        prefetch: o.prefetch,
        autoack: o.autoack,
        until: None,
        latency: true,
        keep_queues: false,
    }
}

fn two_publishers(o: &Options, name: &str) -> Plan {
    Plan {
        name: name.into(),
        queues: vec![BACKLOG.into()],
        bind_to: None,
        producers: vec![("", BACKLOG.into()); 2],
        fan_in: 2,
        rate: o.rate,
        confirm: o.confirm,
        consumers: vec![],
        prefetch: 0,
        autoack: false,
        until: None,
        latency: false,
        keep_queues: true,
    }
}

/// One consumer empties the backlog queue (filling it first, unmeasured, when empty), then
/// deletes it.
async fn drain(o: &Options) -> anyhow::Result<Row> {
    let mut ctl = Conn::open(&o.uri, "warren-bench control").await?;
    let mut count = ctl.declare_queue(BACKLOG, o.persistent).await?;
    if count == 0 {
        let fill = two_publishers(o, "drain (filling)");
        execute(fill, o).await?;
        count = ctl.declare_queue(BACKLOG, o.persistent).await?;
    }
    let plan = Plan {
        name: "drain".into(),
        queues: vec![BACKLOG.into()],
        bind_to: None,
        producers: vec![],
        fan_in: 0,
        rate: 0,
        confirm: 0,
        consumers: vec![BACKLOG.into()],
        prefetch: o.prefetch,
        autoack: o.autoack,
        until: Some(u64::from(count)),
        // The backlog's age, not the broker's latency: not reported.
        latency: false,
        keep_queues: false,
    };
    let row = execute(plan, o).await;
    ctl.close().await.ok();
    row
}

async fn execute(plan: Plan, o: &Options) -> anyhow::Result<Row> {
    let mut ctl = Conn::open(&o.uri, "warren-bench control").await?;
    for q in &plan.queues {
        ctl.declare_queue(q, o.persistent).await?;
        if let Some(x) = plan.bind_to {
            ctl.bind_queue(q, x).await?;
        }
    }
    let counters = Arc::new(Counters::default());
    let timeline = Timeline::new(o.seconds);
    // Set everything up before the clock starts: consumers first, so none of the first
    // messages wait in the queue.
    let mut consumers = Vec::new();
    for (i, q) in plan.consumers.iter().enumerate() {
        let mut c = Conn::open(&o.uri, &format!("warren-bench consumer {i}")).await?;
        c.consume(q, plan.prefetch, plan.autoack).await?;
        consumers.push(c);
    }
    let mut producers = Vec::new();
    for (i, (exchange, key)) in plan.producers.iter().enumerate() {
        let mut c = Conn::open(&o.uri, &format!("warren-bench producer {i}")).await?;
        if plan.confirm > 0 {
            c.confirm_select().await?;
        }
        let t = PublishTemplate::new(exchange, key, o.size, o.persistent, c.frame_max)?;
        producers.push((c, t));
    }
    // A count-bounded run ends when every consumer has what was sent to it.
    let until = plan
        .until
        .or((o.count > 0).then_some(o.count * plan.fan_in));
    let start = Instant::now();
    let deadline = start + Duration::from_secs(o.seconds);
    let mut tasks: Vec<Task> = Vec::new();
    for c in consumers {
        let counters = counters.clone();
        let rec = Recorder::new(timeline.clone());
        let latency = plan.latency;
        let acks = (!plan.autoack).then_some(o.multi_ack_every);
        tasks.push(tokio::spawn(async move {
            consume_loop(c, counters, rec, deadline, until, latency, acks)
                .await
                .map(Some)
        }));
    }
    for (c, t) in producers {
        let counters = counters.clone();
        let (confirm, pace) = (plan.confirm, Pace::new(plan.rate, o.count));
        let flush_every = o.flush_every;
        tasks.push(tokio::spawn(async move {
            publish_loop(c, t, confirm, pace, flush_every, counters, deadline)
                .await
                .map(|()| None)
        }));
    }
    let mut row = runner::supervise(
        plan.name,
        (start, deadline),
        o.broker_pid,
        &counters,
        &timeline,
        tasks,
    )
    .await;
    if !plan.latency {
        // drain: the backlog's age, not the broker's latency.
        row.latency = None;
    }
    if !plan.keep_queues {
        for q in &plan.queues {
            if let Err(e) = ctl.delete_queue(q).await {
                row.errors.push(format!("deleting {q}: {e:#}"));
            }
        }
    }
    ctl.close().await.ok();
    Ok(row)
}

/// Confirms as the broker sends them: `multiple` acks cover every tag up to theirs, single
/// ones may arrive out of order. Out-of-order tags wait in a set bounded by the window.
#[derive(Default)]
struct Confirms {
    done: AtomicU64,
    nacked: AtomicU64,
    notify: Notify,
}

async fn confirm_reader(mut rd: client::Reader, confirms: Arc<Confirms>) -> anyhow::Result<()> {
    let mut upto = 0u64;
    let mut pending = BTreeSet::new();
    loop {
        let (tag, multiple, nack) = match rd.frame().await? {
            Frame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                (a.delivery_tag, a.multiple, false)
            }
            Frame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(n))) => {
                (n.delivery_tag, n.multiple, true)
            }
            Frame::Method(_, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))) => {
                return Ok(());
            }
            Frame::Method(_, m) => {
                check_close(&m)?;
                continue;
            }
            _ => continue,
        };
        let before = upto + pending.len() as u64;
        if multiple {
            upto = upto.max(tag);
            pending = pending.split_off(&(upto + 1));
        } else if tag > upto {
            pending.insert(tag);
        }
        while pending.remove(&(upto + 1)) {
            upto += 1;
        }
        let after = upto + pending.len() as u64;
        if nack {
            confirms.nacked.fetch_add(after - before, Ordering::Relaxed);
        }
        confirms.done.store(after, Ordering::Release);
        confirms.notify.notify_one();
    }
}

async fn publish_loop(
    conn: Conn,
    tpl: PublishTemplate,
    window: u32,
    pace: Pace,
    flush_every: u64,
    counters: Arc<Counters>,
    deadline: Instant,
) -> anyhow::Result<()> {
    let Conn { rd, mut wr, .. } = conn;
    let confirms = Arc::new(Confirms::default());
    let mut reader = tokio::spawn(confirm_reader(rd, confirms.clone()));
    let mut batch_max = (BATCH_BYTES / tpl.wire_len()).max(1) as u64;
    if flush_every > 0 {
        batch_max = batch_max.min(flush_every);
    }
    let mut published = 0u64;
    // A write cut off at the deadline leaves half a frame on the wire: then we just drop the
    // connection instead of sending connection.close after it.
    let mut clean = true;
    while Instant::now() < deadline && !pace.done(published) {
        let mut n = batch_max.min(pace.room(published));
        if n == 0 {
            tokio::select! {
                _ = sleep_until(pace.next_due(published)) => continue,
                _ = sleep_until(deadline) => break,
            }
        }
        if window > 0 {
            let outstanding = published - confirms.done.load(Ordering::Acquire);
            let room = u64::from(window).saturating_sub(outstanding);
            if room == 0 {
                tokio::select! {
                    _ = confirms.notify.notified() => {}
                    _ = sleep_until(deadline) => break,
                    r = &mut reader => return r.map_err(anyhow::Error::from).and_then(|r| r)
                        .and_then(|()| Err(anyhow::anyhow!("the broker closed the connection"))),
                }
                continue;
            }
            n = n.min(room);
        }
        for _ in 0..n {
            tpl.put(&mut wr.buf, now_nanos());
        }
        // Counted when handed to the socket, so that `sent` is never below `received`.
        published += n;
        counters.sent.fetch_add(n, Ordering::Relaxed);
        tokio::select! {
            r = wr.flush() => r?,
            _ = sleep_until(deadline) => { clean = false; break; }
            r = &mut reader => return r.map_err(anyhow::Error::from).and_then(|r| r)
                .and_then(|()| Err(anyhow::anyhow!("the broker closed the connection"))),
        }
    }
    let nacked = confirms.nacked.load(Ordering::Relaxed);
    if clean {
        wr.buf.clear();
        client::close_with(&mut wr).await?;
        match tokio::time::timeout(Duration::from_secs(2), &mut reader).await {
            Ok(r) => r??,
            Err(_) => reader.abort(),
        }
    } else {
        reader.abort();
    }
    if nacked > 0 {
        anyhow::bail!("the broker nacked {nacked} messages");
    }
    Ok(())
}

async fn consume_loop(
    conn: Conn,
    counters: Arc<Counters>,
    mut rec: Recorder,
    deadline: Instant,
    until: Option<u64>,
    latency: bool,
    // None: automatic acks; Some(every) as `Options::multi_ack_every`.
    acks: Option<u64>,
) -> anyhow::Result<Histogram> {
    let Conn { mut rd, mut wr, .. } = conn;
    let mut hist = Histogram::default();
    let mut last_tag = 0u64;
    let mut acked = 0u64;
    let mut received = 0u64;
    // Bytes of the current message's body still to come; `first` marks its first body frame
    // (where the timestamp is).
    let mut remaining = 0u64;
    let mut first = false;
    let mut clean = true;
    'run: loop {
        let mut batch = 0u64;
        while let Some(f) = rd.try_frame()? {
            match f {
                Frame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => {
                    last_tag = d.delivery_tag;
                    match acks {
                        Some(0) => {
                            wr.ack(CH, last_tag, false);
                            acked = last_tag;
                        }
                        Some(n) if last_tag - acked >= n => {
                            wr.ack(CH, last_tag, true);
                            acked = last_tag;
                        }
                        _ => {}
                    }
                }
                Frame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Cancel(_))) => {
                    anyhow::bail!("the broker cancelled the consumer");
                }
                Frame::Method(_, m) => check_close(&m)?,
                Frame::Header(_, h) => {
                    remaining = h.body_size;
                    first = true;
                    if remaining == 0 {
                        batch += 1;
                    }
                }
                Frame::Body(_, b) => {
                    if first
                        && latency
                        && let Some(stamp) = b.get(..8)
                    {
                        let mut s = [0u8; 8];
                        s.copy_from_slice(stamp);
                        let now = now_nanos();
                        let us = now.saturating_sub(u64::from_be_bytes(s)) / 1000;
                        hist.record(us);
                        rec.latency(now, us);
                    }
                    first = false;
                    remaining = remaining.saturating_sub(b.len() as u64);
                    if remaining == 0 {
                        batch += 1;
                    }
                }
                Frame::Heartbeat(_) => {}
            }
        }
        received += batch;
        counters.received.fetch_add(batch, Ordering::Relaxed);
        if batch > 0 {
            rec.received(now_nanos(), batch);
        }
        // A `multiple` ack at the end of a read covers everything delivered so far.
        if acks.is_some_and(|n| n > 0) && last_tag > acked {
            wr.ack(CH, last_tag, true);
            acked = last_tag;
        }
        if !wr.buf.is_empty() {
            tokio::select! {
                r = wr.flush() => r?,
                _ = sleep_until(deadline) => { clean = false; break 'run; }
            }
        }
        if until.is_some_and(|n| received >= n) {
            break;
        }
        tokio::select! {
            r = rd.fill() => r?,
            _ = sleep_until(deadline) => break,
        }
    }
    if clean {
        wr.buf.clear();
        client::close_with(&mut wr).await?;
        // Deliveries still in flight are skipped until close-ok (bounded by the timeout).
        let wait = async {
            loop {
                if let Frame::Method(_, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))) =
                    rd.frame().await?
                {
                    return anyhow::Ok(());
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(2), wait)
            .await
            .ok();
    }
    Ok(hist)
}
