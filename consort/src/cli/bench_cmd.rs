//! `consort bench`: collectives over N local processes (nccl-tests
//! style), and, with a subcommand, this machine's ceilings, DDP's cost and
//! the sharded strategies against DDP.

use clap::Subcommand;

use crate::{
    bench::{collective, ddp, ddp_device, machine, sharded, sharded_device},
    flags::{
        DTypeList, OpList, SizeList, check_memory, parse_count, parse_dtypes, parse_iters,
        parse_mode, parse_op_list, parse_sizes,
    },
    table::Table,
};

type BoxError = Box<dyn std::error::Error>;

#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    machine: Option<BenchCommand>,
    /// Backend: tcp, quic or gloo (one OS process per rank, on loopback;
    /// gloo is torch's Gloo protocol and algorithms, for all_reduce,
    /// broadcast, all_gather and reduce_scatter), sim, or nccl (one process
    /// per GPU, device buffers; needs the `nccl` feature).
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// nccl only: every rank uses GPU 0 (NCCL 2.30+ through
    /// NCCL_MULTI_RANK_GPU_ENABLE, older through one NCCL_HOSTID per rank
    /// over sockets). Slow; for correctness checks on a one-GPU machine.
    #[arg(long)]
    share_gpu: bool,
    /// Number of ranks.
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Ops: all_reduce, broadcast, reduce_scatter, all_gather, all_to_all.
    #[arg(long, default_value = "all_reduce,broadcast,reduce_scatter,all_gather,all_to_all", value_parser = parse_op_list)]
    ops: OpList,
    /// Message sizes, with K/M/G suffixes.
    #[arg(long, default_value = "4K,64K,1M,16M,64M", value_parser = parse_sizes)]
    sizes: SizeList,
    /// Element type.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Timed iterations per row (default: as gloo_bench.py, 3..=200 by size).
    #[arg(long, value_parser = parse_iters)]
    iters: Option<usize>,
    /// Untimed iterations before each row (default: 200 up to 8 KiB, as
    /// OSU's benchmarks skip, but no more than --iters, and 2 above, as
    /// gloo_bench.py and mpi_bench.py run).
    #[arg(long)]
    warmup: Option<usize>,
    /// How an iteration is timed: `max`, the slowest rank's time (as
    /// nccl-tests and the anchors in shared/bench time it), or `rank0`,
    /// rank 0's alone (a broadcast root returns once its bytes are queued).
    #[arg(long, default_value = "max", value_parser = ["max", "rank0"])]
    timing: String,
    /// The ranks `consort bench` starts itself: `core` binds each to a core
    /// of its own where this process may use at least one per rank (as
    /// `mpirun` binds 2 ranks; two unbound ranks the scheduler put on one
    /// core take turns every spin, about 40 us a turn, until it moves
    /// one), `none` leaves them to the scheduler.
    #[arg(long, default_value = "core", value_parser = ["core", "none"])]
    bind_to: String,
    /// One JSON object per row.
    #[arg(long)]
    json: bool,
    /// Be one rank of a launched job (`consort run -- consort bench
    /// --from-env`): the world comes from RANK, WORLD_SIZE, MASTER_ADDR,
    /// ... and rank 0 prints the table.
    #[arg(long)]
    from_env: bool,
}

