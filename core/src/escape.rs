//! Client strings in log lines: `Escaped` prints a string (or bytes) so that a client-chosen
//! name, user, client id, topic or reason can neither start a log line of its own nor pass
//! for fields of its own. Control characters are escaped (`"evil\nFAKE LOG LINE"` logs as
//! `"evil\nFAKE LOG LINE"`, one line), and a value with a space, `=` or `"` is quoted, with
//! its quotes escaped (an MQTT client id `x peer=10.9.9.9:1 user=admin` logs as
//! `client_id="x peer=10.9.9.9:1 user=admin"`, one field, as logfmt reads it). Every log
//! site that prints client data uses it, in every crate: one place to look.

use std::fmt;

/// Displays a client string with control characters (and backslashes, so an escape in the
/// input cannot pass for one of ours) escaped as Rust does (`\n`, `\u{1b}`), in quotes (its
/// own escaped) when it holds a space, `=` or `"`. `Debug` always quotes.
#[derive(Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        // The common case, nothing to escape or quote, is one write.
        if !s.chars().any(|c| needs_escape(c) || needs_quotes(c)) {
            return f.write_str(s);
        }
        let quoted = s.chars().any(needs_quotes);
        if quoted {
            f.write_str("\"")?;
        }
        write_escaped(f, s, quoted)?;
        if quoted {
            f.write_str("\"")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"")?;
        write_escaped(f, self.0, true)?;
        f.write_str("\"")
    }
}

/// `s` with control characters and backslashes escaped, and its quotes if `quoted`.
fn write_escaped(f: &mut fmt::Formatter<'_>, s: &str, quoted: bool) -> fmt::Result {
    for c in s.chars() {
        if needs_escape(c) {
            write!(f, "{}", c.escape_default())?;
        } else if quoted && c == '"' {
            f.write_str("\\\"")?;
        } else {
            write!(f, "{c}")?;
        }
    }
    Ok(())
}

/// Displays client bytes that may not be UTF-8 (MQTT client ids, AMQP responses): valid
/// UTF-8 runs as `Escaped`, every other byte as `\xNN`.
#[derive(Clone, Copy)]
pub struct EscapedBytes<'a>(pub &'a [u8]);

impl fmt::Display for EscapedBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let quoted = self
            .0
            .utf8_chunks()
            .any(|c| c.valid().chars().any(needs_quotes));
        self.write(f, quoted)
    }
}

impl fmt::Debug for EscapedBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, true)
    }
}

impl EscapedBytes<'_> {
    fn write(&self, f: &mut fmt::Formatter<'_>, quoted: bool) -> fmt::Result {
        if quoted {
            f.write_str("\"")?;
        }
        for chunk in self.0.utf8_chunks() {
            write_escaped(f, chunk.valid(), quoted)?;
            for b in chunk.invalid() {
                write!(f, "\\x{b:02x}")?;
            }
        }
        if quoted {
            f.write_str("\"")?;
        }
        Ok(())
    }
}

/// Control characters (C0, DEL, C1, and the Unicode line and paragraph separators, which
/// some log viewers break lines at) and the backslash.
fn needs_escape(c: char) -> bool {
    c.is_control() || c == '\\' || c == '\u{2028}' || c == '\u{2029}'
}

/// What splits or ends a `key=value` field in a text log (any Unicode space, so a
/// no-break space cannot pass for one to a reader either), or would start a quoted one.
fn needs_quotes(c: char) -> bool {
    c.is_whitespace() || c == '=' || c == '"'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_never_reach_the_log_raw() {
        assert_eq!(Escaped("plain.name").to_string(), "plain.name");
        // A newline is whitespace too, so the value is also quoted.
        assert_eq!(
            Escaped("evil\nFAKE_LOG_LINE").to_string(),
            "\"evil\\nFAKE_LOG_LINE\""
        );
        assert_eq!(
            Escaped("a\r\tb\u{1b}[31m\u{7f}\u{85}\u{2028}c\\n").to_string(),
            "\"a\\r\\tb\\u{1b}[31m\\u{7f}\\u{85}\\u{2028}c\\\\n\"",
            "a tab, U+0085 and U+2028 are spaces too: quoted"
        );
        assert_eq!(Escaped("héllo").to_string(), "héllo");
        assert_eq!(
            EscapedBytes(b"id\n\xff\xfeok").to_string(),
            "\"id\\n\\xff\\xfeok\""
        );
        assert_eq!(format!("{:?}", Escaped("x\ny")), "\"x\\ny\"");
    }

    #[test]
    fn client_strings_cannot_forge_fields() {
        assert_eq!(
            Escaped("x peer=10.9.9.9:1 user=admin").to_string(),
            "\"x peer=10.9.9.9:1 user=admin\""
        );
        assert_eq!(Escaped("a=b").to_string(), "\"a=b\"");
        assert_eq!(
            Escaped("x\" user=\"admin").to_string(),
            "\"x\\\" user=\\\"admin\"",
            "a quote cannot end the quoted value early"
        );
        assert_eq!(
            Escaped("x\\\" user=admin").to_string(),
            "\"x\\\\\\\" user=admin\"",
            "nor can a backslash before it"
        );
        assert_eq!(Escaped("no\u{a0}break").to_string(), "\"no\u{a0}break\"");
        assert_eq!(EscapedBytes(b"id \xff=1").to_string(), "\"id \\xff=1\"");
        assert_eq!(format!("{:?}", Escaped("a \"b\"")), "\"a \\\"b\\\"\"");
    }
}
