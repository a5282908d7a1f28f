//! Communication hooks: what DDP does to one bucket of gradients (torch's
//! `register_comm_hook`), and the aligned bucket storage they work on.
//!
//! Every built-in hook averages: it divides by the world size and sums.
//! [`CommHook::AllReduce`] is the default (`allreduce_hook`);
//! [`CommHook::Fp16Compress`] and [`CommHook::Bf16Compress`] cast an f32 or
//! f64 bucket to 16 bits for the wire and back (`fp16_compress_hook`,
//! `bf16_compress_hook`), halving the bytes at some precision cost.

use consort_comm::{
    Backend, BufferMut, CallOptions, CommError, DType, Element, ReduceOp, half, with_dtype,
};

/// Which reduction DDP runs on each bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CommHook {
    /// Divide by the world size, then all-reduce (sum): torch's default.
    #[default]
    AllReduce,
    /// Cast f32/f64 buckets to f16, divide, all-reduce, cast back
    /// (torch's `fp16_compress_hook`). 16-bit buckets go as they are.
    Fp16Compress,
    /// The same through bf16 (torch's `bf16_compress_hook`): f32's range,
    /// 8 bits of mantissa.
    Bf16Compress,
    /// torch's `powerSGD_hook`: each f32 gradient matrix (first dimension
    /// by the rest) that gains from it travels as rank-`rank` factors
    /// `P·Qᵀ`, with error feedback and warm-started `Q`; vectors, small
    /// matrices, other dtypes and the first `start_iter` synced steps are
    /// averaged exactly.
    PowerSgd {
        /// `matrix_approximation_rank`.
        rank: usize,
        /// `start_powerSGD_iter`: steps of plain all-reduce first.
        start_iter: u64,
    },
}

impl CommHook {
    /// The torch name of the hook.
    pub fn name(self) -> &'static str {
        match self {
            CommHook::AllReduce => "allreduce_hook",
            CommHook::Fp16Compress => "fp16_compress_hook",
            CommHook::Bf16Compress => "bf16_compress_hook",
            CommHook::PowerSgd { .. } => "powerSGD_hook",
        }
    }
}

/// Bucket storage: bytes in 8-byte-aligned memory, so that the bucket can
/// be viewed as any element type without copying.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Words {
    words: Vec<u64>,
    len: usize,
}

impl Words {
    pub(crate) fn zeroed(len: usize) -> Self {
        Words {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// The first `len / size_of::<T>()` elements as `T`.
    pub(crate) fn typed_mut<T: Element>(&mut self) -> &mut [T] {
        let n = self.len / size_of::<T>();
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }
}

/// Runs `hook` on one bucket of `dtype` in place: afterwards `data` holds
/// the average over the world (dividing by `world_size`).
pub(crate) async fn run_hook<B: Backend + ?Sized>(
    backend: &B,
    hook: CommHook,
    dtype: DType,
    data: &mut Words,
    opts: &CallOptions,
) -> Result<(), CommError> {
    let world = backend.world_size();
    let wire = match (hook, dtype) {
        (CommHook::Fp16Compress, DType::F32 | DType::F64) => Some(DType::F16),
        (CommHook::Bf16Compress, DType::F32 | DType::F64) => Some(DType::BF16),
        _ => None,
    };
    let Some(wire) = wire else {
        consort_comm::reduce::divide_bytes(dtype, data.bytes_mut(), world)?;
        return with_dtype!(dtype, T => {
            backend
                .all_reduce(BufferMut::from(data.typed_mut::<T>()), ReduceOp::Sum, opts)
                .await
        });
    };
    match (dtype, wire) {
        (DType::F32, DType::F16) => {
            compressed::<f32, half::f16, B>(backend, data, world, opts).await
        }
        (DType::F32, _) => compressed::<f32, half::bf16, B>(backend, data, world, opts).await,
        (_, DType::F16) => compressed::<f64, half::f16, B>(backend, data, world, opts).await,
        _ => compressed::<f64, half::bf16, B>(backend, data, world, opts).await,
    }
}

/// A bucket's float type (f32, f64): exact through f64.
trait Wide: Element + Copy {
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

impl Wide for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Wide for f64 {
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}

/// A 16-bit wire type: one rounding from f64 (f32 widens to f64 exactly,
/// so this equals rounding from f32 directly).
trait Narrow: Element + Copy {
    fn round(v: f64) -> Self;
    fn widen(self) -> f64;
}

impl Narrow for half::f16 {
    fn round(v: f64) -> Self {
        half::f16::from_f64(v)
    }
    fn widen(self) -> f64 {
        self.to_f64()
    }
}

impl Narrow for half::bf16 {
    fn round(v: f64) -> Self {
        half::bf16::from_f64(v)
    }
    fn widen(self) -> f64 {
        self.to_f64()
    }
}

/// Divide, cast to `N` for the wire, sum, cast back: one pass each way and
/// one allocation per bucket.
async fn compressed<W: Wide, N: Narrow, B: Backend + ?Sized>(
    backend: &B,
    data: &mut Words,
    world: usize,
    opts: &CallOptions,
) -> Result<(), CommError> {
    let mut wire: Vec<N> = data
        .typed_mut::<W>()
        .iter()
        .map(|&v| N::round(v.to_f64() / world as f64))
        .collect();
    backend
        .all_reduce(BufferMut::from(&mut wire), ReduceOp::Sum, opts)
        .await?;
    for (d, s) in data.typed_mut::<W>().iter_mut().zip(&wire) {
        *d = W::from_f64(s.widen());
    }
    Ok(())
}
