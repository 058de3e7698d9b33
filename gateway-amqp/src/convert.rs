//! Lossless conversion between amq-protocol's types and the core's protocol-agnostic ones.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable as AmqpTable, LongString,
    ShortString,
};
use bytes::Bytes;
use warren_core::message::{FieldTable, FieldValue, Properties};

pub fn table_from_amqp(t: &AmqpTable) -> FieldTable {
    t.inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), value_from_amqp(v)))
        .collect()
}

pub fn value_from_amqp(v: &AMQPValue) -> FieldValue {
    match v {
        AMQPValue::Boolean(b) => FieldValue::Bool(*b),
        AMQPValue::ShortShortInt(i) => FieldValue::I8(*i),
        AMQPValue::ShortShortUInt(i) => FieldValue::U8(*i),
        AMQPValue::ShortInt(i) => FieldValue::I16(*i),
        AMQPValue::ShortUInt(i) => FieldValue::U16(*i),
        AMQPValue::LongInt(i) => FieldValue::I32(*i),
        AMQPValue::LongUInt(i) => FieldValue::U32(*i),
        AMQPValue::LongLongInt(i) => FieldValue::I64(*i),
        AMQPValue::Float(f) => FieldValue::F32(*f),
        AMQPValue::Double(f) => FieldValue::F64(*f),
        AMQPValue::DecimalValue(d) => FieldValue::Decimal {
            scale: d.scale,
            value: d.value,
        },
        AMQPValue::ShortString(s) => FieldValue::ShortString(s.as_str().to_string()),
        AMQPValue::LongString(s) => FieldValue::LongString(Bytes::copy_from_slice(s.as_bytes())),
        AMQPValue::FieldArray(a) => {
            FieldValue::Array(a.as_slice().iter().map(value_from_amqp).collect())
        }
        AMQPValue::Timestamp(t) => FieldValue::Timestamp(*t),
        AMQPValue::FieldTable(t) => FieldValue::Table(table_from_amqp(t)),
        AMQPValue::ByteArray(b) => FieldValue::ByteArray(Bytes::copy_from_slice(b.as_slice())),
        AMQPValue::Void => FieldValue::Void,
    }
}

pub fn table_to_amqp(t: &FieldTable) -> AmqpTable {
    let mut out = AmqpTable::default();
    for (k, v) in t {
        out.insert(ShortString::from(k.as_str()), value_to_amqp(v));
    }
    out
}

pub fn value_to_amqp(v: &FieldValue) -> AMQPValue {
    match v {
        FieldValue::Bool(b) => AMQPValue::Boolean(*b),
        FieldValue::I8(i) => AMQPValue::ShortShortInt(*i),
        FieldValue::U8(i) => AMQPValue::ShortShortUInt(*i),
        FieldValue::I16(i) => AMQPValue::ShortInt(*i),
        FieldValue::U16(i) => AMQPValue::ShortUInt(*i),
        FieldValue::I32(i) => AMQPValue::LongInt(*i),
        FieldValue::U32(i) => AMQPValue::LongUInt(*i),
        FieldValue::I64(i) => AMQPValue::LongLongInt(*i),
        FieldValue::F32(f) => AMQPValue::Float(*f),
        FieldValue::F64(f) => AMQPValue::Double(*f),
        FieldValue::Decimal { scale, value } => AMQPValue::DecimalValue(DecimalValue {
            scale: *scale,
            value: *value,
        }),
        FieldValue::ShortString(s) => AMQPValue::ShortString(ShortString::from(s.as_str())),
        FieldValue::LongString(b) => AMQPValue::LongString(LongString::from(b.to_vec())),
        FieldValue::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(value_to_amqp).collect::<Vec<_>>(),
        )),
        FieldValue::Timestamp(t) => AMQPValue::Timestamp(*t),
        FieldValue::Table(t) => AMQPValue::FieldTable(table_to_amqp(t)),
        FieldValue::ByteArray(b) => AMQPValue::ByteArray(ByteArray::from(b.to_vec())),
        FieldValue::Void => AMQPValue::Void,
    }
}

