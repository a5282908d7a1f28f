//! Sharded data parallel over any `Backend`: ZeRO-1, ZeRO-2, FSDP (ZeRO-3)
//! and HSDP, beside [`crate::Ddp`].
//!
//! [`Sharded`] owns the model's parameters, gradients and optimizer state
//! in flat buffers ([`layout`]): one per wrapping unit and dtype, padded
//! to a multiple of the shard count and cut into equal contiguous shards.
//! Padding is internal: it never shows in parameters, state dicts or
//! checkpoints.
//!
//! | strategy | parameters | gradients | optimizer state |
//! |---|---|---|---|
//! | [`Strategy::Zero1`] | whole | whole (all-reduced) | 1/N |
//! | [`Strategy::Zero2`] | whole | 1/N (reduce-scattered) | 1/N |
//! | [`Strategy::Fsdp`] | 1/N, gathered per unit for use | 1/N | 1/N |
//! | [`Strategy::Hsdp`] | 1/G within a shard group of G | 1/G, then all-reduced across replicas | 1/G |
//!
//! A step, on every rank, in the same order:
//! 1. [`Sharded::gather`] each unit for the forward pass (FSDP and HSDP
//!    all-gather it, prefetching the next unit; ZeRO-1/2 hand out the
//!    whole parameters they keep);
//! 2. [`Sharded::mark_ready`] each parameter's local gradient as backward
//!    produces it. Once a unit is complete its gradients are averaged
//!    (all-reduce for ZeRO-1, reduce-scatter otherwise) while backward
//!    goes on; units launch strictly from the last to the first, so every
//!    rank makes the same calls in the same order;
//! 3. [`Sharded::step`]: each rank updates its shard with its
//!    [`ShardOptimizer`], and ZeRO-1/2 all-gather the updated parameters.
//!
//! Checkpoints ([`save`]): a full state dict gathered to rank 0, with the
//! same keys as DDP's, and sharded checkpoints (each rank its shard, plus
//! an index) that resume at another world size.
//!
//! A device model ([`crate::DeviceModel`], or any [`ParamSet`] with a
//! placement) keeps every flat buffer on its device: parameters,
//! gradients, optimizer state and gathered units, all stream-ordered on
//! its compute stream. The collectives take device buffers (NCCL, or the
//! emulated device), gradients come in with [`Sharded::mark_ready_device`],
//! gathered parameters go out with [`Gathered::param_device`], and the
//! optimizer steps with the device's [`ShardKernels`] ([`kernels`]).

mod flight;
pub mod kernels;
pub mod layout;
mod limit;
mod load;
mod memory;
pub mod mixed;
pub mod optim;
mod rules;
pub mod save;
pub mod staged;
mod step;
mod update;
pub(crate) mod vals;

use std::{collections::HashMap, fmt, sync::Arc, time::Duration};

use consort_comm::{
    Backend, CallOptions, DType, DeviceMesh, GroupOptions, Placement, ProcessGroup,
};

pub use kernels::{DeviceStep, ShardKernels};
pub use layout::{Flat, Layout, Segment};
pub use memory::Memory;
pub use mixed::{LossScaling, MixedPrecision};
pub use optim::ShardOptimizer;
pub use optim::staged;
pub use rules::{AdamW, Sgd};
pub use staged::{StagedKernels, staged_cast, staged_unscale};
pub use step::Gathered;

use crate::{
    buckets,
    error::DdpError,
    params::{ParamSet, ParamSpec},
    setup,
};
use flight::InFlight;
use vals::Vals;

/// How parameters, gradients and optimizer state are split across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// ZeRO stage 1: optimizer state sharded; gradients all-reduced whole.
    Zero1,
    /// ZeRO stage 2: gradients reduce-scattered, each rank keeps 1/N.
    Zero2,
    /// FSDP (ZeRO stage 3): parameters sharded at rest too, gathered per
    /// wrapping unit for use and freed after.
    Fsdp,
    /// Hybrid sharding: FSDP within each group of `shard_size` consecutive
    /// ranks (a node), gradients all-reduced across the replica groups
    /// (ranks `j, j + shard_size, ...`).
    Hsdp {
        /// Ranks per shard group; must divide the world size.
        shard_size: usize,
    },
}

