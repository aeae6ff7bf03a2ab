//! The RPC link against hostile peers: a client speaking ggml's RPC protocol by hand sends a
//! worker malformed commands (and a thousand mutated ones), silent and unknown connections, and a
//! fake worker written here answers a head with malformed answers. The worker closes each bad
//! connection and serves the next one within its budget; the head reports an error, never a
//! signal or a hang past its bound.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;
mod serving;
mod workers;
use common::{run_within, sluice_command};
use serving::{synth, PATIENCE};
use workers::{SilentProxy, Worker};

/// Budget of the test workers.
const WORKER_MIB: u64 = 256;

// ggml's RPC commands (ggml-rpc.cpp).
const ALLOC_BUFFER: u8 = 0;
const BUFFER_GET_BASE: u8 = 3;
const FREE_BUFFER: u8 = 4;
const SET_TENSOR: u8 = 6;
const GET_TENSOR: u8 = 8;
const COPY_TENSOR: u8 = 9;
const GRAPH_COMPUTE: u8 = 10;
const GET_DEVICE_MEMORY: u8 = 11;
const GET_ALLOC_SIZE: u8 = 13;
const HELLO: u8 = 14;
const DEVICE_COUNT: u8 = 15;
const GRAPH_RECOMPUTE: u8 = 16;
const MEMSET_TENSOR: u8 = 17;

/// ggml's `rpc_tensor`, as it travels (packed, 296 bytes).
#[derive(Clone, Debug, Default)]
struct Tensor {
    id: u64,
    ty: u32,
    buffer: u64,
    ne: [u32; 4],
    nb: [u32; 4],
    op: u32,
    flags: i32,
    src: [u64; 10],
    view_src: u64,
    data: u64,
}

const TENSOR_BYTES: usize = 296;
const GGML_OP_ADD: u32 = 2;
/// `GGML_TENSOR_FLAG_COMPUTE`: the node is computed (ggml skips nodes without it).
const COMPUTE: i32 = 16;

impl Tensor {
    /// A contiguous f32 tensor of `n` elements at `data` in `buffer`.
    fn f32(id: u64, buffer: u64, data: u64, n: u32) -> Tensor {
        Tensor { id, ty: 0, buffer, ne: [n, 1, 1, 1], nb: [4, 4 * n, 4 * n, 4 * n], data, ..Default::default() }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(TENSOR_BYTES);
        b.extend(self.id.to_le_bytes());
        b.extend(self.ty.to_le_bytes());
        b.extend(self.buffer.to_le_bytes());
        self.ne.iter().for_each(|v| b.extend(v.to_le_bytes()));
        self.nb.iter().for_each(|v| b.extend(v.to_le_bytes()));
        b.extend(self.op.to_le_bytes());
        b.extend([0u8; 64]); // op_params
        b.extend(self.flags.to_le_bytes());
        self.src.iter().for_each(|v| b.extend(v.to_le_bytes()));
        b.extend(self.view_src.to_le_bytes());
        b.extend(0u64.to_le_bytes()); // view_offs
        b.extend(self.data.to_le_bytes());
        b.extend([0u8; 64]); // name
        b.extend(1i32.to_le_bytes()); // use_count
        assert_eq!(b.len(), TENSOR_BYTES);
        b
    }
}

/// A client speaking ggml's RPC protocol by hand.
struct Peer {
    stream: TcpStream,
}

impl Peer {
    /// Connects and says HELLO; `None` when the worker closes instead of answering.
    fn hello(endpoint: &str) -> Option<Peer> {
        let stream = TcpStream::connect(endpoint).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut p = Peer { stream };
        let rsp = p.call(HELLO, &[0u8; 24], Some(28))?;
        (rsp[0] == 7).then_some(p)
    }

