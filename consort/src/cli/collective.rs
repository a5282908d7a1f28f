//! `consort bench` for collectives: launches N ranks (OS processes on
//! loopback for tcp, tasks for sim), times each op like
//! `shared/bench/gloo_bench.py` (a barrier, then one op timed on rank 0,
//! median over the iterations), checks every result, and prints an
//! nccl-tests-style table.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::Arc,
    time::Instant,
};

use consort::{CommError, OpKind, ProcessGroup, ReduceOp, with_dtype};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::table::Table;

/// What every rank measures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct BenchSpec {
    pub(crate) backend: String,
    pub(crate) world: usize,
    pub(crate) ops: Vec<String>,
    pub(crate) sizes: Vec<usize>,
    pub(crate) dtype: String,
    pub(crate) iters: Option<usize>,
}

/// One measured row (rank 0's view, with every rank's #wrong summed in).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Row {
    op: String,
    bytes: usize,
    count: usize,
    time_us: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
    wrong: u64,
}

fn bus_factor(op: OpKind, n: usize) -> f64 {
    let n = n as f64;
    match op {
        OpKind::AllReduce => 2.0 * (n - 1.0) / n,
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => (n - 1.0) / n,
        _ => 1.0,
    }
}

pub(crate) fn parse_ops(s: &str) -> Result<Vec<OpKind>, String> {
    s.split(',')
        .map(|o| match o.trim() {
            "all_reduce" => Ok(OpKind::AllReduce),
            "broadcast" => Ok(OpKind::Broadcast),
            "reduce_scatter" => Ok(OpKind::ReduceScatter),
            "all_gather" => Ok(OpKind::AllGather),
            "all_to_all" | "all_to_all_single" => Ok(OpKind::AllToAll),
            other => Err(format!(
                "unknown op {other:?}: expected all_reduce, broadcast, reduce_scatter, all_gather or all_to_all"
            )),
        })
        .collect()
}

/// Counts elements of `got` that differ from `want(i)`.
fn wrong<T: PartialEq + Copy>(got: &[T], want: impl Fn(usize) -> T) -> u64 {
    got.iter()
        .enumerate()
        .filter(|(i, g)| **g != want(*i))
        .count() as u64
}

