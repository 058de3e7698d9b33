//! Sub-entry batching (the stream clients' `subEntrySize` / `compression` producer option)
//! against the `warren` binary, over raw frames built per the protocol, checked against
//! RabbitMQ 3.10.8 with the same frames: sub-batches (uncompressed and gzip) stored as one
//! entry of their records and delivered as written, their records counted in offsets,
//! deduplicated by publishing id, readable record by record over AMQP; large frames cut into
//! chunks of at most 256 entries (consumer credit counts chunks).

use futures::StreamExt;
use std::io::Write;
use std::time::Duration;
use warren_stream::chunk::{ChunkHeader, Entry};
use warren_stream::codec::{Frame, OffsetSpec, PublishedMessage};
use warren_stream::frame::{Reader, code};

mod common;
use common::Killed;
#[path = "common/stream_raw.rs"]
mod stream_raw;
use stream_raw::Raw;

const NONE: u8 = 0;
const GZIP: u8 = 1;
const SNAPPY: u8 = 2;

fn simple_entries(records: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in records {
        out.extend_from_slice(&(r.len() as u32).to_be_bytes());
        out.extend_from_slice(r.as_bytes());
    }
    out
}

/// A sub-batch of `records` as a client builds it.
fn sub_batch(id: u64, compression: u8, records: &[&str]) -> PublishedMessage {
    let plain = simple_entries(records);
    let data = if compression == GZIP {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(&plain).unwrap();
        e.finish().unwrap()
    } else {
        plain.clone()
    };
    PublishedMessage {
        publishing_id: id,
        filter_value: None,
        entry: warren_stream::codec::Entry::SubBatch {
            compression,
            count: records.len() as u16,
            uncompressed_size: plain.len() as u32,
            data: data.into(),
        },
    }
}

fn simple(id: u64, body: &str) -> PublishedMessage {
    PublishedMessage {
        publishing_id: id,
        filter_value: None,
        entry: warren_stream::codec::Entry::Simple(body.as_bytes().to_vec().into()),
    }
}

/// The frame the tests publish: a message, a plain sub-batch, a gzip'd one, a message.
fn frame() -> Vec<PublishedMessage> {
    vec![
        simple(1, "a"),
        sub_batch(2, NONE, &["b1", "b22", "b333"]),
        sub_batch(3, GZIP, &["c1", "c22", "c333"]),
        simple(4, "d"),
    ]
}

/// Every record in offset order.
const RECORDS: [&str; 8] = ["a", "b1", "b22", "b333", "c1", "c22", "c333", "d"];

async fn request(c: &mut Raw, f: Frame) -> u16 {
    c.request(f).await
}

async fn publish(c: &mut Raw, messages: Vec<PublishedMessage>) -> Option<Frame> {
    c.send(&Frame::Publish {
        v2: false,
        publisher_id: 1,
        messages,
    })
    .await;
    c.recv().await
}

fn confirm(ids: &[u64]) -> Option<Frame> {
    Some(Frame::PublishConfirm {
        publisher_id: 1,
        publishing_ids: ids.to_vec(),
    })
}

/// (chunk id, entries, records, entries as stored) of the Deliver frames from offset 0 with
/// `credit`, until none comes for 300 ms, granting one credit per chunk.
async fn chunks(c: &mut Raw, stream: &str, credit: u16) -> Vec<(u64, u16, u32, Vec<Entry>)> {
    let r = request(
        c,
        Frame::Subscribe {
            corr: 20,
            subscription_id: 1,
            stream: stream.into(),
            offset: OffsetSpec::First,
            credit,
            properties: vec![],
        },
    )
    .await;
    assert_eq!(r, code::OK);
    let mut got = Vec::new();
    while let Some(f) = c.recv_within(Duration::from_millis(300)).await {
        let Frame::Deliver { chunk, .. } = f else {
            panic!("a delivery, got {f:?}");
        };
        let h = ChunkHeader::parse(&chunk).expect("a chunk header");
        let mut r = Reader::new(chunk.slice(48..));
        let mut entries = Vec::new();
        while !r.is_empty() {
            entries.push(Entry::read(&mut r).expect("an entry"));
        }
        got.push((h.chunk_id, h.num_entries, h.num_records, entries));
        c.send(&Frame::Credit {
            subscription_id: 1,
            credit: 1,
        })
        .await;
    }
    got
}

/// The stream's records over AMQP (a stream queue consumer from `first`), with offsets.
async fn amqp_records(amqp: u16, stream: &str, n: usize) -> Vec<(i64, String)> {
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    let (_conn, ch) = common::channel(amqp).await;
    common::bounded(ch.basic_qos(100, BasicQosOptions::default()))
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-stream-offset"),
        AMQPValue::LongString("first".into()),
    );
    let mut consumer = common::bounded(ch.basic_consume(
        stream.into(),
        "".into(),
        BasicConsumeOptions::default(),
        args,
    ))
    .await
    .expect("consume");
    let mut got = Vec::new();
    while got.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery within 10 s")
            .expect("open")
            .expect("delivery");
        let offset = match d.properties.headers().as_ref().and_then(|h| {
            h.inner()
                .get(&ShortString::from("x-stream-offset"))
                .cloned()
        }) {
            Some(AMQPValue::LongLongInt(o)) => o,
            other => panic!("x-stream-offset, got {other:?}"),
        };
        got.push((offset, String::from_utf8_lossy(&d.data).into_owned()));
        common::bounded(d.acker.ack(BasicAckOptions::default()))
            .await
            .unwrap();
    }
    got
}

