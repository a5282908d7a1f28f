//! [`ReduceOp`] and the element-wise kernels that combine two buffers.
//!
//! This module owns the arithmetic of every reduction, for every dtype, in
//! one place: the simulator, the TCP backend and the QUIC backend all call
//! [`ReduceOp::apply_bytes`] (or its typed twin [`ReduceOp::apply`]) on the
//! ranges a schedule names. NCCL reduces on the GPU and does not use it.
//!
//! # Numeric behaviour
//!
//! - **Sum, Prod, Avg** on floats follow IEEE 754: a NaN in either input
//!   gives NaN, `inf + -inf` is NaN, overflow gives ±inf. Results do not
//!   depend on the machine: the kernels do no reassociation.
//! - **f16 and bf16** are widened to f32, combined in f32, and rounded back
//!   once per combine (round to nearest even). A value past the half type's
//!   range becomes ±inf.
//! - **Min and Max** propagate NaN, like `torch.minimum` / `torch.maximum`:
//!   if either input is NaN the result is NaN. Between `-0.0` and `+0.0`
//!   either one may be returned.
//! - **Integers** wrap on overflow (two's complement), as PyTorch's C++
//!   kernels do. `Avg` on integers divides with truncation toward zero.
//! - **Avg** combines exactly like `Sum`. On integers, f32 and f64 the
//!   driver divides once at the end with [`ReduceOp::finalize`], after the
//!   last combine (Gloo's order). On f16 and bf16 each rank multiplies its
//!   own input by `1/world` first, with [`ReduceOp::prescale_bytes`], as
//!   NCCL does, so partial sums stay in range.
//! - **PremulSum** multiplies each rank's own input by that rank's factor
//!   ([`ReduceOp::prescale_bytes`]), then combines like `Sum`.
//! - **BAnd, BOr, BXor** exist for integer dtypes only; on a float dtype they
//!   return [`CommError::Unsupported`], never a silent bit-twiddle.

use std::fmt;

use half::{bf16, f16};

use crate::{CommError, DType, Element, Result};

/// A reduction, with the codes of c10d's `ReduceOp` enum. Two ops are
/// equal when their codes are, and for [`ReduceOp::PremulSum`] their
/// factors' bits too.
#[derive(Clone, Copy, Debug)]
#[repr(u8)]
pub enum ReduceOp {
    /// Element-wise sum (`ReduceOp.SUM`).
    Sum = 0,
    /// Element-wise mean over ranks (`ReduceOp.AVG`). Integers, f32 and f64
    /// are summed, then divided by the world size once at the end (as
    /// Gloo); f16 and bf16 are multiplied by `1/world` first and then
    /// summed (as NCCL), so that an average that fits the type never
    /// overflows on the way.
    Avg = 1,
    /// Element-wise product (`ReduceOp.PRODUCT`).
    Prod = 2,
    /// Element-wise minimum (`ReduceOp.MIN`); NaN propagates.
    Min = 3,
    /// Element-wise maximum (`ReduceOp.MAX`); NaN propagates.
    Max = 4,
    /// Bitwise and (`ReduceOp.BAND`), integer dtypes only.
    BAnd = 5,
    /// Bitwise or (`ReduceOp.BOR`), integer dtypes only.
    BOr = 6,
    /// Bitwise xor (`ReduceOp.BXOR`), integer dtypes only.
    BXor = 7,
    /// `PREMUL_SUM`: each rank multiplies its own input by its factor, then
    /// the products are summed (torch's `_make_nccl_premul_sum(factor)`).
    /// Floating dtypes only. Each rank may pass its own factor; only the op
    /// is compared across ranks. Make it with [`ReduceOp::premul_sum`].
    /// The scaling happens in the caller's buffer when the call is made,
    /// so a call that fails leaves it scaled (as after any failed call,
    /// its contents are unspecified).
    PremulSum(f64) = 8,
}

