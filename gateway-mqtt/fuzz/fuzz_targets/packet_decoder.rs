//! Feeds arbitrary bytes to the packet decoder before CONNECT and at each protocol level, with
//! a small and a large maximum packet size: it must never panic, whatever it returns.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for level in [None, Some(3), Some(4), Some(5)] {
        for max in [64, 1 << 20] {
            let mut buf = BytesMut::from(data);
            while let Ok(Some(_)) = warren_mqtt::codec::decode(&mut buf, level, max) {}
        }
    }
});
