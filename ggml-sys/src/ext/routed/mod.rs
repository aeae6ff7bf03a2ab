//! The routed matrix product (`MUL_MAT_ID`) on the CPU, gated per expert, for extension kernels.
//!
//! [`mul_mat_id`] computes a `MUL_MAT_ID` node as ggml-cpu's own kernel does: the activations
//! converted to the weights' `vec_dot_type` with the CPU type traits' `from_float`, then one
//! `vec_dot` of a weight row and an activation row per output element. Its output is therefore
//! bit for bit the native one wherever [`reproduces_native`] holds. What it adds is the
//! schedule: each routed expert is computed as soon as an [`ExpertGate`] says its weights are in
//! memory, the experts already there first, and a thread that finds nothing ready blocks in the
//! gate instead of spinning.
//!
//! The workspace ([`mul_mat_id_workspace`], which a kernel's `prepare` reports so that ggml
//! allocates and accounts it) holds what the native kernel keeps in its work buffer (the
//! converted activations and the rows routed to each expert, here compacted to one entry per
//! routed slot) plus each expert's schedule state (its next chunk, whether it is ready, and how
//! many of its chunks are done: when the last is, the gate hears that the expert's weights are
//! no longer needed, so a caller may give their memory back before the product ends).

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Barrier, Mutex, OnceLock};

use llama_cpp_sys_2 as sys;

use super::kernel::{Execution, KernelError};
use crate::{GgmlType, TensorView};

mod shape;

use shape::{align, Shape, ALIGN, STATE_WORDS};

/// When the weights of each routed expert may be read.
pub trait ExpertGate: Sync {
    /// Whether expert `expert`'s weights are in memory now. Must not block for long; called
    /// from the compute threads.
    fn ready(&self, expert: u32) -> bool;

    /// Blocks until one of `pending` may have become ready (returning early is allowed). An
    /// error (the weights will not arrive) fails the product, and with it the graph.
    fn wait(&self, pending: &[u32]) -> Result<(), KernelError>;

    /// Expert `expert`'s part of the product is complete: this execution reads its weights no
    /// more. Called once per routed expert, from the compute thread that finished it.
    fn done(&self, _expert: u32) {}
}

/// Whether ggml-cpu computes a `MUL_MAT_ID` over `weights` with `tokens` activation columns by
/// per-element `vec_dot`, as [`mul_mat_id`] does. Not so where its tiled K-quant path may take
/// over (x86 builds with AVX, K- and IQ-quant weights, 8 or more rows routed to one expert,
/// which needs as many tokens): that path rounds differently.
pub fn reproduces_native(weights: GgmlType, tokens: i64) -> bool {
    let tiling = native_tiling();
    !(tiling.on && tiled_type(weights) && (tokens >= 8 || tiling.forced))
}

/// ggml-cpu's tiled path as this process has it: built (x86 with AVX) and switched on
/// (`GGML_CPU_TILED_MM`, default on), and forced even where unprofitable
/// (`GGML_CPU_TILED_MM_FORCE=1`). Read once, as ggml-cpu reads its switches.
struct Tiling {
    on: bool,
    forced: bool,
}

fn native_tiling() -> &'static Tiling {
    static TILING: OnceLock<Tiling> = OnceLock::new();
    TILING.get_or_init(|| {
        // SAFETY: plain queries of ggml-cpu's compile-time features.
        let x86 = unsafe {
            sys::ggml_cpu_has_avx() != 0 || sys::ggml_cpu_has_avx2() != 0 || sys::ggml_cpu_has_avx512_vnni() != 0
        };
        Tiling {
            on: x86 && env_atoi("GGML_CPU_TILED_MM").is_none_or(|n| n != 0),
            forced: env_atoi("GGML_CPU_TILED_MM_FORCE") == Some(1),
        }
    })
}

/// An environment variable read as C's `atoi` reads it (leading blanks, a sign, digits; no
/// digits give 0), or `None` when unset.
fn env_atoi(name: &str) -> Option<i64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim_start();
    let (sign, rest) = match v.strip_prefix('-') {
        Some(r) => (-1, r),
        None => (1, v.strip_prefix('+').unwrap_or(v)),
    };
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some(sign * digits.parse::<i64>().unwrap_or(0))
}

/// The weight types ggml-cpu's tiled path takes.
fn tiled_type(t: GgmlType) -> bool {
    matches!(
        t.0,
        sys::GGML_TYPE_Q6_K
            | sys::GGML_TYPE_Q5_K
            | sys::GGML_TYPE_Q4_K
            | sys::GGML_TYPE_Q3_K
            | sys::GGML_TYPE_Q2_K
            | sys::GGML_TYPE_IQ4_XS
            | sys::GGML_TYPE_IQ2_XXS
            | sys::GGML_TYPE_IQ2_XS
            | sys::GGML_TYPE_IQ2_S
            | sys::GGML_TYPE_IQ3_XXS
            | sys::GGML_TYPE_IQ3_S
            | sys::GGML_TYPE_IQ1_S
            | sys::GGML_TYPE_IQ1_M
    )
}

