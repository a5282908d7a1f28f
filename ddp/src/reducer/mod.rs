//! [`Ddp`]: DistributedDataParallel over any [`Backend`].
//!
//! # A step
//!
//! ```text
//! ddp.zero_grad()                        (view mode) / model.zero_grad()
//! backward: for each gradient, as soon as it is computed,
//!     ddp.mark_ready(i, &grad)           copies it into its bucket, or
//!     ddp.grad_mut(i) + mark_ready_in_place(i)   (gradient as bucket view)
//!   a bucket whose gradients are all ready is handed to the bucket worker,
//!   which reduces buckets one at a time in index order, while backward goes on
//! ddp.finish().await                     waits for every bucket
//! read ddp.grad(i), or ddp.copy_grads_to(&mut model)
//! optimizer step
//! ```
//!
//! [`Ddp::sync_grads`] does the last four lines for a model whose
//! gradients are all computed already (a framework with no backward hooks).
//!
//! # What every rank must do alike
//!
//! Every rank issues the same collectives in the same order: the same
//! buckets (so the same parameters, checked at construction), the same
//! number of synced steps (or [`Ddp::join`] for the ranks that run out of
//! data first), `no_sync` on the same steps.
//!
//! # Failure
//!
//! A failed bucket (a lost peer, a timeout) fails the step, and the `Ddp`
//! stays failed: every later call returns the first error, because the
//! ranks no longer agree on where they are.

mod finish;
mod mark;
mod shrink;
mod step_extras;

pub use shrink::OnPeerLost;

/// Runs `$body` with `$b` bound to the group DDP reduces over now: the
/// backend it was made with, or the survivors' group after a shrink.
macro_rules! on_group {
    ($self:expr, $b:ident => $body:expr) => {
        match $self.group.clone() {
            Some(g) => {
                let $b = &*g;
                $body
            }
            None => {
                let owned = $self.backend.clone();
                let $b = &*owned;
                $body
            }
        }
    };
}
pub(crate) use on_group;

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::Arc,
    time::Duration,
};

use consort_comm::{Backend, CallOptions, DType, Placement};
use tokio::sync::mpsc;

pub use crate::error::DdpError;

use crate::{
    buckets::{BucketError, ParamInfo, assign_buckets},
    device::{self as dev, Storage},
    hook::CommHook,
    params::{ParamSet, ParamSpec},
    setup::{broadcast_tensors, check_same_model},
    worker::{Done, Job, worker},
};

/// How a [`Ddp`] is configured; torch's `DistributedDataParallel`
/// arguments under the same names.
#[derive(Clone, Debug)]
pub struct DdpOptions {
    /// `bucket_cap_mb` in bytes; `None` keeps torch's default (25 MiB, and
    /// 1 MiB for the first bucket once buckets are rebuilt).
    pub bucket_cap_bytes: Option<usize>,
    /// Parameters without a gradient at [`Ddp::finish`] count as zero
    /// instead of being an error. Turns off bucket rebuilding, as in torch.
    pub find_unused_parameters: bool,
    /// Whether [`Ddp::broadcast_buffers`] sends rank 0's buffers (torch's
    /// default: true).
    pub broadcast_buffers: bool,
    /// The reduction run on each bucket.
    pub comm_hook: CommHook,
    /// Timeout of each collective; `None`: the backend's default.
    pub timeout: Option<Duration>,
    /// What to do when a peer is lost: fail (torch), or continue on the
    /// survivors ([`OnPeerLost::Shrink`]).
    pub on_peer_lost: OnPeerLost,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_bytes: None,
            find_unused_parameters: false,
            broadcast_buffers: true,
            comm_hook: CommHook::AllReduce,
            timeout: None,
            on_peer_lost: OnPeerLost::Fail,
        }
    }
}

impl DdpOptions {
    /// `bucket_cap_mb` (MiB, as torch counts it).
    pub fn bucket_cap_mb(mut self, mb: f64) -> Self {
        self.bucket_cap_bytes = Some((mb * 1024.0 * 1024.0).max(1.0) as usize);
        self
    }

