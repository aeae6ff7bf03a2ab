//! The operator-extension mechanism of vendor patch 0005 (`ggml-ext.h`), one test (or more) per
//! observable sentence of ../shared/reference/ggml-operator-extensions.md, named after it.
//!
//! Registrations are process-wide and scoped to the CPU device here, so every test uses its own
//! operator and kernel names, and its kernels support only nodes whose names start with the
//! test's own prefix: tests running side by side never take each other's nodes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use ggml_sys::ext::{
    find_op, register_kernel, register_op, selected_kernel, Backend, Device, Execution, ExtOp, GgmlOp, GraphBuilder,
    GraphNodes, Kernel, KernelError, KernelSpec, Node, Prepared, Scheduler, Target,
};
use ggml_sys::{GgmlType, TensorView, Threads};

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
}

/// What a test kernel saw.
#[derive(Default)]
struct Counters {
    prepared: AtomicUsize,
    executed: AtomicUsize,
    destroyed: Arc<AtomicUsize>,
    matched: AtomicUsize,
    /// Whether a prepare ran while its nodes had no data address yet (memory measurement).
    prepared_before_addresses: AtomicBool,
    /// Workspace bytes the last execution saw.
    workspace_seen: AtomicUsize,
    /// Nodes the last execution computed.
    nodes_seen: AtomicUsize,
}

/// Plan state whose drop the counters see.
struct State {
    destroyed: Arc<AtomicUsize>,
    tag: u32,
}

impl Drop for State {
    fn drop(&mut self) {
        self.destroyed.fetch_add(1, Ordering::SeqCst);
    }
}

