//! The step time of data-parallel training on a cluster preset.
//!
//! Owns: the compute of a step from the model's FLOPs (6 · parameters ·
//! tokens, at a stated share of the GPU's peak, the MFU), and the
//! collectives DDP and FSDP issue, timed by [`super::predict_on`], with
//! the overlap each assumes stated on [`ddp_step`] and [`fsdp_step`]; and
//! the per-microbatch costs of a pipeline ([`pipeline_costs`]), which the
//! caller times with a schedule (`consort_pipeline::cost::simulate`).
//! Owns no memory model: it does not check that a model fits.

use super::{ClusterError, Collective, Placement, predict_on, presets::Cluster};

/// What one training step is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainConfig {
    /// The model's parameters.
    pub params: f64,
    /// Tokens in one step across all ranks (the global batch).
    pub global_batch_tokens: f64,
    /// The share of the GPU's dense BF16 peak the compute reaches (MFU).
    pub mfu: f64,
    /// Bytes per gradient element all-reduced or reduce-scattered, and
    /// per parameter element gathered (2: BF16).
    pub bytes_per_param: f64,
    /// DDP's bucket size in bytes (torch's `bucket_cap_mb=25`: 25 MiB).
    pub bucket_bytes: usize,
    /// FSDP units (wrapped modules), each gathered and reduce-scattered
    /// as one collective.
    pub fsdp_units: usize,
}

impl TrainConfig {
    /// A model of `params` parameters on `global_batch_tokens` tokens a
    /// step, at 40% MFU, BF16, torch's 25 MiB buckets and 32 FSDP units.
    pub fn new(params: f64, global_batch_tokens: f64) -> TrainConfig {
        TrainConfig {
            params,
            global_batch_tokens,
            mfu: 0.4,
            bytes_per_param: 2.0,
            bucket_bytes: 25 << 20,
            fsdp_units: 32,
        }
    }

    fn check(&self) -> Result<(), ClusterError> {
        let bad = |s: String| Err(ClusterError::BadTraining(s));
        if !(self.params.is_finite() && self.params >= 1.0) {
            return bad(format!("model params {}: expected at least 1", self.params));
        }
        if !(self.global_batch_tokens.is_finite() && self.global_batch_tokens >= 1.0) {
            return bad(format!(
                "global batch of {} tokens: expected at least 1",
                self.global_batch_tokens
            ));
        }
        if !(self.mfu > 0.0 && self.mfu <= 1.0) {
            return bad(format!(
                "MFU {}: expected more than 0 and at most 1",
                self.mfu
            ));
        }
        if !(self.bytes_per_param.is_finite() && self.bytes_per_param > 0.0) {
            return bad(format!(
                "{} bytes per parameter: expected more than 0",
                self.bytes_per_param
            ));
        }
        if self.bucket_bytes == 0 || self.fsdp_units == 0 {
            return bad("a bucket of 0 bytes or 0 FSDP units: expected at least one".into());
        }
        Ok(())
    }
}

/// One step's predicted time, seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
#[must_use]
pub struct StepTime {
    /// Forward and backward compute on each rank.
    pub compute_s: f64,
    /// All the step's collectives, back to back.
    pub comm_s: f64,
    /// The part of `comm_s` the compute does not hide.
    pub exposed_comm_s: f64,
    /// `compute_s + exposed_comm_s`.
    pub step_s: f64,
}

/// Seconds for `flops` at `cfg`'s MFU of `c`'s peak.
fn compute_s(c: &Cluster, cfg: &TrainConfig, flops: f64) -> f64 {
    flops / (c.peak_tflops * 1e12 * cfg.mfu)
}

/// Seconds for one `op` of `bytes` on `at`, with NCCL's own choice.
fn coll_s(c: &Cluster, at: Placement, op: Collective, bytes: f64) -> Result<f64, ClusterError> {
    if at.world_size() == 1 {
        return Ok(0.0);
    }
    let bytes = (bytes.round() as usize).max(1);
    Ok(predict_on(c, at, op, bytes, None)?.time_us * 1e-6)
}

/// DDP (`DistributedDataParallel`): every rank holds the model and
/// all-reduces its gradients in buckets.
///
/// Overlap: buckets become ready evenly through the backward (two thirds
/// of the compute) and run on their own stream, so the backward hides all
/// but the last bucket: exposed = max(last bucket, all buckets − backward).
pub fn ddp_step(
    c: &Cluster,
    world_size: usize,
    cfg: &TrainConfig,
) -> Result<StepTime, ClusterError> {
    cfg.check()?;
    let at = Placement::of(c, world_size)?;
    let tokens = cfg.global_batch_tokens / world_size as f64;
    let compute = compute_s(c, cfg, 6.0 * cfg.params * tokens);
    let grad_bytes = cfg.params * cfg.bytes_per_param;
    let bucket = cfg.bucket_bytes as f64;
    let full = (grad_bytes / bucket).floor();
    let rest = grad_bytes - full * bucket;
    let t_full = coll_s(c, at, Collective::AllReduce, bucket)?;
    let t_rest = if rest >= 1.0 {
        coll_s(c, at, Collective::AllReduce, rest)?
    } else {
        0.0
    };
    let comm = full * t_full + t_rest;
    let last = if rest >= 1.0 { t_rest } else { t_full };
    let exposed = last.max(comm - compute * 2.0 / 3.0).min(comm);
    Ok(StepTime {
        compute_s: compute,
        comm_s: comm,
        exposed_comm_s: exposed,
        step_s: compute + exposed,
    })
}

