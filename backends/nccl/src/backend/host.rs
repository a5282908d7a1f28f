//! Host-buffer calls: staged and enqueued when they are made, as device
//! calls are, so a rank's calls reach the stream in the order they were
//! made whatever order their works are polled in (torch's rule: work runs
//! whether or not anyone waits for it). Each call's staging memory comes
//! from the communicator's pool ([`crate::staging`]) and is held until its
//! result has been copied out; a call whose work is dropped runs to its end,
//! as a device call does.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use consort_comm::{
    CommError, Result,
    stream::{Call, Unlaunched},
};
use cudarc::driver::{result as cu, sys as cusys};

use super::{Enqueue, NcclBackend};
use crate::{staging::Held, sys::result, work::Cuda};

/// A host call on the stream: its result to come, and the staging memory
/// it lands in.
pub(super) struct Staged {
    done: tokio::sync::oneshot::Receiver<Result<()>>,
    held: Arc<Held>,
    /// Where the output starts in the pinned buffer, and its length.
    at: usize,
    len: usize,
}

impl Staged {
    /// Waits for the call's work and copies its output into `output`.
    pub(super) async fn finish(self, output: Option<&mut [u8]>) -> Result<()> {
        self.done.await.map_err(|_| {
            CommError::aborted(consort_comm::AbortCause::Stopped("the NCCL watchdog"))
        })??;
        if let Some(o) = output {
            // SAFETY: the work completed (its copy back is done), and the
            // pair is held: the pinned bytes are the result.
            let back = unsafe {
                std::slice::from_raw_parts((self.held.host() as *const u8).add(self.at), self.len)
            };
            o.copy_from_slice(back);
        }
        Ok(())
    }
}

/// How long freeing the staging buffers waits for the stream to drain.
const STAGING_DRAIN: Duration = Duration::from_secs(10);

impl NcclBackend {
    /// Closes the staging pool once the communication stream is idle.
    pub(super) fn free_staging(&self) {
        let _ = self.ctx.bind_to_thread();
        // After shutdown or abort every launch is refused before it touches
        // the stream; under the launch lock, none is half done (its copy
        // back not yet enqueued). Then once the stream drains, the last
        // staged copies are done. A stream that does not drain (a kernel
        // NCCL's abort has not ended yet), or a launch that keeps the lock,
        // keeps the buffers: they are leaked, not freed under it.
        let slot = self.shared.slot_within(STAGING_DRAIN);
        let drained =
            slot.is_some() && (self.staging.is_empty() || self.stream_drains(STAGING_DRAIN));
        let left = self.staging.close(drained);
        drop(slot);
        if left > 0 {
            tracing::warn!(
                rank = self.rank,
                "the NCCL stream did not drain within {STAGING_DRAIN:?} after the communicator \
                 ended; its staging buffers ({left} bytes) are left allocated"
            );
        }
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

    /// Stages a host call and enqueues it, now: its input (and, in place,
    /// its output) is copied into a pair of staging buffers from the pool,
    /// and the copies and the op go on the stream in this rank's order. A
    /// failure before the launch (no staging memory) ends the call as any
    /// failure before the enqueue does (`pending`).
    pub(super) fn stage(
        &self,
        pending: Unlaunched<'_, Cuda>,
        call: Call,
        input: Option<&[u8]>,
        output: Option<(&[u8], bool)>,
        enqueue: Enqueue<'_>,
    ) -> Result<Staged> {
        // A call its group already refuses takes no staging memory.
        if let Err(e) = self.shared.launchable(call.made.id) {
            pending.settled();
            return Err(e);
        }
        let in_len = input.map_or(0, <[u8]>::len);
        let out_len = output.map_or(0, |(o, _)| o.len());
        let held = match self.staging.take(in_len + out_len, call.made.ctx) {
            Ok(h) => Arc::new(h),
            // Shut down meanwhile: the call is refused, as any call made
            // before a shutdown and enqueued after it (nothing to tell).
            Err(e) => match self.shared.launchable(call.made.id) {
                Err(refused) => {
                    pending.settled();
                    return Err(refused);
                }
                Ok(()) => return Err(pending.failed(e)),
            },
        };
        let (host, dev) = (held.host(), held.dev());
        // SAFETY: the pinned buffer holds `cap >= in_len + out_len` bytes,
        // and nothing else uses it: the pool hands a pair out only once the
        // last call on it completed and its holders let go, or it is new.
        let pinned = unsafe { std::slice::from_raw_parts_mut(host as *mut u8, held.cap()) };
        if let Some(i) = input {
            pinned[..in_len].copy_from_slice(i);
        }
        if let Some((o, true)) = output {
            pinned[in_len..in_len + out_len].copy_from_slice(o);
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (ci, co) = (dev, dev + in_len as u64);
        let staged: Enqueue<'_> = Box::new(move |on, _, _| {
            let s = on.stream as cusys::CUstream;
            // SAFETY: the pair holds `in_len + out_len` bytes each and is
            // held until the work has completed (or, failed, until the
            // stream drained); the copies and the op are ordered on the
            // communication stream.
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
        let launched = self.launch(&call, &[], (ci, co), Some((held.clone(), tx)), staged);
        pending.settled();
        launched?;
        Ok(Staged {
            done: rx,
            held,
            at: in_len,
            len: out_len,
        })
    }
}
