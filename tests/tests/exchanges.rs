//! Exchanges over the wire with lapin: predeclared ones, every type, flags, exchange-to-exchange
//! bindings, alternate exchanges, topic wildcards, headers matching.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, ExchangeKind};
use std::time::Duration;
use warren_tests::*;

fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predeclared_exchanges_exist() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    for (name, kind) in [
        ("amq.direct", ExchangeKind::Direct),
        ("amq.fanout", ExchangeKind::Fanout),
        ("amq.topic", ExchangeKind::Topic),
        ("amq.headers", ExchangeKind::Headers),
        ("amq.match", ExchangeKind::Headers),
        ("amq.rabbitmq.trace", ExchangeKind::Topic),
    ] {
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        bounded(ch.exchange_declare(name.into(), kind, passive, FieldTable::default()))
            .await
            .unwrap_or_else(|e| panic!("{name} should exist: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_declare_of_missing_exchange_is_404_and_redeclare_mismatch_is_406() {
    let b = start().await;
    let conn = b.connect().await;
    let ch = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let err = bounded(ch.exchange_declare(
        "nope".into(),
        ExchangeKind::Direct,
        passive,
        FieldTable::default(),
    ))
    .await
    .expect_err("missing");
    assert_eq!(code(&err), 404);
    let ch = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    bounded(ch.exchange_declare(
        "x".into(),
        ExchangeKind::Direct,
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("declare");
    let err = bounded(ch.exchange_declare(
        "x".into(),
        ExchangeKind::Fanout,
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect_err("type mismatch");
    assert_eq!(code(&err), 406);
    let ch = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    let err = bounded(ch.exchange_declare(
        "amq.mine".into(),
        ExchangeKind::Direct,
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect_err("reserved prefix");
    assert_eq!(code(&err), 403);
    assert!(
        conn.status().connected(),
        "channel errors leave the connection open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fanout_direct_and_internal_exchanges() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    bounded(ch.exchange_declare(
        "fan".into(),
        ExchangeKind::Fanout,
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("fanout");
    for q in ["f1", "f2"] {
        declare(&ch, q).await;
        bounded(ch.queue_bind(
            q.into(),
            "fan".into(),
            "ignored".into(),
            Default::default(),
            FieldTable::default(),
        ))
        .await
        .expect("bind");
    }
    bounded(ch.basic_publish(
        "fan".into(),
        "any".into(),
        Default::default(),
        b"to-all",
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
    for q in ["f1", "f2"] {
        let got = bounded(ch.basic_get(q.into(), BasicGetOptions { no_ack: true }))
            .await
            .expect("get");
        assert_eq!(got.expect("a message").delivery.data, b"to-all");
    }
    let internal = ExchangeDeclareOptions {
        internal: true,
        durable: true,
        ..Default::default()
    };
    bounded(ch.exchange_declare(
        "inside".into(),
        ExchangeKind::Direct,
        internal,
        FieldTable::default(),
    ))
    .await
    .expect("internal exchange");
    let ch2 = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    warren_tests::bounded_as("confirm.select-ok", ch2.confirm_select(Default::default()))
        .await
        .expect("confirms");
    let res = bounded(async {
        ch2.basic_publish(
            "inside".into(),
            "k".into(),
            Default::default(),
            b"x",
            BasicProperties::default(),
        )
        .await?
        .await
    })
    .await;
    assert_eq!(
        code(&res.expect_err("publishing to an internal exchange")),
        403
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_wildcards() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let patterns = [
        ("star", "a.*.c"),
        ("hash", "a.#"),
        ("exact", "a.b.c"),
        ("all", "#"),
    ];
    for (q, p) in patterns {
        declare(&ch, q).await;
        bounded(ch.queue_bind(
            q.into(),
            "amq.topic".into(),
            p.into(),
            Default::default(),
            FieldTable::default(),
        ))
        .await
        .expect("bind");
    }
    for key in ["a.b.c", "a", "a.x.y.z", "b.c"] {
        bounded(ch.basic_publish(
            "amq.topic".into(),
            key.into(),
            Default::default(),
            key.as_bytes(),
            BasicProperties::default(),
        ))
        .await
        .expect("publish");
    }
    assert_eq!(drain(&ch, "star").await, ["a.b.c"]);
    assert_eq!(drain(&ch, "hash").await, ["a.b.c", "a", "a.x.y.z"]);
    assert_eq!(drain(&ch, "exact").await, ["a.b.c"]);
    assert_eq!(drain(&ch, "all").await, ["a.b.c", "a", "a.x.y.z", "b.c"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_exchange_all_and_any() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "h-all").await;
    declare(&ch, "h-any").await;
    let all = table(&[
        ("x-match", text("all")),
        ("format", text("pdf")),
        ("type", text("report")),
    ]);
    let any = table(&[
        ("x-match", text("any")),
        ("format", text("pdf")),
        ("type", text("report")),
    ]);
    bounded(ch.queue_bind(
        "h-all".into(),
        "amq.headers".into(),
        "".into(),
        Default::default(),
        all,
    ))
    .await
    .expect("bind all");
    bounded(ch.queue_bind(
        "h-any".into(),
        "amq.match".into(),
        "".into(),
        Default::default(),
        any.clone(),
    ))
    .await
    .expect("bind any");
    bounded(ch.exchange_bind(
        "amq.match".into(),
        "amq.headers".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("e2e bind");
    let publish = |headers: FieldTable, body: &'static str| {
        let ch = ch.clone();
        async move {
            bounded(ch.basic_publish(
                "amq.headers".into(),
                "".into(),
                Default::default(),
                body.as_bytes(),
                BasicProperties::default().with_headers(headers),
            ))
            .await
            .expect("publish");
        }
    };
    publish(
        table(&[("format", text("pdf")), ("type", text("report"))]),
        "both",
    )
    .await;
    publish(table(&[("format", text("pdf"))]), "one").await;
    publish(table(&[("format", text("zip"))]), "none").await;
    assert_eq!(drain(&ch, "h-all").await, ["both"]);
    assert_eq!(drain(&ch, "h-any").await, ["both", "one"]);
    let err = bounded(ch.queue_bind(
        "h-all".into(),
        "amq.headers".into(),
        "".into(),
        Default::default(),
        table(&[("x-match", text("some"))]),
    ))
    .await
    .expect_err("invalid x-match");
    assert_eq!(code(&err), 406);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_to_exchange_bindings_and_alternate_exchange() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    bounded(ch.exchange_declare(
        "unrouted".into(),
        ExchangeKind::Fanout,
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("ae");
    let args = table(&[("alternate-exchange", text("unrouted"))]);
    bounded(ch.exchange_declare(
        "front".into(),
        ExchangeKind::Direct,
        Default::default(),
        args,
    ))
    .await
    .expect("with ae");
    bounded(ch.exchange_declare(
        "back".into(),
        ExchangeKind::Topic,
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("back");
    bounded(ch.exchange_bind(
        "back".into(),
        "front".into(),
        "orders".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("e2e");
    declare(&ch, "orders-q").await;
    declare(&ch, "lost-q").await;
    bounded(ch.queue_bind(
        "orders-q".into(),
        "back".into(),
        "#".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    bounded(ch.queue_bind(
        "lost-q".into(),
        "unrouted".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    for (key, body) in [("orders", "via-e2e"), ("refunds", "via-ae")] {
        bounded(ch.basic_publish(
            "front".into(),
            key.into(),
            Default::default(),
            body.as_bytes(),
            BasicProperties::default(),
        ))
        .await
        .expect("publish");
    }
    assert_eq!(drain(&ch, "orders-q").await, ["via-e2e"]);
    assert_eq!(drain(&ch, "lost-q").await, ["via-ae"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_delete_exchange_goes_with_its_last_binding_and_delete_if_unused() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    let auto = ExchangeDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    bounded(ch.exchange_declare(
        "ephemeral".into(),
        ExchangeKind::Direct,
        auto,
        FieldTable::default(),
    ))
    .await
    .expect("auto-delete exchange");
    declare(&ch, "aq").await;
    bounded(ch.queue_bind(
        "aq".into(),
        "ephemeral".into(),
        "k".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    let err = bounded(ch.exchange_delete(
        "ephemeral".into(),
        ExchangeDeleteOptions {
            if_unused: true,
            ..Default::default()
        },
    ))
    .await
    .expect_err("in use");
    assert_eq!(code(&err), 406);
    let ch = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    bounded(ch.queue_unbind(
        "aq".into(),
        "ephemeral".into(),
        "k".into(),
        FieldTable::default(),
    ))
    .await
    .expect("unbind");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let err = bounded(ch.exchange_declare(
        "ephemeral".into(),
        ExchangeKind::Direct,
        passive,
        FieldTable::default(),
    ))
    .await
    .expect_err("gone with its last binding");
    assert_eq!(code(&err), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_exchanges_of_every_type_route_like_rabbitmq() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    for (name, kind) in [
        ("my.direct", ExchangeKind::Direct),
        ("my.fanout", ExchangeKind::Fanout),
        ("my.topic", ExchangeKind::Topic),
        ("my.headers", ExchangeKind::Headers),
    ] {
        bounded(ch.exchange_declare(name.into(), kind.clone(), durable, FieldTable::default()))
            .await
            .unwrap_or_else(|e| panic!("declare {name}: {e}"));
        // Declaring again with the same properties is a no-op; a passive declare finds it.
        bounded(ch.exchange_declare(name.into(), kind.clone(), durable, FieldTable::default()))
            .await
            .unwrap_or_else(|e| panic!("redeclare {name}: {e}"));
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        bounded(ch.exchange_declare(name.into(), kind, passive, FieldTable::default()))
            .await
            .unwrap_or_else(|e| panic!("passive {name}: {e}"));
        let q = format!("{name}.q");
        declare(&ch, &q).await;
        let args = if name == "my.headers" {
            // No x-match: "all" is the default. x- arguments take no part in matching.
            table(&[("color", text("red")), ("x-note", text("ignored"))])
        } else {
            FieldTable::default()
        };
        bounded(ch.queue_bind(
            q.as_str().into(),
            name.into(),
            "k.1".into(),
            Default::default(),
            args,
        ))
        .await
        .expect("bind");
    }
    let send = |exchange: &'static str, key: &'static str, body: &'static str, h: FieldTable| {
        let ch = ch.clone();
        async move {
            bounded(ch.basic_publish(
                exchange.into(),
                key.into(),
                Default::default(),
                body.as_bytes(),
                BasicProperties::default().with_headers(h),
            ))
            .await
            .expect("publish");
        }
    };
    send("my.direct", "k.1", "direct-hit", FieldTable::default()).await;
    send("my.direct", "k.2", "direct-miss", FieldTable::default()).await;
    send("my.fanout", "whatever", "fanout-hit", FieldTable::default()).await;
    send("my.topic", "k.1", "topic-hit", FieldTable::default()).await;
    send("my.topic", "k.1.2", "topic-miss", FieldTable::default()).await;
    send(
        "my.headers",
        "",
        "headers-hit",
        table(&[("color", text("red")), ("size", text("xl"))]),
    )
    .await;
    send(
        "my.headers",
        "",
        "headers-miss",
        table(&[("color", text("blue"))]),
    )
    .await;
    send("my.headers", "", "headers-none", FieldTable::default()).await;
    assert_eq!(drain(&ch, "my.direct.q").await, ["direct-hit"]);
    assert_eq!(drain(&ch, "my.fanout.q").await, ["fanout-hit"]);
    assert_eq!(drain(&ch, "my.topic.q").await, ["topic-hit"]);
    assert_eq!(drain(&ch, "my.headers.q").await, ["headers-hit"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_exchange_is_reached_through_an_exchange_binding() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    bounded(ch.exchange_declare(
        "hidden".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            internal: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect("internal exchange");
    bounded(ch.exchange_bind(
        "hidden".into(),
        "amq.direct".into(),
        "in".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind the internal exchange below amq.direct");
    declare(&ch, "behind").await;
    bounded(ch.queue_bind(
        "behind".into(),
        "hidden".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    bounded(ch.basic_publish(
        "amq.direct".into(),
        "in".into(),
        Default::default(),
        b"through",
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
    assert_eq!(drain(&ch, "behind").await, ["through"]);
    // Unbinding the exchanges cuts the route.
    bounded(ch.exchange_unbind(
        "hidden".into(),
        "amq.direct".into(),
        "in".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("exchange.unbind");
    bounded(ch.basic_publish(
        "amq.direct".into(),
        "in".into(),
        Default::default(),
        b"dropped",
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
    assert!(drain(&ch, "behind").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_hash_in_the_middle_and_alternate_exchange_prevents_returns() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "mid").await;
    bounded(ch.queue_bind(
        "mid".into(),
        "amq.topic".into(),
        "a.#.c".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    for key in ["a.c", "a.b.c", "a.b.b.c", "a.b", "x.a.c", "a.c.d"] {
        bounded(ch.basic_publish(
            "amq.topic".into(),
            key.into(),
            Default::default(),
            key.as_bytes(),
            BasicProperties::default(),
        ))
        .await
        .expect("publish");
    }
    assert_eq!(drain(&ch, "mid").await, ["a.c", "a.b.c", "a.b.b.c"]);
    // A mandatory message that only the alternate exchange routes is not returned.
    bounded(ch.exchange_declare(
        "catch-all".into(),
        ExchangeKind::Fanout,
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("ae");
    bounded(ch.exchange_declare(
        "picky".into(),
        ExchangeKind::Direct,
        Default::default(),
        table(&[("alternate-exchange", text("catch-all"))]),
    ))
    .await
    .expect("with ae");
    declare(&ch, "caught").await;
    bounded(ch.queue_bind(
        "caught".into(),
        "catch-all".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    warren_tests::bounded_as("confirm.select-ok", ch.confirm_select(Default::default()))
        .await
        .expect("confirms");
    let confirm = bounded(async {
        ch.basic_publish(
            "picky".into(),
            "nobody".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"rescued",
            BasicProperties::default(),
        )
        .await?
        .await
    })
    .await
    .expect("publish");
    assert!(
        matches!(confirm, lapin::Confirmation::Ack(None)),
        "routed through the alternate exchange: acked, not returned; got {confirm:?}"
    );
    assert_eq!(drain(&ch, "caught").await, ["rescued"]);
}
