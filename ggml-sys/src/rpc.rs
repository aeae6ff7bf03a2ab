//! ggml's RPC backend (vendor patch 0007): a worker board serves its CPU device over TCP
//! ([`serve`]), and a head loads some of a model's layers onto the workers it is connected to
//! ([`RpcDevice`], [`crate::ModelParams::rpc`]). The patch turns the client's aborts (connection
//! refused, a server that goes away) into a "lost" state this module reports as an [`Error`].

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::mem::ManuallyDrop;
use std::net::TcpStream;
use std::os::fd::FromRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use llama_cpp_sys_2 as sys;

use crate::{Error, Result};

unsafe extern "C" {
    fn sluice_rpc_connect(endpoint: *const c_char) -> sys::ggml_backend_dev_t;
    fn sluice_rpc_memory(endpoint: *const c_char, free: *mut u64, total: *mut u64) -> bool;
    fn sluice_rpc_serve(
        endpoint: *const c_char,
        cache_dir: *const c_char,
        n_threads: usize,
        opts: *const RawServerOpts,
    ) -> bool;
    fn ggml_backend_rpc_set_client_opts(opts: *const RawClientOpts);
    fn ggml_backend_rpc_server_lost(endpoint: *const c_char) -> bool;
}

/// `struct ggml_backend_rpc_server_opts` (ggml-rpc.h, vendor patch 0009).
#[repr(C)]
struct RawServerOpts {
    max_alloc: usize,
    max_buffers: usize,
    cache_max_bytes: u64,
    max_graph: usize,
    on_accept: Option<unsafe extern "C" fn(c_int, *mut c_void) -> bool>,
    on_listening: Option<unsafe extern "C" fn(*mut c_void)>,
    user: *mut c_void,
}

/// `struct ggml_backend_rpc_client_opts` (ggml-rpc.h, vendor patch 0009).
#[repr(C)]
struct RawClientOpts {
    connect_timeout_ms: c_int,
    call_timeout_ms: c_int,
    on_connect: Option<unsafe extern "C" fn(c_int, *const c_char, *mut c_void) -> bool>,
    user: *mut c_void,
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
            if let Some(reason) = take_refusal(endpoint) {
                return Err(Error::RpcRefused { endpoint: endpoint.into(), reason });
            }
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

/// What a worker allows each client, and how it treats connections.
pub struct ServeOptions<'a> {
    /// Bytes each client may allocate (its buffers beyond are refused, and the device reports
    /// the limit as its memory); also the largest message a client may send.
    pub max_alloc: u64,
    /// Buffers each client may hold at once.
    pub max_buffers: usize,
    /// Bytes the tensor cache may hold on disk (the oldest files go first).
    pub cache_max_bytes: u64,
    /// Bytes a graph to compute may take on the worker, its message and ggml's structures for
    /// it; a larger one is refused before anything is allocated for it.
    pub max_graph: u64,
    /// Called with each accepted connection before anything is read from it, on a thread of its
    /// own (connections identify themselves at the same time): `false` closes it (not an allowed
    /// peer, or its handshake failed).
    pub on_accept: Box<dyn Fn(&TcpStream) -> bool + Send + Sync + 'a>,
    /// Called once the socket listens.
    pub on_listening: Box<dyn FnOnce() + Send + 'a>,
}

/// The hooks [`serve`] hands to C through `user`, shared by the threads that admit connections.
struct ServeHooks<'a> {
    on_accept: Box<dyn Fn(&TcpStream) -> bool + Send + Sync + 'a>,
    on_listening: Mutex<Option<Box<dyn FnOnce() + Send + 'a>>>,
}

/// `fd` as a stream for the duration of a hook, never closed by Rust.
fn borrowed_stream(fd: c_int) -> ManuallyDrop<TcpStream> {
    // SAFETY: ggml's RPC server or client owns the connected socket `fd` for the whole call of
    // the hook; ManuallyDrop keeps Rust from closing it, and the stream does not outlive the hook.
    ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) })
}