type Run = Box<dyn Fn(&mut Execution<'_>) -> Result<(), KernelError> + Send + Sync>;

/// A kernel for nodes named `prefix*`, computing them with `run`.
struct TestKernel {
    prefix: String,
    preferred: bool,
    workspace: usize,
    prepare_fails: bool,
    /// Fusion rules: node i of the first op and node i + 1 of the second.
    fuse: Option<(GgmlOp, GgmlOp)>,
    run: Run,
    c: Arc<Counters>,
}

impl TestKernel {
    fn new(prefix: &str, run: Run) -> (TestKernel, Arc<Counters>) {
        let c = Arc::new(Counters::default());
        let k = TestKernel {
            prefix: prefix.into(),
            preferred: true,
            workspace: 0,
            prepare_fails: false,
            fuse: None,
            run,
            c: Arc::clone(&c),
        };
        (k, c)
    }
}

fn op_of(node: TensorView<'_>) -> &'static str {
    node.op_name()
}

impl Kernel for TestKernel {
    fn supports(&self, node: TensorView<'_>) -> bool {
        node.name().starts_with(&self.prefix)
    }

    fn preferred(&self, _node: TensorView<'_>) -> bool {
        self.preferred
    }

    fn matches(&self, graph: GraphNodes<'_>, i: usize) -> usize {
        let Some((first, second)) = self.fuse else { return 0 };
        let (Some(a), Some(b)) = (graph.node(i), graph.node(i + 1)) else { return 0 };
        if op_of(a) == first.name() && op_of(b) == second.name() && b.src(0).is_some_and(|s| s.name() == a.name()) {
            self.c.matched.fetch_add(1, Ordering::SeqCst);
            2
        } else {
            0
        }
    }

    fn prepare(&self, nodes: &[TensorView<'_>]) -> Result<Prepared, KernelError> {
        self.c.prepared.fetch_add(1, Ordering::SeqCst);
        if nodes.iter().all(|n| n.data_addr() == 0) {
            self.c.prepared_before_addresses.store(true, Ordering::SeqCst);
        }
        if self.prepare_fails {
            return Err(KernelError("this kernel refuses to plan".into()));
        }
        Ok(Prepared {
            workspace: self.workspace,
            state: Some(Box::new(State { destroyed: Arc::clone(&self.c.destroyed), tag: 7 })),
        })
    }

    fn execute(&self, run: &mut Execution<'_>) -> Result<(), KernelError> {
        self.c.executed.fetch_add(1, Ordering::SeqCst);
        self.c.workspace_seen.store(run.workspace_size(), Ordering::SeqCst);
        self.c.nodes_seen.store(run.nodes().len(), Ordering::SeqCst);
        if run.state::<State>().map(|s| s.tag) != Some(7) {
            return Err(KernelError("the prepared state did not reach the execution".into()));
        }
        (self.run)(run)
    }
}

/// `out = src0 * 2 + 1`, elementwise over f32.
fn scale_add(run: &mut Execution<'_>) -> Result<(), KernelError> {
    let src = run.output().src(0).ok_or_else(|| KernelError("no input".into()))?;
    let x = f32s(&run.read(src)?);
    run.write_output(&f32_bytes(&x.iter().map(|v| v * 2.0 + 1.0).collect::<Vec<_>>()))
}

/// `out = src0 + src1` over f32 of one shape, the way ggml's ADD computes it.
fn add(run: &mut Execution<'_>) -> Result<(), KernelError> {
    let out = run.output();
    let (a, b) = (out.src(0).unwrap(), out.src(1).unwrap());
    let (a, b) = (f32s(&run.read(a)?), f32s(&run.read(b)?));
    run.write_output(&f32_bytes(&a.iter().zip(&b).map(|(x, y)| x + y).collect::<Vec<_>>()))
}

fn spec(name: &str, target: Target, priority: i32) -> KernelSpec {
    KernelSpec { name: name.into(), target, priority, fusion: false }
}

fn cpu() -> Backend {
    Backend::cpu(&Threads::unpinned(2)).unwrap()
}

/// A unary operator `name` whose output has its input's type and shape.
fn unary_op(name: &str, attr_size: usize) -> ExtOp {
    register_op(name, attr_size, |srcs, _| {
        let x = srcs.first()?;
        (srcs.len() == 1 && x.ty() == GgmlType::F32).then(|| (x.ty(), x.ne()))
    })
    .unwrap()
}

/// An f32 input `<prefix>x` of 8 values and `op` over it as the output `<prefix>y`.
fn unary_nodes<'c>(g: &'c GraphBuilder, op: ExtOp, prefix: &str) -> (Node<'c>, Node<'c>) {
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named(&format!("{prefix}x")).input();
    let y = g.ext(op, &[x], &[]).unwrap().named(&format!("{prefix}y")).output();
    (x, y)
}

const INPUT: [f32; 8] = [0.0, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5, 4.0];

/// Allocates `graph` on a CPU scheduler, sets `input`, computes, and returns `out`'s values.
fn run_sched(backend: &Backend, graph: &ggml_sys::ext::Graph<'_>, input: Node<'_>, out: Node<'_>) -> Vec<f32> {
    let mut sched = Scheduler::new(&[backend], 64, false).unwrap();
    sched.alloc(graph).unwrap();
    input.write(&f32_bytes(&INPUT)).unwrap();
    sched.compute(graph).unwrap();
    f32s(&out.read().unwrap())
}

#[test]
fn registration_names_are_unique_and_duplicate_registrations_fail_rather_than_replacing_live_implementations() {
    let op = unary_op("test.unique.v1", 0);
    assert!(register_op("test.unique.v1", 0, |_, _| None).is_err(), "a second operator of the same name");
    assert_eq!(find_op("test.unique.v1"), Some(op), "the first registration stays live");
    let (first, c1) = TestKernel::new("uniq.", Box::new(scale_add));
    let (second, c2) = TestKernel::new("uniq.", Box::new(|_| Err(KernelError("the duplicate ran".into()))));
    register_kernel(Device::cpu(), spec("test.unique.kernel", Target::Ext(op), 0), first).unwrap();
    assert!(register_kernel(Device::cpu(), spec("test.unique.kernel", Target::Ext(op), 9), second).is_err());
    let g = GraphBuilder::new(8).unwrap();
    let (x, y) = unary_nodes(&g, op, "uniq.");
    let graph = g.graph(y).unwrap();
    let out = run_sched(&cpu(), &graph, x, y);
    assert_eq!(out[3], 7.0);
    assert_eq!((c1.executed.load(Ordering::SeqCst), c2.executed.load(Ordering::SeqCst)), (1, 0));
}

#[test]
fn register_op_registers_a_versioned_name_attribute_size_and_output_inference() {
    let op = register_op("test.concat_halves.v1", 4, |srcs, attrs| {
        let rows = i64::from(u32::from_ne_bytes(attrs.try_into().ok()?));
        Some((GgmlType::F32, [srcs.first()?.ne()[0], rows, 1, 1]))
    })
    .unwrap();
    assert_eq!(op.name(), "test.concat_halves.v1");
    assert_eq!(op.attr_size(), 4);
    let g = GraphBuilder::new(4).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap();
    let y = g.ext(op, &[x], &3u32.to_ne_bytes()).unwrap();
    assert_eq!(y.view().ne(), [8, 3, 1, 1], "the shape comes from the inference");
    assert!(g.ext(op, &[x], &[1, 2]).is_err(), "attributes of the wrong size are refused");
}

#[test]
fn op_create_makes_an_ordinary_contiguous_out_of_place_tensor_with_explicit_inputs_and_copied_attributes() {
    let op = unary_op("test.create.v1", 8);
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap();
    // The caller's attribute buffer is gone once the node exists.
    let attrs: Box<[u8]> = Box::new([1u8, 2, 3, 4, 5, 6, 7, 8]);
    let y = g.ext(op, &[x], &attrs).unwrap();
    drop(attrs);
    let v = y.view();
    assert_eq!(v.src(0).map(|s| s.data_addr()), Some(x.view().data_addr()));
    assert!(v.src(1).is_none(), "exactly the explicit inputs");
    assert_eq!((v.ty(), v.ne(), v.nb()[1]), (GgmlType::F32, [8, 1, 1, 1], 32), "contiguous, typed by the inference");
    assert_eq!(ExtOp::attrs(v), Some(&[1u8, 2, 3, 4, 5, 6, 7, 8][..]), "attributes are copied into op_params");
    assert!(g.ext(unary_op("test.create.refuses.v1", 0), &[], &[]).is_err(), "an inference that refuses");
}

#[test]
fn registered_operators_use_ggml_op_custom_with_an_identifiable_marker_and_no_device_mistakes_them_for_cpu_callbacks() {
    let op = unary_op("test.marker.v1", 0);
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap();
    let y = g.ext(op, &[x], &[]).unwrap().named("marker.y");
    assert_eq!(y.view().op_name(), "CUSTOM");
    assert_eq!(ExtOp::of(y.view()), Some(op));
    assert_eq!(ExtOp::of(x.view()), None);
    // ggml's CPU backend runs any GGML_OP_CUSTOM callback natively, but not a registered
    // operator without a kernel.
    assert!(!Device::cpu().supports(y.view()));
}

#[test]
fn auxiliary_tensors_appear_in_src_and_a_kernel_reads_them_there() {
    let op = register_op("test.aux.v1", 0, |srcs, _| (srcs.len() == 2).then(|| (GgmlType::F32, srcs[0].ne()))).unwrap();
    let (k, _) = TestKernel::new("aux.", Box::new(add));
    register_kernel(Device::cpu(), spec("test.aux.cpu", Target::Ext(op), 0), k).unwrap();
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("aux.x").input();
    let y = g.ext(op, &[x, x], &[]).unwrap().named("aux.y").output();
    let out = run_sched(&cpu(), &g.graph(y).unwrap(), x, y);
    assert_eq!(out, INPUT.iter().map(|v| v * 2.0).collect::<Vec<_>>());
}

#[test]
fn capability_queries_include_registered_kernels_and_the_scheduler_places_the_node_on_that_device() {
    let op = unary_op("test.capability.v1", 0);
    let g = GraphBuilder::new(8).unwrap();
    let (x, y) = unary_nodes(&g, op, "cap.");
    assert!(!Device::cpu().supports(y.view()), "native CPU rejects it");
    let (k, c) = TestKernel::new("cap.", Box::new(scale_add));
    register_kernel(Device::cpu(), spec("test.capability.cpu", Target::Ext(op), 0), k).unwrap();
    assert!(Device::cpu().supports(y.view()));
    let backend = cpu();
    let graph = g.graph(y).unwrap();
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    sched.alloc(&graph).unwrap();
    assert_eq!(sched.backend_of(y).as_deref(), Some("CPU"));
    x.write(&f32_bytes(&INPUT)).unwrap();
    sched.compute(&graph).unwrap();
    assert_eq!(f32s(&y.read().unwrap())[1], 3.0);
    assert_eq!(c.executed.load(Ordering::SeqCst), 1);
}

#[test]
fn supports_false_is_never_executed_preferred_false_keeps_the_native_kernel_and_higher_priority_wins() {
    let dev = Device::cpu();
    // Three kernels for ADD on nodes named "prio.*": the highest priority does not support
    // them, the next is not preferred over native, the lowest is used.
    let (never, c_never) = TestKernel::new("never.", Box::new(add));
    let (mut shy, c_shy) = TestKernel::new("prio.", Box::new(add));
    shy.preferred = false;
    let (used, c_used) = TestKernel::new("prio.", Box::new(add));
    register_kernel(dev, spec("test.prio.never", Target::Op(GgmlOp::ADD), 30), never).unwrap();
    register_kernel(dev, spec("test.prio.shy", Target::Op(GgmlOp::ADD), 20), shy).unwrap();
    register_kernel(dev, spec("test.prio.used", Target::Op(GgmlOp::ADD), 10), used).unwrap();
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("prio.x").input();
    let y = g.add(x, x).unwrap().named("prio.y").output();
    assert_eq!(selected_kernel(dev, y.view()).as_deref(), Some("test.prio.used"));
    let out = run_sched(&cpu(), &g.graph(y).unwrap(), x, y);
    assert_eq!(out, INPUT.iter().map(|v| v * 2.0).collect::<Vec<_>>(), "same bytes as native ADD");
    assert_eq!(c_never.executed.load(Ordering::SeqCst), 0);
    assert_eq!(c_shy.executed.load(Ordering::SeqCst), 0);
    assert_eq!(c_used.executed.load(Ordering::SeqCst), 1);
}

#[test]
fn when_native_execution_is_unsupported_a_supported_extension_runs_regardless_of_its_preference() {
    let op = unary_op("test.unpreferred.v1", 0);
    let (mut k, c) = TestKernel::new("unpref.", Box::new(scale_add));
    k.preferred = false;
    register_kernel(Device::cpu(), spec("test.unpreferred.cpu", Target::Ext(op), 0), k).unwrap();
    let g = GraphBuilder::new(8).unwrap();
    let (x, y) = unary_nodes(&g, op, "unpref.");
    let out = run_sched(&cpu(), &g.graph(y).unwrap(), x, y);
    assert_eq!(out[2], 5.0);
    assert_eq!(c.executed.load(Ordering::SeqCst), 1);
}

#[test]
fn a_fusion_only_registration_does_not_claim_single_node_support() {
    let (mut rule, _) = TestKernel::new("fonly.", Box::new(add));
    rule.fuse = Some((GgmlOp::SCALE, GgmlOp::ADD));
    let spec =
        KernelSpec { name: "test.fusion_only".into(), target: Target::Op(GgmlOp::ADD), priority: 0, fusion: true };
    register_kernel(Device::cpu(), spec, rule).unwrap();
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("fonly.x");
    let y = g.add(x, x).unwrap().named("fonly.y");
    assert_eq!(selected_kernel(Device::cpu(), y.view()), None);
}

#[test]
fn prepare_runs_during_memory_measurement_and_its_workspace_is_allocated_and_in_the_buffer_size() {
    const WS: usize = 3 << 20;
    let op = unary_op("test.workspace.v1", 0);
    let (mut k, c) = TestKernel::new(
        "ws.",
        Box::new(|run| {
            let ws = run.workspace().ok_or_else(|| KernelError("no host workspace".into()))?;
            ws.fill(0xA5); // the whole workspace is writable memory
            scale_add(run)
        }),
    );
    k.workspace = WS;
    register_kernel(Device::cpu(), spec("test.workspace.cpu", Target::Ext(op), 0), k).unwrap();
    let backend = cpu();
    // The same graph shape without the extension node, for the scheduler's own buffer.
    let plain = GraphBuilder::new(8).unwrap();
    let px = plain.tensor(GgmlType::F32, &[8]).unwrap().input();
    let py = plain.scale(px, 2.0).unwrap().output();
    let plain_graph = plain.graph(py).unwrap();
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    sched.reserve(&plain_graph).unwrap();
    let base = sched.buffer_size(&backend);

    let g = GraphBuilder::new(8).unwrap();
    let (x, y) = unary_nodes(&g, op, "ws.");
    let graph = g.graph(y).unwrap();
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    sched.reserve(&graph).unwrap();
    assert!(c.prepared_before_addresses.load(Ordering::SeqCst), "prepare ran before addresses were assigned");
    assert!(sched.buffer_size(&backend) >= base + WS, "{} < {base} + {WS}", sched.buffer_size(&backend));
    sched.alloc(&graph).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    sched.compute(&graph).unwrap();
    assert!(c.workspace_seen.load(Ordering::SeqCst) >= WS, "execute received the workspace buffer");
    assert_eq!(f32s(&y.read().unwrap())[0], 1.0, "and the current tensor addresses");
}

#[test]
fn scheduler_plans_are_reused_across_executions_and_destroy_releases_the_prepared_state() {
    let op = unary_op("test.reuse.v1", 0);
    let (k, c) = TestKernel::new("reuse.", Box::new(scale_add));
    register_kernel(Device::cpu(), spec("test.reuse.cpu", Target::Ext(op), 0), k).unwrap();
    let backend = cpu();
    let g = GraphBuilder::new(8).unwrap();
    let (x, y) = unary_nodes(&g, op, "reuse.");
    let graph = g.graph(y).unwrap();
    {
        let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
        sched.alloc(&graph).unwrap();
        x.write(&f32_bytes(&INPUT)).unwrap();
        for _ in 0..3 {
            sched.compute(&graph).unwrap();
        }
        assert_eq!((c.prepared.load(Ordering::SeqCst), c.executed.load(Ordering::SeqCst)), (1, 3));
        assert_eq!(c.destroyed.load(Ordering::SeqCst), 0);
    }
    assert_eq!(c.destroyed.load(Ordering::SeqCst), 1, "freeing the scheduler destroys its plans");
}

#[test]
fn a_preparation_or_execution_error_is_propagated_and_native_execution_is_never_retried() {
    let dev = Device::cpu();
    let (mut k, _) = TestKernel::new("badprep.", Box::new(add));
    k.prepare_fails = true;
    register_kernel(dev, spec("test.badprep", Target::Op(GgmlOp::ADD), 0), k).unwrap();
    let (k, c) = TestKernel::new("badexec.", Box::new(|_| Err(KernelError("refused at execution".into()))));
    register_kernel(dev, spec("test.badexec", Target::Op(GgmlOp::ADD), 0), k).unwrap();
    let backend = cpu();

    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("badprep.x").input();
    let y = g.add(x, x).unwrap().named("badprep.y").output();
    let graph = g.graph(y).unwrap();
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    assert!(sched.alloc(&graph).is_err(), "a preparation error fails the allocation");

    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("badexec.x").input();
    let y = g.add(x, x).unwrap().named("badexec.y").output();
    let graph = g.graph(y).unwrap();
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    sched.alloc(&graph).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    y.write(&f32_bytes(&[-7.0; 8])).unwrap();
    assert!(sched.compute(&graph).is_err(), "an execution error fails the compute");
    assert_eq!(c.executed.load(Ordering::SeqCst), 1);
    assert_eq!(f32s(&y.read().unwrap()), vec![-7.0; 8], "ADD was not retried natively");
}

#[test]
fn explicit_views_and_in_place_nodes_are_not_intercepted() {
    let (k, _) = TestKernel::new("inplace.", Box::new(add));
    register_kernel(Device::cpu(), spec("test.inplace", Target::Op(GgmlOp::ADD), 0), k).unwrap();
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("inplace.x");
    let y = g.add_inplace(x, x).unwrap().named("inplace.y");
    let z = g.add(x, x).unwrap().named("inplace.z");
    assert_eq!(selected_kernel(Device::cpu(), y.view()), None);
    assert_eq!(selected_kernel(Device::cpu(), z.view()).as_deref(), Some("test.inplace"));
}

#[test]
fn rebuilding_the_scheduler_allocation_after_a_registration_applies_it() {
    let backend = cpu();
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("late.x").input();
    let y = g.scale(x, 3.0).unwrap().named("late.y").output();
    let graph = g.graph(y).unwrap();
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    sched.alloc(&graph).unwrap();
    let (k, c) = TestKernel::new("late.", Box::new(scale_add));
    register_kernel(Device::cpu(), spec("test.late", Target::Op(GgmlOp::SCALE), 0), k).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    sched.compute(&graph).unwrap();
    assert_eq!(c.executed.load(Ordering::SeqCst), 0, "the selection was made at allocation");
    assert_eq!(f32s(&y.read().unwrap())[2], 6.0, "native x*3");
    sched.alloc(&graph).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    sched.compute(&graph).unwrap();
    assert_eq!(c.executed.load(Ordering::SeqCst), 1);
    assert_eq!(f32s(&y.read().unwrap())[2], 5.0, "the kernel's x*2+1");
}

/// RMS norm followed by a multiply, computed the way ggml does, in one pass.
fn rms_norm_mul(run: &mut Execution<'_>) -> Result<(), KernelError> {
    let nodes = run.nodes();
    let (norm, mul) = (nodes[0], nodes[1]);
    let x = f32s(&run.read(norm.src(0).unwrap())?);
    let w = f32s(&run.read(mul.src(1).unwrap())?);
    let mean = x.iter().map(|v| (v * v) as f64).sum::<f64>() / x.len() as f64;
    let scale = 1.0 / (mean as f32 + 1e-6).sqrt();
    let out: Vec<f32> = x.iter().zip(&w).map(|(v, w)| (v * scale) * w).collect();
    run.write_output(&f32_bytes(&out))
}

/// `rms_norm(x) * w + x` with nodes named `prefix*`: the norm and the multiply are the fusion
/// candidates, the add a native node after them.
struct NormMul<'c> {
    x: Node<'c>,
    w: Node<'c>,
    norm: Node<'c>,
    out: Node<'c>,
    graph: ggml_sys::ext::Graph<'c>,
}

fn norm_mul<'c>(g: &'c GraphBuilder, prefix: &str) -> NormMul<'c> {
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named(&format!("{prefix}x")).input();
    let w = g.tensor(GgmlType::F32, &[8]).unwrap().named(&format!("{prefix}w")).input();
    let norm = g.rms_norm(x, 1e-6).unwrap().named(&format!("{prefix}norm"));
    let mul = g.mul(norm, w).unwrap().named(&format!("{prefix}mul"));
    let out = g.add(mul, x).unwrap().named(&format!("{prefix}out")).output();
    let graph = g.graph(out).unwrap();
    NormMul { x, w, norm, out, graph }
}

