//! The open connections: their state, the cap on how many there are, and which one gives way
//! to a new client when the cap is reached.
//!
//! A connection is *in a request* from the moment hyper hands a request to the service until
//! its response body is sent or dropped. Connections that are not in a request can be evicted:
//! one waiting for a request head (a stalled or idle client) or lingering after its last
//! response. So can one whose client stalls inside its request for longer than
//! [`STALL_GRACE`]: still sending its body (a client on this network sends a body within
//! moments), or not reading its response. Idle ones go first, then stalled ones, the least
//! recently active first, so a flood of stalled sockets, heads or bodies, cannot keep a real
//! client out; when every connection is in a request and none stalls, a new one gets 503.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// How long a client may stall inside a request (sending its body, or reading its response)
/// before its connection may give way to a new one.
pub const STALL_GRACE: Duration = Duration::from_secs(2);

/// One open connection, as its supervisor, its transport and its requests see it.
#[derive(Debug)]
pub struct ConnState {
    epoch: Instant,
    /// Requests in progress (0 or 1 on HTTP/1.1).
    requests: AtomicUsize,
    /// When the connection last began or finished a request (ms after `epoch`).
    last_active_ms: AtomicU64,
    /// Since when a write has waited for the peer to read (ms after `epoch`); `u64::MAX`: none.
    write_blocked_ms: AtomicU64,
    /// Since when a request body has been read (ms after `epoch`); `u64::MAX`: none is.
    body_since_ms: AtomicU64,
    /// Asks the supervisor to close the connection.
    pub close: Notify,
}

