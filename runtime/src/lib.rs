//! sluice: runs Mixture-of-Experts language models bigger than a board's RAM.
//!
//! This crate is the runtime behind the `sluice` binary: synthetic model generation
//! ([`synth`]), text generation ([`generate`]), the streaming engine ([`stream`]), board
//! profiles ([`board`]), the memory ledger ([`budget`]), the HTTP service ([`serve`]), several
//! boards serving one model over RPC ([`scaleout`]), terminal-safe output ([`text`]), checksums
//! for storage that rots ([`checksums`]), the small state files ([`framed`]) and the
//! out-of-the-box demo ([`demo`]). llama.cpp is reached only through `ggml-sys`.
#![forbid(unsafe_code)]

pub mod bench;
pub mod board;
pub mod budget;
pub mod checksums;
pub mod demo;
pub mod framed;
pub mod generate;
pub mod lossy;
pub mod metadata;
pub mod scaleout;
pub mod serve;
pub mod stream;
pub mod synth;
pub mod telemetry;
pub mod text;
