//! The expert-ready hook (vendor patch 0004): a wait point inside the CPU `mul_mat_id` kernel,
//! called by every compute thread right before it uses one routed expert's weights. The
//! streaming engine's hook blocks until that expert's slice has been read, so experts already in
//! memory are computed while the others are still arriving.
//!
//! ggml has one hook slot per process. This module fills it once with a dispatcher and keeps a
//! registry of the installed hooks, so several overlapped sessions (each with its own model) can
//! coexist: every hook is offered every call and must ignore tensors that are not its own.

use crate::{Result, TensorView};

/// The hook: an expert weight tensor and the expert about to be used. Called concurrently from
/// every compute thread; it may block, and must return (bound every wait). A panic is caught and
/// logged, the kernel goes on, and [`ExpertHookGuard::take_panicked`] reports it so the decode
/// can be failed.
pub type ExpertReadyHook = Box<dyn Fn(TensorView<'_>, u32) + Send + Sync>;

/// Whether the linked ggml has the hook (built with vendor patch 0004).
pub const fn expert_hook_available() -> bool {
    cfg!(expert_ready_hook)
}

/// An installed hook; removed from the registry on drop.
pub struct ExpertHookGuard {
    #[cfg(expert_ready_hook)]
    id: u64,
    panicked: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

#[cfg(expert_ready_hook)]
mod imp {
    use std::ffi::c_void;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Once, RwLock};

    use llama_cpp_sys_2 as sys;

    use super::{ExpertHookGuard, ExpertReadyHook};
    use crate::{Result, TensorView};

    /// The installed hooks: id, hook, and the flag its panics set.
    type Hooks = Vec<(u64, ExpertReadyHook, Arc<AtomicBool>)>;
    static HOOKS: RwLock<Hooks> = RwLock::new(Vec::new());
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    static DISPATCHER: Once = Once::new();

    unsafe extern "C" fn dispatch(weights: *const sys::ggml_tensor, expert: i32, _ud: *mut c_void) {
        // SAFETY: ggml passes the live weight tensor of the mul_mat_id node being computed.
        let view = unsafe { TensorView::from_raw(weights) };
        let hooks = HOOKS.read().unwrap_or_else(|e| e.into_inner());
        for (_, hook, panicked) in hooks.iter() {
            if catch_unwind(AssertUnwindSafe(|| hook(view, expert.max(0) as u32))).is_err() {
                log::error!("expert-ready hook panicked at {} expert {expert}", view.name());
                panicked.store(true, Ordering::SeqCst);
            }
        }
    }

    pub(super) fn install(hook: ExpertReadyHook) -> Result<ExpertHookGuard> {
        crate::init();
        DISPATCHER.call_once(|| {
            // SAFETY: dispatch matches ggml_expert_ready_hook_t and lives for the whole process;
            // it is set once, before any overlapped graph computes, and never changed.
            unsafe { sys::ggml_cpu_set_expert_ready_hook(Some(dispatch), std::ptr::null_mut()) };
        });
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let panicked = Arc::new(AtomicBool::new(false));
        HOOKS.write().unwrap_or_else(|e| e.into_inner()).push((id, hook, Arc::clone(&panicked)));
        Ok(ExpertHookGuard { id, panicked })
    }

    pub(super) fn uninstall(id: u64) {
        HOOKS.write().unwrap_or_else(|e| e.into_inner()).retain(|(i, _, _)| *i != id);
    }
}

impl ExpertHookGuard {
    /// Installs `hook`. Fails when the build lacks the hook.
    pub fn install(hook: ExpertReadyHook) -> Result<ExpertHookGuard> {
        #[cfg(expert_ready_hook)]
        {
            imp::install(hook)
        }
        #[cfg(not(expert_ready_hook))]
        {
            drop(hook);
            Err(crate::Error::NoExpertHook)
        }
    }

    /// Whether the hook panicked since the last call: the decode it ran in must be failed.
    pub fn take_panicked(&self) -> bool {
        self.panicked.swap(false, std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for ExpertHookGuard {
    fn drop(&mut self) {
        #[cfg(expert_ready_hook)]
        imp::uninstall(self.id);
    }
}
