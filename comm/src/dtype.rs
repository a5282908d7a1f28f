//! Element types: the [`DType`] tag that travels on the wire and the sealed
//! [`Element`] trait that ties a Rust type to it.
//!
//! This module owns the mapping between Rust scalar types and consort's dtype
//! codes, and the safe byte views of typed slices. It does not own any
//! arithmetic; that lives in [`crate::reduce`].

use std::fmt;

use half::{bf16, f16};

/// The element type of a buffer, as it is named on the wire and in errors.
///
/// The discriminants are part of consort's frame format (see
/// [`crate::frame`]) and never change meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum DType {
    /// 32-bit IEEE 754 float (`torch.float32`).
    F32 = 0,
    /// 64-bit IEEE 754 float (`torch.float64`).
    F64 = 1,
    /// 16-bit IEEE 754 half float (`torch.float16`); reduced in f32.
    F16 = 2,
    /// bfloat16 (`torch.bfloat16`); reduced in f32.
    BF16 = 3,
    /// Signed 8-bit integer (`torch.int8`).
    I8 = 4,
    /// Unsigned 8-bit integer (`torch.uint8`).
    U8 = 5,
    /// Signed 32-bit integer (`torch.int32`).
    I32 = 6,
    /// Signed 64-bit integer (`torch.int64`).
    I64 = 7,
    /// Unsigned 32-bit integer (`torch.uint32`).
    U32 = 8,
    /// Unsigned 64-bit integer (`torch.uint64`).
    U64 = 9,
}

impl DType {
    /// Every dtype, in discriminant order.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::U32,
        DType::U64,
    ];

    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Whether this is a floating-point type (bitwise reductions are refused).
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The name PyTorch users know, without the `torch.` prefix.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
        }
    }

    /// The wire code of this dtype.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// Decodes a wire code; `None` for codes this version does not know.
    pub const fn from_code(code: u8) -> Option<DType> {
        if (code as usize) < Self::ALL.len() {
            Some(Self::ALL[code as usize])
        } else {
            None
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A scalar type that consort can move and reduce.
///
/// Implemented for `f32`, `f64`, [`half::f16`], [`half::bf16`], `i8`, `u8`,
/// `i32`, `i64`, `u32` and `u64`. The trait is sealed: the set of dtypes is
/// part of the wire format.
pub trait Element:
    bytemuck::Pod + PartialEq + fmt::Debug + Send + Sync + 'static + sealed::Sealed
{
    /// The dtype tag of this type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

element! {
    f32 => F32, f64 => F64, f16 => F16, bf16 => BF16,
    i8 => I8, u8 => U8, i32 => I32, i64 => I64, u32 => U32, u64 => U64,
}

/// Runs `$body` with `$t` bound to the Rust type of the [`DType`] value
/// `$dtype`: the one place that maps run-time dtypes to types.
///
/// ```
/// use consort_comm::{DType, with_dtype};
/// let size = with_dtype!(DType::BF16, T => size_of::<T>());
/// assert_eq!(size, 2);
/// ```
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::F16 => {
                type $t = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = $crate::half::bf16;
                $body
            }
            $crate::DType::I8 => {
                type $t = i8;
                $body
            }
            $crate::DType::U8 => {
                type $t = u8;
                $body
            }
            $crate::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::U32 => {
                type $t = u32;
                $body
            }
            $crate::DType::U64 => {
                type $t = u64;
                $body
            }
        }
    };
}

/// Views a typed slice as its bytes (native endianness, no copy).
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

/// Views a mutable typed slice as its bytes (native endianness, no copy).
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_sizes_match_rust() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::from_code(10), None);
        assert_eq!(DType::from_code(255), None);
        assert_eq!(f16::DTYPE.size_bytes(), size_of::<f16>());
        assert_eq!(bf16::DTYPE.size_bytes(), size_of::<bf16>());
        assert_eq!(u64::DTYPE.size_bytes(), size_of::<u64>());
        assert_eq!(i8::DTYPE.size_bytes(), 1);
    }

    #[test]
    fn byte_views_are_zero_copy() {
        let mut v = [1.0f32, 2.0];
        assert_eq!(as_bytes(&v).len(), 8);
        as_bytes_mut(&mut v)[0..4].copy_from_slice(&3.0f32.to_ne_bytes());
        assert_eq!(v[0], 3.0);
    }
}