impl Strategy {
    /// `zero1`, `zero2`, `fsdp`, `hsdp`.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Fsdp => "fsdp",
            Strategy::Hsdp { .. } => "hsdp",
        }
    }

    /// Parameters are sharded at rest (FSDP, HSDP).
    pub fn shards_params(self) -> bool {
        matches!(self, Strategy::Fsdp | Strategy::Hsdp { .. })
    }

    /// Gradients are kept as a shard (everything but ZeRO-1).
    pub fn shards_grads(self) -> bool {
        self != Strategy::Zero1
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::Hsdp { shard_size } => write!(f, "hsdp (shard groups of {shard_size})"),
            s => f.write_str(s.name()),
        }
    }
}

/// Options of [`Sharded::new`].
#[derive(Debug, Clone)]
pub struct ShardOptions {
    /// The strategy.
    pub strategy: Strategy,
    /// Wrapping units: parameter indices, each parameter in exactly one
    /// (torch: the modules `fully_shard` is applied to). `None`: for ZeRO-1
    /// and ZeRO-2, DDP's gradient buckets (c10d's assignment, by dtype, in
    /// reverse parameter order); for FSDP and HSDP, consecutive parameters
    /// up to the cap.
    pub units: Option<Vec<Vec<usize>>>,
    /// The unit size when `units` is `None`: `None` for DDP's caps (1 MiB
    /// first, then 25 MiB; FSDP and HSDP: 25 MiB).
    pub unit_cap_bytes: Option<usize>,
    /// Prefetch the next unit's parameters while this one is used (FSDP
    /// and HSDP; torch prefetches one unit ahead).
    pub prefetch: bool,
    /// Deadline of each collective (`None`: the group's default).
    pub timeout: Option<Duration>,
    /// The optimizer kernels of a device model's device (`None`:
    /// [`StagedKernels`], which the emulated device runs; a CUDA model
    /// needs `consort::cuda::CudaKernels`). Unused for host models.
    pub kernels: Option<Arc<dyn ShardKernels>>,
    /// Mixed precision (`None`: compute in the model's dtype); see
    /// [`mixed`].
    pub mixed_precision: Option<MixedPrecision>,
}

impl ShardOptions {
    /// `strategy` with the defaults.
    pub fn new(strategy: Strategy) -> Self {
        ShardOptions {
            strategy,
            units: None,
            unit_cap_bytes: None,
            prefetch: true,
            timeout: None,
            kernels: None,
            mixed_precision: None,
        }
    }

    /// Explicit wrapping units.
    pub fn units(mut self, units: Vec<Vec<usize>>) -> Self {
        self.units = Some(units);
        self
    }

    /// Mixed precision (torch's `MixedPrecisionPolicy`).
    pub fn mixed_precision(mut self, policy: MixedPrecision) -> Self {
        self.mixed_precision = Some(policy);
        self
    }

    /// The device's optimizer kernels (device models).
    pub fn kernels(mut self, kernels: Arc<dyn ShardKernels>) -> Self {
        self.kernels = Some(kernels);
        self
    }
}

/// Which direction the step is going, for prefetching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Forward,
    Backward,
}

/// The group a flat's shards live on: this rank's part of it.
#[derive(Debug)]
struct ShardGroup {
    /// The group (the world, or this rank's HSDP shard group).
    pg: Arc<dyn Backend>,
    /// This rank's index in it: the shard it owns.
    index: usize,
    /// The replica group (HSDP only).
    replicas: Option<Arc<dyn Backend>>,
}

/// One flat buffer's storage on this rank.
#[derive(Debug)]
struct FlatState {
    /// Whole and padded (ZeRO-1/2), or this rank's shard (FSDP, HSDP).
    params: Arc<Vals>,
    /// Whole and padded (ZeRO-1), or this rank's shard.
    grads: Vals,
    /// The optimizer's slots, each one shard long.
    state: Vec<Vals>,
    /// This step's local gradients, whole and padded, until launched.
    staging: Option<Vals>,
}

