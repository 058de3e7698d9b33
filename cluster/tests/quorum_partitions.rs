//! A quorum queue's leader partitioned away and healed, round after round (docs/cluster.md,
//! "Quorum queues"): each time, the majority side serves the queue (confirms, deliveries)
//! within a bound tied to the election timeout, and once healed every node does, the old
//! leader included. Over rounds the leadership comes back to nodes that were cut off while
//! they led: the broker there must serve again when Raft elects it (issue 43: a node that
//! missed its step-down never served again, 22-38 s of nacks until it was restarted).
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use std::time::{Duration, Instant};

use common::quorum::{
    confirm_channel, confirmed_within, declare, delivered_within, leader_among, publish,
};
use common::{Cluster, parse};

/// Its own bridge and subnet.
const BRIDGE: &str = "wbf0";
const NET: &str = "10.95.0";

const Q: &str = "qp";

/// Rounds of partition and heal of the current leader.
const ROUNDS: usize = 5;

/// The nodes' longest election timeout (`election_timeout_ms` 500, openraft waits up to
/// twice that).
const ELECTION: Duration = Duration::from_millis(1000);

/// How long the majority side may take to confirm through each of its nodes after the
/// cut: an election (openraft's followers wait a leader lease and an election timeout,
/// 1.5-2 s) and room; the forward timeout (5 s) made it 5.1 s or more before.
const FAILOVER: Duration = Duration::from_millis(4500);

/// How long a publish through a leader cut off by a partition may wait for its answer:
/// its lease (an election timeout without a majority's answer) and room.
const CUT_OFF_ANSWER: Duration = Duration::from_secs(6 * ELECTION.as_secs());

/// How long service may take to resume after a partition or a heal: an election or two,
/// the transport's reconnect backoff (at most 0.5 s), and room for a loaded 2-core machine.
/// The bug this guards against took 22-38 s.
const RESUME: Duration = Duration::from_secs(10 * ELECTION.as_secs());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_leader_partitioned_and_healed_serves_again_each_round() {
    let Some(cluster) = Cluster::prepare("cluster quorum partition rounds test", BRIDGE, NET)
    else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    declare(&nodes[0], Q, true).await;
    let start = Instant::now();
    confirmed_within(&nodes[0], Q, "first", start, RESUME, "after the declare").await;
    let mut led = std::collections::BTreeSet::new();
    let mut again = 0;
    for round in 0..ROUNDS {
        let leader = leader_among(&cluster, &[0, 1, 2], Q).await;
        if !led.insert(leader) {
            // Cut off while it led in an earlier round, it leads again: the case at issue.
            again += 1;
        }
        let others: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
        let (_cut_conn, cut_ch) = confirm_channel(&nodes[leader]).await.expect("connect");
        cluster.run(&["partition", &nodes[leader].name]);
        let cut = Instant::now();
        // Through the cut-off leader: answered (nacked: no majority has it) once its lease
        // is lost, not left waiting for the heal.
        let cut_off = tokio::spawn(async move {
            let r = publish(&cut_ch, Q, "cut-off").await;
            (r, cut.elapsed())
        });
        // Through both nodes of the majority at once: one of them forwards to the leader, at
        // first the cut-off one (its waiting publishes are nacked when the leadership moves).
        let (a, b) = (&nodes[others[0]], &nodes[others[1]]);
        let (body_a, body_b) = (
            format!("r{round}-majority-a"),
            format!("r{round}-majority-b"),
        );
        let (took_a, took_b) = tokio::join!(
            confirmed_within(a, Q, &body_a, cut, RESUME, "partitioned"),
            confirmed_within(b, Q, &body_b, cut, RESUME, "partitioned"),
        );
        let confirmed = took_a.max(took_b);
        assert!(
            confirmed < FAILOVER,
            "round {round}: the majority side confirmed through {} after {took_a:?} and through {} after {took_b:?} (bound {FAILOVER:?})",
            a.name,
            b.name
        );
        let near = &nodes[others[round % 2]];
        let body = format!("r{round}-majority");
        confirmed_within(near, Q, &body, cut, RESUME, "partitioned").await;
        let delivered = delivered_within(near, Q, &body, cut, RESUME, "partitioned").await;
        let new_leader = leader_among(&cluster, &others, Q).await;
        println!(
            "round {round}: {} partitioned; {} leads; majority confirmed after {confirmed:?} (both nodes), delivered through {} after {delivered:?}",
            nodes[leader].name, nodes[new_leader].name, near.name
        );
        let (answer, after) = tokio::time::timeout(CUT_OFF_ANSWER.saturating_sub(cut.elapsed()), cut_off)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "round {round}: a publish through the cut-off leader {} unanswered {CUT_OFF_ANSWER:?} into the partition",
                    nodes[leader].name
                )
            })
            .expect("publisher task");
        println!(
            "round {round}: through the cut-off {}: {answer:?} after {after:?}",
            nodes[leader].name
        );
        // Cut off for longer than an election or two: its group's other members moved on.
        tokio::time::sleep(2 * ELECTION).await;
        cluster.run(&["heal"]);
        let healed = Instant::now();
        // Every node serves again, the one that was cut off first.
        for i in std::iter::once(leader).chain(others.iter().copied()) {
            let body = format!("r{round}-healed-{i}");
            let confirmed = confirmed_within(&nodes[i], Q, &body, healed, RESUME, "healed").await;
            let delivered = delivered_within(&nodes[i], Q, &body, healed, RESUME, "healed").await;
            println!(
                "round {round}: healed; through {}: confirmed after {confirmed:?}, delivered after {delivered:?}",
                nodes[i].name
            );
        }
    }
    println!("{again} of {ROUNDS} rounds partitioned a node cut off as leader before");
}
