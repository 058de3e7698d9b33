//! Feeds arbitrary bytes to the frame decoder with a small and a large frame_max: it must
//! never panic, whatever it returns.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for frame_max in [4096, 131_072] {
        let mut buf = BytesMut::from(data);
        while let Ok(Some(_)) = warren_amqp::codec::decode(&mut buf, frame_max) {}
    }
});
