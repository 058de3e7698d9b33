//! `warren ctl`: rabbitmqctl's common verbs against a running broker, over its admin socket
//! (`<data-dir>/warren.sock`, see `admin.rs`). Aligned tables for people, `--format json` for
//! scripts.

use anyhow::{Context, bail};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// A request the broker refused for its content (a parameter RabbitMQ's rules refuse):
/// exit code 2, as any input the operator must fix.
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

#[derive(clap::Args)]
pub struct CtlArgs {
    /// The data directory of the broker to talk to (its admin socket lives there).
    #[arg(long, default_value = "./warren-data")]
    data_dir: PathBuf,
    /// `table` (aligned columns) or `json`.
    #[arg(long, default_value = "table", value_parser = ["table", "json"])]
    format: String,
    /// The vhost of vhost-scoped verbs (queues, exchanges, bindings, consumers, policies,
    /// permissions), as rabbitmqctl's `-p`.
    #[arg(short = 'p', long = "vhost", default_value = "/", global = true)]
    vhost: String,
    #[command(subcommand)]
    verb: Verb,
}

/// `warren ctl quorum ...`: membership changes of quorum queues' groups, through openraft's
/// membership change (a new member is a learner until it caught up, then a voter).
#[derive(clap::Subcommand)]
enum QuorumVerb {
    /// Adds node NODE to every quorum queue's group it is not a member of (after a `join`)
    Grow { node: u64 },
    /// Removes node NODE from every quorum queue's group it is a member of (before a
    /// `forget-node`), except where it is the last member
    Shrink { node: u64 },
    /// Adds node NODE to queue QUEUE's group (in the vhost of -p)
    #[command(alias = "add_member")]
    AddMember { queue: String, node: u64 },
    /// Removes node NODE from queue QUEUE's group (in the vhost of -p)
    #[command(alias = "delete_member")]
    DeleteMember { queue: String, node: u64 },
}

