//! A shovel's I/O over lapin: one session opens both ends (declaring the queues as
//! RabbitMQ's shovel does), consumes with the prefetch as the bound on unsettled messages,
//! publishes what `Link` decides and settles the source as the ack mode says. A session
//! ends with the first failure; the supervisor reconnects.

use super::config::{AckMode, Source};
use super::link::{Decision, Incoming, Link, table};
use crate::status::Entry;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Confirmation, Connection, ConnectionProperties};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::watch;

/// How long one connect (TCP, handshake, channel, declares) may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// Why a session ended with a failure (the status's `reason`).
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// An end could not be reached or opened.
    #[error("{end}: {source}")]
    Amqp {
        /// `source` or `destination`.
        end: &'static str,
        /// What lapin said.
        source: lapin::Error,
    },
    /// An end did not answer in time.
    #[error("{0}: timed out")]
    Timeout(&'static str),
    /// The source cancelled the shovel's consumer (its queue was deleted, say).
    #[error("source: consumer cancelled")]
    Cancelled,
    /// A URI cannot be dialled.
    #[error("{0}")]
    Uri(String),
}

/// How a session ended without a failure.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The shovel was told to stop (its parameter changed or was cleared, or the broker
    /// stops).
    Stopped,
    /// `src-delete-after` reached: the shovel deletes itself.
    Done,
}

type Confirm = Pin<Box<dyn Future<Output = (u64, lapin::Result<Confirmation>)> + Send>>;

async fn bounded<T>(
    end: &'static str,
    f: impl Future<Output = lapin::Result<T>>,
) -> Result<T, SessionError> {
    match tokio::time::timeout(OPEN_TIMEOUT, f).await {
        Ok(r) => r.map_err(|source| SessionError::Amqp { end, source }),
        Err(_) => Err(SessionError::Timeout(end)),
    }
}

fn amqp(end: &'static str) -> impl Fn(lapin::Error) -> SessionError {
    move |source| SessionError::Amqp { end, source }
}

async fn open(
    end: &'static str,
    uri: &str,
    name: &str,
) -> Result<(Connection, Channel), SessionError> {
    let props =
        ConnectionProperties::default().with_connection_name(format!("Shovel {name}").into());
    let conn = bounded(end, Connection::connect(uri, props)).await?;
    let ch = bounded(end, conn.create_channel()).await?;
    Ok((conn, ch))
}

/// Closes a connection, bounded: its unsettled deliveries go back to their queue.
async fn close(conn: &Connection) {
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        conn.close(200, "shovel stopped".into()),
    )
    .await;
}

/// The source queue to consume from, and the messages it held.
async fn source_queue(link: &Link, ch: &Channel) -> Result<(String, u64), SessionError> {
    let cfg = link.config();
    match &cfg.source {
        // RabbitMQ's shovel declares its source queue durable (with src-queue-args); an
        // existing queue's declare is a check that it is there.
        Source::Queue(q) => {
            let opts = QueueDeclareOptions {
                durable: true,
                ..Default::default()
            };
            let args = table(&cfg.src_queue_args);
            let q = bounded("source", ch.queue_declare(q.as_str().into(), opts, args)).await?;
            Ok((q.name().to_string(), u64::from(q.message_count())))
        }
        Source::Exchange { exchange, key } => {
            let opts = QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            };
            let q = bounded(
                "source",
                ch.queue_declare("".into(), opts, FieldTable::default()),
            )
            .await?;
            let name = q.name().to_string();
            bounded(
                "source",
                ch.queue_bind(
                    name.as_str().into(),
                    exchange.as_str().into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                ),
            )
            .await?;
            Ok((name, 0))
        }
    }
}

/// Runs one session from `src` to `dest` (URIs to dial) until it fails or ends.
pub async fn session(
    link: &mut Link,
    src: &str,
    dest: &str,
    name: &str,
    entry: &Entry,
    now_ms: impl Fn() -> u64,
    stop: &mut watch::Receiver<bool>,
) -> Result<Ended, SessionError> {
    let (src_conn, src_ch) = open("source", src, name).await?;
    let dest_end = open("destination", dest, name).await;
    let (dest_conn, dest_ch) = match dest_end {
        Ok(d) => d,
        Err(e) => {
            close(&src_conn).await;
            return Err(e);
        }
    };
    let result = run(link, &src_ch, &dest_ch, name, entry, &now_ms, stop).await;
    // Unsettled deliveries go back to the source queue with its channel; the link counts
    // them as still to move.
    close(&src_conn).await;
    close(&dest_conn).await;
    link.disconnected();
    result
}

