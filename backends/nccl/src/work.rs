//! Work in flight on one communicator, and the watchdog thread that tracks
//! it (torch's `WorkNCCL` list and its `ncclCommWatchdog`).
//!
//! This module owns the communicator handle and its lifetime: the launch
//! lock that serialises NCCL calls on it, the event pool, and the one
//! thread per communicator that drives the call rules of
//! [`consort_comm::ordered`] (sequence numbers, turns, deadlines, the
//! sticky failure, all shared with the emulated device) on CUDA events and
//! `ncclCommGetAsyncError`, and aborts the communicator when they say so. No thread outlives the communicator: [`Shared::stop`]
//! joins the watchdog before the handle is destroyed.

use std::{
    ffi::c_int,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use consort_comm::{
    CommError, ErrorContext,
    engine::CallId,
    heartbeat::Heartbeat,
    ordered::{
        Ordered,
        check::{Checker, LostPeer},
    },
};
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

/// How long an abort waits for a launch to leave the launch lock.
const ABORT_WAIT: Duration = Duration::from_secs(2);

/// What a host call waits on: the result of its work.
pub(crate) type Waiter = tokio::sync::oneshot::Sender<Result<(), CommError>>;

/// The driver's handle on one enqueued call ([`Ordered`] tracks it).
pub(crate) struct Tracked {
    /// Recorded on the communication stream after the op.
    pub(crate) done: Event,
    pub(crate) waiter: Option<Waiter>,
    /// A host call's staging memory, held until the work completes.
    pub(crate) staging: Option<Arc<crate::staging::Held>>,
    /// The rank a send or receive is with.
    pub(crate) peer: Option<usize>,
}

/// The call rules (the engine, turns, work in flight, the sticky failure)
/// and the event pool, behind the tracking lock.
pub(crate) struct Track {
    pub(crate) core: Ordered<Tracked>,
    pub(crate) stop: bool,
    pub(crate) free_events: Vec<Event>,
    /// The oldest call's completion event while the watchdog queries it
    /// without this lock ([`watchdog`]): a failed call's event is then not
    /// destroyed at once but kept in `doomed`, for the watchdog to destroy
    /// once its query is over.
    querying: Option<Event>,
    doomed: Vec<Event>,
    /// The launcher's heartbeat (`CONSORT_HEARTBEAT_FILE`), if any.
    beat: Option<Arc<Heartbeat>>,
    /// Names the rank behind an `ncclRemoteError` (the side channel's).
    lost: LostPeer,
}

impl Track {
    pub(crate) fn new(core: Ordered<Tracked>, beat: Option<Arc<Heartbeat>>) -> Self {
        Track {
            core,
            stop: false,
            free_events: Vec::new(),
            querying: None,
            doomed: Vec::new(),
            beat,
            lost: LostPeer::default(),
        }
    }

    /// The launcher's heartbeat: a call was made.
    pub(crate) fn made(&self, fp: &consort_comm::Fingerprint) {
        if let Some(b) = &self.beat {
            b.made(fp, consort_comm::heartbeat::now_us());
        }
    }

    /// The launcher's heartbeat: a call ended (done, failed or cancelled).
    pub(crate) fn ended(&self) {
        if let Some(b) = &self.beat {
            b.ended(consort_comm::heartbeat::now_us());
        }
    }

    /// Hands a finished call's outcome to its waiter and its event back to
    /// the pool (a failed call's event may still be pending: destroyed, or,
    /// while the watchdog queries it, once that query is over).
    pub(crate) fn finish(&mut self, w: Tracked, r: Result<(), CommError>) {
        if r.is_ok() {
            if let Some(h) = &w.staging {
                h.completed();
            }
            self.free_events.push(w.done);
        } else if self.querying == Some(w.done) {
            self.doomed.push(w.done);
        } else {
            // SAFETY: our event, queried by no one (`querying`); destroying
            // an unfinished event is allowed.
            let _ = unsafe { cu::event::destroy(w.done.raw()) };
        }
        if let Some(tx) = w.waiter {
            let _ = tx.send(r);
        }
        self.ended();
    }

    /// The watchdog's query of `querying` is over: the events failed
    /// calls left meanwhile are destroyed.
    fn queried(&mut self) {
        self.querying = None;
        for e in self.doomed.drain(..) {
            // SAFETY: a failed call's event, no longer queried by anyone.
            let _ = unsafe { cu::event::destroy(e.raw()) };
        }
    }

    fn finish_all(&mut self, done: Vec<(Tracked, Result<(), CommError>)>) {
        for (w, r) in done {
            self.finish(w, r);
        }
    }
}

/// State shared by the backend and its watchdog.
pub(crate) struct Shared {
    pub(crate) nccl: Arc<Nccl>,
    pub(crate) rank: usize,
    /// The `ncclComm_t`, 0 once destroyed or aborted. It is read and
    /// cleared under the launch lock only: whoever holds the lock may use
    /// the handle, and an abort takes the lock before freeing it.
    pub(crate) comm: std::sync::atomic::AtomicUsize,
    /// The launch lock: the right to make NCCL calls on the communicator
    /// (one thread at a time). The communicator is nonblocking, so no call
    /// holds it inside NCCL for long: an `ncclInProgress` is polled under
    /// it until the call's deadline, or until [`Shared::aborting`] is set.
    pub(crate) slot: Mutex<()>,
    /// Set while an abort waits for the launch lock: a launch polling an
    /// `ncclInProgress` steps aside.
    pub(crate) aborting: std::sync::atomic::AtomicBool,
    pub(crate) track: Mutex<Track>,
    pub(crate) cv: Condvar,
    /// Woken (with `track`) when a call leaves the turn order (enqueued,
    /// failed) or the group fails, while a call waits for its turn
    /// ([`consort_comm::ordered::wait_turn`]).
    pub(crate) turn: Condvar,
    pub(crate) poll: Duration,
    /// The fingerprint check over a host side channel, when one was given.
    pub(crate) checker: std::sync::OnceLock<Checker>,
    /// The thread running this communicator's `ncclCommAbort`, once aborted.
    pub(crate) aborter: Mutex<Option<JoinHandle<()>>>,
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
    /// `comm` is live: callers hold the launch lock, or are the watchdog,
    /// which runs until before the communicator is destroyed.
    pub(crate) fn last_error(&self, comm: usize) -> String {
        last_error(&self.nccl, comm)
    }
    /// Tells the peers, over the fingerprint check's side channel, that
    /// this rank's communicator failed with `e` on its own (a call it
    /// cancelled or could not enqueue): NCCL would leave them waiting on
    /// this rank's part until their deadline ([`Checker::tell`]).
    ///
    /// [`Checker::tell`]: consort_comm::ordered::check::Checker::tell
    pub(crate) fn tell_peers(&self, e: &CommError) {
        if let Some(c) = self.checker.get() {
            c.tell(e.clone());
        }
    }

    /// Ends call `id`, which failed with `e` before it reached the stream
    /// (its launch, its turn or its staging memory): `e` poisons its group
    /// (unless it already failed), the peers are told the group's first
    /// cause (a mismatch, a lost rank or a peer's own told failure they
    /// know already: [`Checker::tell`] leaves those out), and the
    /// communicator is aborted, since peers may have enqueued their part.
    /// Returns the call's error.
    pub(crate) fn failed_before_enqueue(&self, id: CallId, e: CommError) -> CommError {
        let mut t = lock(&self.track);
        let (e, first) = t.core.failed_before_enqueue(id, e);
        t.ended();
        drop(t);
        self.tell_peers(&first);
        self.abort(e.clone());
        e
    }

    /// Fails every call in flight with `e` (the first cause sticks).
    pub(crate) fn poison(&self, e: CommError) {
        let mut t = lock(&self.track);
        let failed = t.core.fail_all(e);
        t.finish_all(failed);
        drop(t);
        self.cv.notify_all();
        self.turn_moved();
    }

    /// Wakes the calls waiting for their turn, if any: a call left the
    /// turn order, or the group failed.
    pub(crate) fn turn_moved(&self) {
        if lock(&self.track).core.turn_awaited() {
            self.turn.notify_all();
        }
    }

    /// The fingerprint check found a mismatch: the calls in flight fail
    /// with it, and the communicator is aborted (a mismatched kernel may
    /// never finish).
    pub(crate) fn mismatch(&self, e: CommError) {
        tracing::debug!(rank = self.rank, cause = %e, "NCCL: the fingerprint check failed the calls");
        let failed = lock(&self.track).core.mismatch(e.clone());
        self.abort(e);
        // The callers hear of it once the abort has begun (a survivors'
        // group made at once waits for it: `aborted_within`).
        lock(&self.track).finish_all(failed);
    }

    /// `e`, a failure an NCCL call returned, with the rank named when it
    /// may be a peer's death that the fingerprint check's side channel saw
    /// (waiting at most the grace, and at most `limit`, the call's time
    /// left: [`LostPeer::name_blocking`]).
    ///
    /// The wait blocks the calling thread: on a multi-threaded tokio
    /// runtime it is moved off the workers (`block_in_place`); on a
    /// current-thread one, whose tasks include the side channel's readers,
    /// it only looks once.
    pub(crate) fn named(&self, e: CommError, limit: Duration) -> CommError {
        use tokio::runtime::{Handle, RuntimeFlavor};
        let CommError::Backend { code, .. } = &e else {
            return e;
        };
        if !crate::map::may_be_lost_peer(*code) {
            return LostPeer::named_now(self.checker.get(), e);
        }
        let checker = self.checker.get();
        match Handle::try_current().map(|h| h.runtime_flavor()) {
            Err(_) => LostPeer::name_blocking(checker, e, limit),
            Ok(RuntimeFlavor::MultiThread) => {
                tokio::task::block_in_place(|| LostPeer::name_blocking(checker, e, limit))
            }
            Ok(_) => LostPeer::name_blocking(checker, e, Duration::ZERO),
        }
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

    /// The live communicator, if any.
    pub(crate) fn comm(&self) -> Option<usize> {
        match self.comm.load(std::sync::atomic::Ordering::SeqCst) {
            0 => None,
            c => Some(c),
        }
    }

    /// Aborts the communicator and poisons the backend with `e`.
    ///
    /// The abort is serialised with every other use of the handle: it asks
    /// a launch in progress to step aside ([`Shared::aborting`]) and takes
    /// the launch lock before `ncclCommAbort` frees the communicator. Only
    /// a launch stuck inside CUDA itself (a kernel launch queue full behind
    /// a hung kernel) can keep the lock; after [`ABORT_WAIT`] the abort
    /// goes ahead under it, since NCCL's abort flag is what unblocks that
    /// launch, and says so in the log.
    pub(crate) fn abort(&self, e: CommError) {
        use std::sync::atomic::Ordering::SeqCst;
        tracing::debug!(rank = self.rank, cause = %e, "NCCL: aborting the communicator");
        // The group has failed: a call waiting for its turn is told now,
        // not once the abort has the launch lock.
        self.turn_moved();
        if self.aborting.swap(true, SeqCst) {
            // Another thread is aborting (ncclCommAbort can take a second
            // while NCCL's threads wind down): this one's calls fail now.
            self.poison(e);
            return;
        }
        let slot = self.slot_within(ABORT_WAIT);
        self.abort_under(slot, e);
        self.aborting.store(false, SeqCst);
    }

    /// [`Shared::abort`] by a thread that holds the launch lock (`slot`;
    /// `None`: it could not be had), which is released before the calls in
    /// flight fail.
    pub(crate) fn abort_under(&self, slot: Option<MutexGuard<'_, ()>>, e: CommError) {
        use std::sync::atomic::Ordering::SeqCst;
        let c = self.comm.swap(0, SeqCst);
        if c != 0 && slot.is_none() {
            tracing::warn!(
                rank = self.rank,
                "an NCCL launch held the launch lock for over {ABORT_WAIT:?}; aborting the \
                 communicator under it"
            );
        }
        // Nobody can reach the handle any more (it was cleared under the
        // lock, and whoever read it before did so under the lock too).
        drop(slot);
        // Started before the calls fail: their callers may make the
        // survivors' group at once, which waits for this abort.
        if c != 0 {
            *lock(&self.aborter) = abort_in_background(&self.nccl, c, self.rank);
        }
        self.poison(e);
    }

    /// Waits, at most `limit`, for this communicator's `ncclCommAbort`
    /// (run in the background) to return: the survivors' new communicator
    /// is made once NCCL has let go of the old one. Whether it returned (or
    /// none ran).
    pub(crate) async fn aborted_within(&self, limit: Duration) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let deadline = consort_comm::time::deadline(limit);
        // An abort under way may not have started its thread yet.
        let t = loop {
            if let Some(t) = lock(&self.aborter).take() {
                break t;
            }
            if !self.aborting.load(SeqCst) || Instant::now() >= deadline {
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
    /// The launch lock, if it comes free within `wait`.
    pub(crate) fn slot_within(&self, wait: Duration) -> Option<MutexGuard<'_, ()>> {
        let deadline = consort_comm::time::deadline(wait);
        loop {
            match self.slot.try_lock() {
                Ok(g) => return Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() >= deadline => {
                    return None;
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        }
    }

    /// Stops the watchdog: it leaves once the queue is empty or the group
    /// has failed, and its pooled events are destroyed.
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

/// How long a communicator's last handle, going, waits for its
/// `ncclCommAbort` still running in the background.
const ABORT_AT_EXIT: Duration = Duration::from_secs(5);

impl Drop for Shared {
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

/// Whether a call's completion event has fired.
fn fired(e: Event) -> Result<bool, CommError> {
    // SAFETY: the event is ours and live: under the tracking lock, or, for
    // the watchdog's unlocked query, kept alive by `Track::querying` (only
    // the watchdog completes calls and recycles their events).
    match unsafe { cu::event::query(e.raw()) } {
        Ok(()) => Ok(true),
        Err(e) if e.0 == cusys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
        Err(e) => Err(driver_error(ErrorContext::default(), "completion query", e)),
    }
}

/// The watchdog loop: the rules of [`Ordered::watch`] on the real device.
/// It completes work in order, and on an asynchronous NCCL error or a
/// passed deadline aborts the communicator; the failure sticks.
///
/// The oldest call's event is queried without the tracking lock:
/// `cuEventQuery` takes the driver's own locks (1.7 µs on an H100), and a
/// call being made takes the tracking lock several times; under the lock,
/// the query made every call that met it wait. After progress the
/// watchdog sleeps its poll interval as always: one pass completes every
/// call that has finished (they finish in stream order), and polling again
/// at once only kept it querying the driver beside the calls being made.
fn watchdog(shared: &Shared) {
    loop {
        let oldest = {
            let mut t = lock(&shared.track);
            let front = t.core.front().map(|(id, w)| (id, w.done));
            t.querying = front.map(|(_, e)| e);
            front
        };
        // The event stays live: a failed call's is kept while `querying`.
        let answer = oldest.map(|(id, e)| (id, fired(e)));
        let mut t = lock(&shared.track);
        t.queried();
        let Track { core, lost, .. } = &mut *t;
        // The answer holds while the same call is the oldest.
        let front = core.front().map(|(id, _)| id);
        let mut first = answer.and_then(|(id, r)| (Some(id) == front).then_some(r));
        let seen = core.watch(
            Instant::now(),
            |w| first.take().unwrap_or_else(|| fired(w.done)),
            |w, ctx, deadline| async_error(shared, (ctx, w.peer, deadline), lost),
        );
        let progressed = !seen.finished.is_empty();
        if seen.abort {
            drop(t);
            let first = lock(&shared.track).core.poisoned().cloned();
            if let Some(e) = first {
                shared.abort(e);
            }
            // The callers hear of it once the abort has begun.
            lock(&shared.track).finish_all(seen.finished);
            continue;
        }
        t.finish_all(seen.finished);
        if progressed {
            // Whoever waits for calls to complete (synchronize, shutdown).
            shared.cv.notify_all();
        }
        if t.stop && (t.core.in_flight() == 0 || t.core.poisoned().is_some()) {
            return;
        }
        let wait = if t.core.in_flight() == 0 {
            Duration::from_millis(100)
        } else {
            shared.poll
        };
        let _ = shared.cv.wait_timeout(t, wait);
    }
}

/// `ncclCommGetAsyncError` as an error, if there is one. Skipped while a
/// launch holds the launch lock (it polls the same state itself). A
/// remote or system error (a peer's socket closed: NCCL names no rank) is
/// named by the fingerprint check's side channel when it can
/// ([`LostPeer`]); with no error, a collective that waits on a rank the
/// side channel lost fails naming it ([`LostPeer::stalled`]).
fn async_error(
    shared: &Shared,
    (ctx, peer, deadline): (ErrorContext, Option<usize>, Instant),
    lost: &mut LostPeer,
) -> Option<CommError> {
    let _slot = shared.slot.try_lock().ok()?;
    let comm = shared.comm()?;
    // The communicator is live and cannot be freed meanwhile: an abort or
    // a shutdown takes the launch lock, held here.
    let code = comm_state(&shared.nccl, comm as Comm);
    if code == result::SUCCESS || code == result::IN_PROGRESS {
        // No error: a collective may still wait on a dead peer (NVLink and
        // shared memory report none).
        return lost.stalled(shared.checker.get(), (ctx, peer), Instant::now());
    }
    let e = nccl_error(ctx, code, &shared.last_error(comm));
    if crate::map::may_be_lost_peer(code) {
        lost.name(shared.checker.get(), e, (Instant::now(), deadline))
    } else {
        Some(LostPeer::named_now(shared.checker.get(), e))
    }
}
