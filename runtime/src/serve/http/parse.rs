//! Request bodies parsed into their types, an error naming the field at fault.

use serde_json::Value;

use crate::serve::error::ApiError;

/// Parses a JSON body into `T`, naming the field at fault.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    parse_value(json(body)?)
}

/// [`parse`] for an API that ignores the fields it does not know (Ollama's, whose clients add
/// their own): those are named in the log instead of refused. `T` must not deny unknown fields.
pub(crate) fn parse_ignoring<T: serde::de::DeserializeOwned>(body: &[u8], api: &str) -> Result<T, ApiError> {
    let value = json(body)?;
    let mut ignored = Vec::new();
    let mut note = |path: serde_ignored::Path<'_>| ignored.push(path.to_string());
    let parsed = checked(value, |v| serde_path_to_error::deserialize(serde_ignored::Deserializer::new(v, &mut note)));
    if !ignored.is_empty() {
        log::info!(
            "{api} request: ignored the fields {} (not used here)",
            crate::text::excerpt(&ignored.join(", "), 200)
        );
    }
    parsed
}

/// [`parse`] of a body already read as JSON (another API's request, translated).
pub(crate) fn parse_value<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    checked(value, serde_path_to_error::deserialize)
}

/// The most objects a request body may hold: each becomes a map of its own, and an API's
/// translation copies them (142,500 small tools in 8 MiB took 423 MiB to parse: about 1.5 KiB
/// an object, so this bound holds a body's parse to about 60 MiB).
pub const MAX_JSON_OBJECTS: usize = 40_000;
/// The most values (numbers, strings, arrays, objects) a request body may hold: a prompt of token
/// ids or a long conversation stay far below it.
pub const MAX_JSON_VALUES: usize = 1_000_000;
/// The deepest a request body's JSON may nest (a schema's own bound is deeper inside it).
pub const MAX_JSON_DEPTH: usize = 64;

/// A body read as JSON, its shape bounded first ([`check_shape`]).
fn json(body: &[u8]) -> Result<Value, ApiError> {
    check_shape(body)?;
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))
}

/// Counts the objects and values of a JSON text and its depth, without building it (a scan of
/// its bytes): a body over [`MAX_JSON_OBJECTS`], [`MAX_JSON_VALUES`] or [`MAX_JSON_DEPTH`] is
/// refused before any of it is parsed. Malformed JSON passes here and fails in the parser.
pub(crate) fn check_shape(body: &[u8]) -> Result<(), ApiError> {
    let (mut objects, mut values, mut depth, mut deepest) = (0usize, 1usize, 0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &b in body {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                objects += usize::from(b == b'{');
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            b',' => values += 1,
            _ => {}
        }
    }
    let over = |what: String| {
        Err(ApiError::new(413, "invalid_request_error", format!("the body is {what}; send less at once")))
    };
    if objects > MAX_JSON_OBJECTS {
        return over(format!("{objects} JSON objects, more than the {MAX_JSON_OBJECTS} a request may hold"));
    }
    if values > MAX_JSON_VALUES {
        return over(format!("over {MAX_JSON_VALUES} JSON values"));
    }
    if deepest > MAX_JSON_DEPTH {
        return over(format!("JSON nested {deepest} levels deep, more than {MAX_JSON_DEPTH}"));
    }
    Ok(())
}

/// `value` (an object) deserialized by `deserialize`, a failure naming the field at fault.
fn checked<T>(
    value: Value,
    deserialize: impl FnOnce(Value) -> Result<T, serde_path_to_error::Error<serde_json::Error>>,
) -> Result<T, ApiError> {
    if !value.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    }
    deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.into_inner().to_string();
        // serde names an unknown field in its message; report it as the parameter at fault.
        let unknown = msg.strip_prefix("unknown field `").and_then(|r| r.split('`').next()).map(str::to_string);
        match unknown {
            Some(field) => {
                let param = if path == "." {
                    field
                } else if path == field || path.ends_with(&format!(".{field}")) {
                    path
                } else {
                    format!("{path}.{field}")
                };
                ApiError::invalid(format!("Unrecognized request argument supplied: {param}"), Some(&param))
            }
            None if path == "." => ApiError::invalid(format!("invalid request body: {msg}"), None),
            None => ApiError::invalid(format!("{path}: {msg}"), Some(&path)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shape_counts_objects_values_and_depth_outside_strings() {
        let objects = format!("[{}]", vec!["{}"; MAX_JSON_OBJECTS + 1].join(","));
        assert_eq!(check_shape(objects.as_bytes()).unwrap_err().status, 413);
        assert!(check_shape(format!("[{}]", vec!["{}"; MAX_JSON_OBJECTS].join(",")).as_bytes()).is_ok());
        let deep = format!("{}{}", "[".repeat(MAX_JSON_DEPTH + 1), "]".repeat(MAX_JSON_DEPTH + 1));
        assert!(check_shape(deep.as_bytes()).unwrap_err().message.contains("nested"));
        let values = format!("[{}]", vec!["1"; MAX_JSON_VALUES + 1].join(","));
        assert!(check_shape(values.as_bytes()).unwrap_err().message.contains("values"));
        // Braces, brackets and commas inside strings (escaped quotes included) are text.
        let text = format!(r#"{{"prompt":"\"{}{}"}}"#, "{[,".repeat(MAX_JSON_VALUES), r#"\\"#);
        assert!(check_shape(text.as_bytes()).is_ok());
    }
}
