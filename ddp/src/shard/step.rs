//! A sharded step: gathering units for use (with prefetch), launching each
//! unit's gradient reduction once its gradients are in, and the optimizer
//! step on this rank's shard.

use std::{ops::Range, sync::Arc};

use consort_comm::{Backend, CallOptions, DType, DeviceBuffer, Element, ReduceOp};

use super::{InFlight, Layout, Phase, Sharded, Vals, limit::Recorder, vals};
use crate::{error::DdpError, params::ParamSet};

/// One wrapping unit's whole parameters, from [`Sharded::gather`]. Under
/// FSDP and HSDP it is the only whole copy: dropping it frees it (torch's
/// reshard after use).
#[derive(Debug, Clone)]
pub struct Gathered {
    unit: usize,
    rank: usize,
    layout: Arc<Layout>,
    /// (flat, its whole values, padded).
    flats: Vec<(usize, Arc<Vals>)>,
}

impl Gathered {
    /// The unit.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// The unit's parameters, in registration order.
    pub fn params(&self) -> &[usize] {
        &self.layout.units[self.unit]
    }

    /// The dtype parameter `p` was gathered in: its own, or the compute
    /// dtype of a mixed-precision policy.
    pub fn param_dtype(&self, p: usize) -> Result<DType, DdpError> {
        Ok(self.find(p)?.0.dtype())
    }

    /// Parameter `p`'s values (`p` in registration order; it must be in
    /// this unit, and `T` its dtype).
    pub fn param<T: Element>(&self, p: usize) -> Result<&[T], DdpError> {
        let usage = |reason| DdpError::Usage {
            rank: self.rank,
            reason,
        };
        let (vals, range) = self.find(p)?;
        if vals.dtype() != T::DTYPE {
            return Err(usage(format!(
                "parameter {p} is {}, not {}: read it as its own dtype",
                vals.dtype(),
                T::DTYPE
            )));
        }
        vals::with_vals!(vals, v => bytemuck::try_cast_slice(&v[range]).map_err(|e| usage(format!(
            "parameter {p} cannot be viewed as {}: {e}", T::DTYPE
        ))), _d => Err(usage(format!(
            "parameter {p} was gathered on the device: use param_device({p}), or param_bytes({p}) \
             for a host copy"
        ))))
    }

    /// Parameter `p`'s whole values as a view on the compute stream (a
    /// sharded device model; ready for kernels enqueued on that stream,
    /// and valid while this `Gathered` lives).
    pub fn param_device(&self, p: usize) -> Result<DeviceBuffer, DdpError> {
        let (vals, range) = self.find(p)?;
        vals.dev()
            .map(|d| d.view(range))
            .ok_or_else(|| DdpError::Usage {
                rank: self.rank,
                reason: format!("parameter {p} was gathered in host memory: use param::<T>({p})"),
            })
    }

    /// Parameter `p`'s values as little-endian bytes, on the host or
    /// copied from the device once the compute stream has produced them.
    pub fn param_bytes(&self, p: usize) -> Result<Vec<u8>, DdpError> {
        let (vals, range) = self.find(p)?;
        vals.read_bytes(range)
            .map(std::borrow::Cow::into_owned)
            .map_err(|e| DdpError::Usage {
                rank: self.rank,
                reason: format!("reading parameter {p} from the device: {e}"),
            })
    }

    /// The flat holding parameter `p`, and its elements there.
    fn find(&self, p: usize) -> Result<(&Vals, Range<usize>), DdpError> {
        let usage = |reason| DdpError::Usage {
            rank: self.rank,
            reason,
        };
        if p >= self.layout.place.len() {
            return Err(usage(format!(
                "parameter {p} does not exist: the model has {}",
                self.layout.place.len()
            )));
        }
        let (f, range) = self.layout.range_of(p);
        match self.flats.iter().find(|(g, _)| *g == f) {
            Some((_, vals)) => Ok((vals, range)),
            None => Err(usage(format!(
                "parameter {p} is in wrapping unit {}, not in unit {}: gather that unit",
                self.layout.flats[f].unit, self.unit
            ))),
        }
    }

    /// Bytes it holds (padding included).
    pub fn bytes(&self) -> usize {
        self.flats.iter().map(|(_, v)| v.bytes()).sum()
    }
}

