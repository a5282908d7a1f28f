//! A communicator's birth and end, each with a deadline: init
//! (`ncclCommInitRankConfig`, nonblocking, polled and aborted when its
//! deadline passes), and [`NcclBackend::shutdown`] and
//! [`NcclBackend::abort`] (finalize polled, then destroy, or abort when it
//! does not finish in time). No thread is left behind in NCCL: a rank
//! whose peer never arrives gets an error within its timeout and can exit.

use std::{
    ffi::c_int,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use consort_comm::{CommError, ErrorContext, Result};
use cudarc::driver::CudaContext;

use super::{NcclBackend, launch::settle};
use crate::{
    cuda::driver_error,
    keys::UNIQUE_ID_BYTES,
    map::nccl_error,
    sys::{self, Comm, Config, Nccl, result},
    work::{Cuda, abort_in_background, comm_state, last_error},
};

/// How often an init or a split in progress is looked at.
const POLL: Duration = Duration::from_millis(1);

/// Joins the communicator of `world` ranks with unique id `id` as `rank`,
/// within `opts.timeout`. On NCCL 2.14+ the communicator is nonblocking:
/// the init runs on NCCL's own thread, polled here, and is aborted when the
/// deadline passes (a peer that never arrives). A blocking communicator
/// (`opts.blocking`, or NCCL before 2.14) inits on a thread of its own
/// that is left behind on a timeout (it cannot hold the process open).
pub(super) async fn init_comm(
    nccl: &Arc<Nccl>,
    ctx: &Arc<CudaContext>,
    ctx0: ErrorContext,
    id: [u8; UNIQUE_ID_BYTES],
    (rank, world): (usize, usize),
    opts: &super::NcclOptions,
) -> Result<usize> {
    let timeout = opts.timeout;
    let deadline = consort_comm::time::deadline(timeout);
    let id = sys::UniqueId {
        internal: id.map(|b| b as std::ffi::c_char),
    };
    let (n, r) = (world as c_int, rank as c_int);
    let init = match nccl.comm_init_rank_config {
        Some(init) if !opts.blocking => init,
        _ => return init_blocking(nccl, ctx, ctx0, id, (rank, world), timeout).await,
    };
    ctx.bind_to_thread()
        .map_err(|e| driver_error(ctx0, "context binding", e))?;
    let (comm, res) = {
        let mut comm: Comm = std::ptr::null_mut();
        let mut config = Config::new(false);
        // SAFETY: `comm` and `config` are valid pointers for the call; the
        // id came from the group's first rank; the config is NCCL's layout.
        let res = unsafe { init(&mut comm, n, id, r, &mut config) };
        (comm as usize, res)
    };
    if comm == 0 {
        return Err(nccl_error(ctx0, res, "ncclCommInitRankConfig"));
    }
    match res {
        result::SUCCESS | result::IN_PROGRESS => {}
        failed => {
            return Err(abort_failed(
                nccl,
                comm,
                ctx0,
                failed,
                "ncclCommInitRankConfig",
            ));
        }
    }
    ready(
        nccl,
        comm,
        ctx0,
        deadline,
        timeout,
        "ncclCommInitRankConfig",
    )
    .await?;
    Ok(comm)
}

/// Waits until a nonblocking communicator that is being made (init or
/// split) is ready; aborts it when it fails or `deadline` passes.
async fn ready(
    nccl: &Arc<Nccl>,
    comm: usize,
    ctx0: ErrorContext,
    deadline: Instant,
    timeout: Duration,
    what: &str,
) -> Result<()> {
    loop {
        // `comm` is ours, made by the caller and not yet handed out.
        match comm_state(nccl, comm as Comm) {
            result::SUCCESS => return Ok(()),
            result::IN_PROGRESS if Instant::now() < deadline => tokio::time::sleep(POLL).await,
            result::IN_PROGRESS => {
                // Ours, never handed out; aborting a communicator still
                // being made is how NCCL ends a nonblocking init.
                let _ = abort_in_background(nccl, comm, ctx0.rank.unwrap_or(0));
                return Err(init_timeout(ctx0, timeout, what));
            }
            failed => return Err(abort_failed(nccl, comm, ctx0, failed, what)),
        }
    }
}

/// The error of an init or split that did not finish within `timeout`.
pub(super) fn init_timeout(ctx: ErrorContext, timeout: Duration, what: &str) -> CommError {
    CommError::Backend {
        ctx,
        backend: "NCCL",
        code: result::TIMEOUT,
        detail: format!(
            "{what} did not finish within {timeout:?}: a rank of the group never joined (it \
             failed, is stopped, or is still before its init). The communicator was aborted; \
             check that every rank starts and reaches the same NCCL init, or raise the timeout \
             (CONSORT_TIMEOUT, NcclOptions::timeout)"
        ),
    }
}

/// Aborts a communicator being made whose init failed with `code`.
fn abort_failed(
    nccl: &Arc<Nccl>,
    comm: usize,
    ctx: ErrorContext,
    code: c_int,
    what: &str,
) -> CommError {
    let detail = last_error(nccl, comm);
    // Ours, never handed out; abort frees it.
    let _ = abort_in_background(nccl, comm, ctx.rank.unwrap_or(0));
    let e = nccl_error(ctx, code, &detail);
    match e {
        CommError::Backend {
            ctx,
            backend,
            code,
            detail,
        } => CommError::Backend {
            ctx,
            backend,
            code,
            detail: format!("{what}: {detail}"),
        },
        other => other,
    }
}

/// `ncclCommInitRank` (a blocking communicator) on a thread of its own, awaited within `timeout`. On a timeout that
/// thread stays blocked in NCCL; it is a plain thread, not the async
/// runtime's, so it does not keep the process from exiting.
async fn init_blocking(
    nccl: &Arc<Nccl>,
    ctx: &Arc<CudaContext>,
    ctx0: ErrorContext,
    id: sys::UniqueId,
    (rank, world): (usize, usize),
    timeout: Duration,
) -> Result<usize> {
    let (nccl, cctx) = (nccl.clone(), ctx.clone());
    let (n, r) = (world as c_int, rank as c_int);
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("consort-nccl-init-{rank}"))
        .spawn(move || {
            let out = cctx
                .bind_to_thread()
                .map_err(|e| driver_error(ctx0, "context binding", e))
                .and_then(|()| {
                    let mut comm: Comm = std::ptr::null_mut();
                    // SAFETY: `comm` is a valid out-pointer; the id came
                    // from the group's first rank.
                    let res = unsafe { (nccl.comm_init_rank)(&mut comm, n, id, r) };
                    if res == result::SUCCESS {
                        Ok(comm as usize)
                    } else {
                        Err(nccl_error(ctx0, res, "ncclCommInitRank"))
                    }
                });
            if let Err(Ok(comm)) = tx.send(out) {
                // Nobody waits any more: do not leak the communicator.
                // SAFETY: made above, never handed out.
                let _ = unsafe { (nccl.comm_abort)(comm as Comm) };
            }
        })
        .map_err(|e| CommError::Aborted {
            ctx: ctx0,
            cause: consort_comm::AbortCause::Spawn {
                what: "the NCCL init thread",
                error: e.to_string(),
            },
        })?;
    match tokio::time::timeout(timeout, rx).await {
        Ok(Ok(out)) => out,
        Ok(Err(_)) => Err(CommError::Aborted {
            ctx: ctx0,
            cause: consort_comm::AbortCause::Stopped("the NCCL init thread"),
        }),
        Err(_) => Err(init_timeout(ctx0, timeout, "ncclCommInitRank")),
    }
}

