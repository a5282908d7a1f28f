//! Mixed torch/consort `gloo` groups, in real processes: torch ranks run
//! `torch_gloo.py`, consort ranks run [`GlooBackend`] in this process, and
//! every arrangement of the two for 2 to 4 ranks runs one script of every
//! op the backend speaks, over several dtypes, lengths (0, 1, ones the
//! world does not divide, one past Gloo's 1 MiB segment), a subgroup and
//! send/recv. Every rank must report the result a reference computes.
//!
//! These need a Python with torch, like torch_interop.rs: `#[ignore]`d in
//! the default run; CI runs them with `CONSORT_TORCH_PYTHON` set and
//! `--ignored`.

use std::{
    process::{Command, Stdio},
    sync::Arc,
    time::Duration,
};

use consort_comm::{
    Backend, BufferMut, CallOptions, DType, HostSliceMut, Op, ProcessGroup, ReduceOp, store::Store,
};
use consort_tcp::{GlooBackend, GlooOptions, TcpStore, TcpStoreOptions, TcpStoreServer};
use half::{bf16, f16};
use serde_json::{Value, json};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/torch_gloo.py");

fn python() -> String {
    std::env::var("CONSORT_TORCH_PYTHON").expect(
        "set CONSORT_TORCH_PYTHON to a python that has torch installed \
         (e.g. python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch)",
    )
}

/// The op script every rank runs (the same JSON goes to torch's ranks).
fn script(world: usize) -> Vec<Value> {
    let last = world - 1;
    let rest: Vec<usize> = (1..world).collect();
    let all: Vec<usize> = (0..world).rev().collect();
    vec![
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f32", "n": 5}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f32", "n": 300_001}),
        json!({"op": "all_reduce", "reduce": "max", "dtype": "i64", "n": 7}),
        json!({"op": "all_reduce", "reduce": "avg", "dtype": "f64", "n": 3}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "bf16", "n": 33}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f16", "n": 1}),
        json!({"op": "all_reduce", "reduce": "min", "dtype": "i32", "n": 9}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "u8", "n": 4}),
        json!({"op": "all_reduce", "reduce": "prod", "dtype": "f32", "n": 6}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "i8", "n": 0}),
        json!({"op": "broadcast", "dtype": "f32", "n": 1000, "root": last}),
        json!({"op": "broadcast", "dtype": "i64", "n": 0, "root": 0}),
        json!({"op": "broadcast", "dtype": "u8", "n": 3, "root": 1 % world}),
        json!({"op": "all_gather", "dtype": "f32", "n": 3}),
        json!({"op": "all_gather", "dtype": "bf16", "n": 1}),
        json!({"op": "all_gather", "dtype": "u8", "n": 5}),
        json!({"op": "all_gather", "dtype": "f64", "n": 0}),
        json!({"op": "reduce_scatter", "reduce": "sum", "dtype": "f32", "n": 4}),
        json!({"op": "reduce_scatter", "reduce": "max", "dtype": "i64", "n": 1}),
        json!({"op": "barrier"}),
        json!({"op": "send_recv", "dtype": "f32", "n": 10, "tag": 3}),
        json!({"op": "new_group", "ranks": rest}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f32", "n": 8, "group": 21}),
        json!({"op": "broadcast", "dtype": "f64", "n": 4, "root": 0, "group": 21}),
        json!({"op": "new_group", "ranks": all}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "i64", "n": 3, "group": 24}),
        json!({"op": "barrier", "group": 24}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f32", "n": 2}),
        json!({"op": "gather", "dtype": "f32", "n": 3, "root": last}),
        json!({"op": "scatter", "dtype": "i64", "n": 2, "root": 0}),
        json!({"op": "all_to_all", "dtype": "bf16", "n": 3, "frac": true}),
        json!({"op": "gather", "dtype": "u8", "n": 0, "root": 0}),
        json!({"op": "reduce", "reduce": "sum", "dtype": "f32", "n": 5, "root": last}),
        json!({"op": "reduce", "reduce": "avg", "dtype": "bf16", "n": 21, "root": 0, "frac": true}),
        json!({"op": "reduce", "reduce": "max", "dtype": "i32", "n": 1, "root": 1 % world}),
        json!({"op": "reduce", "reduce": "sum", "dtype": "f32", "n": 2_621_443, "root": 0, "frac": true}),
        // Sums that round: the bytes show the reduction's order.
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f32", "n": 37, "frac": true}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "bf16", "n": 50, "frac": true}),
        json!({"op": "all_reduce", "reduce": "avg", "dtype": "f32", "n": 9, "frac": true}),
        json!({"op": "all_reduce", "reduce": "avg", "dtype": "bf16", "n": 9, "frac": true}),
        json!({"op": "all_reduce", "reduce": "max", "dtype": "f16", "n": 5, "frac": true}),
        json!({"op": "reduce_scatter", "reduce": "sum", "dtype": "bf16", "n": 3, "frac": true}),
        // Past 2 x world segments of 1 MiB: several segments per rank.
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f32", "n": 2_621_443, "frac": true}),
    ]
}

