//! Bounds on the request fields whose cost is not their size: JSON schemas (`response_format`,
//! tool parameters), tools and stop sequences. Each is checked before any expensive work
//! (schema-to-grammar conversion, template rendering, grammar parsing) and a request over one is
//! a 400 naming the field and the limit.
//!
//! The limits come from where llama.cpp's cost grows:
//! - common's json-schema-to-grammar turns an object's *optional* properties into one rule per
//!   suffix of the list, each as long as the suffix (quadratic), built by recursion as deep as
//!   the list, on the converting thread's stack;
//! - every alternative (`enum` value, `anyOf`/`oneOf` branch, `|` of a `pattern`) that is open
//!   at once is a grammar stack, and sampling checks every stack against candidate tokens, so a
//!   token's cost grows with the alternatives;
//! - a repetition `{m,n}` (a pattern's, or `minLength`/`maxLength`, `minItems`/`maxItems`) with
//!   `n < m` makes llama.cpp's grammar parser count to 2^64 building rules (memory without end),
//!   and large bounds make one rule per repetition;
//! - stop sequences are compared with the output after every token.
//!
//! OpenAI's published structured-output limits are the model where they exist (5,000 object
//! properties, 1,000 enum values, 128 tools); the others are sized from the costs above.

use serde_json::Value;

use super::error::ApiError;

/// Object properties in one schema, all objects together (OpenAI's limit).
pub const MAX_PROPERTIES: usize = 5_000;
/// Optional properties of one object (their grammar grows with the square of the count).
pub const MAX_OPTIONAL_PROPERTIES: usize = 64;
/// Alternatives in one schema: `enum` values, `anyOf`/`oneOf`/`type` branches and a pattern's
/// `|` branches, all together (OpenAI allows 1,000 enum values; the grammar's cost per token
/// grows with every alternative).
pub const MAX_ALTERNATIVES: usize = 1_000;
/// Nesting of objects and arrays in one schema.
pub const MAX_SCHEMA_DEPTH: usize = 32;
/// Bytes of one schema as JSON text.
pub const MAX_SCHEMA_BYTES: usize = 256 << 10;
/// Bytes of one `pattern`.
pub const MAX_PATTERN_BYTES: usize = 1_000;
/// The largest repetition count (`{m,n}`, `maxLength`, `maxItems`, ...): llama.cpp's grammar
/// parser refuses more than 2,000 rules from one repetition.
pub const MAX_REPETITION: u64 = 2_000;
/// Tools one request may offer (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Bytes of one stop sequence.
pub const MAX_STOP_BYTES: usize = 1_024;
/// Entries of `logit_bias`.
pub const MAX_LOGIT_BIAS: usize = 1_024;

/// What one schema holds, counted as it is walked.
#[derive(Debug, Default)]
struct Counts {
    properties: usize,
    alternatives: usize,
}

