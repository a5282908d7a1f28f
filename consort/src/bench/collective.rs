//! `consort bench` for collectives: launches N ranks (OS processes on
//! loopback for tcp, tasks for sim), times each op like
//! `shared/bench/gloo_bench.py` (a barrier, then one op; an iteration's
//! time is the slowest rank's, or rank 0's with `--timing rank0`; the
//! median over the iterations), checks every result, and prints an
//! nccl-tests-style table.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::Arc,
    time::Instant,
};

use consort::{CommError, OpKind, ProcessGroup, ReduceOp, with_dtype};
use serde_json::json;

use super::rows::{BenchSpec, Row, Small, bus_factor, expected, input, output_len, wrong};
use crate::flags::parse_ops;
use crate::table::Table;

/// `n` copies of `x` in memory advised to transparent huge pages when it
/// is 4 MiB or more, as numpy allocates the Open MPI anchor's arrays
/// (`mpi_bench.py`), so that consort and Open MPI run on the same kind of
/// memory. Huge pages matter most to single-copy reads
/// (`CONSORT_SHM_CMA`), which pin every page they read.
fn huge_vec<T: Clone>(n: usize, x: T) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    let bytes = n * size_of::<T>();
    if bytes >= 4 << 20 {
        let page = 4096;
        let start = (v.as_ptr() as usize).next_multiple_of(page);
        let end = (v.as_ptr() as usize + bytes) / page * page;
        if end > start {
            // SAFETY: the range lies within `v`'s allocation, which nothing
            // has touched yet; advice changes no contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    v.resize(n, x);
    v
}

/// One rank's measurements for every op and size.
async fn bench_rank(pg: ProcessGroup, spec: &BenchSpec) -> Result<Vec<Row>, CommError> {
    let (r, n) = (pg.rank(), pg.world_size());
    let dtype = crate::flags::parse_dtypes(&spec.dtype)
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
                let x: Vec<T> = input(op, r, n, count);
                let bad = match op {
                    OpKind::AllReduce => {
                        let mut x = x;
                        pg.all_reduce(&mut x, ReduceOp::Sum).await?;
                        wrong(&x, |i| expected(op, r, n, count, i))
                    }
                    OpKind::Broadcast => {
                        let mut x = x;
                        pg.broadcast(&mut x, 0).await?;
                        wrong(&x, |i| expected(op, r, n, count, i))
                    }
                    OpKind::ReduceScatter => {
                        let mut out = vec![v(0); output_len(op, n, count)];
                        pg.reduce_scatter(&mut out, &x, ReduceOp::Sum).await?;
                        wrong(&out, |i| expected(op, r, n, count, i))
                    }
                    OpKind::AllGather => {
                        let out = pg.all_gather_vec(&x).await?;
                        wrong(&out, |i| expected(op, r, n, count, i))
                    }
                    _ => {
                        let mut out = vec![v(0); output_len(op, n, count)];
                        pg.all_to_all_single(&mut out, &x, None, None).await?;
                        wrong(&out, |i| expected(op, r, n, count, i))
                    }
                };
                // Timed runs, as gloo_bench.py does them.
                let iters = spec.iters.unwrap_or_else(|| (2e8 as usize / bytes.max(1)).clamp(3, 200));
                let mut a: Vec<T> = huge_vec(count, v(1));
                let mut b: Vec<T> = huge_vec(count, v(0));
                let mut times = Vec::with_capacity(iters);
                let warmup = spec.warmup(bytes);
                for it in 0..iters + warmup {
                    pg.barrier().await?;
                    let s = Instant::now();
                    match op {
                        OpKind::AllReduce => pg.all_reduce(&mut a, ReduceOp::Sum).await?,
                        OpKind::Broadcast => pg.broadcast(&mut a, 0).await?,
                        OpKind::ReduceScatter => pg.reduce_scatter(&mut b[..part], &a, ReduceOp::Sum).await?,
                        OpKind::AllGather => pg.all_gather(&mut b, &a[..part]).await?,
                        _ => pg.all_to_all_single(&mut b, &a, None, None).await?,
                    }
                    if it >= warmup {
                        times.push(s.elapsed().as_secs_f64());
                    }
                }
                if spec.timing != "rank0" {
                    // Each iteration's time is the slowest rank's.
                    pg.all_reduce(&mut times, ReduceOp::Max).await?;
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
                    host_us: None,
                    direct_host_us: None,
                }
            });
            rows.push(row);
        }
    }
    Ok(rows)
}

