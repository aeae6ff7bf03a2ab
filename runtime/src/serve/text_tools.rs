//! The HTTP front's questions about text, answered by the loaded model's tokenizer and chat
//! template on the prompt thread (so they wait behind no generation): tokenize, detokenize, a
//! chat rendered by the template, and a chat's prompt tokens (`/tokenize`, `/detokenize`,
//! `/apply-template`, `/v1/messages/count_tokens`).

use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;

use ggml_sys::{ChatInputs, ChatTemplates, Model, Token};
use tokio::sync::oneshot;

use super::error::ApiError;
use super::job::PromptBound;
use super::prompt::ThreadJob;

/// A question about text.
#[derive(Debug)]
pub enum Question {
    /// `text`'s tokens (with BOS when `add_special`; control tokens' text parsed when
    /// `parse_special`), each with its bytes.
    Tokenize {
        /// The text.
        text: String,
        /// Whether BOS (and the like) is added.
        add_special: bool,
        /// Whether control tokens' text is read as those tokens.
        parse_special: bool,
    },
    /// The text of `tokens` (control tokens written out).
    Detokenize(Vec<Token>),
    /// The prompt the template renders for a chat.
    Render(Box<ChatInputs>),
    /// The tokens of the prompt the template renders for a chat.
    CountChat(Box<ChatInputs>),
}

/// An answer.
#[derive(Debug, PartialEq)]
pub enum Answer {
    /// Tokens and their bytes.
    Tokens(Vec<(Token, Vec<u8>)>),
    /// Text.
    Text(String),
    /// A number of tokens.
    Count(usize),
}

/// A question, the bound a rendered prompt keeps, and where its answer goes.
pub(super) type ToolJob = (Question, PromptBound, oneshot::Sender<Result<Answer, ApiError>>);

/// Asks the prompt thread of the loaded model.
#[derive(Debug, Clone)]
pub struct TextTools {
    jobs: Sender<ThreadJob>,
}

impl TextTools {
    pub(super) fn new(jobs: Sender<ThreadJob>) -> TextTools {
        TextTools { jobs }
    }

    /// The answer to `question`; a chat whose rendering is over `bound` is refused untokenized.
    pub async fn ask(&self, question: Question, bound: PromptBound) -> Result<Answer, ApiError> {
        let gone = || ApiError::new(503, "server_error", "the model is being loaded again; retry shortly");
        let (tx, rx) = oneshot::channel();
        self.jobs.send(ThreadJob::Tool((question, bound, tx))).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

/// Answers `question` with `model`'s vocabulary and `templates`.
pub(super) fn answer(
    model: &Model,
    templates: &ChatTemplates,
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
        let prompt = templates.apply(inputs).map(|(p, _)| p.prompt).map_err(|e| {
            ApiError::invalid(format!("the model's chat template cannot take these messages: {e}"), Some("messages"))
        })?;
        bound.check_rendered(prompt.len())?;
        Ok::<_, ApiError>(prompt)
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
        Question::Render(inputs) => render(&inputs).map(Answer::Text),
        Question::CountChat(inputs) => {
            let prompt = render(&inputs)?;
            Ok(Answer::Count(tokenize(&prompt, true, true, "messages")?.len()))
        }
    }
}