/// Whether [`mul_mat_id`] computes `node` (a `MUL_MAT_ID` of a shape ggml-cpu takes, over plain
/// host weights) exactly as ggml-cpu would.
pub fn computes_like_native(node: TensorView<'_>) -> bool {
    Shape::of(node).is_ok_and(|s| reproduces_native(GgmlType(s.wtype), s.ne12))
}

/// Workspace bytes [`mul_mat_id`] needs for `node` (metadata only).
pub fn mul_mat_id_workspace(node: TensorView<'_>) -> Result<usize, KernelError> {
    Ok(Shape::of(node)?.layout().total)
}

fn err(what: impl Into<String>) -> KernelError {
    KernelError(what.into())
}

/// Raw addresses shared by the compute threads (plain integers, so the closure is `Sync`).
#[derive(Clone, Copy)]
struct Addrs {
    src0: usize,
    src1: usize,
    dst: usize,
    conv: usize,
}

/// Computes the execution's `MUL_MAT_ID` output (its one node) on the CPU backend's thread
/// pool, each expert once `gate` lets it. Fails on a workspace smaller than
/// [`mul_mat_id_workspace`], an expert id out of range, an unallocated operand, or a gate error.
pub fn mul_mat_id(run: &mut Execution<'_>, gate: &dyn ExpertGate) -> Result<(), KernelError> {
    let node_ptr = *run.raw_nodes().last().ok_or_else(|| err("no node to compute"))?;
    // SAFETY: ggml passes live nodes for the execution.
    let node = unsafe { TensorView::from_raw(node_ptr) };
    let shape = Shape::of(node)?;
    let layout = shape.layout();
    let (ws_base, ws_size) = run.raw_workspace();
    if ws_base == 0 || ws_size < layout.total {
        return Err(err(format!("{}: workspace of {ws_size} bytes, {} needed", node.name(), layout.total)));
    }
    let base = align(ws_base, ALIGN);
    let (src0, src1, ids) = (node.src(0), node.src(1), node.src(2));
    let [src0, src1, ids] = [src0, src1, ids].map(|s| s.map_or(0, |s| s.data_addr()));
    let dst = node.data_addr();
    if [src0, src1, ids, dst].contains(&0) {
        return Err(err(format!("{}: an operand has no data", node.name())));
    }
    let n_as = shape.n_as as usize;
    let slots = shape.slots();
    // SAFETY: the workspace is a live host buffer of ws_size bytes that this execution owns
    // (ggml runs one execution per workspace at a time); the regions carved here lie inside it
    // (layout.total, which includes the alignment slack, fits), do not overlap, and are aligned
    // for their element types (offsets and rows to 8, state to 64).
    let (offsets, rows, state) = unsafe {
        (
            std::slice::from_raw_parts_mut((base + layout.offsets) as *mut u32, n_as + 1),
            std::slice::from_raw_parts_mut((base + layout.rows) as *mut [i32; 2], slots),
            std::slice::from_raw_parts((base + layout.state) as *const AtomicU32, n_as * STATE_WORDS),
        )
    };
    // SAFETY: the ids tensor is allocated in host memory (the CPU backend computes this node)
    // and holds n_ids x n_tokens i32 values at its strides (checked by Shape::of).
    let id_at = |slot: i64, tok: i64| unsafe {
        ((ids + tok as usize * shape.ids_nb[1] + slot as usize * shape.ids_nb[0]) as *const i32).read_unaligned()
    };
    route(&shape, id_at, offsets, rows, state).map_err(|e| err(format!("{}: {e}", node.name())))?;
    let order = schedule(n_as, offsets, state, gate);
    let addrs = Addrs { src0, src1, dst, conv: base + layout.conv };
    let (offsets, rows) = (&*offsets, &*rows);
    let barrier = OnceLock::new();
    let failed = AtomicBool::new(false);
    let failure = Mutex::new(None);
    let work = |ith: usize, nth: usize| {
        if shape.from_float.is_some() {
            convert(&shape, addrs, ith, nth);
            barrier.get_or_init(|| Barrier::new(nth)).wait();
        }
        if let Err(e) = compute(&shape, addrs, offsets, rows, state, &order, gate, &failed, nth) {
            failed.store(true, Ordering::SeqCst);
            failure.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
        }
    };
    super::sched::cpu_parallel(run.raw_backend(), &work).map_err(|e| err(e.to_string()))?;
    match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Groups the routed slots by expert (counting sort, slots in ggml's order: token-major) into
/// `offsets`/`rows`, and clears each expert's schedule state.
fn route(
    shape: &Shape,
    id_at: impl Fn(i64, i64) -> i32,
    offsets: &mut [u32],
    rows: &mut [[i32; 2]],
    state: &[AtomicU32],
) -> Result<(), String> {
    let n_as = shape.n_as as usize;
    offsets.fill(0);
    for tok in 0..shape.ne12 {
        for slot in 0..shape.n_ids {
            let id = id_at(slot, tok);
            let e = usize::try_from(id)
                .ok()
                .filter(|&e| e < n_as)
                .ok_or_else(|| format!("expert id {id} outside 0..{n_as}"))?;
            offsets[e + 1] += 1;
        }
    }
    for e in 0..n_as {
        offsets[e + 1] += offsets[e];
    }
    // The chunk counters serve as fill cursors first.
    for e in 0..n_as {
        state[STATE_WORDS * e].store(offsets[e], Ordering::Relaxed);
        state[STATE_WORDS * e + 1].store(0, Ordering::Relaxed);
        state[STATE_WORDS * e + 2].store(0, Ordering::Relaxed);
    }
    for tok in 0..shape.ne12 {
        for slot in 0..shape.n_ids {
            let e = id_at(slot, tok) as usize;
            let at = state[STATE_WORDS * e].fetch_add(1, Ordering::Relaxed) as usize;
            rows[at] = [slot as i32, tok as i32];
        }
    }
    for e in 0..n_as {
        state[STATE_WORDS * e].store(0, Ordering::Relaxed);
    }
    Ok(())
}

/// The routed experts in the order to compute them: those `gate` finds ready first (marked so
/// in `state`), then the rest, each group by id.
fn schedule(n_as: usize, offsets: &[u32], state: &[AtomicU32], gate: &dyn ExpertGate) -> Vec<u32> {
    let routed = (0..n_as as u32).filter(|&e| offsets[e as usize + 1] > offsets[e as usize]);
    let (mut ready, waiting): (Vec<u32>, Vec<u32>) = routed.partition(|&e| gate.ready(e));
    for &e in &ready {
        state[STATE_WORDS * e as usize + 1].store(1, Ordering::Release);
    }
    ready.extend(waiting);
    ready
}

/// Converts this thread's share of the activation rows to the dot-product type, into the
/// workspace, laid out as ggml-cpu lays them out (row `i11 + i12 * ne11`).
fn convert(shape: &Shape, a: Addrs, ith: usize, nth: usize) {
    let Some(from_float) = shape.from_float else { return };
    let n_rows = (shape.ne11 * shape.ne12) as usize;
    for r in (ith..n_rows).step_by(nth) {
        let (i11, i12) = (r % shape.ne11 as usize, r / shape.ne11 as usize);
        let x = a.src1 + i11 * shape.nb11 + i12 * shape.nb12;
        let y = a.conv + r * shape.row_size;
        // SAFETY: x is row (i11, i12) of the f32 activations (ne10 values at its strides); y is
        // that row's own row_size bytes in the workspace, written by this thread only.
        unsafe { from_float(x as *const f32, y as *mut std::ffi::c_void, shape.ne10) };
    }
}

/// One thread's part of the product: repeatedly takes a chunk of the first expert in `order`
/// that is ready and has chunks left; when every expert with chunks left is still waiting,
/// blocks in the gate. Returns when no chunk is left (or another thread failed).
#[allow(clippy::too_many_arguments)]
fn compute(
    shape: &Shape,
    a: Addrs,
    offsets: &[u32],
    rows: &[[i32; 2]],
    state: &[AtomicU32],
    order: &[u32],
    gate: &dyn ExpertGate,
    failed: &AtomicBool,
    nth: usize,
) -> Result<(), KernelError> {
    let mut pending = Vec::with_capacity(order.len());
    'scan: while !failed.load(Ordering::Relaxed) {
        pending.clear();
        for &e in order {
            let eu = e as usize;
            let rows_e = &rows[offsets[eu] as usize..offsets[eu + 1] as usize];
            let chunks = Chunks::new(shape.ne01, rows_e.len() as i64, nth);
            let [next, ready, finished] = [0, 1, 2].map(|w| &state[STATE_WORDS * eu + w]);
            if next.load(Ordering::Relaxed) as i64 >= chunks.count() {
                continue;
            }
            if ready.load(Ordering::Acquire) == 0 {
                if !gate.ready(e) {
                    pending.push(e);
                    continue;
                }
                ready.store(1, Ordering::Release);
            }
            loop {
                let c = next.fetch_add(1, Ordering::Relaxed) as i64;
                if c >= chunks.count() {
                    break;
                }
                chunk(shape, a, e, rows_e, chunks.range(c));
                if i64::from(finished.fetch_add(1, Ordering::AcqRel)) + 1 == chunks.count() {
                    gate.done(e);
                }
            }
            continue 'scan;
        }
        if pending.is_empty() {
            return Ok(());
        }
        gate.wait(&pending)?;
    }
    Ok(())
}

/// How one expert's output (`nr0` weight rows by `nr1` routed slots) is cut into chunks, as
/// ggml-cpu cuts it (the cut does not change any value: each output element is one dot product).
struct Chunks {
    n0: i64,
    n1: i64,
    d0: i64,
    d1: i64,
    nr0: i64,
    nr1: i64,
}

impl Chunks {
    fn new(nr0: i64, nr1: i64, nth: usize) -> Chunks {
        let size = if nr0 == 1 || nr1 == 1 { 64 } else { 16 };
        let (mut n0, mut n1) = ((nr0 + size - 1) / size, (nr1 + size - 1) / size);
        let nth = nth as i64;
        if n0 * n1 < nth * 4 {
            (n0, n1) = if nr0 > nr1 { (nth, 1) } else { (1, nth) };
        }
        Chunks { n0, n1, d0: (nr0 + n0 - 1) / n0, d1: (nr1 + n1 - 1) / n1, nr0, nr1 }
    }

    fn count(&self) -> i64 {
        if self.nr1 == 0 {
            0
        } else {
            self.n0 * self.n1
        }
    }

    /// Weight rows and routed slots of chunk `c`.
    fn range(&self, c: i64) -> (std::ops::Range<i64>, std::ops::Range<i64>) {
        let (c0, c1) = (c % self.n0, c / self.n0);
        let r0 = (self.d0 * c0).min(self.nr0)..(self.d0 * c0 + self.d0).min(self.nr0);
        let r1 = (self.d1 * c1).min(self.nr1)..(self.d1 * c1 + self.d1).min(self.nr1);
        (r0, r1)
    }
}

/// Computes one chunk of expert `e`: for each routed slot, each weight row's dot product with
/// the slot's activation row, in blocks of 16 x 16 as ggml-cpu does.
fn chunk(shape: &Shape, a: Addrs, e: u32, rows_e: &[[i32; 2]], (r0, r1): (std::ops::Range<i64>, std::ops::Range<i64>)) {
    const BLCK: i64 = 16;
    let src0_cur = a.src0 + e as usize * shape.nb02;
    let mut tmp = [0f32; BLCK as usize];
    let mut iir1 = r1.start;
    while iir1 < r1.end {
        let mut iir0 = r0.start;
        while iir0 < r0.end {
            let end0 = (iir0 + BLCK).min(r0.end);
            for ir1 in iir1..(iir1 + BLCK).min(r1.end) {
                let [slot, tok] = rows_e[ir1 as usize];
                let (i11, i12) = (slot as usize % shape.ne11 as usize, tok as usize);
                let src1_col = if shape.from_float.is_some() || shape.src1_cont {
                    (if shape.from_float.is_some() { a.conv } else { a.src1 })
                        + (i11 + i12 * shape.ne11 as usize) * shape.row_size
                } else {
                    a.src1 + i11 * shape.nb11 + i12 * shape.nb12
                };
                let dst_col = a.dst + slot as usize * shape.dst_nb[0] + tok as usize * shape.dst_nb[1];
                for ir0 in iir0..end0 {
                    // SAFETY: row ir0 (< ne01) of expert e (< n_as) of the weights, whose
                    // gate reported them in memory; the activation row of this slot; tmp has
                    // room for BLCK values. vec_dot reads ne00 elements of each.
                    unsafe {
                        (shape.vec_dot)(
                            shape.ne00 as c_int,
                            tmp.as_mut_ptr().add((ir0 - iir0) as usize),
                            0,
                            (src0_cur + ir0 as usize * shape.nb01) as *const std::ffi::c_void,
                            0,
                            src1_col as *const std::ffi::c_void,
                            0,
                            1,
                        )
                    };
                }
                // SAFETY: elements iir0..end0 of this slot's output row (dst is f32 with nb0 = 4,
                // checked), which only this chunk writes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        tmp.as_ptr(),
                        (dst_col as *mut f32).add(iir0 as usize),
                        (end0 - iir0) as usize,
                    )
                };
            }
            iir0 += BLCK;
        }
        iir1 += BLCK;
    }
}
