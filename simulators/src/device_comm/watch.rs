//! One communicator's state beside its calls: the call rules
//! ([`Ordered`]) with each call's gate and reply ([`Tracked`]), the
//! asynchronous error, and the watchdog thread that drives them.

use std::{
    sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock},
    time::{Duration, Instant},
};

use consort_comm::{
    CommError, EventId, Fingerprint, Result,
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
    }

    /// The fingerprint check found a mismatch.
    pub(super) fn mismatch(&self, e: CommError) {
        let failed = self.lock().core.mismatch(e);
        self.abort(failed);
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
