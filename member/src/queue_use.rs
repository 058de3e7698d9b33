//! A `queue.delete` with `if-unused` or `if-empty` in a cluster (docs/cluster.md, "Failure
//! modes"): whether the queue is in use or empty is known where it is served (a classic
//! queue's home, a quorum queue's leader), not from this node's stub of it. Before such a
//! delete is proposed, the proposing node asks every other node for its instance's
//! consumers and ready messages (`Rpc::Ask` over the cluster transport) and refuses the
//! delete with RabbitMQ's `406 PRECONDITION_FAILED - queue '...' in vhost '...' in use` (or
//! `is not empty`) if any has them; a node that does not answer makes it fail too (404, as
//! RabbitMQ answers for a queue whose home node is down), since that node may be the home.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use warren_core::escape::Escaped;

use serde::{Deserialize, Serialize};
use warren_cluster::node::ClusterNode;
use warren_core::command::{Op, OpKind};
use warren_core::error::{ErrorCode, ProtocolError};
use warren_runtime::{AdminRequest, AdminResponse, BrokerHandle};

/// How long the proposing node waits for each other node's answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// A node's question to another.
#[derive(Serialize, Deserialize)]
enum Question {
    /// Queue `queue` of `vhost`: its consumers and ready messages there.
    QueueUse { vhost: String, queue: String },
}

/// What a node's instance of a queue holds (none: it has no such queue).
#[derive(Serialize, Deserialize, Default, Clone, Copy)]
struct Use {
    consumers: u64,
    ready: u64,
}

/// This node's instance of queue `queue` of `vhost`: its consumers (another node's
/// consumers of a queue served here count, as they are the queue's) and ready messages.
async fn local_use(broker: &BrokerHandle, vhost: &str, queue: &str) -> Result<Use, String> {
    match broker.admin_local(AdminRequest::ListQueues).await {
        Ok(AdminResponse::Queues(all)) => Ok(all
            .iter()
            .find(|q| q.vhost == vhost && q.name == queue)
            .map(|q| Use {
                consumers: q.consumers as u64,
                ready: q.messages_ready,
            })
            .unwrap_or_default()),
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(_) => Err("broker stopped".into()),
    }
}

/// Answers other nodes' questions from `broker`.
pub fn serve(node: &ClusterNode, broker: BrokerHandle) {
    node.set_ask_handler(Arc::new(move |from, bytes| {
        let broker = broker.clone();
        Box::pin(async move {
            let question: Question = serde_json::from_slice(&bytes).map_err(|e| {
                tracing::warn!(
                    node = from,
                    "cluster: unreadable question from node {from}: {e}"
                );
                format!("unreadable question: {e}")
            })?;
            match question {
                Question::QueueUse { vhost, queue } => {
                    let u = local_use(&broker, &vhost, &queue).await?;
                    serde_json::to_vec(&u).map_err(|e| e.to_string())
                }
            }
        })
    }));
}

/// The check before client op `op` of `vhost` is proposed (`Replicator::precheck`).
/// `delay`: tests widen the window between a passed check and the commit
/// (`WARREN_TEST_CONDITIONAL_DELETE_DELAY_MS`, read by the binary; `None` in production).
pub fn precheck(
    node: Arc<ClusterNode>,
    me: u64,
    broker: BrokerHandle,
    vhost: &str,
    op: &Op,
    delay: Option<Duration>,
) -> Pin<Box<dyn Future<Output = Option<ProtocolError>> + Send>> {
    let (queue, if_unused, if_empty) = match op {
        Op::QueueDelete {
            queue,
            if_unused,
            if_empty,
            ..
        } if *if_unused || *if_empty => (queue.clone(), *if_unused, *if_empty),
        _ => return Box::pin(async { None }),
    };
    let vhost = vhost.to_string();
    Box::pin(async move {
        let refuse = |code, text: String| Some(ProtocolError::new(code, OpKind::QueueDelete, text));
        let mut uses = Vec::new();
        match local_use(&broker, &vhost, &queue).await {
            Ok(u) => uses.push(u),
            Err(e) => return refuse(ErrorCode::InternalError, e),
        }
        let question = serde_json::to_vec(&Question::QueueUse {
            vhost: vhost.clone(),
            queue: queue.clone(),
        })
        .ok()?;
        let others: Vec<u64> = node.members().into_keys().filter(|id| *id != me).collect();
        // Asked at once: each waits at most ASK_TIMEOUT.
        let mut asks = Vec::with_capacity(others.len());
        for &id in &others {
            let question = question.clone();
            let node = node.clone();
            asks.push(tokio::spawn(async move {
                node.ask(id, question, ASK_TIMEOUT).await
            }));
        }
        for (id, ask) in others.iter().zip(asks) {
            let answer = ask.await.map_err(|e| e.to_string()).and_then(|r| {
                r.map_err(|e| e.to_string()).and_then(|bytes| {
                    serde_json::from_slice::<Use>(&bytes).map_err(|e| e.to_string())
                })
            });
            match answer {
                Ok(u) => uses.push(u),
                Err(e) => {
                    tracing::warn!(node = id, queue = %Escaped(&queue), "cluster: conditional queue.delete not checked on node {id}: {e}");
                    return refuse(
                        ErrorCode::NotFound,
                        format!(
                            "node {id} did not answer whether queue '{queue}' in vhost '{vhost}' is in use or empty (its home may be down or inaccessible)"
                        ),
                    );
                }
            }
        }
        let why = if if_unused && uses.iter().any(|u| u.consumers > 0) {
            "in use"
        } else if if_empty && uses.iter().any(|u| u.ready > 0) {
            "is not empty"
        } else {
            // Tests widen the window between this check and the commit (a few ms) to
            // show what happens in it (`cluster/tests/conditional_delete.rs`).
            if let Some(ms) = delay {
                tokio::time::sleep(ms).await;
            }
            return None;
        };
        refuse(
            ErrorCode::PreconditionFailed,
            format!("queue '{queue}' in vhost '{vhost}' {why}"),
        )
    })
}
