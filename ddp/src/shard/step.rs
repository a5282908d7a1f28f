//! A sharded step: gathering units for use (with prefetch), launching each
//! unit's gradient reduction once its gradients are in, and the optimizer
//! step on this rank's shard.

use std::{ops::Range, sync::Arc};

use consort_comm::{Backend, CallOptions, Element, ReduceOp};

use super::{FlatState, InFlight, Layout, Phase, ShardOptimizer, Sharded, Vals, vals};
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

    /// Parameter `p`'s values (`p` in registration order; it must be in
    /// this unit, and `T` its dtype).
    pub fn param<T: Element>(&self, p: usize) -> Result<&[T], DdpError> {
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
        let Some((_, vals)) = self.flats.iter().find(|(g, _)| *g == f) else {
            return Err(usage(format!(
                "parameter {p} is in wrapping unit {}, not in unit {}: gather that unit",
                self.layout.flats[f].unit, self.unit
            )));
        };
        if vals.dtype() != T::DTYPE {
            return Err(usage(format!(
                "parameter {p} is {}, not {}: read it as its own dtype",
                vals.dtype(),
                T::DTYPE
            )));
        }
        vals::with_vals!(&**vals, v => bytemuck::try_cast_slice(&v[range]).map_err(|e| usage(format!(
            "parameter {p} cannot be viewed as {}: {e}", T::DTYPE
        ))))
    }

    /// Bytes it holds (padding included).
    pub fn bytes(&self) -> usize {
        self.flats.iter().map(|(_, v)| v.bytes()).sum()
    }
}

/// All-gathers `input` (one shard) into a new padded buffer.
fn all_gather(pg: Arc<dyn Backend>, input: Vals, padded: usize, call: CallOptions) -> InFlight {
    InFlight::launch(async move {
        let mut out = input.zeros_like(padded);
        pg.all_gather(out.buf_mut(), input.buf(0..input.len()), &call)
            .await?;
        Ok(out)
    })
}

/// Averages `buf` whole over `pg`.
fn all_reduce(pg: Arc<dyn Backend>, mut buf: Vals, call: CallOptions) -> InFlight {
    InFlight::launch(async move {
        pg.all_reduce(buf.buf_mut(), ReduceOp::Avg, &call).await?;
        Ok(buf)
    })
}