/// One rank of a world formed from the environment (torchrun's variables):
/// joins, benches, leaves. Returns rank 0's rows, and `None` elsewhere.
async fn rank_from_env(
    spec: &mut BenchSpec,
) -> Result<Option<Vec<Row>>, Box<dyn std::error::Error>> {
    let dist = consort::init_from_env().await?;
    if spec.backend == "nccl" {
        let rows = nccl_rank(&dist, spec).await;
        let rank = dist.rank();
        dist.shutdown().await?;
        return Ok((rank == 0).then_some(rows?));
    }
    if !matches!(spec.backend.as_str(), "quic" | "gloo") {
        spec.backend = "tcp".into();
    }
    let pg = crate::groups::group(&dist, &spec.backend).await?;
    spec.world = pg.world_size();
    let rows = bench_rank(pg.clone(), spec).await?;
    let rank = pg.rank();
    drop(pg);
    dist.shutdown().await?;
    Ok((rank == 0).then_some(rows))
}

/// One NCCL rank (feature `nccl`), or why there is none.
#[cfg(feature = "nccl")]
async fn nccl_rank(
    dist: &consort::Dist,
    spec: &mut BenchSpec,
) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    spec.world = dist.world_size();
    super::nccl::rank(dist, spec).await
}

#[cfg(not(feature = "nccl"))]
async fn nccl_rank(
    _: &consort::Dist,
    _: &mut BenchSpec,
) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    Err(crate::groups::nccl_not_built().into())
}

/// Checks, before any worker starts, that NCCL and GPU 0 are there, and
/// returns the environment that lets every rank share GPU 0.
#[cfg(feature = "nccl")]
fn nccl_preflight(spec: &BenchSpec) -> Result<Vec<(String, String)>, Box<dyn std::error::Error>> {
    let nccl = consort::nccl::load_nccl()?;
    consort::nccl::probe_device(0)?;
    if !spec.share_gpu {
        return Ok(Vec::new());
    }
    let mut env = vec![("CONSORT_SHARE_GPU".to_string(), "1".to_string())];
    if nccl.version >= consort::nccl::sys::version_code(2, 30, 0) {
        env.push(("NCCL_MULTI_RANK_GPU_ENABLE".into(), "1".into()));
    } else {
        env.extend([
            ("NCCL_NET".into(), "Socket".into()),
            ("NCCL_SOCKET_IFNAME".into(), "lo".into()),
            ("NCCL_HOSTID".into(), "consort-bench-host-{rank}".into()),
        ]);
    }
    Ok(env)
}

#[cfg(not(feature = "nccl"))]
fn nccl_preflight(_: &BenchSpec) -> Result<Vec<(String, String)>, Box<dyn std::error::Error>> {
    Err(crate::groups::nccl_not_built().into())
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
    // The bound is this node's: only where every rank ran here.
    let one_host = std::env::var("LOCAL_WORLD_SIZE").ok() == std::env::var("WORLD_SIZE").ok();
    let bw = if rows.is_some() && one_host {
        node_bandwidth(&spec)
    } else {
        None
    };
    Ok(rows.map(|rows| table(&spec, rows, bw)))
}

