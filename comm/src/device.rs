//! Device memory behind one small trait: [`Device`].
//!
//! This module owns the contract that lets DDP (and any layer above the
//! backends) keep its buffers on an accelerator without knowing which one:
//! allocate, copy, zero, record an event on a stream and make another
//! stream wait for it. Two implementations exist:
//!
//! - CUDA, in consort-nccl (`CudaDevice`), through the driver API;
//! - the emulated device, in consort-sim (`EmulatedDevice`), whose copies
//!   complete late, on a worker thread, after seeded random delays, so that
//!   every ordering rule can be tested without a GPU.
//!
//! It owns no memory itself and no runtime: a [`Device`] is a handle.
//!
//! # The ordering model (CUDA's)
//!
//! Work is *enqueued* on a stream and runs later, in the stream's order.
//! Work on different streams runs in any order unless a stream
//! [`Device::wait`]s for an event [`Device::record`]ed on another. The host
//! sees a stream's results only after [`Device::synchronize`] (or a
//! [`Device::copy_to_host`], which synchronizes first).
//!
//! A backend that takes a [`crate::DeviceBuffer`] keeps the same model: it
//! makes its own stream wait for the buffer's stream, enqueues the
//! collective, makes the buffer's stream wait for the collective, and
//! returns without blocking the host (see [`crate::Backend`]).

use std::fmt;

use crate::Result;

/// A stream handle: the raw `CUstream` for CUDA (0 is the legacy default
/// stream); an index for the emulated device.
pub type StreamId = u64;

/// An event recorded on a stream; release it with [`Device::release`]
/// once nothing waits on it any more. It is a raw handle (a `CUevent`):
/// the methods that use one are `unsafe`, since a released or forged one
/// is undefined behaviour in the driver. [`Event`] owns one safely.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

/// One accelerator's memory and streams.
///
/// Pointers are device addresses as `u64` (what [`crate::DeviceBuffer`]
/// carries). Methods that take raw device addresses are `unsafe`: the
/// caller promises that the range was allocated on this device and stays
/// allocated until the enqueued work has run.
pub trait Device: Send + Sync + fmt::Debug {
    /// `"cuda"` or `"emulated"`.
    fn kind(&self) -> &'static str;

    /// The device ordinal that [`crate::DeviceBuffer::device`] carries.
    fn ordinal(&self) -> i32;

    /// A new stream that runs independently of every other.
    fn new_stream(&self) -> Result<StreamId>;

    /// `bytes` of zeroed device memory, ready once `stream` reaches this
    /// point. Zero bytes still give a valid, unique address.
    fn alloc_zeroed(&self, bytes: usize, stream: StreamId) -> Result<u64>;

    /// Frees memory from [`Device::alloc_zeroed`] once `stream` reaches this
    /// point.
    ///
    /// # Safety
    /// `ptr` came from `alloc_zeroed` on this device and is freed once; no
    /// work on another stream may still use it unless `stream` waits for
    /// that work.
    unsafe fn free(&self, ptr: u64, stream: StreamId) -> Result<()>;

    /// Enqueues a copy of `bytes` from `src` to `dst` on `stream`.
    ///
    /// # Safety
    /// Both ranges lie in live allocations of this device and do not
    /// overlap.
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, stream: StreamId) -> Result<()>;

    /// Enqueues zeroing `bytes` at `dst` on `stream`.
    ///
    /// # Safety
    /// The range lies in a live allocation of this device.
    unsafe fn fill_zero(&self, dst: u64, bytes: usize, stream: StreamId) -> Result<()>;

    /// Enqueues a copy of `src` to `dst` on `stream`. `src` is read before
    /// this returns (staged), so the caller may reuse it at once.
    ///
    /// # Safety
    /// `dst..dst + src.len()` lies in a live allocation of this device.
    unsafe fn copy_from_host(&self, dst: u64, src: &[u8], stream: StreamId) -> Result<()>;

    /// Waits for `stream`, then copies `dst.len()` bytes at `src` into
    /// `dst`. Blocks the host.
    ///
    /// # Safety
    /// `src..src + dst.len()` lies in a live allocation of this device.
    unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64, stream: StreamId) -> Result<()>;

    /// Records an event on `stream`: it completes when the work enqueued
    /// before it has run.
    fn record(&self, stream: StreamId) -> Result<EventId>;

    /// Makes `stream` wait for `event` before running anything enqueued
    /// after this call. Does not block the host.
    ///
    /// # Safety
    ///
    /// `event` came from this device's [`Device::record`] and has not been
    /// released.
    unsafe fn wait(&self, stream: StreamId, event: EventId) -> Result<()>;

    /// Whether `event` has completed.
    ///
    /// # Safety
    ///
    /// As for [`Device::wait`].
    unsafe fn query(&self, event: EventId) -> Result<bool>;

    /// Forgets `event`; streams already waiting on it still wait correctly.
    ///
    /// # Safety
    ///
    /// As for [`Device::wait`]; afterwards `event` must not be used again
    /// (a second release destroys a handle the driver may have reused).
    unsafe fn release(&self, event: EventId) -> Result<()>;

    /// Blocks the host until everything enqueued on `stream` has run.
    fn synchronize(&self, stream: StreamId) -> Result<()>;
}

/// An event recorded on a stream, owned: released once, when dropped, so
/// that safe code cannot use a released handle or release one twice. The
/// safe way to order two streams (what [`Device::wait`] and friends do on
/// raw handles).
pub struct Event<'d> {
    device: &'d dyn Device,
    id: EventId,
}

impl<'d> Event<'d> {
    /// Records an event on `stream` of `device`: it completes when the
    /// work enqueued there before it has run.
    pub fn record(device: &'d dyn Device, stream: StreamId) -> Result<Event<'d>> {
        Ok(Event {
            device,
            id: device.record(stream)?,
        })
    }

    /// Makes `stream` (of the same device) wait for this event before it
    /// runs anything enqueued after this call. Does not block the host.
    pub fn wait_on(&self, stream: StreamId) -> Result<()> {
        // SAFETY: recorded on this device by `record`, released only by
        // `drop`.
        unsafe { self.device.wait(stream, self.id) }
    }

    /// Whether the work before the event has run.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: as in `wait_on`.
        unsafe { self.device.query(self.id) }
    }
}

impl Drop for Event<'_> {
    fn drop(&mut self) {
        // SAFETY: as in `wait_on`; this is the one release. A failed
        // release leaves a handle leaked, which is safe.
        let _ = unsafe { self.device.release(self.id) };
    }
}

impl fmt::Debug for Event<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.device.kind())
            .field("id", &self.id)
            .finish()
    }
}

/// Where a model's tensors live: a device and the compute stream that
/// produces its gradients and consumes its parameters.
#[derive(Clone, Debug)]
pub struct Placement {
    /// The device.
    pub device: std::sync::Arc<dyn Device>,
    /// The stream compute runs on (torch's current stream).
    pub stream: StreamId,
}

impl Placement {
    /// A view of `len` elements of `dtype` at `ptr`, ready on this
    /// placement's stream.
    ///
    /// # Safety
    /// As [`crate::DeviceBuffer::new`]: the range is live device memory of
    /// this device for as long as any op that receives the view runs.
    pub unsafe fn buffer(&self, ptr: u64, len: usize, dtype: crate::DType) -> crate::DeviceBuffer {
        // SAFETY: forwarded to the caller.
        unsafe { crate::DeviceBuffer::new(ptr, len, dtype, self.device.ordinal(), self.stream) }
    }
}