impl ReduceOp {
    /// Every op without a parameter, in code order ([`ReduceOp::PremulSum`]
    /// carries a factor and is not listed).
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// The c10d name, lower case.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Prod => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
            ReduceOp::PremulSum(_) => "premul_sum",
        }
    }

    /// `PREMUL_SUM` with this rank's `factor`: the sum over ranks of each
    /// rank's input times its own factor (torch's
    /// `dist._make_nccl_premul_sum(factor)`).
    pub const fn premul_sum(factor: f64) -> ReduceOp {
        ReduceOp::PremulSum(factor)
    }

    /// The c10d enum value.
    pub const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::BAnd => 5,
            ReduceOp::BOr => 6,
            ReduceOp::BXor => 7,
            ReduceOp::PremulSum(_) => 8,
        }
    }

    /// Decodes a c10d enum value; `None` for unknown codes. The factor of
    /// `PREMUL_SUM` (code 8) is each rank's own and not part of the code:
    /// it decodes as [`ReduceOp::PremulSum`] with factor 1.
    pub const fn from_code(code: u8) -> Option<ReduceOp> {
        if (code as usize) < Self::ALL.len() {
            Some(Self::ALL[code as usize])
        } else if code == 8 {
            Some(ReduceOp::PremulSum(1.0))
        } else {
            None
        }
    }

    /// The op as ranks compare it: [`ReduceOp::PremulSum`]'s factor, which
    /// each rank chooses for itself, set to 1.
    pub const fn compared(self) -> ReduceOp {
        match self {
            ReduceOp::PremulSum(_) => ReduceOp::PremulSum(1.0),
            op => op,
        }
    }

    /// Whether this is one of the bitwise ops.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }

    /// Whether this op is defined for `dtype`.
    pub const fn supports(self, dtype: DType) -> bool {
        match self {
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => !dtype.is_float(),
            ReduceOp::PremulSum(_) => dtype.is_float(),
            _ => true,
        }
    }

    /// `Ok` if this op is defined for `dtype`, else `Unsupported` with the
    /// alternative.
    pub fn check(self, dtype: DType) -> Result<()> {
        if self.supports(dtype) {
            return Ok(());
        }
        Err(CommError::unsupported(if self.is_bitwise() {
            format!(
                "ReduceOp::{self:?} is bitwise and {dtype} is a float dtype; bitwise reductions \
                 need an integer dtype (view the bits as u32/u16 first if that is what you mean)"
            )
        } else {
            format!(
                "ReduceOp::PremulSum scales by a float factor and {dtype} is an integer dtype; \
                 use it on f16, bf16, f32 or f64 (or multiply the integers yourself and use Sum)"
            )
        }))
    }

    /// The factor this rank multiplies its own input by before the first
    /// combine, if any: [`ReduceOp::PremulSum`]'s, and `1/world_size` for
    /// [`ReduceOp::Avg`] on f16 and bf16 (see [`ReduceOp::Avg`]).
    pub fn prescale(self, dtype: DType, world_size: usize) -> Option<f64> {
        match self {
            ReduceOp::PremulSum(f) => Some(f),
            ReduceOp::Avg if is_half(dtype) && world_size > 0 => Some(1.0 / world_size as f64),
            _ => None,
        }
    }

    /// Multiplies `buf` (elements of `dtype`, this rank's own input) by
    /// [`ReduceOp::prescale`]'s factor; nothing for other ops. Drivers call
    /// it once, before the schedule runs.
    pub fn prescale_bytes(self, dtype: DType, buf: &mut [u8], world_size: usize) -> Result<()> {
        let Some(f) = self.prescale(dtype, world_size) else {
            return Ok(());
        };
        self.check(dtype)?;
        match dtype {
            DType::F32 => scale_with(buf, |x: f32| (f64::from(x) * f) as f32),
            DType::F64 => scale_with(buf, |x: f64| x * f),
            DType::F16 => {
                let g = f as f32;
                scale_with(buf, |x: f16| f16::narrow(x.widen() * g))
            }
            DType::BF16 => {
                let g = f as f32;
                scale_with(buf, |x: bf16| bf16::narrow(x.widen() * g))
            }
            _ => {}
        }
        Ok(())
    }

    /// `dst[i] = dst[i] ⊕ src[i]` for every `i`.
    ///
    /// Errors: `InvalidArgument` if the lengths differ, `Unsupported` for a
    /// bitwise op on a float type.
    pub fn apply<T: Element>(self, dst: &mut [T], src: &[T]) -> Result<()> {
        self.apply_bytes(
            T::DTYPE,
            crate::dtype::as_bytes_mut(dst),
            crate::dtype::as_bytes(src),
        )
    }

    /// The type-erased form of [`ReduceOp::apply`], for drivers that hold
    /// bytes: both slices hold elements of `dtype` in native byte order.
    /// Either slice may be unaligned (a network receive buffer); the fast
    /// path runs when both are aligned.
    pub fn apply_bytes(self, dtype: DType, dst: &mut [u8], src: &[u8]) -> Result<()> {
        self.check(dtype)?;
        let size = dtype.size_bytes();
        if dst.len() != src.len() || !dst.len().is_multiple_of(size) {
            return Err(CommError::invalid(format!(
                "reduce {} needs two buffers of equal length in whole {dtype} elements; got {} \
                 and {} bytes",
                self.name(),
                dst.len(),
                src.len()
            )));
        }
        crate::with_dtype!(dtype, T => {
            let aligned = |p: *const u8| p.align_offset(align_of::<T>()) == 0;
            if aligned(dst.as_ptr()) && aligned(src.as_ptr()) {
                T::combine(self, bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
            } else {
                unaligned::<T>(self, dst, src);
            }
        });
        Ok(())
    }

    /// Finishes a reduction after the last combine: divides by `world_size`
    /// for [`ReduceOp::Avg`] on integers, f32 and f64, and does nothing for
    /// every other op (f16 and bf16 Avg divided first, in
    /// [`ReduceOp::prescale_bytes`]).
    pub fn finalize<T: Element>(self, dst: &mut [T], world_size: usize) -> Result<()> {
        self.finalize_bytes(T::DTYPE, crate::dtype::as_bytes_mut(dst), world_size)
    }

    /// The type-erased form of [`ReduceOp::finalize`]. `dst` must be aligned
    /// for `dtype` (it is the caller's output buffer).
    pub fn finalize_bytes(self, dtype: DType, dst: &mut [u8], world_size: usize) -> Result<()> {
        // f16 and bf16 were divided before the sum (`prescale`).
        if self != ReduceOp::Avg || is_half(dtype) {
            return Ok(());
        }
        divide_bytes(dtype, dst, world_size)
    }
}

