//! What every driver does with a schedule's actions, written once: resolve
//! a [`Buf`] range to bytes, perform a [`LocalCopy`], apply a received
//! payload to a [`Receive`] (length check, copy or reduce), and finish the
//! reduce op. The simulator and the TCP backend both use [`CallBuffers`].

use std::ops::Range;

use super::{Buf, LocalCopy, Receive};
use crate::{CommError, DType, ReduceOp, Result};

/// The buffers of one call, as bytes.
#[derive(Debug)]
pub struct CallBuffers<'a> {
    /// Element type of every buffer.
    pub dtype: DType,
    /// The read-only input (empty when the op has none).
    pub input: &'a [u8],
    /// The output, or the in-place buffer.
    pub output: &'a mut [u8],
    /// The schedule's scratch space, `scratch_len` elements, 8-aligned.
    pub scratch: &'a mut [u8],
}

/// Scratch storage for `elements` of `dtype`, 8-byte aligned (so reduce
/// kernels take their fast path).
pub fn scratch(elements: usize, dtype: DType) -> Vec<u64> {
    vec![0u64; (elements * dtype.size_bytes()).div_ceil(8)]
}

/// Views scratch storage as bytes.
pub fn scratch_bytes(v: &mut [u64]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

impl CallBuffers<'_> {
    fn bytes_range(&self, r: &Range<usize>) -> Range<usize> {
        let e = self.dtype.size_bytes();
        r.start * e..r.end * e
    }

    /// The bytes of `range` in `buf`.
    pub fn bytes(&self, buf: Buf, range: &Range<usize>) -> &[u8] {
        let r = self.bytes_range(range);
        match buf {
            Buf::Input => &self.input[r],
            Buf::Output => &self.output[r],
            Buf::Scratch => &self.scratch[r],
        }
    }

    /// The bytes of `range` in `buf`, mutably (schedules never write the
    /// input; asking for it is an error, not a panic).
    pub fn bytes_mut(&mut self, buf: Buf, range: &Range<usize>) -> Result<&mut [u8]> {
        let r = self.bytes_range(range);
        match buf {
            Buf::Output => Ok(&mut self.output[r]),
            Buf::Scratch => Ok(&mut self.scratch[r]),
            Buf::Input => Err(CommError::protocol(
                None,
                "internal: a schedule wrote to the input",
            )),
        }
    }

    /// Performs a local copy, or with `c.reduce` combines the source into
    /// the destination with `op` (the call's; `Sum` where it has none).
    pub fn copy(&mut self, c: &LocalCopy, op: Option<ReduceOp>) -> Result<()> {
        let src = self.bytes_range(&c.src);
        let dst = self.bytes_range(&c.dst);
        if c.reduce {
            let (s, d): (&[u8], &mut [u8]) = match (c.src_buf, c.dst_buf) {
                (Buf::Input, Buf::Output) => (&self.input[src], &mut self.output[dst]),
                (Buf::Input, Buf::Scratch) => (&self.input[src], &mut self.scratch[dst]),
                (Buf::Output, Buf::Scratch) => (&self.output[src], &mut self.scratch[dst]),
                (Buf::Scratch, Buf::Output) => (&self.scratch[src], &mut self.output[dst]),
                _ => {
                    return Err(CommError::protocol(
                        None,
                        "internal: a schedule reduced within one buffer or into the input",
                    ));
                }
            };
            let pool = crate::par::Pool::shared();
            return crate::par::apply_bytes(pool, op.unwrap_or(ReduceOp::Sum), self.dtype, d, s);
        }
        match (c.src_buf, c.dst_buf) {
            (Buf::Input, Buf::Output) => self.output[dst].copy_from_slice(&self.input[src]),
            (Buf::Input, Buf::Scratch) => self.scratch[dst].copy_from_slice(&self.input[src]),
            (Buf::Scratch, Buf::Output) => self.output[dst].copy_from_slice(&self.scratch[src]),
            (Buf::Output, Buf::Scratch) => self.scratch[dst].copy_from_slice(&self.output[src]),
            (Buf::Output, Buf::Output) => self.output.copy_within(src, dst.start),
            (Buf::Scratch, Buf::Scratch) => self.scratch.copy_within(src, dst.start),
            (_, Buf::Input) => {
                return Err(CommError::protocol(
                    None,
                    "internal: a schedule copied into the input",
                ));
            }
        }
        Ok(())
    }

    /// Applies `data`, received from rank `from`, to the posted receive
    /// `rv`: checks its length, then copies it or combines it with `op`.
    pub fn apply(
        &mut self,
        rv: &Receive,
        data: &[u8],
        op: Option<ReduceOp>,
        from: usize,
    ) -> Result<()> {
        let elem = self.dtype.size_bytes();
        if data.len() != rv.range.len() * elem {
            return Err(CommError::invalid(format!(
                "rank {from} sent {} elements where this rank expects {}: the ranks disagree on \
                 lengths or split sizes",
                data.len() / elem,
                rv.range.len()
            )));
        }
        let dtype = self.dtype;
        let dst = self.bytes_mut(rv.buf, &rv.range)?;
        // Large ones over the rank's helper threads, where it has any.
        let pool = crate::par::Pool::shared();
        if rv.reduce {
            crate::par::apply_bytes(pool, op.unwrap_or(ReduceOp::Sum), dtype, dst, data)
        } else {
            crate::par::copy(pool, dst, data, false);
            Ok(())
        }
    }

    /// Finishes the reduce op on the whole output (divides for Avg).
    pub fn finalize(&mut self, op: ReduceOp, world_size: usize) -> Result<()> {
        op.finalize_bytes(self.dtype, self.output, world_size)
    }
}

