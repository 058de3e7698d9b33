//! The AMQP 0.9.1 method table: every (class, method) id with its name and argument
//! layout. The decoder (amq-protocol) says only that a method frame did not parse; this
//! table says why, in the protocol's terms: an id the protocol does not have, or a short
//! string that is not UTF-8 (a name a client got wrong: its channel's error, not the
//! connection's), or arguments that do not fit.

/// One method: its ids, its name as the spec writes it, and its arguments' types in order:
/// `o` octet, `B` short, `l` long, `L` long long, `s` short string, `S` long string,
/// `b` bit (consecutive bits share an octet), `F` field table.
struct Method {
    class: u16,
    method: u16,
    name: &'static str,
    args: &'static str,
    /// The names of its short-string arguments, in order.
    strings: &'static [&'static str],
}

const fn m(
    class: u16,
    method: u16,
    name: &'static str,
    args: &'static str,
    strings: &'static [&'static str],
) -> Method {
    Method {
        class,
        method,
        name,
        args,
        strings,
    }
}

#[rustfmt::skip]
const METHODS: &[Method] = &[
    m(10, 10, "connection.start", "ooFSS", &[]),
    m(10, 11, "connection.start-ok", "FsSs", &["mechanism", "locale"]),
    m(10, 20, "connection.secure", "S", &[]),
    m(10, 21, "connection.secure-ok", "S", &[]),
    m(10, 30, "connection.tune", "BlB", &[]),
    m(10, 31, "connection.tune-ok", "BlB", &[]),
    m(10, 40, "connection.open", "ssb", &["virtual-host", "capabilities"]),
    m(10, 41, "connection.open-ok", "s", &["known-hosts"]),
    m(10, 50, "connection.close", "BsBB", &["reply-text"]),
    m(10, 51, "connection.close-ok", "", &[]),
    m(10, 60, "connection.blocked", "s", &["reason"]),
    m(10, 61, "connection.unblocked", "", &[]),
    m(10, 70, "connection.update-secret", "Ss", &["reason"]),
    m(10, 71, "connection.update-secret-ok", "", &[]),
    m(20, 10, "channel.open", "s", &["out-of-band"]),
    m(20, 11, "channel.open-ok", "S", &[]),
    m(20, 20, "channel.flow", "b", &[]),
    m(20, 21, "channel.flow-ok", "b", &[]),
    m(20, 40, "channel.close", "BsBB", &["reply-text"]),
    m(20, 41, "channel.close-ok", "", &[]),
    m(30, 10, "access.request", "sbbbbb", &["realm"]),
    m(30, 11, "access.request-ok", "B", &[]),
    m(40, 10, "exchange.declare", "BssbbbbbF", &["exchange", "type"]),
    m(40, 11, "exchange.declare-ok", "", &[]),
    m(40, 20, "exchange.delete", "Bsbb", &["exchange"]),
    m(40, 21, "exchange.delete-ok", "", &[]),
    m(40, 30, "exchange.bind", "BsssbF", &["destination", "source", "routing-key"]),
    m(40, 31, "exchange.bind-ok", "", &[]),
    m(40, 40, "exchange.unbind", "BsssbF", &["destination", "source", "routing-key"]),
    m(40, 51, "exchange.unbind-ok", "", &[]),
    m(50, 10, "queue.declare", "BsbbbbbF", &["queue"]),
    m(50, 11, "queue.declare-ok", "sll", &["queue"]),
    m(50, 20, "queue.bind", "BsssbF", &["queue", "exchange", "routing-key"]),
    m(50, 21, "queue.bind-ok", "", &[]),
    m(50, 30, "queue.purge", "Bsb", &["queue"]),
    m(50, 31, "queue.purge-ok", "l", &[]),
    m(50, 40, "queue.delete", "Bsbbb", &["queue"]),
    m(50, 41, "queue.delete-ok", "l", &[]),
    m(50, 50, "queue.unbind", "BsssF", &["queue", "exchange", "routing-key"]),
    m(50, 51, "queue.unbind-ok", "", &[]),
    m(60, 10, "basic.qos", "lBb", &[]),
    m(60, 11, "basic.qos-ok", "", &[]),
    m(60, 20, "basic.consume", "BssbbbbF", &["queue", "consumer-tag"]),
    m(60, 21, "basic.consume-ok", "s", &["consumer-tag"]),
    m(60, 30, "basic.cancel", "sb", &["consumer-tag"]),
    m(60, 31, "basic.cancel-ok", "s", &["consumer-tag"]),
    m(60, 40, "basic.publish", "Bssbb", &["exchange", "routing-key"]),
    m(60, 50, "basic.return", "Bsss", &["reply-text", "exchange", "routing-key"]),
    m(60, 60, "basic.deliver", "sLbss", &["consumer-tag", "exchange", "routing-key"]),
    m(60, 70, "basic.get", "Bsb", &["queue"]),
    m(60, 71, "basic.get-ok", "Lbssl", &["exchange", "routing-key"]),
    m(60, 72, "basic.get-empty", "s", &["cluster-id"]),
    m(60, 80, "basic.ack", "Lb", &[]),
    m(60, 90, "basic.reject", "Lb", &[]),
    m(60, 100, "basic.recover-async", "b", &[]),
    m(60, 110, "basic.recover", "b", &[]),
    m(60, 111, "basic.recover-ok", "", &[]),
    m(60, 120, "basic.nack", "Lbb", &[]),
    m(85, 10, "confirm.select", "b", &[]),
    m(85, 11, "confirm.select-ok", "", &[]),
    m(90, 10, "tx.select", "", &[]),
    m(90, 11, "tx.select-ok", "", &[]),
    m(90, 20, "tx.commit", "", &[]),
    m(90, 21, "tx.commit-ok", "", &[]),
    m(90, 30, "tx.rollback", "", &[]),
    m(90, 31, "tx.rollback-ok", "", &[]),
];

