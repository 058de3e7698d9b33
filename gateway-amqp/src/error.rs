//! Errors at the gateway's boundary: each maps to the AMQP reply code the connection is closed
//! with.

use warren_core::error::ErrorCode;

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// A frame that violates the framing rules (size, frame-end, heartbeat channel).
    #[error("FRAME_ERROR - {0}")]
    Frame(String),
    /// A frame whose payload does not decode.
    #[error("SYNTAX_ERROR - {0}")]
    Syntax(String),
    /// A frame out of sequence (content without publish, method inside content...).
    #[error("UNEXPECTED_FRAME - {0}")]
    Unexpected(String),
    /// A valid method that is not allowed here.
    #[error("COMMAND_INVALID - {0}")]
    CommandInvalid(String),
    #[error("CHANNEL_ERROR - {0}")]
    Channel(String),
    #[error("NOT_ALLOWED - {0}")]
    NotAllowed(String),
    #[error("ACCESS_REFUSED - {0}")]
    AccessRefused(String),
    #[error("NOT_IMPLEMENTED - {0}")]
    NotImplemented(String),
    /// A method whose short string argument is not UTF-8: on an open channel, that
    /// channel's error (406, as any bad argument); a connection error elsewhere.
    #[error("SYNTAX_ERROR - {text}")]
    NotUtf8 {
        channel: u16,
        ids: (u16, u16),
        text: String,
    },
}

impl GatewayError {
    /// The AMQP reply code this error closes the connection with.
    pub fn code(&self) -> ErrorCode {
        match self {
            GatewayError::Frame(_) => ErrorCode::FrameError,
            GatewayError::Syntax(_) => ErrorCode::SyntaxError,
            GatewayError::Unexpected(_) => ErrorCode::UnexpectedFrame,
            GatewayError::CommandInvalid(_) => ErrorCode::CommandInvalid,
            GatewayError::Channel(_) => ErrorCode::ChannelError,
            GatewayError::NotAllowed(_) => ErrorCode::NotAllowed,
            GatewayError::AccessRefused(_) => ErrorCode::AccessRefused,
            GatewayError::NotImplemented(_) => ErrorCode::NotImplemented,
            GatewayError::NotUtf8 { .. } => ErrorCode::SyntaxError,
        }
    }
}
