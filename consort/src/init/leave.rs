//! Leaving a job: every rank's goodbye in the store, and the store's host
//! waiting for them before it stops the server (after a failure, only for
//! a while).

use std::time::Duration;

use consort_comm::store::{Store, StoreError};

use super::{Dist, InitError, rendezvous_store, seconds_var};

/// How long the rank that hosts the store waits for the others' goodbyes
/// after its own failure ([`Dist::shutdown_failed`]), at most.
pub const FAILED_EXIT_WAIT: Duration = Duration::from_secs(60);

impl Dist {
    /// Leaves the job. Every rank announces that it is done; the rank that
    /// hosts the store waits for all of them before stopping the server, so
    /// that no rank loses the store while it still needs it.
    pub async fn shutdown(self) -> Result<(), InitError> {
        self.shutdown_without(&[]).await
    }

    /// [`Dist::shutdown`] after ranks `lost` left the job for good (a
    /// `Ddp` that shrank past them, `DdpError::Shrunk`): nobody waits for
    /// them to leave.
    pub async fn shutdown_without(self, lost: &[usize]) -> Result<(), InitError> {
        let timeout = self.timeout;
        let rank = self.env.rank;
        self.destroy_process_groups(!lost.is_empty()).await;
        self.leave(lost, timeout)
            .await?
            .map_err(|source| InitError::Store { rank, source })
    }

    /// Leaves the job after this rank failed (with the error its caller is
    /// about to report, which this never replaces): as
    /// [`Dist::shutdown_without`], but the rank that hosts the store waits
    /// for the others' goodbyes at most [`FAILED_EXIT_WAIT`], or the op
    /// timeout (`CONSORT_TIMEOUT`) when that is shorter: a failure often
    /// means a peer died, and a dead peer never says goodbye. A rank still
    /// running then loses the store and fails on its own. What goes wrong
    /// here (no goodbye from some ranks, or a store that is gone, its host
    /// having died) is a warning.
    pub async fn shutdown_failed(self, lost: &[usize]) {
        let wait = match seconds_var("CONSORT_TIMEOUT") {
            Ok(Some(t)) => t.min(FAILED_EXIT_WAIT),
            _ => FAILED_EXIT_WAIT,
        }
        .min(self.timeout);
        let rank = self.env.rank;
        self.destroy_process_groups(true).await;
        let why = match self.leave(lost, wait).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => format!("some ranks never said goodbye ({e}); they are probably gone"),
            Err(e) => format!("this rank could not say goodbye ({e}); the store is probably gone"),
        };
        tracing::warn!(rank, "leaving after this rank's failure: {why}");
    }

    /// Destroys the NCCL process groups made by [`Dist::nccl_process_group`]
    /// (torch's `destroy_process_group`): each finishes its work in flight
    /// and is destroyed; after this rank's failure, or once ranks were
    /// lost (`abort`), each is aborted instead, since a finalize would wait
    /// for the dead. The shutdown blocks (up to the op timeout), so it runs
    /// on the blocking pool: the fingerprint check's task, which it waits
    /// for, must keep running even on a current-thread runtime. A healthy
    /// group's failed shutdown is a warning; the job's own result stands.
    async fn destroy_process_groups(&self, abort: bool) {
        #[cfg(feature = "nccl")]
        {
            let held = &self.nccl_groups;
            let groups = std::mem::take(&mut *consort_comm::lock(held));
            for b in groups {
                // A group that failed returns its first error again: its
                // calls reported it already.
                let failed = b.failed().is_some();
                let end = move || if abort { b.abort() } else { b.shutdown() };
                let r = match tokio::task::spawn_blocking(end).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(e) => Err(format!("its shutdown thread failed: {e}")),
                };
                match r {
                    Err(e) if failed => {
                        tracing::debug!(rank = self.env.rank, "a failed NCCL group ended: {e}")
                    }
                    Err(e) => {
                        tracing::warn!(
                            rank = self.env.rank,
                            "an NCCL process group ended with: {e}"
                        )
                    }
                    Ok(()) => {}
                }
            }
        }
        #[cfg(not(feature = "nccl"))]
        let _ = abort;
    }

    /// Says this rank's goodbye (and the lost ranks'), and on the rank that
    /// hosts the store waits up to `wait` for everyone's before stopping
    /// the server. The outer error is setting a goodbye; the inner, the
    /// wait.
    async fn leave(
        self,
        lost: &[usize],
        wait: Duration,
    ) -> Result<Result<(), StoreError>, InitError> {
        let rank = self.env.rank;
        let rdzv = rendezvous_store(&self.store, &self.env);
        let err = |source| InitError::Store { rank, source };
        rdzv.set(&format!("exit/{rank}"), b"1").await.map_err(err)?;
        for r in lost {
            rdzv.set(&format!("exit/{r}"), b"1").await.map_err(err)?;
        }
        let Some(server) = self.server else {
            return Ok(Ok(()));
        };
        let keys: Vec<String> = (0..self.env.world_size)
            .map(|r| format!("exit/{r}"))
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let waited = rdzv.wait(&keys, wait).await;
        drop(rdzv);
        drop(self.store);
        server.shutdown().await;
        Ok(waited)
    }
}