/// Sharded data parallel training of one model: ZeRO-1, ZeRO-2, FSDP or
/// HSDP. See the [module docs](self).
///
/// FSDP on two simulated ranks, one unit, plain SGD: gather the unit for
/// the forward pass, hand over the gradient, step; each rank updates
/// only its half of the parameters.
///
/// ```
/// use std::sync::Arc;
/// use consort_ddp::{PlainModel, Sgd, ShardOptions, Sharded, Strategy};
/// use consort_sim::{SimConfig, SimWorld};
///
/// let world = SimWorld::new(SimConfig::new(2))?;
/// let out = world.run_each(|rank| async move {
///     let rank = Arc::new(rank);
///     let r = consort_comm::Backend::rank(&*rank) as f32;
///     let mut model = PlainModel::new();
///     model.add_param::<f32>("w", vec![4], &[1.0; 4])?;
///     let opts = ShardOptions::new(Strategy::Fsdp); // fully_shard(model)
///     let mut sh = Sharded::new(rank, &mut model, Sgd::new(0.1), opts).await?;
///     let unit = sh.gather(0).await?; // all-gathers the whole parameters
///     assert_eq!(unit.param::<f32>(0)?, [1.0; 4]);
///     drop(unit); // forward done: the whole copy is freed
///     sh.mark_ready(0, &[r + 1.0; 4])?; // backward: reduce-scatters the mean, 1.5
///     sh.step().await?; // SGD on this rank's shard
///     sh.copy_params_to(&mut model).await?;
///     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(model.param::<f32>(0)?.to_vec())
/// })?;
/// for w in out {
///     assert_eq!(w.unwrap(), [0.85; 4]); // 1 - 0.1 * 1.5
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Sharded {
    backend: Arc<dyn Backend>,
    group: ShardGroup,
    strategy: Strategy,
    rank: usize,
    specs: Vec<ParamSpec>,
    layout: Arc<Layout>,
    flats: Vec<FlatState>,
    optimizer: Box<dyn ShardOptimizer>,
    /// The device every flat buffer lives on (`None`: host memory).
    place: Option<Placement>,
    /// The optimizer's kernels there (device models only).
    kernels: Option<Arc<dyn ShardKernels>>,
    /// Mixed precision's policy, and its loss scale.
    mixed: Option<MixedPrecision>,
    scaler: Option<mixed::Scaler>,
    /// The last step found an inf or a NaN and did not update.
    skipped: bool,
    /// Optimizer steps taken.
    steps: u64,
    call: CallOptions,
    prefetch: bool,
    phase: Phase,
    /// FSDP/HSDP gathers made ahead of use, by unit.
    prefetched: HashMap<usize, Vec<InFlight>>,
    /// The cap on gathers unfinished on the device.
    limit: limit::GatherLimit,
    /// Which parameters have their gradient this step.
    ready: Vec<bool>,
    /// Units `next_launch..` have been launched this step.
    next_launch: usize,
    /// Gradient reductions in flight: (flat, call).
    pending: Vec<(usize, InFlight)>,
    failed: Option<DdpError>,
    /// The call under way: still set afterwards only if that call's
    /// future was dropped before it finished.
    busy: Option<&'static str>,
}

impl fmt::Debug for Sharded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sharded")
            .field("strategy", &self.strategy)
            .field("rank", &self.rank)
            .field("units", &self.layout.units.len())
            .field("optimizer", &self.optimizer.name())
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

/// Wraps a collective's error with the rank, the strategy and what it was
/// doing.
pub(crate) fn comm(
    rank: usize,
    strategy: Strategy,
    what: impl Into<String>,
) -> impl FnOnce(consort_comm::CommError) -> DdpError {
    let what = what.into();
    move |source| DdpError::ShardComm {
        rank,
        strategy: strategy.name(),
        what,
        source: Box::new(source),
    }
}

/// DDP's setup errors (shared with it) as a sharded strategy's.
fn setup_error(strategy: Strategy, rank: usize) -> impl FnOnce(DdpError) -> DdpError {
    move |e| match e {
        DdpError::Comm { what, source } => comm(rank, strategy, what)(*source),
        other => other,
    }
}

