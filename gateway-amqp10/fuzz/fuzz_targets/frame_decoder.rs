//! Feeds arbitrary bytes to the AMQP 1.0 frame decoder (and every frame body to the
//! performative decoder) with a small and a large max-frame-size: it must never panic,
//! whatever it returns.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for max in [512, 131_072] {
        let mut buf = BytesMut::from(data);
        while let Ok(Some(frame)) = warren_amqp10::frame::decode_frame(&mut buf, max) {
            let _ = frame.body();
        }
    }
    let _ = warren_amqp10::types::decode_value(data);
});
