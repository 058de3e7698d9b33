//! JSON for `warren ctl` and the HTTP API: field tables both ways, and RabbitMQ's
//! definitions format (`rabbitmqctl export_definitions`, `GET /api/definitions`), so a file
//! exported from RabbitMQ imports here and back.

use serde_json::{Map, Value, json};
use warren_core::command::{Bind, ExchangeDeclare, QueueDeclare};
use warren_core::message::{FieldTable, FieldValue};
use warren_core::parameter::ParameterDef;
use warren_core::policy::{ApplyTo, PolicyDef};
use warren_core::store::Definitions;

/// A definitions document or policy that cannot be read, and why (RabbitMQ-style text).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DefinitionError(pub String);

type Result<T> = std::result::Result<T, DefinitionError>;

macro_rules! bail {
    ($($t:tt)*) => { return Err(DefinitionError(format!($($t)*))) };
}

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

/// A field table as RabbitMQ's JSON shows it (arguments, client properties).
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

fn text<'a>(o: &'a Map<String, Value>, key: &str) -> Result<&'a str> {
    o.get(key).and_then(Value::as_str).ok_or_else(|| {
        DefinitionError(format!(
            "'{key}' missing or not a string in {}",
            Value::Object(o.clone())
        ))
    })
}

fn flag(o: &Map<String, Value>, key: &str, default: bool) -> bool {
    o.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// A policy from its JSON form (as in definitions files and `warren ctl set-policy`).
pub fn policy(p: &Map<String, Value>) -> Result<PolicyDef> {
    let apply_to = p.get("apply-to").and_then(Value::as_str).unwrap_or("all");
    Ok(PolicyDef {
        vhost: vhost_of(p).to_string(),
        name: text(p, "name")?.to_string(),
        pattern: text(p, "pattern")?.to_string(),
        apply_to: ApplyTo::parse(apply_to).ok_or_else(|| {
            DefinitionError(format!(
                "apply-to '{apply_to}' is not one of all, queues, exchanges"
            ))
        })?,
        priority: p.get("priority").and_then(Value::as_i64).unwrap_or(0),
        definition: match p.get("definition") {
            Some(Value::Object(m)) => field_table(m),
            _ => bail!("policy '{}' has no definition object", text(p, "name")?),
        },
    })
}

/// A user's tags: RabbitMQ 3.10 writes them as a list, older versions (and the HTTP API's
/// PUT) as one comma-separated string.
pub(crate) fn tags(o: &Map<String, Value>) -> Vec<String> {
    match o.get("tags") {
        Some(Value::Array(t)) => t
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        Some(Value::String(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect(),
        _ => Vec::new(),
    }
}

fn vhost_of(o: &Map<String, Value>) -> &str {
    o.get("vhost").and_then(Value::as_str).unwrap_or("/")
}

/// Definitions in RabbitMQ's export format: vhosts, users (password hashes as RabbitMQ
/// writes them: base64 of salt and SHA-256 digest), permissions, policies, exchanges,
/// queues, bindings.
pub fn export(defs: &Definitions) -> Value {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let vhosts: Vec<Value> = defs
        .vhosts
        .iter()
        .map(|v| {
            json!({
                "name": v.name, "limits": [],
                "metadata": {"description": v.description, "tags": []},
            })
        })
        .collect();
    let users: Vec<Value> = defs
        .users
        .iter()
        .map(|u| {
            json!({
                "name": u.name, "password_hash": b64.encode(&u.password_hash),
                "hashing_algorithm": warren_core::access::HASHING_ALGORITHM,
                "tags": u.tags, "limits": {},
            })
        })
        .collect();
    let permissions: Vec<Value> = defs
        .permissions
        .iter()
        .map(|p| {
            json!({
                "user": p.user, "vhost": p.vhost, "configure": p.configure,
                "write": p.write, "read": p.read,
            })
        })
        .collect();
    let topic_permissions: Vec<Value> = defs
        .topic_permissions
        .iter()
        .map(|p| {
            json!({
                "user": p.user, "vhost": p.vhost, "exchange": p.exchange,
                "write": p.write, "read": p.read,
            })
        })
        .collect();
    let exchanges: Vec<Value> = defs
        .exchanges
        .iter()
        .map(|(vhost, x)| {
            json!({
                "name": x.exchange, "vhost": vhost, "type": x.kind, "durable": x.durable,
                "auto_delete": x.auto_delete, "internal": x.internal,
                "arguments": table(&x.arguments),
            })
        })
        .collect();
    let queues: Vec<Value> = defs
        .queues
        .iter()
        .map(|(vhost, q)| {
            json!({
                "name": q.queue, "vhost": vhost, "durable": q.durable,
                "auto_delete": q.auto_delete, "arguments": table(&q.arguments),
            })
        })
        .collect();
    let bindings: Vec<Value> = defs
        .bindings
        .iter()
        .map(|(vhost, b, to_exchange)| {
            json!({
                "source": b.source, "vhost": vhost, "destination": b.destination,
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
                "vhost": p.vhost, "name": p.name, "pattern": p.pattern,
                "apply-to": p.apply_to.as_str(), "priority": p.priority,
                "definition": table(&p.definition),
            })
        })
        .collect();
    let parameters: Vec<Value> = defs
        .parameters
        .iter()
        .map(|p| {
            let value = serde_json::from_str::<Value>(&p.value).unwrap_or(Value::Null);
            json!({"value": value, "vhost": p.vhost, "component": p.component, "name": p.name})
        })
        .collect();
    json!({
        "product_name": "Warren",
        "product_version": env!("CARGO_PKG_VERSION"),
        "rabbit_version": "3.10.8",
        "users": users, "vhosts": vhosts, "permissions": permissions,
        "topic_permissions": topic_permissions,
        "parameters": parameters, "global_parameters": [], "policies": policies,
        "queues": queues, "exchanges": exchanges, "bindings": bindings,
    })
}

/// Leaves out of an import the parameters `validate` refuses (component, vhost, name,
/// value -> RabbitMQ's text), listing each as skipped with the reason.
pub fn check_parameters(
    imported: &mut Imported,
    validate: impl Fn(&str, &str, &str, &Value) -> std::result::Result<(), String>,
) {
    let skipped = &mut imported.skipped;
    imported.definitions.parameters.retain(|p| {
        let value = serde_json::from_str::<Value>(&p.value).unwrap_or(Value::Null);
        match validate(&p.component, &p.vhost, &p.name, &value) {
            Ok(()) => true,
            Err(e) => {
                skipped.push(format!(
                    "parameter '{}' of component '{}' in vhost '{}': {}",
                    p.name,
                    p.component,
                    p.vhost,
                    e.trim_end()
                ));
                false
            }
        }
    });
}

/// What an import takes and what it leaves out (and why).
pub struct Imported {
    /// What the broker applies.
    pub definitions: Definitions,
    /// What it leaves out, one line each with the reason.
    pub skipped: Vec<String>,
}

/// Reads RabbitMQ's definitions format. What Warren does not have (runtime parameters such as shovels and federation, users hashed with another algorithm)
/// is listed as skipped rather than failing the import.
pub fn import(doc: &Value) -> Result<Imported> {
    use base64::Engine;
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
    for v in list("vhosts") {
        defs.vhosts.push(warren_core::access::VhostDef {
            name: text(v, "name")?.to_string(),
            description: v
                .get("metadata")
                .and_then(|m| m.get("description"))
                .or_else(|| v.get("description"))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
        });
    }
    for u in list("users") {
        let name = text(u, "name")?;
        let algorithm = u
            .get("hashing_algorithm")
            .and_then(Value::as_str)
            .unwrap_or(warren_core::access::HASHING_ALGORITHM);
        if algorithm != warren_core::access::HASHING_ALGORITHM {
            skipped.push(format!(
                "user '{name}': password hashing '{algorithm}' (Warren reads \
                 {}; set a new password with `warren ctl change-password`)",
                warren_core::access::HASHING_ALGORITHM
            ));
            continue;
        }
        let hash = u.get("password_hash").and_then(Value::as_str).unwrap_or("");
        let password_hash = base64::engine::general_purpose::STANDARD
            .decode(hash)
            .map_err(|_| DefinitionError(format!("user '{name}': password_hash is not base64")))?;
        defs.users.push(warren_core::access::UserDef {
            name: name.to_string(),
            password_hash,
            tags: tags(u),
        });
    }
    for p in list("permissions") {
        defs.permissions.push(warren_core::access::PermissionDef {
            user: text(p, "user")?.to_string(),
            vhost: vhost_of(p).to_string(),
            configure: text(p, "configure")?.to_string(),
            write: text(p, "write")?.to_string(),
            read: text(p, "read")?.to_string(),
        });
    }
    for p in list("topic_permissions") {
        defs.topic_permissions
            .push(warren_core::access::TopicPermissionDef {
                user: text(p, "user")?.to_string(),
                vhost: vhost_of(p).to_string(),
                exchange: text(p, "exchange")?.to_string(),
                write: text(p, "write")?.to_string(),
                read: text(p, "read")?.to_string(),
            });
    }
    for x in list("exchanges") {
        let name = text(x, "name")?;
        if name.is_empty() || name.starts_with("amq.") {
            continue; // predeclared
        }
        defs.exchanges.push((
            vhost_of(x).to_string(),
            ExchangeDeclare {
                exchange: name.to_string(),
                kind: text(x, "type")?.to_string(),
                passive: false,
                durable: flag(x, "durable", true),
                auto_delete: flag(x, "auto_delete", false),
                internal: flag(x, "internal", false),
                nowait: false,
                arguments: arguments(x),
            },
        ));
    }
    for q in list("queues") {
        defs.queues.push((
            vhost_of(q).to_string(),
            QueueDeclare {
                queue: text(q, "name")?.to_string(),
                passive: false,
                durable: flag(q, "durable", true),
                exclusive: false,
                auto_delete: flag(q, "auto_delete", false),
                nowait: false,
                arguments: arguments(q),
            },
        ));
    }
    for b in list("bindings") {
        let (source, destination) = (text(b, "source")?, text(b, "destination")?);
        if source.is_empty() {
            continue; // the default exchange's implicit bindings
        }
        let to_exchange = match text(b, "destination_type")? {
            "queue" => false,
            "exchange" => true,
            other => bail!("binding {source} -> {destination}: unknown destination_type '{other}'"),
        };
        defs.bindings.push((
            vhost_of(b).to_string(),
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
    // RabbitMQ's policies carry keys Warren has no use for (ha-mode, ha-params,
    // queue-mode, ...): import each policy with the keys Warren acts on, warn once per
    // dropped key, and skip a policy left with none.
    let mut dropped: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for p in list("policies") {
        let mut def = policy(p)?;
        let unsupported: Vec<String> = def
            .definition
            .keys()
            .filter(|k| !warren_core::policy::is_supported_key(k))
            .cloned()
            .collect();
        for key in &unsupported {
            def.definition.remove(key);
            dropped
                .entry(key.clone())
                .or_default()
                .push(def.name.clone());
        }
        if def.definition.is_empty() {
            skipped.push(format!(
                "policy '{}' in vhost '{}' (none of its keys is supported)",
                def.name, def.vhost
            ));
        } else {
            defs.policies.push(def);
        }
    }
    for (key, policies) in dropped {
        skipped.push(format!(
            "policy key '{key}' (not supported), in {}: {}",
            if policies.len() == 1 {
                "policy"
            } else {
                "policies"
            },
            policies.join(", ")
        ));
    }
    // Runtime parameters as RabbitMQ exports them; their values are the host's to check
    // (`check_parameters`).
    for p in list("parameters") {
        let text = |k: &str| p.get(k).and_then(Value::as_str).map(str::to_string);
        match (
            text("component"),
            text("vhost"),
            text("name"),
            p.get("value"),
        ) {
            (Some(component), Some(vhost), Some(name), Some(value)) => {
                defs.parameters.push(ParameterDef {
                    component,
                    vhost,
                    name,
                    value: value.to_string(),
                })
            }
            _ => skipped.push(format!(
                "parameter {} (it needs component, vhost, name and value)",
                Value::Object(p.clone())
            )),
        }
    }
    let n = list("global_parameters").len();
    if n > 0 {
        skipped.push(format!("{n} global_parameters (not supported)"));
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
            "vhosts": [{"name": "/"}, {"name": "other", "metadata": {"description": "d"}}],
            "users": [
                {"name": "guest", "password_hash": "J1ZwQ3vBE3H+30BpDw3MU9ijys8asoxcmC7PcGsJqeLXzltz",
                 "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["administrator"]},
                {"name": "old", "password_hash": "", "tags": "monitoring, management"},
                {"name": "md5", "password_hash": "", "hashing_algorithm": "rabbit_password_hashing_md5"}
            ],
            "permissions": [{"user": "guest", "vhost": "other", "configure": "", "write": ".*", "read": "^q$"}],
            "topic_permissions": [{"user": "guest", "vhost": "other", "exchange": "amq.topic", "write": "^{username}\\.", "read": ""}],
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
            ],
            "parameters": [{"name": "shovel"}]
        });
        let imported = import(&doc).expect("valid");
        let d = &imported.definitions;
        assert_eq!(d.exchanges.len(), 1, "amq.* skipped");
        assert_eq!(d.queues.len(), 2);
        assert_eq!(d.queues[1].0, "other");
        assert_eq!(
            d.queues[0].1.arguments.get("x-max-length"),
            Some(&FieldValue::I64(5))
        );
        assert_eq!(d.bindings[0].1.routing_key, "a.#");
        assert_eq!(d.vhosts[1].description, "d");
        assert_eq!(d.users.len(), 2, "the md5 user is skipped");
        assert!(warren_core::access::verify_password(
            &d.users[0].password_hash,
            "guest"
        ));
        assert_eq!(d.users[1].tags, vec!["monitoring", "management"]);
        assert_eq!(d.permissions[0].read, "^q$");
        assert_eq!(d.topic_permissions[0].write, "^{username}\\.");
        assert_eq!(d.topic_permissions[0].exchange, "amq.topic");
        assert_eq!(imported.skipped.len(), 2, "{:?}", imported.skipped);
        let again = import(&export(d)).expect("our export imports");
        assert_eq!(&again.definitions, d);
        assert!(again.skipped.is_empty());
    }
}
