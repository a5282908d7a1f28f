//! The `consort` command line: subcommands, flag parsing, and output.

mod bench;
mod collective;
mod ddp_bench;
mod gpus;
#[cfg(feature = "nccl")]
mod nccl_bench;
mod run;
mod sharded_bench;
mod sim;
mod table;

use clap::{Parser, Subcommand};
use consort::{DType, TcpStoreServer};
use serde_json::json;

use table::Table;

/// consort: collective communication and data-parallel training for Rust.
#[derive(Debug, Parser)]
#[command(name = "consort", version, about, long_about = None)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// What `consort debug` looks into.
#[derive(Debug, Subcommand)]
enum DebugCommand {
    /// Merge the flight records (`rank-K.json`) in DIR: `consort run`
    /// writes them to `<log dir>/attempt_N/flight/` when a job fails (or a
    /// worker gets SIGUSR1).
    Flight {
        /// The directory of `rank-K.json` files.
        dir: std::path::PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the version and the backends compiled in.
    Version {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run a TCPStore server (PyTorch wire-compatible) until interrupted.
    Store {
        /// Address to listen on (0.0.0.0 for every interface).
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port to listen on (0 picks a free one and prints it).
        #[arg(long, default_value_t = 29500)]
        port: u16,
    },
    /// Look into a failed job: `consort debug flight DIR` merges the ranks'
    /// flight records and names who is behind, in which call.
    Debug {
        #[command(subcommand)]
        what: DebugCommand,
    },
    /// Launch workers like torchrun: `consort run --nproc-per-node 4 --
    /// program args...` (RANK, WORLD_SIZE, MASTER_ADDR, ... set for each).
    Run(run::RunArgs),
    /// Benchmark collectives (N ranks on loopback, nccl-tests style), or,
    /// with a subcommand, measure this machine.
    Bench(BenchArgs),
    /// The peer process of `consort bench loopback` (started by it).
    #[command(hide = true)]
    BenchLoopbackPeer {
        /// Port to connect to.
        port: u16,
        /// Bytes each way.
        bytes: usize,
        /// oneway or duplex.
        mode: String,
    },
    /// Print one rank's sample indices as a JSON array (DistributedSampler).
    Sampler {
        /// Dataset length.
        #[arg(long)]
        len: u64,
        /// World size.
        #[arg(long)]
        num_replicas: usize,
        /// This rank.
        #[arg(long)]
        rank: usize,
        /// Seed (torch's default is 0).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Epoch (set_epoch).
        #[arg(long, default_value_t = 0)]
        epoch: u64,
        /// Shuffle (true|false).
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        shuffle: bool,
        /// Drop the tail instead of padding (true|false).
        #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
        drop_last: bool,
        /// exact (PyTorch's order) or streaming (Feistel, O(1) memory).
        #[arg(long, default_value = "exact")]
        mode: String,
    },
    /// One rank of `consort bench --backend tcp` (started by it).
    #[command(hide = true)]
    BenchWorker {
        /// The bench spec, as JSON.
        spec: String,
    },
    /// Predict collective time on an α–β model of a cluster (cost-only
    /// simulator), nccl-tests style, with the closed form beside each row.
    Sim {
        /// The collective.
        #[arg(long, default_value = "all_reduce", value_parser = sim::parse_op)]
        op: consort::OpKind,
        /// Algorithm (snake_case, as CONSORT_ALGO); default: the selection
        /// policy for each size.
        #[arg(long)]
        algo: Option<consort_comm::algo::Algorithm>,
        /// Number of ranks.
        #[arg(long, default_value_t = 8)]
        world_size: usize,
        /// Ranks per node (default: all on one node).
        #[arg(long)]
        ranks_per_node: Option<usize>,
        /// Message sizes, with K/M/G suffixes.
        #[arg(long, default_value = "4K,64K,1M,16M,256M,1G", value_parser = parse_sizes)]
        sizes: SizeList,
        /// Intra-node latency, microseconds (default: loopback TCP here).
        #[arg(long, default_value_t = 9.4)]
        alpha_intra_us: f64,
        /// Intra-node bandwidth, GB/s.
        #[arg(long, default_value_t = 4.76)]
        bw_intra_gbs: f64,
        /// Inter-node latency, microseconds.
        #[arg(long, default_value_t = 25.0)]
        alpha_inter_us: f64,
        /// Inter-node bandwidth, GB/s (12.5 = 100 Gb/s).
        #[arg(long, default_value_t = 12.5)]
        bw_inter_gbs: f64,
        /// Largest pipelined segment, bytes.
        #[arg(long, default_value = "256K", value_parser = parse_sizes)]
        segment: SizeList,
        /// One JSON object per row.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    #[command(subcommand)]
    machine: Option<BenchCommand>,
    /// Backend: tcp or quic (one OS process per rank, on loopback), sim, or
    /// nccl (one process per GPU, device buffers; needs the `nccl` feature).
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
    /// One JSON object per row.
    #[arg(long)]
    json: bool,
    /// Be one rank of a launched job (`consort run -- consort bench
    /// --from-env`): the world comes from RANK, WORLD_SIZE, MASTER_ADDR,
    /// ... and rank 0 prints the table.
    #[arg(long)]
    from_env: bool,
}

/// `--iters`: at least one run (a median of none is undefined).
fn parse_iters(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("at least 1 timed run is needed (the median of no runs is undefined)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number of runs")),
    }
}

#[derive(Debug, Clone)]
struct OpList(Vec<consort::OpKind>);

fn parse_op_list(s: &str) -> Result<OpList, String> {
    collective::parse_ops(s).map(OpList)
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
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
    /// sharded`): each strategy's step time over the real backend.
    Sharded {
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
        /// One JSON object per row.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone)]
pub(crate) struct SizeList(pub(crate) Vec<usize>);

#[derive(Debug, Clone)]
pub(crate) struct DTypeList(pub(crate) Vec<DType>);

/// Parses `4K,64M,1G` (binary multiples) into byte counts.
pub(crate) fn parse_sizes(s: &str) -> Result<SizeList, String> {
    s.split(',')
        .map(|item| {
            let item = item.trim();
            let (num, mult) = match item.chars().last().map(|c| c.to_ascii_uppercase()) {
                Some('K') => (&item[..item.len() - 1], 1usize << 10),
                Some('M') => (&item[..item.len() - 1], 1 << 20),
                Some('G') => (&item[..item.len() - 1], 1 << 30),
                _ => (item, 1),
            };
            num.parse::<usize>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .ok_or_else(|| format!("bad size {item:?}: expected a number with an optional K, M or G suffix, like 4K or 1G"))
        })
        .collect::<Result<_, _>>()
        .map(SizeList)
}

/// Parses a count with an optional decimal K or M suffix (`25M` is
/// 25,000,000, as model sizes are quoted).
pub(crate) fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1_000usize),
        Some('M') => (&t[..t.len() - 1], 1_000_000),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!("bad count {t:?}: expected a number with an optional K or M suffix, like 25M")
        })
}

