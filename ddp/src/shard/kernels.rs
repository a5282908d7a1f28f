//! Optimizer steps on device shards: [`ShardKernels`], the elementwise
//! kernels a device brings, and [`StagedKernels`], the implementation for
//! the emulated device.
//!
//! A sharded strategy on a device model keeps each flat's parameter shard,
//! gradient shard and optimizer slots in device memory, and steps them
//! with [`crate::ShardOptimizer::step_device`]: [`crate::Sgd`] and
//! [`crate::AdamW`] call [`ShardKernels::sgd`] and [`ShardKernels::adamw`],
//! which a CUDA implementation runs as kernels on the compute stream
//! (`consort::cuda::CudaKernels`, NVRTC). Any other elementwise optimizer
//! steps through [`staged`]: the shard goes to the host, the optimizer's
//! host step runs on it, and the result goes back.
//!
//! Mixed precision adds two more: [`ShardKernels::cast`] between f32,
//! bf16 and f16, and [`ShardKernels::unscale`] (loss scaling's unscale and
//! overflow check).
//!
//! [`StagedKernels`] runs SGD and AdamW that way too, with the very code
//! of their host steps: on the emulated device (whose memory is host
//! memory) that is the device's arithmetic, and it makes the device path
//! of every strategy testable in `cargo test`. On a GPU it is correct but
//! slow (two copies of the shard per step).

use std::fmt;

use consort_comm::{CommError, DType, Placement};

use super::optim::{AdamW, Sgd, ShardOptimizer};

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

    /// The optimizer's state slots' addresses, [`ShardOptimizer::slots`]
    /// of them (updated in place).
    pub fn state(&self) -> &[u64] {
        self.state
    }
}

/// The elementwise optimizer kernels of one kind of device. Every method
/// enqueues its work on the step's compute stream and may return before
/// the device has done it. The defaults run [`staged`].
pub trait ShardKernels: Send + Sync + fmt::Debug {
    /// Its name, for errors and logs.
    fn name(&self) -> &str;

    /// Why these kernels cannot run on `place` (another device), if they
    /// cannot; checked by [`crate::Sharded::new`]. The staged defaults run
    /// anywhere.
    fn check_place(&self, place: &Placement) -> Result<(), CommError> {
        let _ = place;
        Ok(())
    }

    /// `torch.optim.SGD`'s update (see [`Sgd`]).
    fn sgd(&self, s: &DeviceStep<'_>, opt: &Sgd) -> Result<(), CommError> {
        staged(opt, s)
    }

    /// `torch.optim.AdamW`'s update (see [`AdamW`]).
    fn adamw(&self, s: &DeviceStep<'_>, opt: &AdamW) -> Result<(), CommError> {
        staged(opt, s)
    }

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
        (src, from): (u64, DType),
        (dst, to): (u64, DType),
        len: usize,
    ) -> Result<(), CommError> {
        // SAFETY: forwarded to the caller.
        unsafe { staged_cast(place, (src, from), (dst, to), len) }
    }

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
    ) -> Result<bool, CommError> {
        // SAFETY: forwarded to the caller.
        unsafe { staged_unscale(place, ptr, len, factor) }
    }
}

/// [`ShardKernels::cast`] through the host.
///
/// # Safety
/// As [`ShardKernels::cast`].
pub unsafe fn staged_cast(
    place: &Placement,
    (src, from): (u64, DType),
    (dst, to): (u64, DType),
    len: usize,
) -> Result<(), CommError> {
    let mut bytes = vec![0u8; len * from.size_bytes()];
    let (dev, stream) = (&place.device, place.stream);
    // SAFETY: the caller's contract: `src` holds `len` elements of `from`.
    unsafe { dev.copy_to_host(&mut bytes, src, stream) }?;
    let mut host = super::vals::Vals::zeros(from, len)
        .ok_or_else(|| CommError::invalid(format!("casting from {from}")))?;
    host.copy_from_bytes(0, &bytes)?;
    let out = host.cast(to, None)?;
    let out = out.read_bytes(0..len)?;
    // SAFETY: the caller's contract: `dst` holds `len` elements of `to`.
    unsafe { dev.copy_from_host(dst, &out, stream) }
}

/// [`ShardKernels::unscale`] through the host.
///
/// # Safety
/// As [`ShardKernels::unscale`].
pub unsafe fn staged_unscale(
    place: &Placement,
    ptr: u64,
    len: usize,
    factor: f64,
) -> Result<bool, CommError> {
    let mut v = vec![0f32; len];
    let (dev, stream) = (&place.device, place.stream);
    // SAFETY: the caller's contract: `ptr` holds `len` f32.
    unsafe { dev.copy_to_host(consort_comm::dtype::as_bytes_mut(&mut v), ptr, stream) }?;
    let mut host = super::vals::Vals::F32(v);
    let found = host.unscale(0..len, factor, None)?;
    let out = host.read_bytes(0..len)?;
    // SAFETY: as above.
    unsafe { dev.copy_from_host(ptr, &out, stream) }?;
    Ok(found)
}

/// The kernels of the emulated device: every update through [`staged`].
#[derive(Debug, Clone, Copy, Default)]
pub struct StagedKernels;

impl ShardKernels for StagedKernels {
    fn name(&self) -> &str {
        "staged (host arithmetic)"
    }
}

/// Steps one device shard with `opt`'s host step: reads the shard, its
/// gradient and its slots once the compute stream has produced them,
/// updates them on the host, and enqueues the writes back.
pub fn staged<O: ShardOptimizer + ?Sized>(opt: &O, s: &DeviceStep<'_>) -> Result<(), CommError> {
    if s.len == 0 {
        return Ok(());
    }
    if s.state.len() != opt.slots() {
        return Err(CommError::invalid(format!(
            "{} keeps {} state slots; the step has {}",
            opt.name(),
            opt.slots(),
            s.state.len()
        )));
    }
    match s.dtype {
        DType::F32 => staged_typed::<f32, O>(opt, s, |o, p, g, st| {
            o.step_f32(s.step, p, g, st);
        }),
        DType::F64 => staged_typed::<f64, O>(opt, s, |o, p, g, st| {
            o.step_f64(s.step, p, g, st);
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
    let (dev, stream) = (&s.place.device, s.place.stream);
    let read = |addr: u64| -> Result<Vec<T>, CommError> {
        let mut v = vec![T::default(); s.len];
        // SAFETY: `DeviceStep`'s addresses hold `len` live elements of `T`
        // (its dtype, matched by the caller).
        unsafe { dev.copy_to_host(consort_comm::dtype::as_bytes_mut(&mut v), addr, stream) }?;
        Ok(v)
    };
    let mut params = read(s.params)?;
    let grads = read(s.grads)?;
    let mut state = s
        .state
        .iter()
        .map(|&a| read(a))
        .collect::<Result<Vec<_>, _>>()?;
    let mut slots: Vec<&mut [T]> = state.iter_mut().map(Vec::as_mut_slice).collect();
    step(opt, &mut params, &grads, &mut slots);
    let write = |addr: u64, v: &[T]| {
        // SAFETY: as for `read`.
        unsafe { dev.copy_from_host(addr, consort_comm::dtype::as_bytes(v), stream) }
    };
    write(s.params, &params)?;
    for (&a, v) in s.state.iter().zip(&state) {
        write(a, v)?;
    }
    Ok(())
}
