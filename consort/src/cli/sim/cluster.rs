//! `consort sim --cluster`: NCCL's own tuning model of a GPU cluster
//! (`consort_sim::cluster`), as an nccl-tests-style table of the
//! algorithm, protocol, time and bandwidths NCCL would reach per size; or,
//! with `--train`, the step time of DDP, FSDP or a pipeline schedule.
//!
//! Owns the flags and the tables; owns no formula.

use consort_pipeline::{Schedule, ScheduleKind, cost};
use consort_sim::cluster::{
    self, Algo, Cluster, Collective, Placement, Proto, predict_on,
    train::{self, TrainConfig},
};
use serde_json::json;

use crate::table::Table;

/// What `--train` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Train {
    /// `DistributedDataParallel`: bucketed gradient all_reduce.
    Ddp,
    /// `FullyShardedDataParallel` (`FULL_SHARD`): all_gather and
    /// reduce_scatter per unit.
    Fsdp,
    /// A pipeline schedule (`--schedule`), data parallel across replicas.
    Pipeline,
}

/// `consort sim`'s cluster flags.
#[derive(Debug, clap::Args)]
pub(crate) struct ClusterArgs {
    /// A GPU cluster preset: dgx-h100, hgx-h200 or a100-4hdr. Predicts
    /// with NCCL's own tuning model (ring, tree, NVLS, PAT; LL, LL128,
    /// Simple) instead of the α–β model, whose flags are then unused.
    #[arg(long)]
    pub(crate) cluster: Option<String>,
    /// Force an algorithm as NCCL_ALGO does (Tree, Ring, NVLS, NVLSTree, PAT).
    #[arg(long)]
    nccl_algo: Option<Algo>,
    /// Force a protocol as NCCL_PROTO does (LL, LL128, Simple).
    #[arg(long)]
    nccl_proto: Option<Proto>,
    /// Predict a training step instead of a size sweep (needs --model-params).
    #[arg(long, value_enum)]
    train: Option<Train>,
    /// The model's parameters, like 7B, 70B or 350M.
    #[arg(long, value_parser = parse_decimal)]
    model_params: Option<f64>,
    /// Tokens in one step across all GPUs (default 4,194,304: 1,024
    /// sequences of 4,096).
    #[arg(long, default_value = "4194304", value_parser = parse_decimal)]
    global_batch_tokens: f64,
    /// The share of the GPU's dense BF16 peak the compute reaches.
    #[arg(long, default_value_t = 0.4)]
    mfu: f64,
    /// DDP's bucket_cap_mb.
    #[arg(long, default_value_t = 25)]
    bucket_mb: usize,
    /// FSDP units (wrapped modules).
    #[arg(long, default_value_t = 32)]
    fsdp_units: usize,
    /// The pipeline schedule, by torch's name.
    #[arg(long, default_value = "1F1B")]
    schedule: ScheduleKind,
    /// Pipeline ranks (stages in a replica's pipeline).
    #[arg(long, default_value_t = 8)]
    pp: usize,
    /// Microbatches a step (default 4 × pp).
    #[arg(long)]
    microbatches: Option<usize>,
    /// Stages per pipeline rank (default 2 for the multi-stage schedules).
    #[arg(long)]
    stages_per_rank: Option<usize>,
    /// Hidden size for the activations between stages (default from the
    /// model's size: (128·N/12)^(1/3)).
    #[arg(long)]
    hidden: Option<usize>,
}

/// Decimal counts: 7B, 1.5T, 350M, 4096K, 4194304.
fn parse_decimal(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('B' | 'G') => (&t[..t.len() - 1], 1e9),
        Some('T') => (&t[..t.len() - 1], 1e12),
        _ => (t, 1.0),
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v * mult),
        _ => Err(format!(
            "{s:?}: expected a positive count like 7B, 350M or 4194304"
        )),
    }
}

/// Whether any cluster flag is given without `--cluster`.
pub(crate) fn check_unused(a: &ClusterArgs) -> Result<(), String> {
    if a.cluster.is_none() && (a.train.is_some() || a.model_params.is_some()) {
        return Err(
            "--train and --model-params need --cluster (dgx-h100, hgx-h200 or a100-4hdr)".into(),
        );
    }
    if a.cluster.is_none() && (a.nccl_algo.is_some() || a.nccl_proto.is_some()) {
        return Err(
            "--nccl-algo and --nccl-proto need --cluster; the α–β model takes --algo".into(),
        );
    }
    Ok(())
}