#[derive(clap::Subcommand)]
enum Verb {
    /// Queues: name, messages, consumers, memory; or the COLUMNS given (e.g. name
    /// messages_ready messages_unacknowledged).
    #[command(alias = "list_queues")]
    ListQueues { columns: Vec<String> },
    /// Exchanges: name, type, durable, auto_delete, internal (or the COLUMNS given).
    #[command(alias = "list_exchanges")]
    ListExchanges { columns: Vec<String> },
    /// Bindings: source, destination, routing key (or the COLUMNS given).
    #[command(alias = "list_bindings")]
    ListBindings { columns: Vec<String> },
    /// Client connections: id, peer, protocol, user, client id, TLS, channels (or the COLUMNS).
    #[command(alias = "list_connections")]
    ListConnections { columns: Vec<String> },
    /// Channels: connection, number, user, consumers, unacked, prefetch (or the COLUMNS).
    #[command(alias = "list_channels")]
    ListChannels { columns: Vec<String> },
    /// Consumers: queue, tag, connection, channel, ack mode, prefetch (or the COLUMNS).
    #[command(alias = "list_consumers")]
    ListConsumers { columns: Vec<String> },
    /// Closes a client connection (ID from list-connections) with REASON (320
    /// CONNECTION_FORCED, as rabbitmqctl close_connection).
    #[command(alias = "close_connection")]
    CloseConnection { id: String, reason: String },
    /// The node: version, uptime, listeners, memory and its alarm, free disk.
    Status,
    /// Checks that the broker answers.
    Ping,
    /// The cluster as this node sees it: its role and term, the leader, its last log
    /// index, and each member with how far it lags (known on the leader)
    #[command(alias = "cluster_status")]
    ClusterStatus,
    /// Removes node ID, gone for good, from the cluster (rabbitmqctl's forget_cluster_node):
    /// the others stop counting it for a majority
    #[command(alias = "forget_node")]
    ForgetNode { id: u64 },
    /// Adds node ID, started with --join and listening at ADDR (its --cluster), to the
    /// cluster this node is in (rabbitmqctl's join_cluster, run on a member): answered once it
    /// caught up and votes
    #[command(alias = "join_cluster")]
    Join { id: u64, addr: String },
    /// This node leaves the cluster (the others stop counting it); stop it and clear its
    /// data dir afterwards (rabbitmqctl's reset)
    Leave,
    /// Quorum queues' members (rabbitmq-queues): grow, shrink, add-member, delete-member
    #[command(subcommand)]
    Quorum(QuorumVerb),
    /// Sets the memory alarm threshold now: a FRACTION of RAM (0.4), or `absolute BYTES`.
    #[command(alias = "set_vm_memory_high_watermark")]
    SetVmMemoryHighWatermark { value: String, bytes: Option<u64> },
    /// Drops a queue's ready messages.
    #[command(alias = "purge_queue")]
    PurgeQueue { name: String },
    /// Deletes a queue (with its messages); `--if-unused`, `--if-empty` as queue.delete.
    #[command(alias = "delete_queue")]
    DeleteQueue {
        name: String,
        #[arg(long)]
        if_unused: bool,
        #[arg(long)]
        if_empty: bool,
    },
    /// Adds or replaces a policy, as rabbitmqctl set_policy: DEFINITION is JSON, e.g.
    /// '{"max-length": 1000, "dead-letter-exchange": "dlx"}'.
    #[command(alias = "set_policy")]
    SetPolicy {
        name: String,
        pattern: String,
        definition: String,
        #[arg(long, default_value_t = 0)]
        priority: i64,
        #[arg(long, default_value = "all", value_parser = ["all", "queues", "exchanges"])]
        apply_to: String,
    },
    /// Removes a policy.
    #[command(alias = "clear_policy")]
    ClearPolicy { name: String },
    /// Policies in the vhost (`-p`).
    #[command(alias = "list_policies")]
    ListPolicies,
    /// Sets a runtime parameter, as rabbitmqctl set_parameter: COMPONENT (shovel), NAME and
    /// VALUE (JSON), e.g. shovel s1 '{"src-uri": "amqp://", "src-queue": "a",
    /// "dest-uri": "amqp://", "dest-queue": "b"}'. A value RabbitMQ's rules refuse exits 2.
    #[command(alias = "set_parameter")]
    SetParameter {
        component: String,
        name: String,
        value: String,
    },
    /// Removes a runtime parameter (a shovel's stops it).
    #[command(alias = "clear_parameter")]
    ClearParameter { component: String, name: String },
    /// Runtime parameters in the vhost (`-p`).
    #[command(alias = "list_parameters")]
    ListParameters,
    /// The shovels running on this broker: state (starting, running, terminated with the
    /// reason), ends, messages moved.
    #[command(alias = "shovel_status")]
    ShovelStatus,
    /// The MQTT bridges of the config file ([[bridge]]): state, the address connected to,
    /// messages out and in, drops, reconnects (as GET /api/bridges).
    #[command(alias = "bridge_status")]
    BridgeStatus,
    /// Delayed messages per exchange in the vhost (`-p`): how many, and the earliest due
    /// (ms since the epoch; empty when all are paged out to the store). docs/delayed.md.
    #[command(alias = "list_scheduled")]
    ListScheduled,
    /// Drops every delayed message of an exchange in the vhost (`-p`).
    #[command(alias = "purge_scheduled")]
    PurgeScheduled { exchange: String },
    /// Writes the durable definitions in RabbitMQ's format to FILE (`-`: standard output).
    #[command(alias = "export_definitions")]
    ExportDefinitions { file: String },
    /// Declares what a definitions file (RabbitMQ's format, e.g. from rabbitmqctl
    /// export_definitions) holds.
    #[command(alias = "import_definitions")]
    ImportDefinitions { file: PathBuf },
    /// Adds a vhost.
    #[command(alias = "add_vhost")]
    AddVhost {
        name: String,
        #[arg(long, default_value = "")]
        description: String,
    },
    /// Deletes a vhost with everything in it; its connections are closed.
    #[command(alias = "delete_vhost")]
    DeleteVhost { name: String },
    /// Vhosts: name, description.
    #[command(alias = "list_vhosts")]
    ListVhosts,
    /// Adds a user (password stored as a salted SHA-256 hash, as RabbitMQ).
    #[command(alias = "add_user")]
    AddUser { name: String, password: String },
    /// Deletes a user with its permissions; its connections are closed.
    #[command(alias = "delete_user")]
    DeleteUser { name: String },
    /// Replaces a user's password.
    #[command(alias = "change_password")]
    ChangePassword { name: String, password: String },
    /// Replaces a user's tags (e.g. administrator, monitoring); none clears them.
    #[command(alias = "set_user_tags")]
    SetUserTags { name: String, tags: Vec<String> },
    /// Users and their tags.
    #[command(alias = "list_users")]
    ListUsers,
    /// Sets a user's configure, write and read permission patterns in the vhost (`-p`).
    #[command(alias = "set_permissions")]
    SetPermissions {
        user: String,
        configure: String,
        write: String,
        read: String,
    },
    /// Removes a user's permissions in the vhost (`-p`).
    #[command(alias = "clear_permissions")]
    ClearPermissions { user: String },
    /// Permissions in the vhost (`-p`).
    #[command(alias = "list_permissions")]
    ListPermissions,
    /// A user's permissions in every vhost.
    #[command(alias = "list_user_permissions")]
    ListUserPermissions { user: String },
    /// Sets a user's topic permissions on a topic exchange in the vhost (`-p`): regexes over
    /// the routing keys it may publish with (write) and bind or subscribe with (read);
    /// `{username}`, `{vhost}` and (MQTT) `{client_id}` expand to the connection's own.
    #[command(alias = "set_topic_permissions")]
    SetTopicPermissions {
        user: String,
        exchange: String,
        write: String,
        read: String,
    },
    /// Removes a user's topic permissions in the vhost (`-p`): on one exchange, or all.
    #[command(alias = "clear_topic_permissions")]
    ClearTopicPermissions {
        user: String,
        exchange: Option<String>,
    },
    /// Topic permissions in the vhost (`-p`).
    #[command(alias = "list_topic_permissions")]
    ListTopicPermissions,
    /// A user's topic permissions in every vhost.
    #[command(alias = "list_user_topic_permissions")]
    ListUserTopicPermissions { user: String },
    /// Reads the TLS certificate, key and CA files again (as SIGHUP); open connections stay.
    #[command(alias = "reload_tls")]
    ReloadTls,
}

