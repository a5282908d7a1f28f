//! The stream-ordered driver, written once for every device: NCCL (CUDA
//! events) and the emulated device (its gates) implement only
//! [`DeviceComm`] (is a work finished, the communicator's asynchronous
//! error, abort, hand a finished work back), as NCCL keeps every transport
//! behind one small interface. Everything else lives here: making a call,
//! its turn, the launch lock, tracking, the watchdog, the abort sequence,
//! telling peers, the side-channel check's verdicts, the heartbeat and the
//! flight record. The rules themselves are [`crate::ordered`]'s (sans-IO);
//! this module owns the threads, locks and clock that drive them.
//!
//! # Driving order
//!
//! A call is made and enqueued within the backend's `submit`:
//!
//! 1. [`Driver::make`]: its sequence number and fingerprint are fixed, the
//!    heartbeat and flight record see it, and a collective's fingerprint
//!    goes to the checker. [`Driver::unlaunched`] guards it until it is on
//!    the stream (dropped before, it is cancelled).
//! 2. [`Driver::wait_turn`]: only while a call made just before it, on
//!    another thread, is still being enqueued.
//! 3. [`Driver::launch`]: under the launch lock, the call is refused if its
//!    group failed meanwhile; else the device enqueues it and the work is
//!    tracked (its deadline armed in the engine: the op's timeout from the
//!    enqueue, on every device). A failed enqueue fails the call, tells the
//!    peers the group's first cause and aborts the communicator.
//! 4. The watchdog thread ([`Driver::spawn_watchdog`]) completes work in
//!    issue order, and on an asynchronous error or a passed deadline aborts.
//!
//! The abort sequence ([`Driver::abort`]) is one: wake the calls waiting
//! for their turn; ask a launch in progress to step aside
//! ([`Launch::stop`]); take the launch lock (at most [`ABORT_WAIT`]); let
//! the device abort; release the lock; fail every call in flight with the
//! cause.

use std::{
    sync::{Arc, OnceLock, Weak},
    time::{Duration, Instant},
};

use crate::{
    CommError, GroupId, OpKind, Result, Shape,
    engine::CallId,
    flight::{FlightOut, FlightSource},
    heartbeat::Heartbeat,
    ordered::{
        Made, Ordered,
        check::{CheckTask, Checker, LostPeer, Report},
    },
};

mod sync;
mod watch;

#[cfg(all(test, loom))]
mod model;
#[cfg(all(test, not(loom)))]
mod tests;

use sync::{AtomicBool, Condvar, Mutex, MutexGuard, Ordering, TryLockError, lock};

/// How long an abort waits for a launch to leave the launch lock.
pub const ABORT_WAIT: Duration = Duration::from_secs(2);

/// The device half of one stream-ordered communicator: the few things a
/// device does differently. Everything else is [`Driver`]'s.
pub trait DeviceComm: Send + Sync + 'static {
    /// The device's handle on one enqueued call: its completion event, and
    /// whoever waits for its outcome.
    type Work: Send + 'static;
    /// What the watchdog queries without the tracking lock (a copy of the
    /// completion event's handle); the work, and so the handle, stays live
    /// while it is queried.
    type Probe: Send + 'static;

    /// The handle to query `work`'s completion with.
    fn probe(&self, work: &Self::Work) -> Self::Probe;

    /// Whether the work has finished; `Err`: the device failed it.
    fn fired(&self, probe: &Self::Probe) -> Result<bool>;

    /// The communicator's asynchronous error while `work` (the oldest
    /// unfinished call) waits: `Ok(())` none, `Err` the failure as the
    /// device reports it (a lost peer's may name no rank: the driver names
    /// it through the side channel), `None` when it cannot be looked at now
    /// (the communicator is gone). Called with the launch lock held.
    fn async_error(&self, work: &Self::Work) -> Option<Result<()>>;

    /// Aborts the communicator, once, under the launch lock: whatever must
    /// happen while no launch runs (NCCL clears its handle). `locked`: the
    /// launch lock is held (false when a launch kept it past
    /// [`ABORT_WAIT`]).
    fn abort(&self, locked: bool);

    /// The rest of the abort, once, after the launch lock is released
    /// (NCCL starts `ncclCommAbort` on a thread of its own): the device's
    /// calls in flight end.
    fn aborted(&self) {}

    /// A finished call's outcome: to its waiter, and its handles back.
    /// Never called while the watchdog queries the work.
    fn finish(&self, work: Self::Work, result: Result<()>);

    /// Runs first on the watchdog's thread (a CUDA context bound to it).
    fn watchdog_started(&self) {}
}