impl Sharded {
    /// Wraps `model` on every rank: checks that the ranks hold the same
    /// parameters, copies rank 0's parameters and buffers to every rank
    /// (so a rank-0 resume reaches everyone), makes the HSDP groups, and
    /// keeps this rank's part of the flat buffers. `model`'s parameters
    /// are not used after this: read them back with [`Sharded::gather`]
    /// or [`Sharded::copy_params_to`].
    ///
    /// f32 and f64 parameters, in host memory or on the model's device
    /// (see the [module docs](self)); every rank calls it with the same
    /// options.
    pub async fn new(
        backend: Arc<dyn Backend>,
        model: &mut (impl ParamSet + ?Sized),
        optimizer: impl ShardOptimizer + 'static,
        opts: ShardOptions,
    ) -> Result<Self, DdpError> {
        let rank = backend.rank();
        let usage = |reason: String| DdpError::Usage { rank, reason };
        let place = model.placement();
        let kernels = check_model(model, &optimizer, place.as_ref(), &opts).map_err(usage)?;
        let specs = model.params();
        let call = CallOptions {
            timeout: opts.timeout,
            ..CallOptions::default()
        };
        let buffers = model.buffers();
        setup::check_same_model(&*backend, &specs, &buffers, &call)
            .await
            .map_err(setup_error(opts.strategy, rank))?;
        match place {
            None => setup::broadcast_tensors(&*backend, model, &specs, &buffers, &call).await,
            Some(_) => {
                crate::device::broadcast_device(&*backend, model, &specs, &buffers, &call).await
            }
        }
        .map_err(setup_error(opts.strategy, rank))?;
        let shards = shard_count(opts.strategy, backend.world_size()).map_err(usage)?;
        let units = units_for(&opts, &specs).map_err(usage)?;
        let layout = Layout::new(&specs, &units, shards);
        // Every rank must wrap the model the same way, before any call
        // that depends on it.
        let setup = describe_setup(&opts, layout.as_ref(), &optimizer);
        agree_setup(&*backend, opts.strategy, &setup, &call).await?;
        let layout = layout.map_err(usage)?;
        let group = make_groups(&backend, opts.strategy, &call).await?;
        let at = (place.as_ref(), opts.strategy, group.index, shards);
        let flats: Result<Vec<_>, _> = (layout.flats.iter())
            .map(|f| flat_state(f, model, at, optimizer.slots()))
            .collect();
        // A rank that cannot place its buffers (out of device memory) makes
        // every rank fail here, not hang at the first gather.
        let flats = agree_placed(&*backend, opts.strategy, flats, &call).await?;
        let ready = vec![false; specs.len()];
        let next_launch = layout.units.len();
        let limit_place = place.clone();
        Ok(Sharded {
            backend,
            group,
            strategy: opts.strategy,
            rank,
            specs,
            layout: Arc::new(layout),
            flats,
            optimizer: Box::new(optimizer),
            place,
            kernels,
            mixed: opts.mixed_precision,
            scaler: (opts.mixed_precision)
                .and_then(|m| m.loss_scaling)
                .map(mixed::Scaler::new),
            skipped: false,
            steps: 0,
            call,
            prefetch: opts.prefetch,
            phase: Phase::Forward,
            prefetched: HashMap::new(),
            limit: limit::GatherLimit::new(limit_place),
            ready,
            next_launch,
            pending: Vec::new(),
            failed: None,
            busy: None,
        })
    }

    /// This rank in the world.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Where the shards live: `None` in host memory, or the model's device
    /// and compute stream.
    pub fn placement(&self) -> Option<&Placement> {
        self.place.as_ref()
    }

    /// The strategy.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The parameters, in registration order.
    pub fn params(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// The flat layout (units, flats, shards).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Optimizer steps taken (restored by a sharded checkpoint).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The shard this rank owns, and how many there are.
    pub fn shard(&self) -> (usize, usize) {
        (self.group.index, self.layout.shards)
    }

    /// The factor to multiply the loss by before backward: mixed
    /// precision's loss scale, or 1 without loss scaling (torch's
    /// `GradScaler.scale(loss)`).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, mixed::Scaler::scale)
    }

    /// Whether the last [`Sharded::step`] found an inf or a NaN in the
    /// gradients (on any rank) and skipped the update, as torch's
    /// `GradScaler.step` does.
    pub fn step_skipped(&self) -> bool {
        self.skipped
    }

