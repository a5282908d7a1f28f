//! The [`Backend`] trait every implementation keeps (sim, tcp, quic, nccl),
//! and the per-call [`CallOptions`].
//!
//! This module owns the contract, not any algorithm: argument order follows
//! `torch.distributed` (output before input), every op is async, and the
//! trait is dyn-compatible so that `Arc<dyn Backend>` can be chosen at run
//! time. Most users call it through the typed [`crate::ProcessGroup`].
//!
//! # What every implementation promises
//!
//! - Arguments are checked before anything is sent ([`crate::validate`]);
//!   a bad length or root is `InvalidArgument` on the rank that passed it.
//! - An op and dtype pair it cannot do is `Unsupported`, never a silent
//!   wrong op.
//! - Every call carries a [`crate::Fingerprint`]; ranks that disagree all get
//!   `Mismatch`.
//! - Every call has a deadline: `opts.timeout`, or the group's default.
//! - After a failure the group is poisoned: later calls return `Aborted`
//!   with the first cause.
//!
//! # Device buffers are stream-ordered
//!
//! A call on [`crate::DeviceBuffer`]s behaves as torch's NCCL backend does:
//! the backend's stream waits for the buffer's stream, the op is enqueued,
//! the buffer's stream waits for the op, and the call returns without
//! waiting for the device. Work enqueued on the buffer's stream afterwards
//! sees the result; the host sees it after synchronizing that stream. A
//! failure that happens on the device later is sticky: the next call, or
//! [`Backend::synchronize`], reports it. Calls on host buffers complete
//! before they return.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use async_trait::async_trait;

use crate::{Buffer, BufferMut, DType, Fingerprint, GroupId, OpKind, ReduceOp, Result};

/// One call with its buffers, as [`Backend::submit`] takes it: torch's
/// collectives and point-to-point ops. Output buffers come first.
#[derive(Debug)]
pub enum Op<'a> {
    /// `all_reduce` in place.
    AllReduce {
        /// The buffer, reduced in place.
        buf: BufferMut<'a>,
        /// The reduction.
        op: ReduceOp,
    },
    /// `broadcast` from `opts.root`.
    Broadcast {
        /// The buffer: the root's is sent, the others' are overwritten.
        buf: BufferMut<'a>,
    },
    /// `reduce` into `opts.root`.
    Reduce {
        /// The buffer; the root's gets the result.
        buf: BufferMut<'a>,
        /// The reduction.
        op: ReduceOp,
    },
    /// `all_gather_into_tensor`.
    AllGather {
        /// `world_size × input.len()` elements.
        output: BufferMut<'a>,
        /// This rank's part.
        input: Buffer<'a>,
    },
    /// `gather` into `opts.root`.
    Gather {
        /// The root's output; `None` elsewhere.
        output: Option<BufferMut<'a>>,
        /// This rank's part.
        input: Buffer<'a>,
    },
    /// `scatter` from `opts.root`.
    Scatter {
        /// This rank's part.
        output: BufferMut<'a>,
        /// The root's input; `None` elsewhere.
        input: Option<Buffer<'a>>,
    },
    /// `reduce_scatter_tensor`.
    ReduceScatter {
        /// This rank's part of the result.
        output: BufferMut<'a>,
        /// `world_size × output.len()` elements.
        input: Buffer<'a>,
        /// The reduction.
        op: ReduceOp,
    },
    /// `all_to_all_single`, with optional uneven splits.
    AllToAll {
        /// Part `i` comes from rank `i`.
        output: BufferMut<'a>,
        /// Part `j` goes to rank `j`.
        input: Buffer<'a>,
        /// Elements received from each rank (`None`: equal parts).
        output_splits: Option<&'a [usize]>,
        /// Elements sent to each rank (`None`: equal parts).
        input_splits: Option<&'a [usize]>,
    },
    /// `barrier`.
    Barrier,
    /// `send` to `dst`, matched by `opts.tag`.
    Send {
        /// The message.
        buf: Buffer<'a>,
        /// The receiving rank.
        dst: usize,
    },
    /// `recv` from `src`, matched by `opts.tag`.
    Recv {
        /// Where the message goes.
        buf: BufferMut<'a>,
        /// The sending rank.
        src: usize,
    },
}

