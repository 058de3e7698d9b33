//! SASL (part 5.3) as RabbitMQ 4 serves it: PLAIN, ANONYMOUS (only when the configuration
//! allows it) and EXTERNAL (only with a verified client certificate, whose identity is the
//! user). The password check itself is the broker's, asked through the shell.

/// What a client's `sasl-init` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Login {
    /// User and password to check.
    Plain { user: String, password: String },
    /// The configured anonymous user, no password.
    Anonymous,
    /// The client certificate's identity, no password.
    External(String),
}

/// Why a `sasl-init` is refused (the outcome is `auth`, code 1).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SaslError {
    #[error("mechanism {0} not offered")]
    NotOffered(String),
    #[error("malformed PLAIN response")]
    MalformedPlain,
}

/// The mechanisms offered: EXTERNAL first when a certificate identifies the client (clients
/// pick the first they support), ANONYMOUS last.
pub fn mechanisms(identity: Option<&str>, allow_anonymous: bool) -> Vec<String> {
    let mut m = Vec::new();
    if identity.is_some() {
        m.push("EXTERNAL".to_string());
    }
    m.push("PLAIN".to_string());
    if allow_anonymous {
        m.push("ANONYMOUS".to_string());
    }
    m
}

/// Parses a `sasl-init`.
pub fn parse_init(
    mechanism: &str,
    response: Option<&[u8]>,
    identity: Option<&str>,
    allow_anonymous: bool,
) -> Result<Login, SaslError> {
    match mechanism {
        // [authzid] NUL authcid NUL password
        "PLAIN" => {
            let response = response.ok_or(SaslError::MalformedPlain)?;
            let mut parts = response.split(|&b| b == 0);
            let _authzid = parts.next().ok_or(SaslError::MalformedPlain)?;
            let mut text = || {
                parts
                    .next()
                    .and_then(|p| std::str::from_utf8(p).ok())
                    .map(str::to_string)
                    .ok_or(SaslError::MalformedPlain)
            };
            let user = text()?;
            let password = text()?;
            if parts.next().is_some() || user.is_empty() {
                return Err(SaslError::MalformedPlain);
            }
            Ok(Login::Plain { user, password })
        }
        "ANONYMOUS" if allow_anonymous => Ok(Login::Anonymous),
        "EXTERNAL" => identity
            .map(|id| Login::External(id.to_string()))
            .ok_or_else(|| SaslError::NotOffered(mechanism.to_string())),
        other => Err(SaslError::NotOffered(other.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_anonymous_external() {
        assert_eq!(
            parse_init("PLAIN", Some(b"\0guest\0pw"), None, false),
            Ok(Login::Plain {
                user: "guest".into(),
                password: "pw".into()
            })
        );
        assert_eq!(
            parse_init("PLAIN", Some(b"guest"), None, false),
            Err(SaslError::MalformedPlain)
        );
        assert!(parse_init("ANONYMOUS", None, None, false).is_err());
        assert_eq!(
            parse_init("ANONYMOUS", None, None, true),
            Ok(Login::Anonymous)
        );
        assert!(parse_init("EXTERNAL", None, None, true).is_err());
        assert_eq!(
            parse_init("EXTERNAL", None, Some("CN=app"), false),
            Ok(Login::External("CN=app".into()))
        );
        assert_eq!(mechanisms(None, false), vec!["PLAIN".to_string()]);
        assert_eq!(mechanisms(Some("x"), true).len(), 3);
    }
}
