//! [`ProcessGroup`]: the typed, PyTorch-shaped face of a [`Backend`].
//!
//! This module owns the ergonomic layer only: it turns `&mut [T]` into
//! buffer views and fills in [`CallOptions`]. Everything it does is one call
//! into the backend.
//!
//! ```no_run
//! # async fn demo(pg: consort_comm::ProcessGroup) -> consort_comm::Result<()> {
//! use consort_comm::ReduceOp;
//! let mut grads = vec![1.0f32; 1024];
//! pg.all_reduce(&mut grads, ReduceOp::Avg).await?;
//! pg.broadcast(&mut grads, 0).await?;
//! # Ok(()) }
//! ```

use std::{fmt, sync::Arc};

use crate::{Backend, Buffer, BufferMut, CallOptions, Element, ReduceOp, Result};

/// A handle on a process group with typed collectives.
///
/// Cheap to clone; clones share the backend. The `*_with` forms take full
/// [`CallOptions`] (timeout, tag).
#[derive(Clone)]
pub struct ProcessGroup {
    backend: Arc<dyn Backend>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("backend", &self.backend.name())
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish()
    }
}

impl ProcessGroup {
    /// Wraps a backend.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        ProcessGroup { backend }
    }

    /// The backend underneath.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.backend.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.backend.world_size()
    }

    /// `all_reduce` in place with default options.
    pub async fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_with(buf, op, &CallOptions::default()).await
    }

    /// `all_reduce` in place.
    pub async fn all_reduce_with<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<()> {
        self.backend
            .all_reduce(BufferMut::from(buf), op, opts)
            .await
    }

    /// `broadcast` from `root`.
    pub async fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.backend
            .broadcast(BufferMut::from(buf), &CallOptions::root(root))
            .await
    }

    /// `reduce` into `root`.
    pub async fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.backend
            .reduce(BufferMut::from(buf), op, &CallOptions::root(root))
            .await
    }

    /// `all_gather` into `output` (`world_size × input.len()` elements).
    pub async fn all_gather<T: Element>(&self, output: &mut [T], input: &[T]) -> Result<()> {
        self.backend
            .all_gather(
                BufferMut::from(output),
                Buffer::from(input),
                &CallOptions::default(),
            )
            .await
    }

    /// `all_gather` into a new vector.
    pub async fn all_gather_vec<T: Element>(&self, input: &[T]) -> Result<Vec<T>> {
        let n = input
            .len()
            .checked_mul(self.world_size())
            .ok_or_else(|| crate::CommError::invalid("all_gather output length overflows usize"))?;
        let mut out = vec![T::zeroed(); n];
        self.all_gather(&mut out, input).await?;
        Ok(out)
    }

    /// `gather` into `output` on `root` (others pass `None`).
    pub async fn gather<T: Element>(
        &self,
        output: Option<&mut [T]>,
        input: &[T],
        root: usize,
    ) -> Result<()> {
        self.backend
            .gather(
                output.map(BufferMut::from),
                Buffer::from(input),
                &CallOptions::root(root),
            )
            .await
    }

    /// `scatter` from `root` (others pass `None` as input).
    pub async fn scatter<T: Element>(
        &self,
        output: &mut [T],
        input: Option<&[T]>,
        root: usize,
    ) -> Result<()> {
        self.backend
            .scatter(
                BufferMut::from(output),
                input.map(Buffer::from),
                &CallOptions::root(root),
            )
            .await
    }

    /// `reduce_scatter` (`input` holds `world_size × output.len()` elements).
    pub async fn reduce_scatter<T: Element>(
        &self,
        output: &mut [T],
        input: &[T],
        op: ReduceOp,
    ) -> Result<()> {
        self.backend
            .reduce_scatter(
                BufferMut::from(output),
                Buffer::from(input),
                op,
                &CallOptions::default(),
            )
            .await
    }

    /// `all_to_all_single`, with equal parts when both split lists are `None`.
    pub async fn all_to_all_single<T: Element>(
        &self,
        output: &mut [T],
        input: &[T],
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
    ) -> Result<()> {
        self.backend
            .all_to_all_single(
                BufferMut::from(output),
                Buffer::from(input),
                output_split_sizes,
                input_split_sizes,
                &CallOptions::default(),
            )
            .await
    }

    /// `barrier`.
    pub async fn barrier(&self) -> Result<()> {
        self.backend.barrier(&CallOptions::default()).await
    }

    /// `send` to `dst` with `tag`.
    pub async fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        self.backend
            .send(
                Buffer::from(buf),
                dst,
                &CallOptions::default().with_tag(tag),
            )
            .await
    }

    /// `recv` from `src` with `tag`.
    pub async fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<()> {
        self.backend
            .recv(
                BufferMut::from(buf),
                src,
                &CallOptions::default().with_tag(tag),
            )
            .await
    }

    /// `new_group(ranks)`: `Some` on members, `None` elsewhere. Every rank of
    /// this group must call it with the same list.
    pub async fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        Ok(self
            .backend
            .new_group(ranks, &CallOptions::default())
            .await?
            .map(ProcessGroup::new))
    }
}
