//! consort's dtypes and reduce ops in NCCL's terms, and NCCL's result
//! codes as `CommError`s. Pure functions: tested without a GPU.

use std::ffi::c_int;

use consort_comm::{CommError, DType, ErrorContext, ReduceOp};

use crate::sys::{dtype, op, result};

/// The NCCL type of `dtype` (every consort dtype has one).
pub fn nccl_dtype(d: DType) -> c_int {
    match d {
        DType::F32 => dtype::FLOAT32,
        DType::F64 => dtype::FLOAT64,
        DType::F16 => dtype::FLOAT16,
        DType::BF16 => dtype::BFLOAT16,
        DType::I8 => dtype::INT8,
        DType::U8 => dtype::UINT8,
        DType::I32 => dtype::INT32,
        DType::I64 => dtype::INT64,
        DType::U32 => dtype::UINT32,
        DType::U64 => dtype::UINT64,
    }
}

/// The built-in NCCL op of `op`; bitwise ops have none, and
/// `PremulSum` is made per call ([`premul_scalar`]).
pub fn nccl_op(o: ReduceOp) -> Result<c_int, CommError> {
    Ok(match o {
        ReduceOp::PremulSum(_) => {
            return Err(CommError::unsupported(
                "ReduceOp::PremulSum is not a built-in NCCL op: it is created per call with \
                 ncclRedOpCreatePreMulSum",
            ));
        }
        ReduceOp::Sum => op::SUM,
        ReduceOp::Avg => op::AVG,
        ReduceOp::Prod => op::PROD,
        ReduceOp::Min => op::MIN,
        ReduceOp::Max => op::MAX,
        other => {
            return Err(CommError::unsupported(format!(
                "NCCL has no bitwise reductions (ReduceOp::{other:?}); use the tcp or sim backend \
                 for bitwise ops, or reduce the bits with Min/Max where that is what you mean"
            )));
        }
    })
}

/// The bytes of `factor` in `dtype` (host order), as
/// `ncclRedOpCreatePreMulSum` reads its scalar: 8 bytes room, the first
/// `dtype.size_bytes()` used. `None` for integer dtypes (consort refuses
/// PremulSum on them, as torch does).
pub fn premul_scalar(factor: f64, d: DType) -> Option<[u8; 8]> {
    let mut out = [0u8; 8];
    match d {
        DType::F64 => out.copy_from_slice(&factor.to_ne_bytes()),
        DType::F32 => out[..4].copy_from_slice(&(factor as f32).to_ne_bytes()),
        DType::F16 => {
            let h = consort_comm::half::f16::from_f64(factor);
            out[..2].copy_from_slice(&h.to_bits().to_ne_bytes());
        }
        DType::BF16 => {
            let h = consort_comm::half::bf16::from_f64(factor);
            out[..2].copy_from_slice(&h.to_bits().to_ne_bytes());
        }
        _ => return None,
    }
    Some(out)
}

/// NCCL's name of a result code (`ncclSystemError`).
pub fn result_name(r: c_int) -> String {
    match r {
        result::SUCCESS => "ncclSuccess",
        result::UNHANDLED_CUDA_ERROR => "ncclUnhandledCudaError",
        result::SYSTEM_ERROR => "ncclSystemError",
        result::INTERNAL_ERROR => "ncclInternalError",
        result::INVALID_ARGUMENT => "ncclInvalidArgument",
        result::INVALID_USAGE => "ncclInvalidUsage",
        result::REMOTE_ERROR => "ncclRemoteError",
        result::IN_PROGRESS => "ncclInProgress",
        result::TIMEOUT => "ncclTimeout",
        _ => return format!("NCCL result {r}"),
    }
    .to_string()
}

pub use consort_comm::ordered::check::may_be_lost_peer;

/// An NCCL failure as a `CommError`, with the library's last-error text
/// (`detail`) when there is one.
pub fn nccl_error(ctx: ErrorContext, r: c_int, detail: &str) -> CommError {
    let detail = if detail.trim().is_empty() {
        match r {
            result::UNHANDLED_CUDA_ERROR => "a CUDA call failed inside NCCL",
            result::SYSTEM_ERROR => {
                "a system call failed (often a socket or shared memory: in containers, give \
                 /dev/shm more space, e.g. `--shm-size=1g`, or set NCCL_SHM_DISABLE=1)"
            }
            result::INTERNAL_ERROR => "an internal NCCL error",
            result::INVALID_ARGUMENT => "NCCL rejected an argument",
            result::INVALID_USAGE => "NCCL was called in an invalid way",
            result::REMOTE_ERROR => "a remote peer failed or disconnected",
            result::TIMEOUT => "an NCCL operation timed out",
            _ => "no further detail",
        }
        .to_string()
    } else {
        detail.trim().to_string()
    };
    CommError::Backend {
        ctx,
        backend: "NCCL",
        code: r,
        detail: format!("{} ({detail})", result_name(r)),
    }
}
