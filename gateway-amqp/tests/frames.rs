//! Every frame the server encodes, pinned byte for byte (insta snapshots of hex dumps), the
//! hand-written hot-path encoders checked against amq-protocol's generator, and a decode round
//! trip for every client method the gateway accepts.

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{
    AMQPClass, BasicProperties, basic, channel, confirm, connection, exchange, queue, tx,
};
use amq_protocol::types::{AMQPValue, FieldTable, ShortString};
use bytes::{Bytes, BytesMut};
use std::sync::Arc;
use warren_amqp::codec::{self, Frame};
use warren_amqp::config::AmqpConfig;
use warren_amqp::{handshake, methods};
use warren_core::effect::Reply;
use warren_core::message::{FieldValue, Properties};

fn hex(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .map(|row| {
            row.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn method(ch: u16, m: AMQPClass) -> String {
    let mut buf = BytesMut::new();
    codec::encode_method(&mut buf, ch, m);
    hex(&buf)
}

fn library(frame: &AMQPFrame) -> Vec<u8> {
    let mut buf = BytesMut::new();
    codec::encode_frame(&mut buf, frame);
    buf.to_vec()
}

#[test]
fn connection_frames() {
    insta::assert_snapshot!("connection_start", method(0, handshake::start_method()));
    insta::assert_snapshot!(
        "connection_tune",
        method(0, handshake::tune_method(&AmqpConfig::default()))
    );
    insta::assert_snapshot!(
        "connection_open_ok",
        method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {}))
        )
    );
    insta::assert_snapshot!(
        "connection_close",
        method(
            0,
            handshake::connection_close(320, "CONNECTION_FORCED - broker shutdown", (0, 0))
        )
    );
    insta::assert_snapshot!(
        "connection_close_ok",
        method(0, handshake::connection_close_ok())
    );
    insta::assert_snapshot!(
        "connection_blocked",
        method(0, handshake::connection_blocked())
    );
    insta::assert_snapshot!(
        "connection_unblocked",
        method(0, handshake::connection_unblocked())
    );
    let mut hb = BytesMut::new();
    codec::encode_heartbeat(&mut hb);
    insta::assert_snapshot!("heartbeat", hex(&hb));
    assert_eq!(hb.to_vec(), library(&AMQPFrame::Heartbeat));
}

#[test]
fn channel_frames() {
    insta::assert_snapshot!(
        "channel_open_ok",
        method(
            1,
            methods::reply_method(&Reply::ChannelOpenOk).expect("frame")
        )
    );
    insta::assert_snapshot!("channel_close_ok", method(1, methods::channel_close_ok()));
    insta::assert_snapshot!(
        "channel_close",
        method(
            1,
            methods::channel_close(404, "NOT_FOUND - no queue 'q' in vhost '/'", (50, 10))
        )
    );
    insta::assert_snapshot!("channel_flow_ok", method(1, methods::flow_ok(true)));
}

#[test]
fn reply_frames() {
    let replies = [
        ("exchange_declare_ok", Reply::ExchangeDeclareOk),
        ("exchange_delete_ok", Reply::ExchangeDeleteOk),
        ("exchange_bind_ok", Reply::ExchangeBindOk),
        ("exchange_unbind_ok", Reply::ExchangeUnbindOk),
        (
            "queue_declare_ok",
            Reply::QueueDeclareOk {
                queue: Arc::from("q"),
                message_count: 3,
                consumer_count: 1,
            },
        ),
        ("queue_bind_ok", Reply::QueueBindOk),
        ("queue_unbind_ok", Reply::QueueUnbindOk),
        ("queue_purge_ok", Reply::QueuePurgeOk { message_count: 7 }),
        ("queue_delete_ok", Reply::QueueDeleteOk { message_count: 2 }),
        ("basic_qos_ok", Reply::QosOk),
        (
            "basic_consume_ok",
            Reply::ConsumeOk {
                consumer_tag: Arc::from("ctag"),
            },
        ),
        (
            "basic_cancel_ok",
            Reply::CancelOk {
                consumer_tag: Arc::from("ctag"),
            },
        ),
        ("basic_get_empty", Reply::GetEmpty),
        ("basic_recover_ok", Reply::RecoverOk),
        ("confirm_select_ok", Reply::ConfirmSelectOk),
        ("tx_select_ok", Reply::TxSelectOk),
        ("tx_commit_ok", Reply::TxCommitOk),
        ("tx_rollback_ok", Reply::TxRollbackOk),
    ];
    for (name, reply) in replies {
        let m = methods::reply_method(&reply).expect("a method frame");
        insta::assert_snapshot!(name, method(1, m));
    }
    insta::assert_snapshot!(
        "basic_cancel_from_server",
        method(1, methods::server_cancel(&Arc::from("ctag")))
    );
    insta::assert_snapshot!(
        "basic_get_ok",
        method(1, methods::get_ok(5, true, "amq.direct", "key", 9))
    );
    insta::assert_snapshot!(
        "basic_return",
        method(1, methods::basic_return(312, "NO_ROUTE", "x", "k"))
    );
}

