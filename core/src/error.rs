//! Errors the core reports to clients, with AMQP 0.9.1 reply codes (the richest vocabulary of the
//! protocols Warren speaks; the MQTT gateway maps them to its reason codes).

use crate::op_kind::OpKind;

/// Reply codes, as AMQP 0.9.1 and RabbitMQ define them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum ErrorCode {
    /// 311 CONTENT_TOO_LARGE.
    ContentTooLarge = 311,
    /// 312 NO_ROUTE.
    NoRoute = 312,
    /// 313 NO_CONSUMERS.
    NoConsumers = 313,
    /// 320 CONNECTION_FORCED.
    ConnectionForced = 320,
    /// 402 INVALID_PATH.
    InvalidPath = 402,
    /// 403 ACCESS_REFUSED.
    AccessRefused = 403,
    /// 404 NOT_FOUND.
    NotFound = 404,
    /// 405 RESOURCE_LOCKED.
    ResourceLocked = 405,
    /// 406 PRECONDITION_FAILED.
    PreconditionFailed = 406,
    /// 501 FRAME_ERROR.
    FrameError = 501,
    /// 502 SYNTAX_ERROR.
    SyntaxError = 502,
    /// 503 COMMAND_INVALID.
    CommandInvalid = 503,
    /// 504 CHANNEL_ERROR.
    ChannelError = 504,
    /// 505 UNEXPECTED_FRAME.
    UnexpectedFrame = 505,
    /// 506 RESOURCE_ERROR.
    ResourceError = 506,
    /// 530 NOT_ALLOWED.
    NotAllowed = 530,
    /// 540 NOT_IMPLEMENTED.
    NotImplemented = 540,
    /// 541 INTERNAL_ERROR.
    InternalError = 541,
}

impl ErrorCode {
    /// The numeric reply code.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The code numbered `code`, if it is one.
    pub fn from_code(code: u16) -> Option<ErrorCode> {
        use ErrorCode::*;
        [
            ContentTooLarge,
            NoRoute,
            NoConsumers,
            ConnectionForced,
            InvalidPath,
            AccessRefused,
            NotFound,
            ResourceLocked,
            PreconditionFailed,
            FrameError,
            SyntaxError,
            CommandInvalid,
            ChannelError,
            UnexpectedFrame,
            ResourceError,
            NotAllowed,
            NotImplemented,
            InternalError,
        ]
        .into_iter()
        .find(|c| c.code() == code)
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
    /// The AMQP reply code.
    pub code: ErrorCode,
    /// RabbitMQ-style text.
    pub text: String,
    /// The operation.
    pub op: OpKind,
}

impl ProtocolError {
    /// An error of `code` on `op`.
    pub fn new(code: ErrorCode, op: OpKind, detail: impl AsRef<str>) -> ProtocolError {
        ProtocolError {
            code,
            text: format!("{} - {}", code.name(), detail.as_ref()),
            op,
        }
    }
}
