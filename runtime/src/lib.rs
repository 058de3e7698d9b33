//! Warren's native runtime: drives the sans-IO `warren-core` broker from a tokio task.
//!
//! One broker task owns the [`warren_core::Broker`]. Connections (AMQP or MQTT gateways) send
//! batches of operations over a bounded channel (awaiting a full channel is the publisher's
//! back-pressure) and receive batches of effects on their own channel. The effect channel is
//! unbounded in type but bounded in practice: replies are bounded by the requests a gateway sends
//! (it stops reading its socket while it cannot send), and deliveries by the core's per-connection
//! write window (`BrokerConfig::write_window`) plus consumer prefetch.
//!
//! Invariants:
//! - Every op of a connection is applied in the order the connection sent it, and its
//!   disconnect (the last sender dropped) after all of them.
//! - A connection's ops are ignored once it has disconnected, so a late op cannot resurrect it.

#![warn(missing_docs, unreachable_pub)]

pub mod counting;
pub mod listener;
mod mailbox;
pub mod nodes;
pub mod replicate;
mod resources;
pub mod sendfile;
mod task;
pub mod tls;
pub mod ws;
pub mod ws_upgrade;
pub mod x509;

pub use mailbox::EffectReceiver;
pub use nodes::NodeLink;
pub use replicate::Replicator;
pub use resources::{ResourceWatch, disk_free, process_rss};
/// The store's sync latency histograms (Prometheus reads them).
pub use warren_store::metrics as storage_metrics;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::mpsc;
pub use warren_core::admin::{AdminRequest, AdminResponse};
use warren_core::command::Op;
use warren_core::ids::ConnId;
use warren_core::routing::RouteTable;

pub use warren_core::BrokerConfig;
pub use warren_core::access::{Login, LoginError};

/// Operation batches in flight from all connections to the broker task. Each batch holds up to
/// one socket read's worth of frames, so this bounds queued input at roughly
/// `REQUEST_QUEUE * 64 KiB`.
const REQUEST_QUEUE: usize = 1024;

/// Milliseconds since the Unix epoch: the core's clock in this runtime.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A seed for the core's name generator (`BrokerConfig::seed`) from the operating system's
/// randomness, for a host to draw at each start: with a fixed seed every fresh broker hands
/// out the same `amq.gen-` names, consumer tags and direct reply-to addresses, so a reply
/// address could be predicted and a restored queue's name drawn again.
pub fn os_seed() -> std::io::Result<u64> {
    use std::io::Read;
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(u64::from_le_bytes(bytes))
}

/// Why a broker with a data directory did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store could not open the data directory.
    #[error(transparent)]
    Open(#[from] warren_store::OpenError),
    #[error(
        "data directory {dir} holds the queues of a broker of {stored} shard(s), not {asked}: \
         pass --shards {stored} (stored queues live on the shard their name says)"
    )]
    /// The data directory was written by a broker of another shard count.
    ShardCount {
        /// The data directory.
        dir: std::path::PathBuf,
        /// The shard count it was written with.
        stored: u32,
        /// The shard count asked for now.
        asked: u32,
    },
    #[error("cannot use {path}: {source}; check that the data directory is writable")]
    /// The `shard-count` file could not be read or written.
    ShardCountFile {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// With more than one shard, the memory alarm compares the body bytes of all shards with
/// the watermark (one shared counter).
fn share_memory_count<'a>(brokers: impl Iterator<Item = &'a mut warren_core::Broker>) {
    let brokers: Vec<&mut warren_core::Broker> = brokers.collect();
    if brokers.len() < 2 {
        return;
    }
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    for b in brokers {
        b.share_memory_count(Arc::clone(&count));
    }
}