fn dtype(s: &Value) -> DType {
    match s["dtype"].as_str().unwrap() {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "i32" => DType::I32,
        "i64" => DType::I64,
        "u8" => DType::U8,
        "i8" => DType::I8,
        other => panic!("dtype {other}"),
    }
}

fn reduce(s: &Value) -> ReduceOp {
    match s["reduce"].as_str().unwrap() {
        "sum" => ReduceOp::Sum,
        "max" => ReduceOp::Max,
        "min" => ReduceOp::Min,
        "prod" => ReduceOp::Prod,
        "avg" => ReduceOp::Avg,
        other => panic!("reduce {other}"),
    }
}

/// The inputs, as torch_gloo.py's `data`.
fn data(rank: usize, step: usize, n: usize, dt: DType) -> Vec<f64> {
    data_of(rank, step, n, dt, false)
}

/// As torch_gloo.py's `data`: with `frac`, thirds (in f32): sums that round.
fn data_of(rank: usize, step: usize, n: usize, dt: DType, frac: bool) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let v = (i * 7 + rank * 3 + step * 5) % 11;
            let v = if matches!(dt, DType::U8 | DType::I8) {
                v % 5
            } else {
                v
            };
            if frac {
                f64::from(v as f32 / 3.0)
            } else {
                v as f64
            }
        })
        .collect()
}

/// Bytes in 8-byte-aligned memory, as a tensor's.
struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    fn zeroed(len: usize) -> Aligned {
        Aligned {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

fn to_bytes(v: &[f64], dt: DType) -> Aligned {
    let b = packed(v, dt);
    let mut a = Aligned::zeroed(b.len());
    a.bytes_mut().copy_from_slice(&b);
    a
}

fn packed(v: &[f64], dt: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * dt.size_bytes());
    for &x in v {
        match dt {
            DType::F32 => out.extend_from_slice(&(x as f32).to_ne_bytes()),
            DType::F64 => out.extend_from_slice(&x.to_ne_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(x).to_ne_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(x).to_ne_bytes()),
            DType::I32 => out.extend_from_slice(&(x as i32).to_ne_bytes()),
            DType::I64 => out.extend_from_slice(&(x as i64).to_ne_bytes()),
            DType::U8 => out.push(x as u8),
            DType::I8 => out.push(x as i8 as u8),
            other => panic!("{other}"),
        }
    }
    out
}

fn from_bytes(b: &[u8], dt: DType) -> Vec<f64> {
    b.chunks_exact(dt.size_bytes())
        .map(|c| match dt {
            DType::F32 => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
            DType::F16 => f16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
            DType::BF16 => bf16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
            DType::I32 => i32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::I64 => i64::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::U8 => c[0] as f64,
            DType::I8 => c[0] as i8 as f64,
            other => panic!("{other}"),
        })
        .collect()
}

fn fold(parts: &[Vec<f64>], op: ReduceOp, dt: DType) -> Vec<f64> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        for (a, b) in acc.iter_mut().zip(p) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => *a + b,
                ReduceOp::Max => a.max(*b),
                ReduceOp::Min => a.min(*b),
                ReduceOp::Prod => *a * b,
                _ => unreachable!(),
            };
        }
    }
    if matches!(op, ReduceOp::Avg) {
        acc.iter_mut().for_each(|a| *a /= parts.len() as f64);
    }
    if dt == DType::U8 {
        acc.iter_mut().for_each(|a| *a = (*a as u64 % 256) as f64);
    }
    acc
}

