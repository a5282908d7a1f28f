//! The call rules of a stream-ordered communicator: NCCL, and the emulated
//! device that stands in for it in tests. Both drive this one module, so
//! the CPU tests of GPU ordering run the rules that run on a GPU.
//!
//! A stream-ordered backend runs no schedules (the library under it runs
//! its own algorithms), but it keeps every call rule of the [`Engine`]:
//! sequence numbers per group fixed when a call is *made*, fingerprints,
//! poisoning with the first cause, cancellation and flight records.
//! [`Ordered`] adds what stream order needs, sans-IO, with time as an
//! argument:
//!
//! - **Turns.** Calls reach the communication stream in the order they
//!   were made. A driver enqueues each call when it is made (a host-buffer
//!   call staged first), so its work may be awaited in any order; a call
//!   made while an earlier one is still being enqueued (on another thread)
//!   waits for it, and so does every call made after it
//!   ([`Ordered::is_turn`]).
//! - **The work queue.** Enqueued calls complete in issue order, as their
//!   completion events fire ([`Ordered::watch`]).
//! - **Deadlines.** [`Ordered::poll_timeout`] says when the driver must
//!   look next. A call past its deadline fails with `Timeout`, and so does
//!   an asynchronous error of the communicator; either way the driver must
//!   abort the communicator, and every call in flight fails.
//! - **The fingerprint check.** The fingerprint cannot ride in a frame
//!   header, so it travels over a host side channel among the same ranks
//!   ([`check`]), compared while the kernel runs. A mismatch fails the
//!   calls in flight with `Mismatch` and poisons the group
//!   ([`Ordered::mismatch`]).
//!
//! # Driving order
//!
//! 1. [`Ordered::make`] when the call is made (its sequence number and
//!    fingerprint are fixed here; send the fingerprint to the checker).
//! 2. When its turn has come ([`Ordered::is_turn`]), under the launch lock:
//!    [`Ordered::launchable`], then the enqueue, then
//!    [`Ordered::enqueued`] with the driver's handle on the work (its
//!    completion event), or [`Ordered::failed_before_enqueue`] (also for
//!    a call whose turn never came: [`Ordered::turn_timed_out`]).
//! 3. A call dropped before it was enqueued (a panic between the two):
//!    [`Ordered::cancel`].
//!    Whatever fails a call before its enqueue, the driver aborts the
//!    communicator and tells the peers the group's first cause
//!    ([`check::Checker::tell`]): their part waits on this rank.
//! 4. The watchdog: [`Ordered::watch`] at [`Ordered::poll_timeout`] or
//!    sooner; when it says so, abort the communicator.
//! 5. The checker's verdict: [`Ordered::mismatch`], then abort.

use std::{
    collections::{BTreeSet, VecDeque},
    time::{Duration, Instant},
};

use crate::{
    AbortCause, CommError, ErrorContext, Fingerprint, GroupId, Result, Shape,
    engine::{CallId, Engine},
};

pub mod check;

/// A call fixed in its rank's order by [`Ordered::make`].
#[derive(Clone, Copy, Debug)]
pub struct Made {
    /// The handle for the other methods.
    pub id: CallId,
    /// The call's identity (send it to the checker).
    pub fp: Fingerprint,
    /// The context every error of this call carries.
    pub ctx: ErrorContext,
}

/// One enqueued call (its deadline is the engine's timer).
#[derive(Debug)]
struct Queued<W> {
    id: CallId,
    ctx: ErrorContext,
    work: W,
}

/// What one look at the work in flight found ([`Ordered::watch`]).
#[derive(Debug)]
pub struct Watched<W> {
    /// Finished work, in issue order, with each call's outcome.
    pub finished: Vec<(W, Result<()>)>,
    /// The communicator failed (an error or a passed deadline): abort it.
    pub abort: bool,
}

impl<W> Default for Watched<W> {
    fn default() -> Self {
        Watched {
            finished: Vec::new(),
            abort: false,
        }
    }
}

/// The state of one stream-ordered communicator (see the module docs).
/// `W` is the driver's handle on enqueued work (its completion event, and
/// whoever waits for it).
#[derive(Debug)]
pub struct Ordered<W> {
    engine: Engine<()>,
    group: GroupId,
    /// Calls made and not yet enqueued (or failed), in the order made.
    unlaunched: BTreeSet<CallId>,
    queue: VecDeque<Queued<W>>,
    /// Set by shutdown: every later call fails with it.
    closed: Option<String>,
    /// Calls blocked waiting for their turn: only then must a driver wake
    /// them ([`Ordered::turn_awaited`]).
    turn_waiters: usize,
}

