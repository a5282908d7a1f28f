//! Optimizers that update one shard: the [`ShardOptimizer`] trait, its
//! implementations for [`Sgd`] (with momentum, dampening, Nesterov and
//! weight decay) and [`AdamW`] (their arithmetic is in `rules`), and
//! [`staged`], the device step of any of them through the host.
//!
//! A sharded strategy hands each rank's optimizer only its own slice of
//! every flat buffer, so an optimizer here must be elementwise: each
//! element's update may read that element's parameter, gradient and state
//! slots, and the step count, but nothing else. SGD, momentum, Adam, AdamW,
//! RMSprop and Adagrad are; LAMB and LARS (per-tensor norms) are not.

use std::fmt;

use consort_comm::CommError;
use consort_comm::DType;

use super::{
    kernels::{DeviceStep, ShardKernels},
    rules::{AdamW, Sgd},
};

/// An elementwise optimizer over flat shards.
///
/// `step` counts updates from 1. `state` holds [`ShardOptimizer::slots`]
/// slices as long as `params`, zeroed before the first step, kept between
/// steps (and in sharded checkpoints) by the strategy.
pub trait ShardOptimizer: Send + Sync + fmt::Debug {
    /// Its name, recorded in sharded checkpoints (`"sgd"`, `"adamw"`).
    fn name(&self) -> &str;

    /// State values kept per parameter element.
    fn slots(&self) -> usize;

    /// Why its settings are invalid, if they are (checked by
    /// [`crate::Sharded::new`] before any call).
    fn check(&self) -> Result<(), String> {
        Ok(())
    }

    /// Updates f32 parameters in place.
    fn step_f32(&self, step: u64, params: &mut [f32], grads: &[f32], state: &mut [&mut [f32]]);

    /// Updates f64 parameters in place.
    fn step_f64(&self, step: u64, params: &mut [f64], grads: &[f64], state: &mut [&mut [f64]]);

    /// Updates a shard in device memory, stream-ordered (see
    /// [`super::kernels`]). The default steps a host copy with
    /// [`ShardOptimizer::step_f32`] or [`ShardOptimizer::step_f64`]
    /// ([`staged`]): correct for any elementwise optimizer, and slow on a
    /// GPU; [`Sgd`] and [`AdamW`] run `kernels`' own.
    fn step_device(&self, kernels: &dyn ShardKernels, s: &DeviceStep<'_>) -> Result<(), CommError> {
        let _ = kernels;
        staged(self, s)
    }
}

impl<O: ShardOptimizer + ?Sized> ShardOptimizer for Box<O> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn slots(&self) -> usize {
        (**self).slots()
    }
    fn check(&self) -> Result<(), String> {
        (**self).check()
    }
    fn step_f32(&self, step: u64, params: &mut [f32], grads: &[f32], state: &mut [&mut [f32]]) {
        (**self).step_f32(step, params, grads, state);
    }
    fn step_f64(&self, step: u64, params: &mut [f64], grads: &[f64], state: &mut [&mut [f64]]) {
        (**self).step_f64(step, params, grads, state);
    }
    fn step_device(&self, kernels: &dyn ShardKernels, s: &DeviceStep<'_>) -> Result<(), CommError> {
        (**self).step_device(kernels, s)
    }
}

impl ShardOptimizer for Sgd {
    fn name(&self) -> &str {
        "sgd"
    }
    fn slots(&self) -> usize {
        usize::from(self.momentum != 0.0)
    }
    fn check(&self) -> Result<(), String> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !ok(self.lr) || !ok(self.momentum) || !ok(self.weight_decay) || !ok(self.dampening) {
            return Err(format!(
                "SGD needs finite, non-negative lr, momentum, dampening and weight_decay: {self:?}"
            ));
        }
        if self.nesterov && (self.momentum == 0.0 || self.dampening != 0.0) {
            return Err(
                "Nesterov momentum requires a momentum and zero dampening (as torch)".into(),
            );
        }
        Ok(())
    }
    fn step_f32(&self, step: u64, params: &mut [f32], grads: &[f32], state: &mut [&mut [f32]]) {
        self.update(step, params, grads, state);
    }
    fn step_f64(&self, step: u64, params: &mut [f64], grads: &[f64], state: &mut [&mut [f64]]) {
        self.update(step, params, grads, state);
    }
    fn step_device(&self, kernels: &dyn ShardKernels, s: &DeviceStep<'_>) -> Result<(), CommError> {
        kernels.sgd(s, self)
    }
}

impl ShardOptimizer for AdamW {
    fn name(&self) -> &str {
        "adamw"
    }
    fn slots(&self) -> usize {
        2
    }
    fn check(&self) -> Result<(), String> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        let beta = |b: f64| (0.0..1.0).contains(&b);
        if !ok(self.lr)
            || !ok(self.eps)
            || !ok(self.weight_decay)
            || !beta(self.beta1)
            || !beta(self.beta2)
        {
            return Err(format!(
                "AdamW needs finite, non-negative lr, eps and weight_decay, and betas in [0, 1): \
                 {self:?}"
            ));
        }
        Ok(())
    }
    fn step_f32(&self, step: u64, params: &mut [f32], grads: &[f32], state: &mut [&mut [f32]]) {
        self.update(step, params, grads, state);
    }
    fn step_f64(&self, step: u64, params: &mut [f64], grads: &[f64], state: &mut [&mut [f64]]) {
        self.update(step, params, grads, state);
    }
    fn step_device(&self, kernels: &dyn ShardKernels, s: &DeviceStep<'_>) -> Result<(), CommError> {
        kernels.adamw(s, self)
    }
}

