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

/// A body read as JSON.
fn json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))
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