    /// The dtype gathered parameters and gradients are in: mixed
    /// precision's `param_dtype`, or `None` (each parameter's own).
    pub fn compute_dtype(&self) -> Option<DType> {
        self.mixed.map(|m| m.param_dtype)
    }

    /// A collective's error, with this rank and strategy.
    fn comm_error(&self, what: impl Into<String>, e: consort_comm::CommError) -> DdpError {
        comm(self.rank, self.strategy, what)(e)
    }

    /// Records `err` as this wrapper's sticky failure and returns it.
    fn fail(&mut self, err: DdpError) -> DdpError {
        self.failed.get_or_insert_with(|| err.clone());
        err
    }

    /// The sticky failure, if any.
    fn check(&self) -> Result<(), DdpError> {
        if let Some(e) = &self.failed {
            return Err(DdpError::ShardFailed(Box::new(e.clone())));
        }
        if let Some(what) = self.busy {
            return Err(DdpError::ShardFailed(Box::new(DdpError::Usage {
                rank: self.rank,
                reason: format!(
                    "an earlier {what}() was dropped before it finished (cancelled by a select! \
                     or a timeout?), so this rank may have made only part of its collectives"
                ),
            })));
        }
        Ok(())
    }

    /// Starts the public call `what`: refused after a failure or a call
    /// dropped half-way.
    fn enter(&mut self, what: &'static str) -> Result<(), DdpError> {
        self.check()?;
        self.busy = Some(what);
        Ok(())
    }

    /// Ends the call [`Sharded::enter`] started.
    fn leave(&mut self) {
        self.busy = None;
    }
}

/// DDP's gradient buckets as wrapping units: c10d's assignment (by dtype,
/// filled in reverse parameter order, 1 MiB first then 25 MiB, or the one
/// cap given), reversed so that the first bucket DDP would launch is the
/// last unit, which the strategies launch first.
fn ddp_buckets(specs: &[ParamSpec], cap: Option<usize>) -> Result<Vec<Vec<usize>>, String> {
    let infos: Vec<buckets::ParamInfo> = specs
        .iter()
        .map(|s| buckets::ParamInfo {
            dtype: s.dtype,
            device: -1,
            numel: s.numel(),
        })
        .collect();
    let order: Vec<usize> = (0..specs.len()).rev().collect();
    let limits = buckets::bucket_limits(cap.map(|c| c.max(1)));
    let mut units =
        buckets::assign_buckets(&infos, &limits, Some(&order)).map_err(|e| e.to_string())?;
    units.reverse();
    for u in &mut units {
        u.sort_unstable();
    }
    Ok(units)
}

/// Checks that every rank wraps the model the same way (`setup` describes
/// it): different units, strategies or optimizers would make different
/// calls, or silently wrong results.
async fn agree_setup(
    backend: &dyn Backend,
    strategy: Strategy,
    setup: &str,
    call: &CallOptions,
) -> Result<(), DdpError> {
    let rank = backend.rank();
    let mine = [setup::fnv(setup.as_bytes())];
    let mut all = vec![0u64; backend.world_size()];
    backend
        .all_gather(
            consort_comm::BufferMut::from(&mut all),
            consort_comm::Buffer::from(&mine[..]),
            call,
        )
        .await
        .map_err(comm(rank, strategy, "all_gather of the sharding setup"))?;
    let differ: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(DdpError::Usage {
        rank,
        reason: format!(
            "the ranks wrap the model differently: ranks {differ:?} differ from rank 0; this rank \
             has {setup}. Every rank must pass the same ShardOptions and optimizer"
        ),
    })
}

/// Every rank's flat buffers placed, or every rank fails: one all_reduce
/// of a flag, this rank's own error where it failed.
async fn agree_placed(
    backend: &dyn Backend,
    strategy: Strategy,
    flats: Result<Vec<FlatState>, consort_comm::CommError>,
    call: &CallOptions,
) -> Result<Vec<FlatState>, DdpError> {
    let rank = backend.rank();
    let mut flag = [f32::from(u8::from(flats.is_err()))];
    backend
        .all_reduce(
            consort_comm::BufferMut::from(&mut flag[..]),
            consort_comm::ReduceOp::Max,
            call,
        )
        .await
        .map_err(comm(
            rank,
            strategy,
            "all_reduce of the placement's outcome",
        ))?;
    match flats {
        Err(e) => Err(comm(rank, strategy, "placing the flat buffers")(e)),
        Ok(_) if flag[0] != 0.0 => Err(DdpError::Usage {
            rank,
            reason: "another rank could not place its flat buffers (its error names why, out \
                     of device memory, say); no rank goes on"
                .into(),
        }),
        Ok(f) => Ok(f),
    }
}

