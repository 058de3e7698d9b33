//! Core throughput in wasmtime against native, same ops through the same byte ABI on both
//! sides (so the ratio measures the core compiled to wasm, not a different code path).
//!
//! ```text
//! cargo build -p warren-guest --target wasm32-unknown-unknown --release
//! cargo run --release -p warren-wasmtime-host --bin wasm-bench [messages]
//! ```
//! Workloads: `pubsub` (publish 100-byte messages to a queue with one consumer at prefetch
//! 100, ack every 50 with `multiple`), `random` (the differential test's random scenarios).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;
use warren_core::command::{Consume, Op, Publish, QueueDeclare};
use warren_core::message::{FieldTable, Properties};
use warren_guest::GuestBroker;
use warren_guest::codec::{decode_effects, encode_op};
use warren_guest::scenario::Scenario;
use warren_wasmtime_host::{GuestModule, HostError, WasmBroker, guest_wasm_path};

/// Either side, behind the same byte interface.
trait Side {
    fn op(&mut self, now: u64, conn: u64, channel: u16, op: &[u8]) -> Result<(), HostError>;
    /// Effect bytes of the last op (appended to `out`).
    fn effects(&mut self, out: &mut Vec<u8>) -> Result<(), HostError>;
}

impl Side for GuestBroker {
    fn op(&mut self, now: u64, conn: u64, channel: u16, op: &[u8]) -> Result<(), HostError> {
        self.handle(now, conn, channel.into(), op)
            .expect("the bench only sends valid ops");
        Ok(())
    }
    fn effects(&mut self, out: &mut Vec<u8>) -> Result<(), HostError> {
        out.extend_from_slice(self.poll_effects());
        Ok(())
    }
}

impl Side for WasmBroker {
    fn op(&mut self, now: u64, conn: u64, channel: u16, op: &[u8]) -> Result<(), HostError> {
        let status = self.handle(now, conn, channel.into(), op)?;
        assert_eq!(status, 0, "the guest refused a valid op");
        Ok(())
    }
    fn effects(&mut self, out: &mut Vec<u8>) -> Result<(), HostError> {
        self.poll_effects(out)
    }
}

fn enc(op: Op) -> Vec<u8> {
    let mut out = Vec::new();
    encode_op(&op, &mut out);
    out
}

/// Publishes `n` messages through a consumer with acks; returns (seconds, effect bytes).
fn pubsub(side: &mut dyn Side, n: u64) -> Result<(f64, usize), HostError> {
    let setup = [
        (
            0,
            enc(Op::ConnectionOpen {
                vhost: "/".into(),
                user: "guest".into(),
                cancel_notify: true,
            }),
        ),
        (1, enc(Op::ChannelOpen)),
        (
            1,
            enc(Op::QueueDeclare(QueueDeclare {
                queue: "bench".into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::new(),
            })),
        ),
        (
            1,
            enc(Op::Qos {
                prefetch_size: 0,
                prefetch_count: 100,
                global: false,
            }),
        ),
        (
            1,
            enc(Op::Consume(Consume {
                queue: "bench".into(),
                consumer_tag: "c".into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::new(),
            })),
        ),
    ];
    let mut out = Vec::new();
    for (ch, op) in &setup {
        side.op(0, 1, *ch, op)?;
        side.effects(&mut out)?;
    }
    let publish = enc(Op::Publish(Box::new(Publish {
        exchange: Arc::from(""),
        routing_key: Arc::from("bench"),
        mandatory: false,
        immediate: false,
        properties: Properties::default(),
        body: bytes::Bytes::from(vec![0x2a; 100]),
        routed: None,
    })));
    let written = enc(Op::Written { count: 50 });
    let start = Instant::now();
    let mut bytes = 0;
    for i in 1..=n {
        side.op(i, 1, 1, &publish)?;
        out.clear();
        side.effects(&mut out)?;
        bytes += out.len();
        if i % 50 == 0 {
            let ack = enc(Op::Ack {
                delivery_tag: i,
                multiple: true,
            });
            side.op(i, 1, 1, &ack)?;
            side.op(i, 1, 0, &written)?;
            out.clear();
            side.effects(&mut out)?;
            bytes += out.len();
        }
    }
    Ok((start.elapsed().as_secs_f64(), bytes))
}

/// Random scenarios (seeds 0..seeds, 300 ops each); the op stream is pre-generated so only
/// the broker is timed. Returns (seconds, ops).
fn random(
    side_for: &mut dyn FnMut(u64) -> Box<dyn Side>,
    seeds: u64,
) -> Result<(f64, u64), HostError> {
    let mut elapsed = 0.0;
    let mut ops = 0;
    for seed in 0..seeds {
        // Record the steps once with a native broker to feed the generator's feedback.
        let mut recorder = GuestBroker::new(seed);
        let mut sc = Scenario::new(seed);
        let mut steps = Vec::new();
        for _ in 0..300 {
            let s = sc.next_step();
            let op = enc(s.op);
            recorder
                .handle(s.now, s.conn, s.channel.into(), &op)
                .expect("valid op");
            let fx = decode_effects(recorder.poll_effects()).expect("valid effects");
            sc.observe(&fx);
            steps.push((s.now, s.conn, s.channel, op));
        }
        let mut side = side_for(seed);
        let mut out = Vec::new();
        let start = Instant::now();
        for (now, conn, channel, op) in &steps {
            side.op(*now, *conn, *channel, op)?;
            out.clear();
            side.effects(&mut out)?;
        }
        elapsed += start.elapsed().as_secs_f64();
        ops += steps.len() as u64;
    }
    Ok((elapsed, ops))
}

fn main() -> ExitCode {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    let module = match GuestModule::load(&guest_wasm_path()) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = (|| -> Result<(), HostError> {
        let (tn, bn) = pubsub(&mut GuestBroker::new(1), n)?;
        let (tw, bw) = pubsub(&mut module.instantiate(1)?, n)?;
        assert_eq!(bn, bw, "the two sides produced different effect volumes");
        let (rn, rw) = (n as f64 / tn, n as f64 / tw);
        println!(
            "pubsub  {n} msgs x 100 B: native {:>10.0} msg/s   wasmtime {:>10.0} msg/s   wasm/native {:.2}",
            rn,
            rw,
            rw / rn
        );
        let seeds = (n / 2000).max(10);
        let (tn, ops) = random(&mut |s| Box::new(GuestBroker::new(s)), seeds)?;
        let (tw, _) = random(
            &mut |s| Box::new(module.instantiate(s).expect("instantiate")),
            seeds,
        )?;
        let (rn, rw) = (ops as f64 / tn, ops as f64 / tw);
        println!(
            "random  {ops} ops:            native {:>10.0} op/s    wasmtime {:>10.0} op/s    wasm/native {:.2}",
            rn,
            rw,
            rw / rn
        );
        Ok(())
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
