//! [`Vals`]: a flat buffer of one float type, the storage of every shard,
//! gathered unit and optimizer slot: host vectors, or an allocation on the
//! model's device ([`DevVals`]), used stream-ordered on its compute stream.
//!
//! Host buffers never fail; a device buffer's every operation is an
//! enqueued device op, and may (the device's sticky error, a bad size).

use std::{borrow::Cow, ops::Range};

use consort_comm::{
    Buffer, BufferMut, CommError, DType, DeviceBuffer, Element, Placement,
    half::{bf16, f16},
};

use super::kernels::ShardKernels;

/// Values of one float dtype: f32 or f64 master parameters, gradients and
/// optimizer state; bf16 or f16 for mixed precision's compute copies and
/// reductions.
#[derive(Debug)]
pub(crate) enum Vals {
    F32(Vec<f32>),
    F64(Vec<f64>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    /// On the model's device.
    Dev(DevVals),
}

/// The float types a host [`Vals`] holds.
pub(crate) trait Float: Element + Copy {
    fn wrap(v: Vec<Self>) -> Vals;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

macro_rules! float {
    ($t:ty, $variant:ident, $to:expr, $from:expr) => {
        impl Float for $t {
            fn wrap(v: Vec<Self>) -> Vals {
                Vals::$variant(v)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
        }
    };
}
float!(f32, F32, f64::from, |v| v as f32);
float!(f64, F64, |v| v, |v| v);
float!(bf16, BF16, bf16::to_f64, bf16::from_f64);
float!(f16, F16, f16::to_f64, f16::from_f64);

/// `len` elements of `dtype` in one allocation of the placement's device,
/// freed (stream-ordered, after every use the compute stream has
/// enqueued or waits for) on drop.
#[derive(Debug)]
pub(crate) struct DevVals {
    place: Placement,
    /// 0 for an empty buffer (nothing allocated).
    ptr: u64,
    len: usize,
    dtype: DType,
}

impl Drop for DevVals {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by `Vals::zeros_on` on this device and freed
            // once, here; the compute stream orders the free after every op
            // it has enqueued on it, and every collective on it (the stream
            // waits for those).
            let _ = unsafe { self.place.device.free(self.ptr, self.place.stream) };
        }
    }
}

impl DevVals {
    /// The address of element `at`.
    pub(crate) fn addr(&self, at: usize) -> u64 {
        self.ptr + (at * self.dtype.size_bytes()) as u64
    }

    /// Elements `range` as a view on the compute stream.
    pub(crate) fn view(&self, range: Range<usize>) -> DeviceBuffer {
        // Callers pass the layout's ranges; a wrong one is a bug here.
        assert!(
            range.start <= range.end && range.end <= self.len,
            "a device view {range:?} of a flat buffer of {}",
            self.len
        );
        let len = range.len();
        // SAFETY: `range` lies in this live allocation (callers take ranges
        // of the layout, which sized it), and the view is used only by ops
        // enqueued on the compute stream before the allocation's free.
        unsafe { self.place.buffer(self.addr(range.start), len, self.dtype) }
    }