    /// Sends a command; reads an answer of `answer` bytes when the command has one. `None` when
    /// the worker closed the connection.
    fn call(&mut self, cmd: u8, payload: &[u8], answer: Option<usize>) -> Option<Vec<u8>> {
        let mut msg = vec![cmd];
        msg.extend((payload.len() as u64).to_le_bytes());
        msg.extend(payload);
        self.stream.write_all(&msg).ok()?;
        let n = answer?;
        let mut size = [0u8; 8];
        self.stream.read_exact(&mut size).ok()?;
        if u64::from_le_bytes(size) as usize != n {
            return None;
        }
        let mut rsp = vec![0u8; n];
        self.stream.read_exact(&mut rsp).ok()?;
        Some(rsp)
    }

    /// Whether the worker closed the connection (checked with a command that has an answer).
    fn closed(&mut self) -> bool {
        self.call(DEVICE_COUNT, &[], Some(4)).is_none()
    }

    /// Allocates a buffer of `size` bytes: (remote pointer, base).
    fn alloc(&mut self, size: u64) -> (u64, u64) {
        let mut req = 0u32.to_le_bytes().to_vec();
        req.extend(size.to_le_bytes());
        let rsp = self.call(ALLOC_BUFFER, &req, Some(16)).expect("alloc answered");
        let ptr = u64::from_le_bytes(rsp[..8].try_into().unwrap());
        let base = if ptr == 0 {
            0
        } else {
            let b = self.call(BUFFER_GET_BASE, &ptr.to_le_bytes(), Some(8)).expect("base answered");
            u64::from_le_bytes(b.try_into().unwrap())
        };
        (ptr, base)
    }

    /// SET_TENSOR of `data` at `offset` of `t`.
    fn set(&mut self, t: &Tensor, offset: u64, data: &[u8]) {
        let mut req = t.bytes();
        req.push(0); // no cache
        req.extend(offset.to_le_bytes());
        req.extend(data);
        let _ = self.call(SET_TENSOR, &req, None);
    }

    /// GET_TENSOR of `size` bytes at `offset` of `t`.
    fn get(&mut self, t: &Tensor, offset: u64, size: u64) -> Option<Vec<u8>> {
        let mut req = t.bytes();
        req.extend(offset.to_le_bytes());
        req.extend(size.to_le_bytes());
        self.call(GET_TENSOR, &req, Some(size as usize))
    }

    /// GRAPH_COMPUTE of `nodes` over `tensors`.
    fn graph(&mut self, nodes: &[u64], tensors: &[Tensor]) {
        let mut req = 0u32.to_le_bytes().to_vec();
        req.extend((nodes.len() as u32).to_le_bytes());
        nodes.iter().for_each(|n| req.extend(n.to_le_bytes()));
        req.extend((tensors.len() as u32).to_le_bytes());
        tensors.iter().for_each(|t| req.extend(t.bytes()));
        let _ = self.call(GRAPH_COMPUTE, &req, None);
    }
}

/// A fresh session that allocates, writes, adds two tensors on the worker and reads the sum
/// back: the worker serves correctly.
fn round_trip(endpoint: &str) {
    let mut p = Peer::hello(endpoint).expect("a fresh connection is served");
    let (buf, base) = p.alloc(4096);
    assert_ne!(buf, 0, "the worker refused a 4 KiB buffer");
    let (a, b, c) =
        (Tensor::f32(1, buf, base, 4), Tensor::f32(2, buf, base + 16, 4), Tensor::f32(3, buf, base + 32, 4));
    let floats = |v: [f32; 4]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    p.set(&a, 0, &floats([1.0, 2.0, 3.0, 4.0]));
    p.set(&b, 0, &floats([10.0, 20.0, 30.0, 40.0]));
    let sum = Tensor { op: GGML_OP_ADD, flags: COMPUTE, src: [1, 2, 0, 0, 0, 0, 0, 0, 0, 0], ..c.clone() };
    p.graph(&[3], &[a, b, sum]);
    assert_eq!(p.get(&c, 0, 16).expect("the sum is read back"), floats([11.0, 22.0, 33.0, 44.0]));
    let _ = p.call(FREE_BUFFER, &buf.to_le_bytes(), None);
}

fn start_worker(dir: &Path, extra: &[&str]) -> Worker {
    let mut w = Worker::start_with(dir, "w", WORKER_MIB, None, &[&["--cache-max-mib", "64"], extra].concat());
    assert!(w.alive());
    w
}

