//! The commands of the `sluice` binary, one module each, and the argument groups they share.

pub mod args;
pub mod bench;
pub mod plan;
pub mod probe;
pub mod run;
pub mod synth;