const WEIGHTS: [f32; 8] = [1.0, 0.5, 2.0, -1.0, 1.5, 0.25, 3.0, 1.0];

/// Computes a norm-mul graph on a fresh scheduler and returns its output, and whether the norm
/// (an intermediate) had memory allocated.
fn compute_norm_mul(backend: &Backend, nm: &NormMul<'_>, parallel: bool, callback: bool) -> (Vec<f32>, bool) {
    let mut sched = Scheduler::new(&[backend], 64, parallel).unwrap();
    if callback {
        sched.set_eval_callback(Some(Box::new(|_, _| true)));
    }
    sched.alloc(&nm.graph).unwrap();
    nm.x.write(&f32_bytes(&INPUT)).unwrap();
    nm.w.write(&f32_bytes(&WEIGHTS)).unwrap();
    sched.compute(&nm.graph).unwrap();
    (f32s(&nm.out.read().unwrap()), nm.norm.view().data_addr() != 0)
}

fn register_norm_mul_rule(prefix: &str, name: &str) -> Arc<Counters> {
    let (mut rule, c) = TestKernel::new(prefix, Box::new(rms_norm_mul));
    rule.fuse = Some((GgmlOp::RMS_NORM, GgmlOp::MUL));
    let spec = KernelSpec { name: name.into(), target: Target::Op(GgmlOp::MUL), priority: 0, fusion: true };
    register_kernel(Device::cpu(), spec, rule).unwrap();
    c
}