impl Op<'_> {
    /// Which op this is.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::AllReduce { .. } => OpKind::AllReduce,
            Op::Broadcast { .. } => OpKind::Broadcast,
            Op::Reduce { .. } => OpKind::Reduce,
            Op::AllGather { .. } => OpKind::AllGather,
            Op::Gather { .. } => OpKind::Gather,
            Op::Scatter { .. } => OpKind::Scatter,
            Op::ReduceScatter { .. } => OpKind::ReduceScatter,
            Op::AllToAll { .. } => OpKind::AllToAll,
            Op::Barrier => OpKind::Barrier,
            Op::Send { .. } => OpKind::Send,
            Op::Recv { .. } => OpKind::Recv,
        }
    }

    /// The call's fingerprint as call `seq` of `group` with root `root`
    /// ([`Op::shape`] placed in its group's sequence).
    pub fn fingerprint(&self, group: GroupId, seq: u64, root: usize) -> Fingerprint {
        self.shape(root).at(group, seq)
    }

    /// What the call is, for its fingerprint (the one place it is
    /// computed): the count is the input's length where input and output
    /// differ (the output's for scatter and reduce_scatter, none for
    /// all_to_all), and the root counts only for rooted ops. Backends that
    /// cannot carry the fingerprint in a frame (NCCL) compare it over a
    /// side channel.
    pub fn shape(&self, root: usize) -> crate::Shape {
        let (dtype, count, reduce) = match self {
            Op::AllReduce { buf, op } | Op::Reduce { buf, op } => {
                (buf.dtype(), buf.len(), Some(*op))
            }
            Op::Broadcast { buf } | Op::Recv { buf, .. } => (buf.dtype(), buf.len(), None),
            Op::AllGather { input, .. } | Op::Gather { input, .. } => {
                (input.dtype(), input.len(), None)
            }
            Op::Scatter { output, .. } => (output.dtype(), output.len(), None),
            Op::ReduceScatter { output, op, .. } => (output.dtype(), output.len(), Some(*op)),
            Op::AllToAll { input, .. } => (input.dtype(), 0, None),
            Op::Barrier => (DType::U8, 0, None),
            Op::Send { buf, .. } => (buf.dtype(), buf.len(), None),
        };
        let op = self.kind();
        crate::Shape {
            op,
            dtype,
            count: count as u64,
            root: if op.has_root() { root as u32 } else { 0 },
            reduce_op: reduce.map(ReduceOp::compared),
        }
    }
}

/// A call in flight (torch's `Work`): await it for the outcome.
///
/// The call's place in its group's sequence was fixed when it was made, so
/// works may be awaited in any order, or together (`join!`). Dropping one
/// before it finishes cancels its call and aborts the group: peers may be
/// part-way through the call, so the group cannot go on. (A stream-ordered
/// backend, NCCL or the emulated device, has put the call on its stream
/// when it was made: a dropped work's call runs to its end there.)
#[must_use = "a call may run only while its Work is awaited (CPU backends), and dropping the Work \
              then aborts the group"]
pub struct Work<'a>(Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>);

impl<'a> Work<'a> {
    /// Work that runs `fut`.
    pub fn new(fut: impl Future<Output = Result<()>> + Send + 'a) -> Self {
        Work(Box::pin(fut))
    }

    /// Work that is already done, with `result` (an argument error, say).
    pub fn ready(result: Result<()>) -> Self {
        Work(Box::pin(std::future::ready(result)))
    }
}

impl Future for Work<'_> {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.0.as_mut().poll(cx)
    }
}

impl fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Work")
    }
}

/// Options for one call. `CallOptions::default()` means root 0, tag 0 and
/// the group's default timeout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// Deadline for this call; `None` uses the group's default.
    pub timeout: Option<Duration>,
    /// Root rank for broadcast, reduce, gather and scatter.
    pub root: usize,
    /// Tag that matches a `send` with its `recv`.
    pub tag: u32,
}

impl CallOptions {
    /// Options with the given root.
    pub fn root(root: usize) -> Self {
        CallOptions {
            root,
            ..Default::default()
        }
    }

