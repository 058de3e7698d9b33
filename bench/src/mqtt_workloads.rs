//! The MQTT workloads (brief: QoS 0/1/2 one-to-one, fan-in, fan-out): publishers pipeline
//! PUBLISHes on one topic under an in-flight window (QoS 1/2, like a Receive Maximum),
//! subscribers ack as MQTT requires; timestamps in the payload give the latency.

use super::mqtt_client::{
    MqttConn, PUBACK, PUBCOMP, PUBLISH, PUBREC, PUBREL, PublishTemplate, Target, packet_id,
    publish_stamp, put_ack,
};
use super::report::{Histogram, Row};
use super::runner::{self, Counters, Pace, Recorder, Task, Timeline, now_nanos};
use super::workloads::BATCH_BYTES;
use anyhow::{Context, bail};
use bytes::Buf;
use futures::future::OptionFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};

/// Packet ids are 16-bit: a window above half of them could collide with slow acks.
pub const MAX_WINDOW: u32 = 32_768;

#[derive(Clone)]
pub struct MqttOptions {
    pub target: Target,
    pub seconds: u64,
    pub size: usize,
    /// QoS of fan-in and fan-out (the one-to-one workloads name theirs).
    pub qos: u8,
    /// Publishers of fan-in, subscribers of fan-out.
    pub fan: usize,
    /// QoS 1/2 messages in flight per publisher.
    pub window: u32,
    pub rate: u64,
    /// `--lead`: at most this many messages published and not yet received (0: no bound).
    pub lead: u64,
    pub count: u64,
    pub broker_pid: Option<u32>,
}

pub const WORKLOADS: [&str; 5] = [
    "mqtt-qos0",
    "mqtt-qos1",
    "mqtt-qos2",
    "mqtt-fan-in",
    "mqtt-fan-out",
];

/// Runs `workload` (one of WORKLOADS, or "all" for every one).
pub async fn run(workload: &str, o: &MqttOptions) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for name in WORKLOADS {
        if workload != "all" && workload != name {
            continue;
        }
        let (qos, publishers, subscribers) = match name {
            "mqtt-qos0" => (0, 1, 1),
            "mqtt-qos1" => (1, 1, 1),
            "mqtt-qos2" => (2, 1, 1),
            "mqtt-fan-in" => (o.qos, o.fan, 1),
            _ => (o.qos, 1, o.fan),
        };
        let label = if name.starts_with("mqtt-fan") {
            format!("{name} qos{qos}")
        } else {
            name.to_string()
        };
        rows.push(execute(label, qos, publishers, subscribers, o).await?);
    }
    Ok(rows)
}

async fn execute(
    name: String,
    qos: u8,
    publishers: usize,
    subscribers: usize,
    o: &MqttOptions,
) -> anyhow::Result<Row> {
    let id = format!("wb{}-{}", std::process::id(), name.replace(' ', "-"));
    let topic = format!("warren-bench/{id}");
    let counters = Arc::new(Counters::default());
    let timeline = Timeline::new(o.seconds);
    // Subscribers first, so no message is published before every one is listening.
    let mut subs = Vec::new();
    for i in 0..subscribers {
        let c = MqttConn::connect(&o.target, &format!("{id}-sub{i}"), Some((&topic, qos))).await?;
        subs.push(c);
    }
    let mut pubs = Vec::new();
    for i in 0..publishers {
        pubs.push(MqttConn::connect(&o.target, &format!("{id}-pub{i}"), None).await?);
    }
    let tpl = Arc::new(PublishTemplate::new(&topic, qos, o.size)?);
    let until = (o.count > 0).then_some(o.count * publishers as u64);
    let window = o.window.clamp(1, MAX_WINDOW);
    let lead = (o.lead > 0).then(|| {
        Arc::new(Lead {
            limit: o.lead,
            publishers: publishers as u64,
            subscribers: subscribers as u64,
            published: AtomicU64::new(0),
            progress: Notify::new(),
        })
    });
    let start = Instant::now();
    let deadline = start + Duration::from_secs(o.seconds);
    let mut tasks: Vec<Task> = Vec::new();
    for c in subs {
        let (counters, rec) = (counters.clone(), Recorder::new(timeline.clone()));
        let lead = lead.clone();
        tasks.push(tokio::spawn(async move {
            subscribe_loop(c, counters, lead, rec, deadline, until)
                .await
                .map(Some)
        }));
    }
    for c in pubs {
        let (counters, tpl, lead) = (counters.clone(), tpl.clone(), lead.clone());
        let pace = Pace::new(o.rate, o.count);
        tasks.push(tokio::spawn(async move {
            publish_loop(c, &tpl, qos, window, pace, counters, lead, deadline)
                .await
                .map(|()| None)
        }));
    }
    Ok(runner::supervise(
        name,
        (start, deadline),
        o.broker_pid,
        &counters,
        &timeline,
        tasks,
    )
    .await)
}

