//! Headers exchange: a destination matches when the message headers satisfy a binding's
//! arguments under its `x-match` mode (RabbitMQ's semantics, including `all-with-x` and
//! `any-with-x`).

use super::DestIndex;
use crate::ids::Destination;
use crate::message::{FieldTable, FieldValue};
use std::sync::Arc;

/// Bindings of a headers exchange.
///
/// Matching depends on arbitrary argument/header combinations, so routing evaluates every
/// binding (as RabbitMQ does); walking the destination index in order yields ascending,
/// de-duplicated output for free, stopping at a destination's first matching binding.
/// Shared (`Arc`) with routing snapshots: a change while a snapshot lives copies the index,
/// O(bindings), as one publish through it costs anyway.
#[derive(Clone, Debug, Default)]
pub struct HeadersBindings {
    pub(super) index: Arc<DestIndex>,
}

impl HeadersBindings {
    pub(super) fn route(&self, headers: Option<&FieldTable>, out: &mut Vec<Destination>) {
        route(&self.index, headers, out);
    }
}

pub(super) fn route(index: &DestIndex, headers: Option<&FieldTable>, out: &mut Vec<Destination>) {
    for (dest, entries) in index.iter() {
        if entries.iter().any(|e| matches(&e.args, headers)) {
            out.push(dest);
        }
    }
}

/// Checks a binding's `x-match` at bind time, so that routing can treat anything unexpected
/// as `all` (RabbitMQ's legacy behaviour) instead of failing per message.
pub fn validate_x_match(arguments: &FieldTable) -> Result<(), String> {
    let Some(value) = arguments.get(X_MATCH) else {
        return Ok(());
    };
    match value.as_str() {
        Some(s) if Mode::parse(s).is_some() => Ok(()),
        Some(s) => Err(format!(
            "Invalid x-match field value {s:?}; expected all, any, all-with-x, or any-with-x"
        )),
        None => Err(format!(
            "Invalid x-match field type (value {value:?}); expected a string: all, any, \
             all-with-x, or any-with-x"
        )),
    }
}

const X_MATCH: &str = "x-match";

#[derive(Clone, Copy)]
struct Mode {
    /// `any` rather than `all`.
    any: bool,
    /// Whether `x-`-prefixed binding arguments take part in matching.
    with_x: bool,
}

impl Mode {
    fn parse(s: &str) -> Option<Mode> {
        let (any, with_x) = match s {
            "all" => (false, false),
            "any" => (true, false),
            "all-with-x" => (false, true),
            "any-with-x" => (true, true),
            _ => return None,
        };
        Some(Mode { any, with_x })
    }

    fn of(arguments: &FieldTable) -> Mode {
        arguments
            .get(X_MATCH)
            .and_then(FieldValue::as_str)
            .and_then(Mode::parse)
            .unwrap_or(Mode {
                any: false,
                with_x: false,
            })
    }
}

/// Whether a message with `headers` (None = empty) matches a binding with `arguments`.
fn matches(arguments: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = Mode::of(arguments);
    for (key, expected) in arguments {
        // `x-match` itself is never a match condition, even in the `-with-x` modes.
        if key == X_MATCH || (!mode.with_x && key.starts_with("x-")) {
            continue;
        }
        let hit = headers
            .and_then(|h| h.get(key))
            .is_some_and(|actual| value_matches(expected, actual));
        if hit == mode.any {
            // First hit decides `any`; first miss decides `all`.
            return hit;
        }
    }
    // Exhausted: `all` had no miss (vacuously true with no conditions); `any` had no hit.
    !mode.any
}

/// A `Void` binding value asks only for the header's presence. Integers compare by value
/// across widths and strings by bytes across short/long, because clients choose those
/// encodings freely (RabbitMQ compares Erlang terms, where both are equal).
fn value_matches(expected: &FieldValue, actual: &FieldValue) -> bool {
    if matches!(expected, FieldValue::Void) {
        return true;
    }
    if let (Some(x), Some(y)) = (expected.as_i64(), actual.as_i64()) {
        return x == y;
    }
    if let (Some(x), Some(y)) = (string_bytes(expected), string_bytes(actual)) {
        return x == y;
    }
    expected == actual
}

fn string_bytes(v: &FieldValue) -> Option<&[u8]> {
    match v {
        FieldValue::ShortString(s) => Some(s.as_bytes()),
        FieldValue::LongString(b) => Some(b),
        _ => None,
    }
}
