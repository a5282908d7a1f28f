//! [`Vals`]: a flat buffer of one float type, the storage of every shard,
//! gathered unit and optimizer slot.

use consort_comm::{Buffer, BufferMut, DType};

/// Values of one float dtype (the sharded strategies keep f32 and f64
/// parameters; half-precision parameters need f32 master weights, which
/// they do not keep yet).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Vals {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Runs `$body` with `$v` bound to the typed vector inside `$vals`.
macro_rules! with_vals {
    ($vals:expr, $v:ident => $body:expr) => {
        match $vals {
            $crate::shard::vals::Vals::F32($v) => $body,
            $crate::shard::vals::Vals::F64($v) => $body,
        }
    };
}
pub(crate) use with_vals;

impl Vals {
    /// `len` zeros of `dtype`, or `None` for a dtype the strategies do not
    /// keep.
    pub(crate) fn zeros(dtype: DType, len: usize) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Vals::F32(vec![0.0; len])),
            DType::F64 => Some(Vals::F64(vec![0.0; len])),
            _ => None,
        }
    }

    /// `len` zeros of the same dtype.
    pub(crate) fn zeros_like(&self, len: usize) -> Self {
        match self {
            Vals::F32(_) => Vals::F32(vec![0.0; len]),
            Vals::F64(_) => Vals::F64(vec![0.0; len]),
        }
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        with_vals!(self, v => v.len())
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        with_vals!(self, v => size_of_val(v.as_slice()))
    }

    /// The dtype.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Vals::F32(_) => DType::F32,
            Vals::F64(_) => DType::F64,
        }
    }

    /// Elements `range` as a new buffer.
    pub(crate) fn slice(&self, range: std::ops::Range<usize>) -> Self {
        match self {
            Vals::F32(v) => Vals::F32(v[range].to_vec()),
            Vals::F64(v) => Vals::F64(v[range].to_vec()),
        }
    }

    /// Copies little-endian `bytes` (whole elements, fitting) to
    /// `self[to..]`.
    pub(crate) fn copy_from_bytes(&mut self, to: usize, bytes: &[u8]) {
        with_vals!(self, v => {
            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut v[to..]);
            dst[..bytes.len()].copy_from_slice(bytes);
        })
    }

    /// Elements `range` as little-endian bytes.
    pub(crate) fn range_bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        with_vals!(self, v => bytemuck::cast_slice(&v[range]))
    }

    /// The whole buffer, for a collective's output.
    pub(crate) fn buf_mut(&mut self) -> BufferMut<'_> {
        with_vals!(self, v => BufferMut::from(v.as_mut_slice()))
    }

    /// Elements `range`, for a collective's input.
    pub(crate) fn buf(&self, range: std::ops::Range<usize>) -> Buffer<'_> {
        with_vals!(self, v => Buffer::from(&v[range]))
    }
}
