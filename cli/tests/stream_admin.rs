//! `warren serve --stream` as operators and other connections see it, over raw frames
//! against the `warren` binary (each checked against RabbitMQ 3.10.8 with the same frames):
//! a stream declared again with other arguments, what clients are told to connect to and
//! StreamStats, MetadataUpdate to every connection using a deleted stream, stream
//! connections in the HTTP API and `warren ctl`, closed from there.

use std::time::Duration;
use warren_stream::codec::{Frame, PublishedMessage};
use warren_stream::frame::code;

mod common;
use common::Killed;
#[path = "common/stream_raw.rs"]
mod stream_raw;
use stream_raw::Raw;

fn serve(dir: &std::path::Path, extra: &[&str]) -> (Killed, u16) {
    let mut args = vec!["--stream", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let served = common::serve(dir, false, &args);
    let port = served.stream.expect("stream port logged");
    (Killed(served), port)
}

fn args(kv: &[(&str, &str)]) -> Vec<(String, String)> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn create(c: &mut Raw, stream: &str, arguments: &[(&str, &str)]) -> u16 {
    c.request(Frame::Create {
        corr: 7,
        stream: stream.into(),
        arguments: args(arguments),
    })
    .await
}

fn message(id: u64) -> PublishedMessage {
    PublishedMessage {
        publishing_id: id,
        filter_value: None,
        entry: warren_stream::codec::Entry::Simple(format!("m{id}").into_bytes().into()),
    }
}

/// Publishes `n` messages in one frame through publisher 1 and waits for their confirm.
async fn publish_confirmed(c: &mut Raw, first_id: u64, n: u64) {
    c.send(&Frame::Publish {
        v2: false,
        publisher_id: 1,
        messages: (first_id..first_id + n).map(message).collect(),
    })
    .await;
    let mut confirmed = 0;
    while confirmed < n {
        match c.recv().await {
            Some(Frame::PublishConfirm { publishing_ids, .. }) => {
                confirmed += publishing_ids.len() as u64
            }
            other => panic!("a confirm, got {other:?}"),
        }
    }
}

/// What RabbitMQ 3.10.8 answered to these declarations of an existing stream: 0x05 with
/// the same arguments (unknown ones ignored, numbers compared as numbers), 0x11 when one
/// differs or is given once only. Checked with the data directory's streams (across a
/// kill -9) and with --in-memory's.
async fn redeclarations(port: u16, stream: &str, before_restart: bool) {
    let mut c = Raw::open(port).await;
    let limit = [("max-length-bytes", "1000000")];
    if before_restart {
        assert_eq!(create(&mut c, stream, &limit).await, code::OK);
    }
    assert_eq!(
        create(&mut c, stream, &limit).await,
        code::STREAM_ALREADY_EXISTS,
        "same arguments"
    );
    assert_eq!(
        create(
            &mut c,
            stream,
            &[("max-length-bytes", "01000000"), ("foo", "bar")]
        )
        .await,
        code::STREAM_ALREADY_EXISTS,
        "the same number, and an argument RabbitMQ ignores"
    );
    for (other, why) in [
        (&[("max-length-bytes", "2000000")][..], "another limit"),
        (&[][..], "no limit"),
        (
            &[("max-length-bytes", "1000000"), ("max-age", "1h")][..],
            "an age added",
        ),
    ] {
        assert_eq!(
            create(&mut c, stream, other).await,
            code::PRECONDITION_FAILED,
            "{why}"
        );
    }
    assert_eq!(
        create(&mut c, stream, &[("max-length-bytes", "x")]).await,
        code::PRECONDITION_FAILED,
        "an invalid value"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_declared_again_with_other_arguments_is_a_precondition_failure() {
    let dir = common::scratch_dir("stream-admin", "redeclare");
    let (served, port) = serve(&dir, &[]);
    redeclarations(port, "limited", true).await;
    // Plain streams compare as plain.
    let mut c = Raw::open(port).await;
    assert_eq!(create(&mut c, "plain", &[]).await, code::OK);
    assert_eq!(
        create(&mut c, "plain", &[]).await,
        code::STREAM_ALREADY_EXISTS
    );
    assert_eq!(
        create(&mut c, "plain", &[("max-age", "1h")]).await,
        code::PRECONDITION_FAILED
    );
    drop(c);
    drop(served);
    // The arguments are the stream's, kept on disk.
    let (served, port) = serve(&dir, &[]);
    redeclarations(port, "limited", false).await;
    drop(served);
    let (served, port) = serve(&dir, &["--in-memory"]);
    redeclarations(port, "in-memory", true).await;
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

fn stats(f: Option<Frame>) -> Vec<(String, i64)> {
    match f {
        Some(Frame::StreamStatsResponse {
            code: code::OK,
            stats,
            ..
        }) => stats,
        other => panic!("stream stats, got {other:?}"),
    }
}

/// `--stream-advertised-host/-port` are what Open and Metadata tell clients (RabbitMQ's
/// stream.advertised_host/port: checked with 3.10.8, whose Open answered them); StreamStats
/// has `last_chunk_id` besides `first_chunk_id` and `committed_chunk_id`, also after a
/// kill -9 (3.10.8 has no StreamStats: RabbitMQ 3.11+ sends osiris's counters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advertised_address_is_settable_and_stream_stats_has_the_last_chunk_id() {
    let dir = common::scratch_dir("stream-admin", "advertised");
    let flags = [
        "--stream-advertised-host",
        "streams.example",
        "--stream-advertised-port",
        "6000",
    ];
    let (served, port) = serve(&dir, &flags);
    let mut c = Raw::open(port).await;
    let opened = c.open_properties.clone();
    assert!(
        opened.contains(&("advertised_host".into(), "streams.example".into()))
            && opened.contains(&("advertised_port".into(), "6000".into())),
        "{opened:?}"
    );
    assert_eq!(create(&mut c, "s", &[]).await, code::OK);
    c.send(&Frame::Metadata {
        corr: 8,
        streams: vec!["s".into()],
    })
    .await;
    match c.recv().await {
        Some(Frame::MetadataResponse { brokers, .. }) => {
            assert_eq!(brokers.len(), 1);
            assert_eq!(
                (brokers[0].host.as_str(), brokers[0].port),
                ("streams.example", 6000)
            );
        }
        other => panic!("metadata, got {other:?}"),
    }
    let ask = Frame::StreamStats {
        corr: 9,
        stream: "s".into(),
    };
    c.send(&ask).await;
    let empty = stats(c.recv().await);
    assert!(empty.contains(&("last_chunk_id".into(), -1)), "{empty:?}");
    let r = c
        .request(Frame::DeclarePublisher {
            corr: 10,
            publisher_id: 1,
            reference: String::new(),
            stream: "s".into(),
        })
        .await;
    assert_eq!(r, code::OK);
    publish_confirmed(&mut c, 1, 3).await;
    publish_confirmed(&mut c, 4, 2).await;
    let want = [
        ("first_chunk_id".to_string(), 0),
        ("committed_chunk_id".to_string(), 3),
        ("last_chunk_id".to_string(), 3),
    ];
    c.send(&ask).await;
    assert_eq!(stats(c.recv().await), want);
    drop(c);
    drop(served);
    let (served, port) = serve(&dir, &[]);
    let mut c = Raw::open(port).await;
    assert!(
        c.open_properties
            .contains(&("advertised_port".into(), port.to_string())),
        "without the flags: the listener's own port"
    );
    c.send(&ask).await;
    assert_eq!(stats(c.recv().await), want, "after a kill -9");
    drop(c);
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stream deleted (over this protocol, then over the HTTP API) is announced with a
/// MetadataUpdate (0x06, "stream not available") to every connection with a publisher or
/// a subscription on it, idle ones included (a subscription without credit, a publisher
/// that sends nothing), and to no other: as RabbitMQ 3.10.8, which told both within
/// milliseconds and said nothing to the deleting connection or to others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_stream_tells_every_connection_using_it() {
    let dir = common::scratch_dir("stream-admin", "deleted");
    let (served, port) = serve(&dir, &["--management", "127.0.0.1:0"]);
    let http = served.0.management.expect("management port");
    let mut admin = Raw::open(port).await;
    let mut other = Raw::open(port).await;
    for stream in ["by-protocol", "by-api"] {
        assert_eq!(create(&mut admin, stream, &[]).await, code::OK);
        let mut publisher = Raw::open(port).await;
        let r = publisher
            .request(Frame::DeclarePublisher {
                corr: 10,
                publisher_id: 1,
                reference: String::new(),
                stream: stream.into(),
            })
            .await;
        assert_eq!(r, code::OK);
        let mut consumer = Raw::open(port).await;
        let r = consumer
            .request(Frame::Subscribe {
                corr: 11,
                subscription_id: 1,
                stream: stream.into(),
                offset: warren_stream::codec::OffsetSpec::First,
                credit: 0,
                properties: vec![],
            })
            .await;
        assert_eq!(r, code::OK);
        if stream == "by-protocol" {
            let r = admin
                .request(Frame::Delete {
                    corr: 12,
                    stream: stream.into(),
                })
                .await;
            assert_eq!(r, code::OK);
        } else {
            let answer = tokio::task::spawn_blocking(move || {
                common::http::call(http, "DELETE", "/api/queues/%2F/by-api", None).status
            })
            .await
            .unwrap();
            assert_eq!(answer, 204);
        }
        let update = Some(Frame::MetadataUpdate {
            code: code::STREAM_NOT_AVAILABLE,
            stream: stream.into(),
        });
        assert_eq!(publisher.recv().await, update, "the idle publisher");
        assert_eq!(consumer.recv().await, update, "the consumer without credit");
        let quiet = Duration::from_millis(300);
        assert_eq!(admin.recv_within(quiet).await, None, "nothing on it");
        assert_eq!(other.recv_within(quiet).await, None, "nothing on it");
        // The publisher went with its stream.
        publisher
            .send(&Frame::Publish {
                v2: false,
                publisher_id: 1,
                messages: vec![message(1)],
            })
            .await;
        assert_eq!(
            publisher.recv().await,
            Some(Frame::PublishError {
                publisher_id: 1,
                errors: vec![(1, code::PUBLISHER_DOES_NOT_EXIST)]
            })
        );
    }
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

fn stream_connections(http: u16) -> Vec<serde_json::Value> {
    common::http::call(http, "GET", "/api/connections", None)
        .json()
        .as_array()
        .expect("a list")
        .iter()
        .filter(|c| c["protocol"] == "stream")
        .cloned()
        .collect()
}

/// Stream connections are the broker's connections (as RabbitMQ 3.10.8 lists them: protocol
/// `stream`, `client_properties.connection_name`, named `peer -> listener`), in the HTTP API
/// and `warren ctl list-connections`, and `DELETE /api/connections/NAME` closes one (RabbitMQ
/// closes the socket at once, without a Close frame; so does Warren). The others stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_connections_are_listed_and_closed_by_operators() {
    let dir = common::scratch_dir("stream-admin", "connections");
    let (served, port) = serve(&dir, &["--management", "127.0.0.1:0"]);
    let http = served.0.management.expect("management port");
    let mut named = Raw::open_as(port, Some("my-stream-conn")).await;
    let mut kept = Raw::open(port).await;
    let listed = common::eventually("two stream connections listed", || {
        let c = stream_connections(http);
        (c.len() == 2).then_some(c)
    });
    let mine = listed
        .iter()
        .find(|c| c["client_properties"]["connection_name"] == "my-stream-conn")
        .unwrap_or_else(|| panic!("{listed:?}"));
    assert_eq!(mine["user"], "guest");
    assert_eq!(mine["vhost"], "/");
    assert_eq!(mine["user_provided_name"], "my-stream-conn");
    let name = mine["name"].as_str().expect("a name").to_string();
    assert!(
        name.starts_with("127.0.0.1:") && name.ends_with(&format!(" -> 127.0.0.1:{port}")),
        "{name}"
    );
    let out = std::process::Command::new(common::BIN)
        .args(["ctl", "--data-dir"])
        .arg(&dir)
        .args(["--format", "json", "list-connections"])
        .output()
        .expect("warren ctl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(
        rows.as_array()
            .expect("rows")
            .iter()
            .any(|r| r["protocol"] == "stream"
                && r["client_name"] == "my-stream-conn"
                && r["user"] == "guest"),
        "{rows}"
    );
    let path = format!(
        "/api/connections/{}",
        name.replace(':', "%3A")
            .replace(' ', "%20")
            .replace('>', "%3E")
    );
    let status =
        tokio::task::spawn_blocking(move || common::http::call(http, "DELETE", &path, None).status)
            .await
            .unwrap();
    assert_eq!(status, 204);
    assert_eq!(
        named.recv().await,
        None,
        "closed at once, without a Close frame"
    );
    let left = common::eventually("one stream connection left", || {
        let c = stream_connections(http);
        (c.len() == 1).then_some(c)
    });
    assert_ne!(left[0]["name"], name.as_str());
    assert_eq!(create(&mut kept, "still-served", &[]).await, code::OK);
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}
