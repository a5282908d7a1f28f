//! Type-erased buffer views that cross the [`crate::Backend`] trait:
//! [`Buffer`] (read-only) and [`BufferMut`], each either host memory or
//! device memory.
//!
//! This module owns the rules for building a view safely. Host views come
//! from typed slices only, so they are always aligned for their dtype.
//! Device views carry a raw device pointer that consort-nccl hands to NCCL
//! without a host copy; CPU backends refuse them with `Unsupported`.

use crate::{CommError, DType, Element, Result};

/// A read-only host buffer: bytes plus the dtype they hold.
#[derive(Clone, Copy, Debug)]
pub struct HostSlice<'a> {
    dtype: DType,
    bytes: &'a [u8],
}

impl<'a> HostSlice<'a> {
    /// Views a typed slice.
    pub fn new<T: Element>(s: &'a [T]) -> Self {
        HostSlice {
            dtype: T::DTYPE,
            bytes: crate::dtype::as_bytes(s),
        }
    }

    /// Views raw bytes as `dtype`: `InvalidArgument` unless they hold a
    /// whole number of elements and start aligned for the dtype.
    pub fn from_bytes(dtype: DType, bytes: &'a [u8]) -> Result<Self> {
        check_bytes(dtype, bytes)?;
        Ok(HostSlice { dtype, bytes })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size_bytes()
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The raw bytes (native byte order).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Views the bytes as `T`; `InvalidArgument` if `T` is not the dtype.
    pub fn typed<T: Element>(&self) -> Result<&'a [T]> {
        check_dtype::<T>(self.dtype)?;
        Ok(bytemuck::cast_slice(self.bytes))
    }
}

/// Checks that `bytes` can be viewed as elements of `dtype`.
fn check_bytes(dtype: DType, bytes: &[u8]) -> Result<()> {
    let size = dtype.size_bytes();
    if !bytes.len().is_multiple_of(size) {
        return Err(CommError::invalid(format!(
            "{} bytes are not a whole number of {dtype} elements ({size} bytes each)",
            bytes.len()
        )));
    }
    if !(bytes.as_ptr() as usize).is_multiple_of(size) {
        return Err(CommError::invalid(format!(
            "the bytes are not aligned for {dtype}; use memory allocated as {dtype} (or wider)"
        )));
    }
    Ok(())
}

/// A mutable host buffer: bytes plus the dtype they hold.
#[derive(Debug)]
pub struct HostSliceMut<'a> {
    dtype: DType,
    bytes: &'a mut [u8],
}

impl<'a> HostSliceMut<'a> {
    /// Views a typed mutable slice.
    pub fn new<T: Element>(s: &'a mut [T]) -> Self {
        HostSliceMut {
            dtype: T::DTYPE,
            bytes: crate::dtype::as_bytes_mut(s),
        }
    }

    /// Views raw bytes as `dtype`: `InvalidArgument` unless they hold a
    /// whole number of elements and start aligned for the dtype.
    pub fn from_bytes(dtype: DType, bytes: &'a mut [u8]) -> Result<Self> {
        check_bytes(dtype, bytes)?;
        Ok(HostSliceMut { dtype, bytes })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size_bytes()
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The raw bytes (native byte order).
    pub fn bytes(&self) -> &[u8] {
        self.bytes
    }

    /// The raw bytes, mutably. Always aligned for the dtype.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes
    }

    /// The raw bytes, mutably, for the whole borrow.
    pub fn into_bytes_mut(self) -> &'a mut [u8] {
        self.bytes
    }

    /// A read-only view of the same memory.
    pub fn as_slice(&self) -> HostSlice<'_> {
        HostSlice {
            dtype: self.dtype,
            bytes: self.bytes,
        }
    }

    /// Views the bytes as `T`; `InvalidArgument` if `T` is not the dtype.
    pub fn typed_mut<T: Element>(&mut self) -> Result<&mut [T]> {
        check_dtype::<T>(self.dtype)?;
        Ok(bytemuck::cast_slice_mut(self.bytes))
    }
}

fn check_dtype<T: Element>(dtype: DType) -> Result<()> {
    if T::DTYPE == dtype {
        Ok(())
    } else {
        Err(CommError::invalid(format!(
            "buffer holds {dtype} but was read as {}",
            T::DTYPE
        )))
    }
}

/// Device memory that a GPU backend can use in place: a raw device pointer,
/// its length in elements, its dtype, the device ordinal and the stream the
/// data is ready on.
///
/// consort does not own or free this memory. Build one with
/// [`DeviceBuffer::new`], which is `unsafe` because consort cannot check the
/// pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    dtype: DType,
    device: i32,
    stream: u64,
}