#[test]
fn a_fusion_rule_replaces_the_consecutive_nodes_it_matches_with_the_same_bytes_and_intermediates_stay_allocated() {
    let backend = cpu();
    let native = GraphBuilder::new(16).unwrap();
    let reference = compute_norm_mul(&backend, &norm_mul(&native, "nat."), false, false);
    let c = register_norm_mul_rule("fuse.", "test.fuse.rms_norm_mul");
    let g = GraphBuilder::new(16).unwrap();
    let nm = norm_mul(&g, "fuse.");
    let (out, norm_allocated) = compute_norm_mul(&backend, &nm, false, false);
    assert_eq!(c.executed.load(Ordering::SeqCst), 1);
    assert_eq!(c.nodes_seen.load(Ordering::SeqCst), 2, "one execution for both nodes: the norm is not computed alone");
    assert_eq!(out, reference.0, "fused bytes equal the unfused graph's, native add after it included");
    assert!(norm_allocated, "the intermediate keeps its allocation");
    let matched = c.matched.load(Ordering::SeqCst);
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    sched.alloc(&nm.graph).unwrap();
    let after_alloc = c.matched.load(Ordering::SeqCst);
    assert!(after_alloc > matched, "matching runs when the scheduler allocates");
    nm.x.write(&f32_bytes(&INPUT)).unwrap();
    nm.w.write(&f32_bytes(&WEIGHTS)).unwrap();
    sched.compute(&nm.graph).unwrap();
    sched.compute(&nm.graph).unwrap();
    assert_eq!(c.matched.load(Ordering::SeqCst), after_alloc, "the selection is frozen before execution");
}

