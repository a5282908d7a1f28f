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
    sync::{Arc, atomic::Ordering},
};

use consort_comm::{Backend, BufferMut, CallOptions, CommError, ErrorContext, GroupId, Result};

use super::{
    NcclBackend, NcclOptions,
    launch::settle,
    life::{init_comm, init_timeout},
};
use crate::{
    cuda::driver_error,
    keys::{SubgroupBootstrap, TorchNccl, UNIQUE_ID_BYTES, check_unique_id, torch_unique_id_key},
    map::nccl_error,
    sys::{self, Comm, result},
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
        let parent = self.shared.group();
        let failed = self.shared.poisoned().is_some();
        let id = self.shared.with_engine(|e| e.next_group_id(parent))?;
        // torch numbers every new_group on every rank, member or not.
        let name = crate::keys::torch_group_name(self.torch_groups.fetch_add(1, Ordering::SeqCst));
        let bootstrap =
            crate::keys::torch_subgroup_bootstrap(self.opts.torch, self.opts.torch_eager);
        let check = self.subgroup_checker(ranks).await?;
        let ctx0 = ErrorContext {
            rank: Some(self.rank),
            ..Default::default()
        };
        let comm = if failed {
            self.init_by_store(ranks, me, (parent, id), timeout, ctx0)
                .await?
        } else if bootstrap == SubgroupBootstrap::StoreId {
            self.init_by_torch_key(ranks, me, &name, timeout, ctx0)
                .await?
        } else if self.shared.device().nccl.comm_split.is_some() {
            self.split(me, ranks, timeout, ctx0).await?
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
            self.shared.device().nccl.clone(),
            self.ctx.clone(),
            (me, ranks.len(), self.device),
            comm,
            id,
            sub_opts,
        )?;
        sub.subgroup = true;
        // One record per rank: the subgroup's calls join its parent's.
        if let Some(out) = self.shared.flight() {
            sub.shared.set_flight(out.clone());
        }
        if let Some(store) = self.store.get() {
            let _ = sub.store.set(store.clone());
        }
        sub.torch_groups = self.torch_groups.clone();
        if let Some((checker, task, bind)) = check {
            sub.start_checker(checker, task, bind);
        }
        Ok(Some(Arc::new(sub)))
    }

    /// A subgroup of a failed communicator: the survivors of a lost rank
    /// (`OnPeerLost::Shrink`, `Dist::shutdown_without`), who cannot call
    /// anything on it. Its first rank makes a unique id and sets it in the
    /// job's store (`NcclBackend::set_store`) under the subgroup's id, the
    /// other members read it, and all init a new communicator, bounded as
    /// every init is. Works on every NCCL release (`ncclCommShrink` needs a
    /// parent that was revoked, not aborted, and 2.28.7 for that).
    async fn init_by_store(
        &self,
        ranks: &[usize],
        me: Option<usize>,
        (parent, id): (GroupId, GroupId),
        timeout: std::time::Duration,
        ctx0: ErrorContext,
    ) -> Result<usize> {
        let Some(me) = me else {
            return Ok(0);
        };
        // NCCL lets go of the failed communicator first (its abort runs in
        // the background), within a bound (a stuck abort is warned about),
        // before the exchange: the inits then start together, each with its
        // whole timeout.
        let driver = &self.shared;
        driver
            .device()
            .aborted_within(ABORT_BEFORE_INIT.min(timeout), || driver.aborting())
            .await;
        let key = format!("consort/nccl/survivors/{:08x}/{:08x}", parent.0, id.0);
        tracing::debug!(rank = self.rank, ?ranks, %key, "NCCL: a communicator of the survivors");
        let why = format!(
            "a group of the survivors of failed NCCL group {:#x} needs the job's store to meet in",
            parent.0
        );
        self.init_from_store(&key, &why, (me, ranks), timeout, ctx0)
            .await
    }

    /// A `new_group` of a torch job whose classic backend made its default
    /// group lazily (`keys::SubgroupBootstrap::StoreId`): the group's first
    /// rank sets a fresh unique id under the group's own torch key
    /// (`default_pg/<name>//cuda//0`), the other members read it, and only
    /// members init; the rest make nothing, as torch's non-members.
    async fn init_by_torch_key(
        &self,
        ranks: &[usize],
        me: Option<usize>,
        name: &str,
        timeout: std::time::Duration,
        ctx0: ErrorContext,
    ) -> Result<usize> {
        let Some(me) = me else {
            return Ok(0);
        };
        let key = torch_unique_id_key(TorchNccl::Legacy, name, 0);
        tracing::debug!(rank = self.rank, ?ranks, %key, "NCCL: a torch subgroup from the store");
        let why = format!(
            "torch's classic NCCL backend keys group {name}'s communicator in the job's store"
        );
        self.init_from_store(&key, &why, (me, ranks), timeout, ctx0)
            .await
    }

    /// A communicator of `ranks` (this rank is group rank `me`) from a
    /// unique id in the job's store under `key`: group rank 0 makes and
    /// sets it, the others wait for it until `timeout`, and all init, bounded
    /// as every init is. `why` says what needs the store, for the error
    /// where none was set.
    async fn init_from_store(
        &self,
        key: &str,
        why: &str,
        (me, ranks): (usize, &[usize]),
        timeout: std::time::Duration,
        ctx0: ErrorContext,
    ) -> Result<usize> {
        let bytes = self
            .id_in_store(key, why, (me, ranks[0]), timeout, ctx0)
            .await?;
        let opts = NcclOptions {
            timeout,
            ..self.opts.clone()
        };
        let (nccl, cctx) = (&self.shared.device().nccl, &self.ctx);
        tracing::debug!(rank = self.rank, me, %key, "NCCL: the unique id is here; init");
        let made = init_comm(nccl, cctx, ctx0, bytes, (me, ranks.len()), &opts).await;
        tracing::debug!(rank = self.rank, ok = made.is_ok(), %key, "NCCL: the init ended");
        made
    }

    /// A unique id through the job's store under `key`: group rank 0
    /// (`me`) makes and sets it, the others wait for it (global rank
    /// `first` is whom they wait on) until `timeout`.
    async fn id_in_store(
        &self,
        key: &str,
        why: &str,
        (me, first): (usize, usize),
        timeout: std::time::Duration,
        ctx0: ErrorContext,
    ) -> Result<[u8; UNIQUE_ID_BYTES]> {
        let store = self.store.get().ok_or_else(|| {
            CommError::unsupported(format!(
                "{why}: call NcclBackend::set_store (Dist::nccl_backend does)"
            ))
        })?;
        let store_err = |source| CommError::Store { ctx: ctx0, source };
        if me == 0 {
            let u = self
                .shared
                .device()
                .nccl
                .unique_id()
                .map_err(|r| nccl_error(ctx0, r, "ncclGetUniqueId"))?;
            let bytes = u.internal.map(|c| c as u8);
            store.set(key, &bytes).await.map_err(store_err)?;
            return Ok(bytes);
        }
        let got = tokio::time::timeout(timeout, store.get(key))
            .await
            .map_err(|_| CommError::Timeout {
                ctx: ctx0,
                after: timeout,
                waiting_on: vec![first],
            })?
            .map_err(store_err)?;
        check_unique_id(key, &got).map_err(CommError::invalid)
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
            match self.shared.device().nccl.unique_id() {
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
                cause: consort_comm::AbortCause::Other(format!(
                    "rank {root}, the subgroup's first rank, could not make an NCCL unique id; \
                     its log has the cause"
                )),
            });
        }
        match me {
            Some(me) => {
                let (nccl, cctx, n) = (&self.shared.device().nccl, &self.ctx, ranks.len());
                let opts = NcclOptions {
                    timeout,
                    ..self.opts.clone()
                };
                init_comm(nccl, cctx, ctx0, id, (me, n), &opts).await
            }
            None => Ok(0),
        }
    }

    /// `ncclCommSplit` of this communicator on a blocking thread that
    /// holds the launch lock (no enqueue of this rank interleaves with it,
    /// and the parent is not used while NCCL makes the child). The parent
    /// is nonblocking: the split returns at once and is polled on the
    /// parent until `timeout`; a rank that never calls `new_group` leaves
    /// it in progress, and then the parent is aborted (under the lock) and
    /// this rank stays failed. Members take torch's colour for the group
    /// (`keys::split_color`: nccl2's `min(ranks)` or the classic
    /// backend's tuple hash, so torch ranks splitting the same parent land
    /// in the same communicator) and their group rank as the key; the rest
    /// `NCCL_SPLIT_NOCOLOR` and get no communicator (0).
    async fn split(
        &self,
        me: Option<usize>,
        ranks: &[usize],
        timeout: std::time::Duration,
        ctx0: ErrorContext,
    ) -> Result<usize> {
        let shared = self.shared.clone();
        let cctx = self.ctx.clone();
        let (color, key) = match me {
            Some(me) => (
                crate::keys::split_color(self.opts.torch, ranks) as c_int,
                me as c_int,
            ),
            None => (sys::SPLIT_NOCOLOR, 0),
        };
        let deadline = consort_comm::time::deadline(timeout);
        let work = tokio::task::spawn_blocking(move || -> Result<usize> {
            cctx.bind_to_thread()
                .map_err(|e| driver_error(ctx0, "context binding", e))?;
            let slot = shared.slot();
            if let Some(e) = shared.poisoned() {
                return Err(e.to_aborted().with_context(ctx0));
            }
            let cuda = shared.device();
            let parent = cuda.comm().ok_or_else(|| CommError::Aborted {
                ctx: ctx0,
                cause: consort_comm::AbortCause::Closed(
                    "the NCCL communicator is gone (aborted)".into(),
                ),
            })? as Comm;
            let split = cuda.nccl.comm_split.ok_or_else(|| {
                CommError::unsupported("this NCCL has no ncclCommSplit (it needs 2.18)")
            })?;
            // NCCL writes the child's handle here when the split completes,
            // from its own thread: the box outlives the split.
            let mut made: Box<Comm> = Box::new(std::ptr::null_mut());
            // SAFETY: `parent` is live (checked above, under the launch
            // lock); `made` is a valid out-pointer; a null config inherits
            // the parent's (nonblocking).
            let r = unsafe { split(parent, color, key, &mut *made, std::ptr::null_mut()) };
            let stop = || shared.aborting();
            let mut r = settle(&cuda.nccl, parent, r, deadline, stop);
            if r == result::SUCCESS && !made.is_null() {
                // The child is nonblocking too: ready once its own state is.
                r = settle(&cuda.nccl, *made, result::IN_PROGRESS, deadline, stop);
            }
            if r == result::SUCCESS {
                return Ok(*made as usize);
            }
            let e = if r == result::TIMEOUT {
                init_timeout(ctx0, timeout, "ncclCommSplit")
            } else {
                nccl_error(ctx0, r, &cuda.last_error(parent as usize))
            };
            // NCCL may still hold the out-pointer until the abort ends it.
            std::mem::forget(made);
            shared.abort_under(Some(slot), e.clone());
            Err(e)
        });
        work.await.map_err(|e| CommError::Aborted {
            ctx: ctx0,
            cause: consort_comm::AbortCause::Other(format!("the ncclCommSplit thread failed: {e}")),
        })?
    }
}

/// How long the survivors' init waits for the failed communicator's
/// `ncclCommAbort` (with a dead peer NCCL's abort waits on its proxy
/// threads; it usually returns well within this).
const ABORT_BEFORE_INIT: std::time::Duration = std::time::Duration::from_secs(10);