/// Who is in the group a step runs on, and this rank's place in it.
fn members(script: &[Value], s: &Value, world: usize) -> Vec<usize> {
    match s.get("group") {
        None => (0..world).collect(),
        Some(g) => {
            let mut r: Vec<usize> = script[g.as_u64().unwrap() as usize]["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            r.sort_unstable();
            r
        }
    }
}

/// What `rank` must report for each step.
fn expected(script: &[Value], world: usize, rank: usize) -> Vec<Value> {
    script
        .iter()
        .enumerate()
        .map(|(step, s)| {
            let op = s["op"].as_str().unwrap();
            if op == "new_group" {
                return Value::Null;
            }
            let m = members(script, s, world);
            let Some(me) = m.iter().position(|&r| r == rank) else {
                return Value::Null;
            };
            if op == "barrier" {
                return json!([[], ""]);
            }
            let (dt, n) = (dtype(s), s["n"].as_u64().unwrap() as usize);
            let frac = s.get("frac").is_some();
            let data = |r, step, n, dt| data_of(r, step, n, dt, frac);
            let g = m.len();
            let v = match op {
                "all_reduce" => {
                    let parts: Vec<_> = (0..g).map(|r| data(r, step, n, dt)).collect();
                    fold(&parts, reduce(s), dt)
                }
                "broadcast" => data(s["root"].as_u64().unwrap() as usize, step, n, dt),
                "all_gather" => (0..g).flat_map(|r| data(r, step, n, dt)).collect(),
                "reduce_scatter" => {
                    let parts: Vec<_> = (0..g).map(|r| data(r, step, n * g, dt)).collect();
                    fold(&parts, reduce(s), dt)[me * n..(me + 1) * n].to_vec()
                }
                "send_recv" => data((rank + world - 1) % world, step, n, dt),
                "gather" | "reduce" if me != s["root"].as_u64().unwrap() as usize => {
                    return Value::Null;
                }
                "reduce" => {
                    let parts: Vec<_> = (0..g).map(|r| data(r, step, n, dt)).collect();
                    fold(&parts, reduce(s), dt)
                }
                "gather" => (0..g).flat_map(|r| data(r, step, n, dt)).collect(),
                "scatter" => data(s["root"].as_u64().unwrap() as usize, step, n * g, dt)
                    [me * n..(me + 1) * n]
                    .to_vec(),
                "all_to_all" => (0..g)
                    .flat_map(|r| data(r, step, n * g, dt)[me * n..(me + 1) * n].to_vec())
                    .collect(),
                other => panic!("op {other}"),
            };
            json!([v, ""])
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn buf(dt: DType, a: &mut Aligned) -> BufferMut<'_> {
    BufferMut::Host(HostSliceMut::from_bytes(dt, a.bytes_mut()).unwrap())
}

fn input(dt: DType, a: &Aligned) -> consort_comm::Buffer<'_> {
    consort_comm::Buffer::Host(consort_comm::HostSlice::from_bytes(dt, a.bytes()).unwrap())
}

/// reduce, gather, scatter and all_to_all on `pg`: the output, or `None`
/// where this rank has none (a reduce's or a gather's non-root).
async fn run_parts(
    pg: &ProcessGroup,
    s: &Value,
    step: usize,
    dt: DType,
    n: usize,
) -> Option<Aligned> {
    let b = pg.backend();
    let (grank, gsize) = (pg.rank(), pg.world_size());
    let frac = s.get("frac").is_some();
    let data = |r, step, n, dt| data_of(r, step, n, dt, frac);
    match s["op"].as_str().unwrap() {
        "reduce" => {
            let root = s["root"].as_u64().unwrap() as usize;
            let mut v = to_bytes(&data(grank, step, n, dt), dt);
            let op = Op::Reduce {
                buf: buf(dt, &mut v),
                op: reduce(s),
            };
            b.submit(op, &CallOptions::root(root)).await.unwrap();
            if grank != root {
                return None;
            }
            Some(v)
        }
        "gather" => {
            let root = s["root"].as_u64().unwrap() as usize;
            let i = to_bytes(&data(grank, step, n, dt), dt);
            let mut o = Aligned::zeroed(i.len * gsize);
            let output = (grank == root).then(|| buf(dt, &mut o));
            let op = Op::Gather {
                output,
                input: input(dt, &i),
            };
            b.submit(op, &CallOptions::root(root)).await.unwrap();
            if grank != root {
                return None;
            }
            Some(o)
        }
        "scatter" => {
            let root = s["root"].as_u64().unwrap() as usize;
            let i = to_bytes(&data(grank, step, n * gsize, dt), dt);
            let mut o = Aligned::zeroed(n * dt.size_bytes());
            let op = Op::Scatter {
                output: buf(dt, &mut o),
                input: (grank == root).then(|| input(dt, &i)),
            };
            b.submit(op, &CallOptions::root(root)).await.unwrap();
            Some(o)
        }
        "all_to_all" => {
            let i = to_bytes(&data(grank, step, n * gsize, dt), dt);
            let mut o = Aligned::zeroed(i.len);
            let op = Op::AllToAll {
                output: buf(dt, &mut o),
                input: input(dt, &i),
                output_splits: None,
                input_splits: None,
            };
            b.submit(op, &CallOptions::default()).await.unwrap();
            Some(o)
        }
        other => panic!("op {other}"),
    }
}

/// One step of the script on `pg`, as torch_gloo.py runs it: the result's
/// values and bytes.
async fn run_step(pg: &ProcessGroup, s: &Value, step: usize, rank: usize, world: usize) -> Value {
    let op = s["op"].as_str().unwrap();
    let b = pg.backend();
    let (grank, gsize) = (pg.rank(), pg.world_size());
    if op == "barrier" {
        b.barrier(&CallOptions::default()).await.unwrap();
        return json!([[], ""]);
    }
    let (dt, n) = (dtype(s), s["n"].as_u64().unwrap() as usize);
    let frac = s.get("frac").is_some();
    let data = |r, step, n, dt| data_of(r, step, n, dt, frac);
    let out = match op {
        "all_reduce" => {
            let mut v = to_bytes(&data(grank, step, n, dt), dt);
            let op = Op::AllReduce {
                buf: buf(dt, &mut v),
                op: reduce(s),
            };
            b.submit(op, &CallOptions::default()).await.unwrap();
            v
        }
        "broadcast" => {
            let mut v = to_bytes(&data(grank, step, n, dt), dt);
            let root = s["root"].as_u64().unwrap() as usize;
            b.submit(
                Op::Broadcast {
                    buf: buf(dt, &mut v),
                },
                &CallOptions::root(root),
            )
            .await
            .unwrap();
            v
        }
        "all_gather" => {
            let i = to_bytes(&data(grank, step, n, dt), dt);
            let mut o = Aligned::zeroed(i.len * gsize);
            let op = Op::AllGather {
                output: buf(dt, &mut o),
                input: input(dt, &i),
            };
            b.submit(op, &CallOptions::default()).await.unwrap();
            o
        }
        "reduce_scatter" => {
            let i = to_bytes(&data(grank, step, n * gsize, dt), dt);
            let mut o = Aligned::zeroed(n * dt.size_bytes());
            let op = Op::ReduceScatter {
                output: buf(dt, &mut o),
                input: input(dt, &i),
                op: reduce(s),
            };
            b.submit(op, &CallOptions::default()).await.unwrap();
            o
        }
        "reduce" | "gather" | "scatter" | "all_to_all" => match run_parts(pg, s, step, dt, n).await
        {
            Some(o) => o,
            None => return Value::Null,
        },
        "send_recv" => {
            let t = to_bytes(&data(rank, step, n, dt), dt);
            let mut r = Aligned::zeroed(t.len);
            let tag = s["tag"].as_u64().unwrap() as u32;
            let o = CallOptions::default().with_tag(tag);
            let (nxt, prv) = ((rank + 1) % world, (rank + world - 1) % world);
            // A send returns once the peer has posted its receive
            // (as torch's): even ranks send first, odd ones receive.
            let send = Op::Send {
                buf: input(dt, &t),
                dst: nxt,
            };
            let recv = Op::Recv {
                buf: buf(dt, &mut r),
                src: prv,
            };
            if rank.is_multiple_of(2) {
                b.submit(send, &o).await.unwrap();
                b.submit(recv, &o).await.unwrap();
            } else {
                b.submit(recv, &o).await.unwrap();
                b.submit(send, &o).await.unwrap();
            }
            r
        }
        other => panic!("op {other}"),
    };
    json!([from_bytes(out.bytes(), dt), hex(out.bytes())])
}

/// Consort's rank `rank` of `world` in the job whose store listens on
/// `port`, with op timeout `timeout`.
async fn join(port: u16, rank: usize, world: usize, timeout: Duration) -> GlooBackend {
    let store = TcpStore::connect(
        format!("127.0.0.1:{port}"),
        TcpStoreOptions {
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(60),
            secret: None,
        },
    )
    .await
    .unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    let opts = GlooOptions {
        timeout,
        ip: Some("127.0.0.1".parse().unwrap()),
        ..Default::default()
    };
    GlooBackend::connect(store, rank, world, opts)
        .await
        .unwrap()
}

/// Runs the script as consort rank `rank`, returning what torch_gloo.py
/// prints.
async fn consort_rank(port: u16, rank: usize, world: usize, script: Vec<Value>) -> Vec<Value> {
    let world_pg = ProcessGroup::new(Arc::new(
        join(port, rank, world, Duration::from_secs(60)).await,
    ));
    let mut groups: Vec<Option<ProcessGroup>> = vec![None; script.len()];
    let mut results = Vec::new();
    for (step, s) in script.iter().enumerate() {
        let op = s["op"].as_str().unwrap();
        if op == "new_group" {
            let ranks: Vec<usize> = members(&script, &json!({"group": step}), world);
            groups[step] = world_pg.new_group(&ranks).await.unwrap();
            results.push(Value::Null);
            continue;
        }
        let pg = match s.get("group") {
            None => &world_pg,
            Some(g) => match &groups[g.as_u64().unwrap() as usize] {
                Some(pg) => pg,
                None => {
                    results.push(Value::Null);
                    continue;
                }
            },
        };
        results.push(run_step(pg, s, step, rank, world).await);
    }
    results
}

/// Runs one arrangement: bit `r` of `torch_mask` set means torch runs
/// rank `r`.
/// Runs one arrangement and returns every rank's results; checks them
/// against the reference values, and bit for bit against `all_torch` (the
/// all-torch arrangement's results) when given.
async fn arrangement(
    world: usize,
    torch_mask: u32,
    all_torch: Option<&[Vec<Value>]>,
) -> Vec<Vec<Value>> {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().port();
    let script = script(world);
    let text = serde_json::to_string(&script).unwrap();
    let mut children = Vec::new();
    let mut ours = Vec::new();
    for rank in 0..world {
        if torch_mask & (1 << rank) != 0 {
            let child = Command::new(python())
                .args([
                    SCRIPT,
                    &port.to_string(),
                    &rank.to_string(),
                    &world.to_string(),
                    &text,
                ])
                .env("GLOO_SOCKET_IFNAME", "lo")
                .stdout(Stdio::piped())
                .spawn()
                .expect("start python");
            children.push((rank, child));
        } else {
            ours.push((
                rank,
                tokio::spawn(consort_rank(port, rank, world, script.clone())),
            ));
        }
    }
    let mut got = vec![Vec::new(); world];
    for (rank, task) in ours {
        got[rank] = tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .unwrap_or_else(|_| panic!("consort rank {rank} of {world} timed out"))
            .unwrap();
    }
    for (rank, child) in children {
        let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "torch rank {rank} of {world} failed: {out:?}"
        );
        got[rank] = serde_json::from_slice(&out.stdout).unwrap();
    }
    for (rank, g) in got.iter().enumerate() {
        let want = expected(&script, world, rank);
        for (step, (a, b)) in g.iter().zip(&want).enumerate() {
            let tol = match (script[step].get("frac"), script[step].get("dtype")) {
                (Some(_), Some(d)) if d == "bf16" || d == "f16" => 3e-2,
                (Some(_), _) => 1e-5,
                _ => 1e-6,
            };
            assert!(
                close(&a[0], &b[0], tol),
                "world {world}, torch ranks {torch_mask:#b}: rank {rank} step {step} ({}) got \
                 {} but the reference is {}",
                script[step],
                a[0],
                b[0]
            );
            if let Some(t) = all_torch {
                assert_eq!(
                    a[1], t[rank][step][1],
                    "world {world}, torch ranks {torch_mask:#b}: rank {rank} step {step} ({}): \
                     the bytes differ from an all-torch group's",
                    script[step]
                );
            }
        }
        assert_eq!(g.len(), want.len());
    }
    server.shutdown().await;
    got
}

fn close(a: &Value, b: &Value, tol: f64) -> bool {
    match (a, b) {
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len()
                && x.iter().zip(y).all(|(p, q)| {
                    let (p, q) = (p.as_f64().unwrap(), q.as_f64().unwrap());
                    (p - q).abs() <= tol * q.abs().max(1.0)
                })
        }
        _ => a == b,
    }
}

