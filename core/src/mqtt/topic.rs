//! MQTT topic names and filters (MQTT 3.1.1 section 4.7, MQTT 5 section 4.7) and their mapping
//! onto AMQP topic-exchange routing keys.
//!
//! Mapping (the one RabbitMQ's MQTT plugin uses, so mixed fleets keep their keys): MQTT levels are
//! separated by `/`, AMQP words by `.`, so the two characters swap: MQTT `a/b.c` is AMQP key
//! `a.b/c`. The swap is a bijection, so a literal `.` in an MQTT topic survives the round trip
//! through AMQP. Filter wildcards: `+` becomes `*`, `#` stays `#`.

use std::fmt;

/// The longest topic or filter MQTT can encode (a two-byte length prefix).
pub const MAX_TOPIC_LEN: usize = 65_535;

/// Why a topic name is not valid for PUBLISH.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopicError {
    /// The topic is empty.
    Empty,
    /// Longer than MQTT allows (65,535 bytes).
    TooLong,
    /// A wildcard in a topic name.
    Wildcard,
    /// A NUL character.
    Nul,
}

/// Why a topic filter is not valid for SUBSCRIBE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterError {
    /// The filter is empty.
    Empty,
    /// Longer than MQTT allows (65,535 bytes).
    TooLong,
    /// A NUL character.
    Nul,
    /// `#` not alone in the last level, or `+` not alone in its level.
    MisplacedWildcard,
    /// `$share/{group}/{filter}` with an empty or wildcard group, or without a filter.
    BadShare,
}

impl fmt::Display for TopicError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TopicError::Empty => "empty topic name",
            TopicError::TooLong => "topic name longer than 65535 bytes",
            TopicError::Wildcard => "wildcard in a topic name",
            TopicError::Nul => "NUL character in a topic name",
        })
    }
}

impl fmt::Display for FilterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FilterError::Empty => "empty topic filter",
            FilterError::TooLong => "topic filter longer than 65535 bytes",
            FilterError::Nul => "NUL character in a topic filter",
            FilterError::MisplacedWildcard => "wildcard not alone in its level",
            FilterError::BadShare => "malformed $share/{group}/{filter}",
        })
    }
}

impl std::error::Error for TopicError {}
impl std::error::Error for FilterError {}

/// Checks a topic name a client publishes to.
pub fn validate_topic(topic: &str) -> Result<(), TopicError> {
    if topic.is_empty() {
        return Err(TopicError::Empty);
    }
    if topic.len() > MAX_TOPIC_LEN {
        return Err(TopicError::TooLong);
    }
    if topic.contains('\0') {
        return Err(TopicError::Nul);
    }
    if topic.contains(['+', '#']) {
        return Err(TopicError::Wildcard);
    }
    Ok(())
}

/// Checks a topic filter (including a `$share/{group}/` prefix) and returns the share group and
/// the plain filter.
pub fn validate_filter(filter: &str) -> Result<(Option<&str>, &str), FilterError> {
    if filter.is_empty() {
        return Err(FilterError::Empty);
    }
    if filter.len() > MAX_TOPIC_LEN {
        return Err(FilterError::TooLong);
    }
    if filter.contains('\0') {
        return Err(FilterError::Nul);
    }
    let (group, plain) = match filter.strip_prefix("$share/") {
        Some(rest) => {
            let (group, plain) = rest.split_once('/').ok_or(FilterError::BadShare)?;
            if group.is_empty() || group.contains(['+', '#']) || plain.is_empty() {
                return Err(FilterError::BadShare);
            }
            (Some(group), plain)
        }
        None => (None, filter),
    };
    let levels = plain.split('/').count();
    for (i, level) in plain.split('/').enumerate() {
        let ok = match level {
            "#" => i + 1 == levels,
            "+" => true,
            other => !other.contains(['+', '#']),
        };
        if !ok {
            return Err(FilterError::MisplacedWildcard);
        }
    }
    Ok((group, plain))
}

fn swap_separators(s: &str) -> String {
    // One allocation of the final size (collecting chars grows the string several times).
    let mut out = String::with_capacity(s.len());
    out.extend(s.chars().map(|c| match c {
        '/' => '.',
        '.' => '/',
        c => c,
    }));
    out
}

/// Topics and keys up to this many bytes are converted on the stack ([`with_swapped`]).
const SWAP_ON_STACK: usize = 256;

