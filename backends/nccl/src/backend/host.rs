//! Host-buffer calls: staging through one reused pinned host buffer and
//! one device buffer (grown when a call needs more), and waiting for the
//! result. Host calls take turns on the staging memory; a call dropped
//! while its copies still run is waited for before the memory is reused.

use std::{
    ffi::c_void,
    time::{Duration, Instant},
};

use consort_comm::{CommError, ErrorContext, Result};
use cudarc::driver::{result as cu, sys as cusys};

use super::{Call, Enqueue, NcclBackend, Unlaunched};
use crate::{
    sys::result,
    work::{Track, driver_error, lock},
};

/// The reused staging memory of host calls.
#[derive(Default)]
pub(super) struct Staging {
    /// Pinned host memory (`cuMemHostAlloc`), as an address.
    host: usize,
    /// Device memory, as an address.
    dev: u64,
    cap: usize,
    /// The generation of the last host call that used it.
    generation: u64,
}

/// How long freeing the staging buffers waits for the stream to drain.
const STAGING_DRAIN: Duration = Duration::from_secs(10);

impl NcclBackend {
    /// Frees the staging memory once the communication stream is idle.
    pub(super) fn free_staging(&self) {
        let Ok(mut st) = self.staging.try_lock() else {
            return;
        };
        if st.cap == 0 {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // After shutdown or abort nothing new is enqueued on our stream:
        // once it drains, the last staged copies are done. A stream that
        // does not drain (a kernel NCCL's abort has not ended yet) keeps
        // the buffers: they are leaked, not freed under it.
        if !self.stream_drains(STAGING_DRAIN) {
            tracing::warn!(
                rank = self.rank,
                "the NCCL stream did not drain within {STAGING_DRAIN:?} after the communicator \
                 ended; its staging buffers ({} bytes) are left allocated",
                st.cap
            );
            *st = Staging::default();
            return;
        }
        // SAFETY: allocated by `grow`, freed once (cap is reset).
        unsafe {
            let _ = cu::free_host(st.host as *mut c_void);
            let _ = cu::free_sync(st.dev);
        }
        *st = Staging::default();
    }

    /// Whether the communication stream's work finishes within `limit`
    /// (an event recorded now, polled).
    fn stream_drains(&self, limit: Duration) -> bool {
        let Ok(e) = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING) else {
            return false;
        };
        // SAFETY: `e` is ours; the stream is ours.
        if unsafe { cu::event::record(e, self.cu_stream()) }.is_err() {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { cu::event::destroy(e) };
            return false;
        }
        let deadline = consort_comm::time::deadline(limit);
        let drained = loop {
            // SAFETY: recorded above, destroyed below.
            match unsafe { cu::event::query(e) } {
                Ok(()) => break true,
                Err(x) if x.0 == cusys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                Err(_) => break false,
            }
            if Instant::now() >= deadline {
                break false;
            }
            std::thread::sleep(Duration::from_micros(100));
        };
        // SAFETY: ours, destroyed once.
        let _ = unsafe { cu::event::destroy(e) };
        drained
    }

