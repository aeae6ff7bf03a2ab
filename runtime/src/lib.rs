//! sluice: runs Mixture-of-Experts language models bigger than a board's RAM.
//!
//! This crate is the runtime behind the `sluice` binary. Its modules are layered (each uses only
//! the layers below it; `docs/architecture.md` draws them): foundations ([`text`], [`units`],
//! [`framed`], [`lossy`]); the model file ([`metadata`]); generation over llama.cpp
//! ([`generate`]); the streaming engine ([`stream`], its verified reads included); the board
//! ([`board`]), the memory ledger ([`budget`]) and several boards over RPC ([`scaleout`]); the
//! one door for a streamed run ([`launch`]) and the reports ([`telemetry`]); the front ends (the
//! HTTP service [`serve`], the benchmark [`bench`]); and the synthetic models ([`synth`],
//! [`demo`]). llama.cpp is reached only through `ggml-sys`.
#![forbid(unsafe_code)]

pub mod bench;
pub mod board;
pub mod budget;
pub mod demo;
pub mod dirs;
pub mod framed;
pub mod generate;
pub mod launch;
pub mod lossy;
pub mod metadata;
pub mod perplexity;
pub mod pull;
pub mod replay;
pub mod scaleout;
pub mod serve;
pub mod store;
pub mod stream;
pub mod synth;
pub mod systemd;
pub mod telemetry;
pub mod text;
pub mod units;
