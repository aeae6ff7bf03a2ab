//! Board facts for sluice: CPUs and thread pinning (more of the board — storage, memory,
//! thermal — lands here as the runtime needs it). Pure Linux, no llama.cpp, no `unsafe`.
#![forbid(unsafe_code)]

pub mod cpu;
