//! JSON values printed as Erlang prints their decoded terms (`~p`): RabbitMQ's validation
//! texts quote the offending value that way (`<<"foo">>` for a string), and Warren's
//! texts are RabbitMQ's.

use serde_json::Value;

/// `v` as Erlang's `~p` of the term RabbitMQ decodes it to.
pub fn term(v: &Value) -> String {
    let mut out = String::new();
    write(v, &mut out);
    out
}

fn write(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => binary(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push_str("#{");
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                binary(k, out);
                out.push_str(" => ");
                write(item, out);
            }
            out.push('}');
        }
    }
}

/// `<<"text">>`, with `"` and `\` escaped as Erlang does.
pub fn binary(s: &str, out: &mut String) {
    out.push_str("<<\"");
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out.push_str("\">>");
}

/// A proplist of unrecognised terms: `[{<<"k">>,V},...]`.
pub fn proplist<'a>(pairs: impl IntoIterator<Item = (&'a String, &'a Value)>) -> String {
    let mut out = String::from("[");
    for (i, (k, v)) in pairs.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('{');
        binary(k, &mut out);
        out.push(',');
        write(v, &mut out);
        out.push('}');
    }
    out.push(']');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn terms_as_rabbitmq_quotes_them() {
        assert_eq!(term(&json!("x")), "<<\"x\">>");
        assert_eq!(term(&json!(-3)), "-3");
        assert_eq!(term(&json!({})), "#{}");
        let m = json!({"bogus": 1});
        assert_eq!(
            proplist(m.as_object().into_iter().flatten()),
            "[{<<\"bogus\">>,1}]"
        );
    }
}