#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Functional-mode simulator: all_reduce of f32 across simulated ranks
    /// in this process (real payloads), in busbw beside memcpy.
    SimAllReduce {
        /// Bytes per rank, with K/M/G suffixes.
        #[arg(long, default_value = "64M", value_parser = parse_sizes)]
        size: SizeList,
        /// Simulated ranks.
        #[arg(long, default_value_t = 4)]
        world_size: usize,
        /// Timed runs (the median is reported).
        #[arg(long, default_value_t = 5, value_parser = parse_iters)]
        iters: usize,
        /// One JSON object per row.
        #[arg(long)]
        json: bool,
    },
    /// The loopback TCP ceiling: two processes copying over one socket,
    /// one way and full duplex.
    Loopback {
        /// Bytes to copy each way, with K/M/G suffixes.
        #[arg(long, default_value = "1G", value_parser = parse_sizes)]
        size: SizeList,
        /// One JSON object per row.
        #[arg(long)]
        json: bool,
    },
    /// DDP's cost on a training step, as one rank of a launched job:
    /// `consort run --standalone --nproc-per-node 2 -- consort bench ddp`.
    /// Rank 0 prints the step time without DDP, with DDP, and with one
    /// all_reduce after backward.
    Ddp {
        /// Where the model lives: cpu (host memory, the job's TCP backend),
        /// cuda (NCCL, the rank's GPU) or emulated (the emulated device).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Parameters (f32), decimal with K/M suffixes.
        #[arg(long, default_value = "25M", value_parser = parse_count)]
        params: usize,
        /// Equal layers the parameters are split into.
        #[arg(long, default_value_t = 25)]
        layers: usize,
        /// Multiply-adds per parameter in the synthetic backward.
        #[arg(long, default_value_t = 8)]
        work: usize,
        /// Timed steps per mode (the median is reported).
        #[arg(long, default_value_t = 5, value_parser = parse_iters)]
        iters: usize,
        /// One JSON object per row.
        #[arg(long)]
        json: bool,
    },
    /// The sharded strategies against DDP. Alone: per-rank bytes of
    /// parameters, gradients and optimizer state (AdamW) at worlds 1, 2, 4
    /// and 8 on the simulator, beside the ZeRO formulas, and each step's
    /// communication on the cost model. As one rank of a launched job
    /// (`consort run --standalone --nproc-per-node 2 -- consort bench
    /// sharded`): each strategy's step time over the real backend; with
    /// `--device cuda` (NCCL) or `--device emulated`, the model on the
    /// device and each rank's device memory beside it.
    Sharded {
        /// Where the model lives in a launched job: cpu (host memory, the
        /// job's TCP backend), cuda (NCCL, the rank's GPU) or emulated (the
        /// emulated device, no GPU).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Mixed precision for the sharded strategies on a device: none,
        /// bf16 or f16 (f32 master shards; DDP stays f32).
        #[arg(long, default_value = "none")]
        mixed: String,
        /// Parameters (f32), decimal with K/M suffixes.
        #[arg(long, default_value = "4M", value_parser = parse_count)]
        params: usize,
        /// Equal layers (one wrapping unit each).
        #[arg(long, default_value_t = 8)]
        layers: usize,
        /// Multiply-adds per parameter in the synthetic backward.
        #[arg(long, default_value_t = 8)]
        work: usize,
        /// Timed steps per strategy (the median is reported).
        #[arg(long, default_value_t = 5, value_parser = parse_iters)]
        iters: usize,
        /// One JSON object per row.
        #[arg(long)]
        json: bool,
    },
    /// Sampler throughput: one rank's indices for a dataset of `len`.
    Sampler {
        /// Dataset length, with K/M/G suffixes (decimal here: 10M = 10,000,000).
        #[arg(long, default_value = "10000000")]
        len: u64,
        /// World size.
        #[arg(long, default_value_t = 1)]
        num_replicas: usize,
        /// exact or streaming.
        #[arg(long, default_value = "exact")]
        mode: String,
        /// One JSON object per row.
        #[arg(long)]
        json: bool,
    },
    /// ReduceOp::Sum apply throughput per dtype, beside memcpy.
    Reduce {
        /// Buffer sizes in bytes of dst, with K/M/G suffixes.
        #[arg(long, default_value = "256K,64M", value_parser = parse_sizes)]
        sizes: SizeList,
        /// Dtypes: f32, f64, f16, bf16, i8, u8, i32, i64, u32, u64.
        #[arg(long, default_value = "f32,f16,bf16", value_parser = parse_dtypes)]
        dtypes: DTypeList,
        /// Timed runs per cell (the median is reported).
        #[arg(long, default_value_t = 30, value_parser = parse_iters)]
        iters: usize,
        /// Also split Sum and the copy in 256 KiB pieces over this many
        /// threads (1 to 8), as a rank with cores to spare does
        /// (`CONSORT_SHM_THREADS`).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
        threads: u8,
        /// One JSON object per row.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `consort bench`.
pub(crate) async fn run(args: BenchArgs) -> Result<(), BoxError> {
    match args.machine {
        Some(BenchCommand::Reduce {
            sizes,
            dtypes,
            iters,
            threads,
            json,
        }) => {
            let largest = sizes.0.iter().copied().max().unwrap_or(0) as u128;
            check_memory("bench reduce", largest * 3, "choose smaller --sizes")?;
            let t: Table = tokio::task::spawn_blocking(move || {
                machine::reduce(&sizes.0, &dtypes.0, iters, threads.into())
            })
            .await??;
            print!("{}", t.render(json));
        }
        Some(BenchCommand::SimAllReduce {
            size,
            world_size,
            iters,
            json,
        }) => {
            check_sim_all_reduce(&size.0, world_size)?;
            let t = machine::sim_all_reduce(&size.0, world_size, iters).await?;
            print!("{}", t.render(json));
        }
        Some(BenchCommand::Sampler {
            len,
            num_replicas,
            mode,
            json,
        }) => {
            let mode = parse_mode(&mode)?;
            if mode == consort::sampler::Mode::Exact {
                check_memory(
                    "bench sampler --mode exact",
                    u128::from(len) * 16,
                    "choose a smaller --len, or --mode streaming (constant memory)",
                )?;
            }
            let t = tokio::task::spawn_blocking(move || {
                machine::sampler(len, num_replicas, mode).map_err(|e| e.to_string())
            })
            .await??;
            print!("{}", t.render(json));
        }
        Some(BenchCommand::Ddp {
            device,
            params,
            layers,
            work,
            iters,
            json,
        }) => {
            check_model(params, layers)?;
            // Parameters, gradients, buckets and a reference copy, in f32.
            check_memory("bench ddp", params as u128 * 16, "choose fewer --params")?;
            let t = if device == "cpu" {
                ddp::run(params, layers, work, iters).await?
            } else {
                ddp_device::run(&device, (params, layers, work, iters)).await?
            };
            if let Some(t) = t {
                print!("{}", t.render(json));
            }
        }
        Some(BenchCommand::Sharded {
            device,
            mixed,
            params,
            layers,
            work,
            iters,
            json,
        }) => {
            check_model(params, layers)?;
            // Parameters, gradients, AdamW's two moments and a copy, in f32,
            // for every simulated world of the memory table.
            check_memory(
                "bench sharded",
                params as u128 * 20 * 8,
                "choose fewer --params",
            )?;
            if let Some(t) = sharded(&device, &mixed, (params, layers, work, iters)).await? {
                print!("{}", t.render(json));
            }
        }
        Some(BenchCommand::Loopback { size, json }) => loopback(&size, json).await?,
        None => collectives(args).await?,
    }
    Ok(())
}

/// `consort bench loopback`: the loopback TCP ceiling, once its buffers fit.
async fn loopback(size: &SizeList, json: bool) -> Result<(), BoxError> {
    let bytes = size.0.first().copied().unwrap_or(1 << 30);
    check_memory(
        "bench loopback",
        bytes as u128 * 2,
        "choose a smaller --size",
    )?;
    let t =
        tokio::task::spawn_blocking(move || machine::loopback(bytes).map_err(|e| e.to_string()))
            .await??;
    print!("{}", t.render(json));
    Ok(())
}

/// `bench sim-all-reduce`'s world and sizes, and whether its buffers fit:
/// every simulated rank holds each size in this process, as f32.
fn check_sim_all_reduce(sizes: &[usize], world_size: usize) -> Result<(), String> {
    if world_size == 0 || world_size > consort::MAX_LOCAL_WORLD_SIZE {
        return Err(format!(
            "--world-size {world_size}: expected 1 to {} (simulated ranks in this process)",
            consort::MAX_LOCAL_WORLD_SIZE
        ));
    }
    if let Some(b) = sizes.iter().find(|&&b| b == 0 || b % 4 != 0) {
        return Err(format!(
            "--size {b}: expected a whole number of f32 elements (a positive multiple of 4 \
             bytes), like 64M"
        ));
    }
    let largest = sizes.iter().copied().max().unwrap_or(0) as u128;
    check_memory(
        "bench sim-all-reduce",
        largest * world_size as u128 * 2,
        "choose a smaller --size or --world-size",
    )
}

/// The synthetic model of `bench ddp` and `bench sharded`: at least one
/// parameter, and every layer at least one (a layer a parameter is a vector
/// per layer, so `--layers` past `--params` only allocates).
fn check_model(params: usize, layers: usize) -> Result<(), String> {
    if params == 0 {
        return Err("--params 0: expected at least 1 parameter, like 25M".into());
    }
    if layers == 0 || layers > params {
        return Err(format!(
            "--layers {layers}: expected 1 to --params ({params}) layers, each of at least one \
             parameter"
        ));
    }
    Ok(())
}

/// `consort bench` without a subcommand: the collectives table.
async fn collectives(a: BenchArgs) -> Result<(), BoxError> {
    parse_dtypes(&a.dtype)?;
    if a.world_size == 0 || a.world_size > consort::MAX_LOCAL_WORLD_SIZE {
        return Err(format!(
            "--world-size {}: expected 1 to {} (the ranks run on this host)",
            a.world_size,
            consort::MAX_LOCAL_WORLD_SIZE
        )
        .into());
    }
    // Every rank runs on this host: a send and a receive buffer each, and
    // a reference to check against.
    let largest = a.sizes.0.iter().copied().max().unwrap_or(0) as u128;
    if a.backend != "nccl" {
        check_memory(
            &format!("bench --world-size {}", a.world_size),
            largest * a.world_size as u128 * 3,
            "choose smaller --sizes or a smaller --world-size",
        )?;
    }
    let spec = crate::bench::rows::BenchSpec {
        backend: a.backend,
        world: a.world_size,
        ops: a.ops.0.iter().map(|o| o.name().to_string()).collect(),
        sizes: a.sizes.0,
        dtype: a.dtype,
        iters: a.iters,
        warmup: a.warmup,
        share_gpu: a.share_gpu,
        timing: a.timing,
        bind_to: a.bind_to,
    };
    if a.from_env {
        if let Some(t) = collective::from_env(spec).await? {
            print!("{}", t.render(a.json));
        }
    } else {
        print!("{}", collective::run(spec).await?.render(a.json));
    }
    Ok(())
}

/// `consort bench sharded`: alone, the memory table; in a launched job,
/// the step times, on the host or (`--device`) on the device.
async fn sharded(
    device: &str,
    mixed: &str,
    (params, layers, work, iters): (usize, usize, usize, usize),
) -> Result<Option<Table>, BoxError> {
    let launched = std::env::var_os("RANK").is_some();
    let mixed = match mixed {
        "none" => None,
        "bf16" => Some(consort::ddp::MixedPrecision::bf16()),
        "f16" => Some(consort::ddp::MixedPrecision::f16()),
        other => {
            return Err(format!("unknown --mixed {other:?}: expected none, bf16 or f16").into());
        }
    };
    if mixed.is_some() && device == "cpu" {
        return Err("--mixed times the device strategies: add --device cuda or emulated".into());
    }
    if device != "cpu" {
        if !launched {
            return Err(format!(
                "--device {device} times a launched job: consort run --standalone \
                 --nproc-per-node N -- consort bench sharded --device {device}"
            )
            .into());
        }
        return sharded_device::steps(device, (params, layers, work, iters), mixed).await;
    }
    if launched {
        return sharded::steps(params, layers, work, iters).await;
    }
    Ok(Some(sharded::memory(params, layers).await?))
}
