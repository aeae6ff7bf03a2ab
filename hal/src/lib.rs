//! Board facts for sluice: CPUs, thread pinning and memory (more of the board — storage,
//! thermal — lands here as the runtime needs it). Pure Linux, no llama.cpp, no `unsafe`.
#![forbid(unsafe_code)]

pub mod cpu;
pub mod memory;
pub mod storage;