    /// Returns these options with a per-call timeout.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Returns these options with a tag.
    #[must_use]
    pub fn with_tag(mut self, tag: u32) -> Self {
        self.tag = tag;
        self
    }

    /// The deadline this call runs under, given the group's default.
    pub fn timeout_or(&self, default: Duration) -> Duration {
        self.timeout.unwrap_or(default)
    }
}

/// A peer's abort of one of a group's calls, as [`Backend::peer_aborts`]
/// reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerAbort {
    /// The peer's rank in the group.
    pub rank: usize,
    /// The call it aborted, as it made it.
    pub call: Fingerprint,
    /// What it said.
    pub said: String,
}

/// A communication backend: one rank's handle on one process group.
///
/// Buffers are type-erased ([`Buffer`], [`BufferMut`]) so that the trait
/// stays dyn-compatible. Output buffers come first, as in
/// `torch.distributed`'s `*_into_tensor` and `*_single` forms.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug {
    /// The backend's name: `"sim"`, `"tcp"`, `"quic"`, `"nccl"`, ...
    fn name(&self) -> &'static str;

    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// This group's id ([`GroupId::WORLD`] for the default group).
    fn group_id(&self) -> GroupId {
        GroupId::WORLD
    }

    /// The deadline a call gets when its options name none.
    fn default_timeout(&self) -> Duration;

    /// Whether consort may make calls of its own on this group, beyond the
    /// caller's (the rank-list check of `new_group`). `false` where torch
    /// ranks share the group: every rank must then make exactly the calls
    /// torch makes.
    fn may_add_calls(&self) -> bool {
        true
    }

    /// Makes one call: checks its arguments, fixes its place in the group's
    /// sequence *now*, before the returned [`Work`] is first polled, and
    /// returns the work to await. Several calls may be in flight on one
    /// group; every rank must make them in the same order. Dropping the work
    /// before it finishes cancels the call and aborts the group with an
    /// error that says so, on a backend that runs calls as their works are
    /// polled (the CPU backends); a stream-ordered one (NCCL, the emulated
    /// device) has put the call on its stream already, and it runs to its
    /// end.
    ///
    /// The named methods below (`all_reduce`, `broadcast`, ...) build an
    /// [`Op`] and call this; backends implement only this.
    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a>;

    /// Reduces `buf` across all ranks in place; every rank gets the result.
    fn all_reduce<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp, opts: &CallOptions) -> Work<'a> {
        self.submit(Op::AllReduce { buf, op }, opts)
    }

    /// Copies `buf` from `opts.root` to every other rank.
    fn broadcast<'a>(&'a self, buf: BufferMut<'a>, opts: &CallOptions) -> Work<'a> {
        self.submit(Op::Broadcast { buf }, opts)
    }

    /// Reduces `buf` across all ranks into `opts.root`'s buffer. Other ranks'
    /// buffers are left in an unspecified state, as in PyTorch.
    fn reduce<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp, opts: &CallOptions) -> Work<'a> {
        self.submit(Op::Reduce { buf, op }, opts)
    }

    /// Concatenates every rank's `input`, in rank order, into every rank's
    /// `output` (`output.len() == world_size * input.len()`).
    fn all_gather<'a>(
        &'a self,
        output: BufferMut<'a>,
        input: Buffer<'a>,
        opts: &CallOptions,
    ) -> Work<'a> {
        self.submit(Op::AllGather { output, input }, opts)
    }

    /// Concatenates every rank's `input` into `output` on `opts.root`, which
    /// must pass `Some`; other ranks pass `None`.
    fn gather<'a>(
        &'a self,
        output: Option<BufferMut<'a>>,
        input: Buffer<'a>,
        opts: &CallOptions,
    ) -> Work<'a> {
        self.submit(Op::Gather { output, input }, opts)
    }

    /// Splits `opts.root`'s `input` into `world_size` equal parts and sends
    /// part `r` to rank `r`. The root passes `Some(input)`, others `None`.
    fn scatter<'a>(
        &'a self,
        output: BufferMut<'a>,
        input: Option<Buffer<'a>>,
        opts: &CallOptions,
    ) -> Work<'a> {
        self.submit(Op::Scatter { output, input }, opts)
    }

    /// Reduces `input` (`world_size * output.len()` elements) across ranks
    /// and leaves part `rank` of the result in `output`.
    fn reduce_scatter<'a>(
        &'a self,
        output: BufferMut<'a>,
        input: Buffer<'a>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Work<'a> {
        self.submit(Op::ReduceScatter { output, input, op }, opts)
    }

    /// `all_to_all_single`: part `j` of this rank's `input` goes to rank `j`,
    /// and part `i` of `output` comes from rank `i`. With both split lists
    /// `None` the parts are equal; otherwise they give each part's length in
    /// elements (a `None` side is split equally).
    fn all_to_all_single<'a>(
        &'a self,
        output: BufferMut<'a>,
        input: Buffer<'a>,
        output_split_sizes: Option<&'a [usize]>,
        input_split_sizes: Option<&'a [usize]>,
        opts: &CallOptions,
    ) -> Work<'a> {
        let op = Op::AllToAll {
            output,
            input,
            output_splits: output_split_sizes,
            input_splits: input_split_sizes,
        };
        self.submit(op, opts)
    }

    /// Returns once every rank has entered the barrier.
    fn barrier<'a>(&'a self, opts: &CallOptions) -> Work<'a> {
        self.submit(Op::Barrier, opts)
    }

    /// Sends `buf` to rank `dst`, matched by `opts.tag`.
    fn send<'a>(&'a self, buf: Buffer<'a>, dst: usize, opts: &CallOptions) -> Work<'a> {
        self.submit(Op::Send { buf, dst }, opts)
    }

    /// Receives into `buf` from rank `src`, matched by `opts.tag`.
    fn recv<'a>(&'a self, buf: BufferMut<'a>, src: usize, opts: &CallOptions) -> Work<'a> {
        self.submit(Op::Recv { buf, src }, opts)
    }

    /// Waits for every call this rank has enqueued on device buffers, and
    /// reports the first failure among them (torch's `work.wait()` on
    /// every outstanding work, then `ncclCommGetAsyncError`). Host-buffer
    /// backends have nothing in flight between calls: the default returns
    /// at once.
    async fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// This rank waits about `d` for something outside the group's calls
    /// (a store, a file, its own compute). Real backends return at once
    /// (the caller sleeps); the simulator advances this rank's virtual
    /// clock by `d`, so that its peers' calls can progress meanwhile (an
    /// idle rank otherwise holds the simulated world at its time).
    async fn idle(&self, d: Duration) {
        let _ = d;
    }

    /// The ranks of this group that this rank's transport has seen go
    /// (a connection closed or reset; the simulator's rank exited), with
    /// what was seen, known without making a call. A stream-ordered
    /// communicator's data path can fail without naming the rank (NCCL's
    /// `ncclRemoteError`); its fingerprint side channel names it through
    /// this ([`crate::ordered::check::LostPeer`]). Default: none known.
    fn lost_peers(&self) -> Vec<(usize, String)> {
        Vec::new()
    }

    /// The ranks of this group that said they failed one of its calls (an
    /// abort they sent, received without making a call): which call, and
    /// what they said. A stream-ordered communicator's peers hear of a
    /// rank's own failure (a call it cancelled, one it could not enqueue)
    /// only this way, through its fingerprint side channel: NCCL tells them
    /// nothing ([`crate::ordered::check::Checker::tell`]). Default: none
    /// known.
    fn peer_aborts(&self) -> Vec<PeerAbort> {
        Vec::new()
    }

    /// Makes a subgroup of this group. `ranks` is already checked (distinct,
    /// inside this group) and in group-rank order; every rank of this group
    /// calls it with the same list, making its subgroups in the same order.
    /// Members get `Some(handle)`, others `None`. `opts.timeout` is the new
    /// group's default timeout (`None`: this group's).
    ///
    /// Users call [`crate::ProcessGroup::new_group`], which applies torch's
    /// rules for the list first. The default refuses with `Unsupported`.
    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        let _ = (ranks, opts);
        Err(crate::CommError::unsupported(format!(
            "the {} backend does not create subgroups yet",
            self.name()
        )))
    }
}