/// The group the shards live on: the world, or (HSDP) this rank's group of
/// `shard_size` consecutive ranks, with its replica group beside it: the
/// two dims of a 2-D [`DeviceMesh`] `[world / shard_size, shard_size]`
/// named `("replicate", "shard")`, as torch's HSDP takes them from
/// `init_device_mesh(..., (replicas, shard_size), mesh_dim_names=("replicate",
/// "shard"))`.
async fn make_groups(
    backend: &Arc<dyn Backend>,
    strategy: Strategy,
    call: &CallOptions,
) -> Result<ShardGroup, DdpError> {
    let (rank, world) = (backend.rank(), backend.world_size());
    // The shard size was checked in `Sharded::new`: at least 1, dividing
    // the world.
    let Strategy::Hsdp { shard_size: g } = strategy else {
        return Ok(ShardGroup {
            pg: backend.clone(),
            index: rank,
            replicas: None,
        });
    };
    let opts = GroupOptions {
        timeout: call.timeout,
        ..GroupOptions::default()
    };
    let shape = [world / g, g];
    let pg = ProcessGroup::new(backend.clone());
    let mesh = DeviceMesh::init_with(&pg, &shape, &["replicate", "shard"], &opts)
        .await
        .map_err(comm(
            rank,
            strategy,
            format!("the HSDP device mesh {shape:?}"),
        ))?;
    let group = |name: &str| {
        (mesh.get_group(name)).map_err(comm(
            rank,
            strategy,
            format!("the HSDP mesh's {name} group"),
        ))
    };
    let shard = group("shard")?;
    Ok(ShardGroup {
        index: shard.rank(),
        pg: shard.backend().clone(),
        replicas: Some(group("replicate")?.backend().clone()),
    })
}

/// What [`Sharded::new`] checks before any call: the parameters' dtypes,
/// the optimizer's settings, a host model's byte views, and a device
/// model's kernels (returned: `None` for a host model).
fn check_model(
    model: &mut (impl ParamSet + ?Sized),
    optimizer: &dyn ShardOptimizer,
    place: Option<&Placement>,
    opts: &ShardOptions,
) -> Result<Option<Arc<dyn ShardKernels>>, String> {
    let specs = model.params();
    if let Some(s) = specs
        .iter()
        .find(|s| !matches!(s.dtype, DType::F32 | DType::F64))
    {
        return Err(format!(
            "parameter {} is {}; the sharded strategies keep f32 and f64 parameters (keep f32 \
             master weights and compute in bf16 or f16 with ShardOptions::mixed_precision)",
            s.describe(),
            s.dtype
        ));
    }
    if let Some(m) = &opts.mixed_precision {
        m.check()?;
        if let Some(s) = specs.iter().find(|s| s.dtype != DType::F32) {
            return Err(format!(
                "mixed precision keeps f32 master weights; parameter {} is {}",
                s.describe(),
                s.dtype
            ));
        }
    }
    optimizer
        .check()
        .map_err(|e| format!("{}: {e}", optimizer.name()))?;
    let Some(place) = place else {
        if let Some((p, s)) = specs
            .iter()
            .enumerate()
            .find(|&(p, s)| model.param_bytes_mut(p).len() != s.bytes())
        {
            return Err(format!(
                "the model exposes {} bytes for parameter {}, not {}: a host model's \
                 param_bytes_mut must return the whole tensor",
                model.param_bytes_mut(p).len(),
                s.describe(),
                s.bytes()
            ));
        }
        return Ok(None);
    };
    if let Some(s) = specs
        .iter()
        .enumerate()
        .find(|&(p, _)| model.param_device(p).is_none())
    {
        return Err(format!(
            "the model is on {} device {} but has no device storage for parameter {}: a \
             device model implements param_device",
            place.device.kind(),
            place.device.ordinal(),
            s.1.describe()
        ));
    }
    match &opts.kernels {
        Some(k) => {
            k.check_place(place)
                .map_err(|e| format!("{}: {e}", k.name()))?;
            Ok(Some(k.clone()))
        }
        None if place.device.kind() == "cuda" => {
            Err("a CUDA model's shards step with CUDA kernels: pass \
             ShardOptions::kernels(consort::cuda::CudaKernels::new(device)?)"
                .into())
        }
        None => Ok(Some(Arc::new(StagedKernels))),
    }
}

