//! [`Tensor`]: one named value of a state dict or a checkpoint (dtype,
//! shape and little-endian bytes), shared by both.

use consort_comm::{DType, Element};

use crate::error::CheckpointError;

/// One tensor: dtype, shape, and its bytes (little-endian, row-major).
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Element type.
    pub dtype: DType,
    /// Dimensions (empty for a scalar).
    pub shape: Vec<usize>,
    /// `product(shape) * dtype.size_bytes()` bytes.
    pub data: Vec<u8>,
}

impl Tensor {
    /// A tensor from raw little-endian bytes; checks the length.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self, CheckpointError> {
        let want = shape
            .iter()
            .try_fold(dtype.size_bytes(), |acc, d| acc.checked_mul(*d));
        if want != Some(data.len()) {
            return Err(CheckpointError::Size {
                len: data.len(),
                shape,
                dtype: dtype.name(),
            });
        }
        Ok(Tensor { dtype, shape, data })
    }

    /// A tensor of `T` values (this host's byte order must be
    /// little-endian, as on x86-64 and aarch64).
    pub fn from_slice<T: Element>(
        shape: Vec<usize>,
        values: &[T],
    ) -> Result<Self, CheckpointError> {
        Self::new(T::DTYPE, shape, bytemuck::cast_slice(values).to_vec())
    }

    /// The values, if `T` is this tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Option<Vec<T>> {
        (T::DTYPE == self.dtype).then(|| bytemuck::pod_collect_to_vec(&self.data))
    }
}
