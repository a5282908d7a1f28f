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

    /// Performs a local copy.
    pub fn copy(&mut self, c: &LocalCopy) -> Result<()> {
        let src = self.bytes_range(&c.src);
        let dst = self.bytes_range(&c.dst);
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
        if rv.reduce {
            op.unwrap_or(ReduceOp::Sum).apply_bytes(dtype, dst, data)
        } else {
            dst.copy_from_slice(data);
            Ok(())
        }
    }

    /// Finishes the reduce op on the whole output (divides for Avg).
    pub fn finalize(&mut self, op: ReduceOp, world_size: usize) -> Result<()> {
        op.finalize_bytes(self.dtype, self.output, world_size)
    }
}