#[test]
fn each_malformed_command_closes_its_connection_and_the_worker_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = start_worker(dir.path(), &[]);
    let e = w.endpoint.clone();
    round_trip(&e);
    type Case = (&'static str, fn(&mut Peer, u64, u64));
    let cases: [Case; 17] = [
        ("an unknown tensor type", |p, buf, base| {
            p.set(&Tensor { ty: 9999, ..Tensor::f32(1, buf, base, 4) }, 0, &[0; 16])
        }),
        ("a row that is not whole blocks (q8_0, 33 elements)", |p, buf, base| {
            p.set(
                &Tensor { ty: 8, ne: [33, 1, 1, 1], nb: [34, 34, 34, 34], ..Tensor::f32(1, buf, base, 4) },
                0,
                &[0; 34],
            )
        }),
        ("strides that overflow", |p, buf, base| {
            let t = Tensor { ne: [u32::MAX; 4], nb: [u32::MAX; 4], ..Tensor::f32(1, buf, base, 4) };
            p.set(&t, 0, &[0; 16])
        }),
        ("tensor data past its buffer", |p, buf, base| p.set(&Tensor::f32(1, buf, base + 4090, 4), 0, &[0; 16])),
        ("a set past the tensor", |p, buf, base| p.set(&Tensor::f32(1, buf, base, 4), 8, &[0; 16])),
        ("a set at an offset that wraps", |p, buf, base| p.set(&Tensor::f32(1, buf, base, 4), u64::MAX - 3, &[0; 8])),
        ("a get past the tensor", |p, buf, base| {
            let _ = p.get(&Tensor::f32(1, buf, base, 4), 0, 4096);
        }),
        ("a copy into a smaller tensor", |p, buf, base| {
            let mut req = Tensor::f32(1, buf, base, 512).bytes();
            req.extend(Tensor::f32(2, buf, base + 4088, 2).bytes());
            let _ = p.call(COPY_TENSOR, &req, Some(1));
        }),
        ("an alloc size that overflows", |p, buf, base| {
            let mut req = 0u32.to_le_bytes().to_vec();
            req.extend(Tensor { ne: [u32::MAX; 4], nb: [u32::MAX; 4], ..Tensor::f32(1, buf, base, 4) }.bytes());
            (0..10).for_each(|_| req.extend([0u8; TENSOR_BYTES]));
            let _ = p.call(GET_ALLOC_SIZE, &req, Some(8));
        }),
        ("an unknown op", |p, buf, base| {
            p.graph(&[1], &[Tensor { op: 100_000, ..Tensor::f32(1, buf, base, 4) }]);
        }),
        ("a graph node of id 0", |p, _, _| p.graph(&[0], &[])),
        // About 420 bytes of the worker's memory a node: 2^22 of them took 1.7 GiB of a 256 MiB
        // worker before the graph was bounded (its message is refused unread).
        ("a graph of 2^22 nodes", |p, _, _| p.graph(&(1..=1u64 << 22).collect::<Vec<_>>(), &[])),
        // A message within the bound whose graph structures are not.
        ("a graph of 2^15 nodes over 2^15 tensors", |p, buf, base| {
            let tensors: Vec<Tensor> = (1..=1u64 << 15).map(|id| Tensor::f32(id, buf, base, 4)).collect();
            p.graph(&(1..=1u64 << 15).collect::<Vec<_>>(), &tensors)
        }),
        ("more graph nodes than tensors", |p, buf, base| p.graph(&[1, 2], &[Tensor::f32(1, buf, base, 4)])),
        ("an add without inputs", |p, buf, base| {
            p.graph(&[1], &[Tensor { op: GGML_OP_ADD, flags: COMPUTE, ..Tensor::f32(1, buf, base, 4) }]);
        }),
        ("a message announcing 3 GiB", |p, _, _| {
            let mut msg = vec![SET_TENSOR];
            msg.extend((3u64 << 30).to_le_bytes());
            let _ = p.stream.write_all(&msg);
        }),
        ("an unknown command", |p, _, _| {
            let _ = p.call(200, &[], None);
        }),
    ];
    for (what, send) in cases {
        let mut p = Peer::hello(&e).unwrap_or_else(|| panic!("{what}: no HELLO; log:\n{}", w.log()));
        let (buf, base) = p.alloc(4096);
        send(&mut p, buf, base);
        assert!(p.closed(), "{what}: the connection stayed open");
        assert!(w.alive(), "{what}: the worker died; log:\n{}", w.log());
        round_trip(&e);
    }
    // Recomputing a graph whose buffer was freed is refused, not a use after free.
    let mut p = Peer::hello(&e).unwrap();
    let (buf, base) = p.alloc(4096);
    p.graph(&[1], &[Tensor::f32(1, buf, base, 4)]);
    let _ = p.call(FREE_BUFFER, &buf.to_le_bytes(), None);
    let _ = p.call(GRAPH_RECOMPUTE, &0u32.to_le_bytes(), None);
    assert!(p.closed(), "a recompute after free was served");
    // Zero-size buffers count against the budget and their number is bounded.
    let mut p = Peer::hello(&e).unwrap();
    let refused = (0..2000).filter(|_| p.alloc(0).0 == 0).count();
    assert!(refused >= 2000 - 1024, "only {refused} of 2000 empty buffers refused");
    drop(p);
    // A memset past its tensor.
    let mut p = Peer::hello(&e).unwrap();
    let (buf, base) = p.alloc(4096);
    let mut req = Tensor::f32(1, buf, base, 4).bytes();
    req.extend(8u64.to_le_bytes());
    req.extend(16u64.to_le_bytes());
    req.push(0);
    let _ = p.call(MEMSET_TENSOR, &req, None);
    assert!(p.closed(), "a memset past its tensor was served");
    assert!(w.alive(), "the worker died; log:\n{}", w.log());
    round_trip(&e);
    w.assert_within_cgroup(WORKER_MIB);
}

