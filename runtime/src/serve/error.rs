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
    /// names (the chat request's), it and the message's leading `name:` become the second.
    pub fn renamed(mut self, names: &[(&str, &str)]) -> ApiError {
        if let Some((from, to)) = self.param.as_deref().and_then(|p| names.iter().find(|(from, _)| p == *from)) {
            self.message = self.message.replacen(&format!("{from}:"), &format!("{to}:"), 1);
            self.param = Some((*to).to_string());
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
