//! Operating quorum queues on three `warren serve` nodes in network namespaces
//! (`scripts/cluster.sh`, docs/cluster.md "Quorum queues"), with lapin on the host:
//!
//! - a declare-ok comes once the new queue's group has a leader serving it, so publishes with
//!   confirms right after it, on the declaring node (the group's leader or not), are all
//!   acked;
//! - `warren ctl cluster-status` shows every group (the metadata group and each quorum
//!   queue's: members, leader, each member's matched index and lag on the leader), and the
//!   HTTP API's queue objects carry `leader`, `members` and `online`;
//! - `warren ctl quorum add-member` / `delete-member` / `grow` / `shrink` change a queue's
//!   group through openraft's membership change: a node added after the leader purged its
//!   log catches up from a snapshot (learner, then voter), and serves every message once
//!   the original members are removed; a node that is not a member forwards publishes to
//!   the leader; a member stopped while the others commit past a
//!   snapshot, returning after the leader died, catches up from the new leader's snapshot.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN); skipped otherwise unless WARREN_CLUSTER_REQUIRE=1.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, Node, bounded, cluster_status, parse};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};

const BRIDGE: &str = "wbq0";
const NET: &str = "10.85.0";
const NET2: &str = "10.86.0";

/// The tests share the bridge's name (a prefix of their namespaces), so they run one at a
/// time; each on its own subnet.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn channel(node: &Node) -> (Connection, Channel) {
    let (conn, ch) = common::amqp_channel(node).await;
    common::answered(
        "confirm.select-ok",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    (conn, ch)
}

fn quorum_args() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args
}

