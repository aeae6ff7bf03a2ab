//! The HTTP errors the API answers with, in OpenAI's shape.

/// An HTTP error with an OpenAI-style body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// What went wrong and what to do.
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `model_not_found`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// An error of another status and type.
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code: None }
    }

    /// The same error with `code`.
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The same error about `param`.
    pub fn with_param(mut self, param: &str) -> ApiError {
        self.param = Some(param.to_string());
        self
    }

    /// The same error about another API's field: when its parameter is one of `names`' first
    /// names (the chat request's) or a field inside one (`response_format.json_schema.schema.x`),
    /// that part of it and of the message becomes the second name. `{i}` in a pair stands for an
    /// index, kept: `("tools[{i}].function.parameters", "tools.{i}.input_schema")`. The first
    /// pair that matches is taken.
    pub fn renamed(mut self, names: &[(&str, &str)]) -> ApiError {
        let Some(param) = self.param.clone() else { return self };
        if let Some(to) = names.iter().find_map(|(from, to)| renamed_field(&param, from, to)) {
            self.message = self.message.replacen(&param, &to, 1);
            self.param = Some(to);
        }
        self
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        self.body_json().to_string()
    }

    /// [`ApiError::body`] as JSON.
    pub fn body_json(&self) -> serde_json::Value {
        serde_json::json!({
            "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code }
        })
    }
}

/// `param` with its leading field `from` named `to` (`{i}` in both: one index, kept), when
/// `param` is that field or a field inside it.
fn renamed_field(param: &str, from: &str, to: &str) -> Option<String> {
    let (index, rest) = match from.split_once("{i}") {
        None => (None, param.strip_prefix(from)?),
        Some((before, after)) => {
            let indexed = param.strip_prefix(before)?;
            let digits = &indexed[..indexed.find(|c: char| !c.is_ascii_digit()).unwrap_or(indexed.len())];
            if digits.is_empty() {
                return None;
            }
            (Some(digits), indexed[digits.len()..].strip_prefix(after)?)
        }
    };
    if !(rest.is_empty() || rest.starts_with('.') || rest.starts_with('[')) {
        return None;
    }
    Some(format!("{}{rest}", index.map_or_else(|| to.to_string(), |i| to.replacen("{i}", i, 1))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_and_the_fields_inside_it_are_renamed_with_their_index() {
        let names = [
            ("response_format.json_schema.schema", "output_config.format.schema"),
            ("response_format", "output_config.format"),
            ("tools[{i}].function.parameters", "tools.{i}.input_schema"),
            ("stop", "stop_sequences"),
        ];
        let renamed = |param: &str| {
            let e = ApiError::invalid(format!("{param}: bad"), Some(param)).renamed(&names);
            (e.param.unwrap(), e.message)
        };
        assert_eq!(
            renamed("response_format.json_schema.schema.properties.x.pattern"),
            (
                "output_config.format.schema.properties.x.pattern".into(),
                "output_config.format.schema.properties.x.pattern: bad".into()
            )
        );
        assert_eq!(renamed("response_format").0, "output_config.format");
        assert_eq!(renamed("tools[12].function.parameters.properties").0, "tools.12.input_schema.properties");
        assert_eq!(renamed("stop").0, "stop_sequences");
        for kept in ["stopped", "tools[x].function.parameters", "tools[1].function.name", "top_p"] {
            assert_eq!(renamed(kept).0, kept);
        }
    }
}