/// `--lead`: publishers stay at most `limit` messages ahead of the subscribers' receipts
/// (a copy to each of N subscribers counts 1/N). A broker that acknowledges faster than it
/// delivers (QoS 0 has no acknowledgement at all; rumqttd answers PUBACK once a message is
/// in its log) otherwise builds a backlog without bound, and the run measures that
/// backlog's growth, not a rate the broker sustains.
struct Lead {
    limit: u64,
    publishers: u64,
    subscribers: u64,
    /// Messages put in the publishers' write buffers.
    published: AtomicU64,
    /// Woken when subscribers receive.
    progress: Notify,
}

impl Lead {
    /// Messages one publisher may add now: its share of the room, so that publishers
    /// that look at once overshoot the limit by at most one message each.
    fn room(&self, counters: &Counters) -> u64 {
        let received = counters.received.load(Ordering::Relaxed) / self.subscribers.max(1);
        let ahead = self
            .published
            .load(Ordering::Relaxed)
            .saturating_sub(received);
        self.limit
            .saturating_sub(ahead)
            .div_ceil(self.publishers.max(1))
    }
}

/// Packet ids in use: a bitset over all 65,536 (8 KiB), so an id is never reused while its
/// message is unacknowledged, whatever order the acks come in.
struct PacketIds {
    used: Vec<u64>,
    next: u16,
    in_flight: u32,
}

impl PacketIds {
    fn new() -> PacketIds {
        PacketIds {
            used: vec![0; 1024],
            next: 0,
            in_flight: 0,
        }
    }

    /// A free id (never 0); the window keeps at least half of them free.
    fn take(&mut self) -> u16 {
        loop {
            self.next = self.next.wrapping_add(1).max(1);
            let (w, b) = (usize::from(self.next / 64), self.next % 64);
            if self.used[w] & (1 << b) == 0 {
                self.used[w] |= 1 << b;
                self.in_flight += 1;
                return self.next;
            }
        }
    }

    /// Frees `id`; false if it was not in flight (a stray or duplicate ack).
    fn release(&mut self, id: u16) -> bool {
        let (w, b) = (usize::from(id / 64), id % 64);
        let was = self.used[w] & (1 << b) != 0;
        self.used[w] &= !(1 << b);
        self.in_flight -= u32::from(was);
        was
    }
}

