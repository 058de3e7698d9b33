//! Users, vhosts and permissions over the wire, as RabbitMQ enforces them: a login with a
//! wrong password is refused (403), a vhost without permissions is refused (530), and every
//! operation checks configure / write / read against the user's patterns in its vhost (403
//! ACCESS_REFUSED closing only the channel, with RabbitMQ's reply text). Vhosts keep their
//! queues and exchanges apart. MQTT logins go through the same user database.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use warren_core::access::{PermissionDef, UserDef, VhostDef, hash_password};
use warren_runtime::{AdminRequest, AdminResponse, BrokerHandle};
use warren_tests::*;

async fn admin(broker: &BrokerHandle, request: AdminRequest) {
    match bounded(broker.admin(request)).await {
        Ok(AdminResponse::Done(Ok(()))) => {}
        other => panic!("admin request failed: {other:?}"),
    }
}

/// Vhost `dev`, user `bob` (password `s3cret`) who in `dev` may configure `bob-*`, write to
/// `bob-*` and the default exchange, and read `bob-*`.
async fn bob(broker: &BrokerHandle) {
    admin(
        broker,
        AdminRequest::AddVhost(VhostDef {
            name: "dev".into(),
            description: String::new(),
        }),
    )
    .await;
    admin(
        broker,
        AdminRequest::AddUser(UserDef {
            name: "bob".into(),
            password_hash: hash_password([7, 7, 7, 7], "s3cret"),
            tags: vec![],
        }),
    )
    .await;
    admin(
        broker,
        AdminRequest::SetPermissions(PermissionDef {
            user: "bob".into(),
            vhost: "dev".into(),
            configure: "^bob-.*".into(),
            write: "^(bob-.*|amq\\.default)$".into(),
            read: "^bob-.*".into(),
        }),
    )
    .await;
}

