//! Errors as RabbitMQ reports them, over the wire with lapin. A channel exception (403
//! ACCESS_REFUSED, 404 NOT_FOUND, 405 RESOURCE_LOCKED, 406 PRECONDITION_FAILED) closes only its
//! channel: the connection, its other channels and their consumers carry on, and the closed
//! channel's unacked messages are requeued. A connection exception (503 COMMAND_INVALID, 530
//! NOT_ALLOWED) closes the connection with every channel on it. Reply texts read
//! `NAME - detail`, as RabbitMQ writes them.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use warren_tests::*;

async fn publish(ch: &Channel, exchange: &str, key: &str, body: &str) {
    bounded(ch.basic_publish(
        exchange.into(),
        key.into(),
        Default::default(),
        body.as_bytes(),
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_found_404_closes_only_the_channel() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    declare(&ch, "present").await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    channel_error(&conn, 404, "NOT_FOUND", "no-such-queue", |c| async move {
        c.queue_declare("no-such-queue".into(), passive, FieldTable::default())
            .await
    })
    .await;
    channel_error(
        &conn,
        404,
        "NOT_FOUND",
        "no-such-exchange",
        |c| async move {
            c.queue_bind(
                "present".into(),
                "no-such-exchange".into(),
                "k".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
        },
    )
    .await;
    channel_error(&conn, 404, "NOT_FOUND", "no-such-queue", |c| async move {
        c.queue_bind(
            "no-such-queue".into(),
            "amq.direct".into(),
            "k".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
    })
    .await;
    channel_error(
        &conn,
        404,
        "NOT_FOUND",
        "no-such-exchange",
        |c| async move {
            c.exchange_bind(
                "amq.fanout".into(),
                "no-such-exchange".into(),
                "".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
        },
    )
    .await;
    channel_error(&conn, 404, "NOT_FOUND", "no-such-queue", |c| async move {
        c.queue_purge("no-such-queue".into(), Default::default())
            .await
    })
    .await;
    channel_error(&conn, 404, "NOT_FOUND", "no-such-queue", |c| async move {
        c.basic_consume(
            "no-such-queue".into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .map(|consumer| consumer.tag())
    })
    .await;
    channel_error(&conn, 404, "NOT_FOUND", "no-such-queue", |c| async move {
        c.basic_get("no-such-queue".into(), Default::default())
            .await
            .map(|m| m.is_some())
    })
    .await;
    // The first channel saw none of it.
    publish(&ch, "", "present", "still here").await;
    assert_eq!(drain(&ch, "present").await, ["still here"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_what_is_not_there_is_not_an_error() {
    // RabbitMQ 3.x made exchange.delete and queue.delete idempotent.
    let b = start().await;
    let (conn, ch) = b.channel().await;
    let n = bounded(ch.queue_delete("never-was".into(), Default::default()))
        .await
        .expect("queue.delete of a missing queue is delete-ok");
    assert_eq!(n, 0);
    bounded(ch.exchange_delete("never-was".into(), Default::default()))
        .await
        .expect("exchange.delete of a missing exchange is delete-ok");
    assert!(ch.status().connected() && conn.status().connected());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_refused_403_closes_only_the_channel() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    declare(&ch, "watched").await;
    let _first = consume(&ch, "watched", false).await;
    channel_error(&conn, 403, "ACCESS_REFUSED", "amq.custom", |c| async move {
        c.exchange_declare(
            "amq.custom".into(),
            ExchangeKind::Direct,
            Default::default(),
            FieldTable::default(),
        )
        .await
    })
    .await;
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "amq.custom-q",
        |c| async move {
            c.queue_declare(
                "amq.custom-q".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
            .map(|q| q.name().to_string())
        },
    )
    .await;
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "default exchange",
        |c| async move {
            c.queue_bind(
                "watched".into(),
                "".into(),
                "watched".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
        },
    )
    .await;
    channel_error(&conn, 403, "ACCESS_REFUSED", "amq.direct", |c| async move {
        c.exchange_delete("amq.direct".into(), Default::default())
            .await
    })
    .await;
    // An exclusive consumer needs a queue without consumers.
    channel_error(&conn, 403, "ACCESS_REFUSED", "watched", |c| async move {
        c.basic_consume(
            "watched".into(),
            "".into(),
            BasicConsumeOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map(|consumer| consumer.tag())
    })
    .await;
    // amq.* exchanges that exist can still be declared (equivalently) and used.
    bounded(ch.exchange_declare(
        "amq.direct".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect("redeclaring amq.direct as it is");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_locked_405_for_another_connections_exclusive_queue() {
    let b = start().await;
    let (_owner, mine) = b.channel().await;
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    bounded(mine.queue_declare("private".into(), exclusive, FieldTable::default()))
        .await
        .expect("exclusive queue");
    publish(&mine, "", "private", "secret").await;
    let stranger = b.connect().await;
    channel_error(
        &stranger,
        405,
        "RESOURCE_LOCKED",
        "private",
        |c| async move {
            c.queue_declare("private".into(), exclusive, FieldTable::default())
                .await
                .map(|q| q.name().to_string())
        },
    )
    .await;
    channel_error(
        &stranger,
        405,
        "RESOURCE_LOCKED",
        "private",
        |c| async move {
            c.queue_declare(
                "private".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|q| q.name().to_string())
        },
    )
    .await;
    channel_error(
        &stranger,
        405,
        "RESOURCE_LOCKED",
        "private",
        |c| async move {
            c.basic_get("private".into(), Default::default())
                .await
                .map(|m| m.is_some())
        },
    )
    .await;
    channel_error(
        &stranger,
        405,
        "RESOURCE_LOCKED",
        "private",
        |c| async move { c.queue_purge("private".into(), Default::default()).await },
    )
    .await;
    channel_error(
        &stranger,
        405,
        "RESOURCE_LOCKED",
        "private",
        |c| async move { c.queue_delete("private".into(), Default::default()).await },
    )
    .await;
    channel_error(
        &stranger,
        405,
        "RESOURCE_LOCKED",
        "private",
        |c| async move {
            c.queue_bind(
                "private".into(),
                "amq.fanout".into(),
                "".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
        },
    )
    .await;
    // None of that touched the owner's queue.
    assert_eq!(drain(&mine, "private").await, ["secret"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precondition_failed_406_closes_only_the_channel() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    bounded(ch.exchange_declare(
        "typed".into(),
        ExchangeKind::Topic,
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("exchange");
    bounded(ch.queue_declare(
        "kept".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect("durable queue");
    publish(&ch, "", "kept", "m").await;
    channel_error(&conn, 406, "PRECONDITION_FAILED", "typed", |c| async move {
        c.exchange_declare(
            "typed".into(),
            ExchangeKind::Direct,
            Default::default(),
            FieldTable::default(),
        )
        .await
    })
    .await;
    channel_error(&conn, 406, "PRECONDITION_FAILED", "kept", |c| async move {
        c.queue_declare(
            "kept".into(),
            QueueDeclareOptions {
                auto_delete: true,
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map(|q| q.name().to_string())
    })
    .await;
    channel_error(&conn, 406, "PRECONDITION_FAILED", "kept", |c| async move {
        c.queue_delete(
            "kept".into(),
            QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        )
        .await
    })
    .await;
    // Acks have no reply: their errors are told apart on connections of their own.
    let conn = b.connect().await;
    channel_error(
        &conn,
        406,
        "PRECONDITION_FAILED",
        "unknown delivery tag",
        |c| async move {
            c.basic_ack(7, Default::default()).await?;
            // The ack has no reply: a round trip after it surfaces the channel close.
            c.queue_declare(
                "kept".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|q| q.message_count())
        },
    )
    .await;
    let conn = b.connect().await;
    channel_error(
        &conn,
        406,
        "PRECONDITION_FAILED",
        "unknown delivery tag",
        |c| async move {
            let m = c
                .basic_get("kept".into(), Default::default())
                .await?
                .expect("a message");
            c.basic_ack(m.delivery.delivery_tag, Default::default())
                .await?;
            // Acking the same tag twice is acking an unknown tag.
            c.basic_ack(m.delivery.delivery_tag, Default::default())
                .await?;
            c.queue_declare(
                "kept".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|q| q.message_count())
        },
    )
    .await;
    assert!(ch.status().connected());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_error_requeues_that_channels_unacked_messages_and_spares_other_consumers() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    declare(&ch, "work").await;
    declare(&ch, "other").await;
    let mut other = consume(&ch, "other", false).await;
    publish(&ch, "", "work", "held").await;
    let doomed = bounded(conn.create_channel()).await.expect("channel");
    let held = bounded(doomed.basic_get("work".into(), Default::default()))
        .await
        .expect("get")
        .expect("a message");
    assert!(!held.delivery.redelivered);
    let err = bounded(doomed.queue_declare(
        "nowhere".into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect_err("404");
    assert_eq!(code(&err), 404);
    // The unacked message goes back to its queue, flagged redelivered.
    let again = bounded(async {
        loop {
            if let Some(m) = ch
                .basic_get("work".into(), BasicGetOptions { no_ack: true })
                .await
                .expect("get")
            {
                break m;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(body(&again.delivery), "held");
    assert!(again.delivery.redelivered);
    // The consumer on the surviving channel still gets its messages.
    publish(&ch, "", "other", "after").await;
    let d = next(&mut other).await;
    assert_eq!(body(&d), "after");
    bounded(d.ack(Default::default())).await.expect("ack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_invalid_503_closes_the_connection_and_all_its_channels() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    let bystander = bounded(conn.create_channel()).await.expect("channel");
    let err = bounded(ch.exchange_declare(
        "odd".into(),
        ExchangeKind::Custom("x-no-such-type".into()),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect_err("unknown exchange type");
    let (c, text, hard) = reply(&err);
    assert_eq!((c, hard), (503, true), "{text}");
    assert!(text.starts_with("COMMAND_INVALID - "), "{text}");
    assert!(text.contains("x-no-such-type"), "{text}");
    eventually("the connection is closed", || !conn.status().connected()).await;
    eventually("every channel is closed", || {
        !bystander.status().connected()
    })
    .await;
    assert!(
        bounded(bystander.queue_declare("".into(), Default::default(), FieldTable::default()))
            .await
            .is_err()
    );
    // Other connections are untouched.
    let (_c2, ch2) = b.channel().await;
    declare(&ch2, "fine").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reusing_a_consumer_tag_is_a_530_connection_error() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    declare(&ch, "tagged").await;
    // Keep it: dropping a lapin Consumer sends basic.cancel, freeing the tag.
    let _first = bounded(ch.basic_consume(
        "tagged".into(),
        "mine".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("first consumer");
    let err = bounded(ch.basic_consume(
        "tagged".into(),
        "mine".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect_err("same tag on the same channel");
    let (c, text, hard) = reply(&err);
    assert_eq!((c, hard), (530, true), "{text}");
    assert!(text.starts_with("NOT_ALLOWED - "), "{text}");
    assert!(text.contains("mine"), "{text}");
    eventually("the connection is closed", || !conn.status().connected()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_a_missing_vhost_is_refused_with_530() {
    let b = start().await;
    let uri = format!("amqp://guest:guest@{}/no-such-vhost", b.addr);
    let err = bounded(Connection::connect(
        &uri,
        lapin::ConnectionProperties::default(),
    ))
    .await
    .expect_err("unknown vhost");
    let (c, text, _) = reply(&err);
    assert_eq!(c, 530, "{text}");
    assert!(text.starts_with("NOT_ALLOWED - "), "{text}");
    assert!(text.contains("no-such-vhost"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_and_confirm_modes_do_not_mix() {
    let b = start().await;
    let conn = b.connect().await;
    channel_error(
        &conn,
        406,
        "PRECONDITION_FAILED",
        "confirm",
        |c| async move {
            c.confirm_select(Default::default()).await?;
            c.tx_select().await
        },
    )
    .await;
    channel_error(&conn, 406, "PRECONDITION_FAILED", "tx", |c| async move {
        c.tx_select().await?;
        c.confirm_select(Default::default()).await
    })
    .await;
    channel_error(
        &conn,
        406,
        "PRECONDITION_FAILED",
        "not transactional",
        |c| async move { c.tx_commit().await },
    )
    .await;
}