#[test]
fn multiple_pipeline_copies_and_evaluation_callbacks_retain_individual_operations() {
    let backend = cpu();
    let native = GraphBuilder::new(16).unwrap();
    let reference = compute_norm_mul(&backend, &norm_mul(&native, "nat2."), false, false);
    let c = register_norm_mul_rule("keep.", "test.keep.rms_norm_mul");
    for (parallel, callback) in [(false, true), (true, false)] {
        let g = GraphBuilder::new(16).unwrap();
        let (out, _) = compute_norm_mul(&backend, &norm_mul(&g, "keep."), parallel, callback);
        assert_eq!(out, reference.0, "parallel {parallel}, callback {callback}");
    }
    assert_eq!(c.executed.load(Ordering::SeqCst), 0);
}

#[test]
fn ggml_checks_output_flags_and_external_uses_before_fusing() {
    let backend = cpu();
    let c = register_norm_mul_rule("guard.", "test.guard.rms_norm_mul");
    // The intermediate is a graph output.
    let g = GraphBuilder::new(16).unwrap();
    let nm = norm_mul(&g, "guard.");
    nm.norm.output();
    compute_norm_mul(&backend, &nm, false, false);
    // The intermediate is used outside the range.
    let g = GraphBuilder::new(16).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("guard.x2").input();
    let w = g.tensor(GgmlType::F32, &[8]).unwrap().named("guard.w2").input();
    let norm = g.rms_norm(x, 1e-6).unwrap().named("guard.norm2");
    let mul = g.mul(norm, w).unwrap().named("guard.mul2");
    let out = g.add(mul, norm).unwrap().named("guard.out2").output();
    let graph = g.graph(out).unwrap();
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    sched.alloc(&graph).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    w.write(&f32_bytes(&WEIGHTS)).unwrap();
    sched.compute(&graph).unwrap();
    assert!(c.matched.load(Ordering::SeqCst) >= 2, "the rule matched both graphs");
    assert_eq!(c.executed.load(Ordering::SeqCst), 0, "and ggml refused both ranges");
}

