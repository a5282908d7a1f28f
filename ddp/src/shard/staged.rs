//! [`StagedKernels`]: the device kernels of the emulated device, each
//! update through the host ([`staged`], [`staged_cast`],
//! [`staged_unscale`]). On the emulated device (whose memory is host
//! memory) that is the device's arithmetic, and it makes the device path of
//! every strategy testable in `cargo test`. On a GPU it is correct but slow
//! (two copies of the shard per step).

use consort_comm::{CommError, DType, Placement};

use super::{
    kernels::{DeviceStep, ShardKernels},
    optim::staged,
    rules::{AdamW, Sgd},
    vals::Vals,
};

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
    let mut host =
        Vals::zeros(from, len).ok_or_else(|| CommError::invalid(format!("casting from {from}")))?;
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
    let mut host = Vals::F32(v);
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

    fn sgd(&self, s: &DeviceStep<'_>, opt: &Sgd) -> Result<(), CommError> {
        staged(opt, s)
    }

    fn adamw(&self, s: &DeviceStep<'_>, opt: &AdamW) -> Result<(), CommError> {
        staged(opt, s)
    }

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