/// One enqueued call as the driver tracks it.
#[derive(Debug)]
struct Entry<W> {
    id: CallId,
    /// The rank a send or receive is with.
    peer: Option<usize>,
    work: W,
}

/// A finished call and its outcome, on its way to [`DeviceComm::finish`].
type Done<W> = (Entry<W>, Result<()>);

/// The rules and the watchdog's bookkeeping, behind the tracking lock.
struct Track<W> {
    core: Ordered<Entry<W>>,
    stop: bool,
    /// The call whose work the watchdog queries without this lock: a
    /// failure that finishes it meanwhile is held in `held` until the
    /// query is over.
    querying: Option<CallId>,
    held: Vec<Done<W>>,
    /// Names the rank behind a lost peer's failure (the side channel's).
    lost: LostPeer,
}

/// How a [`Driver`] behaves.
#[derive(Clone, Copy, Debug)]
pub struct DriverOptions {
    /// How often the watchdog looks at work in flight.
    pub poll: Duration,
    /// Fault injection: the enqueue of the call with this sequence number
    /// (on its group; sends and receives all have 0) waits this long
    /// first, on its caller's thread, before it takes the launch lock: a
    /// call stuck between its make and its enqueue. A call made meanwhile
    /// on another thread waits for its turn.
    pub stall_enqueue_at: Option<(u64, Duration)>,
}

impl Default for DriverOptions {
    fn default() -> Self {
        DriverOptions {
            poll: Duration::from_micros(50),
            stall_enqueue_at: None,
        }
    }
}

/// One stream-ordered communicator's driver (see the module docs).
pub struct Driver<D: DeviceComm> {
    device: D,
    rank: usize,
    track: Mutex<Track<D::Work>>,
    /// Wakes the watchdog, and whoever waits for calls to complete.
    cv: Condvar,
    /// Woken when a call leaves the turn order or the group fails, while a
    /// call waits for its turn.
    turn: Condvar,
    /// The launch lock: the right to enqueue on the communicator (one
    /// thread at a time), which an abort takes before the device aborts.
    slot: Mutex<()>,
    /// Set while an abort waits for the launch lock.
    aborting: AtomicBool,
    /// Set once the device was told to abort (it is told once).
    device_aborted: AtomicBool,
    checker: OnceLock<Checker>,
    beat: OnceLock<Arc<Heartbeat>>,
    /// Where the flight record goes, when it is kept.
    flight: OnceLock<Arc<FlightOut>>,
    opts: DriverOptions,
}

impl<D: DeviceComm> std::fmt::Debug for Driver<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").field("rank", &self.rank).finish()
    }
}

/// A call made on a [`Driver`]: its place in the order and its timeout.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// Its sequence number, fingerprint and error context.
    pub made: Made,
    /// Its deadline, from when it is enqueued.
    pub timeout: Duration,
    /// The rank a send or receive is with (named if it is lost).
    pub peer: Option<usize>,
    /// Whether its turn had come when it was made.
    turn: bool,
}

/// What a device's enqueue gets: the call's deadline, and whether an abort
/// asks it to step aside.
#[derive(Debug)]
pub struct Launch<'a> {
    /// The call.
    pub call: &'a Call,
    /// When the call's timeout passes.
    pub deadline: Instant,
    aborting: &'a AtomicBool,
}

impl Launch<'_> {
    /// Whether an abort waits for the launch lock: a launch polling the
    /// device steps aside (fails the call; the abort follows).
    pub fn stop(&self) -> bool {
        self.aborting.load(Ordering::SeqCst)
    }
}

