//! The TCP listener: accepts sockets and runs one connection task each.

use crate::config::MqttConfig;
use crate::connection::{
    DelayedWill, PeerInfo, now_ms, publish_delayed_will, publish_will, serve_connection,
};
use crate::record::{SessionRecord, decode_will};
use crate::registry::{EXPIRY_TASK, Registry};
use crate::session::session_queue;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use warren_core::command::Op;
use warren_core::escape::Escaped;
use warren_core::mqtt::StoredWill;
use warren_runtime::listener::{accept_loop, is_loopback};
use warren_runtime::{AdminRequest, AdminResponse, BrokerHandle};

/// How long the expiry task sleeps when no session can expire (it is woken earlier when
/// one is stored).
const IDLE_EXPIRY_CHECK: Duration = Duration::from_secs(3600);
/// Sessions ended in one go before the task looks at shutdown again.
const EXPIRE_BATCH: usize = 1000;

/// Accepts MQTT connections until `shutdown` turns true, then closes them (v5: DISCONNECT
/// 0x8B server shutting down) and waits for them, bounded.
pub async fn serve(
    listener: TcpListener,
    broker: BrokerHandle,
    config: Arc<MqttConfig>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    serve_with(
        listener,
        broker,
        Arc::new(Registry::new()),
        config,
        shutdown,
    )
    .await
}

/// As [`serve`], with a registry shared with other listeners (or in-process connections).
pub async fn serve_with(
    listener: TcpListener,
    broker: BrokerHandle,
    registry: Arc<Registry>,
    config: Arc<MqttConfig>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let sessions = start_session_tasks(&broker, &registry, &config, &shutdown);
    let stop = shutdown.clone();
    let served = accept_loop(listener, shutdown, move |socket, addr| {
        let peer = PeerInfo {
            addr: addr.to_string(),
            is_loopback: is_loopback(&addr),
            identity: None,
            tls: false,
        };
        serve_connection(
            socket,
            peer,
            broker.clone(),
            registry.clone(),
            config.clone(),
            stop.clone(),
        )
    })
    .await;
    sessions.abort();
    served
}

/// The work of a registry that no connection does: delayed wills restored from storage,
/// and the expiry of offline sessions. Started once per registry, however many listeners
/// serve it; ends at shutdown (or when the handle is aborted).
pub fn start_session_tasks(
    broker: &BrokerHandle,
    registry: &Arc<Registry>,
    config: &Arc<MqttConfig>,
    shutdown: &watch::Receiver<bool>,
) -> JoinHandle<()> {
    for (client_id, will) in registry.take_restored_wills() {
        schedule_restored_will(client_id, will, broker, registry, config);
    }
    let expiry = tokio::spawn(expire_sessions(
        broker.clone(),
        registry.clone(),
        config.clone(),
        shutdown.clone(),
    ));
    let Some(interval) = config.sys_interval.filter(|i| !i.is_zero()) else {
        return expiry;
    };
    let sys = tokio::spawn(crate::sys::publish_sys_topics(
        broker.clone(),
        registry.clone(),
        config.clone(),
        interval,
        shutdown.clone(),
    ));
    // One handle for both: aborting it (at shutdown) ends both tasks.
    tokio::spawn(async move {
        struct AbortOnDrop(JoinHandle<()>);
        impl Drop for AbortOnDrop {
            fn drop(&mut self) {
                self.0.abort();
            }
        }
        let _sys = AbortOnDrop(sys);
        let mut expiry = AbortOnDrop(expiry);
        let _ = (&mut expiry.0).await;
    })
}

/// Schedules a delayed will read back from storage for the time it was due (at once when
/// that passed while the broker was down); a reconnect of its client id cancels it.
fn schedule_restored_will(
    client_id: Arc<str>,
    will: StoredWill,
    broker: &BrokerHandle,
    registry: &Arc<Registry>,
    config: &Arc<MqttConfig>,
) {
    let Some(decoded) = decode_will(&will.publish) else {
        tracing::warn!(client_id = %Escaped(&client_id), "stored will is no MQTT 5 PUBLISH; dropped");
        return;
    };
    registry.delay_will(client_id.clone(), EXPIRY_TASK);
    tokio::spawn(publish_delayed_will(
        DelayedWill {
            delay_ms: will.due_at.saturating_sub(now_ms()),
            will: decoded,
            user: will.user,
        },
        client_id,
        EXPIRY_TASK,
        broker.clone(),
        registry.clone(),
        config.clone(),
    ));
}

/// Ends offline sessions when their expiry interval runs out (MQTT 5 3.1.2.11.2): publishes
/// a will still waiting, deletes the session queue and the stored session. Sleeps until
/// the next expiry (woken when an earlier one is stored), so an expiry is exact to the
/// timer's resolution, also for sessions restored after a restart.
async fn expire_sessions(
    broker: BrokerHandle,
    registry: Arc<Registry>,
    config: Arc<MqttConfig>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let wait = registry.next_expiry().map_or(IDLE_EXPIRY_CHECK, |at| {
            Duration::from_millis(at.saturating_sub(now_ms()))
        });
        tokio::select! {
            biased;
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    return;
                }
                continue;
            }
            _ = registry.expiry_changed() => continue,
            _ = tokio::time::sleep(wait) => {}
        }
        let now = now_ms();
        let mut ended = 0;
        while ended < EXPIRE_BATCH {
            let (kick, mut kicked) = oneshot::channel();
            let Some((client_id, record)) = registry.claim_expired(now, kick) else {
                break;
            };
            let owned = match registry.cluster() {
                // Ended only if this node still owns it in the cluster (no other node
                // resumed it meanwhile).
                Some(c) => c.expire(&client_id).await,
                None => true,
            };
            if owned {
                end_session(&broker, &registry, &config, &client_id, record).await;
            } else {
                tracing::info!(client_id = %Escaped(&client_id), "MQTT session moved to another node; not expired here");
                registry.forget_local(&client_id);
            }
            registry.release(&client_id, EXPIRY_TASK);
            // A client that connected meanwhile waits for this answer (as for a takeover).
            if let Ok(done) = kicked.try_recv() {
                let _ = done.send(());
            }
            ended += 1;
        }
        if ended == 0 && registry.next_expiry().is_some_and(|at| at <= now) {
            // What is due belongs to clients connecting right now: they end or resume it.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Ends an expired offline session.
async fn end_session(
    broker: &BrokerHandle,
    registry: &Registry,
    config: &MqttConfig,
    client_id: &str,
    record: SessionRecord,
) {
    if let Some(w) = &record.will
        && registry.cancel_will(client_id)
        && let Some(will) = decode_will(&w.publish)
    {
        // The will waits for its delay or the session's end, whichever comes first.
        publish_will(&will, w.user.clone(), client_id, broker, config).await;
    }
    if record.has_queue {
        let op = Op::QueueDelete {
            queue: session_queue(client_id),
            if_unused: false,
            if_empty: false,
            nowait: false,
        };
        let request = AdminRequest::Op {
            vhost: config.vhost.clone(),
            op,
        };
        match broker.admin(request).await {
            Ok(AdminResponse::Op(Ok(_))) => {}
            other => {
                tracing::warn!(
                    client_id = %Escaped(client_id),
                    other = %Escaped(&format!("{other:?}")),
                    "cannot delete the queue of an expired MQTT session"
                )
            }
        }
    }
    registry.persist_session(client_id, None);
    tracing::info!(client_id = %Escaped(client_id), "MQTT session expired");
}
