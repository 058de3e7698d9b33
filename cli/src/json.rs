//! JSON for `warren ctl`: field tables both ways, and RabbitMQ's definitions format
//! (`rabbitmqctl export_definitions`), so a file exported from RabbitMQ imports here and back.

use anyhow::{Context, bail};
use serde_json::{Map, Value, json};
use warren_core::command::{Bind, ExchangeDeclare, QueueDeclare};
use warren_core::message::{FieldTable, FieldValue};
use warren_core::policy::{ApplyTo, PolicyDef};
use warren_core::store::Definitions;

/// A field value as JSON (lossless for what JSON can hold; byte strings as UTF-8 text,
/// lossily, as the management API shows them).
pub fn value(v: &FieldValue) -> Value {
    match v {
        FieldValue::Bool(b) => json!(b),
        FieldValue::I8(n) => json!(n),
        FieldValue::U8(n) => json!(n),
        FieldValue::I16(n) => json!(n),
        FieldValue::U16(n) => json!(n),
        FieldValue::I32(n) => json!(n),
        FieldValue::U32(n) => json!(n),
        FieldValue::I64(n) => json!(n),
        FieldValue::F32(n) => json!(n),
        FieldValue::F64(n) => json!(n),
        FieldValue::Decimal { scale, value } => {
            json!(f64::from(*value) / 10f64.powi(i32::from(*scale)))
        }
        FieldValue::ShortString(s) => json!(s),
        FieldValue::LongString(b) | FieldValue::ByteArray(b) => {
            json!(String::from_utf8_lossy(b))
        }
        FieldValue::Array(items) => Value::Array(items.iter().map(value).collect()),
        FieldValue::Timestamp(t) => json!(t),
        FieldValue::Table(t) => table(t),
        FieldValue::Void => Value::Null,
    }
}

pub fn table(t: &FieldTable) -> Value {
    Value::Object(t.iter().map(|(k, v)| (k.clone(), value(v))).collect())
}

/// JSON as a field value, with the types RabbitMQ gives JSON arguments (integers are longs,
/// text is a long string).
pub fn field(v: &Value) -> FieldValue {
    match v {
        Value::Null => FieldValue::Void,
        Value::Bool(b) => FieldValue::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => FieldValue::I64(i),
            None => FieldValue::F64(n.as_f64().unwrap_or(0.0)),
        },
        Value::String(s) => FieldValue::string(s),
        Value::Array(items) => FieldValue::Array(items.iter().map(field).collect()),
        Value::Object(m) => FieldValue::Table(field_table(m)),
    }
}

fn field_table(m: &Map<String, Value>) -> FieldTable {
    m.iter().map(|(k, v)| (k.clone(), field(v))).collect()
}

fn arguments(o: &Map<String, Value>) -> FieldTable {
    match o.get("arguments") {
        Some(Value::Object(m)) => field_table(m),
        _ => FieldTable::new(),
    }
}

fn text<'a>(o: &'a Map<String, Value>, key: &str) -> anyhow::Result<&'a str> {
    o.get(key).and_then(Value::as_str).with_context(|| {
        format!(
            "'{key}' missing or not a string in {}",
            Value::Object(o.clone())
        )
    })
}