impl<D: DeviceComm> Driver<D> {
    /// The driver of `device`, the communicator of `world` ranks that is
    /// `group`; this rank is `rank` in it.
    pub fn new(
        device: D,
        (rank, world): (usize, usize),
        group: GroupId,
        opts: DriverOptions,
    ) -> Self {
        Driver {
            device,
            rank,
            track: Mutex::new(Track {
                core: Ordered::new(rank, world, group),
                stop: false,
                querying: None,
                held: Vec::new(),
                lost: LostPeer::default(),
            }),
            cv: Condvar::new(),
            turn: Condvar::new(),
            slot: Mutex::new(()),
            aborting: AtomicBool::new(false),
            device_aborted: AtomicBool::new(false),
            checker: OnceLock::new(),
            beat: OnceLock::new(),
            flight: OnceLock::new(),
            opts,
        }
    }

    /// The device half.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// This rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Shows this communicator's calls in the launcher's heartbeat.
    pub fn set_heartbeat(&self, beat: Arc<Heartbeat>) {
        let _ = self.beat.set(beat);
    }

    /// Keeps this communicator's flight record for `out`: every call is
    /// stamped with the wall clock, and the record is written when the
    /// communicator aborts (a failure of its own or a peer's, or a
    /// shutdown's abort) and on request
    /// ([`crate::flight::dump_flight_records`], SIGUSR1). A subgroup's
    /// driver takes its parent's `out`: one file per rank.
    pub fn set_flight(self: &Arc<Self>, out: Arc<FlightOut>) {
        if self.flight.set(out.clone()).is_ok() {
            let weak: Weak<dyn FlightSource> = Arc::downgrade(self) as Weak<dyn FlightSource>;
            crate::flight::register(weak, &out);
        }
    }

    /// Where this communicator's flight record goes, if it is kept.
    pub fn flight(&self) -> Option<&Arc<FlightOut>> {
        self.flight.get()
    }

