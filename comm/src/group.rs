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

use crate::{Backend, Buffer, BufferMut, CallOptions, Element, ReduceOp, Result, Work};

/// A handle on a process group with typed collectives.
///
/// Cheap to clone; clones share the backend. The `*_with` forms take full
/// [`CallOptions`] (timeout, tag).
///
/// Every rank makes the same calls in the same order, as with
/// `torch.distributed`. On two simulated ranks:
///
/// ```
/// use std::sync::Arc;
/// use consort_comm::{ProcessGroup, ReduceOp};
/// use consort_sim::{SimConfig, SimWorld};
///
/// let world = SimWorld::new(SimConfig::new(2))?;
/// let out = world.run_each(|rank| async move {
///     let pg = ProcessGroup::new(Arc::new(rank));
///     let mut w = vec![0.0f64; 4];
///     if pg.rank() == 0 {
///         w.fill(0.5); // rank 0's initial weights
///     }
///     pg.broadcast(&mut w, 0).await?; // every rank now holds rank 0's
///     let mut loss = [pg.rank() as f64 + 1.0];
///     pg.all_reduce(&mut loss, ReduceOp::Sum).await?;
///     let ranks = pg.all_gather_vec(&[pg.rank() as u32]).await?;
///     Ok::<_, consort_comm::CommError>((w, loss[0], ranks))
/// })?;
/// for r in out {
///     assert_eq!(r?, (vec![0.5; 4], 3.0, vec![0, 1]));
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
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
    ///
    /// Every call here returns a [`Work`] whose place in the group's
    /// sequence is fixed now: several may be in flight, awaited in any
    /// order or together.
    pub fn all_reduce<'a, T: Element>(&'a self, buf: &'a mut [T], op: ReduceOp) -> Work<'a> {
        self.all_reduce_with(buf, op, &CallOptions::default())
    }

    /// `all_reduce` in place.
    pub fn all_reduce_with<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Work<'a> {
        self.backend.all_reduce(BufferMut::from(buf), op, opts)
    }

    /// `broadcast` from `root`.
    pub fn broadcast<'a, T: Element>(&'a self, buf: &'a mut [T], root: usize) -> Work<'a> {
        self.backend
            .broadcast(BufferMut::from(buf), &CallOptions::root(root))
    }

    /// `reduce` into `root`.
    pub fn reduce<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Work<'a> {
        self.backend
            .reduce(BufferMut::from(buf), op, &CallOptions::root(root))
    }

    /// `all_gather` into `output` (`world_size × input.len()` elements).
    pub fn all_gather<'a, T: Element>(&'a self, output: &'a mut [T], input: &'a [T]) -> Work<'a> {
        self.backend.all_gather(
            BufferMut::from(output),
            Buffer::from(input),
            &CallOptions::default(),
        )
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
    pub fn gather<'a, T: Element>(
        &'a self,
        output: Option<&'a mut [T]>,
        input: &'a [T],
        root: usize,
    ) -> Work<'a> {
        self.backend.gather(
            output.map(BufferMut::from),
            Buffer::from(input),
            &CallOptions::root(root),
        )
    }

    /// `scatter` from `root` (others pass `None` as input).
    pub fn scatter<'a, T: Element>(
        &'a self,
        output: &'a mut [T],
        input: Option<&'a [T]>,
        root: usize,
    ) -> Work<'a> {
        self.backend.scatter(
            BufferMut::from(output),
            input.map(Buffer::from),
            &CallOptions::root(root),
        )
    }

    /// `reduce_scatter` (`input` holds `world_size × output.len()` elements).
    pub fn reduce_scatter<'a, T: Element>(
        &'a self,
        output: &'a mut [T],
        input: &'a [T],
        op: ReduceOp,
    ) -> Work<'a> {
        self.backend.reduce_scatter(
            BufferMut::from(output),
            Buffer::from(input),
            op,
            &CallOptions::default(),
        )
    }

    /// `all_to_all_single`, with equal parts when both split lists are `None`.
    pub fn all_to_all_single<'a, T: Element>(
        &'a self,
        output: &'a mut [T],
        input: &'a [T],
        output_split_sizes: Option<&'a [usize]>,
        input_split_sizes: Option<&'a [usize]>,
    ) -> Work<'a> {
        self.backend.all_to_all_single(
            BufferMut::from(output),
            Buffer::from(input),
            output_split_sizes,
            input_split_sizes,
            &CallOptions::default(),
        )
    }

    /// `barrier`.
    pub fn barrier(&self) -> Work<'_> {
        self.backend.barrier(&CallOptions::default())
    }

    /// `send` to `dst` with `tag`.
    pub fn send<'a, T: Element>(&'a self, buf: &'a [T], dst: usize, tag: u32) -> Work<'a> {
        self.backend.send(
            Buffer::from(buf),
            dst,
            &CallOptions::default().with_tag(tag),
        )
    }

    /// `recv` from `src` with `tag`.
    pub fn recv<'a, T: Element>(&'a self, buf: &'a mut [T], src: usize, tag: u32) -> Work<'a> {
        self.backend.recv(
            BufferMut::from(buf),
            src,
            &CallOptions::default().with_tag(tag),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{Arc, Mutex},
        time::Duration,
    };

    use async_trait::async_trait;
    use half::bf16;

    use super::*;
    use crate::{DType, OpKind};

    /// What one call reached the backend with.
    #[derive(Debug, PartialEq)]
    struct Seen {
        op: OpKind,
        dtype: DType,
        out_len: Option<usize>,
        in_len: Option<usize>,
        root: usize,
        tag: u32,
        extra: String,
    }

    /// Records every call: checks that the typed layer hands the backend
    /// the right views through `Arc<dyn Backend>`.
    #[derive(Debug, Default)]
    struct Recorder(Mutex<Vec<Seen>>);

    impl Recorder {
        fn log(
            &self,
            op: OpKind,
            out: Option<&BufferMut<'_>>,
            inp: Option<&Buffer<'_>>,
            o: &CallOptions,
            extra: String,
        ) {
            let dtype = out
                .map(|b| b.dtype())
                .or(inp.map(|b| b.dtype()))
                .unwrap_or(DType::U8);
            self.0.lock().unwrap().push(Seen {
                op,
                dtype,
                out_len: out.map(|b| b.len()),
                in_len: inp.map(|b| b.len()),
                root: o.root,
                tag: o.tag,
                extra,
            });
        }
    }

    #[async_trait]
    impl Backend for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            2
        }
        fn default_timeout(&self) -> Duration {
            Duration::from_secs(1)
        }
        fn submit<'a>(&'a self, op: crate::Op<'a>, o: &CallOptions) -> Work<'a> {
            use crate::Op;
            let kind = op.kind();
            match &op {
                Op::AllReduce { buf, op } | Op::Reduce { buf, op } => {
                    self.log(kind, Some(buf), None, o, op.to_string())
                }
                Op::Broadcast { buf } => self.log(kind, Some(buf), None, o, String::new()),
                Op::AllGather { output, input } => {
                    self.log(kind, Some(output), Some(input), o, String::new())
                }
                Op::Gather { output, input } => {
                    self.log(kind, output.as_ref(), Some(input), o, String::new())
                }
                Op::Scatter { output, input } => {
                    self.log(kind, Some(output), input.as_ref(), o, String::new())
                }
                Op::ReduceScatter { output, input, op } => {
                    self.log(kind, Some(output), Some(input), o, op.to_string())
                }
                Op::AllToAll {
                    output,
                    input,
                    output_splits,
                    input_splits,
                } => self.log(
                    kind,
                    Some(output),
                    Some(input),
                    o,
                    format!("{output_splits:?} {input_splits:?}"),
                ),
                Op::Barrier => self.log(kind, None, None, o, String::new()),
                Op::Send { buf, dst } => self.log(kind, None, Some(buf), o, format!("to {dst}")),
                Op::Recv { buf, src } => self.log(kind, Some(buf), None, o, format!("from {src}")),
            }
            Work::ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn typed_calls_reach_a_dyn_backend_intact() {
        let rec = Arc::new(Recorder::default());
        let pg = ProcessGroup::new(rec.clone());
        let mut g = vec![bf16::ONE; 6];
        let x = [1i64, 2, 3];
        let mut y = [0i64; 3];
        pg.all_reduce(&mut g, ReduceOp::Avg).await.unwrap();
        pg.broadcast(&mut g[..2], 1).await.unwrap();
        pg.reduce(&mut y, ReduceOp::Max, 1).await.unwrap();
        assert_eq!(pg.all_gather_vec(&x).await.unwrap().len(), 6);
        pg.gather(None, &x, 1).await.unwrap();
        pg.scatter(&mut y, Some(&[0i64; 6]), 0).await.unwrap();
        pg.reduce_scatter(&mut y, &[0i64; 6], ReduceOp::Sum)
            .await
            .unwrap();
        pg.all_to_all_single(&mut y, &x, Some(&[1, 2]), None)
            .await
            .unwrap();
        pg.barrier().await.unwrap();
        pg.send(&x, 1, 7).await.unwrap();
        pg.recv(&mut y, 1, 8).await.unwrap();

        let seen = std::mem::take(&mut *rec.0.lock().unwrap());
        let s = |op, dtype, out_len, in_len, root, tag, extra: &str| Seen {
            op,
            dtype,
            out_len,
            in_len,
            root,
            tag,
            extra: extra.to_string(),
        };
        use DType::{BF16, I64, U8};
        let want = vec![
            s(OpKind::AllReduce, BF16, Some(6), None, 0, 0, "avg"),
            s(OpKind::Broadcast, BF16, Some(2), None, 1, 0, ""),
            s(OpKind::Reduce, I64, Some(3), None, 1, 0, "max"),
            s(OpKind::AllGather, I64, Some(6), Some(3), 0, 0, ""),
            s(OpKind::Gather, I64, None, Some(3), 1, 0, ""),
            s(OpKind::Scatter, I64, Some(3), Some(6), 0, 0, ""),
            s(OpKind::ReduceScatter, I64, Some(3), Some(6), 0, 0, "sum"),
            s(
                OpKind::AllToAll,
                I64,
                Some(3),
                Some(3),
                0,
                0,
                "Some([1, 2]) None",
            ),
            s(OpKind::Barrier, U8, None, None, 0, 0, ""),
            s(OpKind::Send, I64, None, Some(3), 0, 7, "to 1"),
            s(OpKind::Recv, I64, Some(3), None, 0, 8, "from 1"),
        ];
        assert_eq!(seen, want);
        let e = pg.new_group(&[0]).await.unwrap_err();
        assert!(
            e.to_string()
                .contains("recorder backend does not create subgroups"),
            "{e}"
        );
    }
}
