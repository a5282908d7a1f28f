//! The always-on mismatch check on NCCL: each collective's fingerprint
//! goes to a [`Checker`] that compares it with the peers' over a host side
//! channel while the kernel runs (`consort_comm::ordered::check`). A
//! mismatch fails the calls in flight with `Mismatch`, on every rank, and
//! aborts the communicator.

use std::sync::{Arc, OnceLock, Weak};

use consort_comm::{
    Backend, CommError, Result,
    ordered::check::{CheckTask, Checker},
    stream::reporter,
};

use super::NcclBackend;
use crate::work::Driver;

/// Where a subgroup's checker reports, once the subgroup exists.
pub(super) type Bind = Arc<OnceLock<Weak<Driver>>>;

/// A checker made for a subgroup before its communicator.
pub(super) type SubChecker = (Checker, CheckTask, Bind);

impl NcclBackend {
    /// Turns on the mismatch check: every collective's fingerprint
    /// `(group, seq, op, dtype, count, root, reduce op)` is compared with
    /// the peers' over `host`, a host backend of the same ranks, numbered
    /// alike, that nothing else uses (`consort::Dist::nccl_process_group`
    /// makes one over TCP). The comparison runs on a task of the current
    /// tokio runtime, off the GPU's critical path: the call itself is not
    /// delayed. Subgroups made afterwards are checked too.
    pub fn check_fingerprints(&self, host: Arc<dyn Backend>) -> Result<()> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            CommError::invalid(
                "check_fingerprints runs its comparisons on the current tokio runtime; call it \
                 from inside one",
            )
        })?;
        if host.rank() != self.rank || host.world_size() != self.world {
            return Err(CommError::invalid(format!(
                "the side channel for the fingerprint check is rank {} of {}, but this NCCL \
                 communicator is rank {} of {}; give it a host group of the same ranks",
                host.rank(),
                host.world_size(),
                self.rank,
                self.world
            )));
        }
        let bind: Bind = Arc::new(OnceLock::new());
        let _ = bind.set(Arc::downgrade(&self.shared));
        let (checker, task) = Checker::new(host, self.opts.timeout, reporter(bind));
        self.shared.set_checker(checker)?;
        handle.spawn(task);
        Ok(())
    }

    /// The checker of the subgroup of `ranks`, made in this checker's order
    /// (every rank of this group calls it); `None` without a check, or on a
    /// rank outside the subgroup.
    pub(super) async fn subgroup_checker(&self, ranks: &[usize]) -> Result<Option<SubChecker>> {
        let Some(parent) = self.shared.checker() else {
            return Ok(None);
        };
        let bind: Bind = Arc::new(OnceLock::new());
        let made = parent.new_group(ranks, reporter(bind.clone())).await?;
        Ok(made.map(|(c, t)| (c, t, bind)))
    }

    /// Starts a subgroup's checker, reporting to this communicator.
    pub(super) fn start_checker(&self, checker: Checker, task: CheckTask, bind: Bind) {
        let _ = bind.set(Arc::downgrade(&self.shared));
        let _ = self.shared.set_checker(checker);
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(task);
        }
    }
}
