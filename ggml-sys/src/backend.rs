//! Process-wide llama.cpp initialization and log routing.

use std::cell::Cell;
use std::ffi::{c_char, c_void, CStr};
use std::sync::Once;

use llama_cpp_sys_2 as sys;

static INIT: Once = Once::new();

/// Initializes llama.cpp's backends once per process and routes its log (and ggml's) into the
/// `log` crate under the target `llama`: errors and warnings keep their level, llama.cpp's
/// chatty info lines become `debug`, its debug lines `trace`. Every wrapper that needs llama.cpp
/// calls this; calling it again is free.
pub fn init() {
    INIT.call_once(|| {
        // SAFETY: `log_trampoline` matches ggml_log_callback and is valid for the whole process;
        // the user data pointer is unused (NULL).
        unsafe { sys::llama_log_set(Some(log_trampoline), std::ptr::null_mut()) };
        // SAFETY: llama_backend_init has no preconditions; the Once runs it exactly once.
        unsafe { sys::llama_backend_init() };
        // SAFETY: abort_trampoline matches ggml_abort_callback_t and lives for the whole process.
        unsafe { sys::ggml_set_abort_callback(Some(abort_trampoline)) };
    });
}

/// ggml's last word before it aborts (a failed GGML_ASSERT): logged as an error, in place of
/// ggml's own backtrace, which would try to attach a debugger.
unsafe extern "C" fn abort_trampoline(message: *const c_char) {
    let text = if message.is_null() {
        String::new()
    } else {
        // SAFETY: ggml passes its NUL-terminated message buffer.
        unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
    };
    let _ = std::panic::catch_unwind(|| {
        if log::log_enabled!(target: "llama", log::Level::Error) {
            log::error!(target: "llama", "llama.cpp aborted: {text}");
        } else {
            eprintln!("error: llama.cpp aborted: {text}");
        }
    });
}

/// Ends the process at once with `code`, without running exit handlers or C++ static
/// destructors: for leaving while another thread is still inside llama.cpp (loading a model
/// from slow storage, say), whose process-wide state those destructors would tear down under it.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit has no preconditions; it never returns.
    unsafe { libc::_exit(code) }
}

/// llama.cpp's one-line report of the compiled CPU features (`NEON = 1 | DOTPROD = 1 | ...`).
pub fn system_info() -> String {
    init();
    // SAFETY: returns a pointer to a static, NUL-terminated buffer owned by llama.cpp.
    let p = unsafe { sys::llama_print_system_info() };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: p is non-null and NUL-terminated (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().trim().to_string()
}

thread_local! {
    /// The level of the last line logged on this thread, for llama.cpp's CONT (continuation) lines.
    static LAST_LEVEL: Cell<log::Level> = const { Cell::new(log::Level::Debug) };
}

fn map_level(level: sys::ggml_log_level) -> log::Level {
    match level {
        sys::GGML_LOG_LEVEL_ERROR => log::Level::Error,
        sys::GGML_LOG_LEVEL_WARN => log::Level::Warn,
        sys::GGML_LOG_LEVEL_INFO => log::Level::Debug,
        sys::GGML_LOG_LEVEL_CONT => LAST_LEVEL.with(Cell::get),
        _ => log::Level::Trace,
    }
}

unsafe extern "C" fn log_trampoline(level: sys::ggml_log_level, text: *const c_char, _ud: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string valid for the duration of the call.
    let msg = unsafe { CStr::from_ptr(text) };
    // A panic (a logger that fails) must not unwind into C.
    let _ = std::panic::catch_unwind(|| {
        let level = map_level(level);
        LAST_LEVEL.with(|l| l.set(level));
        if !log::log_enabled!(target: "llama", level) {
            return;
        }
        let msg = msg.to_string_lossy();
        let msg = msg.trim_end();
        if !msg.is_empty() {
            log::log!(target: "llama", level, "{msg}");
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn system_info_names_cpu_features() {
        let info = super::system_info();
        assert!(info.contains("CPU"), "unexpected system info: {info}");
    }
}
