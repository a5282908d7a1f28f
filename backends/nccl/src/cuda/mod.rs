//! consort's CUDA, in one place: [`CudaDevice`], `consort_comm::Device` on
//! one CUDA context through the driver API (cudarc, loaded at run time),
//! and the kernel plumbing ([`compile`] with NVRTC, [`probe_lib`],
//! [`launch_1d`]).
//!
//! This module owns the CUDA side of device-resident DDP: stream-ordered
//! allocation (`cuMemAllocAsync`), copies, zeroing, events and stream
//! waits. It owns no collective: [`crate::NcclBackend`] orders its own
//! stream against the streams these buffers live on.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use consort_comm::{CommError, Device, ErrorContext, EventId, Result, StreamId};
use cudarc::driver::{CudaContext, result as cu, sys as cusys};

use crate::probe::probe_device;

mod nvrtc;
pub use nvrtc::{compile, launch_1d, probe_lib};

/// One GPU's memory and streams for [`consort_comm::Device`] users (DDP's
/// device buckets). Streams it creates are destroyed with it.
pub struct CudaDevice {
    ordinal: i32,
    ctx: Arc<CudaContext>,
    streams: Mutex<Vec<usize>>,
    /// How long `synchronize` (and so `copy_to_host`) waits for a stream.
    sync_timeout: Duration,
    /// What another library's streams need kept alive while work on them
    /// may still be enqueued through this device (see
    /// [`CudaDevice::keep_alive`]); dropped after this device's streams.
    kept: Mutex<Vec<Arc<dyn std::any::Any + Send + Sync>>>,
}

/// [`CudaDevice`]'s default limit on one stream synchronization: NCCL's
/// default op timeout, so a stream behind a collective that never finishes
/// is reported after the communicator's own watchdog has had its turn.
pub const DEFAULT_SYNC_TIMEOUT: Duration = Duration::from_secs(600);

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

/// A CUDA driver failure as the call's abort: the call, what failed, and
/// the driver's code.
pub(crate) fn driver_error(ctx: ErrorContext, what: &'static str, e: cu::DriverError) -> CommError {
    CommError::Aborted {
        ctx,
        cause: consort_comm::AbortCause::Device {
            what,
            error: format!("{e:?}"),
        },
    }
}

fn err(what: &'static str, e: cu::DriverError) -> CommError {
    driver_error(ErrorContext::default(), what, e)
}

impl CudaDevice {
    /// GPU `ordinal`'s primary context. `BackendUnavailable` (never a
    /// panic) without a driver or that GPU.
    pub fn new(ordinal: usize) -> Result<Arc<Self>> {
        Self::with_sync_timeout(ordinal, DEFAULT_SYNC_TIMEOUT)
    }

    /// GPU `ordinal` with `synchronize` waiting at most `timeout` for a
    /// stream (the default is [`DEFAULT_SYNC_TIMEOUT`]).
    pub fn with_sync_timeout(ordinal: usize, timeout: Duration) -> Result<Arc<Self>> {
        probe_device(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| err("context creation", e))?;
        Ok(Arc::new(CudaDevice {
            ordinal: ordinal as i32,
            ctx,
            streams: Mutex::new(Vec::new()),
            sync_timeout: timeout,
            kept: Mutex::new(Vec::new()),
        }))
    }

    /// Keeps `owner` alive as long as this device: for a stream of another
    /// library's (candle's, say) that placements on this device name, so
    /// that a free or copy enqueued on it through this device (DDP's, when
    /// it drops) never meets a destroyed stream.
    pub fn keep_alive(&self, owner: Arc<dyn std::any::Any + Send + Sync>) {
        self.kept
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(owner);
    }

    /// The cudarc context (for kernels and cuBLAS on the same GPU).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| err("context binding", e))
    }

    /// The stream-ordered allocations' bytes in use now and at their peak
    /// since [`CudaDevice::reset_peak`] (the device's default memory pool,
    /// which `alloc_zeroed` draws from: the counterpart of torch's
    /// `memory_allocated` and `max_memory_allocated`). NCCL's own buffers
    /// are not in it.
    pub fn pool_usage(&self) -> Result<(u64, u64)> {
        let pool = self.pool()?;
        let get = |attr| {
            let mut v = 0u64;
            // SAFETY: a live pool; both attributes are 64-bit counters.
            unsafe { cusys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) }
                .result()
                .map(|()| v)
                .map_err(|e| err("memory pool query", e))
        };
        use cusys::CUmemPool_attribute as A;
        Ok((
            get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        ))
    }

    /// Restarts [`CudaDevice::pool_usage`]'s peak from the bytes in use.
    pub fn reset_peak(&self) -> Result<()> {
        let pool = self.pool()?;
        let mut zero = 0u64;
        // SAFETY: a live pool; the high-water mark may only be set to zero.
        unsafe {
            cusys::cuMemPoolSetAttribute(
                pool,
                cusys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        }
        .result()
        .map_err(|e| err("memory pool reset", e))
    }

    /// The device's default memory pool.
    fn pool(&self) -> Result<cusys::CUmemoryPool> {
        self.bind()?;
        let dev = cu::device::get(self.ordinal).map_err(|e| err("device query", e))?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: `pool` receives the device's default pool handle.
        unsafe { cusys::cuDeviceGetDefaultMemPool(&mut pool, dev) }
            .result()
            .map_err(|e| err("memory pool lookup", e))?;
        Ok(pool)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let streams = std::mem::take(&mut *consort_comm::lock(&self.streams));
        for s in streams {
            // SAFETY: created by `new_stream`, destroyed once; pending work
            // completes before the driver releases it.
            let _ = unsafe { cu::stream::destroy(s as cusys::CUstream) };
        }
    }
}

