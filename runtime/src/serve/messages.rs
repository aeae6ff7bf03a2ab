//! What the HTTP front asks of the engine beside generations ([`crate::serve::job`]): the
//! questions about text the prompt thread answers (`/tokenize`, `/detokenize`,
//! `/apply-template`, `/v1/messages/count_tokens`), and llama-server's slot actions, which the
//! engine runs between its steps. Both sides read this file; neither imports the other for it.

use std::sync::{Arc, Mutex};

use ggml_sys::{ChatInputs, Token};
use serde_json::Value;
use tokio::sync::oneshot;

use super::error::ApiError;
use super::job::PromptBound;

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
pub type ToolJob = (Question, PromptBound, oneshot::Sender<Result<Answer, ApiError>>);

/// Asks the prompt thread of the loaded model: hands it a [`ToolJob`] (false once that thread
/// has ended).
#[derive(Clone)]
pub struct TextTools {
    send: Arc<dyn Fn(ToolJob) -> bool + Send + Sync>,
}

impl std::fmt::Debug for TextTools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TextTools")
    }
}

impl TextTools {
    /// Asks by handing each question to `send`, which says whether the prompt thread took it.
    pub fn new(send: impl Fn(ToolJob) -> bool + Send + Sync + 'static) -> TextTools {
        TextTools { send: Arc::new(send) }
    }

    /// The answer to `question`; a chat whose rendering is over `bound` is refused untokenized.
    pub async fn ask(&self, question: Question, bound: PromptBound) -> Result<Answer, ApiError> {
        let gone = || ApiError::new(503, "server_error", "the model is being loaded again; retry shortly");
        let (tx, rx) = oneshot::channel();
        if !(self.send)((question, bound, tx)) {
            return Err(gone());
        }
        rx.await.map_err(|_| gone())?
    }
}

/// What a client asks of a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotAction {
    /// Write it to the saved slots.
    Save,
    /// Read this saved slot back into it.
    Restore(String),
    /// Empty it.
    Erase,
}

/// An action on slot `slot`, and where its answer goes.
#[derive(Debug)]
pub struct SlotRequest {
    /// The slot.
    pub slot: u32,
    /// What is asked of it.
    pub action: SlotAction,
    /// Where the answer goes.
    pub reply: oneshot::Sender<Result<Value, ApiError>>,
}

/// The actions asked and not run yet.
#[derive(Debug, Default)]
pub struct SlotActions(Mutex<Vec<SlotRequest>>);

impl SlotActions {
    /// Asks for `action` on `slot`; the answer comes when the engine has run it.
    pub fn ask(&self, slot: u32, action: SlotAction) -> oneshot::Receiver<Result<Value, ApiError>> {
        let (reply, answer) = oneshot::channel();
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(SlotRequest { slot, action, reply });
        answer
    }

    /// Whether actions wait to be run.
    pub fn pending(&self) -> bool {
        !self.0.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// The actions asked since the last take, in the order asked.
    pub fn take(&self) -> Vec<SlotRequest> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