#[test]
fn direct_backend_computation_runs_single_node_extensions_with_temporary_plans_and_does_not_fuse() {
    let op = unary_op("test.direct.v1", 0);
    let (k, c) = TestKernel::new("direct.", Box::new(scale_add));
    register_kernel(Device::cpu(), spec("test.direct.cpu", Target::Ext(op), 0), k).unwrap();
    let rule = register_norm_mul_rule("direct.", "test.direct.rms_norm_mul");
    let backend = cpu();
    let g = GraphBuilder::new(16).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("direct.x");
    let w = g.tensor(GgmlType::F32, &[8]).unwrap().named("direct.w");
    let norm = g.rms_norm(x, 1e-6).unwrap().named("direct.norm");
    let mul = g.mul(norm, w).unwrap().named("direct.mul");
    let y = g.ext(op, &[mul], &[]).unwrap().named("direct.y");
    let graph = g.graph(y).unwrap();
    g.alloc_on(&backend).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    w.write(&f32_bytes(&WEIGHTS)).unwrap();
    for round in 1..=2 {
        backend.compute(&graph).unwrap();
        assert_eq!(c.executed.load(Ordering::SeqCst), round);
        assert_eq!(c.prepared.load(Ordering::SeqCst), round, "a temporary plan per call");
        assert_eq!(c.destroyed.load(Ordering::SeqCst), round, "released after the call");
    }
    assert_eq!(rule.executed.load(Ordering::SeqCst), 0, "nothing fused");
    let expected: Vec<f32> = f32s(&mul.read().unwrap()).iter().map(|v| v * 2.0 + 1.0).collect();
    assert_ne!(expected, vec![1.0; 8], "the native nodes before the extension node ran");
    assert_eq!(f32s(&y.read().unwrap()), expected);
    let _ = norm;
}