/// One command of the fuzz's base session, mutated by `rng`: random bytes over a random span,
/// a wrong length, or a truncated message.
fn mutated(rng: &mut ChaCha8Rng, buf: u64, base: u64) -> (u8, Vec<u8>, Option<usize>) {
    let t = Tensor::f32(1, buf, base, 8);
    let mut set = t.bytes();
    set.push(0);
    set.extend(0u64.to_le_bytes());
    set.extend([7u8; 32]);
    let mut get = t.bytes();
    get.extend(0u64.to_le_bytes());
    get.extend(32u64.to_le_bytes());
    let mut graph = 0u32.to_le_bytes().to_vec();
    graph.extend(1u32.to_le_bytes());
    graph.extend(3u64.to_le_bytes());
    graph.extend(3u32.to_le_bytes());
    let c = Tensor::f32(3, buf, base + 64, 8);
    for x in [
        t.clone(),
        Tensor::f32(2, buf, base + 32, 8),
        Tensor { op: GGML_OP_ADD, flags: COMPUTE, src: [1, 2, 0, 0, 0, 0, 0, 0, 0, 0], ..c },
    ] {
        graph.extend(x.bytes());
    }
    let mut copy = t.bytes();
    copy.extend(Tensor::f32(2, buf, base + 32, 8).bytes());
    let mut memset = t.bytes();
    memset.extend([0u8; 17]);
    let mut alloc_size = 0u32.to_le_bytes().to_vec();
    alloc_size.extend(t.bytes());
    (0..10).for_each(|_| alloc_size.extend([0u8; TENSOR_BYTES]));
    let base_cmds: [(u8, Vec<u8>, Option<usize>); 7] = [
        (SET_TENSOR, set, None),
        (GET_TENSOR, get, Some(32)),
        (GRAPH_COMPUTE, graph, None),
        (COPY_TENSOR, copy, Some(1)),
        (MEMSET_TENSOR, memset, None),
        (GET_ALLOC_SIZE, alloc_size, Some(8)),
        (GET_DEVICE_MEMORY, 0u32.to_le_bytes().to_vec(), Some(16)),
    ];
    let (cmd, mut payload, answer) = base_cmds[(rng.next_u32() % 7) as usize].clone();
    match if payload.len() < 8 { 0 } else { rng.next_u32() % 4 } {
        // A few random bytes anywhere.
        0 | 1 => {
            for _ in 0..1 + rng.next_u32() % 4 {
                let at = (rng.next_u32() as usize) % payload.len();
                payload[at] = rng.next_u32() as u8;
            }
        }
        // A random 32- or 64-bit value over a field.
        2 => {
            let at = (rng.next_u32() as usize) % payload.len().saturating_sub(8).max(1);
            let v = rng.next_u64().to_le_bytes();
            let n = if rng.next_u32() % 2 == 0 { 4 } else { 8 };
            payload[at..at + n].copy_from_slice(&v[..n]);
        }
        // Shorter or longer than the command expects.
        _ => {
            let n = (rng.next_u32() as usize) % (payload.len() + 64);
            payload.resize(n, rng.next_u32() as u8);
        }
    }
    (cmd, payload, answer)
}

