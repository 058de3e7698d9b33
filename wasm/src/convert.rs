//! JS values <-> the core's message model (field tables, properties, messages).

use bytes::Bytes;
use js_sys::{Array, Object, Reflect, Uint8Array};
use warren_core::effect::Delivery;
use warren_core::message::{FieldTable, FieldValue, Message, Properties};
use wasm_bindgen::{JsCast, JsValue};

/// Header tables from JS nest (objects in arrays in objects); bound the recursion so a cyclic
/// object is an error, not a stack overflow.
const MAX_DEPTH: usize = 16;

pub fn err(msg: impl AsRef<str>) -> JsValue {
    wasm_bindgen::JsError::new(msg.as_ref()).into()
}

/// `obj[key]`, or `undefined` when `obj` is not an object.
pub fn get(obj: &JsValue, key: &str) -> JsValue {
    if obj.is_object() {
        Reflect::get(obj, &JsValue::from_str(key)).unwrap_or(JsValue::UNDEFINED)
    } else {
        JsValue::UNDEFINED
    }
}

pub fn get_bool(obj: &JsValue, key: &str) -> bool {
    get(obj, key).is_truthy()
}

pub fn get_string(obj: &JsValue, key: &str) -> Result<Option<String>, JsValue> {
    let v = get(obj, key);
    if v.is_undefined() || v.is_null() {
        return Ok(None);
    }
    v.as_string()
        .map(Some)
        .ok_or_else(|| err(format!("option '{key}' must be a string")))
}

/// A non-negative integer option no larger than `max`.
pub fn get_uint(obj: &JsValue, key: &str, max: u64) -> Result<Option<u64>, JsValue> {
    let v = get(obj, key);
    if v.is_undefined() || v.is_null() {
        return Ok(None);
    }
    match v.as_f64() {
        Some(n) if n >= 0.0 && n.fract() == 0.0 && n <= max as f64 => Ok(Some(n as u64)),
        _ => Err(err(format!(
            "option '{key}' must be an integer in 0..={max}"
        ))),
    }
}

fn set(obj: &Object, key: &str, v: impl Into<JsValue>) {
    // Setting a plain data property on a fresh plain object cannot fail.
    let _ = Reflect::set(obj, &JsValue::from_str(key), &v.into());
}

/// Bytes from a `Uint8Array` (copied) or a string (UTF-8).
pub fn body_bytes(v: &JsValue) -> Result<Bytes, JsValue> {
    if let Some(s) = v.as_string() {
        return Ok(Bytes::from(s.into_bytes()));
    }
    match v.dyn_ref::<Uint8Array>() {
        Some(a) => Ok(Bytes::from(a.to_vec())),
        None => Err(err("a body must be a string or a Uint8Array")),
    }
}

pub fn table_from_js(v: &JsValue, depth: usize) -> Result<FieldTable, JsValue> {
    if depth > MAX_DEPTH {
        return Err(err("headers nested too deeply (or cyclic)"));
    }
    let mut t = FieldTable::new();
    if v.is_undefined() || v.is_null() {
        return Ok(t);
    }
    let obj = v
        .dyn_ref::<Object>()
        .ok_or_else(|| err("headers and arguments must be objects"))?;
    for entry in Object::entries(obj).iter() {
        let pair: Array = entry.unchecked_into();
        let key = pair.get(0).as_string().unwrap_or_default();
        t.insert(key, value_from_js(&pair.get(1), depth + 1)?);
    }
    Ok(t)
}

fn value_from_js(v: &JsValue, depth: usize) -> Result<FieldValue, JsValue> {
    if v.is_null() || v.is_undefined() {
        return Ok(FieldValue::Void);
    }
    if let Some(b) = v.as_bool() {
        return Ok(FieldValue::Bool(b));
    }
    if let Some(s) = v.as_string() {
        return Ok(FieldValue::string(&s));
    }
    if let Some(n) = v.as_f64() {
        // Integers stay integers (RabbitMQ's x-arguments are integers); the rest are doubles.
        return Ok(if n.fract() == 0.0 && n.abs() < 9.007_199_254_740_992e15 {
            FieldValue::I64(n as i64)
        } else {
            FieldValue::F64(n)
        });
    }
    if let Some(a) = v.dyn_ref::<Uint8Array>() {
        return Ok(FieldValue::ByteArray(Bytes::from(a.to_vec())));
    }
    if depth > MAX_DEPTH {
        return Err(err("headers nested too deeply (or cyclic)"));
    }
    if let Some(a) = v.dyn_ref::<Array>() {
        let mut items = Vec::new();
        for item in a.iter() {
            items.push(value_from_js(&item, depth + 1)?);
        }
        return Ok(FieldValue::Array(items));
    }
    if v.is_object() {
        return Ok(FieldValue::Table(table_from_js(v, depth + 1)?));
    }
    Err(err(
        "unsupported header value (use strings, numbers, booleans, null, Uint8Array, arrays, objects)",
    ))
}