impl PartialEq for ReduceOp {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (ReduceOp::PremulSum(a), ReduceOp::PremulSum(b)) => a.to_bits() == b.to_bits(),
            _ => self.code() == other.code(),
        }
    }
}

impl Eq for ReduceOp {}

impl std::hash::Hash for ReduceOp {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.code().hash(state);
        if let ReduceOp::PremulSum(f) = self {
            f.to_bits().hash(state);
        }
    }
}

/// `dst[i] /= world_size` for every element of `dtype` (integers truncate
/// toward zero; f16 and bf16 divide in f32 and round once). `dst` must be
/// aligned for `dtype`. What [`ReduceOp::finalize_bytes`] does for `Avg`,
/// for callers that divide on their own (DDP divides before it sums).
pub fn divide_bytes(dtype: DType, dst: &mut [u8], world_size: usize) -> Result<()> {
    if world_size == 0 {
        return Err(CommError::invalid("Avg over a world of 0 ranks"));
    }
    crate::with_dtype!(dtype, T => {
        let d = bytemuck::try_cast_slice_mut::<u8, T>(dst).map_err(|e| {
            CommError::invalid(format!("dividing needs an aligned {dtype} buffer: {e}"))
        })?;
        T::divide(d, world_size);
    });
    Ok(())
}

/// Whether `dtype` is one of the 16-bit floats.
fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// `x = f(x)` for every element of `buf`, aligned or not.
fn scale_with<T: Element + bytemuck::Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
    // The caller's buffer is aligned in practice: a plain loop there.
    if let Ok(xs) = bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        for x in xs {
            *x = f(*x);
        }
        return;
    }
    for chunk in buf.chunks_exact_mut(size_of::<T>()) {
        let x: T = bytemuck::pod_read_unaligned(chunk);
        chunk.copy_from_slice(bytemuck::bytes_of(&f(x)));
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Combines through aligned stack chunks when a slice is unaligned.
fn unaligned<T: Kernel>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    const N: usize = 512;
    let mut a = [T::zeroed(); N];
    let mut b = [T::zeroed(); N];
    let step = N * size_of::<T>();
    for (d, s) in dst.chunks_mut(step).zip(src.chunks(step)) {
        let n = d.len() / size_of::<T>();
        bytemuck::cast_slice_mut::<T, u8>(&mut a[..n]).copy_from_slice(d);
        bytemuck::cast_slice_mut::<T, u8>(&mut b[..n]).copy_from_slice(s);
        T::combine(op, &mut a[..n], &b[..n]);
        d.copy_from_slice(bytemuck::cast_slice::<T, u8>(&a[..n]));
    }
}