#[test]
fn a_thousand_mutated_commands_never_end_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = start_worker(dir.path(), &[]);
    let e = w.endpoint.clone();
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    let (mut closed, mut served) = (0, 0);
    let mut p = Peer::hello(&e).unwrap();
    let (mut buf, mut base) = p.alloc(4096);
    // Emulated (qemu) runs take a sample.
    let runs = if common::emulated() { 300 } else { 1200 };
    for i in 0..runs {
        let (cmd, payload, answer) = mutated(&mut rng, buf, base);
        // An answer the mutation changed the size of is not read: the size check would fail.
        let answer = answer.filter(|_| cmd != GET_TENSOR);
        let t0 = Instant::now();
        let ok = p.call(cmd, &payload, answer).is_some() && !p.closed();
        assert!(t0.elapsed() < PATIENCE, "command {i} hung");
        if ok {
            served += 1;
        } else {
            closed += 1;
            assert!(w.alive(), "mutated command {i} ({cmd}) ended the worker; log:\n{}", w.log());
            // The worker serves one connection at a time: this one goes before the next comes.
            let _ = p.stream.shutdown(std::net::Shutdown::Both);
            p = Peer::hello(&e).unwrap_or_else(|| panic!("no HELLO after command {i}; log:\n{}", w.log()));
            (buf, base) = p.alloc(4096);
        }
    }
    println!("{runs} mutated commands: {served} served, {closed} closed the connection, 0 signals");
    assert!(w.alive());
    drop(p);
    round_trip(&e);
    w.assert_within_cgroup(WORKER_MIB);
}

#[test]
fn silent_unlisted_and_keyless_peers_are_dropped_and_the_head_gets_in() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "0123456789abcdef0123456789abcdef\n").unwrap();
    // Only 127.0.0.1, with a key.
    let mut w = start_worker(dir.path(), &["--allow", "127.0.0.1", "--key-file", key.to_str().unwrap()]);
    let e = w.endpoint.clone();
    // A connection that says nothing is dropped within the handshake bound (10 s).
    let mut silent = TcpStream::connect(&e).unwrap();
    silent.set_read_timeout(Some(PATIENCE)).unwrap();
    let t0 = Instant::now();
    let mut sink = Vec::new();
    let _ = silent.read_to_end(&mut sink);
    assert!(t0.elapsed() < Duration::from_secs(60), "a silent connection was held {:?}", t0.elapsed());
    // A peer without the key gets no HELLO answer.
    assert!(Peer::hello(&e).is_none(), "a peer without the key was served");
    // A peer with a wrong key is closed.
    let s = TcpStream::connect(&e).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let wrong = sluice::scaleout::link::LinkKey::new(b"0123456789abcdefXXXXXXXXXXXXXXXX");
    assert!(sluice::scaleout::link::head_handshake(&s, &wrong).is_err());
    assert!(w.alive());
    // From an address not allowed: closed at once.
    let other = TcpStream::connect(("127.0.0.2", w.port()));
    if let Ok(mut other) = other {
        other.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        assert_eq!(other.read(&mut [0u8; 64]).unwrap_or(0), 0, "a peer not in --allow was answered");
    }
    assert!(w.log().contains("not in --allow") || w.log().contains("refused"), "{}", w.log());
    // The head with the key gets in: `plan --rpc` with --rpc-key-file.
    let model = synth(dir.path());
    let o = sluice_command()
        .args(["plan", "--model", model.to_str().unwrap(), "--ctx", "256", "--rpc", &e])
        .args(["--rpc-key-file", key.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stderr), w.log());
    // Without it, the head is told the worker asks for a key, and what to give it.
    let o = sluice_command().args(["plan", "--model", model.to_str().unwrap(), "--rpc", &e]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("asks for a key and this head has none") && err.contains("--rpc-key-file"), "{err}");
    assert!(!err.contains("no RPC server answers there"), "{err}");
    // With another key, that the keys differ.
    let other = dir.path().join("other-key");
    std::fs::write(&other, "fedcba9876543210fedcba9876543210\n").unwrap();
    let o = sluice_command()
        .args(["plan", "--model", model.to_str().unwrap(), "--rpc", &e, "--rpc-key-file", other.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("refused each other") && !err.contains("no RPC server answers there"), "{err}");
    assert!(w.alive());
}