fn s(v: &Option<ShortString>) -> Option<String> {
    v.as_ref().map(|s| s.as_str().to_string())
}

pub fn properties_from_amqp(p: &BasicProperties) -> Properties {
    Properties {
        content_type: s(p.content_type()),
        content_encoding: s(p.content_encoding()),
        headers: p.headers().as_ref().map(table_from_amqp),
        delivery_mode: *p.delivery_mode(),
        priority: *p.priority(),
        correlation_id: s(p.correlation_id()),
        reply_to: s(p.reply_to()),
        expiration: s(p.expiration()),
        message_id: s(p.message_id()),
        timestamp: *p.timestamp(),
        kind: s(p.kind()),
        user_id: s(p.user_id()),
        app_id: s(p.app_id()),
        cluster_id: s(p.cluster_id()),
    }
}

pub fn properties_to_amqp(p: &Properties) -> BasicProperties {
    let mut out = BasicProperties::default();
    let ss = |v: &String| ShortString::from(v.as_str());
    if let Some(v) = &p.content_type {
        out = out.with_content_type(ss(v));
    }
    if let Some(v) = &p.content_encoding {
        out = out.with_content_encoding(ss(v));
    }
    if let Some(v) = &p.headers {
        out = out.with_headers(table_to_amqp(v));
    }
    if let Some(v) = p.delivery_mode {
        out = out.with_delivery_mode(v);
    }
    if let Some(v) = p.priority {
        out = out.with_priority(v);
    }
    if let Some(v) = &p.correlation_id {
        out = out.with_correlation_id(ss(v));
    }
    if let Some(v) = &p.reply_to {
        out = out.with_reply_to(ss(v));
    }
    if let Some(v) = &p.expiration {
        out = out.with_expiration(ss(v));
    }
    if let Some(v) = &p.message_id {
        out = out.with_message_id(ss(v));
    }
    if let Some(v) = p.timestamp {
        out = out.with_timestamp(v);
    }
    if let Some(v) = &p.kind {
        out = out.with_type(ss(v));
    }
    if let Some(v) = &p.user_id {
        out = out.with_user_id(ss(v));
    }
    if let Some(v) = &p.app_id {
        out = out.with_app_id(ss(v));
    }
    if let Some(v) = &p.cluster_id {
        out = out.with_cluster_id(ss(v));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_type_round_trips() {
        let mut t = FieldTable::new();
        let values = [
            FieldValue::Bool(true),
            FieldValue::I8(-1),
            FieldValue::U8(1),
            FieldValue::I16(-2),
            FieldValue::U16(2),
            FieldValue::I32(-3),
            FieldValue::U32(3),
            FieldValue::I64(-4),
            FieldValue::F32(1.5),
            FieldValue::F64(2.5),
            FieldValue::Decimal {
                scale: 2,
                value: 314,
            },
            FieldValue::ShortString("s".into()),
            FieldValue::string("long"),
            FieldValue::Array(vec![FieldValue::I32(1), FieldValue::Void]),
            FieldValue::Timestamp(99),
            FieldValue::ByteArray(Bytes::from_static(b"\x00\x01")),
            FieldValue::Void,
        ];
        for (i, v) in values.into_iter().enumerate() {
            t.insert(format!("k{i}"), v);
        }
        let mut nested = t.clone();
        nested.insert("table".into(), FieldValue::Table(t.clone()));
        assert_eq!(table_from_amqp(&table_to_amqp(&nested)), nested);
        let p = Properties {
            content_type: Some("text/plain".into()),
            headers: Some(nested),
            delivery_mode: Some(2),
            priority: Some(5),
            expiration: Some("1000".into()),
            timestamp: Some(7),
            kind: Some("t".into()),
            ..Properties::default()
        };
        assert_eq!(properties_from_amqp(&properties_to_amqp(&p)), p);
    }
}
