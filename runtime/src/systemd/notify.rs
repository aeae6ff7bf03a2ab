//! systemd's notification protocol (`Type=notify`): a datagram to `$NOTIFY_SOCKET` per state
//! change. Without the variable (not started by systemd) every call does nothing.

use std::time::Duration;

use sd_notify::NotifyState;

fn send(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        log::warn!("cannot notify systemd ({}): {e}", std::env::var("NOTIFY_SOCKET").unwrap_or_default());
    }
}

/// `STATUS=` plus `EXTEND_TIMEOUT_USEC=`: a loading step that may take up to `allow`.
pub fn loading(status: &str, allow: Duration) {
    send(&[
        NotifyState::Status(status),
        NotifyState::ExtendTimeoutUsec(allow.as_micros().min(u32::MAX as u128) as u32),
    ]);
}

/// `READY=1` with a status line.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// `STOPPING=1` with a status line.
pub fn stopping(status: &str) {
    send(&[NotifyState::Stopping, NotifyState::Status(status)]);
}

/// `STATUS=` alone.
pub fn status(status: &str) {
    send(&[NotifyState::Status(status)]);
}

/// `WATCHDOG=1`.
pub fn watchdog() {
    send(&[NotifyState::Watchdog]);
}

/// The watchdog interval systemd asks for (`WatchdogSec=`), if any.
pub fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled()
}