/// Checks the schema at request field `param`; the error names the field and the path inside it.
pub fn check_schema(param: &str, schema: &Value) -> Result<(), ApiError> {
    let bytes = serde_json::to_string(schema).map_or(usize::MAX, |s| s.len());
    if bytes > MAX_SCHEMA_BYTES {
        return Err(over(param, format!("the schema is {bytes} bytes of JSON; at most {MAX_SCHEMA_BYTES}")));
    }
    let mut counts = Counts::default();
    // An explicit stack: the walk must not itself recurse as deep as the schema.
    let mut stack: Vec<(&Value, String, usize)> = vec![(schema, String::new(), 0)];
    while let Some((value, path, depth)) = stack.pop() {
        if depth > MAX_SCHEMA_DEPTH {
            return Err(over(param, format!("{path}: nested more than {MAX_SCHEMA_DEPTH} levels deep")));
        }
        match value {
            Value::Object(map) => {
                check_keywords(param, &path, map, &mut counts)?;
                for (k, v) in map {
                    if v.is_object() || v.is_array() {
                        stack.push((v, format!("{path}.{k}"), depth + 1));
                    }
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    if v.is_object() || v.is_array() {
                        stack.push((v, format!("{path}[{i}]"), depth + 1));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The keywords of one schema object whose cost is bounded.
fn check_keywords(
    param: &str,
    path: &str,
    map: &serde_json::Map<String, Value>,
    counts: &mut Counts,
) -> Result<(), ApiError> {
    if let Some(Value::Object(props)) = map.get("properties") {
        counts.properties += props.len();
        if counts.properties > MAX_PROPERTIES {
            return Err(over(param, format!("{path}.properties: more than {MAX_PROPERTIES} properties in the schema")));
        }
        let required: std::collections::HashSet<&str> = match map.get("required") {
            Some(Value::Array(r)) => r.iter().filter_map(Value::as_str).collect(),
            _ => std::collections::HashSet::new(),
        };
        let optional = props.keys().filter(|k| !required.contains(k.as_str())).count();
        if optional > MAX_OPTIONAL_PROPERTIES {
            return Err(over(
                param,
                format!(
                    "{path}.properties: {optional} optional properties; at most {MAX_OPTIONAL_PROPERTIES} per object (list the others in \"required\", or nest them)"
                ),
            ));
        }
    }
    for key in ["enum", "anyOf", "oneOf", "type"] {
        if let Some(Value::Array(a)) = map.get(key) {
            counts.alternatives += a.len();
        }
    }
    check_ref(param, path, map)?;
    if let Some(p) = map.get("pattern") {
        let Some(p) = p.as_str() else {
            return Err(ApiError::invalid(format!("{param}{path}.pattern: must be a string"), Some(param)));
        };
        counts.alternatives += check_pattern(param, &format!("{path}.pattern"), p)?;
    }
    if counts.alternatives > MAX_ALTERNATIVES {
        return Err(over(
            param,
            format!(
                "{path}: more than {MAX_ALTERNATIVES} alternatives (enum values, anyOf/oneOf branches, pattern branches) in the schema"
            ),
        ));
    }
    for (lo, hi) in [("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties")] {
        let bound = |key: &str| -> Result<Option<u64>, ApiError> {
            match map.get(key) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) if n <= MAX_REPETITION => Ok(Some(n)),
                    Some(n) => Err(over(param, format!("{path}.{key}: {n} is over {MAX_REPETITION}"))),
                    None => Err(ApiError::invalid(
                        format!("{param}{path}.{key}: must be a non-negative integer, got {v}"),
                        Some(param),
                    )),
                },
            }
        };
        if let (Some(min), Some(max)) = (bound(lo)?, bound(hi)?) {
            if min > max {
                return Err(ApiError::invalid(
                    format!("{param}{path}: {lo} {min} is above {hi} {max}; no value can satisfy both"),
                    Some(param),
                ));
            }
        }
    }
    Ok(())
}

/// Checks a `$ref`: only references into the schema's own definitions become a grammar.
fn check_ref(param: &str, path: &str, map: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    match map.get("$ref") {
        None => Ok(()),
        Some(r) if r.as_str().is_some_and(|r| r.starts_with("#/")) => Ok(()),
        Some(r) => Err(ApiError::invalid(
            format!(
                "{param}{path}.$ref: {r} cannot become a grammar: only references into the schema's own definitions (\"#/$defs/NAME\") are followed (\"#\" alone is the whole schema inside itself)"
            ),
            Some(param),
        )),
    }
}

/// Checks a `pattern`: its size, and every `{m,n}` repetition (`m <= n`, both within
/// [`MAX_REPETITION`]). Returns the number of `|` branches it adds.
fn check_pattern(param: &str, path: &str, pattern: &str) -> Result<usize, ApiError> {
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(over(param, format!("{path}: {} bytes; at most {MAX_PATTERN_BYTES}", pattern.len())));
    }
    let bytes = pattern.as_bytes();
    let mut branches = 0;
    let mut i = 0;
    let mut in_class = false;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 1,
            b'[' => in_class = true,
            b']' => in_class = false,
            b'|' if !in_class => branches += 1,
            b'{' if !in_class => {
                let end = pattern[i..].find('}').map(|e| i + e);
                if let Some(end) = end {
                    check_braces(param, path, &pattern[i + 1..end])?;
                    i = end;
                }
            }
            _ => {}
        }
        i += 1;
    }
    Ok(branches)
}