    /// `find_unused_parameters`.
    pub fn find_unused_parameters(mut self, on: bool) -> Self {
        self.find_unused_parameters = on;
        self
    }

    /// `broadcast_buffers`.
    pub fn broadcast_buffers(mut self, on: bool) -> Self {
        self.broadcast_buffers = on;
        self
    }

    /// `register_comm_hook`.
    pub fn comm_hook(mut self, hook: CommHook) -> Self {
        self.comm_hook = hook;
        self
    }

    /// The timeout of every collective DDP runs.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = Some(t);
        self
    }

    /// What to do when a peer is lost ([`OnPeerLost`]).
    pub fn on_peer_lost(mut self, policy: OnPeerLost) -> Self {
        self.on_peer_lost = policy;
        self
    }
}

/// One bucket: parameters of one dtype whose gradients are reduced
/// together.
#[derive(Debug)]
struct Bucket {
    dtype: DType,
    /// Parameter indices, in increasing order (the bucket's layout).
    params: Vec<usize>,
    /// The gradients; `None` while the bucket worker has host storage
    /// (device storage stays: the streams order its uses).
    data: Option<Storage>,
    /// Parameters not yet marked ready this step.
    pending: usize,
}

/// Where one parameter's gradient lives.
#[derive(Debug, Clone, Copy)]
struct Slot {
    bucket: usize,
    /// Byte offset in the bucket.
    offset: usize,
    /// Bytes.
    len: usize,
}

/// DistributedDataParallel: keeps the replicas of one model in step by
/// averaging gradients across ranks, bucket by bucket, while backward
/// runs. See the [module docs](self) for a step.
///
/// Each gradient is handed over as backward produces it (torch's autograd
/// hooks), last layer first; [`Ddp::finish`] waits for the buckets:
///
/// ```
/// use std::sync::Arc;
/// use consort_ddp::{Ddp, DdpOptions, PlainModel};
/// use consort_sim::{SimConfig, SimWorld};
///
/// let world = SimWorld::new(SimConfig::new(2))?;
/// let out = world.run_each(|rank| async move {
///     let mut model = PlainModel::new();
///     model.add_param::<f32>("fc1.weight", vec![4], &[0.1; 4])?;
///     model.add_param::<f32>("fc2.weight", vec![2], &[0.2; 2])?;
///     let rank = Arc::new(rank);
///     let r = consort_comm::Backend::rank(&*rank) as f32;
///     let mut ddp = Ddp::new(rank, &mut model, DdpOptions::default()).await?;
///     ddp.mark_ready(1, &[r; 2])?; // backward reaches fc2 first
///     ddp.mark_ready(0, &[r; 4])?;
///     ddp.finish().await?;
///     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(ddp.grad::<f32>(0)?.to_vec())
/// })?;
/// for g in out {
///     assert_eq!(g.unwrap(), [0.5; 4]); // the mean of rank 0's 0 and rank 1's 1
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Ddp<B: Backend + ?Sized + 'static> {
    backend: Arc<B>,
    opts: DdpOptions,
    call: CallOptions,
    rank: usize,
    /// Where buckets live: `None` for the host, else the model's device
    /// and compute stream.
    placement: Option<Placement>,
    specs: Vec<ParamSpec>,
    buckets: Vec<Bucket>,
    slots: Vec<Slot>,
    /// This step's marks, and the order they came in.
    marked: Vec<bool>,
    ready_order: Vec<usize>,
    /// The next bucket to hand to the worker.
    next_launch: usize,
    /// Buckets handed over and not yet back.
    in_flight: usize,
    /// Whether this step has handed anything to the worker (join count
    /// included).
    started: bool,
    sync: bool,
    /// Synced steps finished.
    steps: u64,
    rebuilt: bool,
    join: bool,
    failed: Option<DdpError>,
    jobs: mpsc::UnboundedSender<Job>,
    done: mpsc::UnboundedReceiver<Done>,
    worker: tokio::task::JoinHandle<()>,
    /// The survivors' group, after a shrink ([`OnPeerLost::Shrink`]).
    group: Option<Arc<dyn Backend>>,
    /// Shrinks so far (they name the store keys of the next).
    shrinks: u32,
    /// This wrapper's id in the store, the same on every rank (rank 0's,
    /// broadcast at construction when shrinking is on): one job's keys
    /// never meet another's, or an earlier round's.
    shrink_id: u64,
}

