//! Mixed precision for the sharded strategies, as torch's FSDP2
//! `MixedPrecisionPolicy` (with `ShardedGradScaler` for f16).
//!
//! - The shards stay in the model's dtype (f32): they are the master
//!   weights, and the optimizer and its state work on them.
//! - What [`crate::Sharded::gather`] hands out is in `param_dtype` (bf16 or
//!   f16): FSDP and HSDP cast the shard before the all-gather (half the
//!   bytes on the wire), ZeRO-1/2 cast their whole parameters.
//! - Gradients come in `param_dtype` (computed with those parameters), are
//!   reduced in `reduce_dtype` (torch's default: `param_dtype`), and are
//!   cast to f32 for the optimizer.
//! - [`LossScaling`] (on by default for f16, whose range is narrow): the
//!   loss is multiplied by [`crate::Sharded::loss_scale`] before backward;
//!   the step unscales the gradients, and if any rank found an inf or a
//!   NaN every rank skips the update and halves the scale; after
//!   `growth_interval` good steps in a row the scale doubles (torch's
//!   `GradScaler` rules and defaults).
//!
//! Checkpoints, state dicts and [`crate::Sharded::copy_params_to`] read
//! the f32 master weights.

use consort_comm::DType;

/// torch's `MixedPrecisionPolicy`: see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixedPrecision {
    /// The dtype of gathered parameters and of gradients: `BF16` or `F16`.
    pub param_dtype: DType,
    /// The dtype gradients are reduced in (`F32`, `BF16` or `F16`; `None`:
    /// `param_dtype`, as torch).
    pub reduce_dtype: Option<DType>,
    /// Dynamic loss scaling (`None`: off; [`MixedPrecision::f16`] turns it
    /// on).
    pub loss_scaling: Option<LossScaling>,
}

impl MixedPrecision {
    /// bf16 compute and reductions, no loss scaling (bf16 has f32's range).
    pub fn bf16() -> Self {
        MixedPrecision {
            param_dtype: DType::BF16,
            reduce_dtype: None,
            loss_scaling: None,
        }
    }

    /// f16 compute and reductions, with dynamic loss scaling.
    pub fn f16() -> Self {
        MixedPrecision {
            param_dtype: DType::F16,
            reduce_dtype: None,
            loss_scaling: Some(LossScaling::default()),
        }
    }

    /// With gradients reduced in `dtype` (`F32` for full-precision sums).
    pub fn reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = Some(dtype);
        self
    }

    /// The dtype gradients are reduced in.
    pub fn reduce(&self) -> DType {
        self.reduce_dtype.unwrap_or(self.param_dtype)
    }

    /// Why the policy is invalid, if it is.
    pub(crate) fn check(&self) -> Result<(), String> {
        if !matches!(self.param_dtype, DType::BF16 | DType::F16) {
            return Err(format!(
                "mixed precision computes in bf16 or f16, not {} (the shards keep the model's f32)",
                self.param_dtype
            ));
        }
        if !matches!(self.reduce(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(format!(
                "mixed precision reduces gradients in f32, bf16 or f16, not {}",
                self.reduce()
            ));
        }
        match &self.loss_scaling {
            Some(l) => l.check(),
            None => Ok(()),
        }
    }
}

/// torch's `GradScaler` settings (its defaults by [`Default`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaling {
    /// The first scale (65536).
    pub init_scale: f64,
    /// The scale's factor after `growth_interval` good steps (2).
    pub growth_factor: f64,
    /// The scale's factor after a step with an inf or NaN (0.5).
    pub backoff_factor: f64,
    /// Good steps in a row before the scale grows (2000).
    pub growth_interval: u64,
}

impl Default for LossScaling {
    fn default() -> Self {
        LossScaling {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScaling {
    fn check(&self) -> Result<(), String> {
        let ok = self.init_scale.is_finite()
            && self.init_scale > 0.0
            && self.growth_factor.is_finite()
            && self.growth_factor >= 1.0
            && self.backoff_factor > 0.0
            && self.backoff_factor < 1.0
            && self.growth_interval >= 1;
        if ok {
            Ok(())
        } else {
            Err(format!(
                "loss scaling needs a finite positive init_scale, growth_factor >= 1, \
                 backoff_factor in (0, 1) and growth_interval >= 1: {self:?}"
            ))
        }
    }
}

/// The scale between steps.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Scaler {
    opts: LossScaling,
    scale: f64,
    /// Good steps since the last change.
    good: u64,
}

impl Scaler {
    pub(crate) fn new(opts: LossScaling) -> Self {
        Scaler {
            opts,
            scale: opts.init_scale,
            good: 0,
        }
    }

    /// The factor the loss is multiplied by.
    pub(crate) fn scale(&self) -> f64 {
        self.scale
    }

    /// The scale and the good steps since its last change (saved in
    /// sharded checkpoints).
    pub(crate) fn state(&self) -> (f64, u64) {
        (self.scale, self.good)
    }

    /// Resumes from [`Scaler::state`] (a non-finite or non-positive scale
    /// is ignored).
    pub(crate) fn restore(&mut self, (scale, good): (f64, u64)) {
        if scale.is_finite() && scale > 0.0 {
            self.scale = scale;
            self.good = good.min(self.opts.growth_interval.saturating_sub(1));
        }
    }

    /// After a step: back off when any rank found an inf or a NaN, grow
    /// after `growth_interval` good steps.
    pub(crate) fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.opts.backoff_factor;
            self.good = 0;
        } else {
            self.good += 1;
            if self.good == self.opts.growth_interval {
                self.scale *= self.opts.growth_factor;
                self.good = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_follows_torchs_grad_scaler() {
        let mut s = Scaler::new(LossScaling {
            growth_interval: 3,
            ..LossScaling::default()
        });
        assert_eq!(s.scale(), 65536.0);
        s.update(true);
        assert_eq!(s.scale(), 32768.0);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 32768.0);
        s.update(false);
        assert_eq!(s.scale(), 65536.0, "grows after 3 good steps in a row");
        s.update(false);
        s.update(true);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 32768.0, "an overflow restarts the count");
    }

    #[test]
    fn bad_policies_are_named() {
        assert!(MixedPrecision::bf16().check().is_ok());
        assert!(
            MixedPrecision::f16()
                .reduce_dtype(DType::F32)
                .check()
                .is_ok()
        );
        let e = MixedPrecision {
            param_dtype: DType::F64,
            ..MixedPrecision::bf16()
        }
        .check()
        .unwrap_err();
        assert!(e.contains("bf16 or f16"), "{e}");
        let e = MixedPrecision::bf16()
            .reduce_dtype(DType::I32)
            .check()
            .unwrap_err();
        assert!(e.contains("reduces gradients"), "{e}");
        let mut f = MixedPrecision::f16();
        f.loss_scaling = Some(LossScaling {
            backoff_factor: 1.5,
            ..LossScaling::default()
        });
        assert!(f.check().unwrap_err().contains("backoff_factor"));
    }
}