/// Publishes until the deadline (or `--count`), writing and reading acks concurrently in one
/// task: QoS 1 frees an id on PUBACK, QoS 2 answers PUBREC with PUBREL and frees on PUBCOMP.
#[allow(clippy::too_many_arguments)] // one call site; a struct would only rename them
async fn publish_loop(
    mut c: MqttConn,
    tpl: &PublishTemplate,
    qos: u8,
    window: u32,
    pace: Pace,
    counters: Arc<Counters>,
    lead: Option<Arc<Lead>>,
    deadline: Instant,
) -> anyhow::Result<()> {
    let mut ids = PacketIds::new();
    let mut published = 0u64;
    // Messages in the write buffer not yet fully handed to the socket: counted as sent once
    // the buffer empties, so that `sent` never counts bytes the broker could not have.
    let mut unwritten = 0u64;
    // Written but not flushed yet.
    let mut dirty = false;
    loop {
        while let Some((h, body)) = c.rx.try_packet()? {
            let kind = h >> 4;
            if !matches!(kind, PUBACK | PUBREC | PUBCOMP) {
                continue;
            }
            let id = packet_id(h, &body).context("short ack from the broker")?;
            match (qos, kind) {
                (1, PUBACK) | (2, PUBCOMP) => {
                    if !ids.release(id) {
                        bail!("ack for packet id {id}, which is not in flight");
                    }
                }
                (2, PUBREC) => put_ack(&mut c.wbuf, PUBREL, id),
                _ => bail!("unexpected packet {h:#04x} for a QoS {qos} publish"),
            }
        }
        // Registered before the room is read, so a receipt in between still wakes us.
        let progress = lead.as_ref().map(|l| l.progress.notified());
        tokio::pin!(progress);
        if let Some(p) = progress.as_mut().as_pin_mut() {
            p.enable();
        }
        let mut room = pace.room(published);
        if qos > 0 {
            room = room.min(u64::from(window.saturating_sub(ids.in_flight)));
        }
        let mut led = false;
        if let Some(l) = &lead {
            let r = l.room(&counters);
            led = r == 0;
            room = room.min(r);
        }
        let before = published;
        while room > 0 && c.wbuf.len() < BATCH_BYTES {
            let id = if qos > 0 { ids.take() } else { 0 };
            tpl.put(&mut c.wbuf, id, now_nanos());
            published += 1;
            unwritten += 1;
            room -= 1;
        }
        if let Some(l) = &lead {
            l.published.fetch_add(published - before, Ordering::Relaxed);
        }
        if pace.done(published) && c.wbuf.is_empty() {
            break;
        }
        let paced = pace.room(published) == 0 && !pace.done(published);
        // A write is followed by a flush (TLS and WebSocket hold written bytes until then;
        // for TCP it is a no-op); each step on its own is cancel safe.
        let (wr, wbuf) = (&mut c.wr, &c.wbuf);
        let step = async move {
            if dirty {
                wr.flush().await.map(|()| None)
            } else {
                wr.write(wbuf).await.map(Some)
            }
        };
        tokio::select! {
            r = step, if dirty || !c.wbuf.is_empty() => match r? {
                None => dirty = false,
                Some(n) => {
                    dirty = true;
                    c.wbuf.advance(n);
                    if c.wbuf.is_empty() {
                        counters.sent.fetch_add(unwritten, Ordering::Relaxed);
                        unwritten = 0;
                    }
                }
            },
            r = c.rx.fill() => r?,
            _ = sleep_until(pace.next_due(published)), if paced => {}
            Some(()) = OptionFuture::from(progress.as_pin_mut()), if led => {}
            _ = sleep_until(deadline) => break,
        }
    }
    if c.wbuf.is_empty() {
        c.disconnect().await?;
    }
    // Else a write was cut off mid-packet: just drop the connection.
    Ok(())
}

async fn subscribe_loop(
    mut c: MqttConn,
    counters: Arc<Counters>,
    lead: Option<Arc<Lead>>,
    mut rec: Recorder,
    deadline: Instant,
    until: Option<u64>,
) -> anyhow::Result<Histogram> {
    let mut hist = Histogram::default();
    let mut received = 0u64;
    loop {
        let mut batch = 0u64;
        while let Some((h, body)) = c.rx.try_packet()? {
            match h >> 4 {
                PUBLISH => {
                    batch += 1;
                    if let Some(stamp) = publish_stamp(h, &body) {
                        let now = now_nanos();
                        let us = now.saturating_sub(stamp) / 1000;
                        hist.record(us);
                        rec.latency(now, us);
                    }
                    match (h >> 1) & 3 {
                        0 => {}
                        q => {
                            let id = packet_id(h, &body).context("short PUBLISH")?;
                            put_ack(&mut c.wbuf, if q == 1 { PUBACK } else { PUBREC }, id);
                        }
                    }
                }
                PUBREL => {
                    let id = packet_id(h, &body).context("short PUBREL")?;
                    put_ack(&mut c.wbuf, PUBCOMP, id);
                }
                _ => {}
            }
        }
        if batch > 0 {
            received += batch;
            counters.received.fetch_add(batch, Ordering::Relaxed);
            if let Some(l) = &lead {
                l.progress.notify_waiters();
            }
            rec.received(now_nanos(), batch);
        }
        tokio::select! {
            r = c.flush() => r?,
            _ = sleep_until(deadline) => return Ok(hist),
        }
        if until.is_some_and(|n| received >= n) {
            break;
        }
        tokio::select! {
            r = c.rx.fill() => r?,
            _ = sleep_until(deadline) => break,
        }
    }
    c.disconnect().await?;
    Ok(hist)
}
