//! Client strings in log lines: `Escaped` prints a string (or bytes) with every control
//! character escaped, so a client-chosen name, user, client id, topic or reason can never
//! start a log line of its own (`"evil\nFAKE LOG LINE"` logs as `evil\nFAKE LOG LINE`, one
//! line). Every log site that prints client data uses it, in every crate: one place to
//! look.

use std::fmt;

/// Displays a client string with control characters (and backslashes, so an escape in the
/// input cannot pass for one of ours) escaped as Rust does (`\n`, `\u{1b}`).
#[derive(Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        // The common case, nothing to escape, is one write.
        if !s.chars().any(needs_escape) {
            return f.write_str(s);
        }
        for c in s.chars() {
            if needs_escape(c) {
                write!(f, "{}", c.escape_default())?;
            } else {
                write!(f, "{c}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

/// Displays client bytes that may not be UTF-8 (MQTT client ids, AMQP responses): valid
/// UTF-8 runs as `Escaped`, every other byte as `\xNN`.
#[derive(Clone, Copy)]
pub struct EscapedBytes<'a>(pub &'a [u8]);

impl fmt::Display for EscapedBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for chunk in self.0.utf8_chunks() {
            Escaped(chunk.valid()).fmt(f)?;
            for b in chunk.invalid() {
                write!(f, "\\x{b:02x}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for EscapedBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

/// Control characters (C0, DEL, C1, and the Unicode line and paragraph separators, which
/// some log viewers break lines at) and the backslash.
fn needs_escape(c: char) -> bool {
    c.is_control() || c == '\\' || c == '\u{2028}' || c == '\u{2029}'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_never_reach_the_log_raw() {
        assert_eq!(Escaped("plain name").to_string(), "plain name");
        assert_eq!(
            Escaped("evil\nFAKE LOG LINE").to_string(),
            "evil\\nFAKE LOG LINE"
        );
        assert_eq!(
            Escaped("a\r\tb\u{1b}[31m\u{7f}\u{85}\u{2028}c\\n").to_string(),
            "a\\r\\tb\\u{1b}[31m\\u{7f}\\u{85}\\u{2028}c\\\\n"
        );
        assert_eq!(Escaped("héllo").to_string(), "héllo");
        assert_eq!(
            EscapedBytes(b"id\n\xff\xfeok").to_string(),
            "id\\n\\xff\\xfeok"
        );
        assert_eq!(format!("{:?}", Escaped("x\ny")), "\"x\\ny\"");
    }
}