/// The per-type kernels. Callers have already checked lengths and op support.
trait Kernel: Element + bytemuck::Zeroable {
    fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]);
    fn divide(dst: &mut [Self], n: usize);
}

macro_rules! float_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            #[inline]
            fn combine(op: ReduceOp, dst: &mut [$t], src: &[$t]) {
                // Each arm is a plain loop over two equal-length slices so
                // that LLVM vectorises it.
                match op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => {
                        for (d, s) in dst.iter_mut().zip(src) { *d += *s; }
                    }
                    ReduceOp::Prod => {
                        for (d, s) in dst.iter_mut().zip(src) { *d *= *s; }
                    }
                    ReduceOp::Min => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            let m = if *s < *d { *s } else { *d };
                            *d = if s.is_nan() { *s } else { m };
                        }
                    }
                    ReduceOp::Max => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            let m = if *s > *d { *s } else { *d };
                            *d = if s.is_nan() { *s } else { m };
                        }
                    }
                    ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
                        debug_assert!(false, "bitwise op on a float reached the kernel");
                    }
                }
            }

            #[inline]
            fn divide(dst: &mut [$t], n: usize) {
                let n = n as $t;
                for d in dst.iter_mut() { *d /= n; }
            }
        }
    )*};
}
float_kernel!(f32, f64);

macro_rules! int_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            #[inline]
            fn combine(op: ReduceOp, dst: &mut [$t], src: &[$t]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => {
                        for (d, s) in dst.iter_mut().zip(src) { *d = d.wrapping_add(*s); }
                    }
                    ReduceOp::Prod => {
                        for (d, s) in dst.iter_mut().zip(src) { *d = d.wrapping_mul(*s); }
                    }
                    ReduceOp::Min => {
                        for (d, s) in dst.iter_mut().zip(src) { *d = (*d).min(*s); }
                    }
                    ReduceOp::Max => {
                        for (d, s) in dst.iter_mut().zip(src) { *d = (*d).max(*s); }
                    }
                    ReduceOp::BAnd => {
                        for (d, s) in dst.iter_mut().zip(src) { *d &= *s; }
                    }
                    ReduceOp::BOr => {
                        for (d, s) in dst.iter_mut().zip(src) { *d |= *s; }
                    }
                    ReduceOp::BXor => {
                        for (d, s) in dst.iter_mut().zip(src) { *d ^= *s; }
                    }
                }
            }

            #[inline]
            fn divide(dst: &mut [$t], n: usize) {
                // A world larger than the type's range divides everything to 0
                // (or -1..=1 for signed), which is what the true quotient
                // truncates to.
                match <$t>::try_from(n) {
                    Ok(n) => for d in dst.iter_mut() { *d /= n; },
                    Err(_) => for d in dst.iter_mut() { *d = ((*d as i128) / (n as i128)) as $t; },
                }
            }
        }
    )*};
}
int_kernel!(i8, u8, i32, i64, u32, u64);

/// The 16-bit floats: widened to f32 one element at a time, combined, and
/// narrowed back in the same pass (one read of each input, one write), with
/// branch-free conversions that LLVM vectorises on plain x86-64. The
/// `half` crate's conversions are scalar unless F16C is enabled at compile
/// time; on x86-64 with F16C, f16 takes a hardware path chosen at run time.
trait Half16: Kernel {
    fn widen(self) -> f32;
    fn narrow(v: f32) -> Self;
}