async fn run(
    link: &mut Link,
    src: &Channel,
    dest: &Channel,
    name: &str,
    entry: &Entry,
    now_ms: &impl Fn() -> u64,
    stop: &mut watch::Receiver<bool>,
) -> Result<Ended, SessionError> {
    let cfg = link.config().clone();
    let (queue, count) = source_queue(link, src).await?;
    if let Some(q) = &cfg.dest_queue {
        let opts = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let args = table(&cfg.dest_queue_args);
        bounded(
            "destination",
            dest.queue_declare(q.as_str().into(), opts, args),
        )
        .await?;
    }
    let confirms = cfg.ack_mode == AckMode::OnConfirm;
    if confirms {
        bounded(
            "destination",
            dest.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
    }
    link.started(count);
    if link.done() {
        return Ok(Ended::Done);
    }
    bounded(
        "source",
        src.basic_qos(cfg.prefetch, BasicQosOptions::default()),
    )
    .await?;
    let mut consumer = bounded(
        "source",
        src.basic_consume(
            queue.as_str().into(),
            format!("shovel-{name}").into(),
            BasicConsumeOptions::default(),
            table(&cfg.src_consumer_args),
        ),
    )
    .await?;
    if entry.set(crate::status::State::Running, None, now_ms()) {
        crate::supervisor::log_state(name, crate::status::State::Running, None);
    }
    // At most `prefetch` confirms pending: the source delivers no more unsettled ones.
    let mut pending: FuturesUnordered<Confirm> = FuturesUnordered::new();
    loop {
        tokio::select! {
            biased;
            _ = stop.changed() => return Ok(Ended::Stopped),
            Some((tag, confirmed)) = pending.next(), if !pending.is_empty() => {
                match confirmed.map_err(amqp("destination"))? {
                    Confirmation::Ack(_) | Confirmation::NotRequested => {
                        src.basic_ack(tag, BasicAckOptions::default()).await.map_err(amqp("source"))?;
                        link.settled();
                        entry.moved.fetch_add(1, Ordering::Relaxed);
                    }
                    // The destination refused it: back to the source (RabbitMQ's shovel
                    // nacks with requeue), to be tried again.
                    Confirmation::Nack(_) => {
                        let requeue = BasicNackOptions { requeue: true, ..Default::default() };
                        src.basic_nack(tag, requeue).await.map_err(amqp("source"))?;
                        link.returned();
                    }
                }
            }
            delivery = consumer.next() => {
                let d = match delivery {
                    Some(d) => d.map_err(amqp("source"))?,
                    None => return Err(SessionError::Cancelled),
                };
                let incoming = Incoming {
                    exchange: d.exchange.as_str(),
                    routing_key: d.routing_key.as_str(),
                    properties: &d.properties,
                };
                let Decision::Publish { exchange, routing_key, properties } =
                    link.accept(&incoming, now_ms() / 1000)
                else {
                    // Past src-delete-after: stays in the source.
                    let requeue = BasicNackOptions { requeue: true, ..Default::default() };
                    src.basic_nack(d.delivery_tag, requeue).await.map_err(amqp("source"))?;
                    continue;
                };
                if link.settles_on_receipt() {
                    src.basic_ack(d.delivery_tag, BasicAckOptions::default()).await.map_err(amqp("source"))?;
                }
                let published = dest
                    .basic_publish(
                        exchange.as_str().into(),
                        routing_key.as_str().into(),
                        BasicPublishOptions::default(),
                        &d.data,
                        *properties,
                    )
                    .await;
                let confirm = match published {
                    Ok(c) => c,
                    Err(e) => {
                        if link.settles_on_receipt() {
                            link.lost();
                        }
                        return Err(SessionError::Amqp { end: "destination", source: e });
                    }
                };
                match cfg.ack_mode {
                    AckMode::OnConfirm => {
                        let tag = d.delivery_tag;
                        pending.push(Box::pin(async move { (tag, confirm.await) }));
                    }
                    AckMode::OnPublish => {
                        src.basic_ack(d.delivery_tag, BasicAckOptions::default()).await.map_err(amqp("source"))?;
                        link.settled();
                        entry.moved.fetch_add(1, Ordering::Relaxed);
                    }
                    AckMode::NoAck => {
                        link.settled();
                        entry.moved.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        if link.done() {
            return Ok(Ended::Done);
        }
    }
}
