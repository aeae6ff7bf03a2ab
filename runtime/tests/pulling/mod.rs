//! The hosts `sluice pull`'s tests fetch from.

pub mod hosts;