impl<W> Ordered<W> {
    /// The communicator of `world` ranks that is `group` (its id as every
    /// member computes it); this rank is `rank` in it.
    pub fn new(rank: usize, world: usize, group: GroupId) -> Self {
        Ordered {
            engine: Engine::for_group(group, rank, world),
            group,
            unlaunched: BTreeSet::new(),
            queue: VecDeque::new(),
            closed: None,
            turn_waiters: 0,
        }
    }

    /// The group this communicator serves.
    pub fn group(&self) -> GroupId {
        self.group
    }

    /// The engine (its flight record, its subgroup ids).
    pub fn engine(&self) -> &Engine<()> {
        &self.engine
    }

    /// The engine, mutably (to number subgroups).
    pub fn engine_mut(&mut self) -> &mut Engine<()> {
        &mut self.engine
    }

    /// Makes a call of `shape`: fixes its sequence number and fingerprint
    /// now. Fails fast with the first cause when the group is poisoned or
    /// shut down.
    pub fn make(&mut self, shape: Shape) -> Result<Made> {
        let (group, op) = (self.group, shape.op);
        if let Some(why) = &self.closed {
            let ctx = ErrorContext {
                op: Some(op),
                rank: Some(self.engine.rank()),
                group: Some(group),
                ..Default::default()
            };
            return Err(CommError::Aborted {
                ctx,
                cause: AbortCause::Closed(why.clone()),
            });
        }
        let b = self.engine.begin(group, shape)?;
        self.unlaunched.insert(b.id);
        Ok(Made {
            id: b.id,
            fp: b.fp,
            ctx: b.ctx,
        })
    }

    /// Whether every call made before `id` has been enqueued or has
    /// failed, so `id` may go to the stream. A call whose group has failed,
    /// or whose communicator was shut down, need not wait:
    /// [`Ordered::launchable`] refuses it at once, with the first cause.
    pub fn is_turn(&self, id: CallId) -> bool {
        self.unlaunched.first().is_none_or(|first| *first >= id) || self.refused(id).is_some()
    }

    /// A call began (`true`) or ended (`false`) waiting for its turn.
    pub fn turn_waiter(&mut self, waits: bool) {
        if waits {
            self.turn_waiters += 1;
        } else {
            self.turn_waiters = self.turn_waiters.saturating_sub(1);
        }
    }

    /// Whether a call waits for its turn: a driver then
    /// wakes it when a call leaves the turn order or the group fails (a
    /// condvar notify is a syscall; with no one waiting, it is skipped).
    pub fn turn_awaited(&self) -> bool {
        self.turn_waiters > 0
    }

    /// The error of call `id`, which waited `after` for its turn: a call
    /// made before it on this rank has not reached the stream (its enqueue,
    /// on another thread, is stuck or was dropped unfinished). The driver
    /// fails the call with it as with any failure before the enqueue
    /// ([`Ordered::failed_before_enqueue`]), and aborts the communicator.
    pub fn turn_timed_out(&self, id: CallId, after: Duration) -> CommError {
        let ahead = self
            .unlaunched
            .first()
            .filter(|first| **first < id)
            .and_then(|first| self.engine.context(*first))
            .and_then(|c| c.op.zip(c.seq));
        CommError::Aborted {
            ctx: self.context(id),
            cause: AbortCause::TurnTimedOut { after, ahead },
        }
    }

    /// Whether call `id` may be enqueued now: `Err` (the call has ended
    /// with it) when its group failed or the communicator was shut down
    /// since it was made.
    pub fn launchable(&mut self, id: CallId) -> Result<()> {
        match self.refused(id) {
            Some(e) => {
                self.unlaunched.remove(&id);
                self.engine.end(id, Err(e)).result
            }
            None => Ok(()),
        }
    }

    /// Why call `id` may not go on the stream: its group failed, or the
    /// communicator was shut down (its watchdog may be gone).
    fn refused(&self, id: CallId) -> Option<CommError> {
        match (&self.closed, self.engine.poisoned(self.group)) {
            (_, Some(e)) => Some(self.named_or_aborted(id, e)),
            (Some(why), None) => Some(CommError::aborted(AbortCause::Closed(why.clone()))),
            (None, None) => None,
        }
    }