#[test]
fn silent_and_idle_connections_never_keep_a_head_out() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let key = dir.path().join("key");
    std::fs::write(&key, "0123456789abcdef0123456789abcdef\n").unwrap();
    let plan = |endpoint: &str, key: Option<&Path>| {
        let mut cmd = sluice_command();
        cmd.args(["plan", "--model", model.to_str().unwrap(), "--rpc", endpoint]);
        if let Some(k) = key {
            cmd.arg("--rpc-key-file").arg(k);
        }
        cmd.output().unwrap()
    };
    // With a key: three connections that never say a word are identified (and dropped) beside
    // the head, not before it (each took the whole handshake bound, one after the other, and three
    // made the head fail).
    let mut keyed = start_worker(dir.path(), &["--key-file", key.to_str().unwrap()]);
    let silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(&keyed.endpoint).unwrap()).collect();
    let o = plan(&keyed.endpoint, Some(&key));
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stderr), keyed.log());
    drop(silent);
    // One address may not hold more than 8 connections that have not identified themselves.
    let flood: Vec<TcpStream> = (0..12).map(|_| TcpStream::connect(&keyed.endpoint).unwrap()).collect();
    let mut closed_at_once = 0;
    for mut s in &flood {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // a worker with a key speaks first (its challenge): a refused connection reads its end
        let mut b = [0u8; 1];
        if !matches!(s.read(&mut b), Ok(n) if n > 0) {
            closed_at_once += 1;
        }
    }
    assert!(closed_at_once >= 4, "only {closed_at_once} of 12 pending connections refused\n{}", keyed.log());
    assert!(keyed.log().contains("still to identify themselves"), "{}", keyed.log());
    drop(flood);
    assert!(keyed.alive());
    // Without a key: a client that says HELLO and then nothing gives way to the head (it held
    // the worker for good).
    let mut open = start_worker(dir.path(), &[]);
    let idle = Peer::hello(&open.endpoint).expect("the first client is served");
    let silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(&open.endpoint).unwrap()).collect();
    let o = plan(&open.endpoint, None);
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stderr), open.log());
    assert!(open.log().contains("Giving way to a waiting client"), "{}", open.log());
    drop((idle, silent));
    assert!(open.alive());
    round_trip(&open.endpoint);
}

/// A command a head sent: its byte and payload; `None` when the connection ended.
fn read_command(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head).ok()?;
    let mut payload = vec![0u8; u64::from_le_bytes(head[1..9].try_into().unwrap()) as usize];
    s.read_exact(&mut payload).ok()?;
    Some((head[0], payload))
}

/// A worker's answer to HELLO: protocol 7.0.0, no transport capabilities.
fn hello_answer() -> Vec<u8> {
    let mut r = vec![7u8, 0, 0, 0];
    r.extend([0u8; 24]);
    r
}