/// Runs `consort sim --cluster`.
pub(crate) fn run(
    a: &ClusterArgs,
    op: consort::OpKind,
    world: usize,
    ranks_per_node: Option<usize>,
    sizes: &[usize],
) -> Result<Table, String> {
    let name = a.cluster.as_deref().unwrap_or_default();
    let c = cluster::preset(name).map_err(|e| e.to_string())?;
    match a.train {
        Some(t) => train_table(a, &c, world, t),
        None => {
            let op: Collective = op
                .name()
                .parse()
                .map_err(|e: cluster::ClusterError| e.to_string())?;
            sweep(a, &c, op, world, ranks_per_node, sizes)
        }
    }
}

fn placement(c: &Cluster, world: usize, rpn: Option<usize>) -> Result<Placement, String> {
    let Some(rpn) = rpn else {
        return Placement::of(c, world).map_err(|e| e.to_string());
    };
    if rpn == 0 || rpn > c.gpus_per_node || !world.is_multiple_of(rpn) {
        return Err(format!(
            "--ranks-per-node {rpn}: expected 1 to {} dividing --world-size {world}",
            c.gpus_per_node
        ));
    }
    Ok(Placement {
        nodes: world / rpn,
        ranks_per_node: rpn,
    })
}

fn sweep(
    a: &ClusterArgs,
    c: &Cluster,
    op: Collective,
    world: usize,
    rpn: Option<usize>,
    sizes: &[usize],
) -> Result<Table, String> {
    let at = placement(c, world, rpn)?;
    let force =
        (a.nccl_algo.is_some() || a.nccl_proto.is_some()).then_some((a.nccl_algo, a.nccl_proto));
    let mut t = Table::new(&[
        "cluster",
        "op",
        "world",
        "nodes",
        "bytes",
        "algo",
        "proto",
        "channels",
        "time_us",
        "algbw_gbs",
        "busbw_gbs",
    ]);
    for &bytes in sizes {
        let p = predict_on(c, at, op, bytes, force).map_err(|e| e.to_string())?;
        t.push(vec![
            json!(c.name),
            json!(op.name()),
            json!(world),
            json!(at.nodes),
            json!(bytes),
            json!(p.algo.name()),
            json!(p.proto.name()),
            json!(p.channels),
            json!(p.time_us),
            json!(p.algbw_gbs),
            json!(p.busbw_gbs),
        ]);
    }
    Ok(t)
}

fn config(a: &ClusterArgs) -> Result<TrainConfig, String> {
    let params = a
        .model_params
        .ok_or("--train needs --model-params, like 7B")?;
    crate::flags::check_positive("--mfu", a.mfu, false)?;
    Ok(TrainConfig {
        mfu: a.mfu,
        bucket_bytes: a.bucket_mb.saturating_mul(1 << 20),
        fsdp_units: a.fsdp_units,
        ..TrainConfig::new(params, a.global_batch_tokens)
    })
}

fn train_table(a: &ClusterArgs, c: &Cluster, world: usize, train: Train) -> Result<Table, String> {
    let cfg = config(a)?;
    if train == Train::Pipeline {
        return pipeline_table(a, c, world, &cfg);
    }
    let s = match train {
        Train::Ddp => train::ddp_step(c, world, &cfg),
        _ => train::fsdp_step(c, world, &cfg),
    }
    .map_err(|e| e.to_string())?;
    let mut t = Table::new(&[
        "cluster",
        "train",
        "world",
        "params",
        "tokens",
        "mfu",
        "compute_ms",
        "comm_ms",
        "exposed_comm_ms",
        "step_ms",
        "tokens_per_s",
    ]);
    t.push(vec![
        json!(c.name),
        json!(if train == Train::Ddp { "ddp" } else { "fsdp" }),
        json!(world),
        json!(cfg.params.round() as u64),
        json!(cfg.global_batch_tokens.round() as u64),
        json!(cfg.mfu),
        json!(s.compute_s * 1e3),
        json!(s.comm_s * 1e3),
        json!(s.exposed_comm_s * 1e3),
        json!(s.step_s * 1e3),
        json!(cfg.global_batch_tokens / s.step_s),
    ]);
    Ok(t)
}

