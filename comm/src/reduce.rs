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
        if dst.len() != src.len() || dst.len() % size != 0 {
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

/// Eight-lane x86-64 paths for the 16-bit floats, chosen at run time: F16C
/// for f16, AVX2 integer shifts for bf16. Each widens eight elements, runs
/// the f32 kernel on them, and narrows back; [`combine_half`] does the tail,
/// so both paths share one definition of every op.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::{
        __m128i, __m256, _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128,
        _mm_storeu_si128, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_blendv_epi8,
        _mm256_blendv_ps, _mm256_castps_si256, _mm256_castsi256_ps, _mm256_castsi256_si128,
        _mm256_cmp_ps, _mm256_cmpgt_epi32, _mm256_cvtepu16_epi32, _mm256_cvtph_ps, _mm256_cvtps_ph,
        _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps, _mm256_or_si256, _mm256_packus_epi32,
        _mm256_permute4x64_epi64, _mm256_set1_epi32, _mm256_slli_epi32, _mm256_srli_epi32,
    };
    use std::sync::OnceLock;

    use half::{bf16, f16};

    use super::{ReduceOp, combine_half};

    pub(super) fn has_f16c() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::is_x86_feature_detected!("f16c") && std::is_x86_feature_detected!("avx")
        })
    }

    pub(super) fn has_avx2() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| std::is_x86_feature_detected!("avx2"))
    }

    /// Expands `$body` once per arithmetic op with `$f` bound to that op's
    /// eight-lane form, so the op is matched once per call, not per vector.
    /// Min and Max keep the scalar kernel's NaN rule: `min_ps(b, a)` is
    /// `b < a ? b : a`, and a NaN `b` is then chosen explicitly.
    macro_rules! per_op {
        ($op:expr, $f:ident => $body:block) => {
            match $op {
                ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => {
                    let $f = |a: __m256, b: __m256| _mm256_add_ps(a, b);
                    $body
                }
                ReduceOp::Prod => {
                    let $f = |a: __m256, b: __m256| _mm256_mul_ps(a, b);
                    $body
                }
                ReduceOp::Min => {
                    let $f = |a: __m256, b: __m256| {
                        _mm256_blendv_ps(
                            _mm256_min_ps(b, a),
                            b,
                            _mm256_cmp_ps::<_CMP_UNORD_Q>(b, b),
                        )
                    };
                    $body
                }
                ReduceOp::Max => {
                    let $f = |a: __m256, b: __m256| {
                        _mm256_blendv_ps(
                            _mm256_max_ps(b, a),
                            b,
                            _mm256_cmp_ps::<_CMP_UNORD_Q>(b, b),
                        )
                    };
                    $body
                }
                ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
                    debug_assert!(false, "bitwise op on a float reached the kernel");
                }
            }
        };
    }

    /// # Safety
    ///
    /// The CPU must support F16C and AVX.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn combine_f16(op: ReduceOp, dst: &mut [f16], src: &[f16]) {
        let n = dst.len().min(src.len());
        let body = n - n % 8;
        per_op!(op, f => {
            for i in (0..body).step_by(8) {
                // SAFETY: i + 8 <= body <= the length of both slices;
                // 16-byte unaligned loads and stores.
                unsafe {
                    let pd = dst.as_mut_ptr().add(i).cast::<__m128i>();
                    let ps = src.as_ptr().add(i).cast::<__m128i>();
                    let a = _mm256_cvtph_ps(_mm_loadu_si128(pd));
                    let b = _mm256_cvtph_ps(_mm_loadu_si128(ps));
                    let r = f(a, b);
                    _mm_storeu_si128(pd, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
                }
            }
        });
        combine_half(op, &mut dst[body..n], &src[body..n]);
    }

    /// # Safety
    ///
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn combine_bf16(op: ReduceOp, dst: &mut [bf16], src: &[bf16]) {
        let n = dst.len().min(src.len());
        let body = n - n % 8;
        per_op!(op, f => {
            for i in (0..body).step_by(8) {
                // SAFETY: i + 8 <= body <= the length of both slices;
                // 16-byte unaligned loads and stores.
                unsafe {
                    let pd = dst.as_mut_ptr().add(i).cast::<__m128i>();
                    let ps = src.as_ptr().add(i).cast::<__m128i>();
                    let a = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                        _mm_loadu_si128(pd),
                    )));
                    let b = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                        _mm_loadu_si128(ps),
                    )));
                    let r = _mm256_castps_si256(f(a, b));
                    // Round to nearest even; NaN stays a quiet NaN (as
                    // f32_to_bf16_bits does).
                    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(r), _mm256_set1_epi32(1));
                    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
                        r,
                        _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb),
                    ));
                    let quiet =
                        _mm256_or_si256(_mm256_srli_epi32::<16>(r), _mm256_set1_epi32(0x40));
                    let abs = _mm256_and_si256(r, _mm256_set1_epi32(0x7fff_ffff));
                    let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
                    let v = _mm256_blendv_epi8(rounded, quiet, is_nan);
                    // Every lane is <= 0xffff, so the unsigned-saturating
                    // pack is exact; the permute gathers the two halves.
                    let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(v, v));
                    _mm_storeu_si128(pd, _mm256_castsi256_si128(packed));
                }
            }
        });
        combine_half(op, &mut dst[body..n], &src[body..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitwise_on_floats_is_unsupported_for_every_float_dtype() {
        for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
            let mut d = [1.0f32];
            let e = op.apply(&mut d, &[2.0]).unwrap_err();
            assert!(matches!(e, CommError::Unsupported { .. }), "{e}");
            for dt in [DType::F64, DType::F16, DType::BF16] {
                assert!(op.check(dt).is_err());
            }
            assert!(op.check(DType::I32).is_ok());
        }
    }

    #[test]
    fn length_mismatch_is_an_error_not_a_panic() {
        let mut d = [1i32, 2];
        assert!(matches!(
            ReduceOp::Sum.apply(&mut d, &[1]),
            Err(CommError::InvalidArgument { .. })
        ));
        let mut bytes = [0u8; 6];
        assert!(
            ReduceOp::Sum
                .apply_bytes(DType::F32, &mut bytes, &[0u8; 6])
                .is_err()
        );
    }

    #[test]
    fn nan_and_inf_behave_as_documented() {
        let mut d = [f32::NAN, 1.0, 1.0, f32::INFINITY];
        ReduceOp::Min
            .apply(&mut d, &[0.0, f32::NAN, 2.0, f32::NEG_INFINITY])
            .unwrap();
        assert!(d[0].is_nan() && d[1].is_nan());
        assert_eq!(d[2], 1.0);
        assert_eq!(d[3], f32::NEG_INFINITY);
        let mut s = [f32::INFINITY];
        ReduceOp::Sum.apply(&mut s, &[f32::NEG_INFINITY]).unwrap();
        assert!(s[0].is_nan());
        let mut h = [f16::MAX];
        ReduceOp::Sum.apply(&mut h, &[f16::MAX]).unwrap();
        assert_eq!(h[0], f16::INFINITY);
    }

    #[test]
    fn half_conversions_match_the_half_crate_exhaustively() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let w = f16_bits_to_f32(bits);
            assert!(
                w.to_bits() == h.to_f32().to_bits() || (w.is_nan() && h.is_nan()),
                "{bits:#x}"
            );
            let b = bf16::from_bits(bits);
            let f = f32::from_bits(u32::from(bits) << 16);
            assert!(f.to_bits() == b.to_f32().to_bits() || (f.is_nan() && b.is_nan()));
        }
        // Narrowing: every f32 whose low bits sit at and around each f16 and
        // bf16 rounding boundary, plus specials.
        let mut probes = vec![
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            65504.0,
            65520.0,
            65519.99,
            1e-8,
            5.96e-8,
            2.98e-8,
            2.99e-8,
            f32::MAX,
            f32::MIN_POSITIVE,
        ];
        for bits in (0..=u32::MAX).step_by(4099) {
            probes.push(f32::from_bits(bits));
        }
        for h in (0..=u16::MAX).step_by(7) {
            let base = u32::from(h) << 16;
            for low in [0u32, 0x7fff, 0x8000, 0x8001, 0xffff] {
                probes.push(f32::from_bits(base | low));
            }
            let x = f16::from_bits(h).to_f32().to_bits();
            for d in [0u32, 1, 0xfff, 0x1000, 0x1001, 0x2000] {
                probes.push(f32::from_bits(x.wrapping_add(d)));
                probes.push(f32::from_bits(x.wrapping_sub(d)));
            }
        }
        for p in probes {
            let want = f16::from_f32(p);
            let got = f16::from_bits(f32_to_f16_bits(p));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "f16 {p:e} ({:#x}): {:#x} vs {:#x}",
                p.to_bits(),
                got.to_bits(),
                want.to_bits()
            );
            let want = bf16::from_f32(p);
            let got = bf16::from_bits(f32_to_bf16_bits(p));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "bf16 {p:e}"
            );
        }
    }

    /// The portable 16-bit path, which CPUs without F16C/AVX2 take, gives
    /// the same bits as the dispatched one.
    #[test]
    fn portable_and_dispatched_half_paths_agree() {
        let vals: Vec<f32> = (0..1000)
            .map(|i| (i as f32 - 500.0) * 0.37)
            .chain([f32::NAN, f32::INFINITY, -0.0, 70000.0, 1e-7])
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            let d16: Vec<f16> = vals.iter().map(|v| f16::from_f32(*v)).collect();
            let s16: Vec<f16> = vals.iter().rev().map(|v| f16::from_f32(*v)).collect();
            let (mut a, mut b) = (d16.clone(), d16);
            combine_half(op, &mut a, &s16);
            op.apply(&mut b, &s16).unwrap();
            assert!(
                a.iter()
                    .zip(&b)
                    .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())),
                "f16 {op}"
            );
            let d: Vec<bf16> = vals.iter().map(|v| bf16::from_f32(*v)).collect();
            let s: Vec<bf16> = vals.iter().rev().map(|v| bf16::from_f32(*v)).collect();
            let (mut a, mut b) = (d.clone(), d);
            combine_half(op, &mut a, &s);
            op.apply(&mut b, &s).unwrap();
            assert!(
                a.iter()
                    .zip(&b)
                    .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())),
                "bf16 {op}"
            );
        }
    }

    #[test]
    fn premul_sum_scales_first_and_compares_without_its_factor() {
        let op = ReduceOp::premul_sum(0.5);
        let mut x = [2.0f32, -3.0];
        op.prescale_bytes(DType::F32, crate::dtype::as_bytes_mut(&mut x), 4)
            .unwrap();
        assert_eq!(x, [1.0, -1.5]);
        op.apply(&mut x, &[1.0, 1.0]).unwrap();
        op.finalize(&mut x, 4).unwrap();
        assert_eq!(x, [2.0, -0.5]);
        assert_eq!(op.code(), 8);
        assert_eq!(ReduceOp::from_code(8), Some(ReduceOp::premul_sum(1.0)));
        assert_eq!(op.compared(), ReduceOp::premul_sum(3.0).compared());
        assert_ne!(op, ReduceOp::premul_sum(3.0));
        assert!(matches!(
            op.check(DType::I32),
            Err(CommError::Unsupported { .. })
        ));
        assert_eq!(ReduceOp::Sum.prescale(DType::F32, 4), None);
    }

    #[test]
    fn half_avg_divides_before_the_sum_and_stays_in_range() {
        let n = 4;
        let mut a = [f16::from_f32(60000.0); 2];
        let mut b = a;
        for v in [&mut a, &mut b] {
            ReduceOp::Avg
                .prescale_bytes(DType::F16, crate::dtype::as_bytes_mut(v), n)
                .unwrap();
        }
        for _ in 1..n {
            ReduceOp::Avg.apply(&mut a, &b).unwrap();
        }
        ReduceOp::Avg.finalize(&mut a, n).unwrap();
        assert_eq!(a[0].to_f32(), 60000.0);
        // f32 still divides once at the end, as Gloo does.
        assert_eq!(ReduceOp::Avg.prescale(DType::F32, n), None);
        assert_eq!(ReduceOp::Avg.prescale(DType::BF16, n), Some(0.25));
    }

    #[test]
    fn avg_divides_once_in_finalize() {
        let mut d = [2.0f32, 4.0];
        ReduceOp::Avg.apply(&mut d, &[4.0, 8.0]).unwrap();
        assert_eq!(d, [6.0, 12.0]);
        ReduceOp::Avg.finalize(&mut d, 2).unwrap();
        assert_eq!(d, [3.0, 6.0]);
        let mut i = [-7i32, 7];
        ReduceOp::Avg.finalize(&mut i, 2).unwrap();
        assert_eq!(i, [-3, 3]);
        let mut u = [200u8];
        ReduceOp::Avg.finalize(&mut u, 1000).unwrap();
        assert_eq!(u, [0]);
        ReduceOp::Sum.finalize(&mut d, 0).unwrap();
        assert!(ReduceOp::Avg.finalize(&mut d, 0).is_err());
    }

    #[test]
    fn unaligned_source_bytes_give_the_same_result() {
        let dst: Vec<f64> = (0..1000).map(|i| i as f64).collect();
        let src: Vec<f64> = (0..1000).map(|i| (i * 3) as f64).collect();
        let mut want = dst.clone();
        ReduceOp::Sum.apply(&mut want, &src).unwrap();

        let mut shifted = vec![0u8; 8001];
        shifted[1..].copy_from_slice(bytemuck::cast_slice(&src));
        let mut got = dst.clone();
        ReduceOp::Sum
            .apply_bytes(
                DType::F64,
                bytemuck::cast_slice_mut(&mut got),
                &shifted[1..],
            )
            .unwrap();
        assert_eq!(got, want);
    }

    /// Properties against a scalar reference, one module per dtype × op.
    mod proptests {
        use super::super::*;
        use proptest::prelude::*;

        /// The reference: one element at a time, written from the documented
        /// semantics rather than from the kernels.
        fn reference_f32(op: ReduceOp, a: f32, b: f32) -> f32 {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Min if a.is_nan() || b.is_nan() => f32::NAN,
                ReduceOp::Max if a.is_nan() || b.is_nan() => f32::NAN,
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
                _ => unreachable!(),
            }
        }

        fn reference_f64(op: ReduceOp, a: f64, b: f64) -> f64 {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Min if a.is_nan() || b.is_nan() => f64::NAN,
                ReduceOp::Max if a.is_nan() || b.is_nan() => f64::NAN,
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
                _ => unreachable!(),
            }
        }

        macro_rules! reference_int {
            ($name:ident, $t:ty) => {
                fn $name(op: ReduceOp, a: $t, b: $t) -> $t {
                    match op {
                        ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                        ReduceOp::Prod => a.wrapping_mul(b),
                        ReduceOp::Min => std::cmp::min(a, b),
                        ReduceOp::Max => std::cmp::max(a, b),
                        ReduceOp::BAnd => a & b,
                        ReduceOp::BOr => a | b,
                        ReduceOp::BXor => a ^ b,
                        ReduceOp::PremulSum(_) => unreachable!(),
                    }
                }
            };
        }
        reference_int!(reference_i8, i8);
        reference_int!(reference_u8, u8);
        reference_int!(reference_i32, i32);
        reference_int!(reference_i64, i64);
        reference_int!(reference_u32, u32);
        reference_int!(reference_u64, u64);

        /// Equal, treating every NaN as equal to every NaN, and ±0 as equal
        /// (the documented freedom of Min/Max).
        fn same_f64(a: f64, b: f64) -> bool {
            (a.is_nan() && b.is_nan()) || a == b
        }

        fn floats_f32() -> impl Strategy<Value = f32> + Clone {
            prop_oneof![
                4 => (-1000i32..1000).prop_map(|v| v as f32 * 0.25),
                1 => proptest::num::f32::ANY,
            ]
        }

        fn floats_f64() -> impl Strategy<Value = f64> + Clone {
            prop_oneof![
                4 => (-1000i32..1000).prop_map(|v| v as f64 * 0.25),
                1 => proptest::num::f64::ANY,
            ]
        }

        fn pairs<S: Strategy + Clone>(s: S) -> impl Strategy<Value = Vec<(S::Value, S::Value)>>
        where
            S::Value: std::fmt::Debug,
        {
            proptest::collection::vec((s.clone(), s), 0..700)
        }

        fn arith_op() -> impl Strategy<Value = ReduceOp> {
            prop::sample::select(vec![
                ReduceOp::Sum,
                ReduceOp::Avg,
                ReduceOp::Prod,
                ReduceOp::Min,
                ReduceOp::Max,
            ])
        }

        fn any_op() -> impl Strategy<Value = ReduceOp> {
            prop::sample::select(ReduceOp::ALL.to_vec())
        }

        macro_rules! int_property {
            ($name:ident, $t:ty, $reference:ident) => {
                proptest! {
                    #[test]
                    fn $name(op in any_op(), v in pairs(any::<$t>())) {
                        let (mut d, s): (Vec<$t>, Vec<$t>) = v.into_iter().unzip();
                        let want: Vec<$t> =
                            d.iter().zip(&s).map(|(a, b)| $reference(op, *a, *b)).collect();
                        op.apply(&mut d, &s).unwrap();
                        prop_assert_eq!(d, want);
                    }
                }
            };
        }
        int_property!(i8_matches_reference, i8, reference_i8);
        int_property!(u8_matches_reference, u8, reference_u8);
        int_property!(i32_matches_reference, i32, reference_i32);
        int_property!(i64_matches_reference, i64, reference_i64);
        int_property!(u32_matches_reference, u32, reference_u32);
        int_property!(u64_matches_reference, u64, reference_u64);

        proptest! {
            #[test]
            fn f32_matches_reference(op in arith_op(), v in pairs(floats_f32())) {
                let (mut d, s): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
                let want: Vec<f32> =
                    d.iter().zip(&s).map(|(a, b)| reference_f32(op, *a, *b)).collect();
                op.apply(&mut d, &s).unwrap();
                for (g, w) in d.iter().zip(&want) {
                    prop_assert!(same_f64(*g as f64, *w as f64), "{} vs {}", g, w);
                }
            }

            #[test]
            fn f64_matches_reference(op in arith_op(), v in pairs(floats_f64())) {
                let (mut d, s): (Vec<f64>, Vec<f64>) = v.into_iter().unzip();
                let want: Vec<f64> =
                    d.iter().zip(&s).map(|(a, b)| reference_f64(op, *a, *b)).collect();
                op.apply(&mut d, &s).unwrap();
                for (g, w) in d.iter().zip(&want) {
                    prop_assert!(same_f64(*g, *w), "{} vs {}", g, w);
                }
            }

            #[test]
            fn f16_matches_f32_reference(op in arith_op(), v in pairs(floats_f32())) {
                let (d0, s0): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
                let mut d: Vec<f16> = d0.iter().map(|x| f16::from_f32(*x)).collect();
                let s: Vec<f16> = s0.iter().map(|x| f16::from_f32(*x)).collect();
                let want: Vec<f16> = d.iter().zip(&s)
                    .map(|(a, b)| f16::from_f32(reference_f32(op, a.to_f32(), b.to_f32())))
                    .collect();
                op.apply(&mut d, &s).unwrap();
                for (g, w) in d.iter().zip(&want) {
                    prop_assert!(same_f64(g.to_f64(), w.to_f64()), "{} vs {}", g, w);
                }
            }

            #[test]
            fn bf16_matches_f32_reference(op in arith_op(), v in pairs(floats_f32())) {
                let (d0, s0): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
                let mut d: Vec<bf16> = d0.iter().map(|x| bf16::from_f32(*x)).collect();
                let s: Vec<bf16> = s0.iter().map(|x| bf16::from_f32(*x)).collect();
                let want: Vec<bf16> = d.iter().zip(&s)
                    .map(|(a, b)| bf16::from_f32(reference_f32(op, a.to_f32(), b.to_f32())))
                    .collect();
                op.apply(&mut d, &s).unwrap();
                for (g, w) in d.iter().zip(&want) {
                    prop_assert!(same_f64(g.to_f64(), w.to_f64()), "{} vs {}", g, w);
                }
            }

            #[test]
            fn avg_finalize_matches_division(
                v in proptest::collection::vec(-1_000_000i64..1_000_000, 0..300),
                n in 1usize..70,
            ) {
                let mut f: Vec<f64> = v.iter().map(|x| *x as f64).collect();
                let mut i = v.clone();
                ReduceOp::Avg.finalize(&mut f, n).unwrap();
                ReduceOp::Avg.finalize(&mut i, n).unwrap();
                for ((x, got_f), got_i) in v.iter().zip(&f).zip(&i) {
                    prop_assert_eq!(*got_f, *x as f64 / n as f64);
                    prop_assert_eq!(*got_i, *x / n as i64);
                }
            }
        }
    }
}