/// `ncclCommFinalize` (NCCL 2.14+) settled within `deadline`, then
/// `ncclCommDestroy`; when finalize fails or does not finish in time, the
/// communicator is aborted instead (a peer that left mid-way must not hold
/// the shutdown). Returns the first error.
pub(super) fn finalize_and_destroy(
    shared: &Cuda,
    comm: usize,
    ctx: ErrorContext,
    deadline: Instant,
) -> Result<()> {
    let nccl = &shared.nccl;
    let c = comm as Comm;
    if let Some(fin) = nccl.comm_finalize {
        // SAFETY: live communicator, nothing in flight, no other NCCL call
        // on it (the caller holds the launch lock and cleared the handle).
        let r = settle(nccl, c, unsafe { fin(c) }, deadline, || false);
        if r != result::SUCCESS {
            let e = if r == result::TIMEOUT {
                CommError::Backend {
                    ctx,
                    backend: "NCCL",
                    code: r,
                    detail: "ncclCommFinalize did not finish in time (a peer is gone or \
                             stopped); the communicator was aborted instead"
                        .into(),
                }
            } else {
                nccl_error(
                    ctx,
                    r,
                    &format!("ncclCommFinalize: {}", last_error(nccl, comm)),
                )
            };
            // Aborted once, instead of the destroy below (the last handle
            // waits for it, briefly, before the process may exit).
            *consort_comm::lock(&shared.aborter) =
                abort_in_background(nccl, comm, ctx.rank.unwrap_or(0));
            return Err(e);
        }
    }
    // SAFETY: destroyed once, after finalize.
    let r = unsafe { (nccl.comm_destroy)(c) };
    if r != result::SUCCESS {
        return Err(nccl_error(ctx, r, "ncclCommDestroy"));
    }
    Ok(())
}