unsafe extern "C" fn listening_trampoline(user: *mut c_void) {
    // SAFETY: `user` is the ServeHooks that `serve` passed, alive for the whole call (which never
    // returns once the server listens); it is only ever borrowed shared, and its parts are Sync.
    let hooks = unsafe { &*(user as *const ServeHooks<'_>) };
    let once = hooks.on_listening.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(f) = once {
        // A panic must not unwind into C++: it is caught and the server goes on.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    }
}

unsafe extern "C" fn accept_trampoline(fd: c_int, user: *mut c_void) -> bool {
    // SAFETY: as in listening_trampoline; ggml calls this from several admitting threads at once,
    // which the shared borrow and the hook's Sync bound allow.
    let hooks = unsafe { &*(user as *const ServeHooks<'_>) };
    let stream = borrowed_stream(fd);
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (hooks.on_accept)(&stream))).unwrap_or(false)
}

/// Serves this process's CPU device over RPC at `endpoint` (`ipv4:port`) with `threads` compute
/// threads under `opts` (vendor patch 0009 checks every command against its tensors and
/// buffers); weights sent before are taken from `cache_dir` (ggml's tensor cache, each file
/// checked against its hash) instead of the network. Connections identify themselves at the same
/// time (at most 8 from one address, 64 in all, each within 10 s); the identified are served one
/// at a time, and one idle for 5 s gives way to one that waits. Returns only when the server
/// cannot start.
pub fn serve(
    endpoint: &str,
    cache_dir: Option<&Path>,
    threads: usize,
    opts: ServeOptions<'_>,
) -> Result<std::convert::Infallible> {
    crate::init();
    let c = c_endpoint(endpoint)?;
    let cache = match cache_dir {
        Some(d) => Some(CString::new(d.as_os_str().as_encoded_bytes()).map_err(|_| Error::PathNul(d.into()))?),
        None => None,
    };
    let hooks = ServeHooks { on_accept: opts.on_accept, on_listening: Mutex::new(Some(opts.on_listening)) };
    let raw = RawServerOpts {
        max_alloc: usize::try_from(opts.max_alloc).unwrap_or(usize::MAX),
        max_buffers: opts.max_buffers,
        cache_max_bytes: opts.cache_max_bytes,
        max_graph: usize::try_from(opts.max_graph).unwrap_or(usize::MAX),
        on_accept: Some(accept_trampoline),
        on_listening: Some(listening_trampoline),
        user: &hooks as *const ServeHooks<'_> as *mut c_void,
    };
    // SAFETY: the strings are NUL-terminated and outlive the call; `hooks` outlives it and the
    // trampolines are the only users of its pointer; the shim catches exceptions.
    let _ = unsafe {
        sluice_rpc_serve(c.as_ptr(), cache.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()), threads.max(1), &raw)
    };
    crate::shim::caught("ggml_backend_rpc_serve")?;
    Err(Error::RpcServe { endpoint: endpoint.into() })
}

/// What this process does with each new connection to a worker, before ggml's handshake: the
/// stream and the endpoint; an error (why the worker or this head refused the other) fails the
/// connection, and a failed [`RpcDevice::connect`] then reports it.
pub type ConnectHook = dyn Fn(&TcpStream, &str) -> std::result::Result<(), String> + Send + Sync;

/// The hook every new connection runs (set by [`set_client_options`]).
static CONNECT_HOOK: RwLock<Option<Arc<ConnectHook>>> = RwLock::new(None);

/// The last refusal the hook gave each endpoint, until a connect reports it.
static REFUSALS: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// Records why the hook refused a connection to `endpoint`.
fn record_refusal(endpoint: &str, reason: String) {
    let mut r = REFUSALS.lock().unwrap_or_else(|e| e.into_inner());
    r.retain(|(e, _)| e != endpoint);
    r.push((endpoint.to_string(), reason));
}

/// Why the hook last refused a connection to `endpoint`, if it did (taken: reported once).
fn take_refusal(endpoint: &str) -> Option<String> {
    let mut r = REFUSALS.lock().unwrap_or_else(|e| e.into_inner());
    let i = r.iter().position(|(e, _)| e == endpoint)?;
    Some(r.remove(i).1)
}

unsafe extern "C" fn connect_trampoline(fd: c_int, endpoint: *const c_char, _user: *mut c_void) -> bool {
    let hook = CONNECT_HOOK.read().unwrap_or_else(|e| e.into_inner()).clone();
    let Some(hook) = hook else { return true };
    // SAFETY: ggml passes the endpoint it connects to, NUL-terminated, alive for the call.
    let endpoint = unsafe { CStr::from_ptr(endpoint) }.to_string_lossy().into_owned();
    let stream = borrowed_stream(fd);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&stream, &endpoint)))
        .unwrap_or_else(|_| Err("the connection hook panicked".into()));
    match outcome {
        Ok(()) => true,
        Err(reason) => {
            record_refusal(&endpoint, reason);
            false
        }
    }
}

/// Sets how this process connects to RPC workers from now on: a connect that gets no answer
/// within `connect_timeout` fails, as does any send or wait for an answer longer than
/// `call_timeout` (the connection is then lost: its requests, those of a decode running on it
/// included, complete at once without effect until [`RpcDevice::connect`] or
/// [`RpcDevice::memory`] connects anew, so one silent worker costs one bound, not one per request);
/// `on_connect` runs on each new connection before ggml's handshake.
pub fn set_client_options(connect_timeout: Duration, call_timeout: Duration, on_connect: Option<Arc<ConnectHook>>) {
    crate::init();
    *CONNECT_HOOK.write().unwrap_or_else(|e| e.into_inner()) = on_connect;
    let ms = |d: Duration| c_int::try_from(d.as_millis()).unwrap_or(c_int::MAX);
    let opts = RawClientOpts {
        connect_timeout_ms: ms(connect_timeout),
        call_timeout_ms: ms(call_timeout),
        on_connect: Some(connect_trampoline),
        user: std::ptr::null_mut(),
    };
    // SAFETY: ggml copies the options; the trampoline is a plain function reading a static.
    unsafe { ggml_backend_rpc_set_client_opts(&opts) };
}
