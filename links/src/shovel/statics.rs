//! Static shovels: `[[shovel]]` tables of `warren.toml`, RabbitMQ's `rabbitmq_shovel.shovels`
//! in spirit. A table is a `name`, an optional `vhost` ("/" by default) and the keys of a
//! dynamic shovel's JSON value with their dashes (`src-uri = "amqp://"`), checked by the
//! same code ([`ShovelConfig::parse`]) with RabbitMQ's texts when the file is read, so one
//! definition means the same thing in either place. They are not runtime parameters: the
//! supervisor runs them from the config file alone, and a dynamic shovel of the same vhost
//! and name is refused (RabbitMQ keeps two namespaces; one key per status row is simpler
//! and nobody has to guess which of two same-named shovels a row or header means).

use super::config::ShovelConfig;
use serde::Deserialize;
use serde::de::{self, Deserializer};
use serde_json::{Map, Value};
use std::sync::Arc;

/// `[[shovel]]` tables at most (each is a task and two connections).
pub const MAX_STATIC: usize = 256;
/// A name's and a vhost's length at most, in characters.
pub const MAX_NAME: usize = 255;

/// One checked `[[shovel]]` table.
#[derive(Clone, Debug, PartialEq)]
pub struct StaticShovel {
    /// The vhost a local end (a URI without host) connects to, and the status's `vhost`.
    pub vhost: String,
    /// The shovel's name.
    pub name: String,
    /// The definition, as a dynamic shovel's value would give it.
    pub cfg: Arc<ShovelConfig>,
}

/// A `[[shovel]]` table that is refused, with what to fix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StaticError {
    #[error("a [[shovel]] table needs a name (a string of 1 to {MAX_NAME} characters)")]
    Name,
    #[error("[[shovel]] {0:?}: vhost must be a string of 1 to {MAX_NAME} characters")]
    Vhost(String),
    /// RabbitMQ's texts, one a clause.
    #[error("[[shovel]] {name:?}: validation failed: {text}")]
    Invalid { name: String, text: String },
    #[error(
        "[[shovel]] {name:?} in vhost {vhost:?} is there twice; every [[shovel]] of a vhost \
         needs its own name"
    )]
    Twice { vhost: String, name: String },
    #[error("at most {MAX_STATIC} [[shovel]] tables")]
    TooMany,
}

fn bounded_string(v: Option<Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) if !s.is_empty() && s.chars().count() <= MAX_NAME => Some(s),
        _ => None,
    }
}

impl StaticShovel {
    /// Checks one table (its keys as written, `name` and `vhost` among them).
    pub fn from_table(mut table: Map<String, Value>) -> Result<StaticShovel, StaticError> {
        let name = bounded_string(table.remove("name")).ok_or(StaticError::Name)?;
        let vhost = match table.remove("vhost") {
            None => "/".to_string(),
            v => bounded_string(v).ok_or_else(|| StaticError::Vhost(name.clone()))?,
        };
        let cfg = ShovelConfig::parse(&name, &Value::Object(table)).map_err(|e| {
            // rabbitmqctl's "Validation failed\n\nA\nB\n" as one line for a config error.
            let text = e
                .lines()
                .filter(|l| !l.is_empty() && *l != "Validation failed")
                .collect::<Vec<_>>()
                .join("; ");
            StaticError::Invalid {
                name: name.clone(),
                text,
            }
        })?;
        Ok(StaticShovel {
            vhost,
            name,
            cfg: Arc::new(cfg),
        })
    }
}

impl<'de> Deserialize<'de> for StaticShovel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<StaticShovel, D::Error> {
        let table = Map::<String, Value>::deserialize(d)?;
        StaticShovel::from_table(table).map_err(de::Error::custom)
    }
}

/// Every `[[shovel]]` table, (vhost, name) unique.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Shovels(pub Vec<StaticShovel>);