/// Columns shown by default in table format, per listing (all fields with `--format json`).
fn columns(verb: &str) -> &'static [&'static str] {
    match verb {
        "list_queues" => &["name", "messages", "consumers", "memory"],
        "list_exchanges" => &["name", "type", "durable", "auto_delete", "internal"],
        "list_bindings" => &[
            "source_name",
            "destination_name",
            "destination_kind",
            "routing_key",
        ],
        "list_connections" => &[
            "id",
            "peer",
            "protocol",
            "user",
            "vhost",
            "client_id",
            "ssl",
            "channels",
            "state",
        ],
        "list_channels" => &[
            "connection",
            "number",
            "user",
            "consumer_count",
            "messages_unacknowledged",
            "prefetch_count",
        ],
        "list_consumers" => &[
            "queue_name",
            "consumer_tag",
            "connection",
            "channel",
            "ack_required",
            "prefetch_count",
        ],
        "list_policies" => &["name", "pattern", "apply-to", "definition", "priority"],
        "list_parameters" => &["component", "name", "value"],
        "shovel_status" => &[
            "name",
            "vhost",
            "type",
            "state",
            "src_uri",
            "dest_uri",
            "messages_moved",
            "reason",
        ],
        "bridge_status" => &[
            "name",
            "state",
            "address",
            "messages_out",
            "messages_in",
            "messages_dropped",
            "reconnects",
            "reason",
        ],
        "list_scheduled" => &["exchange", "messages", "next_due"],
        "list_vhosts" => &["name", "description"],
        "list_users" => &["user", "tags"],
        "list_permissions" => &["user", "configure", "write", "read"],
        "list_user_permissions" => &["vhost", "configure", "write", "read"],
        "list_topic_permissions" => &["user", "exchange", "write", "read"],
        "list_user_topic_permissions" => &["vhost", "exchange", "write", "read"],
        _ => &[],
    }
}

