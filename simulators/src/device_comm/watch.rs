//! One communicator's state beside its calls: the call rules
//! ([`Ordered`]) with each call's gate and reply ([`Tracked`]), the
//! asynchronous error, and the watchdog thread that drives them.

use std::{
    sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock},
    time::{Duration, Instant},
};

use consort_comm::{
    CommError, EventId, Fingerprint, Result,
    engine::CallId,
    ordered::{
        Ordered,
        check::{Checker, LostPeer},
    },
};

use super::job::{Reply, Slot, is_remote_error};
use crate::device::EmulatedDevice;

/// The driver's handle on one enqueued call.
pub(super) struct Tracked {
    pub(super) gate: EventId,
    pub(super) reply: Option<Reply>,
    pub(super) slot: Arc<Mutex<Slot>>,
    /// The rank a send or receive is with.
    pub(super) peer: Option<usize>,
}

/// One communicator's call rules and its asynchronous error.
pub(super) struct State {
    pub(super) core: Ordered<Tracked>,
    /// What the communication thread found (`ncclCommGetAsyncError`).
    pub(super) async_error: Option<CommError>,
    /// Aborted: the communication thread skips its calls.
    pub(super) aborted: bool,
    pub(super) stop: bool,
    /// Names the rank behind the data path's remote error.
    pub(super) lost: LostPeer,
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    pub(super) device: Arc<EmulatedDevice>,
    pub(super) checker: OnceLock<Checker>,
    /// The launcher's heartbeat, as NCCL keeps it.
    pub(super) beat: OnceLock<Arc<consort_comm::heartbeat::Heartbeat>>,
    /// Woken (with `state`) when a call leaves the turn order (enqueued,
    /// failed) or the group fails, while a call waits for its turn.
    pub(super) turn: Condvar,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn finish(&self, w: Tracked, r: Result<()>) {
        self.device.release_event(w.gate);
        if let Some(reply) = w.reply {
            let out = r.map(|()| lock(&w.slot).out.take());
            let _ = reply.send(out);
        }
        self.ended();
    }

    /// The heartbeat: a call was made.
    pub(super) fn made(&self, fp: &Fingerprint) {
        if let Some(b) = self.beat.get() {
            b.made(fp, consort_comm::heartbeat::now_us());
        }
    }

    /// The heartbeat: a call ended (done or failed).
    pub(super) fn ended(&self) {
        if let Some(b) = self.beat.get() {
            b.ended(consort_comm::heartbeat::now_us());
        }
    }

    /// Fails the calls in flight and aborts (the emulated `ncclCommAbort`).
    pub(super) fn abort(&self, finished: Vec<(Tracked, Result<()>)>) {
        self.lock().aborted = true;
        for (w, r) in finished {
            self.finish(w, r);
        }
        self.cv.notify_all();
        self.turn_moved();
    }

    /// Call `id` failed with `e` before it was enqueued, as on NCCL: the
    /// call fails, its peers are told the group's first cause over the
    /// side channel (their part waits on this rank), and the communicator
    /// is aborted (its calls in flight fail). Returns the call's error.
    pub(super) fn failed_before_enqueue(&self, id: CallId, e: CommError) -> CommError {
        let (e, failed, first) = {
            let mut st = self.lock();
            let (e, first) = st.core.failed_before_enqueue(id, e);
            let failed = st.core.fail_all(e.clone());
            (e, failed, first)
        };
        self.ended();
        if let Some(c) = self.checker.get() {
            c.tell(first);
        }
        self.abort(failed);
        e
    }

    /// Call `id` was dropped before it was enqueued (a panic between its
    /// make and its enqueue): cancelled, as on NCCL (its group fails, its
    /// peers are told, the communicator is aborted).
    pub(super) fn cancel(&self, id: CallId) {
        let (abort, failed) = {
            let mut st = self.lock();
            match st.core.cancel(id) {
                Some(e) => {
                    let failed = st.core.fail_all(e.to_aborted());
                    (Some(e), failed)
                }
                None => (None, Vec::new()),
            }
        };
        match abort {
            Some(e) => {
                self.ended();
                if let Some(c) = self.checker.get() {
                    c.tell(e);
                }
                self.abort(failed);
            }
            None => self.turn_moved(),
        }
    }

    /// The fingerprint check found a mismatch.
    pub(super) fn mismatch(&self, e: CommError) {
        let failed = self.lock().core.mismatch(e);
        self.abort(failed);
    }

    /// Wakes the calls waiting for their turn, if any.
    pub(super) fn turn_moved(&self) {
        if self.lock().core.turn_awaited() {
            self.turn.notify_all();
        }
    }

    /// Blocks until call `id`'s turn has come (every call made before it
    /// enqueued, or the group failed), at most `timeout`, as on NCCL; the
    /// error names the call it waited for ([`Ordered::turn_timed_out`]).
    /// On a multi-threaded tokio runtime the wait is moved off the worker.
    pub(super) fn wait_turn(&self, id: CallId, timeout: Duration) -> Result<()> {
        use tokio::runtime::{Handle, RuntimeFlavor};
        if self.lock().core.is_turn(id) {
            return Ok(());
        }
        match Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(RuntimeFlavor::MultiThread) => {
                tokio::task::block_in_place(|| self.wait_turn_blocking(id, timeout))
            }
            _ => self.wait_turn_blocking(id, timeout),
        }
    }

    fn wait_turn_blocking(&self, id: CallId, timeout: Duration) -> Result<()> {
        consort_comm::ordered::wait_turn(&self.state, &self.turn, |st| &mut st.core, id, timeout)
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The watchdog of one communicator: [`Ordered::watch`] on the gates.
pub(super) fn watchdog(shared: &Shared) {
    loop {
        let mut st = shared.lock();
        let State { core, lost, .. } = &mut *st;
        let now = Instant::now();
        let seen = core.watch(
            now,
            |w| match &lock(&w.slot).err {
                // A lost peer, as NCCL reports it: held until the side
                // channel names the rank (NCCL's watchdog does the same),
                // below.
                Some(e) if is_remote_error(e) => Ok(false),
                Some(e) => Err(e.clone()),
                None => Ok(shared.device.event_done(w.gate)),
            },
            |w, ctx, deadline| match lock(&w.slot).err.clone().filter(is_remote_error) {
                Some(held) => lost.name(shared.checker.get(), held, (now, deadline)),
                // No failure yet: a collective may wait on a lost peer.
                None => lost.stalled(shared.checker.get(), (ctx, w.peer), now),
            },
        );
        if st.stop && st.core.in_flight() == 0 && seen.finished.is_empty() {
            return;
        }
        let idle = seen.finished.is_empty() && !seen.abort;
        if idle {
            let wait = st
                .core
                .poll_timeout()
                .map_or(Duration::from_millis(50), |d| {
                    d.saturating_duration_since(Instant::now())
                        .min(Duration::from_micros(200))
                });
            let _ = shared.cv.wait_timeout(st, wait);
            continue;
        }
        drop(st);
        if seen.abort {
            shared.abort(seen.finished);
        } else {
            for (w, r) in seen.finished {
                shared.finish(w, r);
            }
        }
    }
}