/// All-gathers elements `range` of `input` (one shard) into a new padded
/// buffer in the same place. `done`, a unit's [`Recorder`], goes with the
/// call: once every call of the unit has let it go, the gather's end is
/// recorded on the device.
fn all_gather(
    pg: Arc<dyn Backend>,
    input: Arc<Vals>,
    (range, padded): (Range<usize>, usize),
    call: CallOptions,
    done: Option<Arc<Recorder>>,
) -> InFlight {
    // The output is made now: a rank that cannot allocate it knows before
    // it launches anything more (see `InFlight::failed`).
    let mut out = match input.zeros_like(padded) {
        Ok(out) => out,
        Err(e) => return InFlight::Done(Err(e)),
    };
    InFlight::launch(async move {
        let _done = done;
        pg.all_gather(out.buf_mut(), input.buf(range), &call)
            .await?;
        Ok(out)
    })
}

/// All-gathers into `whole` itself, sending `mine`, a copy of this rank's
/// part: the gather holds one shard more, not a second whole buffer.
fn all_gather_in_place(
    pg: Arc<dyn Backend>,
    mut whole: Vals,
    mine: Vals,
    call: CallOptions,
) -> InFlight {
    InFlight::launch(async move {
        pg.all_gather(whole.buf_mut(), mine.buf(0..mine.len()), &call)
            .await?;
        Ok(whole)
    })
}

/// Averages `buf` whole over `pg`.
fn all_reduce(pg: Arc<dyn Backend>, mut buf: Vals, call: CallOptions) -> InFlight {
    InFlight::launch(async move {
        pg.all_reduce(buf.buf_mut(), ReduceOp::Avg, &call).await?;
        Ok(buf)
    })
}

/// Averages `input` over `pg` and keeps this rank's `shard_len` part, in
/// `reuse` when it fits (the flat's gradients from the last step, which
/// this result replaces), else in a new buffer.
fn reduce_scatter(
    pg: Arc<dyn Backend>,
    input: Vals,
    reuse: Vals,
    shard_len: usize,
    call: CallOptions,
) -> InFlight {
    let fits = reuse.len() == shard_len
        && reuse.dtype() == input.dtype()
        && reuse.dev().is_some() == input.dev().is_some();
    let made = if fits {
        Ok(reuse)
    } else {
        drop(reuse);
        input.zeros_like(shard_len)
    };
    let mut out = match made {
        Ok(out) => out,
        Err(e) => return InFlight::Done(Err(e)),
    };
    InFlight::launch(async move {
        pg.reduce_scatter(
            out.buf_mut(),
            input.buf(0..input.len()),
            ReduceOp::Avg,
            &call,
        )
        .await?;
        Ok(out)
    })
}

impl Sharded {
    /// Unit `unit`'s whole parameters, for the forward or backward pass.
    ///
    /// FSDP and HSDP all-gather it over the shard group (or take the
    /// prefetched gather), then prefetch the next unit: `unit + 1` before
    /// the first gradient of the step, `unit - 1` after. ZeRO-1/2 hand out
    /// the parameters they keep, with no call. Every rank gathers the same
    /// units in the same order.
    pub async fn gather(&mut self, unit: usize) -> Result<Gathered, DdpError> {
        self.enter("gather")?;
        let out = self.gather_unit(unit).await;
        self.leave();
        out
    }

    /// [`Sharded::gather`], inside another call.
    pub(crate) async fn gather_unit(&mut self, unit: usize) -> Result<Gathered, DdpError> {
        self.gather_as(unit, self.compute_dtype()).await
    }

    /// Unit `unit`'s whole f32 master parameters (checkpoints, state dicts
    /// and `copy_params_to`): the compute gather without mixed precision.
    pub(crate) async fn gather_master(&mut self, unit: usize) -> Result<Gathered, DdpError> {
        if self.mixed.is_none() {
            return self.gather_unit(unit).await;
        }
        self.gather_as(unit, None).await
    }

