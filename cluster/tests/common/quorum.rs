//! What the quorum-queue leader-change tests share: who leads a queue's group as each node
//! says, and confirmed publishes and deliveries through a node within a bound.

use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};

use super::{Cluster, Node};

/// The leader of quorum queue `queue` as node index `i` reports it (`warren ctl
/// list-queues`), as an index.
pub fn reported_leader(cluster: &Cluster, i: usize, queue: &str) -> Option<usize> {
    let out = std::process::Command::new(&cluster.bin)
        .args(["ctl", "--format", "json", "--data-dir"])
        .arg(
            cluster
                .state
                .path()
                .join(format!("cluster/n{}/data", i + 1)),
        )
        .arg("list-queues")
        .output()
        .ok()?;
    let qs: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let found = qs.as_array()?.iter().find(|x| x["name"] == queue)?;
    usize::try_from(found["leader"].as_u64()?)
        .ok()?
        .checked_sub(1)
}

/// The node among `among` that says it leads `queue` (its own view).
pub async fn leader_among(cluster: &Cluster, among: &[usize], queue: &str) -> usize {
    let deadline = Instant::now() + super::WAIT;
    loop {
        if let Some(l) = among
            .iter()
            .copied()
            .find(|&i| reported_leader(cluster, i, queue) == Some(i))
        {
            return l;
        }
        assert!(
            Instant::now() < deadline,
            "no node among {among:?} says it leads {queue}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Declares durable queue `queue` through `node`: a quorum queue if `quorum`.
pub async fn declare(node: &Node, queue: &str, quorum: bool) {
    let (_c, ch) = super::amqp_channel(node).await;
    let mut args = FieldTable::default();
    if quorum {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
    }
    super::bounded(
        "declare",
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("declare {queue}: {e}"));
}

/// A channel in confirm mode on `node`.
pub async fn confirm_channel(node: &Node) -> Result<(Connection, lapin::Channel), String> {
    let uri = format!("amqp://warren:warren@{}/%2f", node.amqp);
    let conn = Connection::connect(&uri, ConnectionProperties::default())
        .await
        .map_err(|e| e.to_string())?;
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok((conn, ch))
}

/// Publishes `body` (persistent) to `queue` on `ch`: whether it was confirmed (acked).
pub async fn publish(ch: &lapin::Channel, queue: &str, body: &str) -> Result<bool, String> {
    let c = ch
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(c.await.map_err(|e| e.to_string())?.is_ack())
}

/// One publish of `body` to `queue` through `node` on a new connection: whether it was
/// confirmed within `within`.
pub async fn publish_once(
    node: &Node,
    queue: &str,
    body: &str,
    within: Duration,
) -> Result<bool, String> {
    let attempt = async {
        let (conn, ch) = confirm_channel(node).await?;
        let ok = publish(&ch, queue, body).await?;
        let _ = conn.close(200, "done".into()).await;
        Ok(ok)
    };
    match tokio::time::timeout(within, attempt).await {
        Ok(r) => r,
        Err(_) => Err(format!("no confirm in {within:?}")),
    }
}

/// Publishes `body` to `queue` through `node` until it is confirmed; how long that took
/// from `since`. Fails past `since + bound`.
pub async fn confirmed_within(
    node: &Node,
    queue: &str,
    body: &str,
    since: Instant,
    bound: Duration,
    what: &str,
) -> Duration {
    loop {
        let last = match publish_once(node, queue, body, Duration::from_secs(2)).await {
            Ok(true) => return since.elapsed(),
            Ok(false) => "nacked".to_string(),
            Err(e) => e,
        };
        assert!(
            since.elapsed() < bound,
            "{what}: {body} through {} not confirmed {:?} after it (bound {bound:?}; last: {last})",
            node.name,
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Takes messages from `queue` through `node` (basic.get, no-ack) until `body` comes; how
/// long that took from `since`. Fails past `since + bound`.
pub async fn delivered_within(
    node: &Node,
    queue: &str,
    body: &str,
    since: Instant,
    bound: Duration,
    what: &str,
) -> Duration {
    loop {
        let got = async {
            let uri = format!("amqp://warren:warren@{}/%2f", node.amqp);
            let conn = Connection::connect(&uri, ConnectionProperties::default())
                .await
                .ok()?;
            let ch = conn.create_channel().await.ok()?;
            let mut found = false;
            while let Ok(Some(m)) = ch
                .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                .await
            {
                if m.delivery.data == body.as_bytes() {
                    found = true;
                    break;
                }
            }
            let _ = conn.close(200, "done".into()).await;
            Some(found)
        };
        if let Ok(Some(true)) = tokio::time::timeout(Duration::from_secs(2), got).await {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < bound,
            "{what}: {body} not delivered through {} {:?} after it (bound {bound:?})",
            node.name,
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Lines of node `i`'s log (index) that contain `needle`.
pub fn log_lines(cluster: &Cluster, i: usize, needle: &str) -> Vec<String> {
    let log = cluster.state.path().join(format!("cluster/n{}/log", i + 1));
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}
