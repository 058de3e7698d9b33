//! Native vs wasm: seeded random scenarios run in the native core and in the `.wasm` module
//! under wasmtime; after every op the two effect batches must be byte-identical and the
//! core's invariants must hold on both sides.
//!
//! `#[ignore]` because it needs the module built first (`scripts/test.sh` does both):
//! ```text
//! cargo build -p warren-guest --target wasm32-unknown-unknown --release
//! cargo test -p warren-wasmtime-host --test differential -- --ignored
//! ```
//! Knobs: `WARREN_DIFF_SEEDS` (default 1000), `WARREN_DIFF_SEED` (replay one seed),
//! `WARREN_DIFF_STEPS` (ops per seed, default 300), `WARREN_GUEST_WASM` (module path).

use warren_guest::GuestBroker;
use warren_guest::codec::{decode_effects, encode_op, encode_policy};
use warren_guest::scenario::Scenario;
use warren_wasmtime_host::{GuestModule, guest_wasm_path};

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn load() -> GuestModule {
    let path = guest_wasm_path();
    // Loud on purpose: a missing module must fail CI, never skip the comparison.
    GuestModule::load(&path).unwrap_or_else(|e| panic!("cannot load the guest module: {e}"))
}

/// Runs one scenario on both sides (native naming seed `seed`, guest naming seed
/// `guest_seed`). Returns the number of effect bytes compared and of policy changes
/// applied, or a report of the first difference.
fn run(
    module: &GuestModule,
    seed: u64,
    guest_seed: u64,
    steps: u64,
) -> Result<(usize, u64), String> {
    let mut native = GuestBroker::new(seed);
    let mut wasm = module
        .instantiate(guest_seed)
        .map_err(|e| format!("instantiate: {e}"))?;
    let mut scenario = Scenario::new(seed);
    let (mut op, mut wasm_fx) = (Vec::new(), Vec::new());
    let mut compared = 0;
    let mut policies = 0u64;
    for i in 0..steps {
        // An operator's policy change, sometimes, between client ops: its effects (limits
        // dropping or dead-lettering messages, TTLs) must match too.
        if let Some(change) = scenario.next_policy() {
            op.clear();
            encode_policy(&change, &mut op);
            let now = scenario.now();
            let native_status = match native.policy(now, &op) {
                Ok(applied) => i32::from(!applied),
                Err(e) => e.status(),
            };
            let wasm_status = wasm
                .policy(now, &op)
                .map_err(|e| format!("step {i}: {change:?}: guest failed: {e}"))?;
            wasm_fx.clear();
            wasm.poll_effects(&mut wasm_fx)
                .map_err(|e| format!("step {i}: poll: {e}"))?;
            let native_fx = native.poll_effects();
            if native_status != wasm_status || native_fx != wasm_fx.as_slice() {
                return Err(format!(
                    "step {i}: {change:?}\n  native status {native_status}, effects {:?}\n  \
                     wasm   status {wasm_status}, effects {:?}",
                    decode_effects(native_fx),
                    decode_effects(&wasm_fx),
                ));
            }
            compared += native_fx.len() + 1;
            let effects =
                decode_effects(native_fx).map_err(|e| format!("step {i}: decode: {e}"))?;
            scenario.observe(&effects);
            policies += 1;
        }
        let step = scenario.next_step();
        op.clear();
        encode_op(&step.op, &mut op);
        // Time first, with no op: timers (TTL, queue expiry) must fire identically too.
        native.tick(step.now);
        wasm.tick(step.now)
            .map_err(|e| format!("step {i}: tick: {e}"))?;
        wasm_fx.clear();
        wasm.poll_effects(&mut wasm_fx)
            .map_err(|e| format!("step {i}: poll: {e}"))?;
        let native_fx = native.poll_effects();
        if native_fx != wasm_fx.as_slice() {
            return Err(format!(
                "step {i}: tick to {}\n  native effects {:?}\n  wasm   effects {:?}",
                step.now,
                decode_effects(native_fx),
                decode_effects(&wasm_fx),
            ));
        }
        compared += native_fx.len();
        let ticked = decode_effects(native_fx).map_err(|e| format!("step {i}: decode: {e}"))?;
        scenario.observe(&ticked);
        let channel = u32::from(step.channel);
        let native_status = match native.handle(step.now, step.conn, channel, &op) {
            Ok(()) => 0,
            Err(e) => e.status(),
        };
        let wasm_status = wasm
            .handle(step.now, step.conn, channel, &op)
            .map_err(|e| format!("step {i}: {step:?}: guest failed: {e}"))?;
        wasm_fx.clear();
        wasm.poll_effects(&mut wasm_fx)
            .map_err(|e| format!("step {i}: poll: {e}"))?;
        let native_fx = native.poll_effects();
        if native_status != wasm_status || native_fx != wasm_fx.as_slice() {
            return Err(format!(
                "step {i}: {step:?}\n  native status {native_status}, effects {:?}\n  \
                 wasm   status {wasm_status}, effects {:?}",
                decode_effects(native_fx),
                decode_effects(&wasm_fx),
            ));
        }
        compared += native_fx.len();
        let effects = decode_effects(native_fx).map_err(|e| format!("step {i}: decode: {e}"))?;
        scenario.observe(&effects);
        let deadlines = (
            native.next_deadline(),
            wasm.next_deadline().map_err(|e| format!("step {i}: {e}"))?,
        );
        if deadlines.0 != deadlines.1 {
            return Err(format!(
                "step {i}: next deadline native {} wasm {}",
                deadlines.0, deadlines.1
            ));
        }
        native
            .check_invariants()
            .map_err(|e| format!("step {i}: native invariants: {e}"))?;
        if !wasm
            .invariants_hold()
            .map_err(|e| format!("step {i}: {e}"))?
        {
            return Err(format!("step {i}: wasm invariants broken"));
        }
    }
    Ok((compared, policies))
}

