//! Optimizers that update one shard: [`Sgd`] (with momentum, dampening,
//! Nesterov and weight decay) and [`AdamW`], with torch's update rules,
//! and the [`ShardOptimizer`] trait for others.
//!
//! A sharded strategy hands each rank's optimizer only its own slice of
//! every flat buffer, so an optimizer here must be elementwise: each
//! element's update may read that element's parameter, gradient and state
//! slots, and the step count, but nothing else. SGD, momentum, Adam, AdamW,
//! RMSprop and Adagrad are; LAMB and LARS (per-tensor norms) are not.

use std::fmt;

use consort_comm::CommError;

use super::kernels::{DeviceStep, ShardKernels, staged};

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

/// The float types the optimizers compute in.
trait Real: Copy + std::ops::Mul<Output = Self> + std::ops::Add<Output = Self> {
    fn of(v: f64) -> Self;
    fn sub(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
    fn sub(self, o: Self) -> Self {
        self - o
    }
    fn div(self, o: Self) -> Self {
        self / o
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    fn of(v: f64) -> Self {
        v
    }
    fn sub(self, o: Self) -> Self {
        self - o
    }
    fn div(self, o: Self) -> Self {
        self / o
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// `torch.optim.SGD`: `p -= lr * d`, where `d` is the gradient (plus
/// `weight_decay * p`), or with momentum the buffer
/// `b = momentum * b + (1 - dampening) * d` (`b = d` on the first step),
/// or with Nesterov `d + momentum * b`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: none, and no state is kept).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Sgd {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        Sgd {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// With momentum.
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// With weight decay (L2, added to the gradient).
    pub fn weight_decay(mut self, wd: f64) -> Self {
        self.weight_decay = wd;
        self
    }

    fn update<T: Real>(&self, step: u64, p: &mut [T], g: &[T], state: &mut [&mut [T]]) {
        let (lr, mu, wd) = (
            T::of(self.lr),
            T::of(self.momentum),
            T::of(self.weight_decay),
        );
        let keep = T::of(1.0 - self.dampening);
        let buf = state.first_mut();
        match buf {
            Some(buf) => {
                for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
                    let d = if self.weight_decay != 0.0 {
                        g + wd * *p
                    } else {
                        g
                    };
                    *b = if step <= 1 { d } else { mu * *b + keep * d };
                    let d = if self.nesterov { d + mu * *b } else { *b };
                    *p = p.sub(lr * d);
                }
            }
            None => {
                for (p, &g) in p.iter_mut().zip(g) {
                    let d = if self.weight_decay != 0.0 {
                        g + wd * *p
                    } else {
                        g
                    };
                    *p = p.sub(lr * d);
                }
            }
        }
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

/// `torch.optim.AdamW`: decoupled weight decay `p *= 1 - lr * wd`, then
/// Adam with bias correction: `m`, `v` are the first and second moment
/// (two state slots).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Learning rate (torch: 1e-3).
    pub lr: f64,
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Added to the denominator (1e-8).
    pub eps: f64,
    /// Decoupled weight decay (0.01).
    pub weight_decay: f64,
}

impl AdamW {
    /// torch's defaults, with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    fn update<T: Real>(&self, step: u64, p: &mut [T], g: &[T], state: &mut [&mut [T]]) {
        let t = step.max(1) as i32;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        let decay = T::of(1.0 - self.lr * self.weight_decay);
        let (b1, b2) = (T::of(self.beta1), T::of(self.beta2));
        let (c1, c2) = (T::of(1.0 - self.beta1), T::of(1.0 - self.beta2));
        let step_size = T::of(self.lr / bc1);
        let bc2_sqrt = T::of(bc2.sqrt());
        let eps = T::of(self.eps);
        let [m, v] = state else {
            unreachable!("AdamW keeps two state slots")
        };
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            *p = *p * decay;
            *m = b1 * *m + c1 * g;
            *v = b2 * *v + c2 * g * g;
            let denom = v.sqrt().div(bc2_sqrt) + eps;
            *p = p.sub(step_size * m.div(denom));
        }
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