fn request(args: &CtlArgs, verb: &str, params: Value) -> anyhow::Result<Value> {
    let path = args.data_dir.join("warren.sock");
    let mut stream = UnixStream::connect(&path).with_context(|| {
        format!(
            "cannot reach the broker's admin socket {}; is `warren serve --data-dir {}` running?",
            path.display(),
            args.data_dir.display()
        )
    })?;
    // A membership change waits for the new member to catch up (bounded by 60 s a queue
    // on the node).
    let wait = if verb.starts_with("quorum_") { 600 } else { 30 };
    stream.set_read_timeout(Some(Duration::from_secs(wait)))?;
    let mut line = serde_json::to_vec(&json!({"verb": verb, "args": params}))?;
    line.push(b'\n');
    stream.write_all(&line)?;
    let mut answer = String::new();
    BufReader::new(stream)
        .read_line(&mut answer)
        .context("no answer from the broker")?;
    let answer: Value = serde_json::from_str(&answer).context("the broker's answer is not JSON")?;
    if answer.get("refused").and_then(Value::as_bool) == Some(true) {
        let why = answer.get("error").and_then(Value::as_str).unwrap_or("");
        return Err(Refused(why.to_string()).into());
    }
    if answer.get("ok").and_then(Value::as_bool) != Some(true) {
        bail!(
            "{}",
            answer
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("the broker refused the request")
        );
    }
    Ok(answer.get("result").cloned().unwrap_or(Value::Null))
}

fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// Rows as aligned columns, numbers right-aligned.
fn table(rows: &[Value], cols: &[&str]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| cols.iter().map(|c| cell(r.get(*c))).collect())
        .collect();
    let widths: Vec<usize> = cols
        .iter()
        .enumerate()
        .map(|(i, c)| {
            cells
                .iter()
                .map(|r| r[i].chars().count())
                .chain([c.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let numeric: Vec<bool> = cols
        .iter()
        .map(|c| rows.iter().all(|r| r.get(*c).is_none_or(Value::is_number)))
        .collect();
    let mut out = String::new();
    let line = |out: &mut String, values: &[String]| {
        let parts: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if numeric[i] {
                    format!("{v:>w$}", w = widths[i])
                } else {
                    format!("{v:<w$}", w = widths[i])
                }
            })
            .collect();
        out.push_str(parts.join("  ").trim_end());
        out.push('\n');
    };
    line(
        &mut out,
        &cols.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
    );
    for r in &cells {
        line(&mut out, r);
    }
    out
}

pub fn run(args: CtlArgs) -> anyhow::Result<()> {
    let json_out = args.format == "json";
    let vhost = args.vhost.as_str();
    let (verb, mut params) = match &args.verb {
        Verb::ListQueues { .. } => ("list_queues", json!({})),
        Verb::ListExchanges { .. } => ("list_exchanges", json!({})),
        Verb::ListBindings { .. } => ("list_bindings", json!({})),
        Verb::ListConnections { .. } => ("list_connections", json!({})),
        Verb::ListChannels { .. } => ("list_channels", json!({})),
        Verb::ListConsumers { .. } => ("list_consumers", json!({})),
        Verb::CloseConnection { id, reason } => {
            ("close_connection", json!({"id": id, "reason": reason}))
        }
        Verb::Status => ("status", json!({})),
        Verb::Ping => ("ping", json!({})),
        Verb::ClusterStatus => ("cluster_status", json!({})),
        Verb::ForgetNode { id } => ("forget_node", json!({"id": id})),
        Verb::Join { id, addr } => ("join", json!({"id": id, "addr": addr})),
        Verb::Leave => ("leave", json!({})),
        Verb::Quorum(QuorumVerb::Grow { node }) => ("quorum_grow", json!({"node": node})),
        Verb::Quorum(QuorumVerb::Shrink { node }) => ("quorum_shrink", json!({"node": node})),
        Verb::Quorum(QuorumVerb::AddMember { queue, node }) => {
            ("quorum_add_member", json!({"queue": queue, "node": node}))
        }
        Verb::Quorum(QuorumVerb::DeleteMember { queue, node }) => (
            "quorum_delete_member",
            json!({"queue": queue, "node": node}),
        ),
        Verb::SetVmMemoryHighWatermark { value, bytes } => match (value.as_str(), bytes) {
            ("absolute", Some(bytes)) => {
                ("set_vm_memory_high_watermark", json!({"absolute": bytes}))
            }
            ("absolute", None) => bail!("set-vm-memory-high-watermark absolute takes BYTES"),
            (fraction, _) => {
                let f: f64 = fraction.parse().with_context(|| {
                    format!("'{fraction}' is not a fraction of RAM (e.g. 0.4) or `absolute BYTES`")
                })?;
                ("set_vm_memory_high_watermark", json!({"fraction": f}))
            }
        },
        Verb::PurgeQueue { name } => ("purge_queue", json!({"name": name})),
        Verb::AddVhost { name, description } => (
            "add_vhost",
            json!({"name": name, "description": description}),
        ),
        Verb::DeleteVhost { name } => ("delete_vhost", json!({"name": name})),
        Verb::ListVhosts => ("list_vhosts", json!({})),
        Verb::AddUser { name, password } => {
            ("add_user", json!({"name": name, "password": password}))
        }
        Verb::DeleteUser { name } => ("delete_user", json!({"name": name})),
        Verb::ChangePassword { name, password } => (
            "change_password",
            json!({"name": name, "password": password}),
        ),
        Verb::SetUserTags { name, tags } => ("set_user_tags", json!({"name": name, "tags": tags})),
        Verb::ListUsers => ("list_users", json!({})),
        Verb::SetPermissions {
            user,
            configure,
            write,
            read,
        } => (
            "set_permissions",
            json!({"user": user, "configure": configure, "write": write, "read": read}),
        ),
        Verb::ClearPermissions { user } => ("clear_permissions", json!({"user": user})),
        Verb::ListPermissions => ("list_permissions", json!({})),
        Verb::ListUserPermissions { user } => ("list_user_permissions", json!({"user": user})),
        Verb::SetTopicPermissions {
            user,
            exchange,
            write,
            read,
        } => (
            "set_topic_permissions",
            json!({"user": user, "exchange": exchange, "write": write, "read": read}),
        ),
        Verb::ClearTopicPermissions { user, exchange } => (
            "clear_topic_permissions",
            json!({"user": user, "exchange": exchange}),
        ),
        Verb::ListTopicPermissions => ("list_topic_permissions", json!({})),
        Verb::ListUserTopicPermissions { user } => {
            ("list_user_topic_permissions", json!({"user": user}))
        }
        Verb::ReloadTls => ("reload_tls", json!({})),
        Verb::DeleteQueue {
            name,
            if_unused,
            if_empty,
        } => (
            "delete_queue",
            json!({"name": name, "if_unused": if_unused, "if_empty": if_empty}),
        ),
        Verb::SetPolicy {
            name,
            pattern,
            definition,
            priority,
            apply_to,
        } => {
            let definition: Value = serde_json::from_str(definition)
                .with_context(|| format!("the policy definition is not JSON: {definition}"))?;
            (
                "set_policy",
                json!({"name": name, "pattern": pattern, "definition": definition,
                       "priority": priority, "apply-to": apply_to}),
            )
        }
        Verb::ClearPolicy { name } => ("clear_policy", json!({"name": name})),
        Verb::ListPolicies => ("list_policies", json!({})),
        Verb::SetParameter {
            component,
            name,
            value,
        } => {
            let value: Value = serde_json::from_str(value)
                .map_err(|e| Refused(format!("the parameter value is not JSON ({e}): {value}")))?;
            (
                "set_parameter",
                json!({"component": component, "name": name, "value": value}),
            )
        }
        Verb::ClearParameter { component, name } => (
            "clear_parameter",
            json!({"component": component, "name": name}),
        ),
        Verb::ListParameters => ("list_parameters", json!({})),
        Verb::ShovelStatus => ("shovel_status", json!({})),
        Verb::BridgeStatus => ("bridge_status", json!({})),
        Verb::ListScheduled => ("list_scheduled", json!({})),
        Verb::PurgeScheduled { exchange } => ("purge_scheduled", json!({"exchange": exchange})),
        Verb::ExportDefinitions { .. } => ("export_definitions", json!({})),
        Verb::ImportDefinitions { file } => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let doc: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            ("import_definitions", json!({"definitions": doc}))
        }
    };
    if let Some(p) = params.as_object_mut() {
        p.insert("vhost".into(), json!(vhost));
    }
    let result = request(&args, verb, params)?;
    match &args.verb {
        Verb::ExportDefinitions { file } => {
            let text = serde_json::to_string_pretty(&result)?;
            if file == "-" {
                println!("{text}");
            } else {
                std::fs::write(file, text + "\n")
                    .with_context(|| format!("cannot write {file}"))?;
                eprintln!("Exported definitions to {file}");
            }
        }
        _ if json_out => println!("{}", serde_json::to_string_pretty(&result)?),
        Verb::PurgeQueue { name } => {
            println!(
                "Purged {} messages from queue '{name}'",
                cell(result.get("messages"))
            );
        }
        Verb::PurgeScheduled { exchange } => println!(
            "Purged {} scheduled messages of exchange '{exchange}'",
            cell(result.get("messages"))
        ),
        Verb::CloseConnection { id, .. } => println!("Closed connection {id}"),
        Verb::Ping => println!("Ping succeeded"),
        Verb::Status => print!("{}", status_text(&result)),
        Verb::ClusterStatus => print!("{}", cluster_status_text(&result)),
        Verb::ForgetNode { id } => println!("Removed node {id} from the cluster"),
        Verb::Join { id, addr } => println!("Added node {id} ({addr}) to the cluster"),
        Verb::Leave => println!("This node left the cluster; stop it and clear its data dir"),
        Verb::Quorum(QuorumVerb::Grow { .. } | QuorumVerb::Shrink { .. }) => {
            for q in result.as_array().into_iter().flatten() {
                println!(
                    "{}\t{}\t{}",
                    cell(q.get("vhost")),
                    cell(q.get("queue")),
                    cell(q.get("result"))
                );
            }
        }
        Verb::Quorum(QuorumVerb::AddMember { queue, node }) => {
            println!("Added node {node} to quorum queue '{queue}'")
        }
        Verb::Quorum(QuorumVerb::DeleteMember { queue, node }) => {
            println!("Removed node {node} from quorum queue '{queue}'")
        }
        Verb::SetVmMemoryHighWatermark { .. } => println!(
            "Set the memory high watermark to {} bytes",
            cell(result.get("bytes"))
        ),
        Verb::SetPolicy { name, pattern, .. } => {
            println!("Set policy '{name}' for pattern '{pattern}'");
        }
        Verb::ClearPolicy { name } => println!("Cleared policy '{name}'"),
        Verb::SetParameter {
            component, name, ..
        } => println!(
            "Set runtime parameter \"{name}\" for component \"{component}\" in vhost \"{vhost}\""
        ),
        Verb::ClearParameter { component, name } => println!(
            "Cleared runtime parameter \"{name}\" for component \"{component}\" in vhost \"{vhost}\""
        ),
        Verb::AddVhost { name, .. } => println!("Added vhost '{name}'"),
        Verb::DeleteVhost { name } => println!("Deleted vhost '{name}'"),
        Verb::AddUser { name, .. } => println!("Added user '{name}'"),
        Verb::DeleteUser { name } => println!("Deleted user '{name}'"),
        Verb::ChangePassword { name, .. } => println!("Changed the password of user '{name}'"),
        Verb::SetUserTags { name, tags } => {
            println!("Set the tags of user '{name}' to [{}]", tags.join(", "));
        }
        Verb::SetPermissions { user, .. } => {
            println!("Set permissions of user '{user}' in vhost '{vhost}'");
        }
        Verb::ClearPermissions { user } => {
            println!("Cleared permissions of user '{user}' in vhost '{vhost}'");
        }
        Verb::SetTopicPermissions { user, exchange, .. } => {
            println!(
                "Set topic permissions of user '{user}' on exchange '{exchange}' in vhost \
                 '{vhost}'"
            );
        }
        Verb::ClearTopicPermissions { user, exchange } => match exchange {
            Some(x) => println!(
                "Cleared topic permissions of user '{user}' on exchange '{x}' in vhost '{vhost}'"
            ),
            None => println!("Cleared topic permissions of user '{user}' in vhost '{vhost}'"),
        },
        Verb::DeleteQueue { name, .. } => {
            println!(
                "Deleted queue '{name}' ({} messages)",
                cell(result.get("messages"))
            );
        }
        Verb::ImportDefinitions { file } => {
            let d = &result["imported"];
            println!(
                "Imported {}: {} vhosts, {} users, {} permissions, {} topic permissions, {} \
                 policies, {} exchanges, {} queues, {} bindings",
                file.display(),
                cell(d.get("vhosts")),
                cell(d.get("users")),
                cell(d.get("permissions")),
                cell(d.get("topic_permissions")),
                cell(d.get("policies")),
                cell(d.get("exchanges")),
                cell(d.get("queues")),
                cell(d.get("bindings"))
            );
            for s in result["skipped"].as_array().into_iter().flatten() {
                println!("skipped: {}", cell(Some(s)));
            }
            let errors: Vec<String> = result["errors"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| cell(Some(e)))
                .collect();
            if !errors.is_empty() {
                bail!(
                    "{} definitions failed:\n{}",
                    errors.len(),
                    errors.join("\n")
                );
            }
        }
        _ => {
            let rows = result.as_array().cloned().unwrap_or_default();
            let chosen = args.verb.columns();
            if chosen.is_empty() {
                print!("{}", table(&rows, columns(verb)));
            } else {
                let cols: Vec<&str> = chosen.iter().map(String::as_str).collect();
                check_columns(&rows, &cols)?;
                print!("{}", table(&rows, &cols));
            }
        }
    }
    Ok(())
}