use crate::{
    Buffer, BufferMut, CallOptions, ErrorContext, Fingerprint, GroupId, Op, OpKind, Shape, validate,
};

use super::CallSpec;

/// One call of one rank, checked and type-erased: what every backend's
/// `Backend` methods build before they drive a schedule. The argument rules
/// (lengths, roots, splits, peers, op × dtype) live here, once.
#[derive(Debug)]
pub struct Call<'a> {
    /// The op.
    pub op: OpKind,
    /// The reduce op of reducing collectives.
    pub reduce: Option<ReduceOp>,
    /// Element type.
    pub dtype: DType,
    /// What the call is, for its fingerprint ([`Op::shape`], computed
    /// once in [`Call::from_op`]).
    pub shape: Shape,
    /// The schedule's count (see [`CallSpec::count`]).
    pub spec_count: usize,
    /// The root, or the peer of send/recv.
    pub peer_or_root: usize,
    /// The send/recv tag.
    pub tag: u32,
    /// The read-only input bytes.
    pub input: &'a [u8],
    /// The output (or in-place) bytes.
    pub output: &'a mut [u8],
    /// all_to_all: elements sent to each rank.
    pub input_splits: Vec<usize>,
    /// all_to_all: elements received from each rank.
    pub output_splits: Vec<usize>,
    /// Whether this rank finishes the reduce op (Avg) on its output.
    pub finalize: bool,
    /// reduce_scatter with a pre-multiplied op ([`ReduceOp::prescale`]):
    /// this rank's input, scaled. The schedule reads it instead of
    /// `input` ([`Call::input_bytes`]); a driver that keeps raw pointers
    /// into it keeps it alive until the call ends.
    pub scaled_input: Option<Vec<u8>>,
}

fn ctx(op: OpKind, rank: usize) -> ErrorContext {
    ErrorContext {
        op: Some(op),
        rank: Some(rank),
        ..Default::default()
    }
}

impl<'a> Call<'a> {
    fn new(op: OpKind, dtype: DType, len: usize) -> Self {
        Call {
            op,
            reduce: None,
            dtype,
            shape: Shape {
                op,
                dtype,
                count: len as u64,
                root: 0,
                reduce_op: None,
            },
            spec_count: len,
            peer_or_root: 0,
            tag: 0,
            input: &[],
            output: &mut [],
            input_splits: Vec::new(),
            output_splits: Vec::new(),
            finalize: false,
            scaled_input: None,
        }
    }

    /// The bytes the schedule reads as this rank's input: the scaled copy
    /// when there is one, else `input`.
    pub fn input_bytes(&self) -> &[u8] {
        self.scaled_input.as_deref().unwrap_or(self.input)
    }