/// The checks over one broker: `fresh` when the stream is to be created and written.
async fn check(port: u16, amqp: u16, fresh: bool) {
    let mut c = Raw::open(port).await;
    if fresh {
        let r = request(
            &mut c,
            Frame::Create {
                corr: 10,
                stream: "batched".into(),
                arguments: vec![],
            },
        )
        .await;
        assert_eq!(r, code::OK);
    }
    let r = request(
        &mut c,
        Frame::DeclarePublisher {
            corr: 11,
            publisher_id: 1,
            reference: "w".into(),
            stream: "batched".into(),
        },
    )
    .await;
    assert_eq!(r, code::OK);
    if fresh {
        assert_eq!(publish(&mut c, frame()).await, confirm(&[1, 2, 3, 4]));
    }
    // Re-sent: confirmed, not stored again (RabbitMQ deduplicates a sub-batch by its id).
    assert_eq!(
        publish(&mut c, vec![sub_batch(3, GZIP, &["c1", "c22", "c333"])]).await,
        confirm(&[3])
    );
    // A codec this broker does not serve: PRECONDITION_FAILED for it, nothing stored.
    assert_eq!(
        publish(&mut c, vec![sub_batch(5, SNAPPY, &["x"])]).await,
        Some(Frame::PublishError {
            publisher_id: 1,
            errors: vec![(5, code::PRECONDITION_FAILED)]
        })
    );
    let mut s = Raw::open(port).await;
    let got = chunks(&mut s, "batched", 10).await;
    // One chunk (the frame), 4 entries of 8 records, the sub-batches as published (the
    // client decompresses).
    let want_entries: Vec<Entry> = frame()
        .into_iter()
        .map(|m| match m.entry {
            warren_stream::codec::Entry::Simple(b) => Entry::Simple(b),
            warren_stream::codec::Entry::SubBatch {
                compression,
                count,
                uncompressed_size,
                data,
            } => Entry::SubBatch {
                compression,
                count,
                uncompressed_size,
                data,
            },
        })
        .collect();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].0, got[0].1, got[0].2), (0, 4, 8));
    assert!(
        got[0].3 == want_entries,
        "stored as written: {:?}",
        got[0].3
    );
    c.send(&Frame::QueryPublisherSequence {
        corr: 12,
        reference: "w".into(),
        stream: "batched".into(),
    })
    .await;
    assert!(
        matches!(
            c.recv().await,
            Some(Frame::QueryPublisherSequenceResponse {
                code: code::OK,
                sequence: 4,
                ..
            })
        ),
        "the last publishing id stored"
    );
    let want: Vec<(i64, String)> = RECORDS
        .iter()
        .enumerate()
        .map(|(i, r)| (i as i64, r.to_string()))
        .collect();
    assert_eq!(amqp_records(amqp, "batched", 8).await, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_batches_are_stored_as_published_counted_in_offsets_and_deduplicated() {
    let dir = common::scratch_dir("stream-sub-batches", "disk");
    let served = common::serve(&dir, false, &["--stream", "127.0.0.1:0"]);
    let (port, amqp) = (served.stream.expect("stream port"), served.amqp);
    let served = Killed(served);
    check(port, amqp, true).await;
    drop(served);
    // After kill -9: the same chunk, offsets and publisher sequence.
    let served = common::serve(&dir, false, &["--stream", "127.0.0.1:0"]);
    let (port, amqp) = (served.stream.expect("stream port"), served.amqp);
    let served = Killed(served);
    check(port, amqp, false).await;
    drop(served);
    let served = common::serve(&dir, false, &["--stream", "127.0.0.1:0", "--in-memory"]);
    let (port, amqp) = (served.stream.expect("stream port"), served.amqp);
    let served = Killed(served);
    check(port, amqp, true).await;
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One Publish frame of 500 messages is several chunks of at most 256 entries, so a consumer
/// with credit 1 gets one chunk per credit (RabbitMQ 3.10.8 wrote it as 6 chunks of 9 to 256
/// entries); before, it was one chunk of 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_publish_frame_becomes_chunks_of_at_most_256_entries() {
    let dir = common::scratch_dir("stream-sub-batches", "bounded");
    for mode in [&[][..], &["--in-memory"][..]] {
        let mut args = vec!["--stream", "127.0.0.1:0"];
        args.extend_from_slice(mode);
        let served = common::serve(&dir, false, &args);
        let port = served.stream.expect("stream port");
        let served = Killed(served);
        let mut c = Raw::open(port).await;
        let r = request(
            &mut c,
            Frame::Create {
                corr: 10,
                stream: "big-frames".into(),
                arguments: vec![],
            },
        )
        .await;
        assert_eq!(r, code::OK);
        let r = request(
            &mut c,
            Frame::DeclarePublisher {
                corr: 11,
                publisher_id: 1,
                reference: String::new(),
                stream: "big-frames".into(),
            },
        )
        .await;
        assert_eq!(r, code::OK);
        let ids: Vec<u64> = (1..=500).collect();
        let messages = ids.iter().map(|&i| simple(i, &format!("m{i}"))).collect();
        let mut confirmed = Vec::new();
        c.send(&Frame::Publish {
            v2: false,
            publisher_id: 1,
            messages,
        })
        .await;
        while confirmed.len() < 500 {
            match c.recv().await {
                Some(Frame::PublishConfirm { publishing_ids, .. }) => {
                    confirmed.extend(publishing_ids)
                }
                other => panic!("confirms, got {other:?}"),
            }
        }
        let got = chunks(&mut c, "big-frames", 1).await;
        let sizes: Vec<(u64, u32)> = got.iter().map(|g| (g.0, g.2)).collect();
        assert_eq!(sizes, vec![(0, 256), (256, 244)], "{mode:?}");
        drop(served);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