/// Publishes one message in confirm mode and waits for its confirm (so a refusal surfaces).
async fn publish_confirmed(c: lapin::Channel, exchange: &str, key: &str) -> lapin::Result<()> {
    warren_tests::bounded_as(
        "confirm.select-ok",
        c.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    c.basic_publish(
        exchange.into(),
        key.into(),
        BasicPublishOptions::default(),
        b"m",
        BasicProperties::default(),
    )
    .await?
    .await?;
    Ok(())
}

async fn login(
    b: &TestBroker,
    user: &str,
    password: &str,
    vhost: &str,
) -> lapin::Result<Connection> {
    let uri = format!(
        "amqp://{user}:{password}@{}/{}",
        b.addr,
        vhost.replace('/', "%2f")
    );
    bounded(Connection::connect(
        &uri,
        lapin::ConnectionProperties::default(),
    ))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_and_vhost_access() {
    let b = start().await;
    bob(&b.broker).await;
    assert!(login(&b, "bob", "s3cret", "dev").await.is_ok());
    assert!(
        login(&b, "bob", "wrong", "dev").await.is_err(),
        "wrong password"
    );
    assert!(
        login(&b, "nobody", "x", "dev").await.is_err(),
        "unknown user"
    );
    let err = login(&b, "bob", "s3cret", "/")
        .await
        .expect_err("no permissions in /");
    let (code, text, hard) = reply(&err);
    assert_eq!((code, hard), (530, true), "{text}");
    assert_eq!(
        text,
        "NOT_ALLOWED - access to vhost '/' refused for user 'bob'"
    );
    // guest has no permissions in a new vhost until given some.
    let err = login(&b, "guest", "guest", "dev")
        .await
        .expect_err("guest in dev");
    assert_eq!(reply(&err).0, 530);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_checks_its_permission() {
    let b = start().await;
    bob(&b.broker).await;
    let conn = login(&b, "bob", "s3cret", "dev").await.expect("bob");
    let ch = bounded(conn.create_channel()).await.expect("channel");
    declare(&ch, "bob-jobs").await;

    let opts = QueueDeclareOptions::default();
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "access to queue 'alice-jobs' in vhost 'dev' refused for user 'bob'",
        |c| async move {
            c.queue_declare("alice-jobs".into(), opts, FieldTable::default())
                .await
        },
    )
    .await;
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "access to exchange 'alice-x' in vhost 'dev' refused for user 'bob'",
        |c| async move {
            c.exchange_declare(
                "alice-x".into(),
                lapin::ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
        },
    )
    .await;
    // Publishing needs write on the exchange.
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "access to exchange 'amq.topic' in vhost 'dev' refused for user 'bob'",
        |c| publish_confirmed(c, "amq.topic", "k"),
    )
    .await;
    // Binding reads from the source exchange: amq.topic is not readable for bob.
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "access to exchange 'amq.topic' in vhost 'dev' refused for user 'bob'",
        |c| async move {
            c.queue_bind(
                "bob-jobs".into(),
                "amq.topic".into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
        },
    )
    .await;

    // The default exchange is writable (as amq.default), bob-* readable.
    let ch = bounded(conn.create_channel()).await.expect("channel");
    bounded(ch.basic_publish(
        "".into(),
        "bob-jobs".into(),
        BasicPublishOptions::default(),
        b"job",
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
    assert_eq!(drain(&ch, "bob-jobs").await, vec!["job"]);

    // guest, in /, declares a queue of the same name: vhosts keep them apart.
    let (_g, gch) = b.channel().await;
    let q = declare(&gch, "bob-jobs").await;
    assert_eq!(q.message_count(), 0);
    bounded(ch.basic_publish(
        "".into(),
        "bob-jobs".into(),
        BasicPublishOptions::default(),
        b"dev only",
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
    assert!(drain(&gch, "bob-jobs").await.is_empty());
    assert_eq!(drain(&ch, "bob-jobs").await, vec!["dev only"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_and_write_refusals_and_runtime_changes() {
    let b = start().await;
    bob(&b.broker).await;
    // Read-only on bob-*, nothing else.
    admin(
        &b.broker,
        AdminRequest::SetPermissions(PermissionDef {
            user: "bob".into(),
            vhost: "dev".into(),
            configure: "^bob-.*".into(),
            write: "".into(),
            read: "^bob-.*".into(),
        }),
    )
    .await;
    let conn = login(&b, "bob", "s3cret", "dev").await.expect("bob");
    let ch = bounded(conn.create_channel()).await.expect("channel");
    declare(&ch, "bob-q").await;
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "access to exchange 'amq.default' in vhost 'dev' refused for user 'bob'",
        |c| publish_confirmed(c, "", "bob-q"),
    )
    .await;
    // Read granted: consume and get work.
    let mut consumer = consume(&ch, "bob-q", true).await;
    nothing_within(&mut consumer, std::time::Duration::from_millis(50)).await;

    // Permissions cleared: the open connection may no longer read.
    match bounded(b.broker.admin(AdminRequest::ClearPermissions {
        vhost: "dev".into(),
        user: "bob".into(),
    }))
    .await
    {
        Ok(AdminResponse::Done(Ok(()))) => {}
        other => panic!("{other:?}"),
    }
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "access to queue 'bob-q' in vhost 'dev' refused for user 'bob'",
        |c| async move {
            c.basic_get("bob-q".into(), BasicGetOptions { no_ack: true })
                .await
        },
    )
    .await;

    // Deleting the vhost closes its connections (320).
    admin(&b.broker, AdminRequest::DeleteVhost("dev".into())).await;
    eventually("the vhost's connection is closed", || {
        !conn.status().connected()
    })
    .await;
}

/// Connects with `options` and returns why the broker refused (the CONNACK code as text).
async fn refusal(options: rumqttc::MqttOptions) -> String {
    let (_client, mut events) = rumqttc::AsyncClient::new(options, 10);
    loop {
        match bounded(events.poll()).await {
            Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(a))) => {
                panic!("accepted: {a:?}")
            }
            Ok(_) => {}
            Err(e) => return format!("{e:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_logins_use_the_same_users() {
    use rumqttc::{ConnectReturnCode, QoS};
    let m = warren_tests::mqtt::start().await;
    bob(&m.amqp.broker).await;
    // bob has no permissions in / (the MQTT vhost): refused as not authorised.
    let mut options = m.options("bob-1");
    options.set_credentials("bob", "s3cret");
    let why = refusal(options).await;
    assert!(why.contains("NotAuthorized"), "{why}");
    let mut options = m.options("bob-2");
    options.set_credentials("bob", "wrong");
    let why = refusal(options).await;
    assert!(why.contains("BadUserNamePassword"), "{why}");

    // With write on amq.topic only (no configure), bob may publish but not subscribe: the
    // SUBACK refuses the filter (0x80) and the connection lives, as MQTT 3.1.1 §3.9.3 says.
    admin(
        &m.amqp.broker,
        AdminRequest::SetPermissions(PermissionDef {
            user: "bob".into(),
            vhost: "/".into(),
            configure: "".into(),
            write: "^amq\\.topic$".into(),
            read: "".into(),
        }),
    )
    .await;
    let mut watcher = m.connect("watcher").await;
    watcher.subscribe("news/#", QoS::AtLeastOnce).await;
    let mut options = m.options("bob-3");
    options.set_credentials("bob", "s3cret");
    let (mut bob, ack) = m.connect_with(options).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    bob.publish("news/today", QoS::AtLeastOnce, false, b"hello")
        .await;
    assert_eq!(&watcher.next_publish().await.payload[..], b"hello");
    warren_tests::bounded_as(
        "room in the client queue for SUBSCRIBE",
        bob.client.subscribe("news/#", QoS::AtMostOnce),
    )
    .await
    .expect("queue the subscribe");
    assert_eq!(bob.suback().await, [rumqttc::SubscribeReasonCode::Failure]);
    bob.publish("news/later", QoS::AtLeastOnce, false, b"still here")
        .await;
    assert_eq!(&watcher.next_publish().await.payload[..], b"still here");
}
