//! systemd: the service manager's notifications (`sd_notify`: ready, status, watchdog,
//! stopping) that `sluice serve` and `sluice worker` send, and the drop-ins `sluice unit` writes
//! for a board.

pub mod notify;
pub mod unit;

/// The name of the API key credential (`LoadCredential=`) and of the key file in the
/// credentials and state directories.
pub const KEY_FILE: &str = "api-key";