    /// The call for `op`, checked once by [`validate::op`] (the per-op
    /// constructors below check nothing again): one match over every op,
    /// for every backend that drives schedules.
    pub fn from_op(
        backend: &str,
        rank: usize,
        world: usize,
        op: Op<'a>,
        opts: &CallOptions,
    ) -> Result<Self> {
        validate::op(&op, rank, world, opts.root)?;
        let c = ctx(op.kind(), rank);
        let shape = op.shape(opts.root);
        let call = match op {
            Op::AllReduce { buf, op } => Call::all_reduce(backend, world, buf, op),
            Op::Broadcast { buf } => Call::broadcast(backend, buf, opts),
            Op::Reduce { buf, op } => Call::reduce(backend, rank, world, buf, op, opts),
            Op::AllGather { output, input } => Call::all_gather(backend, output, input),
            Op::Gather { output, input } => Call::gather(backend, output, input, opts),
            Op::Scatter { output, input } => Call::scatter(backend, output, input, opts),
            Op::ReduceScatter { output, input, op } => {
                Call::reduce_scatter(backend, world, output, input, op)
            }
            Op::AllToAll {
                output,
                input,
                output_splits,
                input_splits,
            } => Call::all_to_all(backend, world, output, input, output_splits, input_splits),
            Op::Barrier => Ok(Call::barrier()),
            Op::Send { buf, dst } => Call::send(backend, buf, dst, opts),
            Op::Recv { buf, src } => Call::recv(backend, buf, src, opts),
        };
        call.map(|call| Call { shape, ..call })
            .map_err(|e| e.with_context(c))
    }

    /// Whether this is a point-to-point call.
    pub fn is_p2p(&self) -> bool {
        matches!(self.op, OpKind::Send | OpKind::Recv)
    }

    /// The call's fingerprint at sequence number `seq` of `group`.
    pub fn fingerprint(&self, group: GroupId, seq: u64) -> Fingerprint {
        self.shape.at(group, seq)
    }