    /// The error of call `id`, refused because its group failed with `e`:
    /// a mismatch that names this very call (the check can find it before
    /// the call reaches the stream) is the call's own error, as it is for
    /// calls in flight; any other first cause is an earlier failure.
    fn named_or_aborted(&self, id: CallId, e: &CommError) -> CommError {
        match e {
            CommError::Mismatch { local, .. }
                if local.group == self.group && Some(local.seq) == self.context(id).seq =>
            {
                e.clone()
            }
            // An earlier call's abort: its text, this call's context.
            CommError::Aborted { cause, .. } => CommError::Aborted {
                ctx: ErrorContext::default(),
                cause: cause.clone(),
            },
            _ => e.to_aborted(),
        }
    }

    /// Call `id` is on the stream: `work` is tracked until it completes or
    /// `timeout` (from `now`) passes. If its group failed while it was
    /// being enqueued (an abort that did not wait for the launch), or the
    /// communicator was shut down meanwhile, nothing on that communicator
    /// will finish it: the work comes back with the call's error, for the
    /// driver to finish at once.
    #[must_use = "a work handed back must be finished with its error"]
    pub fn enqueued(
        &mut self,
        id: CallId,
        work: W,
        now: Instant,
        timeout: Duration,
    ) -> Option<(W, Result<()>)> {
        self.unlaunched.remove(&id);
        if let Some(e) = self.refused(id) {
            return Some((work, self.engine.end(id, Err(e)).result));
        }
        let ctx = self.context(id);
        self.engine.arm(id, now, timeout, None);
        self.queue.push_back(Queued { id, ctx, work });
        None
    }

    /// The enqueue of call `id` failed with `e`: the call fails, its group
    /// is poisoned, and the driver must abort the communicator (peers may
    /// have enqueued their part). Returns the call's error, with context.
    ///
    /// An enqueue that an abort stopped (`Aborted`, the group already
    /// failed: a mismatch found while the call was being enqueued, say)
    /// fails with that failure, as a refused call does
    /// ([`Ordered::launchable`]): the mismatch itself when it names this
    /// call, else the earlier failure.
    pub fn launch_failed(&mut self, id: CallId, e: CommError) -> CommError {
        let e = match (self.engine.poisoned(self.group), &e) {
            (Some(first), CommError::Aborted { .. }) => {
                let theirs = self.named_or_aborted(id, first);
                tracing::debug!(call = %e, group = %theirs, "an enqueue failed after its group");
                theirs
            }
            _ => e,
        };
        self.unlaunched.remove(&id);
        let out = self.engine.end(id, Err(e)).result;
        out.err().unwrap_or_else(|| {
            CommError::aborted("internal: a failed launch ended without an error")
        })
    }

    /// Call `id` failed with `e` before it reached the stream (its launch,
    /// its turn, its staging memory): [`Ordered::launch_failed`]. Returns
    /// the call's error and the group's first cause: the driver tells its
    /// peers the cause ([`check::Checker::tell`]; their part of the call
    /// waits on this rank), then aborts the communicator.
    pub fn failed_before_enqueue(&mut self, id: CallId, e: CommError) -> (CommError, CommError) {
        let e = self.launch_failed(id, e);
        let first = self.poisoned().cloned().unwrap_or_else(|| e.clone());
        (e, first)
    }

    /// Call `id` was dropped before it was enqueued (a panic between its
    /// make and its enqueue: a driver enqueues every call when it is made,
    /// and a dropped work's call then runs to its end). Its peers
    /// may run it, so the group cannot go on: it is poisoned with an error
    /// that says so (or with the cause the drop gave:
    /// [`crate::cancel::drop_because`]). Returns that error when the call
    /// was still waiting: the driver must then abort the communicator, as
    /// after any failure (peers may have enqueued their part).
    #[must_use = "a cancelled call's communicator must be aborted"]
    pub fn cancel(&mut self, id: CallId) -> Option<CommError> {
        if !self.unlaunched.remove(&id) {
            return None;
        }
        let cause = crate::cancel::cause();
        self.engine.cancel(id, cause);
        self.engine.poisoned(self.group).cloned()
    }

    /// The context of call `id` (empty once it has ended).
    fn context(&self, id: CallId) -> ErrorContext {
        self.engine.context(id).unwrap_or_default()
    }