    /// The tracking lock, with the flight recorder's clock set to now when
    /// a record is kept (every change of a call's state happens under it).
    fn rules(&self) -> MutexGuard<'_, Track<D::Work>> {
        let mut t = lock(&self.track);
        if self.flight.get().is_some() {
            t.core
                .engine_mut()
                .flight_mut()
                .set_now_us(crate::flight::now_us());
        }
        t
    }

    /// Turns on the fingerprint check: `checker`'s verdicts must reach
    /// [`Driver::mismatch`] ([`reporter`]).
    pub fn set_checker(&self, checker: Checker) -> Result<()> {
        self.checker
            .set(checker)
            .map_err(|_| CommError::invalid("this communicator already checks its fingerprints"))
    }

    /// The fingerprint check, when one runs.
    pub fn checker(&self) -> Option<&Checker> {
        self.checker.get()
    }

    /// The ranks the side channel has seen go (none without a check).
    pub fn lost_peers(&self) -> Vec<(usize, String)> {
        Checker::lost_peers_of(self.checker.get())
    }

    /// `f` on the engine, under the tracking lock (subgroup numbering, the
    /// flight record).
    pub fn with_engine<T>(&self, f: impl FnOnce(&mut crate::engine::Engine<()>) -> T) -> T {
        f(lock(&self.track).core.engine_mut())
    }

    /// The group this communicator serves.
    pub fn group(&self) -> GroupId {
        lock(&self.track).core.group()
    }

    /// The group's sticky failure, if it failed.
    pub fn poisoned(&self) -> Option<CommError> {
        lock(&self.track).core.poisoned().cloned()
    }

    /// Work on the stream, not yet finished.
    pub fn in_flight(&self) -> usize {
        lock(&self.track).core.in_flight()
    }

    /// What `synchronize` returns now (`None`: work is in flight).
    pub fn synchronized(&self) -> Option<Result<()>> {
        lock(&self.track).core.synchronized()
    }

    /// Shuts the communicator down: every later call fails with `why`.
    pub fn close(&self, why: &str) {
        lock(&self.track).core.close(why);
        self.turn_moved();
    }

    /// Makes a call of `shape` (its fingerprint is fixed here, with its
    /// group and sequence number), whose deadline is `timeout` from its
    /// enqueue.
    pub fn make(&self, shape: Shape, timeout: Duration, peer: Option<usize>) -> Result<Call> {
        let (made, turn) = {
            let mut t = self.rules();
            let made = t.core.make(shape)?;
            (made, t.core.is_turn(made.id))
        };
        if let Some(b) = self.beat.get() {
            b.made(&made.fp, crate::heartbeat::now_us());
        }
        if !matches!(shape.op, OpKind::Send | OpKind::Recv)
            && let Some(c) = self.checker.get()
        {
            c.check(made.fp);
        }
        Ok(Call {
            made,
            timeout,
            peer,
            turn,
        })
    }

    /// The guard that cancels `call` if it is dropped before it reaches
    /// the stream.
    pub fn unlaunched(&self, call: &Call) -> Unlaunched<'_, D> {
        Unlaunched {
            driver: self,
            id: call.made.id,
            live: true,
        }
    }

    /// Blocks until every call made before `call` has been enqueued (or
    /// has failed), at most its timeout; the error names the call it
    /// waited for. On a multi-threaded tokio runtime the wait is moved off
    /// the worker; on a current-thread one it blocks that thread.
    pub fn wait_turn(&self, call: &Call) -> Result<()> {
        if call.turn || lock(&self.track).core.is_turn(call.made.id) {
            return Ok(());
        }
        off_the_runtime(|| self.wait_turn_blocking(call.made.id, call.timeout))
    }

    fn wait_turn_blocking(&self, id: CallId, timeout: Duration) -> Result<()> {
        let deadline = crate::time::deadline(timeout);
        let mut t = lock(&self.track);
        loop {
            if t.core.is_turn(id) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(t.core.turn_timed_out(id, timeout));
            }
            t.core.turn_waiter(true);
            // Woken by the driver; the short bound is a backstop.
            t = match self.turn.wait_timeout(t, left.min(TURN_LOOK)) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
            t.core.turn_waiter(false);
        }
    }

    /// Whether call `id`, whose turn has come, may go to the stream: `Err`
    /// (the call has ended with it) when its group failed or the
    /// communicator was shut down since it was made.
    pub fn launchable(&self, id: CallId) -> Result<()> {
        let r = self.rules().core.launchable(id);
        if r.is_err() {
            self.ended();
        }
        r
    }

    /// Enqueues `call` (its turn has come) under the launch lock:
    /// `enqueue` is the device's part, and its work is tracked until it
    /// completes. Every failure fails the call, poisons the group and
    /// aborts the communicator: peers may have enqueued their part.
    pub fn launch(
        &self,
        call: &Call,
        enqueue: impl FnOnce(&Launch<'_>) -> Result<D::Work>,
    ) -> Result<()> {
        if let Some((seq, d)) = self.opts.stall_enqueue_at
            && seq == call.made.fp.seq
        {
            std::thread::sleep(d);
        }
        let slot = lock(&self.slot);
        let id = call.made.id;
        if let Err(e) = self.launchable(id) {
            drop(slot);
            self.turn_moved();
            return Err(e);
        }
        let launch = Launch {
            call,
            deadline: crate::time::deadline(call.timeout),
            aborting: &self.aborting,
        };
        match enqueue(&launch) {
            Ok(work) => self.track(call, work, slot),
            Err(e) => {
                drop(slot);
                let e = self.named(e, call.timeout);
                Err(self.failed_before_enqueue(id, e))
            }
        }
    }

    /// Hands an enqueued call's work to the watchdog, then lets the launch
    /// lock go and wakes whoever must hear of it.
    fn track(&self, call: &Call, work: D::Work, slot: MutexGuard<'_, ()>) -> Result<()> {
        let entry = Entry {
            id: call.made.id,
            peer: call.peer,
            work,
        };
        // Tracked before the launch lock goes: an abort, which takes that
        // lock, finds the call in flight and fails it. (One that could not
        // wait for the lock has poisoned the group: the call comes back.)
        let (was_idle, late, waiters) = {
            let mut t = self.rules();
            let idle = t.core.in_flight() == 0;
            let late = t
                .core
                .enqueued(entry.id, entry, Instant::now(), call.timeout);
            (idle, late, t.core.turn_awaited())
        };
        drop(slot);
        if let Some((w, r)) = late {
            let e = r.clone().err();
            self.finish_all(vec![(w, r)]);
            self.turn_moved();
            return e.map_or(Ok(()), Err);
        }
        // The watchdog polls while calls are in flight and sleeps long only
        // when none is: only the first call after a lull has to wake it
        // (a condvar notify is a syscall, on the host path of every call).
        if was_idle {
            self.cv.notify_all();
        }
        if waiters {
            self.turn.notify_all();
        }
        Ok(())
    }

    /// Ends call `id`, which failed with `e` before it reached the stream
    /// (its launch, its turn, its staging memory): `e` poisons its group
    /// (unless it already failed), the peers are told the group's first
    /// cause, and the communicator is aborted, since peers may have
    /// enqueued their part. Returns the call's error.
    pub fn failed_before_enqueue(&self, id: CallId, e: CommError) -> CommError {
        let (e, first) = self.rules().core.failed_before_enqueue(id, e);
        self.ended();
        self.tell_peers(&first);
        self.abort(e.clone());
        e
    }

    /// Tells the peers, over the side channel, that this rank's
    /// communicator failed with `e` on its own: the device would leave
    /// them waiting on this rank's part until their deadline.
    fn tell_peers(&self, e: &CommError) {
        if let Some(c) = self.checker.get() {
            c.tell(e.clone());
        }
    }

    /// Fails every call in flight with `e` (the first cause sticks).
    pub fn poison(&self, e: CommError) {
        self.fail_in_flight(e, None);
    }

    /// Fails every call in flight with `e`, writes this rank's flight
    /// record when `dump` says so (`Some(force)`: see
    /// [`crate::flight::dump`]) before their callers hear of it, and wakes
    /// whoever waits on the group.
    fn fail_in_flight(&self, e: CommError, dump: Option<bool>) {
        let reason = dump.map(|_| e.to_string());
        let failed = self.rules().core.fail_all(e);
        if let (Some(force), Some(reason), Some(out)) = (dump, reason, self.flight.get()) {
            crate::flight::dump(out, &reason, force);
        }
        self.finish_all(failed);
        self.cv.notify_all();
        self.turn_moved();
    }

    /// Wakes the calls waiting for their turn, if any.
    pub fn turn_moved(&self) {
        if lock(&self.track).core.turn_awaited() {
            self.turn.notify_all();
        }
    }

    /// The fingerprint check found a mismatch: the calls in flight fail
    /// with it, and the communicator is aborted (a mismatched kernel may
    /// never finish). The callers hear of it once the abort has begun.
    pub fn mismatch(&self, e: CommError) {
        tracing::debug!(rank = self.rank, cause = %e, "the fingerprint check failed the calls");
        let failed = self.rules().core.mismatch(e.clone());
        self.abort(e);
        self.finish_all(failed);
    }

    /// Aborts the communicator and poisons the group with `e`; see the
    /// module docs for the order. Only a launch stuck inside the device
    /// itself keeps the launch lock past [`ABORT_WAIT`]; the abort then
    /// goes ahead under it (the device's abort is what unblocks it).
    pub fn abort(&self, e: CommError) {
        tracing::debug!(rank = self.rank, cause = %e, "aborting the communicator");
        // The group has failed: a call waiting for its turn is told now,
        // not once the abort has the launch lock.
        self.turn_moved();
        if self.aborting.swap(true, Ordering::SeqCst) {
            // Another thread is aborting: this one's calls fail now.
            self.poison(e);
            return;
        }
        let slot = self.slot_within(ABORT_WAIT);
        self.abort_under(slot, e);
        self.aborting.store(false, Ordering::SeqCst);
    }

    /// [`Driver::abort`] by a thread that holds the launch lock (`slot`;
    /// `None`: it could not be had), released before the device's
    /// after-abort step and before the calls fail. This rank's flight
    /// record is written once the calls in flight have failed, before
    /// their callers hear of it (only the first abort's replaces a record
    /// written before).
    pub fn abort_under(&self, slot: Option<MutexGuard<'_, ()>>, e: CommError) {
        let first = !self.device_aborted.swap(true, Ordering::SeqCst);
        if first {
            self.device.abort(slot.is_some());
        }
        drop(slot);
        if first {
            self.device.aborted();
        }
        self.fail_in_flight(e, Some(first));
    }

    /// The launch lock: the right to use the communicator's handle.
    pub fn slot(&self) -> MutexGuard<'_, ()> {
        lock(&self.slot)
    }

    /// The launch lock, if it comes free within `wait`.
    pub fn slot_within(&self, wait: Duration) -> Option<MutexGuard<'_, ()>> {
        let deadline = crate::time::deadline(wait);
        loop {
            match self.slot.try_lock() {
                Ok(g) => return Some(g),
                Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
                Err(TryLockError::WouldBlock) if Instant::now() >= deadline => return None,
                Err(TryLockError::WouldBlock) => sync_sleep(Duration::from_micros(100)),
            }
        }
    }

    /// Whether an abort waits for the launch lock (a device call polling
    /// under it steps aside).
    pub fn aborting(&self) -> bool {
        self.aborting.load(Ordering::SeqCst)
    }

    /// `e`, a failure the device returned, with the rank named when it may
    /// be a peer's death that the side channel saw (waiting at most the
    /// grace, and at most `limit`). On a multi-threaded tokio runtime the
    /// wait moves off the workers; on a current-thread one, whose tasks
    /// include the side channel's readers, it only looks once.
    pub fn named(&self, e: CommError, limit: Duration) -> CommError {
        let checker = self.checker.get();
        let CommError::Backend { code, .. } = &e else {
            return e;
        };
        if !crate::ordered::check::may_be_lost_peer(*code) {
            return LostPeer::named_now(checker, e);
        }
        match runtime() {
            Runtime::CurrentThread => LostPeer::name_blocking(checker, e, Duration::ZERO),
            _ => off_the_runtime(|| LostPeer::name_blocking(checker, e, limit)),
        }
    }

    /// Waits, at most `limit`, until nothing is in flight or the group has
    /// failed, then closes the communicator with `why` (shutdown). Past
    /// `limit` it aborts with a timeout. Whether it drained.
    pub fn drain_and_close(&self, limit: Duration, why: &str) -> bool {
        let deadline = crate::time::deadline(limit);
        let mut t = lock(&self.track);
        let drained = loop {
            if t.core.in_flight() == 0 || t.core.poisoned().is_some() {
                t.core.close(why);
                drop(t);
                break true;
            }
            if Instant::now() >= deadline {
                drop(t);
                self.abort(crate::ordered::wait_timeout(self.rank, limit));
                break false;
            }
            t = match self.cv.wait_timeout(t, Duration::from_millis(1)) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        self.turn_moved();
        drained
    }

    /// Waits (asynchronously) for every call enqueued to complete, at most
    /// `timeout`: `synchronize`.
    pub async fn synchronize(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(r) = self.synchronized() {
                return r;
            }
            if start.elapsed() >= timeout {
                return Err(crate::ordered::wait_timeout(self.rank, timeout));
            }
            futures_timer::Delay::new(Duration::from_micros(50)).await;
        }
    }

    /// The heartbeat: a call ended (done, failed or cancelled).
    fn ended(&self) {
        if let Some(b) = self.beat.get() {
            b.ended(crate::heartbeat::now_us());
        }
    }

    /// Hands finished calls to the device; one the watchdog is querying
    /// waits until its query is over.
    fn finish_all(&self, done: Vec<Done<D::Work>>) {
        if done.is_empty() {
            return;
        }
        let now: Vec<_> = {
            let mut t = lock(&self.track);
            let q = t.querying;
            let (held, now): (Vec<_>, Vec<_>) =
                done.into_iter().partition(|(e, _)| Some(e.id) == q);
            t.held.extend(held);
            now
        };
        for (e, r) in now {
            self.device.finish(e.work, r);
            self.ended();
        }
    }
}