    /// Unit `unit` in dtype `cast` (`None`: the shards' own). The compute
    /// dtype's gathers prefetch and use prefetches; the others neither.
    async fn gather_as(&mut self, unit: usize, cast: Option<DType>) -> Result<Gathered, DdpError> {
        let units = self.layout.units.len();
        if unit >= units {
            return Err(DdpError::Usage {
                rank: self.rank,
                reason: format!("wrapping unit {unit} does not exist: there are {units}"),
            });
        }
        let compute = cast == self.compute_dtype();
        let ids = self.layout.unit_flats[unit].clone();
        let mut flats = Vec::with_capacity(ids.len());
        if !self.strategy.shards_params() {
            for &f in &ids {
                let params = &self.flats[f].params;
                let v = match cast {
                    None => params.clone(),
                    Some(d) => match params.cast(d, self.kernels.as_deref()) {
                        Ok(v) => Arc::new(v),
                        Err(e) => return Err(self.comm_error("casting the parameters", e)),
                    },
                };
                flats.push((f, v));
            }
        } else {
            let prefetched = if compute {
                self.prefetched.remove(&unit)
            } else {
                None
            };
            let calls = match prefetched {
                Some(calls) => calls,
                None => self.limited_gather(unit, cast).await,
            };
            let next = match self.phase {
                Phase::Forward => unit.checked_add(1),
                Phase::Backward => unit.checked_sub(1),
            };
            let launched = calls.iter().all(|c| c.failed().is_none());
            if let Some(n) = next.filter(|&n| launched && compute && self.prefetch && n < units)
                && !self.prefetched.contains_key(&n)
            {
                let calls = self.limited_gather(n, cast).await;
                self.prefetched.insert(n, calls);
            }
            for (&f, call) in ids.iter().zip(calls) {
                let what = format!("all_gather of unit {unit}'s parameters");
                let v = self.finish(call, what).await?;
                flats.push((f, Arc::new(v)));
            }
        }
        Ok(Gathered {
            unit,
            rank: self.rank,
            layout: self.layout.clone(),
            flats,
        })
    }

    /// [`Sharded::launch_gather`] once fewer than two gathers are
    /// unfinished on the device (see [`super::limit`]).
    async fn limited_gather(&self, unit: usize, cast: Option<DType>) -> Vec<InFlight> {
        let timeout = self.call.timeout_or(self.backend.default_timeout());
        self.limit.room(timeout).await;
        self.launch_gather(unit, cast)
    }

    /// Makes the all-gathers of one unit's flats, each shard cast to
    /// `cast` first (mixed precision gathers half the bytes).
    fn launch_gather(&self, unit: usize, cast: Option<DType>) -> Vec<InFlight> {
        let done = self.limit.recorder();
        self.layout.unit_flats[unit]
            .iter()
            .map(|&f| {
                let flat = &self.layout.flats[f];
                let shard = match cast {
                    None => Ok(self.flats[f].params.clone()),
                    Some(d) => (self.flats[f].params)
                        .cast(d, self.kernels.as_deref())
                        .map(Arc::new),
                };
                let padded = flat.padded(self.layout.shards);
                match shard {
                    Ok(shard) => all_gather(
                        self.group.pg.clone(),
                        shard,
                        (0..flat.shard_len, padded),
                        self.call,
                        Some(done.clone()),
                    ),
                    Err(e) => InFlight::Done(Err(e)),
                }
            })
            .collect()
    }

    /// Waits for one call; a failure is sticky.
    pub(super) async fn finish(&mut self, call: InFlight, what: String) -> Result<Vals, DdpError> {
        match call.wait().await {
            Ok(v) => Ok(v),
            Err(e) => {
                let e = self.comm_error(what, e);
                Err(self.fail(e))
            }
        }
    }

    /// Parameter `p`'s local gradient for this step (`grad.len()` its
    /// element count, `T` its dtype). Once every parameter of the next
    /// unit due (the last unit first) has its gradient, that unit's
    /// gradients are averaged in the background. A device model's shards
    /// take a host gradient too (copied up); [`Sharded::mark_ready_device`]
    /// keeps it on the device.
    pub fn mark_ready<T: Element>(&mut self, p: usize, grad: &[T]) -> Result<(), DdpError> {
        self.check()?;
        self.check_grad(p, T::DTYPE, grad.len())?;
        let kernels = self.kernels.clone();
        self.stage(p, |staging, at| {
            let bytes = consort_comm::dtype::as_bytes(grad);
            if T::DTYPE == staging.dtype() {
                return staging.copy_from_bytes(at, bytes);
            }
            // Mixed precision: a param-dtype gradient, reduced in another.
            let mut host = Vals::zeros(T::DTYPE, grad.len())
                .ok_or_else(|| consort_comm::CommError::invalid("a gradient that is no float"))?;
            host.copy_from_bytes(0, bytes)?;
            let cast = host.cast(staging.dtype(), kernels.as_deref())?;
            staging.copy_from_bytes(at, &cast.read_bytes(0..grad.len())?)
        })
    }

