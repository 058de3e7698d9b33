//! The admin channel `warren ctl` talks to: a Unix socket `<data-dir>/warren.sock` (mode 0600:
//! only the broker's own user can use it, which is the access control), one JSON request line
//! in, one JSON response line out:
//!
//! ```text
//! -> {"verb": "list_queues", "args": {}}
//! <- {"ok": true, "result": [{"name": "q", "messages": 3, ...}]}
//! <- {"ok": false, "error": "NOT_FOUND - no queue 'x' in vhost '/'"}
//! ```

use anyhow::{Context, anyhow, bail};
use serde_json::{Value, json};
use std::path::Path;
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use warren_core::command::Op;
use warren_core::effect::Reply;
use warren_management::definitions as json;
use warren_member::Cluster;
use warren_runtime::tls::Reloadable;
use warren_runtime::{AdminRequest, AdminResponse, BrokerHandle};

/// Longest request accepted (an imported definitions file travels in one line).
const MAX_REQUEST: u64 = 64 << 20;
/// Admin connections served at once; more wait in the listen backlog.
const MAX_CLIENTS: usize = 16;

/// Binds the socket (replacing a stale one: the data dir's lock, taken before, proves no
/// other broker uses it).
pub fn bind(data_dir: &Path) -> anyhow::Result<UnixListener> {
    let path = data_dir.join("warren.sock");
    // A socket left by an earlier broker of this directory (the caller holds its lock).
    let _ = std::fs::remove_file(&path);
    // Owner-only from its creation: `serve` set the umask to 077 before anything, so no
    // other user can connect between bind and a chmod.
    UnixListener::bind(&path)
        .with_context(|| format!("cannot create the admin socket {}", path.display()))
}

/// Serves `warren ctl` until `stopped`. `cluster`: the node's cluster, on a cluster node
/// (its verbs answer that this node is not in one otherwise).
pub async fn serve(
    listener: UnixListener,
    cluster: Option<Cluster>,
    broker: BrokerHandle,
    management: Arc<warren_management::Management>,
    tls: Option<Arc<Reloadable>>,
    mut stopped: watch::Receiver<bool>,
) {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CLIENTS));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped.changed() => return,
        };
        let Ok((stream, _)) = accepted else {
            continue;
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let broker = broker.clone();
        let management = management.clone();
        let tls = tls.clone();
        let cluster = cluster.clone();
        tokio::spawn(async move {
            let tls = tls.as_deref();
            if let Err(e) = client(stream, cluster.as_ref(), &broker, &management, tls).await {
                tracing::warn!(
                    error = %warren_core::escape::Escaped(&format!("{e:#}")),
                    "admin request failed"
                );
            }
            drop(permit);
        });
    }
}

/// A request refused for its content (a parameter RabbitMQ's rules refuse): `warren ctl`
/// exits 2 on it, as on any input the operator must fix.
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// The cluster, or the answer of a node that is in none.
fn member(cluster: Option<&Cluster>) -> anyhow::Result<&Cluster> {
    cluster.ok_or_else(|| anyhow!("this node is not in a cluster (start it with --node-id)"))
}

async fn client(
    stream: UnixStream,
    cluster: Option<&Cluster>,
    broker: &BrokerHandle,
    management: &warren_management::Management,
    tls: Option<&Reloadable>,
) -> anyhow::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(tokio::io::AsyncReadExt::take(read, MAX_REQUEST));
    reader.read_line(&mut line).await?;
    let response = match handle(&line, cluster, broker, management, tls).await {
        Ok(result) => json!({"ok": true, "result": result}),
        Err(e) => json!({
            "ok": false, "error": format!("{e:#}"),
            "refused": e.downcast_ref::<Refused>().is_some(),
        }),
    };
    let mut out = serde_json::to_vec(&response)?;
    out.push(b'\n');
    write.write_all(&out).await?;
    Ok(())
}

fn arg<'a>(args: &'a Value, key: &str) -> anyhow::Result<&'a str> {
    args.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("missing argument '{key}'"))
}

async fn ask(broker: &BrokerHandle, request: AdminRequest) -> anyhow::Result<AdminResponse> {
    broker
        .admin(request)
        .await
        .map_err(|_| anyhow!("the broker is shutting down"))
}

/// The vhost a request is about (`-p`), `/` by default as in rabbitmqctl.
fn vhost(args: &Value) -> String {
    args.get("vhost")
        .and_then(Value::as_str)
        .unwrap_or("/")
        .to_string()
}