/// Averages `input` over `pg` and keeps this rank's `shard_len` part.
fn reduce_scatter(
    pg: Arc<dyn Backend>,
    input: Vals,
    shard_len: usize,
    call: CallOptions,
) -> InFlight {
    InFlight::launch(async move {
        let mut out = input.zeros_like(shard_len);
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
        let units = self.layout.units.len();
        if unit >= units {
            return Err(DdpError::Usage {
                rank: self.rank,
                reason: format!("wrapping unit {unit} does not exist: there are {units}"),
            });
        }
        let ids = self.layout.unit_flats[unit].clone();
        let mut flats = Vec::with_capacity(ids.len());
        if !self.strategy.shards_params() {
            flats.extend(ids.iter().map(|&f| (f, self.flats[f].params.clone())));
        } else {
            let calls = match self.prefetched.remove(&unit) {
                Some(calls) => calls,
                None => self.launch_gather(unit),
            };
            let next = match self.phase {
                Phase::Forward => unit.checked_add(1),
                Phase::Backward => unit.checked_sub(1),
            };
            if let Some(n) = next.filter(|&n| self.prefetch && n < units) {
                if !self.prefetched.contains_key(&n) {
                    let calls = self.launch_gather(n);
                    self.prefetched.insert(n, calls);
                }
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

    /// Makes the all-gathers of one unit's flats.
    fn launch_gather(&self, unit: usize) -> Vec<InFlight> {
        self.layout.unit_flats[unit]
            .iter()
            .map(|&f| {
                let flat = &self.layout.flats[f];
                let shard = (*self.flats[f].params).clone();
                let padded = flat.padded(self.layout.shards);
                all_gather(self.group.pg.clone(), shard, padded, self.call)
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
    /// gradients are averaged in the background.
    pub fn mark_ready<T: Element>(&mut self, p: usize, grad: &[T]) -> Result<(), DdpError> {
        self.check()?;
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
        if T::DTYPE != spec.dtype || grad.len() != spec.numel() {
            return Err(usage(format!(
                "mark_ready({p}): got {} {} values for {}",
                grad.len(),
                T::DTYPE,
                spec.describe()
            )));
        }
        if self.ready[p] {
            return Err(usage(format!(
                "parameter {} was marked ready twice in one step; call step() between",
                spec.name
            )));
        }
        self.phase = Phase::Backward;
        let (f, range) = self.layout.range_of(p);
        let padded = self.layout.flats[f].padded(self.layout.shards);
        let fs = &mut self.flats[f];
        let staging = fs
            .staging
            .get_or_insert_with(|| fs.params.zeros_like(padded));
        staging.copy_from_bytes(range.start, bytemuck::cast_slice(grad));
        self.ready[p] = true;
        self.launch_ready();
        Ok(())
    }

    /// Launches, from the last unit down, every unit whose gradients are
    /// all in.
    fn launch_ready(&mut self) {
        while self.next_launch > 0 {
            let u = self.next_launch - 1;
            if !self.layout.units[u].iter().all(|&p| self.ready[p]) {
                return;
            }
            for f in self.layout.unit_flats[u].clone() {
                let staging = self.flats[f]
                    .staging
                    .take()
                    .expect("every parameter was marked");
                let pg = self.group.pg.clone();
                let call = if self.strategy.shards_grads() {
                    reduce_scatter(pg, staging, self.layout.flats[f].shard_len, self.call)
                } else {
                    all_reduce(pg, staging, self.call)
                };
                self.pending.push((f, call));
            }
            self.next_launch = u;
        }
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
            let calls: Vec<InFlight> = self
                .flats
                .iter_mut()
                .map(|fs| {
                    let g = std::mem::replace(&mut fs.grads, fs.params.zeros_like(0));
                    all_reduce(replicas.clone(), g, self.call)
                })
                .collect();
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
        self.steps += 1;
        self.update();
        if !self.strategy.shards_params() {
            self.gather_updated().await?;
        }
        self.ready.iter_mut().for_each(|r| *r = false);
        self.next_launch = self.layout.units.len();
        self.phase = Phase::Forward;
        Ok(())
    }

    /// The optimizer, on this rank's valid part of every flat.
    fn update(&mut self) {
        let k = self.group.index;
        for (f, fs) in self.flats.iter_mut().enumerate() {
            let flat = &self.layout.flats[f];
            let n = flat.valid_range(k).len();
            let at = flat.shard_range(k).start;
            let p = if self.strategy.shards_params() { 0 } else { at };
            let g = if self.strategy.shards_grads() { 0 } else { at };
            update_flat(&*self.optimizer, self.steps, fs, p..p + n, g..g + n);
        }
    }

    /// ZeRO-1/2: every rank's updated shard, to every rank.
    async fn gather_updated(&mut self) -> Result<(), DdpError> {
        let k = self.group.index;
        let calls: Vec<InFlight> = self
            .layout
            .flats
            .iter()
            .zip(&self.flats)
            .map(|(flat, fs)| {
                let mine = fs.params.slice(flat.shard_range(k));
                let padded = flat.padded(self.layout.shards);
                all_gather(self.group.pg.clone(), mine, padded, self.call)
            })
            .collect();
        for (f, call) in calls.into_iter().enumerate() {
            let unit = self.layout.flats[f].unit;
            let what = format!("all_gather of unit {unit}'s updated parameters");
            self.flats[f].params = Arc::new(self.finish(call, what).await?);
        }
        Ok(())
    }

    /// Copies the whole parameters into `model` (gathering each unit under
    /// FSDP and HSDP: every rank calls it), for evaluation or export.
    pub async fn copy_params_to(
        &mut self,
        model: &mut (impl ParamSet + ?Sized),
    ) -> Result<(), DdpError> {
        for u in 0..self.layout.units.len() {
            let g = self.gather(u).await?;
            for &p in &self.layout.units[u] {
                let (f, range) = self.layout.range_of(p);
                let (_, vals) = g
                    .flats
                    .iter()
                    .find(|(id, _)| *id == f)
                    .expect("unit's flat");
                let dst = model.param_bytes_mut(p);
                let src = vals.range_bytes(range);
                if dst.len() != src.len() {
                    return Err(DdpError::Usage {
                        rank: self.rank,
                        reason: format!(
                            "copy_params_to: the model's parameter {} holds {} bytes, not {}",
                            self.specs[p].describe(),
                            dst.len(),
                            src.len()
                        ),
                    });
                }
                dst.copy_from_slice(src);
            }
        }
        Ok(())
    }
}

/// One flat's optimizer step on `params[p]` with `grads[g]` and the first
/// `p.len()` elements of each state slot.
fn update_flat(
    opt: &dyn ShardOptimizer,
    step: u64,
    fs: &mut FlatState,
    p: Range<usize>,
    g: Range<usize>,
) {
    let n = p.len();
    let params = Arc::make_mut(&mut fs.params);
    match (params, &fs.grads) {
        (Vals::F32(params), Vals::F32(grads)) => {
            let mut state: Vec<&mut [f32]> = fs
                .state
                .iter_mut()
                .map(|s| match s {
                    Vals::F32(v) => &mut v[..n],
                    Vals::F64(_) => unreachable!("a flat's buffers share its dtype"),
                })
                .collect();
            opt.step_f32(step, &mut params[p], &grads[g], &mut state);
        }
        (Vals::F64(params), Vals::F64(grads)) => {
            let mut state: Vec<&mut [f64]> = fs
                .state
                .iter_mut()
                .map(|s| match s {
                    Vals::F64(v) => &mut v[..n],
                    Vals::F32(_) => unreachable!("a flat's buffers share its dtype"),
                })
                .collect();
            opt.step_f64(step, &mut params[p], &grads[g], &mut state);
        }
        _ => unreachable!("a flat's buffers share its dtype"),
    }
}
