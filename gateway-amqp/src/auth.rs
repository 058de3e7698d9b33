//! SASL mechanisms of `connection.start-ok`: PLAIN and AMQPLAIN. The user check is the
//! broker's (`BrokerHandle::authenticate`).

use amq_protocol::types::AMQPValue;
use amq_protocol::types::parsing::parse_field_table;

/// Credentials a client presented.
#[derive(Debug, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

/// Parses the `response` of start-ok for `mechanism`; `None` when it is malformed or the
/// mechanism is not offered.
pub fn parse_response(mechanism: &str, response: &[u8]) -> Option<Credentials> {
    match mechanism {
        // [authzid] NUL authcid NUL password
        "PLAIN" => {
            let mut parts = response.split(|&b| b == 0);
            let _authzid = parts.next()?;
            let user = std::str::from_utf8(parts.next()?).ok()?.to_string();
            let password = std::str::from_utf8(parts.next()?).ok()?.to_string();
            if parts.next().is_some() {
                return None;
            }
            Some(Credentials { user, password })
        }
        // A field table without its length prefix: LOGIN and PASSWORD.
        "AMQPLAIN" => {
            let len = u32::try_from(response.len()).ok()?;
            let mut framed = Vec::with_capacity(response.len() + 4);
            framed.extend_from_slice(&len.to_be_bytes());
            framed.extend_from_slice(response);
            let (_, table) = parse_field_table(&framed[..]).ok()?;
            let get = |k: &str| match table.inner().get(k)? {
                AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
                AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
                _ => None,
            };
            Some(Credentials {
                user: get("LOGIN")?,
                password: get("PASSWORD")?,
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_with_and_without_authzid() {
        let c = parse_response("PLAIN", b"\0guest\0guest").expect("valid");
        assert_eq!(c.user, "guest");
        assert_eq!(c.password, "guest");
        assert!(parse_response("PLAIN", b"admin\0u\0p").is_some());
        assert!(parse_response("PLAIN", b"nonul").is_none());
        assert!(parse_response("PLAIN", b"\0a\0b\0c").is_none());
        assert!(parse_response("CRAM-MD5", b"\0a\0b").is_none());
    }

    #[test]
    fn amqplain_table() {
        // "LOGIN" longstr "guest", "PASSWORD" longstr "guest"
        let mut body = Vec::new();
        for (k, v) in [("LOGIN", "guest"), ("PASSWORD", "guest")] {
            body.push(k.len() as u8);
            body.extend_from_slice(k.as_bytes());
            body.push(b'S');
            body.extend_from_slice(&(v.len() as u32).to_be_bytes());
            body.extend_from_slice(v.as_bytes());
        }
        let c = parse_response("AMQPLAIN", &body).expect("valid");
        assert_eq!(c.user, "guest");
        assert_eq!(c.password, "guest");
        assert!(parse_response("AMQPLAIN", &body[..body.len() - 1]).is_none());
    }
}