    /// [`Sharded::mark_ready`] for a gradient in device memory (a device
    /// model's `grad_device(p)`): copied (or, with mixed precision, cast)
    /// into the unit's staging buffer on the compute stream, after the
    /// stream `grad` is ready on.
    pub fn mark_ready_device(&mut self, p: usize, grad: &DeviceBuffer) -> Result<(), DdpError> {
        self.check()?;
        self.check_grad(p, grad.dtype(), grad.len())?;
        if self.place.is_none() {
            return Err(DdpError::Usage {
                rank: self.rank,
                reason: format!(
                    "mark_ready_device({p}): this model's shards are in host memory; pass the \
                     gradient with mark_ready"
                ),
            });
        }
        let bytes = grad.len() * grad.dtype().size_bytes();
        let what = format!("the gradient of {}", self.specs[p].name);
        let kernels = self.kernels.clone();
        self.stage(p, |staging, at| {
            let to = staging.dtype();
            let (Some(d), Some(k)) = (staging.dev(), kernels.as_deref()) else {
                return Err(consort_comm::CommError::invalid("a host staging buffer"));
            };
            if grad.dtype() == to {
                crate::device::copy_in(d.place(), d.addr(at), grad, bytes, &what)
                    .map_err(consort_comm::CommError::invalid)?;
            } else {
                crate::device::check_view(d.place(), grad, bytes, &what)
                    .map_err(consort_comm::CommError::invalid)?;
                crate::device::order_after(d.place(), grad.stream())?;
                let (src, n) = ((grad.ptr(), grad.dtype()), grad.len());
                // SAFETY: `grad` was checked to hold `n` elements of its
                // dtype on this device; the staging range lies in its live
                // buffer (the layout sized it), written by nothing else this
                // step.
                unsafe { k.cast(d.place(), src, (d.addr(at), to), n) }?;
            }
            // Whatever the gradient's stream does next (zero it, reuse it,
            // free it) waits for the copy.
            crate::device::order_before(d.place(), grad.stream())
        })
    }

    /// Checks a gradient's dtype and length against parameter `p`.
    fn check_grad(&self, p: usize, dtype: consort_comm::DType, len: usize) -> Result<(), DdpError> {
        let usage = |reason| DdpError::Usage {
            rank: self.rank,
            reason,
        };
        let Some(spec) = self.specs.get(p) else {
            return Err(usage(format!(
                "mark_ready({p}): the model has {} parameters",
                self.specs.len()
            )));
        };
        // Mixed precision's gradients are in the compute dtype.
        let want = self.compute_dtype().unwrap_or(spec.dtype);
        if dtype != want || len != spec.numel() {
            let mixed = match self.compute_dtype() {
                Some(d) => format!(" (mixed precision: gradients in {d})"),
                None => String::new(),
            };
            return Err(usage(format!(
                "mark_ready({p}): got {len} {dtype} values for {}{mixed}",
                spec.describe()
            )));
        }
        if self.ready[p] {
            return Err(usage(format!(
                "parameter {} was marked ready twice in one step; call step() between",
                spec.name
            )));
        }
        Ok(())
    }

    /// Puts parameter `p`'s gradient into its flat's staging buffer with
    /// `put(staging, offset)`, and launches what is complete.
    fn stage(
        &mut self,
        p: usize,
        put: impl FnOnce(&mut Vals, usize) -> Result<(), consort_comm::CommError>,
    ) -> Result<(), DdpError> {
        self.phase = Phase::Backward;
        let (f, range) = self.layout.range_of(p);
        let padded = self.layout.flats[f].padded(self.layout.shards);
        let fs = &mut self.flats[f];
        // Gradients are reduced in mixed precision's reduce dtype.
        let reduce = self.mixed.map_or(fs.params.dtype(), |m| m.reduce());
        let staged = match &mut fs.staging {
            Some(s) => put(s, range.start),
            None => fs
                .params
                .zeros_like_dtype(reduce, padded)
                .and_then(|mut s| {
                    let out = put(&mut s, range.start);
                    fs.staging = Some(s);
                    out
                }),
        };
        if let Err(e) = staged {
            let what = format!("staging the gradient of {}", self.specs[p].name);
            let e = self.comm_error(what, e);
            return Err(self.fail(e));
        }
        self.ready[p] = true;
        self.launch_ready()
    }

