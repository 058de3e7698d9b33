//! Quorum queues on one `warren serve` (a group of one): every confirmed message comes back
//! after SIGTERM and after kill -9, transient ones included, acked ones do not, and a
//! returned message keeps its `x-delivery-count`; listings show the type.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use std::process::Child;
use std::time::Duration;

mod common;
use common::{bounded, channel};

/// Kills the broker when dropped, also when the test fails midway.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[derive(Clone, Copy, Debug)]
enum Stop {
    Term,
    Kill,
}

fn stop(mut running: Running, how: Stop) {
    match how {
        Stop::Term => {
            let pid = libc::pid_t::try_from(running.0.id()).expect("pid");
            // SAFETY: signalling our own child process.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        Stop::Kill => {
            let _ = running.0.kill();
        }
    }
    // Bounded: a broker that does not stop fails the test instead of hanging it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = running.0.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("warren serve did not stop within 30 s after {how:?}");
}

fn quorum_args() -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString("quorum".into()),
    );
    t.insert(ShortString::from("x-delivery-limit"), AMQPValue::LongInt(5));
    t
}

fn delivery_count(props: &lapin::BasicProperties) -> Option<i64> {
    props
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-delivery-count").cloned())
        .and_then(|v| match v {
            AMQPValue::LongLongInt(n) => Some(n),
            AMQPValue::LongInt(n) => Some(i64::from(n)),
            _ => None,
        })
}

/// Every message of `queue` by basic.get with ack: (body, x-delivery-count).
async fn drain(ch: &lapin::Channel, queue: &str) -> Vec<(String, Option<i64>)> {
    let mut got = Vec::new();
    while let Some(m) = bounded(ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }))
        .await
        .expect("get")
    {
        got.push((
            String::from_utf8_lossy(&m.delivery.data).into_owned(),
            delivery_count(&m.delivery.properties),
        ));
        assert!(got.len() <= 100, "more messages than were published");
    }
    got
}

async fn survives(how: Stop) {
    let tag = format!("{how:?}").to_lowercase();
    let dir = std::env::temp_dir().join(format!("warren-quorum-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let served = common::serve(&dir, false, &["--management", "127.0.0.1:0"]);
    let (port, api) = (served.amqp, served.management.expect("HTTP API"));
    let running = Running(served.child);
    {
        let (_c, ch) = channel(port).await;
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        bounded(ch.queue_declare("qq".into(), durable, quorum_args()))
            .await
            .expect("declare a quorum queue");
        bounded(ch.confirm_select(Default::default()))
            .await
            .expect("confirms");
        for i in 0..20 {
            // Transient messages: a quorum queue stores them all the same.
            bounded(ch.basic_publish(
                "".into(),
                "qq".into(),
                Default::default(),
                format!("m{i}").as_bytes(),
                lapin::BasicProperties::default().with_delivery_mode(1),
            ))
            .await
            .expect("publish");
        }
        let nacked = bounded(ch.wait_for_confirms()).await.expect("confirms");
        assert!(nacked.is_empty(), "every publish confirmed");
        // m0..m4 acked (gone for good); m5 returned once (to the tail, counted 1).
        for _ in 0..5 {
            let m = bounded(ch.basic_get("qq".into(), BasicGetOptions { no_ack: false }))
                .await
                .expect("get")
                .expect("a message");
            bounded(m.delivery.ack(BasicAckOptions::default()))
                .await
                .expect("ack");
        }
        let m = bounded(ch.basic_get("qq".into(), BasicGetOptions { no_ack: false }))
            .await
            .expect("get")
            .expect("m5");
        bounded(m.delivery.nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        }))
        .await
        .expect("nack");
        // A confirmed publish after the acks and the return: its sync covers them too.
        bounded(ch.basic_publish(
            "".into(),
            "qq".into(),
            Default::default(),
            b"last",
            lapin::BasicProperties::default(),
        ))
        .await
        .expect("publish");
        assert!(
            bounded(ch.wait_for_confirms())
                .await
                .expect("confirm")
                .is_empty()
        );
        // The listings say what the queue is.
        let queues = common::http::call(api, "GET", "/api/queues/%2f/qq", None).json();
        assert_eq!(queues["type"], "quorum", "{queues}");
        let listed = std::process::Command::new(common::BIN)
            .args(["ctl", "--data-dir"])
            .arg(&dir)
            .args(["list-queues", "name", "type"])
            .output()
            .expect("warren ctl");
        let table = String::from_utf8_lossy(&listed.stdout);
        assert!(
            table
                .lines()
                .any(|l| l.split_whitespace().eq(["qq", "quorum"])),
            "{table}"
        );
    }
    stop(running, how);
    let served = common::serve(&dir, false, &[]);
    let running = Running(served.child);
    let (_c, ch) = channel(served.amqp).await;
    // The declare survived with its type: a classic redeclare is refused.
    let mut want: Vec<(String, Option<i64>)> =
        (6..20).map(|i| (format!("m{i}"), Some(0))).collect();
    want.push(("m5".into(), Some(1)));
    want.push(("last".into(), Some(0)));
    assert_eq!(drain(&ch, "qq").await, want, "after {how:?}");
    let err = bounded(ch.queue_declare(
        "qq".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect_err("a classic redeclare of a quorum queue");
    assert!(
        err.to_string().contains("inequivalent arg 'x-queue-type'"),
        "{err}"
    );
    drop(running);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queue_keeps_confirmed_messages_and_counts_across_sigterm() {
    survives(Stop::Term).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queue_keeps_confirmed_messages_and_counts_across_kill_9() {
    survives(Stop::Kill).await;
}