/// A fake worker on a free port: answers HELLO, then each command with `answer(cmd, payload)`
/// (`None`: say nothing more), for every connection until the test ends.
fn fake_worker(answer: fn(u8, &[u8]) -> Option<Vec<u8>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { return };
            std::thread::spawn(move || loop {
                let Some((cmd, payload)) = read_command(&mut s) else { return };
                let rsp = if cmd == HELLO { Some(hello_answer()) } else { answer(cmd, &payload) };
                match rsp {
                    Some(r) if r.is_empty() => {}
                    Some(r) => {
                        let mut msg = (r.len() as u64).to_le_bytes().to_vec();
                        msg.extend(r);
                        if s.write_all(&msg).is_err() {
                            return;
                        }
                    }
                    // Silent from here on: hold the connection.
                    None => std::thread::sleep(Duration::from_secs(3600)),
                }
            });
        }
    });
    endpoint
}

/// The answers of a well-behaved worker lending 1 GiB, with `bad` swapped in for one command.
fn honest(cmd: u8, payload: &[u8]) -> Vec<u8> {
    match cmd {
        DEVICE_COUNT => 1u32.to_le_bytes().to_vec(),
        1 => 32u64.to_le_bytes().to_vec(),        // alignment
        2 => (1u64 << 40).to_le_bytes().to_vec(), // max size
        GET_DEVICE_MEMORY => [(1u64 << 30).to_le_bytes(), (1u64 << 30).to_le_bytes()].concat(),
        ALLOC_BUFFER => {
            let size = u64::from_le_bytes(payload[4..12].try_into().unwrap());
            [0x1000u64.to_le_bytes(), size.to_le_bytes()].concat()
        }
        BUFFER_GET_BASE => 0x10000u64.to_le_bytes().to_vec(),
        GET_ALLOC_SIZE => 64u64.to_le_bytes().to_vec(),
        COPY_TENSOR | 7 => vec![0],
        _ => Vec::new(),
    }
}

#[test]
fn a_worker_answering_malformed_or_not_at_all_is_an_error_on_the_head() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    type Answer = fn(u8, &[u8]) -> Option<Vec<u8>>;
    let cases: [(&str, Answer); 9] = [
        ("a device count of 2^32-1", |c, p| {
            Some(if c == DEVICE_COUNT { u32::MAX.to_le_bytes().to_vec() } else { honest(c, p) })
        }),
        ("alignment 0", |c, p| Some(if c == 1 { 0u64.to_le_bytes().to_vec() } else { honest(c, p) })),
        ("alignment 3", |c, p| Some(if c == 1 { 3u64.to_le_bytes().to_vec() } else { honest(c, p) })),
        ("more free memory than total", |c, p| {
            Some(if c == GET_DEVICE_MEMORY { [2u64.to_le_bytes(), 1u64.to_le_bytes()].concat() } else { honest(c, p) })
        }),
        ("a short answer", |c, p| Some(if c == DEVICE_COUNT { vec![1] } else { honest(c, p) })),
        ("buffers smaller than asked", |c, p| {
            Some(if c == ALLOC_BUFFER { [0x1000u64.to_le_bytes(), 1u64.to_le_bytes()].concat() } else { honest(c, p) })
        }),
        ("a buffer base of 0", |c, p| {
            Some(if c == BUFFER_GET_BASE { 0u64.to_le_bytes().to_vec() } else { honest(c, p) })
        }),
        // ggml asserts on a buffer that ends past the address space: both ends are checked first
        ("a buffer of 2^64-1 bytes", |c, p| {
            Some(if c == ALLOC_BUFFER {
                [0x1000u64.to_le_bytes(), u64::MAX.to_le_bytes()].concat()
            } else {
                honest(c, p)
            })
        }),
        ("a buffer base of 2^64-4096", |c, p| {
            Some(if c == BUFFER_GET_BASE { (u64::MAX - 4095).to_le_bytes().to_vec() } else { honest(c, p) })
        }),
    ];
    for (what, answer) in cases {
        let endpoint = fake_worker(answer);
        let t0 = Instant::now();
        let o = sluice_command()
            .args(["run", "--model", model.to_str().unwrap(), "--prompt", "hi", "-n", "2", "--rpc", &endpoint])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{what}: {:?}\n{err}", o.status);
        assert!(err.contains(&endpoint), "{what}: the error does not name the worker:\n{err}");
        assert!(t0.elapsed() < PATIENCE, "{what}: took {:?}", t0.elapsed());
    }
    // Silent after the handshake: the call bound ends the wait (set to 10 s: a head still
    // waiting at the default's 60 s did not take the setting).
    let endpoint = fake_worker(|c, p| if c == DEVICE_COUNT { None } else { Some(honest(c, p)) });
    let t0 = Instant::now();
    let o = sluice_command()
        .args(["plan", "--model", model.to_str().unwrap(), "--rpc", &endpoint, "--rpc-call-timeout", "10"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(t0.elapsed() < Duration::from_secs(60), "a silent worker held the head {:?}", t0.elapsed());
}

#[test]
fn a_worker_that_stops_answering_mid_run_fails_it_within_one_call_bound() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let w = start_worker(dir.path(), &[]);
    // Silent after the tenth graph: mid-generation.
    let proxy = SilentProxy::start(&w.endpoint, 10);
    // One call bound (10 s here) ends the wait; every request after it completes at once instead
    // of reconnecting (each reconnection took a connect and a handshake bound, for ever).
    let (status, err, took) = run_within(
        sluice_command().args(["run", "--model", model.to_str().unwrap(), "--prompt", "hi", "-n", "4000"]).args([
            "--rpc",
            &proxy.endpoint,
            "--rpc-call-timeout",
            "10",
        ]),
        Duration::from_secs(90),
    );
    let status = status.unwrap_or_else(|| panic!("run still waited on the silent worker after {took:?}:\n{err}"));
    println!("run failed {took:?} after the start:\n{err}");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains(&proxy.endpoint), "the error does not name the worker:\n{err}");
}

