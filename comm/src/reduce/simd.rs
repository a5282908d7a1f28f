//! Eight-lane x86-64 paths for the 16-bit floats, chosen at run time: F16C
//! for f16, AVX2 integer shifts for bf16. Each widens eight elements, runs
//! the f32 kernel on them, and narrows back; [`combine_half`] does the tail,
//! so both paths share one definition of every op.

use std::arch::x86_64::{
    __m128i, __m256, _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128,
    _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_blendv_epi8, _mm256_blendv_ps,
    _mm256_castps_si256, _mm256_castsi256_ps, _mm256_castsi256_si128, _mm256_cmp_ps,
    _mm256_cmpgt_epi32, _mm256_cvtepu16_epi32, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_max_ps,
    _mm256_min_ps, _mm256_mul_ps, _mm256_or_si256, _mm256_packus_epi32, _mm256_permute4x64_epi64,
    _mm256_set1_epi32, _mm256_slli_epi32, _mm256_srli_epi32,
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
                    _mm256_blendv_ps(_mm256_min_ps(b, a), b, _mm256_cmp_ps::<_CMP_UNORD_Q>(b, b))
                };
                $body
            }
            ReduceOp::Max => {
                let $f = |a: __m256, b: __m256| {
                    _mm256_blendv_ps(_mm256_max_ps(b, a), b, _mm256_cmp_ps::<_CMP_UNORD_Q>(b, b))
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