    /// Launches, from the last unit down, every unit whose gradients are
    /// all in.
    fn launch_ready(&mut self) -> Result<(), DdpError> {
        while self.next_launch > 0 {
            let u = self.next_launch - 1;
            if !self.layout.units[u].iter().all(|&p| self.ready[p]) {
                return Ok(());
            }
            for f in self.layout.unit_flats[u].clone() {
                let staging = self.flats[f]
                    .staging
                    .take()
                    .expect("every parameter was marked");
                // This reduction's result replaces the flat's gradients
                // from the last step: they go now (or take the result),
                // not when it is waited for, so that two steps' gradients
                // never live at once.
                let old = match self.flats[f].grads.take() {
                    Ok(old) => old,
                    Err(e) => {
                        let e = self.comm_error("an empty buffer", e);
                        return Err(self.fail(e));
                    }
                };
                let pg = self.group.pg.clone();
                let call = if self.strategy.shards_grads() {
                    let shard_len = self.layout.flats[f].shard_len;
                    reduce_scatter(pg, staging, old, shard_len, self.call)
                } else {
                    drop(old);
                    all_reduce(pg, staging, self.call)
                };
                // A reduction that could not be made fails this rank now,
                // before it launches the next unit's out of step.
                if let Some(e) = call.failed() {
                    let what = format!("launching unit {u}'s gradient reduction");
                    let e = self.comm_error(what, e.clone());
                    return Err(self.fail(e));
                }
                self.pending.push((f, call));
            }
            self.next_launch = u;
        }
        Ok(())
    }

    /// Finishes the step: waits for the gradient reductions (and, under
    /// HSDP, averages the shards across replicas), updates this rank's
    /// shard with the optimizer, and (ZeRO-1/2) all-gathers the updated
    /// parameters. Every parameter must have had its gradient marked.
    pub async fn step(&mut self) -> Result<(), DdpError> {
        self.enter("step")?;
        let out = self.step_inner().await;
        self.leave();
        out
    }

