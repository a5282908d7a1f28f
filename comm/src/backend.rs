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

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;

use crate::{Buffer, BufferMut, GroupId, ReduceOp, Result};

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

    /// Reduces `buf` across all ranks in place; every rank gets the result.
    async fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp, opts: &CallOptions) -> Result<()>;

    /// Copies `buf` from `opts.root` to every other rank.
    async fn broadcast(&self, buf: BufferMut<'_>, opts: &CallOptions) -> Result<()>;

    /// Reduces `buf` across all ranks into `opts.root`'s buffer. Other ranks'
    /// buffers are left in an unspecified state, as in PyTorch.
    async fn reduce(&self, buf: BufferMut<'_>, op: ReduceOp, opts: &CallOptions) -> Result<()>;

    /// Concatenates every rank's `input`, in rank order, into every rank's
    /// `output` (`output.len() == world_size * input.len()`).
    async fn all_gather(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        opts: &CallOptions,
    ) -> Result<()>;

    /// Concatenates every rank's `input` into `output` on `opts.root`, which
    /// must pass `Some`; other ranks pass `None`.
    async fn gather(
        &self,
        output: Option<BufferMut<'_>>,
        input: Buffer<'_>,
        opts: &CallOptions,
    ) -> Result<()>;

    /// Splits `opts.root`'s `input` into `world_size` equal parts and sends
    /// part `r` to rank `r`. The root passes `Some(input)`, others `None`.
    async fn scatter(
        &self,
        output: BufferMut<'_>,
        input: Option<Buffer<'_>>,
        opts: &CallOptions,
    ) -> Result<()>;

    /// Reduces `input` (`world_size * output.len()` elements) across ranks
    /// and leaves part `rank` of the result in `output`.
    async fn reduce_scatter(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<()>;

    /// `all_to_all_single`: part `j` of this rank's `input` goes to rank `j`,
    /// and part `i` of `output` comes from rank `i`. With both split lists
    /// `None` the parts are equal; otherwise they give each part's length in
    /// elements (a `None` side is split equally).
    async fn all_to_all_single(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
        opts: &CallOptions,
    ) -> Result<()>;

    /// Returns once every rank has entered the barrier.
    async fn barrier(&self, opts: &CallOptions) -> Result<()>;

    /// Sends `buf` to rank `dst`, matched by `opts.tag`.
    async fn send(&self, buf: Buffer<'_>, dst: usize, opts: &CallOptions) -> Result<()>;

    /// Receives into `buf` from rank `src`, matched by `opts.tag`.
    async fn recv(&self, buf: BufferMut<'_>, src: usize, opts: &CallOptions) -> Result<()>;

    /// Waits for every call this rank has enqueued on device buffers, and
    /// reports the first failure among them (torch's `work.wait()` on
    /// every outstanding work, then `ncclCommGetAsyncError`). Host-buffer
    /// backends have nothing in flight between calls: the default returns
    /// at once.
    async fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// `new_group(ranks)`: every rank of this group calls it with the same
    /// list; members get `Some(handle)` whose ranks are renumbered in list
    /// order, and non-members get `None`, as in `torch.distributed`.
    ///
    /// The default refuses with `Unsupported`; backends add subgroups by
    /// overriding it.
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
