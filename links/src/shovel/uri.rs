//! Shovel URIs, RabbitMQ's `amqp://user:pass@host:port/vhost?params`: the check with
//! RabbitMQ's error texts, and where a URI leads. `amqp://` without a host (or an empty
//! URI) is the broker running the shovel, reached through its own AMQP listener.

/// Where a shovel end connects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `amqps`.
    pub tls: bool,
    /// `None`: the local broker.
    pub host: Option<String>,
    /// The port (5672, or 5671 with TLS, unless given).
    pub port: u16,
    /// The user (`guest` unless given, as RabbitMQ's URIs).
    pub user: String,
    /// The password.
    pub password: String,
    /// The vhost (`None`: the local broker's is the parameter's, a remote's `/`).
    pub vhost: Option<String>,
}

fn bad(uri: &str, why: &str) -> String {
    format!("\"{uri}\" not a valid URI: {{{why},\"{uri}\"}}")
}

/// Checks `uri` as RabbitMQ's `amqp_uri:parse` would; the error is RabbitMQ's text.
pub fn check(uri: &str) -> Result<(), String> {
    parse(uri).map(|_| ())
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Reads `uri`; the error is RabbitMQ's text.
pub fn parse(uri: &str) -> Result<Target, String> {
    let local = Target {
        tls: false,
        host: None,
        port: 5672,
        user: "guest".into(),
        password: "guest".into(),
        vhost: None,
    };
    if uri.is_empty() {
        return Ok(local);
    }
    let Some((scheme, rest)) = uri.split_once("://") else {
        return Err(bad(uri, "{unable_to_parse_uri,no_scheme}"));
    };
    let tls = match scheme {
        "amqp" => false,
        "amqps" => true,
        other => return Err(bad(uri, &format!("{{unexpected_uri_scheme,\"{other}\"}}"))),
    };
    // Query parameters (heartbeat, TLS options, ...) do not change where it leads.
    let rest = rest.split_once('?').map_or(rest, |(r, _)| r);
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let (mut user, mut password) = ("guest".to_string(), "guest".to_string());
    if let Some(u) = userinfo {
        let (name, pass) = u.split_once(':').unwrap_or((u, ""));
        user = percent_decode(name).ok_or_else(|| bad(uri, "{unable_to_parse_uri,userinfo}"))?;
        password =
            percent_decode(pass).ok_or_else(|| bad(uri, "{unable_to_parse_uri,userinfo}"))?;
    }
    let (host, port) = if let Some(h) = hostport.strip_prefix('[') {
        let (h, p) = h
            .split_once(']')
            .ok_or_else(|| bad(uri, "{unable_to_parse_uri,host}"))?;
        (h.to_string(), p.strip_prefix(':'))
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (hostport.to_string(), None),
        }
    };
    let port = match port {
        None | Some("") => {
            if tls {
                5671
            } else {
                5672
            }
        }
        Some(p) => p
            .parse::<u16>()
            .map_err(|_| bad(uri, &format!("port_invalid,\"{p}\"")))?,
    };
    let vhost = if path.is_empty() {
        None
    } else {
        Some(percent_decode(path).ok_or_else(|| bad(uri, "{unable_to_parse_uri,path}"))?)
    };
    Ok(Target {
        tls,
        host: (!host.is_empty()).then_some(host),
        port,
        user,
        password,
        vhost,
    })
}

impl Target {
    /// The URI to dial: the local broker at `local` (its AMQP listener) in `vhost` when
    /// this target has no host.
    pub fn dial(&self, local: Option<std::net::SocketAddr>, vhost: &str) -> Result<String, String> {
        let enc = |s: &str| {
            let mut out = String::new();
            for b in s.bytes() {
                if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                    out.push(b as char);
                } else {
                    out.push_str(&format!("%{b:02X}"));
                }
            }
            out
        };
        let (host, port) = match &self.host {
            Some(h) if h.contains(':') => (format!("[{h}]"), self.port),
            Some(h) => (h.clone(), self.port),
            None => {
                let addr =
                    local.ok_or("this broker has no AMQP listener for a local shovel end")?;
                (addr.ip().to_string(), addr.port())
            }
        };
        let vhost = match (&self.vhost, &self.host) {
            (Some(v), _) => v.clone(),
            (None, None) => vhost.to_string(),
            (None, Some(_)) => "/".to_string(),
        };
        let scheme = if self.tls { "amqps" } else { "amqp" };
        Ok(format!(
            "{scheme}://{}:{}@{host}:{port}/{}",
            enc(&self.user),
            enc(&self.password),
            enc(&vhost)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_and_remote() {
        let l = parse("amqp://").expect("local");
        assert_eq!(l.host, None);
        let local: std::net::SocketAddr = "127.0.0.1:5999".parse().expect("addr");
        assert_eq!(
            l.dial(Some(local), "v/1").expect("dial"),
            "amqp://guest:guest@127.0.0.1:5999/v%2F1"
        );
        let r = parse("amqp://u:p%40@h.example:5673/%2f?heartbeat=5").expect("remote");
        assert_eq!(r.host.as_deref(), Some("h.example"));
        assert_eq!((r.port, r.password.as_str()), (5673, "p@"));
        assert_eq!(r.vhost.as_deref(), Some("/"));
        assert!(parse("amqp://h:x").is_err());
    }
}