    /// When the driver must call [`Ordered::watch`] at the latest: the
    /// oldest work's deadline, the engine's timer (`None` with nothing in
    /// flight).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.queue.front().and_then(|q| self.engine.deadline(q.id))
    }

    /// Looks at the work in flight at `now`: `done(work)` says whether a
    /// work's completion event has fired (`Err`: the device failed), and
    /// `failure(work, ctx, deadline)`, asked about the oldest unfinished
    /// work, is the communicator's failure, if any: an asynchronous error,
    /// or one held back until its rank is named ([`check::LostPeer`], which
    /// lets it stand once `deadline` passes). Completes work in issue order;
    /// on a failure or a passed deadline every call in flight fails and
    /// [`Watched::abort`] is set.
    pub fn watch(
        &mut self,
        now: Instant,
        mut done: impl FnMut(&W) -> Result<bool>,
        failure: impl FnOnce(&W, ErrorContext, Instant) -> Option<CommError>,
    ) -> Watched<W> {
        let mut out = Watched::default();
        while let Some(front) = self.queue.front() {
            match done(&front.work) {
                Ok(true) => {
                    let Some(q) = self.queue.pop_front() else {
                        break;
                    };
                    let ended = self.engine.end(q.id, Ok(()));
                    out.finished.push((q.work, ended.result));
                }
                Ok(false) => {
                    let (id, ctx) = (front.id, front.ctx);
                    let deadline = self.engine.deadline(id).unwrap_or(now);
                    // The engine's clock: a call past its deadline fails
                    // with the one `Timeout` the engine builds.
                    let failed = failure(&front.work, ctx, deadline)
                        .or_else(|| (now >= deadline).then(|| self.engine.timed_out(id, &[])));
                    if let Some(e) = failed {
                        out.finished.extend(self.fail_all(e));
                        out.abort = true;
                    }
                    return out;
                }
                Err(e) => {
                    out.finished.extend(self.fail_all(e));
                    out.abort = true;
                    return out;
                }
            }
        }
        out
    }

    /// Fails every call in flight: the oldest with `e` (the first cause,
    /// which poisons the group), the rest as aborted by it.
    pub fn fail_all(&mut self, e: CommError) -> Vec<(W, Result<()>)> {
        let mut out = Vec::with_capacity(self.queue.len());
        let mut first = Some(e.clone());
        for q in std::mem::take(&mut self.queue) {
            let err = first.take().unwrap_or_else(|| e.to_aborted());
            out.push((q.work, self.engine.end(q.id, Err(err)).result));
        }
        if out.is_empty() {
            self.engine.poison(self.group, e);
        }
        out
    }

    /// The fingerprint check found a mismatch: it is the group's first
    /// cause unless it already failed, and every call in flight fails with
    /// it. The driver then aborts the communicator.
    pub fn mismatch(&mut self, e: CommError) -> Vec<(W, Result<()>)> {
        if self.engine.poisoned(self.group).is_some() {
            return Vec::new();
        }
        self.fail_all(e)
    }

    /// The sticky failure, if the group failed.
    pub fn poisoned(&self) -> Option<&CommError> {
        self.engine.poisoned(self.group)
    }

    /// Whether nothing is in flight or waiting for its turn.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.unlaunched.is_empty()
    }

    /// What `synchronize` returns now: `Some(Err)` with the sticky failure,
    /// `Some(Ok)` when every call enqueued has completed, `None` while work
    /// is in flight. (A call still waiting for its turn, in another
    /// thread's `submit`, is not on the stream yet; that thread waits for
    /// it.)
    pub fn synchronized(&self) -> Option<Result<()>> {
        if let Some(e) = self.poisoned() {
            return Some(Err(e.to_aborted()));
        }
        self.queue.is_empty().then_some(Ok(()))
    }

    /// Shuts the communicator down: every later call fails with `why`.
    pub fn close(&mut self, why: impl Into<String>) {
        self.closed.get_or_insert_with(|| why.into());
    }

    /// Work still in flight, oldest first.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }

    /// The oldest call in flight (the next [`Ordered::watch`] asks about
    /// first) and its work: a driver may query its completion without its
    /// lock, then hand [`Ordered::watch`] that answer while the same call
    /// is still the oldest.
    pub fn front(&self) -> Option<(CallId, &W)> {
        self.queue.front().map(|q| (q.id, &q.work))
    }
}

/// The error of a wait (`synchronize`, shutdown) on this rank that ran
/// past `after`.
pub fn wait_timeout(rank: usize, after: Duration) -> CommError {
    CommError::Timeout {
        ctx: ErrorContext {
            rank: Some(rank),
            ..Default::default()
        },
        after,
        waiting_on: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