/// Checks that `data_dir` was written by a broker of `shards` shards (a directory without
/// `shard-count` was written by one shard, or is new when it holds no queues), then
/// records it.
fn check_shard_count(
    data_dir: &std::path::Path,
    shards: u32,
    holds_queues: bool,
) -> Result<(), StartError> {
    let path = data_dir.join("shard-count");
    let file_err = |source| StartError::ShardCountFile {
        path: path.clone(),
        source,
    };
    let stored = match std::fs::read_to_string(&path) {
        Ok(text) => match text.trim().parse::<u32>() {
            Ok(n) => Some(n),
            Err(e) => {
                let invalid = std::io::Error::new(std::io::ErrorKind::InvalidData, e);
                return Err(file_err(invalid));
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => holds_queues.then_some(1),
        Err(e) => return Err(file_err(e)),
    };
    if let Some(stored) = stored
        && stored != shards
    {
        return Err(StartError::ShardCount {
            dir: data_dir.to_path_buf(),
            stored,
            asked: shards,
        });
    }
    std::fs::write(&path, format!("{shards}\n")).map_err(file_err)
}

/// The broker has stopped (the runtime is shutting down).
#[derive(Debug, thiserror::Error)]
#[error("broker stopped")]
pub struct BrokerGone;

pub(crate) struct Request {
    conn: ConnId,
    ops: Vec<(u16, Op)>,
}

pub(crate) enum Control {
    Register {
        conn: ConnId,
        effects: mailbox::MailboxSender,
    },
    /// The connection's last `CommandSender` is gone. `after`: how many op batches it had
    /// sent; the disconnect is applied only after those, so it never overtakes them.
    Disconnect { conn: ConnId, after: u64 },
    /// The store's sync thread finished an epoch.
    Synced {
        epoch: u64,
        result: Result<(), warren_store::SyncError>,
    },
    /// A clean stop, first step: answer once this shard has nothing left to apply and
    /// everything it wrote is synced (acks included), with how many pieces of mail it has
    /// sent other shards so far (`BrokerHandle::stop` asks until the counts settle).
    Flush {
        reply: tokio::sync::oneshot::Sender<u64>,
    },
    /// A clean stop, last step: the task ends and closes its store (its sync thread
    /// finishes), then answers.
    Stop {
        reply: tokio::sync::oneshot::Sender<()>,
    },
    /// An operator's request (`warren ctl`).
    Admin {
        request: AdminRequest,
        reply: tokio::sync::oneshot::Sender<AdminResponse>,
    },
    /// The host's latest measurements of the machine (`ResourceWatch`).
    Resources(warren_core::Resources),
    /// A clustered host's link to the other nodes (`BrokerHandle::set_node_link`).
    NodeLink(Arc<dyn NodeLink>),
    /// Mail another node sent (`BrokerHandle::receive_node_mail`); `done` once applied.
    NodeMail {
        from: u32,
        mails: Vec<warren_core::NodeMail>,
        done: tokio::sync::oneshot::Sender<()>,
    },
    /// The host could not reach `node` (`BrokerHandle::node_unreachable`).
    NodeUnreachable(u32),
    /// The host reaches `node` again (`BrokerHandle::node_reachable`).
    NodeReachable(u32),
    /// A client logs in (AMQP start-ok, MQTT CONNECT).
    Authenticate {
        user: String,
        /// `None`: the host proved the user's identity (a verified TLS client certificate).
        password: Option<String>,
        from_loopback: bool,
        vhost: Option<String>,
        reply: tokio::sync::oneshot::Sender<Result<Login, LoginError>>,
    },
    /// Streams in the shard's `StreamWakes` grew (`BrokerHandle::streams_grew`).
    StreamsGrew(Arc<StreamWakes>),
}

/// Streams that grew by the stream protocol's appends, which a shard has not looked at yet:
/// a set (so a stream appended to many times is looked at once), and at most one
/// `Control::StreamsGrew` on its way per shard (sent when the set stops being empty).
#[derive(Default)]
pub(crate) struct StreamWakes(std::sync::Mutex<std::collections::HashSet<(String, String)>>);

impl StreamWakes {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<(String, String)>> {
        // A set of names stays consistent whatever panicked while holding it.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds a stream; true when the set was empty (the shard must be told).
    fn add(&self, vhost: &str, name: &str) -> bool {
        let mut set = self.lock();
        let was_empty = set.is_empty();
        if !set.iter().any(|(v, n)| v == vhost && n == name) {
            set.insert((vhost.to_string(), name.to_string()));
        }
        was_empty
    }

    /// Everything added so far (the set is empty again).
    pub(crate) fn take(&self) -> Vec<(String, String)> {
        self.lock().drain().collect()
    }
}

/// What a gateway knows of a connection and the core does not (peer, protocol, client
/// properties or MQTT client id), for operators' listings (`warren ctl list_connections`,
/// the HTTP API). Set once per connection (`CommandSender::describe`), dropped with it.
#[derive(Clone, Debug, Default)]
pub struct ConnMeta {
    /// As RabbitMQ names it: `AMQP 0-9-1`, `MQTT 3.1.1`, `MQTT 5-0`.
    pub protocol: &'static str,
    /// The client's address, `ip:port` (shared with the gateway's copy for its logs).
    pub peer: Arc<str>,
    /// Whether it came through a TLS listener (the HTTP API's `ssl`).
    pub tls: bool,
    /// AMQP: the client properties of connection.start-ok (product, version, capabilities,
    /// connection_name); empty for MQTT.
    pub client_properties: Option<Box<warren_core::message::FieldTable>>,
    /// MQTT: the client identifier (the session's own, shared: not a copy per connection).
    pub client_id: Option<Arc<str>>,
    /// Negotiated heartbeat or keep-alive, seconds.
    pub heartbeat: u16,
    /// AMQP frame_max (0 for MQTT).
    pub frame_max: u32,
    /// When it connected, ms since the Unix epoch.
    pub connected_at: u64,
}

struct Shared {
    /// One per shard, by shard index: connection `n` is shard `n % shards.len()`'s.
    shards: Vec<ShardLink>,
    /// Held while an operator's change is sent to every shard, so all shards see the
    /// changes in one order (never held across an await).
    admin_order: std::sync::Mutex<()>,
    /// Gateways' descriptions of their live connections (`ConnMeta`): off the broker task,
    /// so listing them costs the message path nothing. One entry per live connection.
    meta: std::sync::Mutex<std::collections::HashMap<ConnId, Arc<ConnMeta>>>,
    next_conn: AtomicU64,
    /// The routing table as of the broker's last turn: connection tasks route publishes on
    /// it (lock-free reads), so routing runs on their threads, not the broker's.
    routes: Routes,
    /// A clustered host's metadata group (`BrokerHandle::set_replicator`): durable
    /// metadata changes are committed there before this broker applies them.
    replicator: std::sync::OnceLock<Arc<dyn Replicator>>,
}

/// Where a shard's task reads what connections and the host send it.
struct ShardLink {
    requests: mpsc::Sender<Request>,
    control: mpsc::UnboundedSender<Control>,
    stream_wakes: Arc<StreamWakes>,
    /// Whether any consumer reads the shard's stream queues (`streams_grew` skips it if not).
    stream_readers: warren_core::queue::StreamReaders,
}

impl Shared {
    fn shard(&self, conn: ConnId) -> &ShardLink {
        &self.shards[(conn.0 % self.shards.len() as u64) as usize]
    }

    /// Shard 0: topology, users, vhosts and policies (ARCHITECTURE.md, "warren-runtime").
    fn first(&self) -> &ShardLink {
        &self.shards[0]
    }
}

/// The published routing snapshot (see `warren_core::routing`).
pub(crate) type Routes = Arc<arc_swap::ArcSwap<RouteTable>>;

/// A layer over each shard's disk store, given at start
/// ([`BrokerHandle::start_with_store_layered`]): a cluster node replicates its quorum
/// queues' writes through their Raft groups this way (member/src/qq.rs, docs/cluster.md).
pub trait StoreLayer: Send + Sync {
    /// For shard `shard`, whose broker is told of completed syncs by `synced`: the callback
    /// the disk store reports its syncs to, and what wraps that disk store. The layer calls
    /// `synced` itself once a sync is complete on both sides.
    #[allow(clippy::type_complexity)]
    fn layer(
        &self,
        shard: u32,
        synced: warren_store::SyncCallback,
    ) -> (
        warren_store::SyncCallback,
        Box<
            dyn FnOnce(Box<dyn warren_core::store::Store>) -> Box<dyn warren_core::store::Store>
                + Send,
        >,
    );
}

/// A cheap, clonable handle to the running broker.
#[derive(Clone)]
pub struct BrokerHandle {
    shared: Arc<Shared>,
}

/// How long a clean stop waits for every shard to become idle and synced (and then for each
/// to close its store) before it gives up: well under systemd's 90 s stop timeout.
const STOP_FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl BrokerHandle {
    /// Spawns the broker task on the current tokio runtime, everything in memory.
    pub fn start(config: BrokerConfig) -> BrokerHandle {
        let (control, control_rx) = mpsc::unbounded_channel();
        BrokerHandle::spawn(warren_core::Broker::new(config), control, control_rx)
    }

    /// Spawns the broker task with durable storage under `data_dir`: restores the stored
    /// definitions and queues first (blocking; restart time is measured in
    /// docs/benchmarks.md), then serves.
    pub fn start_with_store(
        config: BrokerConfig,
        data_dir: &std::path::Path,
        storage: warren_store::DiskConfig,
    ) -> Result<(BrokerHandle, warren_store::definitions::DefinitionStore), StartError> {
        BrokerHandle::start_with_store_sharded(config, data_dir, storage, 1)
    }

    /// `start_with_store` over `shards` shards, each with its own message log (shard 0 in
    /// `data_dir`, with the definitions; shard `i` in `data_dir/shards/i`) and its own
    /// syncs. A stored queue lives on the shard its name says, so the number of shards is
    /// fixed for a data directory once it holds queues (`data_dir/shard-count`).
    pub fn start_with_store_sharded(
        config: BrokerConfig,
        data_dir: &std::path::Path,
        storage: warren_store::DiskConfig,
        shards: u32,
    ) -> Result<(BrokerHandle, warren_store::definitions::DefinitionStore), StartError> {
        BrokerHandle::start_with_store_layered(config, data_dir, storage, shards, None)
    }

    /// `start_with_store_sharded` with `layer` over each shard's disk store (a cluster
    /// node's quorum-queue replication: [`StoreLayer`]).
    pub fn start_with_store_layered(
        config: BrokerConfig,
        data_dir: &std::path::Path,
        storage: warren_store::DiskConfig,
        shards: u32,
        layer: Option<Arc<dyn StoreLayer>>,
    ) -> Result<(BrokerHandle, warren_store::definitions::DefinitionStore), StartError> {
        let shards = shards.max(1);
        let mut brokers = Vec::new();
        let mut controls = Vec::new();
        let mut first_definitions = None;
        for i in 0..shards {
            let (control, control_rx) = mpsc::unbounded_channel();
            let synced = control.clone();
            let dir = match i {
                0 => data_dir.to_path_buf(),
                i => data_dir.join("shards").join(i.to_string()),
            };
            let on_synced: warren_store::SyncCallback = Box::new(move |epoch, result| {
                // Fails only when the broker task is gone (shutdown): nothing to confirm
                // then.
                let _ = synced.send(Control::Synced { epoch, result });
            });
            let (on_synced, wrap) = match &layer {
                Some(layer) => {
                    let (cb, wrap) = layer.layer(i, on_synced);
                    (cb, Some(wrap))
                }
                None => (on_synced, None),
            };
            let (store, definitions) =
                warren_store::DiskStore::open(&dir, storage.clone(), on_synced)?;
            if i == 0 {
                first_definitions = Some((definitions, store.definitions()));
            }
            let store: Box<dyn warren_core::store::Store> = match wrap {
                Some(wrap) => wrap(Box::new(store)),
                None => Box::new(store),
            };
            let mut broker = warren_core::Broker::with_store(config.clone(), store);
            broker.set_shard(i, shards);
            brokers.push(broker);
            controls.push((control, control_rx));
        }
        let Some((definitions, definitions_db)) = first_definitions else {
            unreachable!("at least one shard");
        };
        check_shard_count(data_dir, shards, !definitions.queues.is_empty())?;
        // Before the restore: the restored queues' bytes count in the sum.
        share_memory_count(brokers.iter_mut());
        let started = std::time::Instant::now();
        for error in warren_core::shards::restore(unix_ms(), &definitions, &mut brokers) {
            tracing::warn!(
                error = %warren_core::escape::Escaped(&error.to_string()),
                "a stored definition could not be restored"
            );
        }
        tracing::info!(
            exchanges = definitions.exchanges.len(),
            queues = definitions.queues.len(),
            bindings = definitions.bindings.len(),
            mqtt_retained = definitions.retained.len(),
            shards,
            elapsed_ms = started.elapsed().as_millis() as u64,
            dir = %data_dir.display(),
            "restored definitions"
        );
        let brokers = brokers
            .into_iter()
            .zip(controls)
            .map(|(broker, (control, control_rx))| (broker, control, control_rx))
            .collect();
        Ok((BrokerHandle::spawn_shards(brokers), definitions_db))
    }

    /// Spawns `shards` broker tasks, everything in memory (ARCHITECTURE.md,
    /// "warren-runtime"): connections spread over them at connect, and each queue lives on
    /// the shard of the connection that declared it, so queue work runs on up to `shards`
    /// cores. Users, permissions, vhosts and policies an operator changes reach every
    /// shard.
    pub fn start_sharded(config: BrokerConfig, shards: u32) -> BrokerHandle {
        BrokerHandle::start_sharded_with_streams(config, shards, None)
    }

    /// `start_sharded`, with stream queues' logs in `streams` when given: the host shares
    /// them with its stream protocol listener (`warren serve --in-memory --stream`), and
    /// calls [`BrokerHandle::streams_grew`] when that appends.
    pub fn start_sharded_with_streams(
        config: BrokerConfig,
        shards: u32,
        streams: Option<Arc<dyn warren_core::store::SharedStreams>>,
    ) -> BrokerHandle {
        let shards = shards.max(1);
        let mut brokers: Vec<_> = (0..shards)
            .map(|i| {
                let mut broker = warren_core::Broker::new(config.clone());
                broker.set_shard(i, shards);
                if let Some(s) = &streams {
                    broker.set_shared_streams(Arc::clone(s));
                }
                let (control, control_rx) = mpsc::unbounded_channel();
                (broker, control, control_rx)
            })
            .collect();
        share_memory_count(brokers.iter_mut().map(|(b, _, _)| b));
        BrokerHandle::spawn_shards(brokers)
    }

    fn spawn(
        broker: warren_core::Broker,
        control: mpsc::UnboundedSender<Control>,
        control_rx: mpsc::UnboundedReceiver<Control>,
    ) -> BrokerHandle {
        BrokerHandle::spawn_shards(vec![(broker, control, control_rx)])
    }

    fn spawn_shards(
        mut brokers: Vec<(
            warren_core::Broker,
            mpsc::UnboundedSender<Control>,
            mpsc::UnboundedReceiver<Control>,
        )>,
    ) -> BrokerHandle {
        for (b, _, _) in &mut brokers {
            // MQTT connections send their client id: `{client_id}` in topic permissions.
            b.expand_client_ids();
        }
        let first = brokers.first().map(|(b, _, _)| Arc::clone(b.routes()));
        let routes: Routes = Arc::new(arc_swap::ArcSwap::new(first.unwrap_or_default()));
        // Mail between shards: unbounded channels, so two shards never wait on each other;
        // a shard whose mail waits at another beyond a bound stops taking its connections'
        // requests until that one catches up (`task::ShardIo::backlogged`).
        let (inboxes, mut mail_rxs): (Vec<_>, Vec<_>) =
            brokers.iter().map(|_| mpsc::unbounded_channel()).unzip();
        let backlog: Arc<Vec<std::sync::atomic::AtomicUsize>> =
            Arc::new(brokers.iter().map(|_| Default::default()).collect());
        let mut shards = Vec::new();
        for (shard, (broker, control, control_rx)) in brokers.into_iter().enumerate().rev() {
            let (requests, requests_rx) = mpsc::channel(REQUEST_QUEUE);
            let stream_wakes = Arc::new(StreamWakes::default());
            let stream_readers = broker.stream_readers();
            let io = task::ShardIo {
                mail: mail_rxs.pop().expect("one inbox per shard"),
                peers: inboxes.clone(),
                backlog: Arc::clone(&backlog),
                shard,
            };
            tokio::spawn(task::run(
                broker,
                requests_rx,
                control_rx,
                Arc::clone(&routes),
                io,
            ));
            shards.push(ShardLink {
                requests,
                control,
                stream_wakes,
                stream_readers,
            });
        }
        shards.reverse();
        BrokerHandle {
            shared: Arc::new(Shared {
                shards,
                admin_order: std::sync::Mutex::new(()),
                meta: std::sync::Mutex::new(std::collections::HashMap::new()),
                next_conn: AtomicU64::new(1),
                routes,
                replicator: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Stream `name` of `vhost` grew by appends the broker did not make (the stream
    /// protocol's publishers): the shard owning its queue delivers to the queue's waiting
    /// consumers now. Cheap to call per append: a stream is looked at once however often it
    /// is named before its shard gets to it, and free for shards where no consumer reads a
    /// stream queue. Call after the appends are visible in the log (`StreamReaders::any`).
    pub fn streams_grew(&self, vhost: &str, name: &str) {
        // The queue may be on any shard: each with readers looks among its own.
        for shard in &self.shared.shards {
            if shard.stream_readers.any() && shard.stream_wakes.add(vhost, name) {
                // Fails only when the task is gone (shutdown).
                let _ = shard
                    .control
                    .send(Control::StreamsGrew(Arc::clone(&shard.stream_wakes)));
            }
        }
    }

    /// Makes this broker a cluster member: from now on durable metadata changes, from
    /// clients and operators alike, are committed by `replicator` first (module
    /// `replicate`). Set once, before clients connect; a second call is ignored.
    pub fn set_replicator(&self, replicator: Arc<dyn Replicator>) {
        let _ = self.shared.replicator.set(replicator);
    }

    /// Runs an operator's request. A metadata change on a cluster member is committed by
    /// the cluster first and answered with this node's result of applying it
    /// (`set_replicator`); anything else as `admin_local`.
    pub async fn admin(&self, request: AdminRequest) -> Result<AdminResponse, BrokerGone> {
        let Some(replicator) = self.shared.replicator.get() else {
            return self.admin_local(request).await;
        };
        if !replicate::replicated_admin(&request) {
            return self.admin_local(request).await;
        }
        // How a refusal is answered depends on the request, which goes to the cluster.
        enum Shape {
            Op(Op),
            Import,
            Done,
        }
        let shape = match &request {
            AdminRequest::Op { op, .. } => Shape::Op(op.clone()),
            AdminRequest::Import(_) => Shape::Import,
            _ => Shape::Done,
        };
        // An operator's conditional delete is checked where the queue is served too.
        if let AdminRequest::Op { vhost, op } = &request
            && let Some(refused) = replicator.precheck(vhost, op).await
        {
            return Ok(AdminResponse::Op(Err(refused)));
        }
        let request = match request {
            AdminRequest::Op { vhost, op } => AdminRequest::Op {
                vhost,
                op: replicate::decided(op),
            },
            other => other,
        };
        Ok(match replicator.replicate(request).await {
            Ok(answer) => answer,
            Err(why) => match shape {
                Shape::Op(op) => AdminResponse::Op(Err(replicate::unavailable(&op, &why))),
                Shape::Import => AdminResponse::Imported(warren_core::admin::ImportReport {
                    errors: vec![format!("metadata store unavailable: {why}")],
                    ..Default::default()
                }),
                Shape::Done => {
                    AdminResponse::Done(Err(warren_core::admin::AdminError::Unavailable(format!(
                        "metadata store unavailable: {why}"
                    ))))
                }
            },
        })
    }

    /// Makes `link` carry this node's mail for other cluster nodes (module `nodes`). Set
    /// once, before clients connect.
    pub fn set_node_link(&self, link: Arc<dyn NodeLink>) {
        for shard in &self.shared.shards {
            let _ = shard.control.send(Control::NodeLink(link.clone()));
        }
    }

    /// Applies mail node `from` sent, in order; returns once every shard it concerns
    /// applied it. A forwarded message goes to shard 0 (its queue's shard gets it from
    /// there), an answer to the shard its token names.
    pub async fn receive_node_mail(
        &self,
        from: u32,
        mails: Vec<warren_core::NodeMail>,
    ) -> Result<(), BrokerGone> {
        let k = self.shared.shards.len() as u64;
        let mut per_shard: Vec<Vec<warren_core::NodeMail>> =
            self.shared.shards.iter().map(|_| Vec::new()).collect();
        for m in mails {
            let shard = match &m {
                warren_core::NodeMail::Answered { token, .. } => (token % k) as usize,
                // Consumers across nodes are served by shard 0 (docs/cluster.md: with one
                // shard, the default).
                _ => 0,
            };
            per_shard[shard].push(m);
        }
        let mut waits = Vec::new();
        for (shard, mails) in self.shared.shards.iter().zip(per_shard) {
            if mails.is_empty() {
                continue;
            }
            let (done, wait) = tokio::sync::oneshot::channel();
            shard
                .control
                .send(Control::NodeMail { from, mails, done })
                .map_err(|_| BrokerGone)?;
            waits.push(wait);
        }
        for w in waits {
            w.await.map_err(|_| BrokerGone)?;
        }
        Ok(())
    }

    /// The host could not hand mail to node `node`: the publishes forwarded to it that
    /// wait for an answer are nacked.
    pub fn node_unreachable(&self, node: u32) {
        for shard in &self.shared.shards {
            let _ = shard.control.send(Control::NodeUnreachable(node));
        }
    }

    /// The host hands mail to node `node` again after it was unreachable (or restarted):
    /// consumers that wait for it attach there again.
    pub fn node_reachable(&self, node: u32) {
        for shard in &self.shared.shards {
            let _ = shard.control.send(Control::NodeReachable(node));
        }
    }

    /// Runs an operator's request on the broker task (shard 0's), on this node only: a
    /// cluster host applies committed metadata changes with it. Changes to users,
    /// permissions, vhosts and policies go to every shard, in the same order on each;
    /// shard 0 answers.
    pub async fn admin_local(&self, request: AdminRequest) -> Result<AdminResponse, BrokerGone> {
        if self.shared.shards.len() > 1 && request.gathered().is_some() {
            return self.gather(request).await;
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        if let AdminRequest::CloseConnection { conn, .. } = &request {
            // A connection lives on its own shard.
            self.shared
                .shard(*conn)
                .control
                .send(Control::Admin { request, reply })
                .map_err(|_| BrokerGone)?;
            return answer.await.map_err(|_| BrokerGone);
        }
        {
            let _order = self
                .shared
                .admin_order
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for shard in &self.shared.shards[1..] {
                let Some(request) = request.replica() else {
                    break;
                };
                // The other shards' answers are the same as shard 0's: nobody waits.
                let (reply, _) = tokio::sync::oneshot::channel();
                let _ = shard.control.send(Control::Admin { request, reply });
            }
            self.shared
                .first()
                .control
                .send(Control::Admin { request, reply })
                .map_err(|_| BrokerGone)?;
        }
        answer.await.map_err(|_| BrokerGone)
    }

    /// Stops the broker cleanly, once its connections are closed: every shard applies
    /// what it was sent, makes everything durable (acks, purges and deletes too, so that
    /// nothing acked comes back after a restart) and closes its store. Mail between shards
    /// may carry acks, so the shards are asked until none sent mail since the last round.
    /// Returns whether every shard became idle and synced within `STOP_FLUSH_TIMEOUT`.
    pub async fn stop(&self) -> bool {
        // Bounded: a shard that cannot get idle and synced (a store that keeps failing, work
        // that keeps arriving) must not keep the process from ending; the host logs that
        // what was acked since the last sync may come back.
        let flushed = tokio::time::timeout(STOP_FLUSH_TIMEOUT, self.flush_all())
            .await
            .is_ok();
        if !flushed {
            tracing::error!(
                "the store was not synced within {} s of the stop: messages acked since the \
                 last sync may be delivered again after the restart",
                STOP_FLUSH_TIMEOUT.as_secs()
            );
        }
        for shard in &self.shared.shards {
            let (reply, answer) = tokio::sync::oneshot::channel();
            if shard.control.send(Control::Stop { reply }).is_ok() {
                let _ = tokio::time::timeout(STOP_FLUSH_TIMEOUT, answer).await;
            }
        }
        flushed
    }

    /// Flush rounds until no shard sent mail since the last (a clean stop's first part).
    async fn flush_all(&self) {
        // Each round is one flush of every shard; mail stops once connections are gone,
        // within a few rounds (the bound is a safety net, not a schedule).
        let mut last = None;
        for _ in 0..64 {
            let mut sent = 0u64;
            for shard in &self.shared.shards {
                let (reply, answer) = tokio::sync::oneshot::channel();
                if shard.control.send(Control::Flush { reply }).is_err() {
                    return;
                }
                match answer.await {
                    Ok(n) => sent += n,
                    Err(_) => return,
                }
            }
            if last == Some(sent) {
                break;
            }
            last = Some(sent);
        }
    }

    /// A listing of what lives on every shard (queues, their consumers, connections):
    /// asked of each, merged in the order one shard lists them.
    async fn gather(&self, request: AdminRequest) -> Result<AdminResponse, BrokerGone> {
        let mut answers = Vec::new();
        for shard in &self.shared.shards {
            let (reply, answer) = tokio::sync::oneshot::channel();
            let Some(request) = request.gathered() else {
                break;
            };
            shard
                .control
                .send(Control::Admin { request, reply })
                .map_err(|_| BrokerGone)?;
            answers.push(answer);
        }
        let mut responses = Vec::with_capacity(answers.len());
        for answer in answers {
            responses.push(answer.await.map_err(|_| BrokerGone)?);
        }
        Ok(request.merge(responses))
    }

    /// Checks a client's credentials (RabbitMQ's internal auth backend: salted SHA-256,
    /// `guest` only from loopback) and, given a vhost, the user's access to it.
    pub async fn authenticate(
        &self,
        user: &str,
        password: &str,
        from_loopback: bool,
        vhost: Option<&str>,
    ) -> Result<Result<Login, LoginError>, BrokerGone> {
        self.login(user, Some(password), from_loopback, vhost).await
    }

    /// As [`BrokerHandle::authenticate`] for a user whose TLS client certificate the listener
    /// verified (AMQP EXTERNAL, MQTT `use_identity_as_username`): no password checked.
    pub async fn authenticate_certified(
        &self,
        user: &str,
        from_loopback: bool,
        vhost: Option<&str>,
    ) -> Result<Result<Login, LoginError>, BrokerGone> {
        self.login(user, None, from_loopback, vhost).await
    }

    async fn login(
        &self,
        user: &str,
        password: Option<&str>,
        from_loopback: bool,
        vhost: Option<&str>,
    ) -> Result<Result<Login, LoginError>, BrokerGone> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.shared
            .first()
            .control
            .send(Control::Authenticate {
                user: user.to_string(),
                password: password.map(str::to_string),
                from_loopback,
                vhost: vhost.map(str::to_string),
                reply,
            })
            .map_err(|_| BrokerGone)?;
        answer.await.map_err(|_| BrokerGone)
    }

    /// Routes a publish on the latest routing table, as a connection would (`None`: no such
    /// vhost or exchange, or an internal one). For hosts that publish on the admin channel
    /// and report whether the message reached a queue.
    pub fn route(
        &self,
        vhost: &str,
        exchange: &str,
        routing_key: &str,
        headers: Option<&warren_core::message::FieldTable>,
    ) -> Option<warren_core::routing::Routed> {
        let table = self.shared.routes.load();
        table.route_publish(table.vhost(vhost)?, exchange, routing_key, headers)
    }

    /// The gateways' descriptions of the live connections that have one, by id.
    pub fn connection_meta(&self) -> Vec<(ConnId, Arc<ConnMeta>)> {
        let mut out: Vec<(ConnId, Arc<ConnMeta>)> = self
            .shared
            .meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(id, m)| (*id, Arc::clone(m)))
            .collect();
        out.sort_by_key(|(id, _)| *id);
        out
    }

    /// Registers a new connection with a fresh id.
    pub fn connect(&self) -> Connection {
        let id = ConnId(self.shared.next_conn.fetch_add(1, Ordering::Relaxed));
        let (effects, rx, credit) = mailbox::mailbox();
        // Sent before any op of this connection can be, and the task drains control messages
        // before applying a request batch, so the registration is always seen first.
        let _ = self
            .shared
            .shard(id)
            .control
            .send(Control::Register { conn: id, effects });
        Connection {
            id,
            tx: CommandSender {
                guard: Arc::new(ConnGuard {
                    conn: id,
                    shared: self.shared.clone(),
                    sent: AtomicU64::new(0),
                    credit,
                    vhost: std::sync::OnceLock::new(),
                    login: std::sync::OnceLock::new(),
                    amqp: std::sync::atomic::AtomicBool::new(false),
                    mqtt: std::sync::atomic::AtomicBool::new(false),
                }),
            },
            rx,
        }
    }
}

/// Op batches one connection may have sent and the broker not yet applied: enough to keep
/// the broker busy (each batch is one socket read, up to 64 KiB of frames), few enough that
/// a flow-control pause takes effect within a few thousand messages.
const MAX_IN_FLIGHT: u64 = 4;

/// One connection's link to the broker.
pub struct Connection {
    /// The core's id of the connection.
    pub id: ConnId,
    /// Sends op batches to the connection's shard.
    pub tx: CommandSender,
    /// Receives the effect batches the core produced for it.
    pub rx: EffectReceiver,
}

struct ConnGuard {
    conn: ConnId,
    shared: Arc<Shared>,
    /// Op batches handed to the request channel.
    sent: AtomicU64,
    credit: mailbox::Credit,
    /// The connection's vhost, once it opened (publishes are routed in its table).
    vhost: std::sync::OnceLock<warren_core::ids::VhostId>,
    /// Its vhost and user by name, once it opened, on a cluster member only (which checks
    /// permissions before it proposes a client's metadata change). Boxed: inline, the two
    /// strings were 48 of the guard's 112 bytes in every connection of every broker.
    login: std::sync::OnceLock<Box<(String, String)>>,
    /// An AMQP connection (`describe`): its durable declares are cluster metadata.
    amqp: std::sync::atomic::AtomicBool,
    /// An MQTT connection (`describe`): its session queue and bindings are cluster
    /// metadata (`replicate::replicated_session_op`).
    mqtt: std::sync::atomic::AtomicBool,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.shared
            .meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.conn);
        // Safety net: a gateway that dies without sending ConnectionClose still releases its
        // channels, consumers and exclusive queues.
        let _ = self
            .shared
            .shard(self.conn)
            .control
            .send(Control::Disconnect {
                conn: self.conn,
                after: self.sent.load(Ordering::Acquire),
            });
    }
}

/// Sends operations of one connection to the broker.
#[derive(Clone)]
pub struct CommandSender {
    guard: Arc<ConnGuard>,
}

/// The last publish this thread routed without reading headers, and where it went: a
/// publisher repeats its exchange and routing key (an MQTT client its topic, a hundred of
/// them in fan-in the same one), and routing it again (two name lookups and the topic trie)
/// was a tenth of an MQTT broker's samples (docs/benchmarks.md). One entry per thread,
/// nothing per connection.
struct LastRoute {
    /// The table it was routed on, as its identity: tables are immutable snapshots, and the
    /// `Weak` keeps the address from being reused by another table (of this broker or of
    /// another one in the process) without keeping the old table's contents alive.
    table: std::sync::Weak<RouteTable>,
    vhost: warren_core::ids::VhostId,
    exchange: Arc<str>,
    routing_key: Arc<str>,
    routed: warren_core::routing::Routed,
}

thread_local! {
    static LAST_ROUTE: std::cell::RefCell<Option<LastRoute>> = const { std::cell::RefCell::new(None) };
}

fn same_str(a: &Arc<str>, b: &Arc<str>) -> bool {
    Arc::ptr_eq(a, b) || a == b
}

/// `table.route_publish` for `p`, reusing this thread's last result for the same table,
/// vhost, exchange and routing key when that one read no headers.
fn route_repeated(
    table: &Arc<RouteTable>,
    vhost: warren_core::ids::VhostId,
    p: &warren_core::command::Publish,
) -> Option<warren_core::routing::Routed> {
    let hit = LAST_ROUTE.with_borrow(|last| {
        let l = last.as_ref()?;
        (std::ptr::eq(l.table.as_ptr(), Arc::as_ptr(table))
            && l.vhost == vhost
            && same_str(&l.exchange, &p.exchange)
            && same_str(&l.routing_key, &p.routing_key))
        .then(|| l.routed.clone())
    });
    if hit.is_some() {
        return hit;
    }
    let (routed, read_headers) = table.route_publish_keyed(
        vhost,
        &p.exchange,
        &p.routing_key,
        p.properties.headers.as_ref(),
    )?;
    if !read_headers {
        LAST_ROUTE.set(Some(LastRoute {
            table: Arc::downgrade(table),
            vhost,
            exchange: p.exchange.clone(),
            routing_key: p.routing_key.clone(),
            routed: routed.clone(),
        }));
    }
    Some(routed)
}

impl CommandSender {
    /// Sends a batch of `(channel, op)` pairs. Waits while the broker is saturated.
    ///
    /// Publishes are routed here first, on the connection's task, against the broker's
    /// latest routing table (`Publish::routed`), so the broker task only enqueues them.
    pub async fn send(&self, mut ops: Vec<(u16, Op)>) -> Result<(), BrokerGone> {
        if ops.is_empty() {
            return Ok(());
        }
        self.route(&mut ops);
        if let Some(replicator) = self.replicator()
            && ops
                .iter()
                .any(|(_, op)| self.replicated(op) || replicate::needs_barrier(op))
        {
            // Boxed: every connection task awaits `send` inline, so an inline replicated path
            // (waiting on the metadata group) would grow every idle connection's future
            // (the MQTT one from 680 to 1,832 bytes: gateway-mqtt's footprint test).
            return Box::pin(self.send_replicated(replicator.as_ref(), ops)).await;
        }
        self.send_batch(ops).await
    }

    /// The cluster's replicator, if this is an AMQP or MQTT connection of a cluster member.
    fn replicator(&self) -> Option<Arc<dyn Replicator>> {
        if !self.guard.amqp.load(Ordering::Relaxed) && !self.guard.mqtt.load(Ordering::Relaxed) {
            return None;
        }
        self.guard.shared.replicator.get().cloned()
    }

    /// Whether `op` of this connection is cluster metadata: an AMQP client's durable
    /// changes, an MQTT session's queue and bindings.
    fn replicated(&self, op: &Op) -> bool {
        if self.guard.amqp.load(Ordering::Relaxed) {
            replicate::replicated_op(op)
        } else {
            replicate::replicated_session_op(op)
        }
    }

    /// Sends a batch with metadata changes: each is committed by the cluster (and applied
    /// by this node) before it goes to the broker with what follows it, which then answers
    /// the client as for any declare (the entity now exists, so declare-ok). What comes
    /// before it is sent first. A change the user may not make is not proposed (the broker
    /// refuses it as usual); one the cluster could not commit becomes the channel error of
    /// `replicate::unavailable`, in request order. Passive declares wait for a read barrier
    /// first (if the barrier fails they are answered from what this node knows).
    async fn send_replicated(
        &self,
        replicator: &dyn Replicator,
        ops: Vec<(u16, Op)>,
    ) -> Result<(), BrokerGone> {
        let mut out = Vec::with_capacity(ops.len());
        for (ch, op) in ops {
            let change = self.replicated(&op);
            if !change && !replicate::needs_barrier(&op) {
                out.push((ch, op));
                continue;
            }
            if !out.is_empty() {
                self.send_batch(std::mem::take(&mut out)).await?;
            }
            if !change {
                if let Err(why) = replicator.barrier().await {
                    tracing::debug!(why = %warren_core::escape::Escaped(&why.to_string()), "cluster read barrier failed; answering locally");
                }
                out.push((ch, op));
                continue;
            }
            let Some((vhost, user)) = self.guard.login.get().map(|l| (**l).clone()) else {
                // Not open yet: the broker refuses it.
                out.push((ch, op));
                continue;
            };
            if self.declared_here(&vhost, &op) {
                // A redeclare (clients declare what they use on every start): the entity
                // exists here as everywhere, so the broker's answer (ok, or 406 if it does
                // not match) is the cluster's, without a round of consensus.
                out.push((ch, op));
                continue;
            }
            if !self.may(&vhost, &user, &op).await? {
                out.push((ch, op));
                continue;
            }
            if let Some(refused) = replicator.precheck(&vhost, &op).await {
                out.push((ch, Op::Refuse(refused)));
                continue;
            }
            // Here too: this node applies what the cluster committed.
            let op = replicate::decided(op);
            let request = AdminRequest::Op {
                vhost,
                op: op.clone(),
            };
            match replicator.replicate(request).await {
                Ok(_) => out.push((ch, op)),
                Err(why) => {
                    tracing::warn!(conn = self.guard.conn.0, op = ?op.kind(), why = %warren_core::escape::Escaped(&why.to_string()), "metadata change not committed");
                    let refused = replicate::unavailable(&op, &why);
                    out.push((ch, Op::Refuse(refused)));
                }
            }
        }
        self.send_batch(out).await
    }

    /// Whether `op` declares an exchange or queue this node already has.
    fn declared_here(&self, vhost: &str, op: &Op) -> bool {
        let table = self.guard.shared.routes.load();
        let Some(v) = table.vhost(vhost) else {
            return false;
        };
        match op {
            Op::ExchangeDeclare(d) => table.exchange(v, &d.exchange).is_some(),
            // An MQTT clean session's queue may exist here as the stub of an earlier
            // session on another node: its declare always moves it here.
            Op::QueueDeclare(d) => !d.exclusive && table.queue(v, &d.queue).is_some(),
            _ => false,
        }
    }

    /// Whether `user` may make the metadata change `op` in `vhost` (the broker's own
    /// permissions, read on the admin path).
    async fn may(&self, vhost: &str, user: &str, op: &Op) -> Result<bool, BrokerGone> {
        let broker = BrokerHandle {
            shared: self.guard.shared.clone(),
        };
        let AdminResponse::Permissions(all) =
            broker.admin_local(AdminRequest::ListPermissions).await?
        else {
            return Ok(false);
        };
        let perms = all
            .into_iter()
            .find(|p| p.vhost == vhost && p.user == user)
            .and_then(|p| warren_core::access::Permissions::compile(p).ok());
        if !replicate::permitted(perms.as_ref(), op) {
            return Ok(false);
        }
        // A bind from a topic exchange also needs the binding key's topic permission, as
        // the core checks it (`check_topic_access`), with the connection's MQTT client id.
        let (Op::QueueBind(b) | Op::QueueUnbind(b) | Op::ExchangeBind(b) | Op::ExchangeUnbind(b)) =
            op
        else {
            return Ok(true);
        };
        let topic = {
            let table = self.guard.shared.routes.load();
            table
                .vhost(vhost)
                .and_then(|v| table.exchange(v, &b.source))
                .is_some_and(|x| table.is_topic(x))
        };
        if !topic {
            return Ok(true);
        }
        let AdminResponse::TopicPermissions(all) = broker
            .admin_local(AdminRequest::ListTopicPermissions)
            .await?
        else {
            return Ok(false);
        };
        let mine: Vec<_> = all
            .into_iter()
            .filter(|p| p.vhost == vhost && p.user == user)
            .collect();
        if mine.is_empty() {
            return Ok(true);
        }
        let client_id = self
            .guard
            .shared
            .meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&self.guard.conn)
            .and_then(|m| m.client_id.clone());
        Ok(
            warren_core::access::TopicPermissions::compile(mine).is_ok_and(|t| {
                let t = match &client_id {
                    Some(id) => t.for_client(id),
                    None => t,
                };
                t.allows(warren_core::access::Perm::Read, &b.source, &b.routing_key)
            }),
        )
    }

    /// Sends one batch to the connection's shard.
    async fn send_batch(&self, ops: Vec<(u16, Op)>) -> Result<(), BrokerGone> {
        if ops.is_empty() {
            return Ok(());
        }
        let sent = self.guard.sent.load(Ordering::Acquire);
        self.guard.credit.wait(sent, MAX_IN_FLIGHT).await;
        self.guard
            .shared
            .shard(self.guard.conn)
            .requests
            .send(Request {
                conn: self.guard.conn,
                ops,
            })
            .await
            .map_err(|_| BrokerGone)?;
        self.guard.sent.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// The connection these operations belong to.
    pub fn conn(&self) -> ConnId {
        self.guard.conn
    }

    /// Describes the connection for operators' listings (replaces an earlier description).
    pub fn describe(&self, meta: ConnMeta) {
        if meta.protocol.starts_with("AMQP") {
            self.guard.amqp.store(true, Ordering::Relaxed);
        } else if meta.protocol.starts_with("MQTT") {
            self.guard.mqtt.store(true, Ordering::Relaxed);
        }
        self.guard
            .shared
            .meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(self.guard.conn, Arc::new(meta));
    }

    /// Routes the batch's publishes on the latest table (one lock-free load per batch, not
    /// held past it: a held snapshot keeps the broker's replaced paths alive). A publish
    /// the table cannot route (unknown exchange or vhost) goes unrouted: the broker reports
    /// the error.
    fn route(&self, ops: &mut [(u16, Op)]) {
        let mut table = None;
        for (_, op) in ops.iter_mut() {
            match op {
                Op::ConnectionOpen { vhost, user, .. } => {
                    // The replicator is set before any client can connect (`warren serve`
                    // starts the cluster first), so no connection of a member misses it.
                    if self.guard.shared.replicator.get().is_some() {
                        let _ = self
                            .guard
                            .login
                            .set(Box::new((vhost.clone(), user.clone())));
                    }
                    // The vhost's id: looked up once, when the connection opens.
                    let table = table.get_or_insert_with(|| self.guard.shared.routes.load());
                    if let Some(id) = table.vhost(vhost) {
                        let _ = self.guard.vhost.set(id);
                    }
                }
                Op::Publish(p) if p.routed.is_none() => {
                    let Some(&vhost) = self.guard.vhost.get() else {
                        continue;
                    };
                    let table = table.get_or_insert_with(|| self.guard.shared.routes.load());
                    p.routed = route_repeated(table, vhost, p);
                }
                _ => {}
            }
        }
    }
}
