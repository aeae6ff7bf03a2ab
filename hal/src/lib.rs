//! Board facts for sluice: identity, CPU topology and pinning, storage, memory and cgroups,
//! thermal state. Every probe reads under a [`root::SysRoot`] (`/` on a board, a fake tree in
//! tests). Pure Linux, no llama.cpp, no `unsafe`.
#![forbid(unsafe_code)]

pub mod board;
pub mod cgroup;
pub mod contention;
pub mod cpu;
pub mod cpulist;
pub mod file;
pub mod memory;
pub mod probe;
pub mod root;
pub mod storage;
pub mod thermal;
pub mod usage;
