//! A call's way to the stream: its turn (every call made before it
//! enqueued first) and the guard that ends it when it never gets there.
//! Calls are enqueued when they are made, so a call waits for its turn only
//! while one made just before it, on another thread, is still being
//! enqueued. A call dropped while it waits, timed out behind an earlier
//! one, or failed before its enqueue ends with its cause, its communicator
//! is aborted, and its peers are told
//! ([`consort_comm::ordered::check::Checker::tell`]).

use std::time::Instant;

use consort_comm::{CommError, Result, engine::CallId};

use super::{Call, NcclBackend};
use crate::work::{Shared, lock};

/// A call made and not yet enqueued: dropped before it is, it is cancelled
/// (its group is poisoned, since peers may run it), as on every backend.
pub(super) struct Unlaunched<'a> {
    shared: &'a Shared,
    id: CallId,
    live: bool,
}

impl Unlaunched<'_> {
    /// The call was enqueued, or failed: nothing to cancel.
    pub(super) fn settled(mut self) {
        self.live = false;
    }

    /// The call failed with `e` before its enqueue (its turn did not come
    /// in time, or there was no staging memory): it ends with `e`, which poisons its
    /// group, and the communicator is aborted, since peers may have
    /// enqueued their part. Returns the call's error.
    pub(super) fn failed(mut self, e: CommError) -> CommError {
        self.live = false;
        self.shared.failed_before_enqueue(self.id, e)
    }
}

impl Drop for Unlaunched<'_> {
    fn drop(&mut self) {
        if self.live {
            let mut t = lock(&self.shared.track);
            let abort = t.core.cancel(self.id);
            t.ended();
            drop(t);
            // The group cannot go on: as after any failure, the
            // communicator goes too (its calls in flight fail with the
            // cause, and the watchdog stops watching nothing). The peers
            // are told the group's first cause (`abort`).
            match abort {
                Some(e) => {
                    self.shared.tell_peers(&e);
                    self.shared.abort(e);
                }
                None => self.shared.turn.notify_waiters(),
            }
        }
    }
}

impl NcclBackend {
    /// The guard that cancels `call` if it is dropped before it is
    /// enqueued.
    pub(super) fn unlaunched(&self, call: Call) -> Unlaunched<'_> {
        Unlaunched {
            shared: &self.shared,
            id: call.made.id,
            live: true,
        }
    }

    /// Waits until every call made before `call` has been enqueued (or has
    /// failed), at most its timeout; the error names the call it waited
    /// for ([`Ordered::turn_timed_out`]).
    ///
    /// [`Ordered::turn_timed_out`]: consort_comm::ordered::Ordered::turn_timed_out
    pub(super) async fn wait_turn(&self, call: Call) -> Result<()> {
        let deadline = consort_comm::time::deadline(call.timeout);
        loop {
            let notified = self.shared.turn.notified();
            if lock(&self.shared.track).core.is_turn(call.made.id) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                let t = lock(&self.shared.track);
                // The turn (or the group's failure) may have come just now.
                if t.core.is_turn(call.made.id) {
                    return Ok(());
                }
                return Err(t.core.turn_timed_out(call.made.id, call.timeout));
            }
        }
    }
}
