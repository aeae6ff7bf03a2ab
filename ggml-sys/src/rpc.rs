//! ggml's RPC backend (vendor patch 0007): a worker board serves its CPU device over TCP
//! ([`serve`]), and a head loads some of a model's layers onto the workers it is connected to
//! ([`RpcDevice`], [`crate::ModelParams::rpc`]). The patch turns the client's aborts (connection
//! refused, a server that goes away) into a "lost" state this module reports as an [`Error`].

use std::ffi::{c_char, c_void, CString};
use std::fmt;
use std::path::Path;

use llama_cpp_sys_2 as sys;

use crate::{Error, Result};

unsafe extern "C" {
    fn sluice_rpc_connect(endpoint: *const c_char) -> sys::ggml_backend_dev_t;
    fn sluice_rpc_memory(endpoint: *const c_char, free: *mut u64, total: *mut u64) -> bool;
    fn sluice_rpc_serve(
        endpoint: *const c_char,
        cache_dir: *const c_char,
        n_threads: usize,
        max_alloc: usize,
        on_listening: Option<unsafe extern "C" fn(*mut c_void)>,
        user: *mut c_void,
    ) -> bool;
    fn ggml_backend_rpc_server_lost(endpoint: *const c_char) -> bool;
}

/// An RPC server's device this process is connected to: a worker board lending its memory and
/// cores. Cloning shares the same device (ggml keeps one per endpoint for the process).
#[derive(Clone)]
pub struct RpcDevice {
    endpoint: String,
    c_endpoint: CString,
    dev: sys::ggml_backend_dev_t,
}

// SAFETY: the device is an entry of ggml's RPC registry, created once per endpoint and never
// freed or changed afterwards; ggml's RPC client serializes the requests on it.
unsafe impl Send for RpcDevice {}
// SAFETY: as above; &RpcDevice only reads the pointer and the endpoint.
unsafe impl Sync for RpcDevice {}

impl fmt::Debug for RpcDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RpcDevice").field("endpoint", &self.endpoint).finish()
    }
}

/// `host:port` as a C string, or the error naming it.
fn c_endpoint(endpoint: &str) -> Result<CString> {
    CString::new(endpoint).map_err(|e| Error::TextNul(e.nul_position()))
}

impl RpcDevice {
    /// Connects to the ggml RPC server at `endpoint` (`host:port`, IPv4 or a resolvable name).
    pub fn connect(endpoint: &str) -> Result<RpcDevice> {
        crate::init();
        let c = c_endpoint(endpoint)?;
        // SAFETY: c is NUL-terminated and outlives the call; the shim catches exceptions.
        let dev = unsafe { sluice_rpc_connect(c.as_ptr()) };
        let reason = match crate::shim::caught("ggml_backend_rpc_add_server") {
            Err(Error::Exception { message, .. }) => message,
            Err(e) => e.to_string(),
            Ok(()) => String::new(),
        };
        if dev.is_null() {
            return Err(Error::RpcConnect { endpoint: endpoint.into(), reason });
        }
        Ok(RpcDevice { endpoint: endpoint.into(), c_endpoint: c, dev })
    }

    /// The `host:port` this device is served at.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The server's free and total memory in bytes. A sluice worker reports its budget as the
    /// total and what is left of it as free. Reconnects when the last connection was lost.
    pub fn memory(&self) -> Result<(u64, u64)> {
        let (mut free, mut total) = (0u64, 0u64);
        // SAFETY: the endpoint is NUL-terminated; free and total are writable u64s.
        let ok = unsafe { sluice_rpc_memory(self.c_endpoint.as_ptr(), &mut free, &mut total) };
        let caught = crate::shim::caught("ggml_backend_rpc_get_device_memory");
        if !ok || caught.is_err() {
            return Err(Error::RpcLost { endpoint: self.endpoint.clone() });
        }
        Ok((free, total))
    }

    /// Whether the connection to this server was lost (the server went away or answered
    /// malformed): every request since completed without effect.
    pub fn lost(&self) -> bool {
        // SAFETY: the endpoint is NUL-terminated; the call only looks up a map under a mutex.
        unsafe { ggml_backend_rpc_server_lost(self.c_endpoint.as_ptr()) }
    }

    /// The ggml device, for the model parameters.
    pub(crate) fn raw(&self) -> sys::ggml_backend_dev_t {
        self.dev
    }
}

/// `Err` naming the first of `devices` whose connection was lost.
pub(crate) fn check_connected(devices: &[RpcDevice]) -> Result<()> {
    match devices.iter().find(|d| d.lost()) {
        Some(d) => Err(Error::RpcLost { endpoint: d.endpoint.clone() }),
        None => Ok(()),
    }
}

/// The most RPC servers a model may use (ggml's `GGML_RPC_MAX_SERVERS`).
pub const MAX_RPC_SERVERS: usize = 16;

/// What [`serve`] calls once its socket listens.
type OnListening<'a> = Option<Box<dyn FnOnce() + 'a>>;

unsafe extern "C" fn listening_trampoline(user: *mut c_void) {
    // SAFETY: `user` is the &mut OnListening that `serve` passed, alive for the whole call.
    let slot = unsafe { &mut *(user as *mut OnListening<'_>) };
    if let Some(f) = slot.take() {
        // A panic must not unwind into C++: it is caught and the server goes on.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    }
}

/// Serves this process's CPU device over RPC at `endpoint` (`ipv4:port`) with `threads` compute
/// threads, each client allowed `max_alloc` bytes (its buffers beyond that are refused, and the
/// device reports the limit as its memory); weights sent before are taken from `cache_dir`
/// (ggml's tensor cache) instead of the network. Calls `on_listening` once the socket listens.
/// Returns only when the server cannot start.
pub fn serve(
    endpoint: &str,
    cache_dir: Option<&Path>,
    threads: usize,
    max_alloc: u64,
    on_listening: impl FnOnce(),
) -> Result<std::convert::Infallible> {
    crate::init();
    let c = c_endpoint(endpoint)?;
    let cache = match cache_dir {
        Some(d) => Some(CString::new(d.as_os_str().as_encoded_bytes()).map_err(|_| Error::PathNul(d.into()))?),
        None => None,
    };
    let mut slot: OnListening<'_> = Some(Box::new(on_listening));
    let max = usize::try_from(max_alloc).unwrap_or(usize::MAX);
    // SAFETY: the strings are NUL-terminated and outlive the call; `slot` outlives it and the
    // trampoline is the only user of the pointer; the shim catches exceptions.
    let _ = unsafe {
        sluice_rpc_serve(
            c.as_ptr(),
            cache.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            threads.max(1),
            max,
            Some(listening_trampoline),
            &mut slot as *mut OnListening<'_> as *mut c_void,
        )
    };
    crate::shim::caught("ggml_backend_rpc_serve")?;
    Err(Error::RpcServe { endpoint: endpoint.into() })
}