/// The inside of a pattern's `{...}`: `m`, `m,` or `m,n` (anything else is left to llama.cpp,
/// which refuses or ignores it).
fn check_braces(param: &str, path: &str, inside: &str) -> Result<(), ApiError> {
    let mut parts = inside.splitn(2, ',');
    let number = |s: Option<&str>| -> Option<Option<u64>> {
        match s.map(str::trim) {
            None | Some("") => Some(None),
            Some(t) if t.bytes().all(|b| b.is_ascii_digit()) => Some(Some(t.parse().unwrap_or(u64::MAX))),
            Some(_) => None,
        }
    };
    let (Some(min), Some(max)) = (number(parts.next()), number(parts.next())) else { return Ok(()) };
    let max = if inside.contains(',') { max } else { min };
    for n in [min, max].into_iter().flatten() {
        if n > MAX_REPETITION {
            return Err(over(param, format!("{path}: the repetition {{{inside}}} is over {MAX_REPETITION}")));
        }
    }
    if let (Some(min), Some(max)) = (min, max) {
        if min > max {
            return Err(ApiError::invalid(
                format!("{param}{path}: the repetition {{{inside}}} has its minimum above its maximum"),
                Some(param),
            ));
        }
    }
    Ok(())
}

/// A 400 for a field over a limit.
fn over(param: &str, what: String) -> ApiError {
    ApiError::invalid(format!("{param}: {what}: simplify it or split the request"), Some(param))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(schema: Value) -> String {
        check_schema("response_format", &schema).unwrap_err().message
    }

    #[test]
    fn schemas_within_the_limits_pass() {
        let s = json!({"type": "object", "properties": {"a": {"type": "string", "maxLength": 24, "pattern": "^[a-z]{1,8}(x|y)$"}, "b": {"enum": [1, 2, 3]}}, "required": ["a"]});
        check_schema("response_format", &s).unwrap();
    }

    #[test]
    fn each_costly_shape_is_refused_naming_the_limit() {
        let props: serde_json::Map<String, Value> =
            (0..65).map(|i| (format!("p{i}"), json!({"type": "integer"}))).collect();
        assert!(refused(json!({"type": "object", "properties": props})).contains("65 optional properties"));
        let required: Vec<String> = (0..65).map(|i| format!("p{i}")).collect();
        check_schema("x", &json!({"type": "object", "properties": props, "required": required})).unwrap();
        assert!(refused(json!({"enum": (0..1001).collect::<Vec<_>>()})).contains("more than 1000 alternatives"));
        assert!(refused(json!({"type": "string", "pattern": "^a{2,1}$"})).contains("minimum above its maximum"));
        assert!(refused(json!({"type": "string", "pattern": "^a{9999}$"})).contains("over 2000"));
        assert!(refused(json!({"type": "string", "pattern": format!("^({})$", vec!["a"; 1001].join("|"))}))
            .contains("bytes; at most 1000"));
        assert!(refused(json!({"type": "string", "minLength": 5, "maxLength": 2})).contains("minLength 5 is above"));
        assert!(refused(json!({"type": "array", "maxItems": 1_000_000})).contains("maxItems"));
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(refused(deep).contains("nested more than 32"));
        // `[{]` and `\{` are not repetitions.
        check_schema("x", &json!({"pattern": "^[{]\\{x$"})).unwrap();
    }
}
