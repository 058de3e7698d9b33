//! Loads the broker core as a `.wasm` module under wasmtime and runs a publish/consume
//! scenario through the byte ABI, printing every effect. The same ops go to the native core
//! too, and the two effect streams are compared byte for byte.
//!
//! ```text
//! cargo build -p warren-guest --target wasm32-unknown-unknown --release
//! cargo run -p warren-wasmtime-host [path/to/warren_guest.wasm]
//! ```

use bytes::Bytes;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use warren_core::command::{Bind, Consume, ExchangeDeclare, Op, Publish, QueueDeclare};
use warren_core::effect::Effect;
use warren_core::message::{FieldTable, FieldValue, Properties};
use warren_guest::GuestBroker;
use warren_guest::codec::{Decoded, decode_effects, encode_op};
use warren_wasmtime_host::{GuestModule, HostError, guest_wasm_path};

fn scenario() -> Vec<(u16, Op)> {
    let mut ops = vec![
        (
            0,
            Op::ConnectionOpen {
                vhost: "/".into(),
                user: "guest".into(),
                cancel_notify: true,
            },
        ),
        (1, Op::ChannelOpen),
        (
            1,
            Op::ExchangeDeclare(ExchangeDeclare {
                exchange: "sensors".into(),
                kind: "topic".into(),
                passive: false,
                durable: false,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::new(),
            }),
        ),
    ];
    for (queue, pattern) in [("kitchen", "kitchen.#"), ("temperatures", "*.temperature")] {
        ops.push((
            1,
            Op::QueueDeclare(QueueDeclare {
                queue: queue.into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::new(),
            }),
        ));
        ops.push((
            1,
            Op::QueueBind(Bind {
                destination: queue.into(),
                source: "sensors".into(),
                routing_key: pattern.into(),
                nowait: false,
                arguments: FieldTable::new(),
            }),
        ));
    }
    for (key, body) in [
        ("kitchen.temperature", "21.5"),
        ("kitchen.humidity", "40"),
        ("garage.temperature", "12.0"),
    ] {
        let headers = [("unit".to_string(), FieldValue::string("C"))].into();
        ops.push((
            1,
            Op::Publish(Box::new(Publish {
                exchange: Arc::from("sensors"),
                routing_key: Arc::from(key),
                mandatory: false,
                immediate: false,
                properties: Properties {
                    content_type: Some("text/plain".into()),
                    headers: Some(headers),
                    ..Properties::default()
                },
                body: Bytes::from_static(body.as_bytes()),
                routed: None,
            })),
        ));
    }
    for queue in ["kitchen", "temperatures"] {
        ops.push((
            1,
            Op::Consume(Consume {
                queue: queue.into(),
                consumer_tag: format!("{queue}-reader"),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::new(),
            }),
        ));
    }
    // Deliveries 1..=4 (two per queue): ack them all at once.
    ops.push((
        1,
        Op::Ack {
            delivery_tag: 4,
            multiple: true,
        },
    ));
    ops
}

fn describe(e: &Decoded) -> String {
    match e {
        Decoded::Effect(Effect::Deliver {
            consumer_tag,
            delivery,
            ..
        }) => format!(
            "deliver  {consumer_tag:16} tag {} {:22} {:?}",
            delivery.delivery_tag,
            delivery.message.routing_key,
            String::from_utf8_lossy(&delivery.message.body)
        ),
        Decoded::Effect(Effect::Reply { reply, .. }) => format!("reply    {reply:?}"),
        other => format!("{other:?}"),
    }
}

fn run(path: PathBuf) -> Result<bool, HostError> {
    let module = GuestModule::load(&path)?;
    let mut wasm = module.instantiate(1)?;
    let mut native = GuestBroker::new(1);
    let conn = 1;
    let (mut op, mut wasm_fx) = (Vec::new(), Vec::new());
    let mut identical = true;
    let mut delivered = 0;
    for (now, (channel, o)) in (1u64..).zip(scenario()) {
        op.clear();
        encode_op(&o, &mut op);
        let status = wasm.handle(now, conn, channel.into(), &op)?;
        assert_eq!(status, 0, "the guest refused a valid op");
        wasm_fx.clear();
        wasm.poll_effects(&mut wasm_fx)?;
        native
            .handle(now, conn, channel.into(), &op)
            .expect("a valid op");
        identical &= native.poll_effects() == wasm_fx.as_slice();
        let effects = match decode_effects(&wasm_fx) {
            Ok(e) => e,
            Err(e) => {
                eprintln!("undecodable effect batch from the guest: {e}");
                return Ok(false);
            }
        };
        for e in &effects {
            delivered += usize::from(matches!(e, Decoded::Effect(Effect::Deliver { .. })));
            println!("[wasm] {}", describe(e));
        }
    }
    println!(
        "{delivered} deliveries; guest memory {} KiB; invariants {}; native effect bytes {}",
        wasm.memory_size() / 1024,
        if wasm.invariants_hold()? {
            "hold"
        } else {
            "BROKEN"
        },
        if identical { "identical" } else { "DIFFERENT" }
    );
    Ok(identical && delivered == 4 && wasm.invariants_hold()?)
}

fn main() -> ExitCode {
    let path = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(guest_wasm_path);
    match run(path) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
