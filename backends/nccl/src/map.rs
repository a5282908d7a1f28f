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

/// The built-in NCCL op of `op`; bitwise ops have none.
pub fn nccl_op(o: ReduceOp) -> Result<c_int, CommError> {
    Ok(match o {
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
