//! Request bodies parsed into their types, an error naming the field at fault.

use serde_json::Value;

use crate::serve::error::ApiError;

/// Parses a JSON body into `T`, naming the field at fault.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    parse_value(value)
}

/// [`parse`] of a body already read as JSON (another API's request, translated).
pub(crate) fn parse_value<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    if !value.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
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
