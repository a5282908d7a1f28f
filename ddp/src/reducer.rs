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

use std::{
    fmt,
    ops::{Deref, DerefMut},
    path::Path,
    sync::Arc,
    time::Duration,
};

use consort_comm::{
    Backend, BufferMut, CallOptions, CommError, DType, DeviceBuffer, Element, Placement,
};
use tokio::sync::mpsc;

pub use crate::error::DdpError;

use crate::{
    StateDict,
    buckets::{BucketError, ParamInfo, assign_buckets, bucket_limits},
    device::{self as dev, Storage},
    hook::CommHook,
    params::{ParamSet, ParamSpec},
    powersgd::Piece,
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
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_bytes: None,
            find_unused_parameters: false,
            broadcast_buffers: true,
            comm_hook: CommHook::AllReduce,
            timeout: None,
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

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
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

    fn slot(&self, i: usize) -> Result<Slot, DdpError> {
        self.slots.get(i).copied().ok_or_else(|| {
            self.usage(format!(
                "parameter index {i} is out of range (the model has {} parameters)",
                self.specs.len()
            ))
        })
    }

    fn check_dtype<T: Element>(&self, i: usize) -> Result<(), DdpError> {
        let p = &self.specs[i];
        if p.dtype == T::DTYPE {
            Ok(())
        } else {
            Err(self.usage(format!(
                "parameter {} is {}, but its gradient was given as {}",
                p.name,
                p.dtype,
                T::DTYPE
            )))
        }
    }

    /// The bytes of parameter `i`'s gradient in its bucket.
    fn slot_bytes(&mut self, i: usize) -> Result<&mut [u8], DdpError> {
        let s = self.slot(i)?;
        let name = &self.specs[i].name;
        match self.buckets[s.bucket].data.as_mut() {
            Some(Storage::Host(d)) => Ok(&mut d.bytes_mut()[s.offset..s.offset + s.len]),
            Some(Storage::Device(_)) => Err(DdpError::Usage {
                rank: self.rank,
                reason: format!(
                    "the gradient of {name} lives in a device bucket; use grad_device({i}) and \
                     mark_ready_device, or copy_grads_to(model), instead of host views"
                ),
            }),
            None => Err(DdpError::Usage {
                rank: self.rank,
                reason: format!(
                    "the gradient of {name} is being reduced (its bucket is in flight); wait for \
                     finish() before touching it"
                ),
            }),
        }
    }

    /// Marks parameter `i`'s gradient ready and copies `grad` into its
    /// bucket (torch's autograd hook). Under [`Ddp::no_sync`] it does
    /// nothing: gradient accumulation is the model's, as with `.grad`.
    pub fn mark_ready<T: Element>(&mut self, i: usize, grad: &[T]) -> Result<(), DdpError> {
        self.slot(i)?;
        self.check_dtype::<T>(i)?;
        self.mark_ready_bytes(i, bytemuck::cast_slice(grad))
    }

    /// [`Ddp::mark_ready`] with the gradient as little-endian bytes.
    pub fn mark_ready_bytes(&mut self, i: usize, grad: &[u8]) -> Result<(), DdpError> {
        self.check()?;
        let s = self.slot(i)?;
        if grad.len() != s.len {
            let p = &self.specs[i];
            return Err(self.usage(format!(
                "the gradient of {} has {} bytes; {} needs {}",
                p.name,
                grad.len(),
                p.describe(),
                s.len
            )));
        }
        if !self.sync {
            return Ok(());
        }
        self.check_not_marked(i)?;
        if let Some(p) = self.placement.clone() {
            let dst = self.slot_ptr(i)?;
            // SAFETY: `dst` is parameter i's slot of `grad.len()` bytes
            // (checked above) in a live device bucket.
            unsafe { p.device.copy_from_host(dst, grad, p.stream) }
                .map_err(|e| self.device_error(i, e.to_string()))?;
        } else {
            self.slot_bytes(i)?.copy_from_slice(grad);
        }
        self.note_ready(i);
        Ok(())
    }

    /// The device address of parameter `i`'s slot in its device bucket.
    fn slot_ptr(&self, i: usize) -> Result<u64, DdpError> {
        let s = self.slot(i)?;
        match &self.buckets[s.bucket].data {
            Some(Storage::Device(d)) => Ok(d.ptr() + s.offset as u64),
            _ => Err(self.usage(format!(
                "{} has no device bucket: this Ddp wraps a host model (its ParamSet has no \
                 placement); use mark_ready and grad_mut",
                self.specs[i].name
            ))),
        }
    }

    fn device_error(&self, i: usize, reason: String) -> DdpError {
        self.usage(format!("device copy for {}: {reason}", self.specs[i].name))
    }

    /// Device-resident [`Ddp::mark_ready`]: enqueues the copy of `grad`
    /// into parameter `i`'s device bucket on the compute stream (after the
    /// stream `grad` is ready on), and launches the bucket's all-reduce
    /// once it is complete. Never blocks the host.
    pub fn mark_ready_device(&mut self, i: usize, grad: DeviceBuffer) -> Result<(), DdpError> {
        self.check()?;
        let s = self.slot(i)?;
        if grad.dtype() != self.specs[i].dtype {
            let p = &self.specs[i];
            return Err(self.usage(format!(
                "parameter {} is {}, but its gradient was given as {}",
                p.name,
                p.dtype,
                grad.dtype()
            )));
        }
        if !self.sync {
            return Ok(());
        }
        self.check_not_marked(i)?;
        let dst = self.slot_ptr(i)?;
        let p = self
            .placement
            .clone()
            .ok_or_else(|| self.usage("no placement"))?;
        let what = format!("the gradient of {}", self.specs[i].name);
        dev::copy_in(&p, dst, &grad, s.len, &what).map_err(|e| self.device_error(i, e))?;
        self.note_ready(i);
        Ok(())
    }

    /// Gradient-as-bucket-view on the device: parameter `i`'s slot in its
    /// device bucket, ready on the compute stream. Backward writes (or
    /// accumulates) into it, then calls [`Ddp::mark_ready_in_place`];
    /// after [`Ddp::finish`], work enqueued on the compute stream sees the
    /// average.
    pub fn grad_device(&self, i: usize) -> Result<DeviceBuffer, DdpError> {
        let ptr = self.slot_ptr(i)?;
        let p = self
            .placement
            .as_ref()
            .ok_or_else(|| self.usage("no placement"))?;
        let spec = &self.specs[i];
        // SAFETY: the slot lies in a live device bucket of this Ddp, which
        // frees buckets only stream-ordered (rebuild, drop).
        Ok(unsafe { p.buffer(ptr, spec.numel(), spec.dtype) })
    }

    /// Gradient-as-bucket-view (torch's `gradient_as_bucket_view=True`):
    /// parameter `i`'s gradient storage inside its bucket, for backward to
    /// write (or accumulate) into, so that no copy is made in either
    /// direction. Zeroed by [`Ddp::zero_grad`]; after [`Ddp::finish`] it
    /// holds the averaged gradient.
    pub fn grad_mut<T: Element>(&mut self, i: usize) -> Result<&mut [T], DdpError> {
        self.slot(i)?;
        self.check_dtype::<T>(i)?;
        let rank = self.rank;
        let b = self.slot_bytes(i)?;
        // Bucket storage is 8-byte aligned and every slot starts at a
        // multiple of its element size within a single-dtype bucket.
        bytemuck::try_cast_slice_mut(b).map_err(|e| DdpError::Usage {
            rank,
            reason: format!("bucket view: {e:?}"),
        })
    }

    /// Parameter `i`'s gradient as it is in its bucket: after
    /// [`Ddp::finish`], the average over all ranks.
    pub fn grad<T: Element>(&mut self, i: usize) -> Result<&[T], DdpError> {
        Ok(self.grad_mut::<T>(i)?)
    }

    /// Marks parameter `i` ready after backward wrote its gradient through
    /// [`Ddp::grad_mut`]. Under [`Ddp::no_sync`] it does nothing.
    pub fn mark_ready_in_place(&mut self, i: usize) -> Result<(), DdpError> {
        self.check()?;
        self.slot(i)?;
        if !self.sync {
            return Ok(());
        }
        self.check_not_marked(i)?;
        self.note_ready(i);
        Ok(())
    }

    fn check_not_marked(&self, i: usize) -> Result<(), DdpError> {
        if self.marked[i] {
            return Err(self.usage(format!(
                "the gradient of {} was marked ready twice in one step. Mark each parameter once \
                 per backward; if it is used twice in the forward pass, mark it after its gradient \
                 is fully accumulated",
                self.specs[i].name
            )));
        }
        Ok(())
    }

    fn note_ready(&mut self, i: usize) {
        self.marked[i] = true;
        self.ready_order.push(i);
        let b = self.slots[i].bucket;
        self.buckets[b].pending -= 1;
        self.launch_ready();
    }

    /// Hands every complete bucket to the worker, in index order.
    fn launch_ready(&mut self) {
        if self.join && !self.started {
            let _ = self.jobs.send(Job::Count { active: true });
            self.in_flight += 1;
        }
        self.started = true;
        while let Some(b) = self.buckets.get_mut(self.next_launch) {
            if b.pending > 0 {
                break;
            }
            let data = match &b.data {
                Some(Storage::Device(d)) => Storage::Device(*d),
                _ => b
                    .data
                    .take()
                    .unwrap_or(Storage::Host(crate::hook::Words::default())),
            };
            let pieces = match self.opts.comm_hook {
                CommHook::PowerSgd { .. } => Arc::new(
                    b.params
                        .iter()
                        .map(|&i| {
                            let shape = &self.specs[i].shape;
                            let rows = shape.first().copied().unwrap_or(1);
                            Piece {
                                param: i,
                                offset: self.slots[i].offset / b.dtype.size_bytes(),
                                rows,
                                cols: self.specs[i].numel() / rows.max(1),
                            }
                        })
                        .collect(),
                ),
                _ => Arc::default(),
            };
            let job = Job::Reduce {
                index: self.next_launch,
                dtype: b.dtype,
                data,
                pieces,
                step: self.steps,
            };
            self.next_launch += 1;
            self.in_flight += 1;
            // A closed channel means the worker is gone; finish reports it.
            let _ = self.jobs.send(job);
        }
    }

    /// Waits for every bucket of this step (launching those that are
    /// left) and leaves the averaged gradients in the buckets. Under
    /// [`Ddp::no_sync`] it only ends the step.
    ///
    /// A parameter that was never marked is an error naming it, unless
    /// `find_unused_parameters` is on; then its gradient counts as zero.
    /// After the first synced step the buckets are rebuilt in the order
    /// rank 0's gradients became ready (torch's bucket rebuild).
    pub async fn finish(&mut self) -> Result<(), DdpError> {
        self.check()?;
        if !self.sync {
            self.reset_step();
            return Ok(());
        }
        let missing: Vec<usize> = (0..self.specs.len()).filter(|&i| !self.marked[i]).collect();
        if !missing.is_empty() {
            if !self.opts.find_unused_parameters {
                let names: Vec<&str> = missing
                    .iter()
                    .take(5)
                    .map(|&i| self.specs[i].name.as_str())
                    .collect();
                let e = DdpError::MissingGrads {
                    rank: self.rank,
                    count: missing.len(),
                    names: names.join(", ") + if missing.len() > 5 { ", …" } else { "" },
                };
                return Err(self.fail(e));
            }
            for i in missing {
                if let Some(p) = self.placement.clone() {
                    let len = self.slot(i)?.len;
                    let ptr = self.slot_ptr(i)?;
                    dev::zero(&p, ptr, len).map_err(|e| self.device_error(i, e.to_string()))?;
                } else if let Ok(b) = self.slot_bytes(i) {
                    b.fill(0);
                }
                self.marked[i] = true;
                let b = self.slots[i].bucket;
                self.buckets[b].pending -= 1;
            }
        }
        self.launch_ready();
        self.drain().await?;
        if !self.rebuilt && !self.opts.find_unused_parameters {
            self.rebuild().await?;
        }
        self.reset_step();
        self.steps += 1;
        Ok(())
    }

    /// Collects every result the worker owes.
    async fn drain(&mut self) -> Result<(), DdpError> {
        let mut first: Option<DdpError> = None;
        while self.in_flight > 0 {
            let Some(done) = self.done.recv().await else {
                let e = self.usage("the DDP bucket worker stopped (its runtime shut down?)");
                return Err(self.fail(e));
            };
            self.in_flight -= 1;
            let (what, result) = match done {
                Done::Reduced {
                    index,
                    data,
                    result,
                } => {
                    self.buckets[index].data = Some(data);
                    (self.describe_bucket(index), result)
                }
                Done::Count(r) => ("join count".to_string(), r.map(|_| ())),
            };
            if let Err(source) = result
                && first.is_none()
            {
                let what = if matches!(
                    source,
                    CommError::Mismatch { .. } | CommError::Timeout { .. }
                ) {
                    format!(
                        "{what} (if the ranks run different numbers of steps, as with uneven \
                         data, call enable_join() on every rank and join() on those that run \
                         out: torch's `with model.join():`)"
                    )
                } else {
                    what
                };
                first = Some(DdpError::Comm {
                    what,
                    source: Box::new(source),
                });
            }
        }
        match first {
            Some(e) => Err(self.fail(e)),
            None => Ok(()),
        }
    }

    fn describe_bucket(&self, b: usize) -> String {
        let names: Vec<&str> = self.buckets[b]
            .params
            .iter()
            .take(3)
            .map(|&i| self.specs[i].name.as_str())
            .collect();
        let more = self.buckets[b].params.len().saturating_sub(3);
        let tail = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        format!("all-reduce of bucket {b} ({}{tail})", names.join(", "))
    }

    fn reset_step(&mut self) {
        self.marked.fill(false);
        self.ready_order.clear();
        self.next_launch = 0;
        self.started = false;
        for b in &mut self.buckets {
            b.pending = b.params.len();
        }
    }

    /// Rebuilds the buckets in the order rank 0's gradients became ready,
    /// keeping every gradient.
    async fn rebuild(&mut self) -> Result<(), DdpError> {
        let n = self.specs.len();
        let mut order: Vec<u64> = if self.ready_order.len() == n {
            self.ready_order.iter().map(|&i| i as u64).collect()
        } else {
            // Not a full step here (a joined rank): rank 0's order wins.
            self.buckets
                .iter()
                .flat_map(|b| b.params.iter().rev().map(|&i| i as u64))
                .collect()
        };
        let opts = self.call.with_timeout(self.timeout());
        let opts = CallOptions { root: 0, ..opts };
        if let Err(source) = self
            .backend
            .broadcast(BufferMut::from(&mut order), &opts)
            .await
        {
            let e = DdpError::Comm {
                what: "broadcast of rank 0's bucket order".into(),
                source: Box::new(source),
            };
            return Err(self.fail(e));
        }
        let order: Vec<usize> = order.iter().map(|&i| i as usize).collect();
        let limits = bucket_limits(self.opts.bucket_cap_bytes);
        let assignment = match assign_buckets(&self.infos(), &limits, Some(&order)) {
            Ok(a) => a,
            Err(e) => {
                let e = self.bucket_error(e);
                return Err(self.fail(e));
            }
        };
        if let Some(p) = self.placement.clone() {
            if let Err(e) = self.relayout_device(&p, assignment) {
                return Err(self.fail(e));
            }
            self.rebuilt = true;
            return Ok(());
        }
        let old: Vec<Vec<u8>> = (0..n)
            .map(|i| self.slot_bytes(i).map(|b| b.to_vec()).unwrap_or_default())
            .collect();
        if let Err(e) = self.layout(assignment) {
            return Err(self.fail(e));
        }
        for (i, g) in old.iter().enumerate() {
            if let Ok(b) = self.slot_bytes(i) {
                b.copy_from_slice(g);
            }
        }
        self.rebuilt = true;
        Ok(())
    }

    /// Device buckets for a new assignment: every gradient copied slot to
    /// slot on the compute stream, the old buckets freed after the copies.
    fn relayout_device(
        &mut self,
        p: &Placement,
        assignment: Vec<Vec<usize>>,
    ) -> Result<(), DdpError> {
        let n = self.specs.len();
        let old: Vec<u64> = (0..n).map(|i| self.slot_ptr(i)).collect::<Result<_, _>>()?;
        let old_buckets: Vec<Storage> = self
            .buckets
            .iter_mut()
            .filter_map(|b| b.data.take())
            .collect();
        self.layout(assignment)?;
        for (i, &src) in old.iter().enumerate() {
            let (dst, len) = (self.slot_ptr(i)?, self.slots[i].len);
            dev::copy_slot(p, dst, src, len).map_err(|e| self.device_error(i, e.to_string()))?;
        }
        for b in old_buckets {
            b.free(Some(p))
                .map_err(|e| self.usage(format!("freeing an old bucket: {e}")))?;
        }
        Ok(())
    }

    fn timeout(&self) -> Duration {
        self.call.timeout_or(self.backend.default_timeout())
    }

    /// Zeroes every gradient in the buckets (`optimizer.zero_grad()` in
    /// gradient-as-bucket-view mode).
    ///
    /// With device buckets the zeroing is enqueued on the compute stream;
    /// a device error makes this `Ddp` fail (the next call reports it).
    pub fn zero_grad(&mut self) {
        let mut failed = None;
        for b in &mut self.buckets {
            match &mut b.data {
                Some(Storage::Host(d)) => d.bytes_mut().fill(0),
                Some(Storage::Device(d)) => {
                    if let Some(p) = &self.placement {
                        let bytes = d.len() * d.dtype().size_bytes();
                        if let Err(e) = dev::zero(p, d.ptr(), bytes) {
                            failed.get_or_insert(e);
                        }
                    }
                }
                None => {}
            }
        }
        if let Some(e) = failed {
            let e = self.usage(format!("zeroing the device buckets: {e}"));
            self.fail(e);
        }
    }

    /// Writes every averaged gradient into `model`'s gradients (the copy
    /// that gradient-as-bucket-view avoids).
    ///
    /// For a device model the copies are enqueued on the compute stream
    /// (after the all-reduces it already waits for); the host does not
    /// wait.
    pub fn copy_grads_to(&mut self, model: &mut (impl ParamSet + ?Sized)) -> Result<(), DdpError> {
        self.check()?;
        if let Some(p) = self.placement.clone() {
            for i in 0..self.specs.len() {
                let s = self.slot(i)?;
                let Some(grad) = model.grad_device(i) else {
                    return Err(self.usage(format!(
                        "the model has no device gradient storage for {}",
                        self.specs[i].name
                    )));
                };
                let src = self.slot_ptr(i)?;
                let what = format!("the model's gradient storage for {}", self.specs[i].name);
                dev::copy_out(&p, &grad, src, s.len, &what).map_err(|e| self.device_error(i, e))?;
            }
            return Ok(());
        }
        for i in 0..self.specs.len() {
            let want = self.slot(i)?.len;
            let have = model.grad_bytes_mut(i).len();
            if have != want {
                let name = &self.specs[i].name;
                return Err(self.usage(format!(
                    "the model's gradient storage for {name} has {have} bytes; it needs {want}"
                )));
            }
            let src = self.slot_bytes(i)?;
            model.grad_bytes_mut(i).copy_from_slice(src);
        }
        Ok(())
    }

    /// One synced step for a model whose gradients are all computed: marks
    /// every parameter that has a gradient (in bucket order), waits for the
    /// buckets, and writes the averages back into `model`.
    pub async fn sync_grads(
        &mut self,
        model: &mut (impl ParamSet + ?Sized),
    ) -> Result<(), DdpError> {
        self.check()?;
        let order: Vec<usize> = self
            .buckets
            .iter()
            .flat_map(|b| b.params.iter().rev().copied())
            .collect();
        for i in order {
            if self.placement.is_some() {
                if let Some(g) = model.grad_device(i) {
                    self.mark_ready_device(i, g)?;
                }
            } else if let Some(g) = model.grad_bytes(i) {
                self.mark_ready_bytes(i, g)?;
            }
        }
        self.finish().await?;
        if self.sync {
            self.copy_grads_to(model)?;
        }
        Ok(())
    }

    /// torch's `no_sync()`: until the guard drops, steps reduce nothing and
    /// gradients accumulate where backward writes them. The first step
    /// after it reduces the accumulated gradients.
    pub fn no_sync(&mut self) -> NoSync<'_, B> {
        self.sync = false;
        NoSync { ddp: self }
    }

    /// Sends rank 0's buffers to every rank (torch does this before each
    /// forward when `broadcast_buffers=True`). Does nothing when the option
    /// is off. Every rank must call it.
    pub async fn broadcast_buffers(
        &mut self,
        model: &mut (impl ParamSet + ?Sized),
    ) -> Result<(), DdpError> {
        self.check()?;
        if !self.opts.broadcast_buffers {
            return Ok(());
        }
        let buffers = model.buffers();
        let res = if self.placement.is_some() {
            dev::broadcast_device(&*self.backend, model, &[], &buffers, &self.call).await
        } else {
            broadcast_tensors(&*self.backend, model, &[], &buffers, &self.call).await
        };
        if let Err(e) = res {
            return Err(self.fail(e));
        }
        Ok(())
    }

    /// Starts torch's `join()` context for uneven inputs: from now on every
    /// synced step first counts the ranks still training, so that ranks
    /// that ran out of data can call [`Ddp::join`] and shadow the others'
    /// collectives. Every rank must call it before the same step.
    pub fn enable_join(&mut self) {
        self.join = true;
    }

    /// For a rank that has run out of data (inside [`Ddp::enable_join`]):
    /// takes part in the other ranks' steps with zero gradients until every
    /// rank has joined. Averages still divide by the full world size, as
    /// torch's default (`divide_by_initial_world_size=True`).
    ///
    /// Buffers are not shadowed: with `broadcast_buffers`, stop calling
    /// [`Ddp::broadcast_buffers`] inside the join context.
    pub async fn join(&mut self) -> Result<(), DdpError> {
        self.check()?;
        if !self.join {
            return Err(self.usage(
                "join() needs enable_join() on every rank first (torch: `with model.join():`)",
            ));
        }
        if self.started || self.in_flight > 0 || !self.sync {
            return Err(
                self.usage("join() must be called between steps (after finish(), outside no_sync)")
            );
        }
        loop {
            let _ = self.jobs.send(Job::Count { active: false });
            self.in_flight += 1;
            let Some(done) = self.done.recv().await else {
                let e = self.usage("the DDP bucket worker stopped (its runtime shut down?)");
                return Err(self.fail(e));
            };
            self.in_flight -= 1;
            let active = match done {
                Done::Count(Ok(n)) => n,
                Done::Count(Err(source)) => {
                    let e = DdpError::Comm {
                        what: "join count".into(),
                        source: Box::new(source),
                    };
                    return Err(self.fail(e));
                }
                Done::Reduced { .. } => {
                    let e = self.usage("DDP worker answered out of order");
                    return Err(self.fail(e));
                }
            };
            if active == 0 {
                self.join = false;
                return Ok(());
            }
            // Shadow one step: every bucket, in order, with zeros.
            self.zero_grad();
            self.started = true;
            for i in 0..self.specs.len() {
                self.marked[i] = true;
            }
            for b in &mut self.buckets {
                b.pending = 0;
            }
            self.launch_ready();
            self.drain().await?;
            if !self.rebuilt && !self.opts.find_unused_parameters {
                self.rebuild().await?;
            }
            self.reset_step();
            self.steps += 1;
        }
    }

    /// Writes `state` as a safetensors checkpoint at `path` on rank 0 (temp
    /// file, fsync, rename), then tells every rank whether it worked. Every
    /// rank must call it; only rank 0 touches the file system. Save the
    /// bare keys (`PlainModel::state_dict`, or `StateDict::unwrapped`): they
    /// load into wrapped and bare models alike.
    pub async fn save_checkpoint(
        &mut self,
        path: &Path,
        state: &StateDict,
        metadata: &std::collections::BTreeMap<String, String>,
    ) -> Result<(), DdpError> {
        self.check()?;
        let mut status = [0u8; 1];
        let mut reason = String::new();
        if self.rank == 0
            && let Err(e) = crate::save_safetensors(path, state, metadata)
        {
            status[0] = 1;
            reason = e.to_string();
        }
        let opts = CallOptions {
            root: 0,
            ..self.call
        };
        if let Err(source) = self
            .backend
            .broadcast(BufferMut::from(&mut status[..]), &opts)
            .await
        {
            let e = DdpError::Comm {
                what: "checkpoint status broadcast".into(),
                source: Box::new(source),
            };
            return Err(self.fail(e));
        }
        if status[0] != 0 {
            if reason.is_empty() {
                reason = format!("rank 0 could not write {}", path.display());
            }
            return Err(DdpError::Checkpoint {
                rank: self.rank,
                reason,
            });
        }
        Ok(())
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
