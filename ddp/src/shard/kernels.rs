//! The device side of an optimizer step: [`DeviceStep`] (one flat shard's
//! update, its addresses and dtype) and [`ShardKernels`], the elementwise
//! kernels a device brings.
//!
//! A sharded strategy on a device model keeps each flat's parameter shard,
//! gradient shard and optimizer slots in device memory, and steps them
//! with [`crate::ShardOptimizer::step_device`]: [`crate::Sgd`] and
//! [`crate::AdamW`] call [`ShardKernels::sgd`] and [`ShardKernels::adamw`],
//! which a CUDA implementation runs as kernels on the compute stream
//! (`consort::cuda::CudaKernels`, NVRTC). Any other elementwise optimizer
//! steps through [`crate::shard::staged()`]: the shard goes to the host, the
//! optimizer's host step runs on it, and the result goes back.
//! [`crate::StagedKernels`] (the emulated device's) runs every method that
//! way.
//!
//! Mixed precision adds two more: [`ShardKernels::cast`] between f32,
//! bf16 and f16, and [`ShardKernels::unscale`] (loss scaling's unscale and
//! overflow check).

use std::fmt;

use consort_comm::{CommError, DType, Placement};

use super::rules::{AdamW, Sgd};

/// One flat shard's update on the device: `len` elements of `dtype` at
/// each address, stream-ordered on the placement's compute stream. Its
/// constructor is unsafe, so its addresses are always live allocations of
/// at least `len` elements.
#[derive(Debug)]
pub struct DeviceStep<'a> {
    place: &'a Placement,
    dtype: DType,
    len: usize,
    step: u64,
    params: u64,
    grads: u64,
    state: &'a [u64],
}

impl<'a> DeviceStep<'a> {
    /// One update of `len` elements: the parameters and the gradient at
    /// `(params, grads)`, the optimizer's slots at `state`. The sharded
    /// strategies make their own; DDP on a device model makes one per
    /// parameter to step it with the same kernels.
    ///
    /// # Safety
    /// Every address holds `len` live elements of `dtype` on `place`'s
    /// device, ready on its compute stream, until the work the kernels
    /// enqueue there has run; the parameter and slot ranges are not used
    /// by anything else meanwhile.
    pub unsafe fn new(
        place: &'a Placement,
        dtype: DType,
        len: usize,
        step: u64,
        (params, grads): (u64, u64),
        state: &'a [u64],
    ) -> Self {
        DeviceStep {
            place,
            dtype,
            len,
            step,
            params,
            grads,
            state,
        }
    }

    /// The device and the compute stream to run on.
    pub fn place(&self) -> &Placement {
        self.place
    }

    /// The element type (f32 or f64).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements to update.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is nothing to update.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The optimizer step, counted from 1.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The parameter shard's address (updated in place).
    pub fn params(&self) -> u64 {
        self.params
    }

    /// The averaged gradient shard's address (read only).
    pub fn grads(&self) -> u64 {
        self.grads
    }

    /// The optimizer's state slots' addresses, [`crate::ShardOptimizer::slots`]
    /// of them (updated in place).
    pub fn state(&self) -> &[u64] {
        self.state
    }
}

/// The elementwise optimizer kernels of one kind of device. Every method
/// enqueues its work on the step's compute stream and may return before
/// the device has done it. [`crate::StagedKernels`] runs each through the
/// host ([`crate::shard::staged()`]), for any device.
pub trait ShardKernels: Send + Sync + fmt::Debug {
    /// Its name, for errors and logs.
    fn name(&self) -> &str;

    /// Why these kernels cannot run on `place` (another device), if they
    /// cannot; checked by [`crate::Sharded::new`]. By default, anywhere.
    fn check_place(&self, place: &Placement) -> Result<(), CommError> {
        let _ = place;
        Ok(())
    }

    /// `torch.optim.SGD`'s update (see [`Sgd`]).
    fn sgd(&self, s: &DeviceStep<'_>, opt: &Sgd) -> Result<(), CommError>;

    /// `torch.optim.AdamW`'s update (see [`AdamW`]).
    fn adamw(&self, s: &DeviceStep<'_>, opt: &AdamW) -> Result<(), CommError>;

    /// Converts `len` elements at `src` (of dtype `from`) to dtype `to` at
    /// `dst`, rounding to nearest even (mixed precision's casts: f32, f64,
    /// bf16 and f16).
    ///
    /// # Safety
    /// `src` and `dst` hold `len` live elements of their dtypes on
    /// `place`'s device, ready on its compute stream; `dst` is used by
    /// nothing else until the cast has run.
    unsafe fn cast(
        &self,
        place: &Placement,
        src: (u64, DType),
        dst: (u64, DType),
        len: usize,
    ) -> Result<(), CommError>;

    /// Multiplies `len` f32 at `ptr` by `factor` and says whether any was
    /// not finite (torch's `_amp_foreach_non_finite_check_and_unscale_`);
    /// waits for the device to know.
    ///
    /// # Safety
    /// `ptr` holds `len` live f32 on `place`'s device, used by nothing else
    /// meanwhile.
    unsafe fn unscale(
        &self,
        place: &Placement,
        ptr: u64,
        len: usize,
        factor: f64,
    ) -> Result<bool, CommError>;
}