#[test]
fn hot_path_encoders_match_the_library() {
    let mut deliver = BytesMut::new();
    codec::encode_deliver(&mut deliver, 3, "ctag", 42, true, "amq.topic", "a.b");
    insta::assert_snapshot!("basic_deliver", hex(&deliver));
    assert_eq!(
        deliver.to_vec(),
        library(&AMQPFrame::Method(
            3,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "ctag".into(),
                delivery_tag: 42,
                redelivered: true,
                exchange: "amq.topic".into(),
                routing_key: "a.b".into(),
            }))
        ))
    );
    for (name, multiple, ack) in [
        ("basic_ack_multiple", true, true),
        ("basic_nack", false, false),
    ] {
        let mut buf = BytesMut::new();
        codec::encode_confirm(&mut buf, 1, 17, multiple, ack);
        insta::assert_snapshot!(name, hex(&buf));
        let expected = if ack {
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 17,
                multiple,
            }))
        } else {
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag: 17,
                multiple,
                requeue: false,
            }))
        };
        assert_eq!(buf.to_vec(), library(&AMQPFrame::Method(1, expected)));
    }
    // Empty properties take the hand-written path; the body splits at frame_max - 8.
    let mut content = BytesMut::new();
    let body = Bytes::from(vec![0xAB; 10]);
    codec::encode_content(&mut content, 1, &Properties::default(), &body, 12);
    insta::assert_snapshot!("content_split_at_frame_max", hex(&content));
    let mut expected = library(&AMQPFrame::Header(
        1,
        AMQPContentHeader {
            class_id: 60,
            body_size: 10,
            properties: BasicProperties::default(),
        },
    ));
    expected.extend(library(&AMQPFrame::Body(1, vec![0xAB; 4])));
    expected.extend(library(&AMQPFrame::Body(1, vec![0xAB; 4])));
    expected.extend(library(&AMQPFrame::Body(1, vec![0xAB; 2])));
    assert_eq!(content.to_vec(), expected);
    let mut headers = warren_core::message::FieldTable::new();
    headers.insert("x-n".into(), FieldValue::I32(1));
    let props = Properties {
        content_type: Some("text/plain".into()),
        delivery_mode: Some(2),
        headers: Some(headers),
        ..Properties::default()
    };
    let mut with_props = BytesMut::new();
    codec::encode_content(
        &mut with_props,
        1,
        &props,
        &Bytes::from_static(b"hi"),
        131_072,
    );
    insta::assert_snapshot!("content_with_properties", hex(&with_props));
}

/// Every client method the gateway accepts decodes back to what was encoded.
#[test]
fn client_methods_round_trip() {
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-match"),
        AMQPValue::LongString("any".into()),
    );
    let all = vec![
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: false })),
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: "x".into(),
            kind: "headers".into(),
            passive: false,
            durable: true,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: args.clone(),
        })),
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: "x".into(),
            if_unused: true,
            nowait: false,
        })),
        AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
            destination: "d".into(),
            source: "s".into(),
            routing_key: "k".into(),
            nowait: false,
            arguments: args.clone(),
        })),
        AMQPClass::Exchange(exchange::AMQPMethod::Unbind(exchange::Unbind {
            destination: "d".into(),
            source: "s".into(),
            routing_key: "k".into(),
            nowait: true,
            arguments: FieldTable::default(),
        })),
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q".into(),
            passive: true,
            durable: false,
            exclusive: true,
            auto_delete: true,
            nowait: false,
            arguments: args.clone(),
        })),
        AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: "q".into(),
            exchange: "x".into(),
            routing_key: "a.*".into(),
            nowait: false,
            arguments: args.clone(),
        })),
        AMQPClass::Queue(queue::AMQPMethod::Unbind(queue::Unbind {
            queue: "q".into(),
            exchange: "x".into(),
            routing_key: "a.*".into(),
            arguments: FieldTable::default(),
        })),
        AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: "q".into(),
            nowait: false,
        })),
        AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: "q".into(),
            if_unused: true,
            if_empty: true,
            nowait: false,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 10,
            global: true,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "q".into(),
            consumer_tag: "t".into(),
            no_local: false,
            no_ack: true,
            exclusive: true,
            nowait: false,
            arguments: args,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: "t".into(),
            nowait: false,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "x".into(),
            routing_key: "k".into(),
            mandatory: true,
            immediate: false,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "q".into(),
            no_ack: false,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 9,
            multiple: true,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: 9,
            multiple: false,
            requeue: true,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag: 9,
            requeue: false,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
        AMQPClass::Basic(basic::AMQPMethod::RecoverAsync(basic::RecoverAsync {
            requeue: true,
        })),
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
        AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})),
        AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {})),
        AMQPClass::Tx(tx::AMQPMethod::Rollback(tx::Rollback {})),
    ];
    for m in all {
        let mut buf = BytesMut::new();
        codec::encode_method(&mut buf, 7, m.clone());
        let decoded = codec::decode(&mut buf, 131_072)
            .expect("decodes")
            .expect("complete");
        assert_eq!(decoded, Frame::Method(7, m.clone()));
        assert!(buf.is_empty());
        assert!(methods::incoming(m).is_ok(), "the gateway accepts it");
    }
}