impl Shovels {
    /// Checks the tables together (the count, unique names).
    pub fn new(all: Vec<StaticShovel>) -> Result<Shovels, StaticError> {
        if all.len() > MAX_STATIC {
            return Err(StaticError::TooMany);
        }
        for (i, s) in all.iter().enumerate() {
            if all[..i]
                .iter()
                .any(|o| o.name == s.name && o.vhost == s.vhost)
            {
                return Err(StaticError::Twice {
                    vhost: s.vhost.clone(),
                    name: s.name.clone(),
                });
            }
        }
        Ok(Shovels(all))
    }

    /// Whether a static shovel has this vhost and name.
    pub fn contains(&self, vhost: &str, name: &str) -> bool {
        self.0.iter().any(|s| s.vhost == vhost && s.name == name)
    }
}

impl<'de> Deserialize<'de> for Shovels {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Shovels, D::Error> {
        Shovels::new(Vec::<StaticShovel>::deserialize(d)?).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shovel::config::AckMode;

    #[derive(serde::Deserialize)]
    struct File {
        shovel: Shovels,
    }

    fn read(text: &str) -> Result<Shovels, String> {
        toml::from_str::<File>(text)
            .map(|f| f.shovel)
            .map_err(|e| e.message().to_string())
    }

    #[test]
    fn tables_with_dashed_keys_as_dynamic_values() {
        let s = read(
            "[[shovel]]\nname = \"move\"\nsrc-uri = \"amqp://\"\n\"src-queue\" = \"a\"\n\
             dest-uri = [\"amqp://h1\", \"amqp://h2\"]\ndest-queue = \"b\"\n\
             ack-mode = \"on-publish\"\nsrc-prefetch-count = 50\nreconnect-delay = 0.5\n\
             src-delete-after = 10\n\
             dest-publish-properties = { delivery_mode = 2 }\n\
             [[shovel]]\nname = \"move\"\nvhost = \"other\"\nsrc-uri = \"\"\n\
             src-exchange = \"x\"\ndest-uri = \"amqp://\"\ndest-exchange = \"y\"\n",
        )
        .expect("valid");
        assert_eq!(s.0.len(), 2);
        let a = &s.0[0];
        assert_eq!((a.vhost.as_str(), a.name.as_str()), ("/", "move"));
        assert_eq!(a.cfg.ack_mode, AckMode::OnPublish);
        assert_eq!(a.cfg.prefetch, 50);
        assert_eq!(a.cfg.dest_uris.len(), 2);
        assert_eq!(a.cfg.publish_properties["delivery_mode"], 2);
        assert_eq!(s.0[1].vhost, "other");
        assert!(s.contains("other", "move") && !s.contains("other", "x"));
    }

    #[test]
    fn refusals_name_the_shovel_with_rabbitmqs_texts() {
        let head = "[[shovel]]\nname = \"s1\"\nsrc-uri = \"amqp://\"\nsrc-queue = \"a\"\n\
                    dest-uri = \"amqp://\"\ndest-queue = \"b\"\n";
        let e = read(&format!("{head}bogus = 1\n")).expect_err("refused");
        assert_eq!(
            e,
            "[[shovel]] \"s1\": validation failed: Unrecognised terms [{<<\"bogus\">>,1}] in s1"
        );
        let e = read(&format!("{head}ack-mode = \"foo\"\nsrc-exchange = \"x\"\n"))
            .expect_err("refused");
        assert!(
            e.contains("Cannot specify 'src-exchange' and 'src-queue'; ack-mode should be one of"),
            "{e}"
        );
        let e = read("[[shovel]]\nsrc-uri = \"amqp://\"\n").expect_err("refused");
        assert!(e.contains("needs a name"), "{e}");
        let e = read(&format!("{head}vhost = 5\n")).expect_err("refused");
        assert!(e.contains("\"s1\": vhost must be"), "{e}");
        let e = read(&format!("{head}{head}")).expect_err("refused");
        assert!(e.contains("\"s1\" in vhost \"/\" is there twice"), "{e}");
        let e = read(&head.replace("src-uri = \"amqp://\"\n", "")).expect_err("refused");
        assert!(e.contains("Key \"src-uri\" not found in s1"), "{e}");
        let e = read(&head.replace("\"s1\"", &format!("\"{}\"", "n".repeat(256))))
            .expect_err("refused");
        assert!(e.contains("needs a name"), "{e}");
    }
}