impl DeviceBuffer {
    /// Describes `len` elements of `dtype` at device address `ptr` on device
    /// `device`, ready on `stream` (0 for the default stream).
    ///
    /// # Safety
    ///
    /// `ptr` must point to at least `len * dtype.size_bytes()` bytes of device
    /// memory on `device`, valid and not used by anything else for as long as
    /// any op that receives this buffer runs.
    pub unsafe fn new(ptr: u64, len: usize, dtype: DType, device: i32, stream: u64) -> Self {
        DeviceBuffer {
            ptr,
            len,
            dtype,
            device,
            stream,
        }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// The CUDA stream handle the data is ready on (0: default stream).
    pub fn stream(&self) -> u64 {
        self.stream
    }
}

/// A read-only buffer argument: host memory or device memory.
#[derive(Clone, Copy, Debug)]
pub enum Buffer<'a> {
    /// Host memory.
    Host(HostSlice<'a>),
    /// Device memory.
    Device(DeviceBuffer),
}

/// A mutable buffer argument: host memory or device memory.
#[derive(Debug)]
pub enum BufferMut<'a> {
    /// Host memory.
    Host(HostSliceMut<'a>),
    /// Device memory.
    Device(DeviceBuffer),
}

impl Buffer<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::Host(h) => h.dtype(),
            Buffer::Device(d) => d.dtype(),
        }
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        match self {
            Buffer::Host(h) => h.len(),
            Buffer::Device(d) => d.len(),
        }
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> Buffer<'a> {
    /// The host view, or `Unsupported` naming `backend` for device memory.
    pub fn host(self, backend: &str) -> Result<HostSlice<'a>> {
        match self {
            Buffer::Host(h) => Ok(h),
            Buffer::Device(_) => Err(device_unsupported(backend)),
        }
    }
}

impl BufferMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            BufferMut::Host(h) => h.dtype(),
            BufferMut::Device(d) => d.dtype(),
        }
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        match self {
            BufferMut::Host(h) => h.len(),
            BufferMut::Device(d) => d.len(),
        }
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reborrows for a shorter lifetime.
    pub fn reborrow(&mut self) -> BufferMut<'_> {
        match self {
            BufferMut::Host(h) => BufferMut::Host(HostSliceMut {
                dtype: h.dtype,
                bytes: h.bytes,
            }),
            BufferMut::Device(d) => BufferMut::Device(*d),
        }
    }
}

impl<'a> BufferMut<'a> {
    /// The host view, or `Unsupported` naming `backend` for device memory.
    pub fn host(self, backend: &str) -> Result<HostSliceMut<'a>> {
        match self {
            BufferMut::Host(h) => Ok(h),
            BufferMut::Device(_) => Err(device_unsupported(backend)),
        }
    }
}

fn device_unsupported(backend: &str) -> CommError {
    CommError::unsupported(format!(
        "the {backend} backend works on host memory and got a device buffer; copy it to the \
         host first, or use the nccl backend for GPU memory"
    ))
}

impl<'a, T: Element> From<&'a [T]> for Buffer<'a> {
    fn from(s: &'a [T]) -> Self {
        Buffer::Host(HostSlice::new(s))
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for Buffer<'a> {
    fn from(s: &'a Vec<T>) -> Self {
        Buffer::Host(HostSlice::new(s))
    }
}

impl<'a, T: Element> From<&'a mut [T]> for BufferMut<'a> {
    fn from(s: &'a mut [T]) -> Self {
        BufferMut::Host(HostSliceMut::new(s))
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for BufferMut<'a> {
    fn from(s: &'a mut Vec<T>) -> Self {
        BufferMut::Host(HostSliceMut::new(s))
    }
}

impl From<DeviceBuffer> for Buffer<'_> {
    fn from(d: DeviceBuffer) -> Self {
        Buffer::Device(d)
    }
}

impl From<DeviceBuffer> for BufferMut<'_> {
    fn from(d: DeviceBuffer) -> Self {
        BufferMut::Device(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn host_views_keep_dtype_and_length() {
        let mut v = vec![bf16::ONE; 5];
        let mut b = BufferMut::from(&mut v);
        assert_eq!(b.dtype(), DType::BF16);
        assert_eq!(b.len(), 5);
        let mut h = b.reborrow().host("sim").unwrap();
        assert_eq!(h.bytes().len(), 10);
        assert!(h.typed_mut::<f32>().is_err());
        h.typed_mut::<bf16>().unwrap()[0] = bf16::ZERO;
        assert_eq!(v[0], bf16::ZERO);
    }

    #[test]
    fn device_buffers_are_refused_by_host_backends() {
        // SAFETY: the buffer is only described, never dereferenced.
        let d = unsafe { DeviceBuffer::new(0x1000, 4, DType::F32, 0, 0) };
        let e = Buffer::from(d).host("tcp").unwrap_err();
        assert!(e.to_string().contains("use the nccl backend"), "{e}");
    }
}