    pub(super) async fn host_call(
        &self,
        pending: Unlaunched<'_>,
        call: Call,
        input: Option<&[u8]>,
        mut output: Option<(&mut [u8], bool)>,
        enqueue: Enqueue<'_>,
    ) -> Result<()> {
        let in_len = input.map_or(0, <[u8]>::len);
        let out_len = output.as_ref().map_or(0, |(o, _)| o.len());
        let mut st = self.staging.lock().await;
        let ready = match self.wait_staging(st.generation, call.timeout).await {
            Ok(()) => self.grow(&mut st, in_len + out_len),
            Err(e) => Err(e),
        };
        if let Err(e) = ready {
            return Err(pending.failed(e));
        }
        let host = st.host;
        // SAFETY: the pinned buffer holds `cap >= in_len + out_len` bytes and
        // no device copy uses it (the previous host call's work finished).
        let pinned = unsafe { std::slice::from_raw_parts_mut(host as *mut u8, st.cap) };
        if let Some(i) = input {
            pinned[..in_len].copy_from_slice(i);
        }
        if let Some((o, true)) = &output {
            pinned[in_len..in_len + out_len].copy_from_slice(o);
        }
        // Counted only once launched: a launch that fails leaves no work
        // carrying this generation, and the next call must not wait for it.
        let (generation, dev) = (st.generation + 1, st.dev);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (ci, co) = (dev, dev + in_len as u64);
        let staged: Enqueue<'_> = Box::new(move |on, _, _| {
            let s = on.stream as cusys::CUstream;
            // SAFETY: `pinned` and `dev` hold `in_len + out_len` bytes; the
            // copies and the op are ordered on the communication stream.
            unsafe {
                let host = host as *mut u8;
                let both = std::slice::from_raw_parts(host, in_len + out_len);
                if !both.is_empty() && cu::memcpy_htod_async(dev, both, s).is_err() {
                    return result::UNHANDLED_CUDA_ERROR;
                }
                // Settled: the copy back must follow the kernel.
                let r = enqueue(on, ci, co);
                if r != result::SUCCESS {
                    return r;
                }
                let back = std::slice::from_raw_parts_mut(host.add(in_len), out_len);
                if !back.is_empty() && cu::memcpy_dtoh_async(back, co, s).is_err() {
                    return result::UNHANDLED_CUDA_ERROR;
                }
                r
            }
        });
        let launched = self.launch(call, &[], (ci, co), Some((generation, tx)), staged);
        pending.settled();
        launched?;
        st.generation = generation;
        rx.await.map_err(|_| CommError::Aborted {
            ctx: ErrorContext::default(),
            cause: "the NCCL watchdog stopped before the call finished".into(),
        })??;
        if let Some((o, _)) = output.as_mut() {
            // SAFETY: the work finished: the pinned bytes are the result.
            let back =
                unsafe { std::slice::from_raw_parts((host as *const u8).add(in_len), out_len) };
            o.copy_from_slice(back);
        }
        Ok(())
    }

    /// Waits until the host call of generation `generation` has finished on the
    /// device (it may have been dropped while its copies still ran).
    async fn wait_staging(&self, generation: u64, timeout: Duration) -> Result<()> {
        self.wait_for(timeout, |t| {
            (t.staged >= generation || t.core.poisoned().is_some()).then_some(Ok(()))
        })
        .await
    }

    /// Polls the tracked work until `done` answers, or `timeout` passes.
    pub(super) async fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&Track) -> Option<Result<()>>,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(r) = done(&lock(&self.shared.track)) {
                return r;
            }
            if start.elapsed() >= timeout {
                return Err(consort_comm::ordered::wait_timeout(self.rank, timeout));
            }
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
    }

    /// Makes the staging buffers hold at least `bytes` (doubling).
    fn grow(&self, st: &mut Staging, bytes: usize) -> Result<()> {
        if bytes <= st.cap && st.cap > 0 {
            return Ok(());
        }
        let ctx = ErrorContext {
            rank: Some(self.rank),
            ..Default::default()
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error(ctx, "context binding", e))?;
        let cap = bytes.max(st.cap * 2).max(4096);
        // SAFETY: the old buffers are idle (wait_staging); freed once.
        unsafe {
            if st.cap > 0 {
                let _ = cu::free_host(st.host as *mut c_void);
                let _ = cu::free_sync(st.dev);
                *st = Staging {
                    generation: st.generation,
                    ..Staging::default()
                };
            }
            let host = cu::malloc_host(cap, 0)
                .map_err(|e| driver_error(ctx, "pinned staging allocation", e))?;
            let dev = match cu::malloc_sync(cap) {
                Ok(d) => d,
                Err(e) => {
                    let _ = cu::free_host(host);
                    return Err(driver_error(ctx, "device staging allocation", e));
                }
            };
            st.host = host as usize;
            st.dev = dev;
            st.cap = cap;
        }
        Ok(())
    }
}