/// f16 bits to f32, exact (normals, subnormals, ±0, ±inf, NaN stays NaN).
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let em = (h & 0x7fff) << 13; // exponent and mantissa in f32 position
    let exp = em & (0x7c00 << 13);
    let normal = f32::from_bits(em + ((127 - 15) << 23));
    // Subnormals and zero: scale the mantissa by a magic multiplier, exact.
    let sub = f32::from_bits(em + (113 << 23)) - f32::from_bits(113 << 23);
    let special = f32::from_bits(em + ((255 - 31) << 23));
    let v = if exp == 0x7c00 << 13 {
        special
    } else if exp == 0 {
        sub
    } else {
        normal
    };
    f32::from_bits(v.to_bits() | sign)
}

/// f32 to f16 bits with round to nearest even; overflow gives ±inf, NaN
/// gives a quiet NaN.
#[inline(always)]
fn f32_to_f16_bits(f: f32) -> u16 {
    const F16_MAX: u32 = (127 + 16) << 23; // 65536.0: first value that overflows
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
    let bits = f.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let a = bits & 0x7fff_ffff;
    let inf_or_nan: u16 = if a > 0x7f80_0000 { 0x7e00 } else { 0x7c00 };
    // Subnormal results: adding the magic lets the FPU round, then subtract.
    let sub = (f32::from_bits(a) + f32::from_bits(DENORM_MAGIC))
        .to_bits()
        .wrapping_sub(DENORM_MAGIC) as u16;
    let odd = (a >> 13) & 1;
    let normal = (a
        .wrapping_add(((15u32.wrapping_sub(127)) << 23).wrapping_add(0xfff))
        .wrapping_add(odd)
        >> 13) as u16;
    let v = if a >= F16_MAX {
        inf_or_nan
    } else if a < (113 << 23) {
        sub
    } else {
        normal
    };
    v | sign
}

/// bf16 to f32 is a shift; f32 to bf16 rounds to nearest even and keeps NaN
/// a (quiet) NaN.
#[inline(always)]
fn f32_to_bf16_bits(f: f32) -> u16 {
    let b = f.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }
}

impl Half16 for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn narrow(v: f32) -> Self {
        f16::from_bits(f32_to_f16_bits(v))
    }
}

impl Half16 for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline(always)]
    fn narrow(v: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(v))
    }
}

/// `dst[i] = narrow(f(widen(dst[i]), widen(src[i])))`.
#[inline(always)]
fn fused<T: Half16>(dst: &mut [T], src: &[T], f: impl Fn(f32, f32) -> f32) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::narrow(f(d.widen(), s.widen()));
    }
}

/// The f32 semantics of each arithmetic op, shared by the 16-bit kernels.
#[inline(always)]
fn combine_half<T: Half16>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => fused(dst, src, |a, b| a + b),
        ReduceOp::Prod => fused(dst, src, |a, b| a * b),
        ReduceOp::Min => fused(dst, src, |a, b| {
            let m = if b < a { b } else { a };
            if b.is_nan() { b } else { m }
        }),
        ReduceOp::Max => fused(dst, src, |a, b| {
            let m = if b > a { b } else { a };
            if b.is_nan() { b } else { m }
        }),
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
            debug_assert!(false, "bitwise op on a float reached the kernel");
        }
    }
}

impl Kernel for bf16 {
    #[inline]
    fn combine(op: ReduceOp, dst: &mut [bf16], src: &[bf16]) {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() {
            // SAFETY: the CPU has AVX2, checked just above.
            unsafe { simd::combine_bf16(op, dst, src) };
            return;
        }
        combine_half(op, dst, src);
    }

    fn divide(dst: &mut [bf16], n: usize) {
        let n = n as f32;
        for d in dst.iter_mut() {
            *d = bf16::narrow(d.widen() / n);
        }
    }
}

impl Kernel for f16 {
    #[inline]
    fn combine(op: ReduceOp, dst: &mut [f16], src: &[f16]) {
        #[cfg(target_arch = "x86_64")]
        if simd::has_f16c() {
            // SAFETY: the CPU has F16C and AVX, checked just above.
            unsafe { simd::combine_f16(op, dst, src) };
            return;
        }
        combine_half(op, dst, src);
    }

    fn divide(dst: &mut [f16], n: usize) {
        let n = n as f32;
        for d in dst.iter_mut() {
            *d = f16::narrow(d.widen() / n);
        }
    }
}

pub mod copy;

/// The x86-64 SIMD paths of the 16-bit floats.
#[cfg(target_arch = "x86_64")]
mod simd;

#[cfg(test)]
mod tests;
