//! Ollama's `keep_alive`: how long the model stays loaded after a request, read as Ollama reads
//! it (zero unloads).

use serde_json::Value;

use crate::serve::error::ApiError;

/// Whether `keep_alive` unloads the model (a duration of zero), as Ollama reads it: a number of
/// seconds (negative: for ever) or a Go duration (`"5m"`, `"1h30m"`, `"-1s"`, `"0"`); a number
/// of seconds written as a string (`"-1"`, which Python clients send) is taken too. Anything
/// else is refused as Ollama refuses it.
pub fn unloads(keep_alive: Option<&Value>) -> Result<bool, ApiError> {
    let bad = |why: String| Err(ApiError::invalid(format!("keep_alive: {why}"), Some("keep_alive")));
    let zero_seconds = |s: f64| s.trunc() == 0.0;
    match keep_alive {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Number(n)) => Ok(n.as_f64().is_some_and(zero_seconds)),
        Some(Value::String(s)) if s.trim().parse::<f64>().is_ok_and(f64::is_finite) => {
            Ok(s.trim().parse::<f64>().is_ok_and(zero_seconds))
        }
        Some(Value::String(s)) => match go_duration_is_zero(s) {
            Some(zero) => Ok(zero),
            None => bad(format!(
                "time: invalid duration {s:?} (a number of seconds, or a duration such as \"5m\", \"1h30m\" or \"-1s\")"
            )),
        },
        Some(other) => bad(format!("{other} is not a number of seconds or a duration string")),
    }
}

/// Whether Go's `time.ParseDuration` reads `s` as zero; `None` when it does not parse: an
/// optional sign, then numbers (with an optional fraction) each followed by a unit (`ns`, `us`,
/// `µs`, `ms`, `s`, `m`, `h`), or `0` alone.
fn go_duration_is_zero(s: &str) -> Option<bool> {
    let body = s.strip_prefix(['-', '+']).unwrap_or(s);
    if body == "0" {
        return Some(true);
    }
    let (mut rest, mut zero) = (body, true);
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let number = &rest[..number_len];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return None;
        }
        rest = &rest[number_len..];
        let unit = ["ns", "us", "µs", "μs", "ms", "s", "m", "h"].into_iter().find(|u| rest.starts_with(u))?;
        rest = &rest[unit.len()..];
        zero &= number.bytes().all(|b| b == b'0' || b == b'.');
    }
    Some(zero)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keep_alive_is_read_as_ollama_reads_it() {
        for (value, unloads) in [
            (json!(0), true),
            (json!(0.5), true),
            (json!("0"), true),
            (json!("0s"), true),
            (json!("0m0.0s"), true),
            (json!(-1), false),
            (json!("-1"), false),
            (json!("5"), false),
            (json!(300), false),
            (json!("5m"), false),
            (json!("1h30m"), false),
            (json!("-1s"), false),
            (json!("1.5h"), false),
            (json!("300ms"), false),
            (Value::Null, false),
        ] {
            assert_eq!(super::unloads(Some(&value)).unwrap(), unloads, "{value}");
        }
        for bad in [
            json!("5 minutes"),
            json!("abc"),
            json!("inf"),
            json!(""),
            json!("5x"),
            json!("1..2s"),
            json!(true),
            json!([0]),
        ] {
            let e = unloads(Some(&bad)).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some("keep_alive")), "{bad}");
        }
    }
}
