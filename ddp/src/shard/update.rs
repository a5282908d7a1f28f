//! The optimizer step on this rank's shard: mixed precision's cast of the
//! averaged gradients to the f32 masters and its loss scaling (one agreed
//! flag, so every rank skips or fails alike), then the update itself, on
//! the host or with the device's kernels.

use std::{ops::Range, sync::Arc};

use consort_comm::{DType, ReduceOp};

use super::{FlatState, ShardOptimizer, Sharded, Vals};
use crate::error::DdpError;

impl Sharded {
    /// Mixed precision: the reduced gradients (in the reduce dtype) cast to
    /// the f32 master dtype for the optimizer.
    pub(super) fn master_grads(&mut self) -> Result<(), DdpError> {
        let Some(m) = self.mixed else {
            return Ok(());
        };
        if m.reduce() == DType::F32 {
            return Ok(());
        }
        for f in 0..self.flats.len() {
            match self.flats[f]
                .grads
                .cast(DType::F32, self.kernels.as_deref())
            {
                Ok(v) => self.flats[f].grads = v,
                Err(e) => return Err(self.comm_error("casting the averaged gradients to f32", e)),
            }
        }
        Ok(())
    }

    /// Loss scaling: unscales this rank's part of the gradients and says
    /// whether any rank found an inf or a NaN, after updating the scale.
    /// One all_reduce of a flag (0 clean, 1 inf or NaN, 2 a local failure:
    /// `prior`, the cast before, or the unscale), so every rank skips alike
    /// and every rank fails alike: a rank that failed still makes the call
    /// its peers make. Without loss scaling, `prior` and `false`.
    pub(super) async fn unscale_grads(
        &mut self,
        prior: Result<(), DdpError>,
    ) -> Result<bool, DdpError> {
        let Some(scale) = self.scaler.as_ref().map(super::mixed::Scaler::scale) else {
            return prior.map(|()| false).map_err(|e| self.fail(e));
        };
        let mut local = prior.err();
        let mut found = false;
        if local.is_none() {
            match self.unscale_local(scale) {
                Ok(x) => found = x,
                Err(e) => local = Some(self.comm_error("unscaling the gradients", e)),
            }
        }
        let code = if local.is_some() {
            2.0
        } else {
            f32::from(u8::from(found))
        };
        let mut flag = [code];
        let agreed = self
            .backend
            .all_reduce(
                consort_comm::BufferMut::from(&mut flag[..]),
                ReduceOp::Max,
                &self.call,
            )
            .await;
        if let Err(e) = agreed {
            let e = self.comm_error("all_reduce of the loss scaler's inf/NaN flag", e);
            return Err(self.fail(local.unwrap_or(e)));
        }
        if flag[0] >= 2.0 {
            let e = local.unwrap_or_else(|| DdpError::Usage {
                rank: self.rank,
                reason: "another rank failed this step (its error names it); no rank updates. \
                         Restart from the last checkpoint"
                    .into(),
            });
            return Err(self.fail(e));
        }
        let found = flag[0] > 0.0;
        if let Some(s) = &mut self.scaler {
            s.update(found);
        }
        Ok(found)
    }

    /// Multiplies this rank's part of every gradient by 1/`scale` (in f32,
    /// as torch's GradScaler takes the reciprocal); whether any was not
    /// finite.
    fn unscale_local(&mut self, scale: f64) -> Result<bool, consort_comm::CommError> {
        let inv = f64::from((1.0 / scale) as f32);
        let k = self.group.index;
        let mut found = false;
        for f in 0..self.flats.len() {
            let flat = &self.layout.flats[f];
            let n = flat.valid_range(k).len();
            let at = if self.strategy.shards_grads() {
                0
            } else {
                flat.shard_range(k).start
            };
            let kernels = self.kernels.clone();
            found |= self.flats[f]
                .grads
                .unscale(at..at + n, inv, kernels.as_deref())?;
        }
        Ok(found)
    }