#[test]
fn cpu_parallel_runs_the_callback_on_the_configured_pinned_pool_and_honours_the_abort_callback() {
    let usable = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
    let cpu0 = (0..1024).find(|&c| usable.is_set(c).unwrap_or(false)).unwrap();
    let threads = Threads { cpus: vec![cpu0], ..Threads::unpinned(2) };
    let mut backend = Backend::cpu(&threads).unwrap();
    let seen = std::sync::Mutex::new(Vec::new());
    backend
        .cpu_parallel(|ith, nth| {
            let mask = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
            let cpus: Vec<usize> = (0..1024).filter(|&c| mask.is_set(c).unwrap_or(false)).collect();
            seen.lock().unwrap().push((ith, nth, cpus));
        })
        .unwrap();
    let mut seen = seen.into_inner().unwrap();
    seen.sort();
    assert_eq!(seen.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>(), vec![(0, 2), (1, 2)], "every pool thread ran once");
    if std::env::var_os("SLUICE_TEST_RUNNER").is_none() {
        assert!(seen.iter().all(|s| s.2 == vec![cpu0]), "threads pinned to the profile's core: {seen:?}");
    }
    let stop = Arc::new(AtomicBool::new(true));
    backend.set_abort_flag(Some(Arc::clone(&stop)));
    let ran = AtomicUsize::new(0);
    let r = backend.cpu_parallel(|_, _| {
        ran.fetch_add(1, Ordering::SeqCst);
    });
    assert!(matches!(r, Err(ggml_sys::Error::Aborted)), "{r:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    stop.store(false, Ordering::SeqCst);
    backend.cpu_parallel(|_, _| {}).unwrap();
}

#[test]
fn a_kernel_stopped_by_the_abort_callback_reports_the_abort_not_a_failure() {
    let op = unary_op("test.aborted_kernel.v1", 0);
    let (k, c) = TestKernel::new(
        "abort.",
        Box::new(|run| {
            run.cpu_parallel(|_, _| {})?;
            run.write_output(&f32_bytes(&INPUT))
        }),
    );
    register_kernel(Device::cpu(), spec("test.aborted_kernel.cpu", Target::Ext(op), 0), k).unwrap();
    let g = GraphBuilder::new(8).unwrap();
    let (x, y) = unary_nodes(&g, op, "abort.");
    let graph = g.graph(y).unwrap();
    let mut backend = cpu();
    let stop = Arc::new(AtomicBool::new(true));
    backend.set_abort_flag(Some(Arc::clone(&stop)));
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    sched.alloc(&graph).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    let r = sched.compute(&graph);
    assert!(matches!(r, Err(ggml_sys::Error::Aborted)), "{r:?}");
    assert_eq!(c.executed.load(Ordering::SeqCst), 1);
    stop.store(false, Ordering::SeqCst);
    sched.compute(&graph).unwrap();
    assert_eq!(f32s(&y.read().unwrap()), INPUT.to_vec());
}

#[test]
fn a_kernel_runs_its_work_through_the_cpu_parallel_service() {
    let op = unary_op("test.parallel_kernel.v1", 0);
    let (k, c) = TestKernel::new(
        "par.",
        Box::new(|run| {
            let src = run.output().src(0).unwrap();
            let x = f32s(&run.read(src)?);
            let out: Vec<std::sync::atomic::AtomicU32> = x.iter().map(|_| Default::default()).collect();
            run.cpu_parallel(|ith, nth| {
                for i in (ith..x.len()).step_by(nth) {
                    out[i].store((x[i] * 2.0 + 1.0).to_bits(), Ordering::Relaxed);
                }
            })?;
            run.write_output(&f32_bytes(
                &out.iter().map(|v| f32::from_bits(v.load(Ordering::Relaxed))).collect::<Vec<_>>(),
            ))
        }),
    );
    register_kernel(Device::cpu(), spec("test.parallel_kernel.cpu", Target::Ext(op), 0), k).unwrap();
    let g = GraphBuilder::new(8).unwrap();
    let (x, y) = unary_nodes(&g, op, "par.");
    let out = run_sched(&cpu(), &g.graph(y).unwrap(), x, y);
    assert_eq!(out, INPUT.iter().map(|v| v * 2.0 + 1.0).collect::<Vec<_>>());
    assert_eq!(c.executed.load(Ordering::SeqCst), 1);
}

#[test]
fn the_cuda_services_are_found_where_a_cuda_backend_is_registered() {
    let services = ggml_sys::extension_services();
    let parallel = services.iter().find(|s| s.name == "ggml_ext_cpu_parallel_v1").unwrap();
    assert_eq!(parallel.backend.as_deref(), Some("CPU"));
    if !ggml_sys::backends().iter().any(|b| b == "CUDA") {
        eprintln!(
            "skipped: no CUDA backend in this build (the CUDA services are checked by make cuda-check and on a GPU)"
        );
        return;
    }
    for name in ["ggml_ext_cuda_context_v1", "ggml_ext_cuda_device_v1"] {
        let s = services.iter().find(|s| s.name == name).unwrap();
        assert_eq!(s.backend.as_deref(), Some("CUDA"), "{name}");
    }
    assert_eq!(Device::cpu().cuda_ordinal(), None, "the CPU is not a CUDA device");
    let gpu = Device::all().into_iter().find(|d| d.cuda_ordinal().is_some()).expect("a CUDA device");
    let ordinal = gpu.cuda_ordinal().unwrap();
    let backend = Backend::of(gpu).unwrap();
    let (device, stream) = backend.cuda_stream().expect("a CUDA backend lends its stream");
    assert_eq!(device, ordinal, "the borrowed device is the one looked up before the backend existed");
    assert_ne!(stream, 0);
    assert_eq!(cpu().cuda_stream(), None);
}

// Soundness: the safe API refuses what would otherwise read freed or unallocated memory, or
// unwind into C.

#[test]
fn computing_a_graph_that_is_not_allocated_or_was_detached_is_an_error() {
    let backend = cpu();
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("unalloc.x").input();
    let y = g.scale(x, 2.0).unwrap().named("unalloc.y").output();
    let graph = g.graph(y).unwrap();
    let not_allocated = |r: ggml_sys::Result<()>| matches!(r, Err(ggml_sys::Error::NotAllocated(_)));
    assert!(not_allocated(backend.compute(&graph)), "a direct computation of unallocated tensors");
    let mut sched = Scheduler::new(&[&backend], 64, false).unwrap();
    assert!(not_allocated(sched.compute(&graph)), "a graph the scheduler never allocated");
    sched.alloc(&graph).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    sched.compute(&graph).unwrap();
    assert_eq!(f32s(&y.read().unwrap())[1], 2.0);
    // A reservation may replace the scheduler's buffers: the graph is detached first, and must be
    // allocated again before it computes.
    sched.reserve(&graph).unwrap();
    assert!(not_allocated(sched.compute(&graph)), "a graph detached by a reservation");
    assert!(y.read().is_err(), "the detached output has no data");
    sched.alloc(&graph).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    sched.compute(&graph).unwrap();
    assert_eq!(f32s(&y.read().unwrap())[3], 6.0);
}

/// A fusion rule that claims more nodes than the graph has, and never computes.
struct Greedy;

impl Kernel for Greedy {
    fn supports(&self, node: TensorView<'_>) -> bool {
        node.name().starts_with("greedy.")
    }

    fn matches(&self, graph: GraphNodes<'_>, i: usize) -> usize {
        if graph.node(i).is_some_and(|n| n.name().starts_with("greedy.")) {
            usize::MAX
        } else {
            0
        }
    }

    fn execute(&self, _run: &mut Execution<'_>) -> Result<(), KernelError> {
        Err(KernelError("a range past the graph's end was fused".into()))
    }
}

#[test]
fn a_fusion_rule_claiming_more_nodes_than_the_graph_has_is_cut_to_what_is_left() {
    let spec =
        KernelSpec { name: "test.greedy.scale".into(), target: Target::Op(GgmlOp::SCALE), priority: 0, fusion: true };
    register_kernel(Device::cpu(), spec, Greedy).unwrap();
    let backend = cpu();
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("greedy.x").input();
    // The graph's only node: a claim of usize::MAX nodes from it leaves one, which fuses nothing.
    let y = g.scale(x, 3.0).unwrap().named("greedy.y").output();
    let graph = g.graph(y).unwrap();
    assert_eq!(run_sched(&backend, &graph, x, y), INPUT.iter().map(|v| v * 3.0).collect::<Vec<_>>());
}

/// Plan state whose drop panics.
struct Explosive;

impl Drop for Explosive {
    fn drop(&mut self) {
        panic!("a kernel state that panics when dropped");
    }
}

/// A kernel whose plan state panics when ggml destroys it.
struct ExplosiveState;

impl Kernel for ExplosiveState {
    fn supports(&self, node: TensorView<'_>) -> bool {
        node.name().starts_with("explode.")
    }

    fn prepare(&self, _nodes: &[TensorView<'_>]) -> Result<Prepared, KernelError> {
        Ok(Prepared { workspace: 0, state: Some(Box::new(Explosive)) })
    }

    fn execute(&self, run: &mut Execution<'_>) -> Result<(), KernelError> {
        scale_add(run)
    }
}

#[test]
fn a_kernel_state_that_panics_when_dropped_does_not_abort_the_process() {
    let op = unary_op("test.explode.v1", 0);
    register_kernel(Device::cpu(), spec("test.explode.cpu", Target::Ext(op), 0), ExplosiveState).unwrap();
    let backend = cpu();
    let g = GraphBuilder::new(8).unwrap();
    let x = g.tensor(GgmlType::F32, &[8]).unwrap().named("explode.x");
    let y = g.ext(op, &[x], &[]).unwrap().named("explode.y");
    let graph = g.graph(y).unwrap();
    g.alloc_on(&backend).unwrap();
    x.write(&f32_bytes(&INPUT)).unwrap();
    // A direct computation makes a temporary plan and destroys its state after the call.
    backend.compute(&graph).unwrap();
    assert_eq!(f32s(&y.read().unwrap())[1], 3.0);
}

/// Every test above again under valgrind's memcheck, where valgrind is installed (`make test`
/// installs it): the soundness cases included, each now refused or impossible, with no invalid
/// read or write in ggml, the shims or the safe wrappers. Skipped, saying so, under emulation
/// (qemu-user cannot host valgrind) or without valgrind.
#[test]
fn the_extension_tests_are_clean_under_memcheck() {
    const INNER: &str = "SLUICE_UNDER_MEMCHECK";
    if std::env::var_os(INNER).is_some() {
        return;
    }
    if std::env::var_os("SLUICE_TEST_RUNNER").is_some_and(|r| !r.is_empty()) {
        println!("memcheck skipped: an emulated run");
        return;
    }
    if std::process::Command::new("valgrind").arg("--version").output().is_err() {
        println!("memcheck skipped: valgrind is not installed");
        return;
    }
    let o = std::process::Command::new("valgrind")
        .args(["--quiet", "--error-exitcode=99", "--leak-check=no", "--fair-sched=yes"])
        .arg(std::env::current_exe().unwrap())
        .args(["--test-threads=1", "--skip", "the_extension_tests_are_clean_under_memcheck"])
        .env(INNER, "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    let tail: String = err.lines().rev().take(60).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    assert!(
        o.status.success(),
        "memcheck found errors ({}):\n{tail}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout)
    );
}
