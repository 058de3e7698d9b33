//! Descriptor codes of the spec's described types (domain 0x00000000), and their symbolic
//! names, which a peer may send in place of the code.

// Each constant is named as the spec names its type (`OPEN` is `amqp:open:list`): the table
// below is their documentation.
#![allow(missing_docs)]

pub const OPEN: u64 = 0x10;
pub const BEGIN: u64 = 0x11;
pub const ATTACH: u64 = 0x12;
pub const FLOW: u64 = 0x13;
pub const TRANSFER: u64 = 0x14;
pub const DISPOSITION: u64 = 0x15;
pub const DETACH: u64 = 0x16;
pub const END: u64 = 0x17;
pub const CLOSE: u64 = 0x18;
pub const ERROR: u64 = 0x1d;
pub const RECEIVED: u64 = 0x23;
pub const ACCEPTED: u64 = 0x24;
pub const REJECTED: u64 = 0x25;
pub const RELEASED: u64 = 0x26;
pub const MODIFIED: u64 = 0x27;
pub const SOURCE: u64 = 0x28;
pub const TARGET: u64 = 0x29;
pub const DELETE_ON_CLOSE: u64 = 0x2b;
pub const DELETE_ON_NO_LINKS: u64 = 0x2c;
pub const DELETE_ON_NO_MESSAGES: u64 = 0x2d;
pub const DELETE_ON_NO_LINKS_OR_MESSAGES: u64 = 0x2e;
pub const SASL_MECHANISMS: u64 = 0x40;
pub const SASL_INIT: u64 = 0x41;
pub const SASL_CHALLENGE: u64 = 0x42;
pub const SASL_RESPONSE: u64 = 0x43;
pub const SASL_OUTCOME: u64 = 0x44;
pub const HEADER: u64 = 0x70;
pub const DELIVERY_ANNOTATIONS: u64 = 0x71;
pub const MESSAGE_ANNOTATIONS: u64 = 0x72;
pub const PROPERTIES: u64 = 0x73;
pub const APPLICATION_PROPERTIES: u64 = 0x74;
pub const DATA: u64 = 0x75;
pub const AMQP_SEQUENCE: u64 = 0x76;
pub const AMQP_VALUE: u64 = 0x77;
pub const FOOTER: u64 = 0x78;

const NAMES: &[(&str, u64)] = &[
    ("amqp:open:list", OPEN),
    ("amqp:begin:list", BEGIN),
    ("amqp:attach:list", ATTACH),
    ("amqp:flow:list", FLOW),
    ("amqp:transfer:list", TRANSFER),
    ("amqp:disposition:list", DISPOSITION),
    ("amqp:detach:list", DETACH),
    ("amqp:end:list", END),
    ("amqp:close:list", CLOSE),
    ("amqp:error:list", ERROR),
    ("amqp:received:list", RECEIVED),
    ("amqp:accepted:list", ACCEPTED),
    ("amqp:rejected:list", REJECTED),
    ("amqp:released:list", RELEASED),
    ("amqp:modified:list", MODIFIED),
    ("amqp:source:list", SOURCE),
    ("amqp:target:list", TARGET),
    ("amqp:delete-on-close:list", DELETE_ON_CLOSE),
    ("amqp:delete-on-no-links:list", DELETE_ON_NO_LINKS),
    ("amqp:delete-on-no-messages:list", DELETE_ON_NO_MESSAGES),
    (
        "amqp:delete-on-no-links-or-messages:list",
        DELETE_ON_NO_LINKS_OR_MESSAGES,
    ),
    ("amqp:sasl-mechanisms:list", SASL_MECHANISMS),
    ("amqp:sasl-init:list", SASL_INIT),
    ("amqp:sasl-challenge:list", SASL_CHALLENGE),
    ("amqp:sasl-response:list", SASL_RESPONSE),
    ("amqp:sasl-outcome:list", SASL_OUTCOME),
    ("amqp:header:list", HEADER),
    ("amqp:delivery-annotations:map", DELIVERY_ANNOTATIONS),
    ("amqp:message-annotations:map", MESSAGE_ANNOTATIONS),
    ("amqp:properties:list", PROPERTIES),
    ("amqp:application-properties:map", APPLICATION_PROPERTIES),
    ("amqp:data:binary", DATA),
    ("amqp:amqp-sequence:list", AMQP_SEQUENCE),
    ("amqp:amqp-value:*", AMQP_VALUE),
    ("amqp:footer:map", FOOTER),
];

/// The code of a symbolic descriptor, if the spec defines it.
pub fn code_of(name: &str) -> Option<u64> {
    NAMES.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
}