    /// The optimizer, on this rank's valid part of every flat: on the host,
    /// or with the kernels on the device.
    pub(super) fn update(&mut self) -> Result<(), consort_comm::CommError> {
        let k = self.group.index;
        for (f, fs) in self.flats.iter_mut().enumerate() {
            let flat = &self.layout.flats[f];
            let n = flat.valid_range(k).len();
            let at = flat.shard_range(k).start;
            let p = if self.strategy.shards_params() { 0 } else { at };
            let g = if self.strategy.shards_grads() { 0 } else { at };
            match &self.kernels {
                Some(kernels) => {
                    let step = (&*self.optimizer, &**kernels, self.steps);
                    update_flat_device(step, fs, p..p + n, g..g + n)?;
                }
                None => update_flat(&*self.optimizer, self.steps, fs, p..p + n, g..g + n)?,
            }
        }
        Ok(())
    }
}

/// One flat's optimizer step on `params[p]` with `grads[g]` and the first
/// `p.len()` elements of each state slot, on the host.
fn update_flat(
    opt: &dyn ShardOptimizer,
    step: u64,
    fs: &mut FlatState,
    p: Range<usize>,
    g: Range<usize>,
) -> Result<(), consort_comm::CommError> {
    let n = p.len();
    let mixed = || consort_comm::CommError::invalid("a flat's buffers differ in dtype or place");
    let params = unshared(&mut fs.params)?;
    match (params, &fs.grads) {
        (Vals::F32(params), Vals::F32(grads)) => {
            let mut state = Vec::with_capacity(fs.state.len());
            for s in &mut fs.state {
                match s {
                    Vals::F32(v) => state.push(&mut v[..n]),
                    _ => return Err(mixed()),
                }
            }
            opt.step_f32(step, &mut params[p], &grads[g], &mut state);
        }
        (Vals::F64(params), Vals::F64(grads)) => {
            let mut state = Vec::with_capacity(fs.state.len());
            for s in &mut fs.state {
                match s {
                    Vals::F64(v) => state.push(&mut v[..n]),
                    _ => return Err(mixed()),
                }
            }
            opt.step_f64(step, &mut params[p], &grads[g], &mut state);
        }
        _ => return Err(mixed()),
    }
    Ok(())
}

/// The parameters, to update in place: copied first when a `Gathered`
/// still shares them (it keeps the values it was handed).
fn unshared(params: &mut Arc<Vals>) -> Result<&mut Vals, consort_comm::CommError> {
    if Arc::get_mut(params).is_none() {
        *params = Arc::new(params.try_clone()?);
    }
    Arc::get_mut(params).ok_or_else(|| consort_comm::CommError::invalid("shared parameters"))
}

/// [`update_flat`] on the device: the optimizer's device step (its
/// kernels) on `params[p]`, `grads[g]` and the state slots, enqueued on the
/// compute stream. A `Gathered` still holding the parameters keeps its
/// values: the parameters are copied first, as on the host.
fn update_flat_device(
    (opt, kernels, step): (&dyn ShardOptimizer, &dyn super::ShardKernels, u64),
    fs: &mut FlatState,
    p: Range<usize>,
    g: Range<usize>,
) -> Result<(), consort_comm::CommError> {
    let inner =
        || consort_comm::CommError::invalid("a flat buffer of a device model is on the host");
    let params = unshared(&mut fs.params)?;
    let dtype = params.dtype();
    let params = params.dev().ok_or_else(inner)?;
    let grads = fs.grads.dev().ok_or_else(inner)?;
    let state = fs
        .state
        .iter()
        .map(|s| s.dev().map(|d| d.addr(0)).ok_or_else(inner))
        .collect::<Result<Vec<u64>, _>>()?;
    // SAFETY: the ranges are this rank's valid part of the flat, inside
    // every buffer (the layout sized them), so the addresses hold
    // `p.len()` live elements each, on the compute stream; the flat's
    // buffers are this wrapper's alone (the parameters were unshared).
    let s = unsafe {
        super::kernels::DeviceStep::new(
            params.place(),
            dtype,
            p.len(),
            step,
            (params.addr(p.start), grads.addr(g.start)),
            &state,
        )
    };
    opt.step_device(kernels, &s)
}
