//! `consort sim`: the cost-only simulator as an nccl-tests-style table,
//! with the closed-form α–β time beside every row; with `--cluster`,
//! NCCL's own model of a GPU cluster instead ([`cluster`]).

mod cluster;

use consort_comm::{OpKind, algo::AlgoConfig, algo::Algorithm};
use consort_sim::cost::{Link, Topology, simulate_within};
use serde_json::json;

use crate::{
    flags::{SizeList, parse_sizes},
    table::Table,
};

/// What `consort sim` was asked for.
#[derive(Debug)]
pub(crate) struct SimArgs {
    pub(crate) op: OpKind,
    pub(crate) algo: Option<Algorithm>,
    pub(crate) world: usize,
    pub(crate) ranks_per_node: Option<usize>,
    pub(crate) sizes: Vec<usize>,
    pub(crate) intra: Link,
    pub(crate) inter: Link,
    pub(crate) segment_bytes: usize,
    /// Segments in flight (the TCP mesh's 4 under --fitted-crosshost).
    pub(crate) window: usize,
    /// The share of a core each rank gets.
    pub(crate) cpu_share: f64,
}

/// The largest world `consort sim` simulates: a gather's root there runs
/// 65,536 lanes, which the schedule engine polls in turn (its cost grows
/// as the square of the world).
pub(crate) const MAX_SIM_WORLD: usize = 1 << 16;

/// The most schedule actions (segments sent, received and copied, over
/// the ranks simulated) one row may take: about 20 s and 2 GiB in a debug
/// build (the simulator keeps some 120 bytes an action), and less where
/// less memory is available. A chain broadcast of 1 GiB over 65,536 ranks
/// in 256 KiB segments would take half a billion, for minutes and 4 GiB.
pub(crate) const MAX_SIM_ACTIONS: u64 = 1 << 24;

/// [`MAX_SIM_ACTIONS`], or fewer where a quarter of the available memory
/// holds fewer at 128 bytes each.
fn action_budget() -> u64 {
    let fits = crate::flags::available_memory().map_or(u128::MAX, |b| b / 4 / 128);
    MAX_SIM_ACTIONS.min(u64::try_from(fits).unwrap_or(u64::MAX))
}