/// FSDP (`FullyShardedDataParallel`, `FULL_SHARD`): each unit's
/// parameters are all-gathered before its forward and again before its
/// backward, and its gradients reduce-scattered after.
///
/// Overlap: the next unit's gather is prefetched under the current unit's
/// compute, so each phase exposes what its compute cannot cover, and at
/// least one collective: forward exposed = max(one gather, gathers −
/// forward); backward exposed = max(one reduce-scatter, gathers +
/// reduce-scatters − backward).
pub fn fsdp_step(
    c: &Cluster,
    world_size: usize,
    cfg: &TrainConfig,
) -> Result<StepTime, ClusterError> {
    cfg.check()?;
    let at = Placement::of(c, world_size)?;
    let tokens = cfg.global_batch_tokens / world_size as f64;
    let compute = compute_s(c, cfg, 6.0 * cfg.params * tokens);
    let (fwd, bwd) = (compute / 3.0, compute * 2.0 / 3.0);
    let units = cfg.fsdp_units as f64;
    let unit_bytes = cfg.params * cfg.bytes_per_param / units;
    let ag = coll_s(c, at, Collective::AllGather, unit_bytes)?;
    let rs = coll_s(c, at, Collective::ReduceScatter, unit_bytes)?;
    let exposed_fwd = ag.max(units * ag - fwd).min(units * ag);
    let back = units * (ag + rs);
    let exposed_bwd = rs.max(back - bwd).min(back);
    let exposed = exposed_fwd + exposed_bwd;
    Ok(StepTime {
        compute_s: compute,
        comm_s: units * ag + back,
        exposed_comm_s: exposed,
        step_s: compute + exposed,
    })
}

/// A pipeline's costs per microbatch on one stage, seconds, and the data
/// parallel all_reduce that ends its step.
#[derive(Clone, Copy, Debug, PartialEq)]
#[must_use]
pub struct PipelineCosts {
    /// Data-parallel replicas (`world_size / pp`).
    pub dp: usize,
    /// One stage's forward of one microbatch.
    pub forward_s: f64,
    /// Its backward to the input (the backward to the weights is the same:
    /// torch's two-forwards backward, halved).
    pub backward_s: f64,
    /// One activation (or its gradient) between adjacent stages.
    pub p2p_s: f64,
    /// The hidden size the activation was sized with.
    pub hidden: usize,
    /// The all_reduce of one rank's stage gradients across its `dp`
    /// replicas, after the schedule ends (not overlapped).
    pub dp_all_reduce_s: f64,
}

/// A transformer's hidden size from its parameters, if not given:
/// `N ≈ 12 · layers · h²` with `layers ≈ h / 128` (Llama 2 7B: 4,096 and
/// 32), so `h ≈ (128 · N / 12)^(1/3)`, rounded to a multiple of 128.
pub fn hidden_for(params: f64) -> usize {
    let h = (128.0 * params / 12.0).cbrt();
    ((h / 128.0).round().max(1.0) as usize) * 128
}

/// The costs of `pp` pipeline ranks with `stages_per_rank` stages each and
/// `microbatches` microbatches a step, each replica on `world_size / pp`.
///
/// Layout: the pipeline is outermost, as Megatron-LM lays it out: stage
/// rank `s` owns ranks `s·dp .. (s+1)·dp`, so its data-parallel group is
/// those ranks (on one node, or whole nodes), and a message between
/// stages crosses the network unless the whole world is one node; it is
/// timed as a ring step's Simple network latency (14 µs) plus the
/// activation over one GPU's share of the node's NICs (or its NVLink).
pub fn pipeline_costs(
    c: &Cluster,
    world_size: usize,
    pp: usize,
    stages_per_rank: usize,
    microbatches: usize,
    hidden: Option<usize>,
    cfg: &TrainConfig,
) -> Result<PipelineCosts, ClusterError> {
    cfg.check()?;
    let at = Placement::of(c, world_size)?;
    let bad = |s: String| Err(ClusterError::BadTraining(s));
    if pp == 0 || stages_per_rank == 0 || microbatches == 0 {
        return bad("pp, stages per rank and microbatches must each be at least 1".into());
    }
    if !world_size.is_multiple_of(pp) {
        return bad(format!(
            "world_size {world_size} is not a multiple of pp {pp}"
        ));
    }
    let dp = world_size / pp;
    let gpn = c.gpus_per_node;
    if !(dp.is_multiple_of(gpn) || gpn.is_multiple_of(dp)) {
        return bad(format!(
            "{dp} data-parallel replicas per stage neither fill whole nodes of {gpn} GPUs nor \
             divide one: choose pp so that world_size / pp does"
        ));
    }
    let dp_at = Placement::of(c, dp)?;
    let hidden = hidden.unwrap_or_else(|| hidden_for(cfg.params));
    if hidden == 0 {
        return bad("hidden size 0: expected at least 1".into());
    }
    let mb_tokens = cfg.global_batch_tokens / dp as f64 / microbatches as f64;
    let stage_params = cfg.params / (pp * stages_per_rank) as f64;
    let forward = compute_s(c, cfg, 2.0 * stage_params * mb_tokens);
    let act_bytes = mb_tokens * hidden as f64 * cfg.bytes_per_param;
    let p2p = if at.nodes == 1 {
        3.4e-6 + act_bytes / (c.nvlink_gbs * 1e9)
    } else {
        let share = c.nic_gbs * c.nics_per_node as f64 / gpn as f64;
        14e-6 + act_bytes / (share * 1e9)
    };
    let grads = cfg.params / pp as f64 * cfg.bytes_per_param;
    Ok(PipelineCosts {
        dp,
        forward_s: forward,
        backward_s: forward,
        p2p_s: p2p,
        hidden,
        dp_all_reduce_s: coll_s(c, dp_at, Collective::AllReduce, grads)?,
    })
}
