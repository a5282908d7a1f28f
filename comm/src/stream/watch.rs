//! The watchdog: one thread per communicator that completes work in issue
//! order and aborts on an asynchronous error or a passed deadline (torch's
//! `ncclCommWatchdog`), on whatever device the driver drives.

use std::{
    sync::Arc,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{CommError, ErrorContext, Result, ordered::check::LostPeer};

use super::{DeviceComm, Driver, Entry, lock, may_be_lost_peer};

/// How long an idle watchdog sleeps when nothing wakes it.
const IDLE: Duration = Duration::from_millis(100);

/// What one pass of the watchdog came to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Pass {
    /// Look again after at most this long (or when woken).
    Again(Duration),
    /// Stopped: nothing is in flight, or the group has failed.
    Stop,
}

impl<D: DeviceComm> Driver<D> {
    /// Starts the watchdog thread, named `name`. It runs until
    /// [`Driver::stop`].
    pub fn spawn_watchdog(self: &Arc<Self>, name: String) -> Result<JoinHandle<()>> {
        let me = self.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                me.device.watchdog_started();
                me.watchdog();
            })
            .map_err(|e| {
                CommError::aborted(crate::AbortCause::Spawn {
                    what: "the watchdog thread",
                    error: e.to_string(),
                })
            })
    }

    /// Stops the watchdog: it leaves once the queue is empty or the group
    /// has failed.
    pub fn stop(&self, watchdog: Option<JoinHandle<()>>) {
        lock(&self.track).stop = true;
        self.cv.notify_all();
        if let Some(w) = watchdog {
            let _ = w.join();
        }
    }

    /// Wakes the watchdog (a device's work finished on a thread of its
    /// own).
    pub fn wake(&self) {
        self.cv.notify_all();
    }

    fn watchdog(&self) {
        while let Pass::Again(wait) = self.watch_once() {
            // Looked at again under the lock the calls take to be tracked:
            // a call enqueued since the pass (its caller woken by it, say)
            // notified no one, so the wait is the poll interval, not the
            // idle one; and a stop that can end the watchdog is not
            // slept through.
            let t = lock(&self.track);
            let in_flight = t.core.in_flight();
            if t.stop && (in_flight == 0 || t.core.poisoned().is_some()) {
                continue;
            }
            let wait = if in_flight > 0 {
                wait.min(self.opts.poll)
            } else {
                wait
            };
            let _ = self.cv.wait_timeout(t, wait);
        }
    }

    /// One look at the work in flight.
    ///
    /// The oldest call's completion is queried without the tracking lock
    /// (on a GPU `cuEventQuery` takes the driver's own locks, and a call
    /// being made takes the tracking lock several times); a failure that
    /// finishes that call meanwhile waits in `held` until the query is
    /// over. After progress it still waits its poll interval: one pass
    /// completes every call that has finished (they finish in stream
    /// order).
    pub(super) fn watch_once(&self) -> Pass {
        let oldest = {
            let mut t = lock(&self.track);
            let front = t
                .core
                .front()
                .map(|(id, e)| (id, self.device.probe(&e.work)));
            t.querying = front.as_ref().map(|(id, _)| *id);
            front
        };
        let answer = oldest.map(|(id, p)| (id, self.device.fired(&p)));
        let mut t = self.rules();
        t.querying = None;
        let held = std::mem::take(&mut t.held);
        let super::Track { core, lost, .. } = &mut *t;
        // The answer holds while the same call is the oldest.
        let front = core.front().map(|(id, _)| id);
        let mut first = answer.and_then(|(id, r)| (Some(id) == front).then_some(r));
        let now = Instant::now();
        let seen = core.watch(
            now,
            |e| {
                first
                    .take()
                    .unwrap_or_else(|| self.device.fired(&self.device.probe(&e.work)))
            },
            |e, ctx, deadline| self.async_failure(e, (ctx, deadline, now), lost),
        );
        let in_flight = core.in_flight();
        let poll_at = core.poll_timeout();
        let stopping = t.stop && (in_flight == 0 || t.core.poisoned().is_some());
        drop(t);
        let progressed = !seen.finished.is_empty();
        self.finish_all(held);
        if seen.abort {
            if let Some(e) = self.poisoned() {
                self.abort(e);
            }
            // The callers hear of it once the abort has begun.
            self.finish_all(seen.finished);
            return Pass::Again(Duration::ZERO);
        }
        self.finish_all(seen.finished);
        if progressed {
            // Whoever waits for calls to complete (synchronize, shutdown).
            self.cv.notify_all();
        }
        if stopping {
            return Pass::Stop;
        }
        Pass::Again(match (in_flight, poll_at) {
            (0, _) => IDLE,
            (_, Some(at)) => self
                .opts
                .poll
                .min(at.saturating_duration_since(Instant::now())),
            (_, None) => self.opts.poll,
        })
    }

    /// The communicator's failure while `e` (the oldest unfinished call)
    /// waits, named through the side channel when it may be a lost peer;
    /// skipped while a launch holds the launch lock (it polls the same
    /// state itself). With no failure, a call that waits on a rank the
    /// side channel lost fails naming it ([`LostPeer::stalled`]).
    fn async_failure(
        &self,
        e: &Entry<D::Work>,
        (ctx, deadline, now): (ErrorContext, Instant, Instant),
        lost: &mut LostPeer,
    ) -> Option<CommError> {
        let checker = self.checker.get();
        let state = {
            let _slot = self.slot.try_lock().ok()?;
            self.device.async_error(&e.work)?
        };
        match state {
            Ok(()) => lost.stalled(checker, (ctx, e.peer), now),
            Err(err) if may_be_lost_peer(&err) => lost.name(checker, err, (now, deadline)),
            Err(err) => Some(LostPeer::named_now(checker, err)),
        }
    }

    /// The call the watchdog would look at first (for tests).
    #[cfg(all(test, not(loom)))]
    pub(super) fn oldest(&self) -> Option<crate::engine::CallId> {
        lock(&self.track).core.front().map(|(id, _)| id)
    }
}