fn flag(o: &Map<String, Value>, key: &str, default: bool) -> bool {
    o.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// A policy from its JSON form (as in definitions files and `warren ctl set-policy`).
pub fn policy(p: &Map<String, Value>) -> anyhow::Result<PolicyDef> {
    let apply_to = p.get("apply-to").and_then(Value::as_str).unwrap_or("all");
    Ok(PolicyDef {
        name: text(p, "name")?.to_string(),
        pattern: text(p, "pattern")?.to_string(),
        apply_to: ApplyTo::parse(apply_to).with_context(|| {
            format!("apply-to '{apply_to}' is not one of all, queues, exchanges")
        })?,
        priority: p.get("priority").and_then(Value::as_i64).unwrap_or(0),
        definition: match p.get("definition") {
            Some(Value::Object(m)) => field_table(m),
            _ => bail!("policy '{}' has no definition object", text(p, "name")?),
        },
    })
}

/// Definitions in RabbitMQ's export format (vhost `/`; users, permissions and policies come
/// with their own issue and are exported empty).
pub fn export(defs: &Definitions) -> Value {
    let exchanges: Vec<Value> = defs
        .exchanges
        .iter()
        .map(|x| {
            json!({
                "name": x.exchange, "vhost": "/", "type": x.kind, "durable": x.durable,
                "auto_delete": x.auto_delete, "internal": x.internal,
                "arguments": table(&x.arguments),
            })
        })
        .collect();
    let queues: Vec<Value> = defs
        .queues
        .iter()
        .map(|q| {
            json!({
                "name": q.queue, "vhost": "/", "durable": q.durable,
                "auto_delete": q.auto_delete, "arguments": table(&q.arguments),
            })
        })
        .collect();
    let bindings: Vec<Value> = defs
        .bindings
        .iter()
        .map(|(b, to_exchange)| {
            json!({
                "source": b.source, "vhost": "/", "destination": b.destination,
                "destination_type": if *to_exchange { "exchange" } else { "queue" },
                "routing_key": b.routing_key, "arguments": table(&b.arguments),
            })
        })
        .collect();
    let policies: Vec<Value> = defs
        .policies
        .iter()
        .map(|p| {
            json!({
                "vhost": "/", "name": p.name, "pattern": p.pattern,
                "apply-to": p.apply_to.as_str(), "priority": p.priority,
                "definition": table(&p.definition),
            })
        })
        .collect();
    json!({
        "product_name": "Warren",
        "product_version": env!("CARGO_PKG_VERSION"),
        "rabbit_version": "3.10.8",
        "users": [], "vhosts": [{"name": "/"}], "permissions": [], "topic_permissions": [],
        "parameters": [], "global_parameters": [], "policies": policies,
        "queues": queues, "exchanges": exchanges, "bindings": bindings,
    })
}

/// What an import takes and what it leaves out (and why).
pub struct Imported {
    pub definitions: Definitions,
    pub skipped: Vec<String>,
}

/// Reads RabbitMQ's definitions format. Entities of other vhosts, and users, permissions,
/// policies and parameters, are listed as skipped (not yet supported) rather than failing.
pub fn import(doc: &Value) -> anyhow::Result<Imported> {
    let Some(doc) = doc.as_object() else {
        bail!("a definitions file is a JSON object (as rabbitmqctl export_definitions writes)");
    };
    let mut defs = Definitions::default();
    let mut skipped = Vec::new();
    let list = |key: &str| -> Vec<&Map<String, Value>> {
        doc.get(key)
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_object).collect())
            .unwrap_or_default()
    };
    let in_default_vhost = |o: &Map<String, Value>, skipped: &mut Vec<String>, what: String| {
        let vhost = o.get("vhost").and_then(Value::as_str).unwrap_or("/");
        if vhost != "/" {
            skipped.push(format!("{what} in vhost '{vhost}' (only '/' exists yet)"));
        }
        vhost == "/"
    };
    for x in list("exchanges") {
        let name = text(x, "name")?;
        if name.is_empty() || name.starts_with("amq.") {
            continue; // predeclared
        }
        if !in_default_vhost(x, &mut skipped, format!("exchange '{name}'")) {
            continue;
        }
        defs.exchanges.push(ExchangeDeclare {
            exchange: name.to_string(),
            kind: text(x, "type")?.to_string(),
            passive: false,
            durable: flag(x, "durable", true),
            auto_delete: flag(x, "auto_delete", false),
            internal: flag(x, "internal", false),
            nowait: false,
            arguments: arguments(x),
        });
    }
    for q in list("queues") {
        let name = text(q, "name")?;
        if !in_default_vhost(q, &mut skipped, format!("queue '{name}'")) {
            continue;
        }
        defs.queues.push(QueueDeclare {
            queue: name.to_string(),
            passive: false,
            durable: flag(q, "durable", true),
            exclusive: false,
            auto_delete: flag(q, "auto_delete", false),
            nowait: false,
            arguments: arguments(q),
        });
    }
    for b in list("bindings") {
        let (source, destination) = (text(b, "source")?, text(b, "destination")?);
        if !in_default_vhost(
            b,
            &mut skipped,
            format!("binding {source} -> {destination}"),
        ) {
            continue;
        }
        if source.is_empty() {
            continue; // the default exchange's implicit bindings
        }
        let to_exchange = match text(b, "destination_type")? {
            "queue" => false,
            "exchange" => true,
            other => bail!("binding {source} -> {destination}: unknown destination_type '{other}'"),
        };
        defs.bindings.push((
            Bind {
                destination: destination.to_string(),
                source: source.to_string(),
                routing_key: b
                    .get("routing_key")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                nowait: false,
                arguments: arguments(b),
            },
            to_exchange,
        ));
    }
    for p in list("policies") {
        let name = text(p, "name")?;
        if !in_default_vhost(p, &mut skipped, format!("policy '{name}'")) {
            continue;
        }
        defs.policies.push(policy(p)?);
    }
    for key in ["users", "permissions", "topic_permissions", "parameters"] {
        let n = list(key).len();
        if n > 0 {
            skipped.push(format!("{n} {key} (not supported yet)"));
        }
    }
    let vhosts: Vec<&str> = list("vhosts")
        .iter()
        .filter_map(|v| v.get("name").and_then(Value::as_str))
        .filter(|v| *v != "/")
        .collect();
    if !vhosts.is_empty() {
        skipped.push(format!("vhosts {vhosts:?} (only '/' exists yet)"));
    }
    Ok(Imported {
        definitions: defs,
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_tables_round_trip_through_json() {
        let mut t = FieldTable::new();
        t.insert("x-max-length".into(), FieldValue::I64(10));
        t.insert("x-dead-letter-exchange".into(), FieldValue::string("dlx"));
        t.insert("flag".into(), FieldValue::Bool(true));
        t.insert("list".into(), FieldValue::Array(vec![FieldValue::I64(1)]));
        let back = match field(&table(&t)) {
            FieldValue::Table(b) => b,
            other => panic!("{other:?}"),
        };
        assert_eq!(back, t);
    }

    #[test]
    fn definitions_round_trip() {
        let doc = json!({
            "vhosts": [{"name": "/"}, {"name": "other"}],
            "users": [{"name": "guest"}],
            "exchanges": [
                {"name": "x", "vhost": "/", "type": "topic", "durable": true, "auto_delete": false, "internal": false, "arguments": {}},
                {"name": "amq.direct", "vhost": "/", "type": "direct", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}
            ],
            "queues": [
                {"name": "q", "vhost": "/", "durable": true, "auto_delete": false, "arguments": {"x-max-length": 5}},
                {"name": "elsewhere", "vhost": "other", "durable": true, "auto_delete": false, "arguments": {}}
            ],
            "bindings": [
                {"source": "x", "vhost": "/", "destination": "q", "destination_type": "queue", "routing_key": "a.#", "arguments": {}}
            ]
        });
        let imported = import(&doc).expect("valid");
        let d = &imported.definitions;
        assert_eq!(d.exchanges.len(), 1, "amq.* skipped");
        assert_eq!(d.queues.len(), 1);
        assert_eq!(
            d.queues[0].arguments.get("x-max-length"),
            Some(&FieldValue::I64(5))
        );
        assert_eq!(d.bindings[0].0.routing_key, "a.#");
        assert_eq!(imported.skipped.len(), 3, "{:?}", imported.skipped);
        let again = import(&export(d)).expect("our export imports");
        assert_eq!(&again.definitions, d);
        assert!(again.skipped.is_empty());
    }
}