/// Publishes `n` persistent messages to `queue` and waits for every confirm: how many were
/// acked.
async fn publish_confirmed(ch: &Channel, queue: &str, n: usize) -> usize {
    let mut confirms = Vec::with_capacity(n);
    for i in 0..n {
        confirms.push(
            bounded(
                "publish",
                ch.basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    format!("m{i}").as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await
            .expect("publish"),
        );
    }
    let mut acked = 0;
    for c in confirms {
        if bounded("confirm", c).await.expect("confirm").is_ack() {
            acked += 1;
        }
    }
    acked
}

/// `GET path` on a node's HTTP API as warren/warren: the JSON body.
fn http_get(node: &Node, path: &str) -> serde_json::Value {
    let out = std::process::Command::new("curl")
        .args(["-sf", "-m", "10", "-u", "warren:warren"])
        .arg(format!("http://{}{path}", node.http))
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "GET {path} on {}: {}",
        node.name,
        out.status
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_ok_waits_for_a_leader_and_cluster_status_shows_every_group() {
    let _serial = SERIAL.lock().await;
    let Some(cluster) = Cluster::prepare("quorum queue operations test", BRIDGE, NET) else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    let state = cluster.state.path().join("cluster");

    // Declares on every node in turn, each followed at once by confirmed publishes on the
    // same channel. Six queues: their groups' first leaders spread over the nodes, so the
    // declaring node leads some and not others (then it forwards to the leader).
    let names: Vec<String> = (0..6).map(|i| format!("qq-ops-{i}")).collect();
    let mut declare_ms = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let node = &nodes[i % 3];
        let (_c, ch) = channel(node).await;
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let t = Instant::now();
        bounded(
            "declare",
            ch.queue_declare(name.as_str().into(), durable, quorum_args()),
        )
        .await
        .expect("declare a quorum queue");
        declare_ms.push(t.elapsed().as_millis());
        let acked = publish_confirmed(&ch, name, 20).await;
        assert_eq!(
            acked, 20,
            "publishes right after the declare-ok of {name} on {} are all acked",
            node.name
        );
    }
    eprintln!("quorum queue declare-ok took {declare_ms:?} ms");

    // cluster-status on every node names the metadata group and every queue's group, with
    // the same leader for each queue; on that leader, every member's matched index and lag.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let statuses: Vec<serde_json::Value> = (1..=3)
            .map(|i| cluster_status(&state, &cluster.bin, i).expect("cluster-status answers"))
            .collect();
        let mut problems = Vec::new();
        for name in &names {
            let groups: Vec<&serde_json::Value> = statuses
                .iter()
                .filter_map(|s| {
                    s["groups"]
                        .as_array()?
                        .iter()
                        .find(|g| g["type"] == "quorum" && g["queue"] == name.as_str())
                })
                .collect();
            if groups.len() != 3 {
                problems.push(format!("{name}: in {} nodes' status", groups.len()));
                continue;
            }
            let leaders: Vec<Option<u64>> = groups
                .iter()
                .map(|g| g["status"]["leader"].as_u64())
                .collect();
            let Some(Some(leader)) = leaders.first().copied() else {
                problems.push(format!("{name}: no leader"));
                continue;
            };
            if leaders.iter().any(|l| *l != Some(leader)) {
                problems.push(format!("{name}: leaders {leaders:?}"));
                continue;
            }
            let on_leader = groups[(leader - 1) as usize];
            assert_eq!(on_leader["status"]["state"], "leader");
            assert_eq!(on_leader["members"].as_array().map(Vec::len), Some(3));
            let members = on_leader["status"]["members"].as_array().expect("members");
            assert_eq!(members.len(), 3, "{on_leader}");
            for m in members {
                // 20 messages and the leader's marker are committed; every member has them.
                if m["matched"].as_u64().unwrap_or(0) < 2 || m["lag"].as_u64() != Some(0) {
                    problems.push(format!("{name}: member {m} behind"));
                }
                assert_eq!(m["online"], true, "{m}");
                assert_eq!(m["voter"], true, "{m}");
            }
        }
        for s in &statuses {
            let g = &s["groups"][0];
            assert_eq!(g["type"], "metadata", "the metadata group first: {s}");
            assert_eq!(g["status"]["leader"], s["leader"]);
            assert!(s["alarms"].as_array().is_some_and(Vec::is_empty), "{s}");
        }
        if problems.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "cluster-status does not show every group settled: {problems:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The text form lists the groups too.
    let text = std::process::Command::new(&cluster.bin)
        .args(["ctl", "--data-dir"])
        .arg(state.join("n1/data"))
        .arg("cluster-status")
        .output()
        .expect("ctl");
    let text = String::from_utf8_lossy(&text.stdout);
    for name in &names {
        assert!(text.contains(name.as_str()), "{name} in:\n{text}");
    }

    // The HTTP API's queues carry their group: leader, members, online (RabbitMQ's fields).
    for node in &nodes {
        let qs = http_get(node, "/api/queues");
        for name in &names {
            let q = qs
                .as_array()
                .and_then(|a| a.iter().find(|q| q["name"] == name.as_str()))
                .unwrap_or_else(|| panic!("{name} in /api/queues on {}", node.name));
            assert_eq!(q["type"], "quorum");
            assert_eq!(q["members"].as_array().map(Vec::len), Some(3), "{q}");
            assert_eq!(q["online"].as_array().map(Vec::len), Some(3), "{q}");
            assert!(q["leader"].as_u64().is_some(), "{q}");
        }
        let one = http_get(node, &format!("/api/queues/%2f/{}", names[0]));
        assert!(one["leader"].as_u64().is_some(), "{one}");
    }
    // Every node's alarms, on every node: a memory alarm on n2 (a 1-byte watermark) shows
    // in n1's cluster-status, and goes when it clears.
    let alarms_on_n1 = || {
        cluster_status(&state, &cluster.bin, 1)
            .map(|s| s["alarms"].clone())
            .unwrap_or_default()
    };
    ctl(
        &cluster,
        2,
        &["set-vm-memory-high-watermark", "absolute", "1"],
    )
    .expect("watermark");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a = alarms_on_n1();
        if a.as_array().is_some_and(|a| {
            a.iter()
                .any(|x| x["node"] == 2 && x["resource"] == "memory")
        }) {
            break;
        }
        assert!(Instant::now() < deadline, "n2's alarm not shown on n1: {a}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ctl(&cluster, 2, &["set-vm-memory-high-watermark", "0.4"]).expect("watermark");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a = alarms_on_n1();
        if a.as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "n2's alarm still shown on n1: {a}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A member down: the others no longer count it online.
    cluster.run(&["kill", "n3"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let q = http_get(&nodes[0], &format!("/api/queues/%2f/{}", names[0]));
        if q["online"].as_array().map(Vec::len) == Some(2) {
            assert!(
                !q["online"].as_array().into_iter().flatten().any(|m| m == 3),
                "{q}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "n3 still online: {q}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `warren ctl ARGS` against node `i` (1-based): its stdout, or the error it printed.
fn ctl(cluster: &Cluster, i: usize, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(&cluster.bin)
        .arg("ctl")
        .arg("--data-dir")
        .arg(cluster.state.path().join(format!("cluster/n{i}/data")))
        .args(args)
        .output()
        .expect("run warren ctl");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Queue `name`'s group as node `i` reports it in `cluster-status`.
fn group_of(cluster: &Cluster, i: usize, name: &str) -> Option<serde_json::Value> {
    let st = cluster_status(&cluster.state.path().join("cluster"), &cluster.bin, i)?;
    st["groups"]
        .as_array()?
        .iter()
        .find(|g| g["queue"] == name)
        .cloned()
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_u64)
        .collect()
}

/// Polls until every node in `on` records `want` as queue `name`'s members and, on the
/// group's leader, each of them is a voter with no lag.
async fn settled(cluster: &Cluster, on: &[usize], name: &str, want: &[u64]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let groups: Vec<Option<serde_json::Value>> =
            on.iter().map(|i| group_of(cluster, *i, name)).collect();
        let recorded = groups
            .iter()
            .all(|g| g.as_ref().is_some_and(|g| ids(&g["members"]) == want));
        let leader = groups
            .iter()
            .flatten()
            .find(|g| g["status"]["state"] == "leader");
        let voters_caught_up = leader.is_some_and(|g| {
            let ms = g["status"]["members"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            g["serving"] == true
                && ms.len() == want.len()
                && ms.iter().all(|m| {
                    want.contains(&m["id"].as_u64().unwrap_or(0))
                        && m["voter"] == true
                        && m["lag"].as_u64() == Some(0)
                })
        });
        if recorded && voters_caught_up {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "queue {name}: members not settled at {want:?}: {groups:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls nodes `among` until one leads queue `name`'s group and serves it: its id.
async fn serving_leader(cluster: &Cluster, among: &[u64], name: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(l) = among.iter().copied().find(|m| {
            group_of(cluster, *m as usize, name)
                .is_some_and(|g| g["status"]["state"] == "leader" && g["serving"] == true)
        }) {
            return l;
        }
        assert!(
            Instant::now() < deadline,
            "no node of {among:?} serves {name}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Takes every message of `queue` (acking each): their bodies.
async fn drain(ch: &Channel, queue: &str) -> Vec<String> {
    let mut got = Vec::new();
    while let Some(m) = bounded(
        "basic.get",
        ch.basic_get(queue.into(), BasicGetOptions { no_ack: false }),
    )
    .await
    .expect("basic.get")
    {
        got.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
        bounded("ack", m.delivery.ack(BasicAckOptions::default()))
            .await
            .expect("ack");
        assert!(got.len() < 100_000, "more messages than were published");
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_added_by_snapshot_and_removed_through_openraft() {
    let _serial = SERIAL.lock().await;
    let Some(cluster) = Cluster::prepare("quorum queue membership test", BRIDGE, NET2) else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    const Q: &str = "qq-members";
    // Two members out of three: the third is the one added later.
    let (_c, ch) = channel(&nodes[0]).await;
    let mut args = quorum_args();
    args.insert("x-quorum-initial-group-size".into(), AMQPValue::LongInt(2));
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    bounded("declare", ch.queue_declare(Q.into(), durable, args))
        .await
        .expect("declare a quorum queue of 2");
    let members = ids(&group_of(&cluster, 1, Q).expect("the group in cluster-status")["members"]);
    assert_eq!(members.len(), 2, "{members:?}");
    let outsider = (1..=3u64)
        .find(|i| !members.contains(i))
        .expect("a non-member");
    let leader_node = serving_leader(&cluster, &members, Q).await;
    // Over a snapshot period of entries (one per confirmed publish, each awaited), so the
    // leader snapshots and purges the start of its log: a member added now needs the
    // snapshot. Published on a member (the declaring node may be the outsider).
    let (_pc, pch) = channel(&nodes[(leader_node - 1) as usize]).await;
    let mut want = std::collections::BTreeSet::new();
    for i in 0..1300 {
        let body = format!("m{i}");
        let c = bounded(
            "publish",
            pch.basic_publish(
                "".into(),
                Q.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            ),
        )
        .await
        .expect("publish");
        assert!(
            bounded("confirm", c).await.expect("confirm").is_ack(),
            "{body}"
        );
        want.insert(body);
    }
    let snapshot = |i: u64| -> Vec<std::path::PathBuf> {
        let dir = cluster
            .state
            .path()
            .join(format!("cluster/n{i}/data/cluster"));
        std::fs::read_dir(&dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                        n.starts_with("q-") && n.ends_with(".snapshot")
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    assert!(snapshot(outsider).is_empty(), "no copy on the outsider yet");
    // A node that is not a member takes publishes too: it forwards them to the leader the
    // metadata group names (before: nacked, it followed no group).
    {
        let (_xc, xch) = channel(&nodes[(outsider - 1) as usize]).await;
        for i in 0..10 {
            let body = format!("x{i}");
            let c = bounded(
                "publish",
                xch.basic_publish(
                    "".into(),
                    Q.into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await
            .expect("publish");
            assert!(
                bounded("confirm", c).await.expect("confirm").is_ack(),
                "{body} published on non-member node {outsider} confirmed"
            );
            want.insert(body);
        }
        // Its queue listing names the leader it forwards to.
        let qs = http_get(
            &nodes[(outsider - 1) as usize],
            &format!("/api/queues/%2f/{Q}"),
        );
        assert_eq!(qs["leader"].as_u64(), Some(leader_node), "{qs}");
    }

    // Added from the outsider itself (not a member: forwarded to the group's leader).
    let t = Instant::now();
    ctl(
        &cluster,
        outsider as usize,
        &["quorum", "add-member", Q, &outsider.to_string()],
    )
    .expect("add-member");
    eprintln!(
        "add-member of node {outsider} (snapshot catch-up) took {:?}",
        t.elapsed()
    );
    let mut all: Vec<u64> = members.clone();
    all.push(outsider);
    all.sort();
    settled(&cluster, &[1, 2, 3], Q, &all).await;
    let log = std::fs::read_to_string(
        cluster
            .state
            .path()
            .join(format!("cluster/n{outsider}/log")),
    )
    .unwrap_or_default();
    assert!(
        !snapshot(outsider).is_empty() && log.contains("installed a snapshot from the leader"),
        "the added member caught up from the leader's snapshot (its log was purged)"
    );
    // Adding it twice is refused.
    let again = ctl(
        &cluster,
        1,
        &["quorum", "add-member", Q, &outsider.to_string()],
    );
    assert!(again.is_err_and(|e| e.contains("already")));

    // The original members leave, one by one, through openraft's membership change; the
    // added node alone then serves every message from its own copy.
    for m in &members {
        ctl(&cluster, 1, &["quorum", "delete-member", Q, &m.to_string()])
            .unwrap_or_else(|e| panic!("delete-member {m}: {e}"));
    }
    settled(&cluster, &[1, 2, 3], Q, &[outsider]).await;
    // A removed member deletes its copy.
    for m in &members {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !snapshot(*m).is_empty() {
            assert!(Instant::now() < deadline, "node {m} keeps its copy");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let last = ctl(
        &cluster,
        1,
        &["quorum", "delete-member", Q, &outsider.to_string()],
    );
    assert!(last.is_err_and(|e| e.contains("last member")));
    let (_oc, och) = channel(&nodes[(outsider - 1) as usize]).await;
    let got = drain(&och, Q).await;
    let got_set: std::collections::BTreeSet<String> = got.iter().cloned().collect();
    assert_eq!(got.len(), got_set.len(), "no message twice");
    assert_eq!(
        got_set, want,
        "the added member has every confirmed message"
    );
    // A publish there is confirmed by its group of one.
    assert_eq!(publish_confirmed(&och, Q, 5).await, 5);

    // grow: the two others join again (RabbitMQ's grow after a join); shrink: one leaves.
    for m in &members {
        let out = ctl(
            &cluster,
            outsider as usize,
            &["quorum", "grow", &m.to_string()],
        )
        .expect("grow");
        assert!(out.contains(Q) && out.contains("ok"), "{out}");
    }
    settled(&cluster, &[1, 2, 3], Q, &[1, 2, 3]).await;

    // A stopped member catches up from a snapshot: X down, 1,300 more committed by the
    // other two (the follower among them snapshots and purges its own log), then the leader
    // dies and X returns: the follower, now leading with its log purged, sends X its
    // snapshot, and the two of them serve everything.
    let l = serving_leader(&cluster, &[1, 2, 3], Q).await;
    let x = (1..=3u64).find(|n| *n != l).expect("a follower");
    let y = (1..=3u64)
        .find(|n| *n != l && *n != x)
        .expect("the other follower");
    let installs = |n: u64| {
        std::fs::read_to_string(cluster.state.path().join(format!("cluster/n{n}/log")))
            .unwrap_or_default()
            .matches("installed a snapshot from the leader")
            .count()
    };
    let before = installs(x);
    cluster.run(&["kill", &format!("n{x}")]);
    let (_lc, lch) = channel(&nodes[(l - 1) as usize]).await;
    let mut later = std::collections::BTreeSet::new();
    for i in 0..1300 {
        let body = format!("s{i}");
        let c = bounded(
            "publish",
            lch.basic_publish(
                "".into(),
                Q.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            ),
        )
        .await
        .expect("publish");
        assert!(
            bounded("confirm", c).await.expect("confirm").is_ack(),
            "{body}"
        );
        later.insert(body);
    }
    cluster.run(&["kill", &format!("n{l}")]);
    let line = cluster.run(&["start", &format!("n{x}")]);
    assert!(line.contains("amqp="), "{line}");
    let y_leads = serving_leader(&cluster, &[x, y], Q).await;
    assert_eq!(
        y_leads, y,
        "the member that stayed up leads (the other is behind)"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let caught_up = group_of(&cluster, y as usize, Q).is_some_and(|g| {
            g["status"]["members"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|m| m["id"] == x && m["lag"].as_u64() == Some(0))
        });
        if caught_up && installs(x) > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node {x} did not catch up by snapshot: {:?}",
            group_of(&cluster, y as usize, Q)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_yc, ych) = channel(&nodes[(y - 1) as usize]).await;
    let got: std::collections::BTreeSet<String> = drain(&ych, Q).await.into_iter().collect();
    assert_eq!(
        got.len(),
        later.len() + 5,
        "the 5 from before and the 1,300"
    );
    assert!(later.is_subset(&got));
    let line = cluster.run(&["start", &format!("n{l}")]);
    assert!(line.contains("amqp="), "{line}");
    settled(&cluster, &[1, 2, 3], Q, &[1, 2, 3]).await;

    // shrink: one leaves; the group of two goes on.
    let out = ctl(&cluster, 2, &["quorum", "shrink", &members[0].to_string()]).expect("shrink");
    assert!(out.contains(Q) && out.contains("ok"), "{out}");
    let mut two: Vec<u64> = vec![members[1], outsider];
    two.sort();
    settled(&cluster, &[1, 2, 3], Q, &two).await;
    let leader = serving_leader(&cluster, &two, Q).await;
    let (_lc, lch) = channel(&nodes[(leader - 1) as usize]).await;
    assert_eq!(publish_confirmed(&lch, Q, 3).await, 3);
    assert_eq!(drain(&lch, Q).await.len(), 3);
}