fn pipeline_table(
    a: &ClusterArgs,
    c: &Cluster,
    world: usize,
    cfg: &TrainConfig,
) -> Result<Table, String> {
    let kind = a.schedule;
    let spr = a
        .stages_per_rank
        .unwrap_or(if kind.single_stage() { 1 } else { 2 });
    let m = a.microbatches.unwrap_or(4 * a.pp);
    let schedule = Schedule::new(kind, a.pp, m, spr).map_err(|e| e.to_string())?;
    let pc =
        train::pipeline_costs(c, world, a.pp, spr, m, a.hidden, cfg).map_err(|e| e.to_string())?;
    let costs = cost::Costs {
        forward: pc.forward_s,
        backward_input: pc.backward_s,
        backward_weight: pc.backward_s,
        p2p: pc.p2p_s,
    };
    let timing = cost::simulate(&schedule, &costs)?;
    let step = timing.makespan + pc.dp_all_reduce_s;
    let mut t = Table::new(&[
        "cluster",
        "schedule",
        "world",
        "pp",
        "dp",
        "microbatches",
        "hidden",
        "forward_ms",
        "p2p_us",
        "pipeline_ms",
        "bubble",
        "dp_all_reduce_ms",
        "step_ms",
        "tokens_per_s",
    ]);
    t.push(vec![
        json!(c.name),
        json!(kind.name()),
        json!(world),
        json!(a.pp),
        json!(pc.dp),
        json!(m),
        json!(pc.hidden),
        json!(pc.forward_s * 1e3),
        json!(pc.p2p_s * 1e6),
        json!(timing.makespan * 1e3),
        json!(timing.bubble),
        json!(pc.dp_all_reduce_s * 1e3),
        json!(step * 1e3),
        json!(cfg.global_batch_tokens / step),
    ]);
    Ok(t)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        a: ClusterArgs,
    }

    fn flags(args: &[&str]) -> ClusterArgs {
        Flags::parse_from(std::iter::once("sim").chain(args.iter().copied())).a
    }

    fn rows(t: &Table) -> Vec<serde_json::Value> {
        t.render(true)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn a_sweep_names_nccls_choice_per_size() {
        let a = flags(&["--cluster", "dgx-h100"]);
        let t = run(&a, consort::OpKind::AllReduce, 8, None, &[4096, 1 << 30]).unwrap();
        let r = rows(&t);
        assert_eq!(r[0]["algo"], "Ring");
        assert_eq!(r[1]["algo"], "NVLS");
        let busbw = r[1]["busbw_gbs"].as_f64().unwrap();
        assert!((400.0..500.0).contains(&busbw), "{busbw}");
    }

    #[test]
    fn every_training_mode_gives_a_step_longer_than_its_compute() {
        for mode in ["ddp", "fsdp", "pipeline"] {
            let a = flags(&[
                "--cluster",
                "dgx-h100",
                "--train",
                mode,
                "--model-params",
                "7B",
            ]);
            let t = run(&a, consort::OpKind::AllReduce, 256, None, &[]).unwrap();
            let r = &rows(&t)[0];
            assert!(r["step_ms"].as_f64().unwrap() > 0.0, "{mode}: {r}");
            if mode != "pipeline" {
                assert!(
                    r["step_ms"].as_f64() >= r["compute_ms"].as_f64(),
                    "{mode}: {r}"
                );
            }
        }
    }

    #[test]
    fn bad_cluster_flags_are_refused_with_what_fits() {
        let e = run(
            &flags(&["--cluster", "tpu"]),
            consort::OpKind::AllReduce,
            8,
            None,
            &[1],
        )
        .unwrap_err();
        assert!(e.contains("dgx-h100"), "{e}");
        let a = flags(&["--cluster", "dgx-h100"]);
        let e = run(&a, consort::OpKind::Broadcast, 8, None, &[1]).unwrap_err();
        assert!(e.contains("all_gather"), "{e}");
        let e = run(&a, consort::OpKind::AllReduce, 8, Some(3), &[1]).unwrap_err();
        assert!(e.contains("--ranks-per-node 3"), "{e}");
        let e = run(&a, consort::OpKind::AllReduce, 8, None, &[0]).unwrap_err();
        assert!(e.contains("0 bytes"), "{e}");
        let p = flags(&[
            "--cluster",
            "dgx-h100",
            "--train",
            "pipeline",
            "--model-params",
            "7B",
            "--pp",
            "3",
        ]);
        let e = run(&p, consort::OpKind::AllReduce, 64, None, &[]).unwrap_err();
        assert!(e.contains("pp 3"), "{e}");
        let e = run(
            &flags(&["--cluster", "dgx-h100", "--train", "ddp"]),
            consort::OpKind::AllReduce,
            8,
            None,
            &[],
        )
        .unwrap_err();
        assert!(e.contains("--model-params"), "{e}");
        assert!(check_unused(&flags(&["--train", "ddp"])).is_err());
    }

    #[test]
    fn decimal_counts_parse_as_the_field_writes_them() {
        assert_eq!(parse_decimal("7B").unwrap(), 7e9);
        assert_eq!(parse_decimal("1.5t").unwrap(), 1.5e12);
        assert_eq!(parse_decimal("4194304").unwrap(), 4194304.0);
        assert!(parse_decimal("0").is_err());
        assert!(parse_decimal("lots").is_err());
    }
}
