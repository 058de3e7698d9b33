//! Errors the core reports to clients, with AMQP 0.9.1 reply codes (the richest vocabulary of the
//! protocols Warren speaks; the MQTT gateway maps them to its reason codes).

use crate::command::OpKind;

/// Reply codes, as AMQP 0.9.1 and RabbitMQ define them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum ErrorCode {
    ContentTooLarge = 311,
    NoRoute = 312,
    NoConsumers = 313,
    ConnectionForced = 320,
    InvalidPath = 402,
    AccessRefused = 403,
    NotFound = 404,
    ResourceLocked = 405,
    PreconditionFailed = 406,
    FrameError = 501,
    SyntaxError = 502,
    CommandInvalid = 503,
    ChannelError = 504,
    UnexpectedFrame = 505,
    ResourceError = 506,
    NotAllowed = 530,
    NotImplemented = 540,
    InternalError = 541,
}

impl ErrorCode {
    /// The numeric reply code.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The reply-text prefix RabbitMQ uses, e.g. `NOT_FOUND`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::ContentTooLarge => "CONTENT_TOO_LARGE",
            ErrorCode::NoRoute => "NO_ROUTE",
            ErrorCode::NoConsumers => "NO_CONSUMERS",
            ErrorCode::ConnectionForced => "CONNECTION_FORCED",
            ErrorCode::InvalidPath => "INVALID_PATH",
            ErrorCode::AccessRefused => "ACCESS_REFUSED",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::ResourceLocked => "RESOURCE_LOCKED",
            ErrorCode::PreconditionFailed => "PRECONDITION_FAILED",
            ErrorCode::FrameError => "FRAME_ERROR",
            ErrorCode::SyntaxError => "SYNTAX_ERROR",
            ErrorCode::CommandInvalid => "COMMAND_INVALID",
            ErrorCode::ChannelError => "CHANNEL_ERROR",
            ErrorCode::UnexpectedFrame => "UNEXPECTED_FRAME",
            ErrorCode::ResourceError => "RESOURCE_ERROR",
            ErrorCode::NotAllowed => "NOT_ALLOWED",
            ErrorCode::NotImplemented => "NOT_IMPLEMENTED",
            ErrorCode::InternalError => "INTERNAL_ERROR",
        }
    }

    /// Channel-level codes close only the channel; the rest close the connection.
    pub fn is_channel_level(self) -> bool {
        matches!(
            self,
            ErrorCode::ContentTooLarge
                | ErrorCode::NoRoute
                | ErrorCode::NoConsumers
                | ErrorCode::AccessRefused
                | ErrorCode::NotFound
                | ErrorCode::ResourceLocked
                | ErrorCode::PreconditionFailed
        )
    }
}

/// A protocol error: the code, the text a user can act on (already prefixed with the code's
/// name, as RabbitMQ writes it), and the operation that failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{text}")]
pub struct ProtocolError {
    pub code: ErrorCode,
    pub text: String,
    pub op: OpKind,
}

impl ProtocolError {
    pub fn new(code: ErrorCode, op: OpKind, detail: impl AsRef<str>) -> ProtocolError {
        ProtocolError {
            code,
            text: format!("{} - {}", code.name(), detail.as_ref()),
            op,
        }
    }
}