#[test]
#[ignore = "needs the guest .wasm; scripts/test.sh builds it and runs this with --ignored"]
fn native_and_wasm_effect_streams_are_identical() {
    let module = load();
    let steps = env_u64("WARREN_DIFF_STEPS", 300);
    let seeds: Vec<u64> = match std::env::var("WARREN_DIFF_SEED") {
        Ok(_) => vec![env_u64("WARREN_DIFF_SEED", 0)],
        Err(_) => (0..env_u64("WARREN_DIFF_SEEDS", 1000)).collect(),
    };
    let (mut bytes, mut policies) = (0, 0);
    let mut failures = Vec::new();
    for &seed in &seeds {
        match run(&module, seed, seed, steps) {
            Ok((n, p)) => {
                bytes += n;
                policies += p;
            }
            Err(report) => {
                eprintln!(
                    "seed {seed} diverged at {report}\nreplay: WARREN_DIFF_SEED={seed} \
                     WARREN_DIFF_STEPS={steps} cargo test -p warren-wasmtime-host --test \
                     differential -- --ignored --nocapture"
                );
                failures.push(seed);
            }
        }
    }
    println!(
        "{} seeds x {steps} ops, {policies} policy changes: {bytes} effect bytes identical",
        seeds.len()
    );
    assert!(failures.is_empty(), "diverging seeds: {failures:?}");
    assert!(bytes > 0, "nothing compared");
    assert!(policies > 0 || steps < 100, "no policy change was compared");
}

/// The comparison is not vacuous: a guest with a different naming seed (so different
/// `amq.gen-`/`amq.ctag-` names) must be caught.
#[test]
#[ignore = "needs the guest .wasm; scripts/test.sh builds it and runs this with --ignored"]
fn a_different_guest_is_detected() {
    let module = load();
    let caught = (0..20)
        .filter(|&seed| run(&module, seed, seed ^ 0xdead_beef, 300).is_err())
        .count();
    assert!(
        caught > 0,
        "no seed told two differently seeded brokers apart"
    );
}

/// The guest refuses malformed ops with the same status as the native side, and survives.
#[test]
#[ignore = "needs the guest .wasm; scripts/test.sh builds it and runs this with --ignored"]
fn malformed_ops_get_the_native_status() {
    let module = load();
    let mut wasm = module.instantiate(1).expect("instantiate");
    let mut native = GuestBroker::new(1);
    for (channel, op) in [
        (0u32, &[0xee_u8][..]),
        (0, &[]),
        (70_000, &[0x03]),
        (0, &[0x02, 0]),
    ] {
        let n = native
            .handle(1, 1, channel, op)
            .map_or_else(|e| e.status(), |()| 0);
        let w = wasm.handle(1, 1, channel, op).expect("no trap");
        assert_eq!((n, w), (n, n), "op {op:?} on channel {channel}");
        assert_ne!(n, 0, "op {op:?} accepted");
    }
    // A big op (1 MiB body) grows the host's guest buffer and still matches.
    let mut op = Vec::new();
    encode_op(
        &warren_core::command::Op::ConnectionOpen {
            vhost: "/".repeat(1 << 20),
            user: "guest".into(),
            cancel_notify: true,
        },
        &mut op,
    );
    assert_eq!(wasm.handle(2, 2, 0, &op).expect("no trap"), 0);
    native.handle(2, 2, 0, &op).expect("valid op");
    let mut fx = Vec::new();
    wasm.poll_effects(&mut fx).expect("poll");
    assert_eq!(native.poll_effects(), fx.as_slice());
    assert!(fx.len() > 4, "a bad vhost must produce a connection error");
}
