//! The responses every API's answers are made of: a JSON body, an error with its status's
//! headers, and the CORS preflight.

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};

use super::body::Body;
use crate::serve::error::ApiError;

/// A JSON response with `status`.
pub(crate) fn json_response(status: u16, body: String) -> Response<Body> {
    let mut r = Response::new(Body::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An error response in OpenAI's shape (see [`error_with`]).
pub(crate) fn error(e: &ApiError) -> Response<Body> {
    error_with(e, e.body())
}

/// An error response with `body`, an API's rendering of `e`. 503 says when to retry; 401 how to
/// authenticate; a 4xx that may have left a request body unread closes the connection, so no
/// unread byte is taken for the next request.
pub(crate) fn error_with(e: &ApiError, body: String) -> Response<Body> {
    let mut r = json_response(e.status, body);
    let h = r.headers_mut();
    match e.status {
        503 => {
            h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        401 => {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        400 | 408 | 411 | 413 => {
            h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        _ => {}
    }
    r
}

/// A CORS preflight from an allowed origin.
pub(crate) fn preflight(req: &Request<Incoming>) -> Response<Body> {
    let mut r = Response::new(Body::full(Bytes::new()));
    *r.status_mut() = StatusCode::NO_CONTENT;
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, DELETE, OPTIONS"));
    let asked = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        asked.unwrap_or_else(|| HeaderValue::from_static("authorization, content-type")),
    );
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    r
}