async fn every_arrangement(world: usize) {
    // torch alone first: its bytes are the reference for every mix of torch
    // and consort ranks, and for consort alone.
    let all = (1u32 << world) - 1;
    let reference = arrangement(world, all, None).await;
    for mask in 0..all {
        arrangement(world, mask, Some(&reference)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs torch: set CONSORT_TORCH_PYTHON and pass --ignored"]
async fn mixed_groups_of_two() {
    every_arrangement(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs torch: set CONSORT_TORCH_PYTHON and pass --ignored"]
async fn mixed_groups_of_three() {
    every_arrangement(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs torch: set CONSORT_TORCH_PYTHON and pass --ignored"]
async fn mixed_groups_of_four() {
    every_arrangement(4).await;
}

/// Torch's rank 0 and consort's rank 1 call different collectives: torch's
/// rank fails with its own error (or timeout), consort's with its own, and
/// neither returns a result.
async fn mismatched(torch_step: Value, ours: Value) {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().port();
    let text = serde_json::to_string(&vec![torch_step]).unwrap();
    let child = Command::new(python())
        .args([SCRIPT, &port.to_string(), "0", "2", &text])
        .env("GLOO_SOCKET_IFNAME", "lo")
        .env("TORCH_GLOO_TIMEOUT", "5")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start python");
    let b = join(port, 1, 2, Duration::from_secs(5)).await;
    let (dt, n) = (dtype(&ours), ours["n"].as_u64().unwrap() as usize);
    let mut v = to_bytes(&data(1, 0, n, dt), dt);
    let op = match ours["op"].as_str().unwrap() {
        "all_reduce" => Op::AllReduce {
            buf: buf(dt, &mut v),
            op: reduce(&ours),
        },
        "broadcast" => Op::Broadcast {
            buf: buf(dt, &mut v),
        },
        other => panic!("op {other}"),
    };
    let t = std::time::Instant::now();
    let root = ours.get("root").map_or(0, |r| r.as_u64().unwrap() as usize);
    let res = tokio::time::timeout(
        Duration::from_secs(60),
        b.submit(op, &CallOptions::root(root)),
    )
    .await
    .expect("consort's rank hung past its timeout");
    assert!(
        res.is_err(),
        "consort's rank returned {res:?} from a mismatched call"
    );
    eprintln!("consort: {} after {:?}", res.unwrap_err(), t.elapsed());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "torch's rank succeeded in a mismatched call: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    eprintln!("torch: {last}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs torch: set CONSORT_TORCH_PYTHON and pass --ignored"]
async fn a_different_collective_fails_on_both_sides() {
    mismatched(
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f32", "n": 5}),
        json!({"op": "broadcast", "dtype": "f32", "n": 5}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs torch: set CONSORT_TORCH_PYTHON and pass --ignored"]
async fn a_different_size_fails_on_both_sides() {
    mismatched(
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f32", "n": 5}),
        json!({"op": "all_reduce", "reduce": "sum", "dtype": "f32", "n": 6}),
    )
    .await;
    // The root sends more than torch's rank can take (a root that sends
    // less would succeed, under torch as here: only receivers check).
    mismatched(
        json!({"op": "broadcast", "dtype": "f32", "n": 4, "root": 1}),
        json!({"op": "broadcast", "dtype": "f32", "n": 9, "root": 1}),
    )
    .await;
}