/// Why a method frame's payload did not decode.
#[derive(Debug, PartialEq, Eq)]
pub enum BadMethod {
    /// Shorter than its class and method ids.
    NoIds,
    /// Ids the protocol does not define.
    Unknown { class: u16, method: u16 },
    /// Short string argument `field` of method `name` is not UTF-8.
    NotUtf8 {
        class: u16,
        method: u16,
        name: &'static str,
        field: &'static str,
    },
    /// Arguments that do not fit the method's layout.
    Malformed {
        class: u16,
        method: u16,
        name: &'static str,
    },
}

/// The spec's name of method (`class`, `method`), if it has one.
pub fn method_name(class: u16, method: u16) -> Option<&'static str> {
    METHODS
        .iter()
        .find(|m| m.class == class && m.method == method)
        .map(|m| m.name)
}

/// Says why `payload` (a method frame's, which the decoder refused) is wrong.
pub fn diagnose(payload: &[u8]) -> BadMethod {
    let [c0, c1, m0, m1, args @ ..] = payload else {
        return BadMethod::NoIds;
    };
    let (class, method) = (
        u16::from_be_bytes([*c0, *c1]),
        u16::from_be_bytes([*m0, *m1]),
    );
    let Some(spec) = METHODS
        .iter()
        .find(|m| m.class == class && m.method == method)
    else {
        return BadMethod::Unknown { class, method };
    };
    match first_bad_string(spec, args) {
        Some(field) => BadMethod::NotUtf8 {
            class,
            method,
            name: spec.name,
            field,
        },
        None => BadMethod::Malformed {
            class,
            method,
            name: spec.name,
        },
    }
}

/// The first short-string argument of `spec` in `args` that is not UTF-8; `None` if every
/// one is (or the arguments end first: then they are malformed, whatever the strings).
fn first_bad_string(spec: &Method, mut args: &[u8]) -> Option<&'static str> {
    let mut strings = spec.strings.iter();
    let mut bits = 0u32;
    for kind in spec.args.bytes() {
        // Consecutive bits share one octet, up to eight.
        if kind == b'b' {
            if bits.is_multiple_of(8) {
                args = args.get(1..)?;
            }
            bits += 1;
            continue;
        }
        bits = 0;
        let len = match kind {
            b'o' => 1,
            b'B' => 2,
            b'l' => 4,
            b'L' => 8,
            b's' => {
                let (&n, rest) = args.split_first()?;
                let text = rest.get(..usize::from(n))?;
                let field = strings.next().copied().unwrap_or("?");
                if std::str::from_utf8(text).is_err() {
                    return Some(field);
                }
                1 + usize::from(n)
            }
            // Long strings and tables: a 4-byte length, then that many bytes.
            _ => {
                let n = u32::from_be_bytes(args.get(..4)?.try_into().ok()?);
                4 + usize::try_from(n).ok()?
            }
        };
        args = args.get(len..)?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_names_each_of_its_short_strings() {
        for m in METHODS {
            let strings = m.args.bytes().filter(|&b| b == b's').count();
            assert_eq!(strings, m.strings.len(), "{}", m.name);
            assert!(
                m.args.bytes().all(|b| b"oBlLsSbF".contains(&b)),
                "{}",
                m.name
            );
        }
    }

    #[test]
    fn tells_unknown_ids_from_bad_strings_and_bad_layouts() {
        assert_eq!(diagnose(&[0, 99]), BadMethod::NoIds);
        assert_eq!(
            diagnose(&[0, 99, 0, 7]),
            BadMethod::Unknown {
                class: 99,
                method: 7
            }
        );
        // queue.declare: ticket, queue name (3 bytes, not UTF-8), bits, empty table.
        let mut declare = vec![0, 50, 0, 10, 0, 0, 3, b'q', 0xC3, 0x28, 0, 0, 0, 0, 0];
        assert_eq!(
            diagnose(&declare),
            BadMethod::NotUtf8 {
                class: 50,
                method: 10,
                name: "queue.declare",
                field: "queue"
            }
        );
        declare[8] = b'x';
        declare.truncate(10);
        assert_eq!(
            diagnose(&declare),
            BadMethod::Malformed {
                class: 50,
                method: 10,
                name: "queue.declare"
            }
        );
        // basic.publish: the routing key (second short string) is the bad one.
        let publish = [0, 60, 0, 40, 0, 0, 1, b'x', 2, 0xFF, 0xFE, 0];
        assert!(matches!(
            diagnose(&publish),
            BadMethod::NotUtf8 {
                field: "routing-key",
                ..
            }
        ));
    }
}