impl Verb {
    /// The columns a listing verb was asked for (rabbitmqctl's `list_queues name messages`).
    fn columns(&self) -> &[String] {
        match self {
            Verb::ListQueues { columns }
            | Verb::ListExchanges { columns }
            | Verb::ListBindings { columns }
            | Verb::ListConnections { columns }
            | Verb::ListChannels { columns }
            | Verb::ListConsumers { columns } => columns,
            _ => &[],
        }
    }
}

/// An unknown column is an error naming the ones there are.
fn check_columns(rows: &[Value], cols: &[&str]) -> anyhow::Result<()> {
    let Some(first) = rows.first().and_then(Value::as_object) else {
        return Ok(());
    };
    let unknown: Vec<&str> = cols
        .iter()
        .copied()
        .filter(|c| !first.contains_key(*c))
        .collect();
    if !unknown.is_empty() {
        let mut known: Vec<&str> = first.keys().map(String::as_str).collect();
        known.sort_unstable();
        bail!(
            "unknown column(s) {}; this listing has: {}",
            unknown.join(", "),
            known.join(" ")
        );
    }
    Ok(())
}

/// `warren ctl status` for people.
fn cluster_status_text(s: &Value) -> String {
    let mut out = format!(
        "Node {}: {}, term {}, leader {}, last log index {}, applied {}\n",
        cell(s.get("id")),
        cell(s.get("state")),
        cell(s.get("term")),
        cell(s.get("leader")),
        cell(s.get("last_log_index")),
        cell(s.get("last_applied")),
    );
    out.push_str(&format!(
        "{:<6}{:<24}{:<10}{}\n",
        "id", "address", "matched", "lag"
    ));
    for m in s["members"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{:<6}{:<24}{:<10}{}\n",
            cell(m.get("id")),
            cell(m.get("addr")),
            cell(m.get("matched")),
            cell(m.get("lag")),
        ));
    }
    let alarms: Vec<String> = s["alarms"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| format!("node {} {}", cell(a.get("node")), cell(a.get("resource"))))
        .collect();
    out.push_str(&format!(
        "Alarms: {}\n",
        if alarms.is_empty() {
            "none".to_string()
        } else {
            alarms.join(", ")
        }
    ));
    let queues: Vec<&Value> = s["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|g| g["type"] == "quorum")
        .collect();
    if !queues.is_empty() {
        out.push_str(&format!(
            "\n{:<28}{:<12}{:<8}{:<10}{:<6}{}\n",
            "quorum queue", "members", "leader", "this node", "term", "member matched/lag"
        ));
    }
    for g in queues {
        let st = &g["status"];
        let members: Vec<String> = g["members"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| cell(Some(m)))
            .collect();
        let lags: Vec<String> = st["members"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| {
                format!(
                    "{}{}:{}/{}",
                    cell(m.get("id")),
                    if m["voter"] == false { "(learner)" } else { "" },
                    cell(m.get("matched")),
                    cell(m.get("lag"))
                )
            })
            .collect();
        out.push_str(&format!(
            "{:<28}{:<12}{:<8}{:<10}{:<6}{}\n",
            format!("{} {}", cell(g.get("vhost")), cell(g.get("queue"))),
            members.join(","),
            cell(st.get("leader")),
            if st.is_null() {
                "-".to_string()
            } else {
                cell(st.get("state"))
            },
            cell(st.get("term")),
            lags.join(" "),
        ));
    }
    out
}

