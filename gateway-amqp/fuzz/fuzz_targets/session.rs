//! Drives a whole AMQP session with arbitrary bytes, cut into reads at arbitrary points, with
//! every login check granted and time moving on: it must never panic, whatever it answers.
//! The first byte chooses whether the input starts at the protocol header or right after an
//! open handshake (so the fuzzer reaches channel and content frames quickly).
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;
use warren_amqp::{AmqpConfig, Session};

/// protocol header, start-ok (PLAIN guest/guest), tune-ok (frame_max 4096, heartbeat 10 s),
/// connection.open "/".
fn handshake() -> Vec<u8> {
    let mut t = b"AMQP\x00\x00\x09\x01".to_vec();
    let frame = |t: &mut Vec<u8>, payload: &[u8]| {
        t.extend([1, 0, 0]);
        t.extend((payload.len() as u32).to_be_bytes());
        t.extend_from_slice(payload);
        t.push(0xCE);
    };
    let mut start_ok = vec![0, 10, 0, 11, 0, 0, 0, 0, 5];
    start_ok.extend(b"PLAIN");
    start_ok.extend(12u32.to_be_bytes());
    start_ok.extend(b"\0guest\0guest");
    start_ok.push(5);
    start_ok.extend(b"en_US");
    frame(&mut t, &start_ok);
    frame(&mut t, &[0, 10, 0, 31, 0, 16, 0, 0, 16, 0, 0, 10]);
    frame(&mut t, &[0, 10, 0, 40, 1, b'/', 0, 0]);
    t
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, data)) = data.split_first() else {
        return;
    };
    let mut s = Session::new(Arc::new(AmqpConfig::default()), None, "fuzz".into(), 0);
    let mut input = BytesMut::new();
    let mut now = 0u64;
    let mut feed = |s: &mut Session, bytes: &[u8], now: u64| {
        input.extend_from_slice(bytes);
        s.handle_input(now, &mut input);
        while s.take_login().is_some() {
            s.on_login(now, Ok(()));
            s.handle_input(now, &mut input);
        }
        s.output_written(now);
        let _ = s.take_ops();
    };
    if mode & 1 == 1 {
        feed(&mut s, &handshake(), now);
    }
    // Reads of 1..=64 bytes, their sizes taken from the mode byte's high bits and the data.
    let step = usize::from(mode >> 2) + 1;
    for chunk in data.chunks(step) {
        now += 250;
        feed(&mut s, chunk, now);
        if s.deadline().is_some_and(|d| d <= now) {
            s.on_timeout(now);
        }
        if s.ended().is_some() {
            break;
        }
    }
});
