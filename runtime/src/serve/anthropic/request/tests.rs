//! The Messages request's translation into the chat request.

use super::*;
use crate::serve::job::PromptInput;

fn chat(body: Value) -> Result<(Value, GenerationRequest), ApiError> {
    let (r, _) = parse(&serde_json::to_vec(&body).unwrap(), false)?;
    let PromptInput::Chat(c) = &r.prompt else { panic!("not a chat") };
    Ok((c.messages.clone(), r))
}

#[test]
fn blocks_become_the_chat_messages_a_template_renders() {
    let (messages, r) = chat(json!({
    "model": "claude-x", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
    "stop_sequences": ["END"],
    "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look it up", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
            {"type": "text", "text": "And now?"}]}
    ]}))
    .unwrap();
    assert_eq!(
        messages,
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
            {"role": "user", "content": "And now?"}
        ])
    );
    assert_eq!((r.max_tokens, r.stop.as_slice()), (Some(5), ["END".to_string()].as_slice()));
}

#[test]
fn bad_requests_name_the_messages_api_field() {
    let e = |body: Value| chat(body).unwrap_err();
    let user = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(e(json!({"messages": user})).param.as_deref(), Some("max_tokens"));
    let err = e(json!({"max_tokens": 3, "messages": user, "stop_sequences": [""]}));
    assert_eq!(err.param.as_deref(), Some("stop_sequences"), "{err:?}");
    assert!(err.message.starts_with("stop_sequences:"), "{err:?}");
    let image = json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]);
    assert_eq!(e(json!({"max_tokens": 3, "messages": image})).param.as_deref(), Some("messages.0.content.0"));
    let server_tool = json!([{"type": "web_search_20250305", "name": "web_search"}]);
    assert_eq!(
        e(json!({"max_tokens": 3, "messages": user, "tools": server_tool})).param.as_deref(),
        Some("tools.0.type")
    );
    assert_eq!(e(json!({"max_tokens": 3, "messages": user, "temperature": 1.5})).param.as_deref(), Some("temperature"));
    assert_eq!(
        e(json!({"max_tokens": 3, "messages": user, "tool_choice": {"type": "any"}})).param.as_deref(),
        Some("tool_choice")
    );
    assert_eq!(e(json!({"max_tokens": 3, "messages": user, "container": "x"})).param.as_deref(), Some("container"));
    assert_eq!(e(json!({"max_tokens": 3, "messages": user, "bogus": 1})).param.as_deref(), Some("bogus"));
    let format = json!({"format": {"type": "text"}});
    assert_eq!(
        e(json!({"max_tokens": 3, "messages": user, "output_config": format})).param.as_deref(),
        Some("output_config.format")
    );
    // Fields inside a schema, named as this API names them.
    let schema = json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "a{5,2}"}}});
    let format = json!({"format": {"type": "json_schema", "schema": schema}});
    let err = e(json!({"max_tokens": 3, "messages": user, "output_config": format}));
    assert_eq!(err.param.as_deref(), Some("output_config.format.schema"), "{err:?}");
    assert!(err.message.starts_with("output_config.format.schema.properties.a.pattern"), "{err:?}");
    let tools = json!([{"name": "ok", "input_schema": {"type": "object"}}, {"name": "f", "input_schema": schema}]);
    let err = e(json!({"max_tokens": 3, "messages": user, "tools": tools}));
    assert_eq!(err.param.as_deref(), Some("tools.1.input_schema"), "{err:?}");
    assert!(err.message.starts_with("tools.1.input_schema.properties.a.pattern"), "{err:?}");
    let recursive = json!({"format": {"type": "json_schema", "schema": {"$ref": "#"}}});
    let err = e(json!({"max_tokens": 3, "messages": user, "output_config": recursive}));
    assert!(err.message.starts_with("output_config.format.schema.$ref: \"#\" cannot become a grammar"), "{err:?}");
}

#[test]
fn a_named_tool_is_forced_and_thinking_switches_map() {
    let tools =
        json!([{"name": "w", "input_schema": {"type": "object"}}, {"name": "t", "input_schema": {"type": "object"}}]);
    let (_, r) = chat(json!({"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
        "tool_choice": {"type": "tool", "name": "t"}, "thinking": {"type": "disabled"}}))
    .unwrap();
    let PromptInput::Chat(c) = &r.prompt else { panic!() };
    assert_eq!(c.tool_choice, ggml_sys::ToolChoice::Required);
    assert_eq!(c.tools.as_ref().unwrap().as_array().unwrap().len(), 1);
    assert!(!c.enable_thinking && c.parallel_tool_calls);
}