/// Runs the bench and returns the table.
pub(crate) async fn run(spec: BenchSpec) -> Result<Table, Box<dyn std::error::Error>> {
    let rows: Vec<Row> = match spec.backend.as_str() {
        "tcp" | "quic" | "gloo" => launch(&spec, &[])?,
        "nccl" => {
            let env = nccl_preflight(&spec)?;
            launch(&spec, &env)?
        }
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
            return Err(format!(
                "unknown backend {other:?}: expected tcp, quic, gloo, sim or nccl"
            )
            .into());
        }
    };
    let bw = node_bandwidth(&spec);
    Ok(table(&spec, rows, bw))
}

/// This node's memory bandwidth with a core per rank, for the CPU
/// backends (the simulator's ranks and NCCL's GPUs have other bounds);
/// said on stderr beside the table, whose rows carry the bound.
fn node_bandwidth(spec: &BenchSpec) -> Option<f64> {
    if !matches!(spec.backend.as_str(), "tcp" | "quic" | "gloo") {
        return None;
    }
    let threads = super::bound::threads_for(spec.world);
    match super::bound::memory_bandwidth(threads) {
        Ok(bw) => {
            eprintln!(
                "memory bandwidth: {:.1} GB/s with {threads} core(s) copying (STREAM Copy, read + write); \
                 bound_gbs is the single-copy bound on algbw, of_bound the row's fraction",
                bw / 1e9
            );
            Some(bw)
        }
        Err(e) => {
            eprintln!("no memory bandwidth, so no bound column: {e}");
            None
        }
    }
}

/// One row per (op, size), nccl-tests columns.
/// The table of `rows`; `bw` is this node's memory bandwidth where every
/// rank ran on it (the bound's columns are null elsewhere).
fn table(spec: &BenchSpec, rows: Vec<Row>, bw: Option<f64>) -> Table {
    let mut columns = vec![
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
        "bound_gbs",
        "of_bound",
        "wrong",
    ];
    let host = spec.backend == "nccl";
    if host {
        columns.extend(["host_us", "direct_host_us", "overhead_us"]);
    }
    let mut t = Table::new(&columns);
    for r in rows {
        let bound = bw
            .zip(parse_ops(&r.op).ok().and_then(|o| o.first().copied()))
            .and_then(|(bw, op)| super::bound::single_copy_bound(op, spec.world, bw));
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
        let mut row = vec![
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
            json!(bound.map(|b| b / 1e9)),
            json!(bound.map(|b| r.algbw_gbs * 1e9 / b)),
            json!(r.wrong),
        ];
        if host {
            let overhead = r.host_us.zip(r.direct_host_us).map(|(a, b)| a - b);
            row.extend([json!(r.host_us), json!(r.direct_host_us), json!(overhead)]);
        }
        t.push(row);
    }
    t
}

/// Starts `spec.world` worker processes on loopback and collects rank 0's
/// rows. `env` is set in every worker, with `{rank}` replaced.
fn launch(
    spec: &BenchSpec,
    env: &[(String, String)],
) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe()?;
    let spec_json = serde_json::to_string(spec)?;
    let mut children = Vec::with_capacity(spec.world);
    // A core per rank where there are enough, as mpirun binds its ranks,
    // so that both sides of a comparison run alike (see launch::cpus).
    let cores = if spec.bind_to == "core" {
        consort::launch::cpus::cores_for(spec.world)
    } else {
        None
    };
    for r in 0..spec.world {
        let mut cmd = Command::new(&exe);
        if let Some(core) = cores.as_ref().map(|c| c[r]) {
            use std::os::unix::process::CommandExt;
            // SAFETY: bind_self_to is async-signal-safe (its docs).
            unsafe { cmd.pre_exec(move || consort::launch::cpus::bind_self_to(core)) };
        }
        // Every worker is on this host: QUIC would meet its peers through
        // shared memory, so the QUIC rows turn it off to measure QUIC.
        if spec.backend == "quic" && std::env::var_os("CONSORT_SHM").is_none() {
            cmd.env("CONSORT_SHM", "0");
        }
        for (k, v) in env {
            cmd.env(k, v.replace("{rank}", &r.to_string()));
        }
        let child = cmd
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