/// Parses a comma-separated dtype list (`f32` or `float32` style).
pub(crate) fn parse_dtypes(s: &str) -> Result<DTypeList, String> {
    s.split(',')
        .map(|item| {
            let item = item.trim();
            DType::ALL
                .into_iter()
                .find(|d| {
                    d.name() == item || format!("{d:?}").eq_ignore_ascii_case(item)
                })
                .ok_or_else(|| format!("unknown dtype {item:?}: expected one of f32, f64, f16, bf16, i8, u8, i32, i64, u32, u64"))
        })
        .collect::<Result<_, _>>()
        .map(DTypeList)
}

fn parse_mode(s: &str) -> Result<consort::sampler::Mode, String> {
    match s {
        "exact" => Ok(consort::sampler::Mode::Exact),
        "streaming" => Ok(consort::sampler::Mode::Streaming),
        other => Err(format!(
            "unknown --mode {other:?}: expected exact or streaming"
        )),
    }
}

/// Backends compiled into this build.
fn backends() -> Vec<&'static str> {
    vec!["sim", "tcp-store"]
}

/// Runs one command; the exit code is the launcher's (a failed worker's
/// code) for `consort run`, and success for the others.
pub(crate) async fn run(cli: Cli) -> Result<std::process::ExitCode, Box<dyn std::error::Error>> {
    match cli.command {
        Command::Run(args) => {
            let code = run::run(args).await?;
            return Ok(std::process::ExitCode::from(code.clamp(0, 255) as u8));
        }
        Command::Version { json } => {
            let v = env!("CARGO_PKG_VERSION");
            if json {
                println!(
                    "{}",
                    json!({"name": "consort", "version": v, "backends": backends()})
                );
            } else {
                println!("consort {v} (backends: {})", backends().join(", "));
            }
        }
        Command::Debug {
            what: DebugCommand::Flight { dir },
        } => {
            for line in consort::launch::records::verdict(&dir)? {
                println!("{line}");
            }
        }
        Command::Store { host, port } => {
            let server = TcpStoreServer::bind(format!("{host}:{port}").as_str()).await?;
            println!("TCPStore listening on {}", server.local_addr());
            use std::io::Write;
            std::io::stdout().flush()?;
            tokio::signal::ctrl_c().await?;
            server.shutdown().await;
        }
        Command::Bench(BenchArgs {
            machine:
                Some(BenchCommand::Reduce {
                    sizes,
                    dtypes,
                    iters,
                    json,
                }),
            ..
        }) => {
            let t: Table =
                tokio::task::spawn_blocking(move || bench::reduce(&sizes.0, &dtypes.0, iters))
                    .await?;
            print!("{}", t.render(json));
        }
        Command::Bench(BenchArgs {
            machine:
                Some(BenchCommand::SimAllReduce {
                    size,
                    world_size,
                    iters,
                    json,
                }),
            ..
        }) => {
            let t = bench::sim_all_reduce(&size.0, world_size, iters).await?;
            print!("{}", t.render(json));
        }
        Command::Bench(BenchArgs {
            machine: None,
            backend,
            world_size,
            ops,
            sizes,
            dtype,
            iters,
            json,
            from_env,
            share_gpu,
        }) => {
            parse_dtypes(&dtype)?;
            if world_size == 0 || world_size > consort::MAX_LOCAL_WORLD_SIZE {
                return Err(format!(
                    "--world-size {world_size}: expected 1 to {} (the ranks run on this host)",
                    consort::MAX_LOCAL_WORLD_SIZE
                )
                .into());
            }
            let spec = collective::BenchSpec {
                backend,
                world: world_size,
                ops: ops.0.iter().map(|o| o.name().to_string()).collect(),
                sizes: sizes.0,
                dtype,
                iters,
                share_gpu,
            };
            if from_env {
                if let Some(t) = collective::from_env(spec).await? {
                    print!("{}", t.render(json));
                }
            } else {
                print!("{}", collective::run(spec).await?.render(json));
            }
        }
        Command::BenchWorker { spec } => collective::worker(&spec).await?,
        Command::Sampler {
            len,
            num_replicas,
            rank,
            seed,
            epoch,
            shuffle,
            drop_last,
            mode,
        } => {
            let mut s = consort::sampler::DistributedSampler::new(
                len,
                num_replicas,
                rank,
                shuffle,
                seed,
                drop_last,
            )?
            .with_mode(parse_mode(&mode)?);
            s.set_epoch(epoch);
            println!("{}", serde_json::to_string(&s.indices()?)?);
        }
        Command::Bench(BenchArgs {
            machine:
                Some(BenchCommand::Sampler {
                    len,
                    num_replicas,
                    mode,
                    json,
                }),
            ..
        }) => {
            let mode = parse_mode(&mode)?;
            let t = tokio::task::spawn_blocking(move || {
                bench::sampler(len, num_replicas, mode).map_err(|e| e.to_string())
            })
            .await??;
            print!("{}", t.render(json));
        }
        Command::Bench(BenchArgs {
            machine:
                Some(BenchCommand::Ddp {
                    params,
                    layers,
                    work,
                    iters,
                    json,
                }),
            ..
        }) => {
            if let Some(t) = ddp_bench::run(params, layers, work, iters).await? {
                print!("{}", t.render(json));
            }
        }
        Command::Bench(BenchArgs {
            machine:
                Some(BenchCommand::Sharded {
                    params,
                    layers,
                    work,
                    iters,
                    json,
                }),
            ..
        }) => {
            let t = if std::env::var_os("RANK").is_some() {
                sharded_bench::steps(params, layers, work, iters).await?
            } else {
                Some(sharded_bench::memory(params, layers).await?)
            };
            if let Some(t) = t {
                print!("{}", t.render(json));
            }
        }
        Command::Bench(BenchArgs {
            machine: Some(BenchCommand::Loopback { size, json }),
            ..
        }) => {
            let bytes = size.0.first().copied().unwrap_or(1 << 30);
            let t = tokio::task::spawn_blocking(move || {
                bench::loopback(bytes).map_err(|e| e.to_string())
            })
            .await??;
            print!("{}", t.render(json));
        }
        Command::BenchLoopbackPeer { port, bytes, mode } => {
            tokio::task::spawn_blocking(move || {
                bench::loopback_peer(port, bytes, mode == "duplex").map_err(|e| e.to_string())
            })
            .await??;
        }
        Command::Sim {
            op,
            algo,
            world_size,
            ranks_per_node,
            sizes,
            alpha_intra_us,
            bw_intra_gbs,
            alpha_inter_us,
            bw_inter_gbs,
            segment,
            json,
        } => {
            let args = sim::SimArgs {
                op,
                algo,
                world: world_size,
                ranks_per_node,
                sizes: sizes.0,
                intra: consort_sim::cost::Link::new(alpha_intra_us, bw_intra_gbs),
                inter: consort_sim::cost::Link::new(alpha_inter_us, bw_inter_gbs),
                segment_bytes: segment.0.first().copied().unwrap_or(256 * 1024),
            };
            let t = tokio::task::spawn_blocking(move || sim::run(&args)).await??;
            print!("{}", t.render(json));
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_dtypes_parse() {
        assert_eq!(parse_sizes("4K,1G,7").unwrap().0, vec![4096, 1 << 30, 7]);
        assert!(parse_sizes("4X").is_err());
        assert!(parse_sizes("").is_err());
        assert!(parse_sizes("99999999999999999G").is_err());
        assert_eq!(
            parse_dtypes("f32,bfloat16").unwrap().0,
            vec![DType::F32, DType::BF16]
        );
        assert!(parse_dtypes("f8").unwrap_err().contains("unknown dtype"));
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
