//! MQTT-style topics on top of `amq.topic`, the way RabbitMQ's MQTT plugin maps them:
//! levels separated by `/` become words separated by `.`, `+` becomes `*`, `#` stays `#`, and
//! a `.` inside a level becomes `/` so the mapping is reversible.
//!
//! Private to the JS API on purpose: the core grows its own MQTT topic module (with retained
//! messages) and this one is swapped for it then.

/// Why a topic or filter is not valid MQTT.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    #[error("empty topic")]
    Empty,
    /// A wildcard in a topic name (only filters may have them).
    #[error("wildcards are only allowed in subscriptions")]
    WildcardInName,
    /// `+`/`#` not alone in its level, or `#` not last.
    #[error("'+' and '#' must fill a whole level, '#' only the last")]
    BadWildcard,
    /// MQTT forbids U+0000 in topics.
    #[error("topic contains U+0000")]
    Nul,
}

fn level(l: &str) -> String {
    l.replace('.', "/")
}

/// A topic name (`home/kitchen/temp`) as a routing key (`home.kitchen.temp`).
pub fn name_to_key(topic: &str) -> Result<String, TopicError> {
    check(topic)?;
    if topic.contains(['+', '#']) {
        return Err(TopicError::WildcardInName);
    }
    Ok(topic.split('/').map(level).collect::<Vec<_>>().join("."))
}

/// A topic filter (`home/+/temp`, `home/#`) as a binding key (`home.*.temp`, `home.#`).
pub fn filter_to_key(filter: &str) -> Result<String, TopicError> {
    check(filter)?;
    let levels: Vec<&str> = filter.split('/').collect();
    let mut out = Vec::with_capacity(levels.len());
    for (i, l) in levels.iter().enumerate() {
        out.push(match *l {
            "+" => "*".to_string(),
            "#" if i + 1 == levels.len() => "#".to_string(),
            l if l.contains(['+', '#']) => return Err(TopicError::BadWildcard),
            l => level(l),
        });
    }
    Ok(out.join("."))
}

/// A routing key back to the topic name it came from.
pub fn key_to_name(key: &str) -> String {
    key.split('.')
        .map(|w| w.replace('/', "."))
        .collect::<Vec<_>>()
        .join("/")
}

fn check(t: &str) -> Result<(), TopicError> {
    if t.is_empty() {
        return Err(TopicError::Empty);
    }
    if t.contains('\0') {
        return Err(TopicError::Nul);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_filters_map_like_rabbitmq() {
        assert_eq!(
            name_to_key("home/kitchen/temp").as_deref(),
            Ok("home.kitchen.temp")
        );
        assert_eq!(name_to_key("v1.2/x").as_deref(), Ok("v1/2.x"));
        assert_eq!(key_to_name("v1/2.x"), "v1.2/x");
        assert_eq!(key_to_name("home.kitchen.temp"), "home/kitchen/temp");
        assert_eq!(filter_to_key("home/+/temp").as_deref(), Ok("home.*.temp"));
        assert_eq!(filter_to_key("home/#").as_deref(), Ok("home.#"));
        assert_eq!(filter_to_key("#").as_deref(), Ok("#"));
        assert_eq!(filter_to_key("+").as_deref(), Ok("*"));
    }

    #[test]
    fn invalid_topics_are_refused() {
        assert_eq!(name_to_key(""), Err(TopicError::Empty));
        assert_eq!(name_to_key("a/+"), Err(TopicError::WildcardInName));
        assert_eq!(name_to_key("a/#"), Err(TopicError::WildcardInName));
        assert_eq!(filter_to_key("a/#/b"), Err(TopicError::BadWildcard));
        assert_eq!(filter_to_key("a/b+"), Err(TopicError::BadWildcard));
        assert_eq!(filter_to_key("a\0"), Err(TopicError::Nul));
    }
}