impl<D: DeviceComm> FlightSource for Driver<D> {
    fn flight_entries(&self) -> Vec<crate::flight::Entry> {
        self.rules().core.engine().flight().entries().collect()
    }
}

/// A call made and not yet enqueued: dropped before it is (a panic between
/// its make and its enqueue, both in `submit`), it is cancelled: its group
/// is poisoned (peers may run it), its peers are told, and the
/// communicator is aborted.
pub struct Unlaunched<'a, D: DeviceComm> {
    driver: &'a Driver<D>,
    id: CallId,
    live: bool,
}

impl<D: DeviceComm> std::fmt::Debug for Unlaunched<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unlaunched").field("id", &self.id).finish()
    }
}

impl<D: DeviceComm> Unlaunched<'_, D> {
    /// The call was enqueued, or failed: nothing to cancel.
    pub fn settled(mut self) {
        self.live = false;
    }

    /// The call failed with `e` before its enqueue
    /// ([`Driver::failed_before_enqueue`]). Returns the call's error.
    pub fn failed(mut self, e: CommError) -> CommError {
        self.live = false;
        self.driver.failed_before_enqueue(self.id, e)
    }
}

impl<D: DeviceComm> Drop for Unlaunched<'_, D> {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        let d = self.driver;
        let abort = d.rules().core.cancel(self.id);
        match abort {
            Some(e) => {
                d.ended();
                d.tell_peers(&e);
                d.abort(e);
            }
            None => d.turn_moved(),
        }
    }
}