    /// What the schedule builder needs.
    pub fn spec(&self, rank: usize, world: usize) -> CallSpec<'_> {
        CallSpec {
            op: self.op,
            rank,
            world,
            count: self.spec_count,
            elem_size: self.dtype.size_bytes(),
            root: self.peer_or_root,
            tag: self.tag,
            input_splits: &self.input_splits,
            output_splits: &self.output_splits,
        }
    }

    /// `all_reduce`.
    fn all_reduce(backend: &str, world: usize, buf: BufferMut<'a>, op: ReduceOp) -> Result<Self> {
        let b = buf.host(backend)?;
        let (dtype, len) = (b.dtype(), b.len());
        let output = b.into_bytes_mut();
        op.prescale_bytes(dtype, output, world)?;
        Ok(Call {
            reduce: Some(op),
            output,
            finalize: true,
            ..Call::new(OpKind::AllReduce, dtype, len)
        })
    }

    /// `broadcast` from `opts.root`.
    fn broadcast(backend: &str, buf: BufferMut<'a>, opts: &CallOptions) -> Result<Self> {
        let b = buf.host(backend)?;
        let (dtype, len) = (b.dtype(), b.len());
        Ok(Call {
            peer_or_root: opts.root,
            output: b.into_bytes_mut(),
            ..Call::new(OpKind::Broadcast, dtype, len)
        })
    }

    /// `reduce` into `opts.root`.
    fn reduce(
        backend: &str,
        rank: usize,
        world: usize,
        buf: BufferMut<'a>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<Self> {
        let b = buf.host(backend)?;
        let (dtype, len) = (b.dtype(), b.len());
        // In place: a non-root's buffer is unspecified afterwards, as in torch.
        let output = b.into_bytes_mut();
        op.prescale_bytes(dtype, output, world)?;
        Ok(Call {
            reduce: Some(op),
            peer_or_root: opts.root,
            output,
            finalize: rank == opts.root,
            ..Call::new(OpKind::Reduce, dtype, len)
        })
    }

    /// `all_gather`.
    fn all_gather(backend: &str, output: BufferMut<'a>, input: Buffer<'a>) -> Result<Self> {
        let o = output.host(backend)?;
        let i = input.host(backend)?;
        Ok(Call {
            input: i.bytes(),
            output: o.into_bytes_mut(),
            ..Call::new(OpKind::AllGather, i.dtype(), i.len())
        })
    }

    /// `gather` into `opts.root` (only the root passes an output).
    fn gather(
        backend: &str,
        output: Option<BufferMut<'a>>,
        input: Buffer<'a>,
        opts: &CallOptions,
    ) -> Result<Self> {
        let i = input.host(backend)?;
        let out: &'a mut [u8] = match output {
            Some(o) => {
                let o = o.host(backend)?;
                o.into_bytes_mut()
            }
            None => &mut [],
        };
        Ok(Call {
            peer_or_root: opts.root,
            input: i.bytes(),
            output: out,
            ..Call::new(OpKind::Gather, i.dtype(), i.len())
        })
    }

    /// `scatter` from `opts.root` (only the root passes an input).
    fn scatter(
        backend: &str,
        output: BufferMut<'a>,
        input: Option<Buffer<'a>>,
        opts: &CallOptions,
    ) -> Result<Self> {
        let o = output.host(backend)?;
        let inp: &'a [u8] = match input {
            Some(i) => {
                let i = i.host(backend)?;
                i.bytes()
            }
            None => &[],
        };
        let (dtype, len) = (o.dtype(), o.len());
        Ok(Call {
            peer_or_root: opts.root,
            input: inp,
            output: o.into_bytes_mut(),
            ..Call::new(OpKind::Scatter, dtype, len)
        })
    }

    /// `reduce_scatter`.
    fn reduce_scatter(
        backend: &str,
        world: usize,
        output: BufferMut<'a>,
        input: Buffer<'a>,
        op: ReduceOp,
    ) -> Result<Self> {
        let o = output.host(backend)?;
        let i = input.host(backend)?;
        let (dtype, len) = (o.dtype(), o.len());
        let scaled_input = match op.prescale(dtype, world) {
            Some(_) => {
                let mut v = i.bytes().to_vec();
                op.prescale_bytes(dtype, &mut v, world)?;
                Some(v)
            }
            None => None,
        };
        Ok(Call {
            reduce: Some(op),
            input: i.bytes(),
            output: o.into_bytes_mut(),
            finalize: true,
            scaled_input,
            ..Call::new(OpKind::ReduceScatter, dtype, len)
        })
    }

    /// `all_to_all_single`, equal parts when a split list is `None`.
    fn all_to_all(
        backend: &str,
        world: usize,
        output: BufferMut<'a>,
        input: Buffer<'a>,
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
    ) -> Result<Self> {
        let o = output.host(backend)?;
        let i = input.host(backend)?;
        let ins = validate::splits(input_split_sizes, i.len(), world, "input")?;
        let outs = validate::splits(output_split_sizes, o.len(), world, "output")?;
        Ok(Call {
            input: i.bytes(),
            output: o.into_bytes_mut(),
            input_splits: ins,
            output_splits: outs,
            ..Call::new(OpKind::AllToAll, i.dtype(), i.len())
        })
    }

    /// `barrier`.
    fn barrier() -> Self {
        Call::new(OpKind::Barrier, DType::U8, 0)
    }

    /// `send` to `dst` with `opts.tag`.
    fn send(backend: &str, buf: Buffer<'a>, dst: usize, opts: &CallOptions) -> Result<Self> {
        let b = buf.host(backend)?;
        Ok(Call {
            peer_or_root: dst,
            tag: opts.tag,
            input: b.bytes(),
            ..Call::new(OpKind::Send, b.dtype(), b.len())
        })
    }

    /// `recv` from `src` with `opts.tag`.
    fn recv(backend: &str, buf: BufferMut<'a>, src: usize, opts: &CallOptions) -> Result<Self> {
        let b = buf.host(backend)?;
        let (dtype, len) = (b.dtype(), b.len());
        Ok(Call {
            peer_or_root: src,
            tag: opts.tag,
            output: b.into_bytes_mut(),
            ..Call::new(OpKind::Recv, dtype, len)
        })
    }
}