fn value_to_js(v: &FieldValue) -> JsValue {
    match v {
        FieldValue::Bool(b) => JsValue::from_bool(*b),
        FieldValue::I8(x) => JsValue::from(*x),
        FieldValue::U8(x) => JsValue::from(*x),
        FieldValue::I16(x) => JsValue::from(*x),
        FieldValue::U16(x) => JsValue::from(*x),
        FieldValue::I32(x) => JsValue::from(*x),
        FieldValue::U32(x) => JsValue::from(*x),
        FieldValue::I64(x) => JsValue::from_f64(*x as f64),
        FieldValue::F32(x) => JsValue::from_f64(f64::from(*x)),
        FieldValue::F64(x) => JsValue::from_f64(*x),
        FieldValue::Decimal { scale, value } => {
            JsValue::from_f64(f64::from(*value) / 10f64.powi(i32::from(*scale)))
        }
        FieldValue::ShortString(s) => JsValue::from_str(s),
        FieldValue::LongString(b) => match std::str::from_utf8(b) {
            Ok(s) => JsValue::from_str(s),
            Err(_) => Uint8Array::from(&b[..]).into(),
        },
        FieldValue::Array(items) => items.iter().map(value_to_js).collect::<Array>().into(),
        FieldValue::Timestamp(t) => JsValue::from_f64(*t as f64),
        FieldValue::Table(t) => table_to_js(t),
        FieldValue::ByteArray(b) => Uint8Array::from(&b[..]).into(),
        FieldValue::Void => JsValue::NULL,
    }
}

fn table_to_js(t: &FieldTable) -> JsValue {
    let o = Object::new();
    for (k, v) in t {
        set(&o, k, value_to_js(v));
    }
    o.into()
}

/// `PublishOptions` -> properties.
pub fn properties_from_js(o: &JsValue) -> Result<Properties, JsValue> {
    let headers = get(o, "headers");
    Ok(Properties {
        content_type: get_string(o, "contentType")?,
        content_encoding: get_string(o, "contentEncoding")?,
        headers: if headers.is_undefined() || headers.is_null() {
            None
        } else {
            Some(table_from_js(&headers, 0)?)
        },
        delivery_mode: if get_bool(o, "persistent") {
            Some(2)
        } else {
            get_uint(o, "deliveryMode", 2)?.map(|v| v as u8)
        },
        priority: get_uint(o, "priority", 255)?.map(|v| v as u8),
        correlation_id: get_string(o, "correlationId")?,
        reply_to: get_string(o, "replyTo")?,
        expiration: get_string(o, "expiration")?,
        message_id: get_string(o, "messageId")?,
        timestamp: get_uint(o, "timestamp", u64::from(u32::MAX) * 1000)?,
        kind: get_string(o, "type")?,
        user_id: get_string(o, "userId")?,
        app_id: get_string(o, "appId")?,
        cluster_id: None,
    })
}

fn properties_to_js(p: &Properties) -> JsValue {
    let o = Object::new();
    let strs = [
        ("contentType", &p.content_type),
        ("contentEncoding", &p.content_encoding),
        ("correlationId", &p.correlation_id),
        ("replyTo", &p.reply_to),
        ("expiration", &p.expiration),
        ("messageId", &p.message_id),
        ("type", &p.kind),
        ("userId", &p.user_id),
        ("appId", &p.app_id),
    ];
    for (k, v) in strs {
        if let Some(v) = v {
            set(&o, k, v.as_str());
        }
    }
    if let Some(h) = &p.headers {
        set(&o, "headers", table_to_js(h));
    }
    if let Some(v) = p.delivery_mode {
        set(&o, "deliveryMode", v);
    }
    if let Some(v) = p.priority {
        set(&o, "priority", v);
    }
    if let Some(v) = p.timestamp {
        set(&o, "timestamp", v as f64);
    }
    o.into()
}

/// The JS `Message` (see the TypeScript section in lib.rs).
pub fn message_to_js(
    m: &Message,
    delivery: Option<(&Delivery, u16)>,
    consumer_tag: Option<&str>,
    topic: Option<String>,
) -> JsValue {
    let o = Object::new();
    if let Some((d, channel)) = delivery {
        set(&o, "deliveryTag", d.delivery_tag as f64);
        set(&o, "channel", channel);
        set(&o, "redelivered", d.redelivered);
    }
    if let Some(tag) = consumer_tag {
        set(&o, "consumerTag", tag);
    }
    set(&o, "exchange", &*m.exchange);
    set(&o, "routingKey", &*m.routing_key);
    set(&o, "body", Uint8Array::from(&m.body[..]));
    set(&o, "properties", properties_to_js(&m.properties));
    if let Some(t) = topic {
        set(&o, "topic", t);
        set(&o, "payload", Uint8Array::from(&m.body[..]));
    }
    o.into()
}