/// The reporter of a [`Checker`] for the driver `bind` will hold: its
/// verdicts go to [`Driver::mismatch`].
pub fn reporter<D: DeviceComm>(bind: Arc<OnceLock<Weak<Driver<D>>>>) -> Report {
    Arc::new(move |e: CommError| {
        if let Some(d) = bind.get().and_then(Weak::upgrade) {
            d.mismatch(e);
        }
    })
}

/// A checker made for a subgroup before its driver, and where its verdicts
/// go once the driver exists.
pub type SubChecker<D> = (Checker, CheckTask, Arc<OnceLock<Weak<Driver<D>>>>);

/// Whether `e` may be a peer's death that the device reports without its
/// rank (NCCL's remote and system errors).
fn may_be_lost_peer(e: &CommError) -> bool {
    matches!(e, CommError::Backend { code, .. } if crate::ordered::check::may_be_lost_peer(*code))
}

/// How often a call waiting for its turn looks again, woken or not.
const TURN_LOOK: Duration = Duration::from_millis(10);

#[cfg_attr(loom, allow(dead_code))]
enum Runtime {
    None,
    CurrentThread,
    MultiThread,
}

fn runtime() -> Runtime {
    #[cfg(not(loom))]
    {
        use tokio::runtime::{Handle, RuntimeFlavor};
        match Handle::try_current().map(|h| h.runtime_flavor()) {
            Err(_) => Runtime::None,
            Ok(RuntimeFlavor::MultiThread) => Runtime::MultiThread,
            Ok(_) => Runtime::CurrentThread,
        }
    }
    #[cfg(loom)]
    Runtime::None
}

/// `f`, which blocks, moved off a multi-threaded tokio runtime's worker
/// when called on one.
fn off_the_runtime<T>(f: impl FnOnce() -> T) -> T {
    match runtime() {
        #[cfg(not(loom))]
        Runtime::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// A short sleep (a yield under loom, which models no time).
fn sync_sleep(d: Duration) {
    #[cfg(not(loom))]
    std::thread::sleep(d);
    #[cfg(loom)]
    {
        let _ = d;
        loom::thread::yield_now();
    }
}