    /// The placement it lives on.
    pub(crate) fn place(&self) -> &Placement {
        &self.place
    }
}

/// Runs `$body` with `$v` bound to the typed vector inside `$vals`, or
/// `$dev` for a device buffer.
macro_rules! with_vals {
    ($vals:expr, $v:ident => $body:expr, $d:ident => $dev:expr) => {
        match $vals {
            $crate::shard::vals::Vals::F32($v) => $body,
            $crate::shard::vals::Vals::F64($v) => $body,
            $crate::shard::vals::Vals::BF16($v) => $body,
            $crate::shard::vals::Vals::F16($v) => $body,
            $crate::shard::vals::Vals::Dev($d) => $dev,
        }
    };
}
pub(crate) use with_vals;

/// A device op's error as this module's.
fn outside(range: &Range<usize>, len: usize) -> CommError {
    CommError::invalid(format!(
        "elements {range:?} of a flat buffer of {len}: out of range"
    ))
}

impl Vals {
    /// `len` zeros of `dtype` on the host, or `None` for a dtype the
    /// strategies do not keep (not a float).
    pub(crate) fn zeros(dtype: DType, len: usize) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Vals::F32(vec![0.0; len])),
            DType::F64 => Some(Vals::F64(vec![0.0; len])),
            DType::BF16 => Some(Vals::BF16(vec![bf16::ZERO; len])),
            DType::F16 => Some(Vals::F16(vec![f16::ZERO; len])),
            _ => None,
        }
    }

    /// `len` zeros of `dtype` (f32 or f64) where `place` says: its device,
    /// or the host.
    pub(crate) fn zeros_on(
        place: Option<&Placement>,
        dtype: DType,
        len: usize,
    ) -> Result<Self, CommError> {
        let Some(p) = place else {
            return Vals::zeros(dtype, len)
                .ok_or_else(|| CommError::invalid(format!("flat buffers of {dtype}")));
        };
        let bytes = len * dtype.size_bytes();
        let ptr = if bytes == 0 {
            0
        } else {
            p.device.alloc_zeroed(bytes, p.stream)?
        };
        Ok(Vals::Dev(DevVals {
            place: p.clone(),
            ptr,
            len,
            dtype,
        }))
    }

    /// Where it lives: `None` on the host.
    pub(crate) fn place(&self) -> Option<&Placement> {
        with_vals!(self, _v => None, d => Some(&d.place))
    }

    /// `len` zeros of the same dtype, in the same place.
    pub(crate) fn zeros_like(&self, len: usize) -> Result<Self, CommError> {
        Vals::zeros_on(self.place(), self.dtype(), len)
    }

    /// Takes the buffer out, leaving an empty one in the same place (which
    /// holds nothing, on the host or the device).
    pub(crate) fn take(&mut self) -> Result<Self, CommError> {
        let empty = self.zeros_like(0)?;
        Ok(std::mem::replace(self, empty))
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        with_vals!(self, v => v.len(), d => d.len)
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.len() * self.dtype().size_bytes()
    }

    /// The dtype.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Vals::F32(_) => DType::F32,
            Vals::F64(_) => DType::F64,
            Vals::BF16(_) => DType::BF16,
            Vals::F16(_) => DType::F16,
            Vals::Dev(d) => d.dtype,
        }
    }

    /// A copy (a device copy is enqueued on the compute stream).
    pub(crate) fn try_clone(&self) -> Result<Self, CommError> {
        self.slice(0..self.len())
    }

    /// Elements `range` as a new buffer in the same place.
    pub(crate) fn slice(&self, range: Range<usize>) -> Result<Self, CommError> {
        if range.end > self.len() || range.start > range.end {
            return Err(outside(&range, self.len()));
        }
        match self {
            Vals::F32(v) => Ok(Float::wrap(v[range].to_vec())),
            Vals::F64(v) => Ok(Float::wrap(v[range].to_vec())),
            Vals::BF16(v) => Ok(Float::wrap(v[range].to_vec())),
            Vals::F16(v) => Ok(Float::wrap(v[range].to_vec())),
            Vals::Dev(d) => {
                let out = self.zeros_like(range.len())?;
                if let Vals::Dev(o) = &out
                    && !range.is_empty()
                {
                    let bytes = range.len() * d.dtype.size_bytes();
                    // SAFETY: both ranges lie in live allocations of this
                    // device (checked above; `out` was sized for it).
                    unsafe {
                        d.place
                            .device
                            .copy(o.ptr, d.addr(range.start), bytes, d.place.stream)
                    }?;
                }
                Ok(out)
            }
        }
    }

    /// Copies little-endian `bytes` (whole elements, fitting) to
    /// `self[to..]`.
    pub(crate) fn copy_from_bytes(&mut self, to: usize, bytes: &[u8]) -> Result<(), CommError> {
        let size = self.dtype().size_bytes();
        let range = to..to + bytes.len() / size;
        if !bytes.len().is_multiple_of(size) || range.end > self.len() {
            return Err(outside(&range, self.len()));
        }
        with_vals!(self, v => {
            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut v[to..]);
            dst[..bytes.len()].copy_from_slice(bytes);
            Ok(())
        }, d => {
            if bytes.is_empty() {
                return Ok(());
            }
            // SAFETY: the range was checked to lie in this live allocation.
            unsafe { d.place.device.copy_from_host(d.addr(to), bytes, d.place.stream) }
        })
    }

    /// Elements `range` as little-endian bytes: borrowed on the host; a
    /// device buffer is read after its compute stream's work so far.
    pub(crate) fn read_bytes(&self, range: Range<usize>) -> Result<Cow<'_, [u8]>, CommError> {
        if range.end > self.len() || range.start > range.end {
            return Err(outside(&range, self.len()));
        }
        with_vals!(self, v => Ok(Cow::Borrowed(bytemuck::cast_slice(&v[range]))), d => {
            let mut out = vec![0u8; range.len() * d.dtype.size_bytes()];
            if !out.is_empty() {
                // SAFETY: the range was checked to lie in this allocation.
                unsafe { d.place.device.copy_to_host(&mut out, d.addr(range.start), d.place.stream) }?;
            }
            Ok(Cow::Owned(out))
        })
    }

    /// The whole buffer, for a collective's output.
    pub(crate) fn buf_mut(&mut self) -> BufferMut<'_> {
        with_vals!(self, v => BufferMut::from(v.as_mut_slice()), d => BufferMut::Device(d.view(0..d.len)))
    }

    /// Elements `range`, for a collective's input.
    pub(crate) fn buf(&self, range: Range<usize>) -> Buffer<'_> {
        with_vals!(self, v => Buffer::from(&v[range]), d => Buffer::Device(d.view(range)))
    }

    /// A copy in dtype `to` (rounded to nearest even), in the same place;
    /// a device copy runs `kernels`' cast on the compute stream.
    pub(crate) fn cast(
        &self,
        to: DType,
        kernels: Option<&dyn ShardKernels>,
    ) -> Result<Self, CommError> {
        if to == self.dtype() {
            return self.try_clone();
        }
        if let Vals::Dev(d) = self {
            let out = self.zeros_like_dtype(to, d.len)?;
            let (Some(k), Some(o)) = (kernels, out.dev()) else {
                return Err(CommError::invalid(
                    "a device cast without the device's kernels",
                ));
            };
            if d.len > 0 {
                // SAFETY: both buffers hold `len` live elements of their
                // dtypes on this device; `out` is new, used by nothing else.
                unsafe { k.cast(&d.place, (d.ptr, d.dtype), (o.ptr, to), d.len) }?;
            }
            return Ok(out);
        }
        fn to_f64<T: Float>(v: &[T]) -> Vec<f64> {
            v.iter().map(|x| x.to_f64()).collect()
        }
        let wide: Vec<f64> = with_vals!(self, v => to_f64(v), _d => unreachable!("handled above"));
        fn narrow<T: Float>(w: &[f64]) -> Vals {
            T::wrap(w.iter().map(|&x| T::from_f64(x)).collect())
        }
        match to {
            DType::F32 => Ok(narrow::<f32>(&wide)),
            DType::F64 => Ok(narrow::<f64>(&wide)),
            DType::BF16 => Ok(narrow::<bf16>(&wide)),
            DType::F16 => Ok(narrow::<f16>(&wide)),
            d => Err(CommError::invalid(format!("flat buffers of {d}"))),
        }
    }

    /// `len` zeros of `dtype`, in the same place.
    pub(crate) fn zeros_like_dtype(&self, dtype: DType, len: usize) -> Result<Self, CommError> {
        Vals::zeros_on(self.place(), dtype, len)
    }

    /// Multiplies elements `range` by `factor`; whether any was not finite
    /// before (mixed precision's unscale and overflow check, as torch's
    /// `GradScaler`). f32 only.
    pub(crate) fn unscale(
        &mut self,
        range: Range<usize>,
        factor: f64,
        kernels: Option<&dyn ShardKernels>,
    ) -> Result<bool, CommError> {
        if range.end > self.len() || range.start > range.end {
            return Err(outside(&range, self.len()));
        }
        match self {
            Vals::F32(v) => {
                let f = factor as f32;
                let mut found = false;
                for x in &mut v[range] {
                    found |= !x.is_finite();
                    *x *= f;
                }
                Ok(found)
            }
            Vals::Dev(d) if d.dtype == DType::F32 => {
                let k = kernels
                    .ok_or_else(|| CommError::invalid("a device unscale without the kernels"))?;
                if range.is_empty() {
                    return Ok(false);
                }
                // SAFETY: the range was checked to lie in this live f32
                // allocation.
                unsafe { k.unscale(&d.place, d.addr(range.start), range.len(), factor) }
            }
            _ => Err(CommError::invalid(format!(
                "loss scaling unscales f32 gradients, not {}",
                self.dtype()
            ))),
        }
    }

    /// The device buffer, if it is one.
    pub(crate) fn dev(&self) -> Option<&DevVals> {
        match self {
            Vals::Dev(d) => Some(d),
            _ => None,
        }
    }
}
