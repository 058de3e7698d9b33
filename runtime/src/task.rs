//! The broker task: applies op batches to the core and routes effects to connections.

use crate::{Control, Request};
use std::collections::HashMap;
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep_until};
use warren_core::Broker;
use warren_core::command::Op;
use warren_core::effect::Effect;
use warren_core::ids::{ChannelRef, ConnId};

/// Request batches applied before effects are flushed: bounds the latency a busy broker adds
/// to replies while still amortising the flush over many publishes.
const BATCHES_PER_TURN: usize = 64;

pub(crate) async fn run(
    mut broker: Broker,
    mut requests: mpsc::Receiver<Request>,
    mut control: mpsc::UnboundedReceiver<Control>,
) {
    let epoch = Instant::now();
    let now_ms = |at: Instant| at.duration_since(epoch).as_millis() as u64;
    let mut conns: HashMap<ConnId, mpsc::UnboundedSender<Vec<Effect>>> = HashMap::new();
    let mut effects = Vec::new();
    let mut outboxes: HashMap<ConnId, Vec<Effect>> = HashMap::new();
    loop {
        let deadline = broker
            .next_deadline()
            .map(|ms| epoch + std::time::Duration::from_millis(ms));
        tokio::select! {
            biased;
            msg = control.recv() => match msg {
                Some(msg) => apply_control(&mut broker, &mut conns, msg, now_ms(Instant::now())),
                None => return,
            },
            req = requests.recv() => {
                let Some(req) = req else { return };
                // Registrations sent before these ops must be applied first.
                while let Ok(msg) = control.try_recv() {
                    apply_control(&mut broker, &mut conns, msg, now_ms(Instant::now()));
                }
                let now = now_ms(Instant::now());
                apply(&mut broker, &conns, req, now);
                for _ in 1..BATCHES_PER_TURN {
                    match requests.try_recv() {
                        Ok(req) => {
                            // A connection registered after the drain above may have sent
                            // this batch: its registration must be applied first too.
                            while let Ok(msg) = control.try_recv() {
                                apply_control(&mut broker, &mut conns, msg, now);
                            }
                            apply(&mut broker, &conns, req, now)
                        }
                        Err(_) => break,
                    }
                }
            }
            _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                broker.tick(now_ms(Instant::now()));
            }
        }
        broker.poll_effects(&mut effects);
        flush(&mut effects, &mut outboxes, &conns);
    }
}

fn apply_control(
    broker: &mut Broker,
    conns: &mut HashMap<ConnId, mpsc::UnboundedSender<Vec<Effect>>>,
    msg: Control,
    now: u64,
) {
    match msg {
        Control::Register { conn, effects } => {
            conns.insert(conn, effects);
        }
        Control::Disconnect(conn) => {
            if conns.remove(&conn).is_some() {
                broker.handle(now, ChannelRef::new(conn, 0), Op::ConnectionClose);
            }
        }
    }
}

fn apply(
    broker: &mut Broker,
    conns: &HashMap<ConnId, mpsc::UnboundedSender<Vec<Effect>>>,
    req: Request,
    now: u64,
) {
    if !conns.contains_key(&req.conn) {
        return;
    }
    for (channel, op) in req.ops {
        broker.handle(now, ChannelRef::new(req.conn, channel), op);
    }
}

fn flush(
    effects: &mut Vec<Effect>,
    outboxes: &mut HashMap<ConnId, Vec<Effect>>,
    conns: &HashMap<ConnId, mpsc::UnboundedSender<Vec<Effect>>>,
) {
    if effects.is_empty() {
        return;
    }
    for effect in effects.drain(..) {
        outboxes.entry(effect.conn()).or_default().push(effect);
    }
    for (conn, batch) in outboxes.iter_mut() {
        if batch.is_empty() {
            continue;
        }
        let batch = std::mem::take(batch);
        // A send fails only when the connection task is gone; its Disconnect follows and
        // releases the connection in the core.
        if let Some(tx) = conns.get(conn) {
            let _ = tx.send(batch);
        }
    }
    // Keep the map from growing with connections that come and go.
    if outboxes.len() > 1024 {
        outboxes.clear();
    }
}
