//! A call's way to the stream: its turn (every call made before it
//! enqueued first) and the guard that ends it when it never gets there.
//! Every call is made and enqueued within `submit`, so a call waits for its
//! turn (blocking, as a launch waits for the launch lock) only while one
//! made just before it, on another thread, is still being enqueued; when
//! `submit` returns, the call is on the stream or has failed. A call timed
//! out behind an earlier one, or failed before its enqueue, ends with its
//! cause, its communicator is aborted, and its peers are told
//! ([`consort_comm::ordered::check::Checker::tell`]).

use consort_comm::{CommError, Result, engine::CallId};

use super::{Call, NcclBackend};
use crate::work::{Shared, lock};

/// A call made and not yet enqueued: dropped before it is (a panic), it is
/// cancelled (its group is poisoned, since peers may run it), as on every
/// backend.
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
    /// in time, or there was no staging memory): it ends with `e`, which
    /// poisons its group, and the communicator is aborted, since peers may
    /// have enqueued their part. Returns the call's error.
    pub(super) fn failed(mut self, e: CommError) -> CommError {
        self.live = false;
        self.shared.failed_before_enqueue(self.id, e)
    }
}

impl Drop for Unlaunched<'_> {
    fn drop(&mut self) {
        if self.live {
            // Only a panic between the call's make and its enqueue gets
            // here (both happen in `submit`).
            let mut t = lock(&self.shared.track);
            let abort = t.core.cancel(self.id);
            if abort.is_some() {
                t.ended();
            }
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
                None => self.shared.turn_moved(),
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

    /// Blocks until every call made before `call` has been enqueued (or has
    /// failed), at most its timeout; the error names the call it waited
    /// for ([`Ordered::turn_timed_out`]). A call made before it is in
    /// another thread's `submit`, between its make and its enqueue, so
    /// this waits as long as a launch waits for the launch lock. On a
    /// multi-threaded tokio runtime the wait is moved off the worker
    /// (`block_in_place`); on a current-thread one it blocks that thread,
    /// whose other tasks (a side channel's readers) then wait too.
    ///
    /// [`Ordered::turn_timed_out`]: consort_comm::ordered::Ordered::turn_timed_out
    pub(super) fn wait_turn(&self, call: Call) -> Result<()> {
        use tokio::runtime::{Handle, RuntimeFlavor};
        if call.turn || lock(&self.shared.track).core.is_turn(call.made.id) {
            return Ok(());
        }
        match Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(RuntimeFlavor::MultiThread) => {
                tokio::task::block_in_place(|| self.wait_turn_blocking(call))
            }
            _ => self.wait_turn_blocking(call),
        }
    }

    fn wait_turn_blocking(&self, call: Call) -> Result<()> {
        let (sh, id) = (&self.shared, call.made.id);
        consort_comm::ordered::wait_turn(&sh.track, &sh.turn, |t| &mut t.core, id, call.timeout)
    }

    /// Whether call `id`, whose turn has come, may go to the stream: `Err`
    /// (the call has ended with it) when its group failed or the
    /// communicator was shut down since it was made.
    pub(super) fn launchable(sh: &Shared, id: CallId) -> Result<()> {
        let mut t = lock(&sh.track);
        let r = t.core.launchable(id);
        if r.is_err() {
            t.ended();
        }
        r
    }
}