impl ConnState {
    fn new(epoch: Instant) -> ConnState {
        ConnState {
            epoch,
            requests: AtomicUsize::new(0),
            last_active_ms: AtomicU64::new(epoch.elapsed().as_millis() as u64),
            write_blocked_ms: AtomicU64::new(u64::MAX),
            body_since_ms: AtomicU64::new(u64::MAX),
            close: Notify::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether a request is in progress.
    pub fn in_request(&self) -> bool {
        self.requests.load(Ordering::SeqCst) > 0
    }

    /// Marks a request in progress until the guard drops.
    pub fn begin_request(self: &Arc<Self>) -> RequestGuard {
        self.requests.fetch_add(1, Ordering::SeqCst);
        self.last_active_ms.store(self.now_ms(), Ordering::Relaxed);
        RequestGuard(Arc::clone(self))
    }

    /// A write is waiting for the peer to read.
    pub fn write_blocked(&self) {
        let now = self.now_ms();
        let _ = self.write_blocked_ms.compare_exchange(u64::MAX, now, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// A write went through.
    pub fn write_progressed(&self) {
        self.write_blocked_ms.store(u64::MAX, Ordering::Relaxed);
    }

    /// A request body is being read until the guard drops.
    pub fn reading_body(self: &Arc<Self>) -> BodyGuard {
        self.body_since_ms.store(self.now_ms(), Ordering::Relaxed);
        BodyGuard(Arc::clone(self))
    }

    /// How long since the time stored in `at` (zero when it holds `u64::MAX`: not now).
    fn since(&self, at: &AtomicU64) -> Duration {
        let since = at.load(Ordering::Relaxed);
        if since == u64::MAX {
            return Duration::ZERO;
        }
        Duration::from_millis(self.now_ms().saturating_sub(since))
    }

    /// How long a request body has been read (zero when none is).
    fn body_for(&self) -> Duration {
        self.since(&self.body_since_ms)
    }

    /// Whether the connection may give way to a new one: 0 idle, 1 stalled in a request for
    /// longer than [`STALL_GRACE`]; `None`: busy.
    fn eviction_class(&self) -> Option<u8> {
        if !self.in_request() {
            Some(0)
        } else if self.body_for() > STALL_GRACE || self.write_stalled_for() > STALL_GRACE {
            Some(1)
        } else {
            None
        }
    }

    /// How long the peer has left a write waiting (zero when none waits).
    pub fn write_stalled_for(&self) -> Duration {
        self.since(&self.write_blocked_ms)
    }
}

/// A request in progress on a connection; dropped when its response is sent or abandoned.
#[derive(Debug)]
pub struct RequestGuard(Arc<ConnState>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.last_active_ms.store(self.0.now_ms(), Ordering::Relaxed);
        self.0.requests.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request body being read; dropped when it is read or abandoned.
#[derive(Debug)]
pub struct BodyGuard(Arc<ConnState>);

impl Drop for BodyGuard {
    fn drop(&mut self) {
        self.0.body_since_ms.store(u64::MAX, Ordering::Relaxed);
    }
}

/// The open connections.
#[derive(Debug)]
pub struct Registry {
    epoch: Instant,
    cap: usize,
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<ConnState>>>,
}

/// Why a new connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

impl Registry {
    /// A registry that admits at most `cap` connections at once.
    pub fn new(cap: usize) -> Registry {
        Registry { epoch: Instant::now(), cap: cap.max(1), next: AtomicU64::new(0), open: Mutex::new(HashMap::new()) }
    }

    /// Connections in a request now.
    pub fn busy(&self) -> usize {
        self.open.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|c| c.in_request()).count()
    }

    /// Admits a connection, evicting the least recently active idle one (or else a stalled
    /// one) when the cap is reached; `Err(Full)` when every open connection is busy. The
    /// returned id is given back with [`Registry::remove`].
    pub fn admit(&self) -> Result<(u64, Arc<ConnState>), Full> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.len() >= self.cap {
            let victim = Self::least_active_idle(&open).ok_or(Full)?;
            if let Some(v) = open.remove(&victim) {
                v.close.notify_one();
            }
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState::new(self.epoch));
        open.insert(id, Arc::clone(&state));
        Ok((id, state))
    }

    /// Closes the least recently active connection that is idle (or else stalled), to free a
    /// file descriptor; whether there was one.
    pub fn evict_one(&self) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let Some(victim) = Self::least_active_idle(&open) else { return false };
        if let Some(v) = open.remove(&victim) {
            v.close.notify_one();
        }
        true
    }

    /// Forgets a closed connection.
    pub fn remove(&self, id: u64) {
        self.open.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    }

    fn least_active_idle(open: &HashMap<u64, Arc<ConnState>>) -> Option<u64> {
        open.iter()
            .filter_map(|(id, c)| Some((c.eviction_class()?, c.last_active_ms.load(Ordering::Relaxed), *id)))
            .min()
            .map(|(_, _, id)| id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_active_idle_connection_gives_way_and_busy_ones_never_do() {
        let r = Registry::new(3);
        let (a, sa) = r.admit().unwrap();
        let (_b, sb) = r.admit().unwrap();
        let (_c, sc) = r.admit().unwrap();
        let busy_b = sb.begin_request();
        // At the cap: `a` (idle, least recently active) is evicted and told to close.
        let (d, _sd) = r.admit().unwrap();
        assert_eq!(r.open.lock().unwrap().len(), 3);
        let closed = sa.close.notified();
        tokio::pin!(closed);
        assert!(futures_ready(closed.as_mut()), "the evicted connection was not told to close");
        r.remove(a); // its supervisor forgets it; nothing else changes
        assert_eq!(r.open.lock().unwrap().len(), 3);
        // Everything in a request: a new connection is refused.
        let _busy_c = sc.begin_request();
        let busy_d = r.open.lock().unwrap()[&d].begin_request();
        assert_eq!(r.admit().unwrap_err(), Full);
        assert!(!r.evict_one());
        drop(busy_d);
        assert!(r.evict_one());
        drop(busy_b);
    }

    #[test]
    fn a_request_whose_body_stalls_past_the_grace_gives_way() {
        let r = Registry::new(1);
        let (_a, sa) = r.admit().unwrap();
        let _busy = sa.begin_request();
        let body = sa.reading_body();
        assert_eq!(r.admit().unwrap_err(), Full, "a body just begun is not stalled");
        // Backdate the body's start past the grace.
        let grace = STALL_GRACE.as_millis() as u64 + 1;
        sa.body_since_ms.store(sa.now_ms().saturating_sub(grace), Ordering::Relaxed);
        if sa.now_ms() < grace {
            return; // the process is younger than the grace: nothing to backdate to
        }
        assert!(r.admit().is_ok(), "a stalled body kept a new client out");
        drop(body);
    }

    /// Whether a future is ready at its first poll.
    fn futures_ready<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> bool {
        let waker = std::task::Waker::noop();
        f.poll(&mut std::task::Context::from_waker(waker)).is_ready()
    }
}