/// Steps one device shard with `opt`'s host step: reads the shard, its
/// gradient and its slots once the compute stream has produced them,
/// updates them on the host, and enqueues the writes back.
pub fn staged<O: ShardOptimizer + ?Sized>(opt: &O, s: &DeviceStep<'_>) -> Result<(), CommError> {
    if s.is_empty() {
        return Ok(());
    }
    if s.state().len() != opt.slots() {
        return Err(CommError::invalid(format!(
            "{} keeps {} state slots; the step has {}",
            opt.name(),
            opt.slots(),
            s.state().len()
        )));
    }
    match s.dtype() {
        DType::F32 => staged_typed::<f32, O>(opt, s, |o, p, g, st| {
            o.step_f32(s.step(), p, g, st);
        }),
        DType::F64 => staged_typed::<f64, O>(opt, s, |o, p, g, st| {
            o.step_f64(s.step(), p, g, st);
        }),
        d => Err(CommError::invalid(format!(
            "the sharded optimizers step f32 and f64 shards, not {d}"
        ))),
    }
}

/// [`staged`] for one element type `T`.
fn staged_typed<T: consort_comm::Element + Default, O: ShardOptimizer + ?Sized>(
    opt: &O,
    s: &DeviceStep<'_>,
    step: impl FnOnce(&O, &mut [T], &[T], &mut [&mut [T]]),
) -> Result<(), CommError> {
    let (dev, stream) = (&s.place().device, s.place().stream);
    let read = |addr: u64| -> Result<Vec<T>, CommError> {
        let mut v = vec![T::default(); s.len()];
        // SAFETY: `DeviceStep`'s addresses hold `len` live elements of `T`
        // (its dtype, matched by the caller).
        unsafe { dev.copy_to_host(consort_comm::dtype::as_bytes_mut(&mut v), addr, stream) }?;
        Ok(v)
    };
    let mut params = read(s.params())?;
    let grads = read(s.grads())?;
    let mut state = s
        .state()
        .iter()
        .map(|&a| read(a))
        .collect::<Result<Vec<_>, _>>()?;
    let mut slots: Vec<&mut [T]> = state.iter_mut().map(Vec::as_mut_slice).collect();
    step(opt, &mut params, &grads, &mut slots);
    let write = |addr: u64, v: &[T]| {
        // SAFETY: as for `read`.
        unsafe { dev.copy_from_host(addr, consort_comm::dtype::as_bytes(v), stream) }
    };
    write(s.params(), &params)?;
    for (&a, v) in s.state().iter().zip(&state) {
        write(a, v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01) on
    /// p = [1.0, -2.0] with grads [0.5, 0.25] twice, worked by hand.
    #[test]
    fn sgd_momentum_matches_torch_by_hand() {
        let opt = Sgd::new(0.1).momentum(0.9).weight_decay(0.01);
        let mut p = [1.0f64, -2.0];
        let mut b = [0.0f64; 2];
        opt.step_f64(1, &mut p, &[0.5, 0.25], &mut [&mut b]);
        // d = g + 0.01 p = [0.51, 0.23]; b = d; p -= 0.1 b
        assert!(
            (p[0] - 0.949).abs() < 1e-12 && (p[1] + 2.023).abs() < 1e-12,
            "{p:?}"
        );
        opt.step_f64(2, &mut p, &[0.5, 0.25], &mut [&mut b]);
        // d = [0.50949, 0.22977]; b = 0.9 b + d = [0.96849, 0.43677]
        assert!(
            (b[0] - 0.96849).abs() < 1e-12 && (b[1] - 0.43677).abs() < 1e-12,
            "{b:?}"
        );
        assert!((p[0] - (0.949 - 0.096849)).abs() < 1e-12, "{p:?}");
    }

    /// AdamW's first step moves every element by about lr against its
    /// gradient's sign (m̂/√v̂ = ±1), after the decay.
    #[test]
    fn adamw_first_step_is_lr_times_the_sign() {
        let opt = AdamW::new(0.01);
        let mut p = [1.0f32, 1.0, 1.0];
        let (mut m, mut v) = ([0f32; 3], [0f32; 3]);
        opt.step_f32(1, &mut p, &[3.0, -0.5, 0.0], &mut [&mut m, &mut v]);
        let decayed = 1.0 - 0.01 * 0.01;
        assert!((p[0] - (decayed - 0.01)).abs() < 1e-6, "{p:?}");
        assert!((p[1] - (decayed + 0.01)).abs() < 1e-6, "{p:?}");
        assert!((p[2] - decayed).abs() < 1e-7, "{p:?}");
    }
}