fn stream(s: StreamId) -> cusys::CUstream {
    s as cusys::CUstream
}

impl Device for CudaDevice {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn ordinal(&self) -> i32 {
        self.ordinal
    }

    fn new_stream(&self) -> Result<StreamId> {
        self.bind()?;
        let s = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| err("stream creation", e))?;
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(s as usize);
        Ok(s as StreamId)
    }

    fn alloc_zeroed(&self, bytes: usize, s: StreamId) -> Result<u64> {
        self.bind()?;
        // SAFETY: stream-ordered allocation on a stream of this context;
        // at least one byte so that every allocation has its own address.
        unsafe {
            let p = cu::malloc_async(stream(s), bytes.max(1)).map_err(|e| err("allocation", e))?;
            cu::memset_d8_async(p, 0, bytes.max(1), stream(s)).map_err(|e| err("memset", e))?;
            Ok(p)
        }
    }

    unsafe fn free(&self, ptr: u64, s: StreamId) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract (allocated here, freed once).
        unsafe { cu::free_async(ptr, stream(s)) }.map_err(|e| err("free", e))
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, s: StreamId) -> Result<()> {
        self.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract (live, non-overlapping ranges).
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, stream(s)) }.map_err(|e| err("copy", e))
    }

    unsafe fn fill_zero(&self, dst: u64, bytes: usize, s: StreamId) -> Result<()> {
        self.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract (a live range).
        unsafe { cu::memset_d8_async(dst, 0, bytes, stream(s)) }.map_err(|e| err("memset", e))
    }

    unsafe fn copy_from_host(&self, dst: u64, src: &[u8], s: StreamId) -> Result<()> {
        self.bind()?;
        if src.is_empty() {
            return Ok(());
        }
        // From pageable memory the driver stages the source before it
        // returns; the caller's slice might be pinned (then the copy would
        // read it later), so it goes through a pageable copy of our own.
        let staged = src.to_vec();
        // SAFETY: `dst` holds `src.len()` bytes (caller's contract); the
        // source is pageable, consumed before return.
        unsafe { cu::memcpy_htod_async(dst, &staged, stream(s)) }
            .map_err(|e| err("host-to-device copy", e))
    }

    unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64, s: StreamId) -> Result<()> {
        self.bind()?;
        if dst.is_empty() {
            return self.synchronize(s);
        }
        // SAFETY: `src` holds `dst.len()` bytes; the stream sync below
        // finishes the copy before `dst` is returned to the caller.
        unsafe { cu::memcpy_dtoh_async(dst, src, stream(s)) }
            .map_err(|e| err("device-to-host copy", e))?;
        self.synchronize(s)
    }

    fn record(&self, s: StreamId) -> Result<EventId> {
        self.bind()?;
        let e = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| err("event creation", e))?;
        // SAFETY: `e` is ours; `s` is a stream of this context.
        if let Err(x) = unsafe { cu::event::record(e, stream(s)) } {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { cu::event::destroy(e) };
            return Err(err("event record", x));
        }
        Ok(EventId(e as u64))
    }

    unsafe fn wait(&self, s: StreamId, event: EventId) -> Result<()> {
        self.bind()?;
        // SAFETY: `event` came from `record` and is not released yet (the
        // caller's promise).
        unsafe {
            cu::stream::wait_event(
                stream(s),
                event.0 as cusys::CUevent,
                cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| err("stream wait", e))
    }

    unsafe fn query(&self, event: EventId) -> Result<bool> {
        self.bind()?;
        // SAFETY: as in `wait`.
        match unsafe { cu::event::query(event.0 as cusys::CUevent) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == cusys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(err("event query", e)),
        }
    }

    unsafe fn release(&self, event: EventId) -> Result<()> {
        self.bind()?;
        // SAFETY: released once (the caller's promise); the driver frees it
        // when it completes.
        unsafe { cu::event::destroy(event.0 as cusys::CUevent) }
            .map_err(|e| err("event destroy", e))
    }

    /// Waits for the stream's work, at most the sync timeout: an event is
    /// recorded and polled (spinning briefly, then sleeping), so a stream
    /// behind a kernel that never ends is an error, not a hang.
    fn synchronize(&self, s: StreamId) -> Result<()> {
        let e = consort_comm::Event::record(self, s)?;
        let deadline = consort_comm::time::deadline(self.sync_timeout);
        let mut spins = 0u32;
        loop {
            match e.query() {
                Ok(true) => break Ok(()),
                Err(x) => break Err(x),
                Ok(false) if Instant::now() >= deadline => {
                    break Err(CommError::aborted(format!(
                        "CUDA stream {s} of GPU {} did not drain within {:?}: a kernel on it (a \
                         collective whose peer is gone or stopped?) never finished",
                        self.ordinal, self.sync_timeout
                    )));
                }
                Ok(false) if spins < 1000 => {
                    spins += 1;
                    std::thread::yield_now();
                }
                Ok(false) => std::thread::sleep(Duration::from_micros(20)),
            }
        }
    }
}
