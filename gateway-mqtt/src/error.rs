//! Why a connection ends.

use mqtt_proto::v5::DisconnectReasonCode;

/// A reason to close a connection, with the v5 DISCONNECT reason sent to v5 clients.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("{text} (reason {:#04x})", *.reason as u8)]
pub struct CloseError {
    pub reason: DisconnectReasonCode,
    pub text: String,
}

impl CloseError {
    pub fn new(reason: DisconnectReasonCode, text: impl Into<String>) -> CloseError {
        CloseError {
            reason,
            text: text.into(),
        }
    }

    pub fn protocol(text: impl Into<String>) -> CloseError {
        CloseError::new(DisconnectReasonCode::ProtocolError, text)
    }
}
