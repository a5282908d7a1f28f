//! NCCL's half of the stream-ordered driver
//! ([`consort_comm::stream::DeviceComm`]): a call's completion is a CUDA
//! event, the asynchronous error is `ncclCommGetAsyncError`, and an abort
//! is `ncclCommAbort`, run off the caller's thread. Everything else (turns,
//! the launch lock, tracking, the watchdog thread, the abort sequence, the
//! side channel) is the driver the emulated device runs too
//! ([`consort_comm::stream`]).
//!
//! This module owns the communicator handle and its lifetime: it is read
//! and cleared under the driver's launch lock only, and no thread outlives
//! it ([`Cuda`]'s drop waits for a background abort).

use std::{
    ffi::c_int,
    sync::{Arc, Mutex, atomic::AtomicUsize},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use consort_comm::{CommError, ErrorContext, lock, stream::DeviceComm};
use cudarc::driver::{CudaContext, result as cu, sys as cusys};

use crate::{
    cuda::driver_error,
    map::nccl_error,
    sys::{Comm, Nccl, result},
};

/// A CUDA event handle, kept as an integer so it can cross threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Event(pub(crate) usize);

impl Event {
    pub(crate) fn raw(self) -> cusys::CUevent {
        self.0 as cusys::CUevent
    }
}

/// What a host call waits on: the result of its work.
pub(crate) type Waiter = tokio::sync::oneshot::Sender<Result<(), CommError>>;

/// The driver of one NCCL communicator.
pub(crate) type Driver = consort_comm::stream::Driver<Cuda>;

/// The driver's handle on one enqueued call.
pub(crate) struct Tracked {
    /// Recorded on the communication stream after the op.
    pub(crate) done: Event,
    pub(crate) waiter: Option<Waiter>,
    /// A host call's staging memory, held until the work completes.
    pub(crate) staging: Option<Arc<crate::staging::Held>>,
}

/// One NCCL communicator's device state: the library, the handle, the
/// event pool and the background abort.
pub(crate) struct Cuda {
    pub(crate) nccl: Arc<Nccl>,
    pub(crate) rank: usize,
    pub(crate) ctx: Arc<CudaContext>,
    /// The `ncclComm_t`, 0 once destroyed or aborted. It is read and
    /// cleared under the driver's launch lock only: whoever holds the lock
    /// may use the handle, and an abort takes the lock before freeing it.
    pub(crate) comm: AtomicUsize,
    /// Completion events of finished calls, to record again.
    events: Mutex<Vec<Event>>,
    /// The thread running this communicator's `ncclCommAbort`, once aborted.
    pub(crate) aborter: Mutex<Option<JoinHandle<()>>>,
    /// A handle cleared by an abort under the launch lock, which
    /// `ncclCommAbort` frees once the lock is released.
    pending_abort: AtomicUsize,
}

impl Cuda {
    pub(crate) fn new(nccl: Arc<Nccl>, rank: usize, ctx: Arc<CudaContext>, comm: usize) -> Self {
        Cuda {
            nccl,
            rank,
            ctx,
            comm: AtomicUsize::new(comm),
            events: Mutex::new(Vec::new()),
            aborter: Mutex::new(None),
            pending_abort: AtomicUsize::new(0),
        }
    }

    /// NCCL's last error text for the communicator (empty when unknown).
    /// `comm` is live: callers hold the launch lock, or are the watchdog.
    pub(crate) fn last_error(&self, comm: usize) -> String {
        last_error(&self.nccl, comm)
    }

    /// An event from the pool, or a new one.
    pub(crate) fn event(&self, ctx: ErrorContext) -> Result<Event, CommError> {
        if let Some(e) = lock(&self.events).pop() {
            return Ok(e);
        }
        cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(|e| Event(e as usize))
            .map_err(|e| driver_error(ctx, "event creation", e))
    }

    /// Returns an event to the pool (it may be re-recorded at once).
    pub(crate) fn recycle(&self, e: Event) {
        lock(&self.events).push(e);
    }

    /// The live communicator, if any.
    pub(crate) fn comm(&self) -> Option<usize> {
        match self.comm.load(std::sync::atomic::Ordering::SeqCst) {
            0 => None,
            c => Some(c),
        }
    }

    /// Destroys the pooled events (the watchdog has stopped).
    pub(crate) fn free_events(&self) {
        for e in std::mem::take(&mut *lock(&self.events)) {
            // SAFETY: pooled events are complete and owned by the pool.
            let _ = unsafe { cu::event::destroy(e.raw()) };
        }
    }

    /// Waits, at most `limit`, for this communicator's `ncclCommAbort`
    /// (run in the background) to return: the survivors' new communicator
    /// is made once NCCL has let go of the old one. Whether it returned (or
    /// none ran). `aborting`: whether an abort is under way (it may not
    /// have started its thread yet).
    pub(crate) async fn aborted_within(
        &self,
        limit: Duration,
        aborting: impl Fn() -> bool,
    ) -> bool {
        let deadline = consort_comm::time::deadline(limit);
        let t = loop {
            if let Some(t) = lock(&self.aborter).take() {
                break t;
            }
            if !aborting() || Instant::now() >= deadline {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        while !t.is_finished() {
            if Instant::now() >= deadline {
                tracing::warn!(
                    rank = self.rank,
                    "ncclCommAbort of the failed communicator has not returned after {limit:?}; \
                     making the survivors' communicator beside it"
                );
                // Still waited for (briefly) when the last handle goes.
                *lock(&self.aborter) = Some(t);
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let _ = t.join();
        true
    }
}

impl DeviceComm for Cuda {
    type Work = Tracked;
    type Probe = Event;

    fn probe(&self, w: &Tracked) -> Event {
        w.done
    }

    fn fired(&self, e: &Event) -> Result<bool, CommError> {
        // SAFETY: the event is ours and live: the driver hands its work to
        // `finish` (which may destroy it) only once no query is under way.
        match unsafe { cu::event::query(e.raw()) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == cusys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(driver_error(ErrorContext::default(), "completion query", e)),
        }
    }

    fn async_error(&self, _: &Tracked) -> Option<Result<(), CommError>> {
        let comm = self.comm()?;
        // The communicator is live and cannot be freed meanwhile: an abort
        // or a shutdown takes the launch lock, held by the driver here.
        let code = comm_state(&self.nccl, comm as Comm);
        if code == result::SUCCESS || code == result::IN_PROGRESS {
            return Some(Ok(()));
        }
        Some(Err(nccl_error(
            ErrorContext::default(),
            code,
            &self.last_error(comm),
        )))
    }

    fn abort(&self, locked: bool) {
        let c = self.comm.swap(0, std::sync::atomic::Ordering::SeqCst);
        if c == 0 {
            return;
        }
        self.pending_abort
            .store(c, std::sync::atomic::Ordering::SeqCst);
        if !locked {
            tracing::warn!(
                rank = self.rank,
                "an NCCL launch held the launch lock for over {:?}; aborting the communicator \
                 under it",
                consort_comm::stream::ABORT_WAIT
            );
        }
    }

    fn aborted(&self) {
        let c = self
            .pending_abort
            .swap(0, std::sync::atomic::Ordering::SeqCst);
        if c == 0 {
            return;
        }
        // Nobody can reach the handle any more (it was cleared under the
        // launch lock, and whoever read it before did so under the lock
        // too). Started before the calls fail: their callers may make the
        // survivors' group at once, which waits for this abort.
        *lock(&self.aborter) = abort_in_background(&self.nccl, c, self.rank);
    }

    fn finish(&self, w: Tracked, r: Result<(), CommError>) {
        if r.is_ok() {
            if let Some(h) = &w.staging {
                h.completed();
            }
            self.recycle(w.done);
        } else {
            // SAFETY: our event, queried by no one (the driver's promise);
            // destroying an unfinished event is allowed.
            let _ = unsafe { cu::event::destroy(w.done.raw()) };
        }
        if let Some(tx) = w.waiter {
            let _ = tx.send(r);
        }
    }

    fn watchdog_started(&self) {
        let _ = self.ctx.bind_to_thread();
    }
}

/// How long a communicator's last handle, going, waits for its
/// `ncclCommAbort` still running in the background.
const ABORT_AT_EXIT: Duration = Duration::from_secs(5);

impl Drop for Cuda {
    /// The process should not exit (CUDA's exit handlers run) while NCCL is
    /// inside `ncclCommAbort` on another thread: the last handle of an
    /// aborted communicator waits for it, at most [`ABORT_AT_EXIT`].
    fn drop(&mut self) {
        use tokio::runtime::{Handle, RuntimeFlavor};
        let Some(t) = lock(&self.aborter).take() else {
            return;
        };
        let deadline = consort_comm::time::deadline(ABORT_AT_EXIT);
        let wait = || {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        // Off the runtime's workers when dropped in a task.
        match Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(wait),
            _ => wait(),
        }
        if t.is_finished() {
            let _ = t.join();
        } else {
            tracing::warn!(
                rank = self.rank,
                "ncclCommAbort has not returned {ABORT_AT_EXIT:?} after the communicator's last \
                 handle went; leaving it running"
            );
        }
    }
}

/// A communicator's state (`ncclCommGetAsyncError`): success, in
/// progress, or its error (the query's own failure included). `comm` must
/// be live: the callers hold the launch lock, or own a communicator not yet
/// handed out.
pub(crate) fn comm_state(nccl: &Nccl, comm: Comm) -> c_int {
    let mut state = result::SUCCESS;
    // SAFETY: `comm` is live (the caller's promise); `state` is a valid
    // out-pointer.
    let q = unsafe { (nccl.comm_get_async_error)(comm, &mut state) };
    if q != result::SUCCESS { q } else { state }
}

/// NCCL's last error text for live communicator `comm` (empty when
/// unknown).
pub(crate) fn last_error(nccl: &Nccl, comm: usize) -> String {
    let Some(f) = nccl.get_last_error else {
        return String::new();
    };
    // SAFETY: `comm` is live (the caller's promise).
    let p = unsafe { f(comm as Comm) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: NCCL returns a NUL-terminated string it owns.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// `ncclCommAbort` of `comm`, which nothing else can reach any more, on a
/// thread of its own: with a dead peer NCCL's abort can wait long for its
/// proxy threads, and the calls it fails must not wait for it (torch's
/// watchdog aborts with a timeout for the same reason). The thread is a
/// plain one, so it never keeps the process from exiting.
/// Returns the thread, to wait for when something must follow the abort
/// (`None`: it ran on the caller's thread, which could not spawn one).
pub(crate) fn abort_in_background(
    nccl: &Arc<Nccl>,
    comm: usize,
    rank: usize,
) -> Option<JoinHandle<()>> {
    let n = nccl.clone();
    let abort = move || {
        // SAFETY: `comm` was live and is aborted once: its only holder
        // handed it over and cleared its own copy.
        let r = unsafe { (n.comm_abort)(comm as Comm) };
        tracing::debug!(rank, result = r, "NCCL: ncclCommAbort returned");
    };
    match std::thread::Builder::new()
        .name(format!("consort-nccl-abort-{rank}"))
        .spawn(abort.clone())
    {
        Ok(t) => Some(t),
        Err(_) => {
            abort();
            None
        }
    }
}

#[cfg(test)]
mod tests {
    /// NCCL's driver is the one the emulated device runs: only `Cuda`, its
    /// `DeviceComm`, is NCCL's own.
    #[test]
    fn nccl_runs_the_shared_stream_driver() {
        fn same(d: &super::Driver) -> &consort_comm::stream::Driver<super::Cuda> {
            d
        }
        let _ = same;
    }
}