/// The wrapping units: the options' own, else consecutive parameters up
/// to the cap (FSDP, HSDP), else DDP's buckets (ZeRO-1/2).
fn units_for(opts: &ShardOptions, specs: &[ParamSpec]) -> Result<Vec<Vec<usize>>, String> {
    Ok(match &opts.units {
        Some(u) => u.clone(),
        None if opts.strategy.shards_params() => {
            let cap = opts.unit_cap_bytes.unwrap_or(buckets::DEFAULT_BUCKET_CAP);
            layout::units_by_cap(specs, cap.max(1))
        }
        None => ddp_buckets(specs, opts.unit_cap_bytes)?,
    })
}

/// What every rank must agree on before any call: the strategy, the
/// units, prefetch, the optimizer and mixed precision.
fn describe_setup(
    opts: &ShardOptions,
    layout: Result<&Layout, &String>,
    optimizer: &dyn ShardOptimizer,
) -> String {
    match layout {
        Ok(l) => format!(
            "strategy {}, units {:?}, prefetch {}, optimizer {} ({} slots), mixed precision {:?}",
            opts.strategy,
            l.units,
            opts.prefetch,
            optimizer.name(),
            optimizer.slots(),
            opts.mixed_precision
        ),
        Err(e) => format!("invalid units ({e})"),
    }
}

/// Shards per flat: the world, or HSDP's shard-group size.
fn shard_count(strategy: Strategy, world: usize) -> Result<usize, String> {
    match strategy {
        Strategy::Hsdp { shard_size: g } if g == 0 || !world.is_multiple_of(g) => Err(format!(
            "HSDP's shard size {g} must be at least 1 and divide the world size {world} (torch: \
             a device mesh of (replicas, shard size))"
        )),
        Strategy::Hsdp { shard_size } => Ok(shard_size),
        _ => Ok(world),
    }
}

/// One flat's storage, filled from the model's (broadcast) parameters:
/// in host memory, or on the model's device.
fn flat_state(
    f: &Flat,
    model: &mut (impl ParamSet + ?Sized),
    (place, strategy, index, shards): (Option<&Placement>, Strategy, usize, usize),
    slots: usize,
) -> Result<FlatState, consort_comm::CommError> {
    let padded = f.padded(shards);
    let mut whole = Vals::zeros_on(place, f.dtype, padded)?;
    for s in &f.segments {
        match whole.dev() {
            None => whole.copy_from_bytes(s.offset, model.param_bytes_mut(s.param))?,
            Some(d) => {
                let src = model.param_device(s.param).ok_or_else(|| {
                    consort_comm::CommError::invalid("a device parameter without storage")
                })?;
                if src.dtype() != f.dtype {
                    return Err(consort_comm::CommError::invalid(format!(
                        "a parameter's device storage is {}, its flat {}",
                        src.dtype(),
                        f.dtype
                    )));
                }
                // The layout's size: copy_in checks the view holds it.
                let bytes = s.numel * f.dtype.size_bytes();
                crate::device::copy_in(d.place(), d.addr(s.offset), &src, bytes, "a parameter")
                    .map_err(consort_comm::CommError::invalid)?;
                crate::device::order_before(d.place(), src.stream())?;
            }
        }
    }
    let params = if strategy.shards_params() {
        whole.slice(f.shard_range(index))?
    } else {
        whole
    };
    let grad_len = if strategy.shards_grads() {
        f.shard_len
    } else {
        padded
    };
    let zeros = |n| Vals::zeros_on(place, f.dtype, n);
    Ok(FlatState {
        params: Arc::new(params),
        grads: zeros(grad_len)?,
        state: (0..slots)
            .map(|_| zeros(f.shard_len))
            .collect::<Result<_, _>>()?,
        staging: None,
    })
}