    async fn step_inner(&mut self) -> Result<(), DdpError> {
        if self.next_launch > 0 {
            let missing: Vec<&str> = (0..self.specs.len())
                .filter(|&p| !self.ready[p])
                .map(|p| self.specs[p].name.as_str())
                .collect();
            let err = DdpError::Usage {
                rank: self.rank,
                reason: format!(
                    "{} parameter(s) got no gradient this step: {}. The sharded strategies \
                     reduce every parameter each step: call mark_ready for every parameter \
                     before step() (with zeros for one the step did not use)",
                    missing.len(),
                    missing
                        .iter()
                        .take(5)
                        .copied()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            return Err(self.fail(err));
        }
        for (f, call) in std::mem::take(&mut self.pending) {
            let unit = self.layout.flats[f].unit;
            let what = if self.strategy.shards_grads() {
                format!("reduce_scatter of unit {unit}'s gradients")
            } else {
                format!("all_reduce of unit {unit}'s gradients")
            };
            self.flats[f].grads = self.finish(call, what).await?;
        }
        if let Some(replicas) = self.group.replicas.clone() {
            let mut calls = Vec::with_capacity(self.flats.len());
            for f in 0..self.flats.len() {
                let g = self.flats[f].grads.take();
                let g = g.map_err(|e| self.comm_error("an empty buffer", e))?;
                calls.push(all_reduce(replicas.clone(), g, self.call));
            }
            for (f, call) in calls.into_iter().enumerate() {
                let unit = self.layout.flats[f].unit;
                let what = format!("all_reduce of unit {unit}'s gradient shard across replicas");
                self.flats[f].grads = self.finish(call, what).await?;
            }
        }
        let left: Vec<_> = self.prefetched.drain().flat_map(|(_, c)| c).collect();
        for call in left {
            self.finish(call, "an unused prefetch all_gather".into())
                .await?;
        }
        let cast = self.master_grads();
        self.skipped = self.unscale_grads(cast).await?;
        if self.skipped {
            // An inf or a NaN on some rank: no rank updates (GradScaler).
            self.ready.iter_mut().for_each(|r| *r = false);
            self.next_launch = self.layout.units.len();
            self.phase = Phase::Forward;
            return Ok(());
        }
        self.steps += 1;
        let updated = self.update();
        // ZeRO-1/2 all-gather the shards even after a failed update, so
        // that the peers' all_gather finds this rank; the failure sticks
        // after it.
        if !self.strategy.shards_params() {
            self.gather_updated().await?;
        }
        if let Err(e) = updated {
            let e = self.comm_error("the optimizer step on this rank's shard", e);
            return Err(self.fail(e));
        }
        self.ready.iter_mut().for_each(|r| *r = false);
        self.next_launch = self.layout.units.len();
        self.phase = Phase::Forward;
        Ok(())
    }

    /// ZeRO-1/2: every rank's updated shard, to every rank.
    /// Each flat is gathered in place when nothing else holds it (no
    /// [`Gathered`] of the forward is still alive), else into a new buffer.
    /// Every call is waited for; the first failure is returned (a flat
    /// whose in-place gather failed is left empty: the failure is sticky).
    async fn gather_updated(&mut self) -> Result<(), DdpError> {
        if self.layout.shards == 1 {
            // The one shard is the whole, updated in place.
            return Ok(());
        }
        let k = self.group.index;
        let calls: Vec<InFlight> = (0..self.flats.len())
            .map(|f| self.launch_gather_updated(f, k))
            .collect();
        let mut first = None;
        for (f, call) in calls.into_iter().enumerate() {
            let unit = self.layout.flats[f].unit;
            let what = format!("all_gather of unit {unit}'s updated parameters");
            match self.finish(call, what).await {
                Ok(v) => self.flats[f].params = Arc::new(v),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Flat `f`'s all-gather of the updated shards (this rank's is shard
    /// `k`): in place when nothing else holds its parameters.
    fn launch_gather_updated(&mut self, f: usize, k: usize) -> InFlight {
        let (flat, pg) = (&self.layout.flats[f], self.group.pg.clone());
        let (range, padded) = (flat.shard_range(k), flat.padded(self.layout.shards));
        let fs = &mut self.flats[f];
        if let Some(params) = Arc::get_mut(&mut fs.params) {
            // The copy is made first: a failure leaves the parameters be.
            let made = params
                .slice(range.clone())
                .and_then(|mine| Ok((mine, params.take()?)));
            return match made {
                Ok((mine, whole)) => all_gather_in_place(pg, whole, mine, self.call),
                Err(e) => InFlight::Done(Err(e)),
            };
        }
        all_gather(pg, fs.params.clone(), (range, padded), self.call, None)
    }

    /// Copies the whole parameters into `model` (gathering each unit under
    /// FSDP and HSDP: every rank calls it), for evaluation or export: a
    /// host model's bytes, or a device model's tensors (stream-ordered on
    /// the compute stream).
    pub async fn copy_params_to(
        &mut self,
        model: &mut (impl ParamSet + ?Sized),
    ) -> Result<(), DdpError> {
        // Every unit is gathered even after a failed copy, so that the
        // peers' gathers find this rank; the first error comes at the end.
        let mut first = None;
        for u in 0..self.layout.units.len() {
            self.enter("copy_params_to")?;
            let g = self.gather_master(u).await;
            self.leave();
            let g = g?;
            if first.is_none() {
                first = self.copy_unit(&g, model).err();
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// [`Sharded::copy_params_to`] of one gathered unit.
    fn copy_unit(
        &self,
        g: &Gathered,
        model: &mut (impl ParamSet + ?Sized),
    ) -> Result<(), DdpError> {
        for &p in &self.layout.units[g.unit] {
            let (vals, range) = g.find(p)?;
            let spec = &self.specs[p];
            let copied = match (model.placement(), vals.dev()) {
                (Some(_), Some(d)) => match model.param_device(p) {
                    Some(dst) => crate::device::copy_out(
                        d.place(),
                        &dst,
                        d.addr(range.start),
                        spec.bytes(),
                        &spec.name,
                    ),
                    None => Err("the device model has no device storage for it".into()),
                },
                (Some(_), None) => Err(
                    "the model is on a device and the shards are in host memory: copy into a host \
                     model"
                        .into(),
                ),
                (None, _) => {
                    let src = g.param_bytes(p)?;
                    let dst = model.param_bytes_mut(p);
                    if dst.len() == src.len() {
                        dst.copy_from_slice(&src);
                        Ok(())
                    } else {
                        Err(format!("it holds {} bytes, not {}", dst.len(), src.len()))
                    }
                }
            };
            copied.map_err(|e| DdpError::Usage {
                rank: self.rank,
                reason: format!(
                    "copy_params_to: the model's parameter {}: {e}",
                    spec.describe()
                ),
            })?;
        }
        Ok(())
    }
}