/// Runs the sweep.
pub(crate) fn run(a: &SimArgs) -> Result<Table, String> {
    if a.world == 0 || a.world > MAX_SIM_WORLD {
        return Err(format!(
            "--world-size {}: expected 1 to {MAX_SIM_WORLD} ranks",
            a.world
        ));
    }
    let rpn = a.ranks_per_node.unwrap_or(a.world);
    if rpn == 0 || !a.world.is_multiple_of(rpn) {
        return Err(format!(
            "--world-size {} is not a multiple of --ranks-per-node {rpn}",
            a.world
        ));
    }
    let topo = Topology {
        nodes: a.world / rpn,
        ranks_per_node: rpn,
        intra: a.intra,
        inter: a.inter,
        cpu_share: a.cpu_share,
    };
    let cfg = AlgoConfig {
        segment_bytes: a.segment_bytes,
        window: a.window,
        ..AlgoConfig::default()
    };
    let mut t = Table::new(&[
        "op",
        "algo",
        "world",
        "bytes",
        "time_us",
        "rank0_us",
        "algbw_gbs",
        "busbw_gbs",
        "closed_form_us",
    ]);
    let budget = action_budget();
    for &bytes in &a.sizes {
        let algo = a.algo.unwrap_or_else(|| cfg.select(a.op, bytes, a.world));
        if !algo.supports(a.op) {
            return Err(format!(
                "`{algo}` does not implement {}; it implements {}",
                a.op,
                algo.ops()
                    .iter()
                    .map(|o| o.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let r = simulate_within(a.op, algo, bytes, &topo, &cfg, budget).map_err(|e| {
            format!("{e}: choose a smaller --world-size, smaller --sizes or a larger --segment")
        })?;
        t.push(vec![
            json!(a.op.name()),
            json!(algo.name()),
            json!(a.world),
            json!(bytes),
            json!(r.time * 1e6),
            json!(r.rank0_time * 1e6),
            json!(r.algbw_gbs),
            json!(r.busbw_gbs),
            json!(r.closed_form * 1e6),
        ]);
    }
    Ok(t)
}

/// Parses an op name as `torch.distributed` spells it.
pub(crate) fn parse_op(s: &str) -> Result<OpKind, String> {
    let s = s.trim();
    OpKind::ALL
        .into_iter()
        .filter(|o| !matches!(o, OpKind::Send | OpKind::Recv | OpKind::NewGroup))
        .find(|o| o.name() == s || (s == "all_to_all" && *o == OpKind::AllToAll))
        .ok_or_else(|| {
            format!(
                "unknown op {s:?}: expected all_reduce, broadcast, reduce, all_gather, gather, \
                 scatter, reduce_scatter, all_to_all or barrier"
            )
        })
}

/// `consort sim`'s flags.
#[derive(Debug, clap::Args)]
pub(crate) struct SimCmd {
    /// The collective.
    #[arg(long, default_value = "all_reduce", value_parser = parse_op)]
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
    /// Largest pipelined segment, bytes (default 256K; 1M with
    /// --fitted-crosshost, the TCP mesh's).
    #[arg(long, value_parser = parse_sizes)]
    segment: Option<SizeList>,
    /// Receiver CPU cost per message, microseconds (default 0: compute is
    /// free).
    #[arg(long, default_value_t = 0.0)]
    overhead_us: f64,
    /// Receiver CPU cost per byte, nanoseconds (default 0).
    #[arg(long, default_value_t = 0.0)]
    gamma_ns: f64,
    /// The cores all ranks share, when they share one machine (emulated
    /// hosts): each rank gets min(1, cores / world) of a core for its CPU
    /// costs. Default: a core each.
    #[arg(long)]
    cores: Option<usize>,
    /// consort's TCP mesh as `crosshost.sh` measures it on this project's
    /// 2-vCPU machine: the inter-node link of --bw-inter-gbs with the
    /// fitted latency and CPU costs, 1 MiB segments, and --cores 2 unless
    /// given. Predicts those runs within 20% (BENCHMARKS.md, "Across hosts").
    #[arg(long)]
    fitted_crosshost: bool,
    /// One JSON object per row.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    gpu_cluster: cluster::ClusterArgs,
}

/// Refuses figures the cost model cannot run on: a zero, negative, NaN or
/// infinite bandwidth, latency or cost, no cores, a zero segment.
fn check(a: &SimCmd) -> Result<(), String> {
    use crate::flags::check_positive;
    check_positive("--bw-intra-gbs", a.bw_intra_gbs, false)?;
    check_positive("--bw-inter-gbs", a.bw_inter_gbs, false)?;
    check_positive("--alpha-intra-us", a.alpha_intra_us, true)?;
    check_positive("--alpha-inter-us", a.alpha_inter_us, true)?;
    check_positive("--overhead-us", a.overhead_us, true)?;
    check_positive("--gamma-ns", a.gamma_ns, true)?;
    if a.cores == Some(0) {
        return Err("--cores 0: expected at least one core".into());
    }
    if a.ranks_per_node == Some(0) {
        return Err("--ranks-per-node 0: expected at least one rank per node".into());
    }
    if let Some(s) = &a.segment
        && s.0.contains(&0)
    {
        return Err("--segment 0: expected a segment of at least one byte, like 256K".into());
    }
    Ok(())
}

/// Runs `consort sim`.
pub(crate) async fn command(a: SimCmd) -> Result<(), Box<dyn std::error::Error>> {
    cluster::check_unused(&a.gpu_cluster)?;
    if a.gpu_cluster.cluster.is_some() {
        let t = cluster::run(
            &a.gpu_cluster,
            a.op,
            a.world_size,
            a.ranks_per_node,
            &a.sizes.0,
        )?;
        print!("{}", t.render(a.json));
        return Ok(());
    }
    check(&a)?;
    let fit = a.fitted_crosshost;
    let inter = if fit {
        Link::fitted_crosshost(a.bw_inter_gbs)
    } else {
        Link::new(a.alpha_inter_us, a.bw_inter_gbs).with_cpu(a.overhead_us, a.gamma_ns)
    };
    let cores = a.cores.or(fit.then_some(2));
    let args = SimArgs {
        op: a.op,
        algo: a.algo,
        world: a.world_size,
        ranks_per_node: a.ranks_per_node,
        sizes: a.sizes.0,
        intra: Link::new(a.alpha_intra_us, a.bw_intra_gbs).with_cpu(a.overhead_us, a.gamma_ns),
        inter,
        segment_bytes: a
            .segment
            .and_then(|s| s.0.first().copied())
            .unwrap_or(if fit { 1 << 20 } else { 256 * 1024 }),
        window: if fit { 4 } else { AlgoConfig::default().window },
        cpu_share: cores.map_or(1.0, |c| (c as f64 / a.world_size.max(1) as f64).min(1.0)),
    };
    let t = tokio::task::spawn_blocking(move || run(&args)).await??;
    print!("{}", t.render(a.json));
    Ok(())
}
