//! The HTTP front's questions about text ([`Question`]), answered on the prompt thread by the
//! loaded model's tokenizer and chat template.

use std::sync::atomic::AtomicBool;

use ggml_sys::{ChatInputs, ChatTemplates, Model};

use super::message_text::{self, ControlTexts, Rendered};
use crate::serve::error::ApiError;
use crate::serve::job::PromptBound;
use crate::serve::messages::{Answer, Question};

/// Answers `question` with `model`'s vocabulary and `templates` (message text keeping the
/// `controls` it carries as text).
pub(super) fn answer(
    model: &Model,
    templates: &ChatTemplates,
    controls: &ControlTexts,
    question: Question,
    bound: PromptBound,
) -> Result<Answer, ApiError> {
    let never = AtomicBool::new(false);
    let tokenize = |text: &str, add_special: bool, parse_special: bool, field: &str| {
        let tokens = if parse_special {
            model.tokenize_cancellable(text, add_special, true, &never)
        } else {
            model.tokenize_with(text, add_special, false)
        };
        tokens.map_err(|e| ApiError::invalid(format!("{field}: cannot be tokenized: {e}"), Some(field)))
    };
    let render = |inputs: &ChatInputs| {
        let rendered = message_text::render(templates, controls, inputs).map_err(|e| {
            ApiError::invalid(format!("the model's chat template cannot take these messages: {e}"), Some("messages"))
        })?;
        bound.check_rendered(rendered.prompt.prompt.len())?;
        Ok::<_, ApiError>(rendered)
    };
    match question {
        Question::Tokenize { text, add_special, parse_special } => {
            let tokens = tokenize(&text, add_special, parse_special, "content")?;
            Ok(Answer::Tokens(tokens.into_iter().map(|t| (t, model.token_piece_with(t, true))).collect()))
        }
        Question::Detokenize(tokens) => {
            let n_vocab = model.n_vocab();
            if let Some((i, t)) =
                tokens.iter().enumerate().find(|(_, t)| usize::try_from(**t).map_or(true, |t| t >= n_vocab))
            {
                let param = format!("tokens[{i}]");
                return Err(ApiError::invalid(
                    format!("{param}: {t} is not a token of this model (0 to {})", n_vocab.saturating_sub(1)),
                    Some(&param),
                ));
            }
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| model.token_piece_with(*t, true)).collect();
            Ok(Answer::Text(String::from_utf8_lossy(&bytes).into_owned()))
        }
        Question::Render(inputs) => render(&inputs).map(|r: Rendered| Answer::Text(r.prompt.prompt)),
        Question::CountChat(inputs) => {
            let tokens = render(&inputs)?
                .tokenize(model, &never)
                .map_err(|e| ApiError::invalid(format!("messages: cannot be tokenized: {e}"), Some("messages")))?;
            Ok(Answer::Count(tokens.len()))
        }
    }
}
