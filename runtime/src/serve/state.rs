//! The server's life cycle, as `/health` and `/metrics` report it.

/// The server's life cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Loading the model; generation requests get 503.
    Loading,
    /// Serving.
    Ready,
    /// Stopping: in-flight requests finish, new ones get 503.
    Draining,
    /// An RPC worker is gone: requests get 503 until it is back and the model is loaded again.
    Degraded,
}

impl State {
    /// Every state, as `/metrics` lists them.
    pub const ALL: [State; 4] = [State::Loading, State::Ready, State::Draining, State::Degraded];

    /// The name `/health` and `/metrics` report.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Loading => "loading",
            State::Ready => "ready",
            State::Draining => "draining",
            State::Degraded => "degraded",
        }
    }
}