fn status_text(s: &Value) -> String {
    let mut out = String::new();
    let line = |out: &mut String, k: &str, v: String| out.push_str(&format!("{k:<22}{v}\n"));
    let app = &s["applications"][0];
    line(&mut out, "Node", cell(s.get("name")));
    line(&mut out, "Version", cell(app.get("version")));
    line(
        &mut out,
        "Uptime (seconds)",
        (s["uptime"].as_u64().unwrap_or(0) / 1000).to_string(),
    );
    line(&mut out, "Memory used (bytes)", cell(s.get("mem_used")));
    line(
        &mut out,
        "Message bytes held",
        cell(s.get("message_bytes_held")),
    );
    line(&mut out, "Memory alarm at", cell(s.get("mem_limit")));
    line(
        &mut out,
        "Alarms",
        if s["mem_alarm"] == true {
            "memory".to_string()
        } else {
            "(none)".to_string()
        },
    );
    line(&mut out, "Disk free (bytes)", cell(s.get("disk_free")));
    for l in s["listeners"].as_array().into_iter().flatten() {
        line(
            &mut out,
            "Listener",
            format!(
                "{}:{} ({})",
                cell(l.get("ip_address")),
                cell(l.get("port")),
                cell(l.get("protocol"))
            ),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_text_left_and_numbers_right() {
        let rows = vec![
            json!({"name": "orders", "messages": 5}),
            json!({"name": "q", "messages": 1200}),
        ];
        assert_eq!(
            table(&rows, &["name", "messages"]),
            "name    messages\norders         5\nq           1200\n"
        );
    }
}