/// Whether a listed row belongs to the requested vhost.
fn in_vhost(args: &Value, row_vhost: &str) -> bool {
    args.get("vhost").and_then(Value::as_str).unwrap_or("/") == row_vhost
}

/// A permission row's listing filter, as rabbitmqctl's: a user's rows in every vhost
/// (`list_user_permissions`), else the rows of the asked vhost.
fn for_user_or_vhost(args: &Value, user: Option<&str>, row_user: &str, row_vhost: &str) -> bool {
    match user {
        Some(u) => row_user == u,
        None => in_vhost(args, row_vhost),
    }
}

async fn done(broker: &BrokerHandle, request: AdminRequest) -> anyhow::Result<Value> {
    match ask(broker, request).await? {
        AdminResponse::Done(Ok(())) => Ok(json!({})),
        AdminResponse::Done(Err(e)) => bail!("{e}"),
        other => bail!("unexpected answer {other:?}"),
    }
}

/// A password hash as RabbitMQ makes it, with a fresh random salt.
fn hash_password(password: &str) -> anyhow::Result<Vec<u8>> {
    warren_management::hash_password(password)
        .context("cannot read /dev/urandom for a password salt")
}

fn tags(args: &Value) -> Vec<String> {
    args.get("tags")
        .and_then(Value::as_array)
        .map(|t| {
            t.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

async fn op(broker: &BrokerHandle, vhost: String, op: Op) -> anyhow::Result<Option<Reply>> {
    match ask(broker, AdminRequest::Op { vhost, op }).await? {
        AdminResponse::Op(Ok(reply)) => Ok(reply),
        AdminResponse::Op(Err(e)) => bail!("{e}"),
        other => bail!("unexpected answer {other:?}"),
    }
}

/// Verbs whose listing is scoped to a vhost: an unknown vhost is an error, not an empty
/// table (as rabbitmqctl).
const VHOST_SCOPED: [&str; 9] = [
    "list_queues",
    "list_exchanges",
    "list_bindings",
    "list_consumers",
    "list_policies",
    "list_parameters",
    "list_permissions",
    "list_topic_permissions",
    "list_scheduled",
];

async fn handle(
    line: &str,
    cluster: Option<&Cluster>,
    broker: &BrokerHandle,
    management: &warren_management::Management,
    tls: Option<&Reloadable>,
) -> anyhow::Result<Value> {
    let request: Value = serde_json::from_str(line).context("the request is not JSON")?;
    let verb = request
        .get("verb")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("the request has no verb"))?;
    let args = request.get("args").cloned().unwrap_or(Value::Null);
    if VHOST_SCOPED.contains(&verb) && args.get("user").is_none() {
        let vh = vhost(&args);
        let known = match ask(broker, AdminRequest::ListVhosts).await? {
            AdminResponse::Vhosts(vs) => vs.iter().any(|v| v.name == vh),
            other => bail!("unexpected answer {other:?}"),
        };
        if !known {
            bail!("Virtual host '{vh}' does not exist");
        }
    }
    Ok(match verb {
        // As SIGHUP: new connections get the files' certificate, open ones keep theirs.
        "reload_tls" => {
            let cluster = cluster.map_or(Ok(false), Cluster::reload_tls)?;
            if cluster {
                tracing::info!("warren ctl reload-tls: cluster TLS files reloaded");
            }
            match tls {
                Some(tls) => {
                    tls.reload()?;
                    tracing::info!("warren ctl reload-tls: TLS certificate files reloaded");
                    json!({})
                }
                None if cluster => json!({}),
                None => bail!(
                    "no TLS listener is configured (--tls-cert, --tls-key, or --cluster-tls-*)"
                ),
            }
        }
        "ping" => match ask(broker, AdminRequest::MemoryStatus).await? {
            AdminResponse::Memory(_) => json!("pong"),
            other => bail!("unexpected answer {other:?}"),
        },
        "cluster_status" => {
            let alarms = match ask(broker, AdminRequest::MemoryStatus).await? {
                AdminResponse::Memory(m) if m.alarm => vec!["memory"],
                _ => Vec::new(),
            };
            member(cluster)?.status(&alarms)?
        }
        "forget_node" => {
            let id = args
                .get("id")
                .and_then(Value::as_u64)
                .ok_or_else(|| anyhow!("missing argument 'id' (a node id)"))?;
            member(cluster)?.forget(id).await?;
            json!({})
        }
        "join" => {
            let id = args
                .get("id")
                .and_then(Value::as_u64)
                .ok_or_else(|| anyhow!("missing argument 'id' (a node id)"))?;
            let addr = args
                .get("addr")
                .and_then(Value::as_str)
                .ok_or_else(|| anyhow!("missing argument 'addr' (IP:PORT)"))?;
            member(cluster)?.join(id, addr).await?;
            json!({})
        }
        "leave" => {
            member(cluster)?.leave().await?;
            json!({})
        }
        "quorum_grow" | "quorum_shrink" => {
            let node = args
                .get("node")
                .and_then(Value::as_u64)
                .ok_or_else(|| anyhow!("missing argument 'node' (a node id)"))?;
            let repl = member(cluster)?.replication();
            json!(repl.grow_or_shrink(node, verb == "quorum_grow").await)
        }
        "quorum_add_member" | "quorum_delete_member" => {
            let node = args
                .get("node")
                .and_then(Value::as_u64)
                .ok_or_else(|| anyhow!("missing argument 'node' (a node id)"))?;
            let queue = args
                .get("queue")
                .and_then(Value::as_str)
                .ok_or_else(|| anyhow!("missing argument 'queue'"))?;
            let repl = member(cluster)?.replication();
            let vh = vhost(&args);
            if verb == "quorum_add_member" {
                repl.add_member(&vh, queue, node).await
            } else {
                repl.delete_member(&vh, queue, node).await
            }
            .map_err(|e| anyhow!(e))?;
            json!({})
        }
        "status" => management
            .status()
            .await
            .map_err(|e| anyhow!("{e}"))?,
        "set_vm_memory_high_watermark" => {
            let bytes = match args.get("absolute").and_then(Value::as_u64) {
                Some(bytes) => bytes,
                None => {
                    let fraction = args
                        .get("fraction")
                        .and_then(Value::as_f64)
                        .ok_or_else(|| anyhow!("missing argument 'fraction'"))?;
                    crate::settings::watermark_bytes(&fraction.to_string()).map_err(|e| anyhow!("{e}"))?
                }
            };
            done(broker, AdminRequest::SetMemoryWatermark(bytes)).await?;
            json!({"bytes": bytes})
        }
        "close_connection" => {
            let id = arg(&args, "id")?;
            let conn = id
                .parse::<u64>()
                .map_err(|_| anyhow!("connection id '{id}' is not a number (see list_connections)"))?;
            let reason = arg(&args, "reason")?.to_string();
            match ask(
                broker,
                AdminRequest::CloseConnection {
                    conn: warren_core::ids::ConnId(conn),
                    reason,
                },
            )
            .await?
            {
                AdminResponse::Closed(true) => json!({}),
                AdminResponse::Closed(false) => bail!("no connection with id {conn}"),
                other => bail!("unexpected answer {other:?}"),
            }
        }
        "list_channels" => match ask(broker, AdminRequest::ListChannels).await? {
            AdminResponse::Channels(cs) => cs
                .iter()
                .map(|c| {
                    json!({
                        "connection": c.conn.0, "number": c.channel, "vhost": c.vhost,
                        "user": c.user, "consumer_count": c.consumers,
                        "messages_unacknowledged": c.unacked, "prefetch_count": c.prefetch,
                        "global_prefetch_count": c.global_prefetch, "confirm": c.confirm,
                        "transactional": c.transactional, "published": c.stats.publish,
                        "delivered": c.stats.deliver_get, "acked": c.stats.ack,
                    })
                })
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "list_queues" => match ask(broker, AdminRequest::ListQueues).await? {
            AdminResponse::Queues(qs) => qs
                .iter()
                .filter(|q| in_vhost(&args, &q.vhost))
                .map(|q| {
                    json!({
                        "vhost": q.vhost, "name": q.name, "type": q.queue_type.name(),
                        "messages": q.messages_ready + q.messages_unacked,
                        "messages_ready": q.messages_ready,
                        "messages_unacknowledged": q.messages_unacked,
                        "consumers": q.consumers, "memory": q.memory, "paged_out": q.paged_out,
                        "messages_dlx": q.messages_dlx,
                        "durable": q.durable, "auto_delete": q.auto_delete,
                        "exclusive": q.exclusive, "arguments": json::table(&q.arguments),
                        // A replicated quorum queue's group leader (the node serving it).
                        "leader": cluster.and_then(|c| c.quorum_leader(&q.vhost, &q.name)),
                    })
                })
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "list_exchanges" => match ask(broker, AdminRequest::ListExchanges).await? {
            AdminResponse::Exchanges(xs) => xs
                .iter()
                .filter(|x| in_vhost(&args, &x.vhost))
                .map(|x| {
                    json!({
                        "vhost": x.vhost, "name": x.name, "type": x.kind, "durable": x.durable,
                        "auto_delete": x.auto_delete, "internal": x.internal,
                        "arguments": json::table(&x.arguments),
                    })
                })
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "list_bindings" => match ask(broker, AdminRequest::ListBindings).await? {
            AdminResponse::Bindings(bs) => bs
                .iter()
                .filter(|b| in_vhost(&args, &b.vhost))
                .map(|b| {
                    json!({
                        "vhost": b.vhost, "source_name": b.source, "destination_name": b.destination,
                        "destination_kind": if b.destination_is_exchange { "exchange" } else { "queue" },
                        "routing_key": b.routing_key, "arguments": json::table(&b.arguments),
                    })
                })
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "list_connections" => match ask(broker, AdminRequest::ListConnections).await? {
            AdminResponse::Connections(cs) => {
                let meta: std::collections::HashMap<_, _> =
                    broker.connection_meta().into_iter().collect();
                cs.iter()
                    .map(|c| {
                        let m = meta.get(&c.conn);
                        json!({
                            "id": c.conn.0, "vhost": c.vhost, "user": c.user,
                            "peer": m.map(|m| &*m.peer),
                            "protocol": m.map(|m| m.protocol),
                            "client_id": m.and_then(|m| m.client_id.as_deref()),
                            "client_name": m
                                .and_then(|m| m.client_properties.as_deref())
                                .and_then(|p| p.get("connection_name"))
                                .map(json::value),
                            "ssl": m.is_some_and(|m| m.tls),
                            "channels": c.channels,
                            "consumers": c.consumers, "in_flight": c.in_flight,
                            "state": if c.paused_by > 0 { "flow" } else { "running" },
                            "published": c.stats.publish, "delivered": c.stats.deliver_get,
                            "acked": c.stats.ack,
                        })
                    })
                    .collect()
            }
            other => bail!("unexpected answer {other:?}"),
        },
        "list_consumers" => match ask(broker, AdminRequest::ListConsumers).await? {
            AdminResponse::Consumers(cs) => cs
                .iter()
                .filter(|c| in_vhost(&args, &c.vhost))
                .map(|c| {
                    json!({
                        "vhost": c.vhost, "queue_name": c.queue, "consumer_tag": c.tag,
                        "connection": c.conn.0, "channel": c.channel,
                        "ack_required": c.ack_required, "exclusive": c.exclusive,
                        "prefetch_count": c.prefetch, "priority": c.priority,
                        "unacked": c.unacked,
                    })
                })
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "list_scheduled" => match ask(broker, AdminRequest::ListScheduled).await? {
            AdminResponse::Scheduled(s) => s
                .iter()
                .filter(|s| in_vhost(&args, &s.vhost))
                .map(|s| json!({"vhost": s.vhost, "exchange": s.exchange,
                                "messages": s.messages, "next_due": s.next_due}))
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "purge_scheduled" => {
            let (vhost, exchange) = (vhost(&args), arg(&args, "exchange")?);
            let exchange = exchange.to_string();
            match ask(broker, AdminRequest::PurgeScheduled { vhost, exchange }).await? {
                AdminResponse::Dropped(n) => json!({ "messages": n }),
                other => bail!("unexpected answer {other:?}"),
            }
        }
        "purge_queue" => {
            let reply = op(
                broker,
                vhost(&args),
                Op::QueuePurge {
                    queue: arg(&args, "name")?.to_string(),
                    nowait: false,
                },
            )
            .await?;
            match reply {
                Some(Reply::QueuePurgeOk { message_count }) => json!({"messages": message_count}),
                other => bail!("unexpected reply {other:?}"),
            }
        }
        "delete_queue" => {
            let name = arg(&args, "name")?.to_string();
            let vh = vhost(&args);
            // queue.delete of a missing queue succeeds in AMQP; an operator wants to know.
            let exists = match ask(broker, AdminRequest::ListQueues).await? {
                AdminResponse::Queues(qs) => qs.iter().any(|q| q.name == name && q.vhost == vh),
                _ => true,
            };
            if !exists {
                bail!("NOT_FOUND - no queue '{name}' in vhost '{vh}'");
            }
            let flag = |k: &str| args.get(k).and_then(Value::as_bool).unwrap_or(false);
            let reply = op(
                broker,
                vh,
                Op::QueueDelete {
                    queue: name,
                    if_unused: flag("if_unused"),
                    if_empty: flag("if_empty"),
                    nowait: false,
                },
            )
            .await?;
            match reply {
                Some(Reply::QueueDeleteOk { message_count }) => json!({"messages": message_count}),
                other => bail!("unexpected reply {other:?}"),
            }
        }
        "set_policy" => {
            let p = args
                .as_object()
                .ok_or_else(|| anyhow!("set_policy takes an object"))?;
            done(broker, AdminRequest::SetPolicy(json::policy(p)?)).await?
        }
        "clear_policy" => {
            let name = arg(&args, "name")?.to_string();
            done(
                broker,
                AdminRequest::ClearPolicy {
                    vhost: vhost(&args),
                    name,
                },
            )
            .await?
        }
        "list_policies" => match ask(broker, AdminRequest::ListPolicies).await? {
            AdminResponse::Policies(ps) => ps
                .iter()
                .filter(|p| in_vhost(&args, &p.vhost))
                .map(|p| {
                    json!({
                        "vhost": p.vhost, "name": p.name, "pattern": p.pattern,
                        "apply-to": p.apply_to.as_str(),
                        "definition": json::table(&p.definition), "priority": p.priority,
                    })
                })
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "set_parameter" => {
            let component = arg(&args, "component")?.to_string();
            let name = arg(&args, "name")?.to_string();
            let value = args
                .get("value")
                .ok_or_else(|| anyhow!("missing argument 'value'"))?;
            let vhost = vhost(&args);
            management
                .validate_parameter(&component, &vhost, &name, value)
                .map_err(|e| Refused(e.trim_end().to_string()))?;
            let def = warren_core::parameter::ParameterDef {
                component,
                vhost,
                name,
                value: value.to_string(),
            };
            let answer = done(broker, AdminRequest::SetParameter(def)).await?;
            management.parameters_changed();
            answer
        }
        "clear_parameter" => {
            let request = AdminRequest::ClearParameter {
                vhost: vhost(&args),
                component: arg(&args, "component")?.to_string(),
                name: arg(&args, "name")?.to_string(),
            };
            let answer = done(broker, request).await?;
            management.parameters_changed();
            answer
        }
        "list_parameters" => match ask(broker, AdminRequest::ListParameters).await? {
            AdminResponse::Parameters(ps) => ps
                .iter()
                .filter(|p| in_vhost(&args, &p.vhost))
                .map(|p| {
                    let value: Value = serde_json::from_str(&p.value).unwrap_or(Value::Null);
                    json!({"vhost": p.vhost, "component": p.component, "name": p.name,
                           "value": value})
                })
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "shovel_status" => Value::Array(management.shovel_status()),
        "bridge_status" => Value::Array(management.bridge_status()),
        "export_definitions" => match ask(broker, AdminRequest::Definitions).await? {
            AdminResponse::Definitions(defs) => json::export(&defs),
            other => bail!("unexpected answer {other:?}"),
        },
        "import_definitions" => {
            let doc = args
                .get("definitions")
                .ok_or_else(|| anyhow!("missing argument 'definitions'"))?;
            let mut imported = json::import(doc)?;
            json::check_parameters(&mut imported, |c, h, n, v| {
                management.validate_parameter(c, h, n, v)
            });
            let answer = ask(broker, AdminRequest::Import(imported.definitions)).await?;
            management.parameters_changed();
            match answer {
                // What the broker imported, not what the file held: a refused definition
                // is an error, not a count.
                AdminResponse::Imported(r) => json!({
                    "imported": {
                        "vhosts": r.vhosts, "users": r.users, "permissions": r.permissions,
                        "topic_permissions": r.topic_permissions, "policies": r.policies,
                        "parameters": r.parameters,
                        "exchanges": r.exchanges, "queues": r.queues, "bindings": r.bindings,
                    },
                    "errors": r.errors,
                    "skipped": imported.skipped,
                }),
                other => bail!("unexpected answer {other:?}"),
            }
        }
        "add_vhost" => {
            let def = warren_core::access::VhostDef {
                name: arg(&args, "name")?.to_string(),
                description: args
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            };
            done(broker, AdminRequest::AddVhost(def)).await?
        }
        "delete_vhost" => {
            done(broker, AdminRequest::DeleteVhost(arg(&args, "name")?.into())).await?
        }
        "list_vhosts" => match ask(broker, AdminRequest::ListVhosts).await? {
            AdminResponse::Vhosts(vs) => vs
                .iter()
                .map(|v| json!({"name": v.name, "description": v.description}))
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "add_user" => {
            let user = warren_core::access::UserDef {
                name: arg(&args, "name")?.to_string(),
                password_hash: hash_password(arg(&args, "password")?)?,
                tags: tags(&args),
            };
            done(broker, AdminRequest::AddUser(user)).await?
        }
        "change_password" => {
            let request = AdminRequest::ChangePassword {
                user: arg(&args, "name")?.to_string(),
                password_hash: hash_password(arg(&args, "password")?)?,
            };
            done(broker, request).await?
        }
        "set_user_tags" => {
            let request = AdminRequest::SetUserTags {
                user: arg(&args, "name")?.to_string(),
                tags: tags(&args),
            };
            done(broker, request).await?
        }
        "delete_user" => done(broker, AdminRequest::DeleteUser(arg(&args, "name")?.into())).await?,
        "list_users" => match ask(broker, AdminRequest::ListUsers).await? {
            AdminResponse::Users(us) => us
                .iter()
                .map(|u| json!({"user": u.name, "tags": u.tags}))
                .collect(),
            other => bail!("unexpected answer {other:?}"),
        },
        "set_permissions" => {
            let p = warren_core::access::PermissionDef {
                vhost: vhost(&args),
                user: arg(&args, "user")?.to_string(),
                configure: arg(&args, "configure")?.to_string(),
                write: arg(&args, "write")?.to_string(),
                read: arg(&args, "read")?.to_string(),
            };
            done(broker, AdminRequest::SetPermissions(p)).await?
        }
        "clear_permissions" => {
            let request = AdminRequest::ClearPermissions {
                vhost: vhost(&args),
                user: arg(&args, "user")?.to_string(),
            };
            done(broker, request).await?
        }
        "list_permissions" | "list_user_permissions" => {
            let user = args.get("user").and_then(Value::as_str);
            match ask(broker, AdminRequest::ListPermissions).await? {
                AdminResponse::Permissions(ps) => ps
                    .iter()
                    .filter(|p| for_user_or_vhost(&args, user, &p.user, &p.vhost))
                    .map(|p| {
                        json!({
                            "vhost": p.vhost, "user": p.user, "configure": p.configure,
                            "write": p.write, "read": p.read,
                        })
                    })
                    .collect(),
                other => bail!("unexpected answer {other:?}"),
            }
        }
        "set_topic_permissions" => {
            let p = warren_core::access::TopicPermissionDef {
                vhost: vhost(&args),
                user: arg(&args, "user")?.to_string(),
                exchange: arg(&args, "exchange")?.to_string(),
                write: arg(&args, "write")?.to_string(),
                read: arg(&args, "read")?.to_string(),
            };
            done(broker, AdminRequest::SetTopicPermissions(p)).await?
        }
        "clear_topic_permissions" => {
            let request = AdminRequest::ClearTopicPermissions {
                vhost: vhost(&args),
                user: arg(&args, "user")?.to_string(),
                exchange: args
                    .get("exchange")
                    .and_then(Value::as_str)
                    .map(str::to_string),
            };
            done(broker, request).await?
        }
        "list_topic_permissions" | "list_user_topic_permissions" => {
            let user = args.get("user").and_then(Value::as_str);
            match ask(broker, AdminRequest::ListTopicPermissions).await? {
                AdminResponse::TopicPermissions(ps) => ps
                    .iter()
                    .filter(|p| for_user_or_vhost(&args, user, &p.user, &p.vhost))
                    .map(|p| {
                        json!({
                            "vhost": p.vhost, "user": p.user, "exchange": p.exchange,
                            "write": p.write, "read": p.read,
                        })
                    })
                    .collect(),
                other => bail!("unexpected answer {other:?}"),
            }
        }
        other => bail!(
            "unknown verb '{other}' (list_queues, list_exchanges, list_bindings, list_connections, \
             list_channels, close_connection, status, ping, set_vm_memory_high_watermark, \
             list_consumers, purge_queue, delete_queue, set_policy, clear_policy, list_policies, \
             set_parameter, clear_parameter, list_parameters, shovel_status, bridge_status, \
             list_scheduled, \
             purge_scheduled, \
             export_definitions, import_definitions, add_vhost, delete_vhost, list_vhosts, \
             add_user, delete_user, change_password, set_user_tags, list_users, set_permissions, \
             clear_permissions, list_permissions, list_user_permissions, set_topic_permissions, \
             clear_topic_permissions, list_topic_permissions, list_user_topic_permissions)"
        ),
    })
}