#[test]
fn a_thousand_mutated_answers_never_end_or_hang_the_head() {
    // In this process: the head's side of ggml's RPC client, with a short call bound.
    ggml_sys::rpc_client_options(Duration::from_secs(1), Duration::from_secs(1), None);
    let mut rng = ChaCha8Rng::seed_from_u64(30);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let runs = if common::emulated() { 250 } else { 1000 };
    // Every connection the head makes gets its own mutation (the head reconnects after each
    // failure, and ggml opens one per request when none is held).
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { return };
            let mut rng = ChaCha8Rng::seed_from_u64(rng.next_u64());
            // Which answer (HELLO first) is mutated, and how.
            let victim = rng.next_u32() % 5;
            let mut n = 0;
            while let Some((cmd, payload)) = read_command(&mut s) {
                let mut rsp = if cmd == HELLO { hello_answer() } else { honest(cmd, &payload) };
                let mut size = rsp.len() as u64;
                if n == victim {
                    match rng.next_u32() % 32 {
                        0..=13 => rsp.iter_mut().for_each(|b| *b = rng.next_u32() as u8),
                        14..=23 => size = rng.next_u64() % 64,
                        24..=30 => break,                                     // close mid-conversation
                        _ => std::thread::sleep(Duration::from_millis(1500)), // silent past the bound
                    }
                }
                n += 1;
                let mut msg = size.to_le_bytes().to_vec();
                msg.extend(&rsp);
                if s.write_all(&msg).is_err() {
                    break;
                }
            }
        }
    });
    let (mut ok, mut failed) = (0, 0);
    let endpoint = format!("127.0.0.1:{port}");
    for i in 0..runs {
        let t0 = Instant::now();
        let r = ggml_sys::RpcDevice::connect(&endpoint).and_then(|d| d.memory());
        assert!(t0.elapsed() < Duration::from_secs(30), "answer set {i} held the head {:?}", t0.elapsed());
        match r {
            Ok((free, total)) => {
                assert!(free <= total, "answer set {i}: {free} free of {total}");
                ok += 1;
            }
            Err(_) => failed += 1,
        }
    }
    println!("{runs} mutated answer sets: {ok} connected, {failed} refused, 0 signals, 0 hangs");
}
