//! Subgroups on NCCL: a new communicator per subgroup, made with
//! `ncclCommSplit` where the loaded library has it (NCCL 2.18+), otherwise
//! with `ncclCommInitRank` on a unique id that the subgroup's first rank
//! makes and broadcasts over the parent communicator (torch passes it
//! through the store; the parent is already connected, so consort uses
//! it). Either way every rank of the parent takes part, in the order of its
//! other calls, as torch's `new_group` requires; ranks outside the list get
//! `None`.

use std::{
    ffi::c_int,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use consort_comm::{Backend, BufferMut, CallOptions, CommError, ErrorContext, Result};

use super::{NcclBackend, NcclOptions, init_comm};
use crate::{
    keys::UNIQUE_ID_BYTES,
    map::nccl_error,
    sys::{self, Comm, result},
    work::{driver_error, lock},
};

impl NcclBackend {
    /// `Backend::new_group` (`ranks`: checked, in group-rank order).
    pub(super) async fn make_subgroup(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        let me = ranks.iter().position(|&r| r == self.rank);
        let timeout = opts.timeout_or(self.opts.timeout);
        // Every rank of the parent numbers the subgroup alike, member or not.
        let id = {
            let mut t = lock(&self.shared.track);
            let parent = t.core.group();
            t.core.engine_mut().next_group_id(parent)?
        };
        let check = self.subgroup_checker(ranks).await?;
        let ctx0 = ErrorContext {
            rank: Some(self.rank),
            ..Default::default()
        };
        let comm = if self.shared.nccl.comm_split.is_some() {
            self.split(me, timeout, ctx0).await?
        } else {
            self.init_by_broadcast(ranks, me, timeout, ctx0).await?
        };
        let Some(me) = me else {
            return Ok(None);
        };
        let sub_opts = NcclOptions {
            device: Some(self.device),
            timeout,
            group: format!("{}/{}", self.opts.group, ranks.len()),
            ..self.opts.clone()
        };
        let mut sub = NcclBackend::assemble(
            self.shared.nccl.clone(),
            self.ctx.clone(),
            (me, ranks.len(), self.device),
            comm,
            id,
            sub_opts,
        )?;
        sub.subgroup = true;
        if let Some((checker, task, bind)) = check {
            sub.start_checker(checker, task, bind);
        }
        Ok(Some(Arc::new(sub)))
    }

    /// A subgroup's communicator where NCCL has no `ncclCommSplit`: its
    /// first rank makes a unique id and broadcasts it on this communicator,
    /// and the members init with it (0 on the rest).
    async fn init_by_broadcast(
        &self,
        ranks: &[usize],
        me: Option<usize>,
        timeout: std::time::Duration,
        ctx0: ErrorContext,
    ) -> Result<usize> {
        let Some(root) = ranks.first().copied() else {
            return Err(CommError::invalid("a subgroup needs at least one rank"));
        };
        // The root sends the id, or zeros when it could not make one,
        // so that every rank fails at once instead of waiting.
        let mut id = [0u8; UNIQUE_ID_BYTES];
        let mut made = Ok(());
        if self.rank == root {
            match self.shared.nccl.unique_id() {
                Ok(u) => id = u.internal.map(|c| c as u8),
                Err(r) => made = Err(nccl_error(ctx0, r, "ncclGetUniqueId")),
            }
        }
        let o = CallOptions::root(root).with_timeout(timeout);
        self.broadcast(BufferMut::from(&mut id[..]), &o).await?;
        made?;
        if id.iter().all(|&b| b == 0) {
            return Err(CommError::Aborted {
                ctx: ctx0,
                cause: format!(
                    "rank {root}, the subgroup's first rank, could not make an NCCL unique \
                     id; its log has the cause"
                ),
            });
        }
        match me {
            Some(me) => {
                let (nccl, cctx, n) = (&self.shared.nccl, &self.ctx, ranks.len());
                init_comm(nccl, cctx, ctx0, id, me, n, timeout).await
            }
            None => Ok(0),
        }
    }

    /// `ncclCommSplit` of this communicator, off the async runtime, under
    /// the launch lock (so no enqueue of this rank interleaves with it).
    /// Members take color 0 and their group rank as the key; the rest
    /// `NCCL_SPLIT_NOCOLOR` and get no communicator (0).
    async fn split(
        &self,
        me: Option<usize>,
        timeout: std::time::Duration,
        ctx0: ErrorContext,
    ) -> Result<usize> {
        let shared = self.shared.clone();
        let cctx = self.ctx.clone();
        let (color, key) = match me {
            Some(me) => (0, me as c_int),
            None => (sys::SPLIT_NOCOLOR, 0),
        };
        // Set when nobody waits for the split any more: a communicator it
        // makes after that is destroyed, not leaked.
        let abandoned = Arc::new(AtomicBool::new(false));
        let gave_up = abandoned.clone();
        let work = tokio::task::spawn_blocking(move || -> Result<usize> {
            cctx.bind_to_thread()
                .map_err(|e| driver_error(ctx0, "context binding", e))?;
            let _launches = lock(&shared.slot);
            if let Some(e) = lock(&shared.track).core.poisoned() {
                return Err(e.to_aborted().with_context(ctx0));
            }
            let parent = shared.comm().ok_or_else(|| CommError::Aborted {
                ctx: ctx0,
                cause: "the NCCL communicator is gone (aborted)".into(),
            })?;
            let split = shared.nccl.comm_split.ok_or_else(|| {
                CommError::unsupported("this NCCL has no ncclCommSplit (it needs 2.18)")
            })?;
            let mut made: Comm = std::ptr::null_mut();
            // SAFETY: `parent` is live (checked above, under the launch
            // lock); `made` is a valid out-pointer; a null config inherits
            // the parent's.
            let r = unsafe { split(parent as Comm, color, key, &mut made, std::ptr::null_mut()) };
            if r != result::SUCCESS {
                return Err(nccl_error(ctx0, r, "ncclCommSplit"));
            }
            if gave_up.load(Ordering::SeqCst) && !made.is_null() {
                // SAFETY: made just above, never handed out.
                let _ = unsafe { (shared.nccl.comm_destroy)(made) };
                return Err(CommError::Aborted {
                    ctx: ctx0,
                    cause: "ncclCommSplit finished after its deadline".into(),
                });
            }
            Ok(made as usize)
        });
        match tokio::time::timeout(timeout, work).await {
            Ok(joined) => joined.map_err(|e| CommError::Aborted {
                ctx: ctx0,
                cause: format!("the ncclCommSplit thread failed: {e}"),
            })?,
            Err(_) => {
                // A rank that never calls new_group leaves the split blocked
                // inside NCCL, holding the launch lock: abort the parent
                // (without that lock), which ends it, and stay failed.
                abandoned.store(true, Ordering::SeqCst);
                let e = CommError::Timeout {
                    ctx: ctx0,
                    after: timeout,
                    waiting_on: Vec::new(),
                };
                self.shared.abort(e.clone());
                Err(e)
            }
        }
    }
}