/// Calls `f` with `s`'s `/` and `.` swapped (the conversion both ways between MQTT topics
/// and AMQP routing keys), without a heap allocation of its own for usual lengths: for the
/// message path, where the result is copied into an `Arc<str>` or a topic name anyway.
pub fn with_swapped<R>(s: &str, f: impl FnOnce(&str) -> R) -> R {
    if s.len() <= SWAP_ON_STACK {
        let mut buf = [0u8; SWAP_ON_STACK];
        let bytes = &mut buf[..s.len()];
        bytes.copy_from_slice(s.as_bytes());
        for b in bytes.iter_mut() {
            *b = match *b {
                b'/' => b'.',
                b'.' => b'/',
                other => other,
            };
        }
        // Swapping ASCII bytes keeps UTF-8 valid (they never occur inside a multi-byte
        // sequence), so this always succeeds; the fallback only avoids an unwrap.
        if let Ok(swapped) = std::str::from_utf8(bytes) {
            return f(swapped);
        }
    }
    f(&swap_separators(s))
}

/// The AMQP routing key for an MQTT topic name (`a/b` -> `a.b`, `a.b` -> `a/b`).
pub fn topic_to_amqp_key(topic: &str) -> String {
    swap_separators(topic)
}

/// The MQTT topic name for an AMQP routing key (the inverse of [`topic_to_amqp_key`]).
pub fn amqp_key_to_topic(key: &str) -> String {
    swap_separators(key)
}

/// The AMQP binding pattern for a (plain, non-shared) MQTT filter: `+` -> `*`, `#` -> `#`.
pub fn filter_to_amqp_pattern(filter: &str) -> String {
    filter
        .split('/')
        .map(|level| match level {
            "+" => "*".to_string(),
            "#" => "#".to_string(),
            other => other.replace('.', "/"),
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// Whether a (plain, valid) filter matches a topic name, MQTT rules: `+` one level, `#` the
/// parent level and any number below, and a leading wildcard never matches a `$` topic
/// (MQTT-4.7.2-1).
pub fn matches(filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') && filter.starts_with(['+', '#']) {
        return false;
    }
    let mut f = filter.split('/');
    let mut t = topic.split('/');
    loop {
        match (f.next(), t.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(fl), Some(tl)) if fl == tl => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics() {
        assert_eq!(validate_topic("a/b"), Ok(()));
        assert_eq!(validate_topic("/"), Ok(()));
        assert_eq!(validate_topic(""), Err(TopicError::Empty));
        assert_eq!(validate_topic("a/+"), Err(TopicError::Wildcard));
        assert_eq!(validate_topic("a/#"), Err(TopicError::Wildcard));
        assert_eq!(validate_topic("a\0b"), Err(TopicError::Nul));
    }

    #[test]
    fn filters() {
        assert_eq!(validate_filter("a/+/c"), Ok((None, "a/+/c")));
        assert_eq!(validate_filter("#"), Ok((None, "#")));
        assert_eq!(validate_filter("a/#"), Ok((None, "a/#")));
        assert_eq!(validate_filter("$share/g/a/#"), Ok((Some("g"), "a/#")));
        assert_eq!(
            validate_filter("a/#/c"),
            Err(FilterError::MisplacedWildcard)
        );
        assert_eq!(validate_filter("a/b#"), Err(FilterError::MisplacedWildcard));
        assert_eq!(validate_filter("a+"), Err(FilterError::MisplacedWildcard));
        assert_eq!(validate_filter("$share/g"), Err(FilterError::BadShare));
        assert_eq!(validate_filter("$share//a"), Err(FilterError::BadShare));
        assert_eq!(validate_filter(""), Err(FilterError::Empty));
    }

    #[test]
    fn mapping() {
        assert_eq!(topic_to_amqp_key("a/b"), "a.b");
        assert_eq!(topic_to_amqp_key("a.b/c"), "a/b.c");
        assert_eq!(amqp_key_to_topic(&topic_to_amqp_key("x.y/z")), "x.y/z");
        assert_eq!(filter_to_amqp_pattern("a/+/#"), "a.*.#");
        assert_eq!(filter_to_amqp_pattern("a.b/+"), "a/b.*");
        // On the stack and past it, multi-byte characters kept.
        let long = format!("{}é/ü.", "x/".repeat(200));
        for s in ["", "a/b.c", "é/ü.日本/x", long.as_str()] {
            assert_eq!(with_swapped(s, str::to_string), topic_to_amqp_key(s), "{s}");
        }
    }

    #[test]
    fn matching() {
        assert!(matches("a/+", "a/b"));
        assert!(!matches("a/+", "a/b/c"));
        assert!(matches("a/#", "a"));
        assert!(matches("a/#", "a/b/c"));
        assert!(matches("#", "a/b"));
        assert!(!matches("#", "$SYS/x"));
        assert!(!matches("+/x", "$SYS/x"));
        assert!(matches("$SYS/#", "$SYS/x"));
        assert!(matches("+/+", "/x"));
        assert!(!matches("a/b", "a/c"));
    }
}