impl NcclBackend {
    /// Finishes the work in flight (within the default timeout), stops the
    /// watchdog, and destroys the communicator. Every rank should call it
    /// at the end; afterwards every op fails. With a failed communicator
    /// it only releases what is left and returns the first error.
    pub fn shutdown(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.shared
            .drain_and_close(self.opts.timeout, "the NCCL backend was shut down");
        // The peers' comparisons of this rank's last calls need this
        // rank's part of the side channel: leave after them (bounded).
        if let Some(c) = self.shared.checker() {
            c.wait_drained();
        }
        self.stop_watchdog();
        let poisoned = self.shared.poisoned();
        let comm = {
            let _launches = self.shared.slot();
            match self.shared.device().comm.swap(0, Ordering::SeqCst) {
                0 => None,
                c => Some(c),
            }
        };
        let ctx = ErrorContext {
            rank: Some(self.rank),
            ..Default::default()
        };
        let mut out = match poisoned {
            Some(e) => Err(e),
            None => Ok(()),
        };
        if let Some(c) = comm {
            let _ = self.ctx.bind_to_thread();
            let by = consort_comm::time::deadline(self.opts.timeout);
            out = out.and(finalize_and_destroy(self.shared.device(), c, ctx, by));
        }
        self.free_staging();
        out
    }

    /// The group's sticky failure, if it failed: what every later call
    /// returns, and what [`NcclBackend::shutdown`] will.
    pub fn failed(&self) -> Option<CommError> {
        self.shared.poisoned()
    }

    /// Aborts the communicator (`ncclCommAbort`): in-flight work on every
    /// rank fails, and this backend stays failed. Safe with work in
    /// flight. Use it when a peer is known dead.
    pub fn abort(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.shared.close("the NCCL communicator was aborted");
        self.shared.abort(CommError::Aborted {
            ctx: ErrorContext {
                rank: Some(self.rank),
                ..Default::default()
            },
            cause: consort_comm::AbortCause::Closed("the communicator was aborted".into()),
        });
        self.stop_watchdog();
        self.free_staging();
        Ok(())
    }

    fn stop_watchdog(&self) {
        let w = consort_comm::lock(&self.watchdog).take();
        self.shared.stop(w);
        self.shared.device().free_events();
    }
}