/// One rank's measurements for every op and size.
async fn bench_rank(pg: ProcessGroup, spec: &BenchSpec) -> Result<Vec<Row>, CommError> {
    let (r, n) = (pg.rank(), pg.world_size());
    let dtype = super::parse_dtypes(&spec.dtype)
        .map_err(CommError::invalid)?
        .0[0];
    let ops = parse_ops(&spec.ops.join(",")).map_err(CommError::invalid)?;
    let mut rows = Vec::new();
    for &op in &ops {
        for &bytes in &spec.sizes {
            let row = with_dtype!(dtype, T => {
                let count = (bytes / size_of::<T>()).max(n) / n * n; // divisible by n
                let v = |x: usize| -> T { T::small(x) };
                let part = count / n;
                // Correctness run: small per-rank values, checked exactly.
                let mut bad = 0u64;
                match op {
                    OpKind::AllReduce => {
                        let mut x: Vec<T> = (0..count).map(|i| v(r + i % 7)).collect();
                        pg.all_reduce(&mut x, ReduceOp::Sum).await?;
                        bad += wrong(&x, |i| v((0..n).map(|q| q + i % 7).sum()));
                    }
                    OpKind::Broadcast => {
                        let mut x: Vec<T> = (0..count).map(|i| v(r * 3 + i % 5)).collect();
                        pg.broadcast(&mut x, 0).await?;
                        bad += wrong(&x, |i| v(i % 5));
                    }
                    OpKind::ReduceScatter => {
                        let x: Vec<T> = (0..count).map(|i| v(r + i % 7)).collect();
                        let mut out = vec![v(0); part];
                        pg.reduce_scatter(&mut out, &x, ReduceOp::Sum).await?;
                        bad += wrong(&out, |i| v((0..n).map(|q| q + (r * part + i) % 7).sum()));
                    }
                    OpKind::AllGather => {
                        let x: Vec<T> = (0..part).map(|i| v(r + i % 3)).collect();
                        let out = pg.all_gather_vec(&x).await?;
                        bad += wrong(&out, |i| v(i / part.max(1) + (i % part.max(1)) % 3));
                    }
                    _ => {
                        let x: Vec<T> = (0..count).map(|i| v(r * 2 + i / part.max(1))).collect();
                        let mut out = vec![v(0); count];
                        pg.all_to_all_single(&mut out, &x, None, None).await?;
                        bad += wrong(&out, |i| v((i / part.max(1)) * 2 + r));
                    }
                }
                // Timed runs, as gloo_bench.py does them.
                let iters = spec.iters.unwrap_or_else(|| (2e8 as usize / bytes.max(1)).clamp(3, 200));
                let mut a: Vec<T> = vec![v(1); count];
                let mut b: Vec<T> = vec![v(0); count];
                let mut times = Vec::with_capacity(iters);
                for it in 0..iters + 2 {
                    pg.barrier().await?;
                    let s = Instant::now();
                    match op {
                        OpKind::AllReduce => pg.all_reduce(&mut a, ReduceOp::Sum).await?,
                        OpKind::Broadcast => pg.broadcast(&mut a, 0).await?,
                        OpKind::ReduceScatter => pg.reduce_scatter(&mut b[..part], &a, ReduceOp::Sum).await?,
                        OpKind::AllGather => pg.all_gather(&mut b, &a[..part]).await?,
                        _ => pg.all_to_all_single(&mut b, &a, None, None).await?,
                    }
                    if it >= 2 {
                        times.push(s.elapsed().as_secs_f64());
                    }
                }
                times.sort_by(f64::total_cmp);
                let med = times[times.len() / 2];
                let moved = count * size_of::<T>();
                let mut total_bad = [bad];
                pg.all_reduce(&mut total_bad, ReduceOp::Sum).await?;
                let alg = moved as f64 / med / 1e9;
                Row {
                    op: op.name().trim_end_matches("_single").to_string(),
                    bytes: moved,
                    count,
                    time_us: med * 1e6,
                    algbw_gbs: alg,
                    busbw_gbs: alg * bus_factor(op, n),
                    wrong: total_bad[0],
                }
            });
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Small integers (below 64) as an element, exact in every dtype.
trait Small: consort::Element + Copy + PartialEq {
    fn small(x: usize) -> Self;
}

macro_rules! small {
    ($($t:ty => $conv:expr),* $(,)?) => {$(
        impl Small for $t {
            fn small(x: usize) -> Self {
                $conv((x % 64) as u8)
            }
        }
    )*};
}
small! {
    f32 => f32::from, f64 => f64::from,
    consort::half::f16 => consort::half::f16::from, consort::half::bf16 => consort::half::bf16::from,
    i8 => |v: u8| v as i8, u8 => |v: u8| v, i32 => i32::from, i64 => i64::from, u32 => u32::from, u64 => u64::from,
}

/// One rank of a world formed from the environment (torchrun's variables):
/// joins, benches, leaves. Returns rank 0's rows, and `None` elsewhere.
async fn rank_from_env(
    spec: &mut BenchSpec,
) -> Result<Option<Vec<Row>>, Box<dyn std::error::Error>> {
    let dist = consort::init_from_env().await?;
    let pg = match spec.backend.as_str() {
        "quic" => dist.quic_process_group().await?,
        _ => {
            spec.backend = "tcp".into();
            dist.process_group().await?
        }
    };
    spec.world = pg.world_size();
    let rows = bench_rank(pg.clone(), spec).await?;
    let rank = pg.rank();
    drop(pg);
    dist.shutdown().await?;
    Ok((rank == 0).then_some(rows))
}

/// The hidden `bench-worker` subcommand: one rank of `consort bench
/// --backend tcp`; rank 0 prints its rows for the parent to collect.
pub(crate) async fn worker(spec_json: &str) -> Result<(), Box<dyn std::error::Error>> {
    let mut spec: BenchSpec = serde_json::from_str(spec_json)?;
    for row in rank_from_env(&mut spec).await?.unwrap_or_default() {
        println!("ROW {}", serde_json::to_string(&row)?);
    }
    Ok(())
}

/// `consort bench --from-env`: one rank of a launched job (`consort run
/// -- consort bench --from-env`, or torchrun); rank 0 returns the table.
pub(crate) async fn from_env(
    mut spec: BenchSpec,
) -> Result<Option<Table>, Box<dyn std::error::Error>> {
    let rows = rank_from_env(&mut spec).await?;
    Ok(rows.map(|rows| table(&spec, rows)))
}

/// Runs the bench and returns the table.
pub(crate) async fn run(spec: BenchSpec) -> Result<Table, Box<dyn std::error::Error>> {
    let rows: Vec<Row> = match spec.backend.as_str() {
        "tcp" | "quic" => launch(&spec)?,
        "sim" => {
            let world = consort::sim::SimWorld::new(consort::sim::SimConfig::new(spec.world))?;
            let tasks: Vec<_> = world
                .ranks()
                .into_iter()
                .map(|rank| {
                    let spec = spec.clone();
                    tokio::spawn(async move {
                        bench_rank(ProcessGroup::new(Arc::new(rank)), &spec).await
                    })
                })
                .collect();
            let mut first = None;
            for t in tasks {
                let rows = t.await??;
                first.get_or_insert(rows);
            }
            first.unwrap_or_default()
        }
        other => {
            return Err(format!("unknown backend {other:?}: expected tcp, quic or sim").into());
        }
    };
    Ok(table(&spec, rows))
}

/// One row per (op, size), nccl-tests columns.
fn table(spec: &BenchSpec, rows: Vec<Row>) -> Table {
    let mut t = Table::new(&[
        "op",
        "backend",
        "world",
        "bytes",
        "count",
        "dtype",
        "redop",
        "root",
        "time_us",
        "algbw_gbs",
        "busbw_gbs",
        "wrong",
    ]);
    for r in rows {
        let redop = if matches!(r.op.as_str(), "all_reduce" | "reduce_scatter") {
            "sum"
        } else {
            "none"
        };
        let root = if r.op == "broadcast" {
            json!(0)
        } else {
            json!(-1)
        };
        t.push(vec![
            json!(r.op),
            json!(spec.backend),
            json!(spec.world),
            json!(r.bytes),
            json!(r.count),
            json!(spec.dtype),
            json!(redop),
            root,
            json!(r.time_us),
            json!(r.algbw_gbs),
            json!(r.busbw_gbs),
            json!(r.wrong),
        ]);
    }
    t
}

/// Starts `spec.world` worker processes on loopback and collects rank 0's
/// rows.
fn launch(spec: &BenchSpec) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe()?;
    let spec_json = serde_json::to_string(spec)?;
    let mut children = Vec::with_capacity(spec.world);
    for r in 0..spec.world {
        let child = Command::new(&exe)
            .arg("bench-worker")
            .arg(&spec_json)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", spec.world.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", spec.world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .env(
                "CONSORT_LOG",
                std::env::var("CONSORT_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(if r == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .spawn()?;
        children.push(child);
    }
    let out = children[0].stdout.take().ok_or("no stdout from rank 0")?;
    let mut rows = Vec::new();
    for line in BufReader::new(out).lines() {
        if let Some(j) = line?.strip_prefix("ROW ") {
            rows.push(serde_json::from_str(j)?);
        }
    }
    for (r, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            return Err(format!("bench rank {r} exited with {status}").into());
        }
    }
    Ok(rows)
}
