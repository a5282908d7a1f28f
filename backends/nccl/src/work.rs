//! Work in flight on one communicator, and the watchdog thread that tracks
//! it (torch's `WorkNCCL` list and its `ncclCommWatchdog`).
//!
//! This module owns the communicator handle and every rule about its
//! lifetime: the launch lock that serialises NCCL calls on it, sequence
//! numbers, poisoning, the event pool, and the one thread per communicator
//! that completes work in order, checks `ncclCommGetAsyncError`, aborts the
//! communicator when the oldest work passes its deadline, and makes that
//! failure sticky. No thread outlives the communicator: [`Shared::stop`]
//! joins the watchdog before the handle is destroyed.

use std::{
    collections::VecDeque,
    ffi::c_int,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use consort_comm::{CommError, ErrorContext, GroupId, OpKind};
use cudarc::driver::{CudaContext, result as cu, sys as cusys};

use crate::{
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

/// One enqueued call.
pub(crate) struct Work {
    pub(crate) ctx: ErrorContext,
    /// Recorded on the communication stream after the op.
    pub(crate) done: Event,
    pub(crate) deadline: Instant,
    pub(crate) timeout: Duration,
    pub(crate) waiter: Option<Waiter>,
    /// A host call's staging generation (see `Shared::staged`).
    pub(crate) staging: Option<u64>,
}

/// What the launch lock guards: the next sequence number, and the right
/// to make NCCL calls on the communicator (one thread at a time).
pub(crate) struct Slot {
    pub(crate) seq: u64,
}

/// Tracked work and the sticky failure, behind the tracking lock.
#[derive(Default)]
pub(crate) struct Track {
    pub(crate) queue: VecDeque<Work>,
    pub(crate) poisoned: Option<CommError>,
    pub(crate) stop: bool,
    pub(crate) free_events: Vec<Event>,
    /// The newest staging generation whose work has finished.
    pub(crate) staged: u64,
}

/// State shared by the backend and its watchdog.
pub(crate) struct Shared {
    pub(crate) nccl: Arc<Nccl>,
    pub(crate) rank: usize,
    /// The `ncclComm_t`, 0 once destroyed or aborted. An atomic, not part
    /// of the launch lock: the watchdog must be able to query and abort the
    /// communicator while a launch is blocked inside NCCL (torch's watchdog
    /// aborts from its own thread for the same reason).
    pub(crate) comm: std::sync::atomic::AtomicUsize,
    pub(crate) slot: Mutex<Slot>,
    pub(crate) track: Mutex<Track>,
    pub(crate) cv: Condvar,
    pub(crate) poll: Duration,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn driver_error(ctx: ErrorContext, what: &str, e: cu::DriverError) -> CommError {
    CommError::Aborted {
        ctx,
        cause: format!("CUDA {what} failed: {e:?}"),
    }
}

impl Shared {
    /// NCCL's last error text for the communicator (empty when unknown).
    pub(crate) fn last_error(&self, comm: usize) -> String {
        let Some(f) = self.nccl.get_last_error else {
            return String::new();
        };
        // SAFETY: `comm` is live (callers hold the launch lock, or are the
        // watchdog, which runs until before the communicator is destroyed).
        let p = unsafe { f(comm as Comm) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: NCCL returns a NUL-terminated string it owns.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }

    /// The sticky error, if any, as this call's `Aborted`.
    pub(crate) fn check(&self, ctx: ErrorContext) -> Result<(), CommError> {
        match &lock(&self.track).poisoned {
            Some(e) => Err(e.to_aborted().with_context(ctx)),
            None => Ok(()),
        }
    }

    /// Records the first failure and fails every waiter.
    pub(crate) fn poison(&self, e: CommError) {
        let mut t = lock(&self.track);
        t.poisoned.get_or_insert(e);
        let first = t.poisoned.clone();
        let queue = std::mem::take(&mut t.queue);
        for w in queue {
            if let (Some(tx), Some(err)) = (w.waiter, &first) {
                let _ = tx.send(Err(err.to_aborted().with_context(w.ctx)));
            }
            // SAFETY: our event; destroying an unfinished event is allowed.
            let _ = unsafe { cu::event::destroy(w.done.raw()) };
            if let Some(g) = w.staging {
                t.staged = t.staged.max(g);
            }
        }
        drop(t);
        self.cv.notify_all();
    }

    /// An event from the pool, or a new one.
    pub(crate) fn event(&self, ctx: ErrorContext) -> Result<Event, CommError> {
        if let Some(e) = lock(&self.track).free_events.pop() {
            return Ok(e);
        }
        cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(|e| Event(e as usize))
            .map_err(|e| driver_error(ctx, "event creation", e))
    }

    /// Returns an event to the pool (it may be re-recorded at once).
    pub(crate) fn recycle(&self, e: Event) {
        lock(&self.track).free_events.push(e);
    }

    /// The call context for the next call; collectives take a sequence
    /// number, point-to-point calls do not.
    pub(crate) fn next_ctx(&self, slot: &mut Slot, op: OpKind, p2p: bool) -> ErrorContext {
        let seq = if p2p { 0 } else { slot.seq };
        if !p2p {
            slot.seq += 1;
        }
        ErrorContext::new(op, self.rank, seq, GroupId::WORLD)
    }

    /// The live communicator, if any.
    pub(crate) fn comm(&self) -> Option<usize> {
        match self.comm.load(std::sync::atomic::Ordering::SeqCst) {
            0 => None,
            c => Some(c),
        }
    }

    /// Aborts the communicator and poisons the backend with `e`. It does
    /// not take the launch lock: a launch may be blocked inside NCCL
    /// (connection setup, a full queue behind a hung kernel), and
    /// `ncclCommAbort` from another thread is how NCCL unblocks it.
    pub(crate) fn abort(&self, e: CommError) {
        let c = self.comm.swap(0, std::sync::atomic::Ordering::SeqCst);
        if c != 0 {
            // SAFETY: the communicator was live and is aborted once (the
            // swap hands it to one caller); abort is allowed with work in
            // flight and from another thread than the one blocked in NCCL.
            unsafe { (self.nccl.comm_abort)(c as Comm) };
        }
        self.poison(e);
    }

    /// Stops the watchdog: it leaves once the queue is empty (or at once,
    /// with `now`).
    pub(crate) fn stop(&self, watchdog: Option<JoinHandle<()>>) {
        lock(&self.track).stop = true;
        self.cv.notify_all();
        if let Some(w) = watchdog {
            let _ = w.join();
        }
        for e in std::mem::take(&mut lock(&self.track).free_events) {
            // SAFETY: pooled events are complete and owned by the pool.
            let _ = unsafe { cu::event::destroy(e.raw()) };
        }
    }
}

/// Starts the watchdog of one communicator.
pub(crate) fn spawn_watchdog(
    shared: Arc<Shared>,
    ctx: Arc<CudaContext>,
) -> Result<JoinHandle<()>, CommError> {
    std::thread::Builder::new()
        .name(format!("consort-nccl-watchdog-{}", shared.rank))
        .spawn(move || {
            let _ = ctx.bind_to_thread();
            watchdog(&shared);
        })
        .map_err(|e| CommError::Aborted {
            ctx: ErrorContext::default(),
            cause: format!("could not start the NCCL watchdog thread: {e}"),
        })
}

/// What one look at the front of the queue found.
enum Front {
    Empty,
    Done(Work),
    Running {
        deadline: Instant,
        ctx: ErrorContext,
        timeout: Duration,
    },
    Failed(CommError),
}

fn front(shared: &Shared) -> Front {
    let mut t = lock(&shared.track);
    let Some(w) = t.queue.front() else {
        return Front::Empty;
    };
    // SAFETY: the event is ours and live until recycled.
    match unsafe { cu::event::query(w.done.raw()) } {
        Ok(()) => {
            let w = t.queue.pop_front().expect("front exists");
            if let Some(g) = w.staging {
                t.staged = t.staged.max(g);
            }
            Front::Done(w)
        }
        Err(e) if e.0 == cusys::cudaError_enum::CUDA_ERROR_NOT_READY => Front::Running {
            deadline: w.deadline,
            ctx: w.ctx,
            timeout: w.timeout,
        },
        Err(e) => Front::Failed(driver_error(w.ctx, "completion query", e)),
    }
}

/// The watchdog loop: completes work in order, and turns an asynchronous
/// NCCL error or a passed deadline into an abort and a sticky error.
fn watchdog(shared: &Shared) {
    loop {
        match front(shared) {
            Front::Done(w) => {
                if let Some(tx) = w.waiter {
                    let _ = tx.send(Ok(()));
                }
                shared.recycle(w.done);
                shared.cv.notify_all();
                continue;
            }
            Front::Failed(e) => shared.abort(e),
            Front::Running {
                deadline,
                ctx,
                timeout,
            } => {
                if let Some(e) = async_error(shared, ctx) {
                    shared.abort(e);
                } else if Instant::now() >= deadline {
                    shared.abort(CommError::Timeout {
                        ctx,
                        after: timeout,
                        waiting_on: Vec::new(),
                    });
                }
            }
            Front::Empty => {}
        }
        let t = lock(&shared.track);
        if t.stop && (t.queue.is_empty() || t.poisoned.is_some()) {
            return;
        }
        let wait = if t.queue.is_empty() {
            Duration::from_millis(100)
        } else {
            shared.poll
        };
        let _ = shared.cv.wait_timeout(t, wait);
    }
}

/// `ncclCommGetAsyncError` as an error, if there is one.
fn async_error(shared: &Shared, ctx: ErrorContext) -> Option<CommError> {
    let comm = shared.comm()?;
    let mut code: c_int = result::SUCCESS;
    // SAFETY: the communicator is live (only this thread aborts it while
    // the watchdog runs, and shutdown stops the watchdog first);
    // ncclCommGetAsyncError may be called while another thread is inside
    // NCCL, as torch's watchdog does.
    let r = unsafe { (shared.nccl.comm_get_async_error)(comm as Comm, &mut code) };
    let code = if r != result::SUCCESS { r } else { code };
    if code == result::SUCCESS || code == result::IN_PROGRESS {
        return None;
    }
    Some(nccl_error(ctx, code, &shared.last_error(comm)))
}
