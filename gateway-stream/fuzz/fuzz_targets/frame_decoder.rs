//! Feeds arbitrary bytes to the frame splitter and decoder with a small and a large
//! frame-max, and every decoded Deliver chunk to the chunk verifier: none may panic, whatever
//! they return.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use warren_stream::codec::{self, Frame};
use warren_stream::frame::split_frame;

fuzz_target!(|data: &[u8]| {
    for max in [64, 8192, 0] {
        let mut buf = BytesMut::from(data);
        while let Ok(Some(body)) = split_frame(&mut buf, max) {
            if let Ok(Frame::Deliver { chunk, .. }) = codec::decode(body) {
                let _ = warren_stream::chunk::verify(&chunk);
            }
        }
    }
});