impl<B: Backend + ?Sized + 'static> fmt::Debug for Ddp<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ddp")
            .field("rank", &self.rank)
            .field("params", &self.specs.len())
            .field("buckets", &self.bucket_assignment())
            .field("failed", &self.failed.is_some())
            .finish()
    }
}

impl<B: Backend + ?Sized + 'static> Drop for Ddp<B> {
    fn drop(&mut self) {
        self.worker.abort();
        for b in &mut self.buckets {
            if let Some(data) = b.data.take() {
                // Stream-ordered: after every collective the compute stream
                // already waits for.
                let _ = data.free(self.placement.as_ref());
            }
        }
    }
}

impl<B: Backend + ?Sized + 'static> Ddp<B> {
    /// Wraps `model`: checks that every rank holds the same parameters and
    /// buffers, copies rank 0's values to every rank in coalesced
    /// broadcasts, and assigns gradients to buckets as c10d does. Every
    /// rank must call it. Needs a tokio runtime (the bucket worker is a
    /// task).
    pub async fn new(
        backend: Arc<B>,
        model: &mut (impl ParamSet + ?Sized),
        opts: DdpOptions,
    ) -> Result<Self, DdpError> {
        let rank = backend.rank();
        let usage = |reason: String| DdpError::Usage { rank, reason };
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            usage("Ddp::new must run inside a tokio runtime (its bucket worker is a task)".into())
        })?;
        let specs = model.params();
        let buffers = model.buffers();
        let placement = model.placement();
        if placement.is_some() && opts.comm_hook != CommHook::AllReduce {
            return Err(usage(format!(
                "the model lives on a device, and {} runs on host buckets; device-resident DDP \
                 averages with the backend's Avg on the device (CommHook::AllReduce)",
                opts.comm_hook.name()
            )));
        }
        if let Some(p) = specs.iter().find(|p| !p.dtype.is_float()) {
            return Err(usage(format!(
                "parameter {} has integer dtype {}; gradients must be floating point (register \
                 integer state as a buffer)",
                p.name, p.dtype
            )));
        }
        let mut call = CallOptions::default();
        if let Some(t) = opts.timeout {
            call = call.with_timeout(t);
        }
        check_same_model(&*backend, &specs, &buffers, &call).await?;
        if placement.is_some() {
            dev::broadcast_device(&*backend, model, &specs, &buffers, &call).await?;
        } else {
            broadcast_tensors(&*backend, model, &specs, &buffers, &call).await?;
        }

        let shrink_id = if matches!(opts.on_peer_lost, OnPeerLost::Shrink { .. }) {
            shrink::job_id(&*backend, &call).await?
        } else {
            0
        };
        let (jobs, job_rx) = mpsc::unbounded_channel();
        let (done_tx, done) = mpsc::unbounded_channel();
        let worker = runtime.spawn(worker(
            backend.clone(),
            opts.comm_hook,
            call,
            job_rx,
            done_tx,
        ));
        let mut ddp = Ddp {
            backend,
            opts,
            call,
            rank,
            placement,
            marked: vec![false; specs.len()],
            specs,
            buckets: Vec::new(),
            slots: Vec::new(),
            ready_order: Vec::new(),
            next_launch: 0,
            in_flight: 0,
            started: false,
            sync: true,
            steps: 0,
            rebuilt: false,
            join: false,
            failed: None,
            jobs,
            done,
            worker,
            group: None,
            shrinks: 0,
            shrink_id,
        };
        // c10d: iteration 1 has one bucket per dtype (its ready order is
        // not known yet); the list is reversed, since backward produces the
        // last parameters' gradients first.
        let infos = ddp.infos();
        let mut assignment =
            assign_buckets(&infos, &[usize::MAX], None).map_err(|e| ddp.bucket_error(e))?;
        assignment.reverse();
        ddp.layout(assignment)?;
        Ok(ddp)
    }

    fn infos(&self) -> Vec<ParamInfo> {
        self.specs
            .iter()
            .map(|p| ParamInfo {
                dtype: p.dtype,
                device: -1,
                numel: p.numel(),
            })
            .collect()
    }

    fn bucket_error(&self, e: BucketError) -> DdpError {
        DdpError::Usage {
            rank: self.rank,
            reason: e.to_string(),
        }
    }

    /// Builds fresh, zeroed buckets for `assignment` (on the device, for a
    /// device model).
    fn layout(&mut self, assignment: Vec<Vec<usize>>) -> Result<(), DdpError> {
        self.slots = vec![
            Slot {
                bucket: 0,
                offset: 0,
                len: 0
            };
            self.specs.len()
        ];
        let mut buckets = Vec::with_capacity(assignment.len());
        for (b, mut params) in assignment.into_iter().enumerate() {
            params.sort_unstable();
            let dtype = params.first().map_or(DType::F32, |&i| self.specs[i].dtype);
            let mut offset = 0;
            for &i in &params {
                let len = self.specs[i].bytes();
                self.slots[i] = Slot {
                    bucket: b,
                    offset,
                    len,
                };
                offset += len;
            }
            let data = Storage::zeroed(self.placement.as_ref(), dtype, offset).map_err(|e| {
                self.usage(format!(
                    "could not allocate bucket {b} ({offset} bytes): {e}"
                ))
            })?;
            buckets.push(Bucket {
                dtype,
                pending: params.len(),
                params,
                data: Some(data),
            });
        }
        self.buckets = buckets;
        Ok(())
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The backend it was made with (after a shrink, [`Ddp::group`] is
    /// the group it reduces over).
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The survivors' group, once a peer was lost and DDP shrank past it.
    pub fn group(&self) -> Option<&Arc<dyn Backend>> {
        self.group.as_ref()
    }

    /// Ranks in the group DDP reduces over now.
    pub fn world_size(&self) -> usize {
        on_group!(self, b => b.world_size())
    }

    /// The parameters, as rank 0 and every other rank agreed on them.
    pub fn params(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Bytes of gradient storage in the buckets (every parameter's
    /// gradient, once: DDP keeps them whole on every rank).
    pub fn bucket_bytes(&self) -> usize {
        self.buckets
            .iter()
            .flat_map(|b| &b.params)
            .map(|&p| self.specs[p].bytes())
            .sum()
    }

    /// Each bucket's parameter indices, in launch order.
    pub fn bucket_assignment(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// Whether the buckets have been rebuilt in gradient-ready order (after
    /// the first synced step).
    pub fn buckets_rebuilt(&self) -> bool {
        self.rebuilt
    }

    fn usage(&self, reason: impl Into<String>) -> DdpError {
        DdpError::Usage {
            rank: self.rank,
            reason: reason.into(),
        }
    }

    fn check(&self) -> Result<(), DdpError> {
        match &self.failed {
            Some(e) => Err(DdpError::Failed(Box::new(e.clone()))),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: DdpError) -> DdpError {
        if self.failed.is_none() {
            self.failed = Some(e.clone());
        }
        e
    }
}

/// The guard [`Ddp::no_sync`] returns; dereferences to the `Ddp`.
#[derive(Debug)]
pub struct NoSync<'a, B: Backend + ?Sized + 'static> {
    ddp: &'a mut Ddp<B>,
}

impl<B: Backend + ?Sized + 'static> Deref for NoSync<'_, B> {
    type Target = Ddp<B>;
    fn deref(&self) -> &Ddp<B> {
        self.ddp
    }
}

impl<B: Backend + ?Sized + 'static> DerefMut for NoSync<'_, B> {
    fn deref_mut(&mut self) -> &mut Ddp<B> {
        self.ddp
    }
}

impl<B: Backend + ?Sized + 'static> Drop for NoSync<'_, B> {
    fn drop(&mut self) {
        self.ddp.sync = true;
    }
}
