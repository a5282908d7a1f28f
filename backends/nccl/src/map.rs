//! consort's dtypes and reduce ops in NCCL's terms, and NCCL's result
//! codes as `CommError`s. Pure functions: tested without a GPU.

use consort_comm::{CommError, DType, ErrorContext, ReduceOp};
use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t, ncclResult_t};

/// The NCCL type of `dtype` (every consort dtype has one).
pub fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::I8 => ncclDataType_t::ncclInt8,
        DType::U8 => ncclDataType_t::ncclUint8,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U32 => ncclDataType_t::ncclUint32,
        DType::U64 => ncclDataType_t::ncclUint64,
    }
}

/// The NCCL op of `op`; bitwise ops have none.
pub fn nccl_op(op: ReduceOp) -> Result<ncclRedOp_t, CommError> {
    Ok(match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::Prod => ncclRedOp_t::ncclProd,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        other => {
            return Err(CommError::unsupported(format!(
                "NCCL has no bitwise reductions (ReduceOp::{other:?}); use the tcp or sim backend \
                 for bitwise ops, or reduce the bits with Min/Max where that is what you mean"
            )));
        }
    })
}

/// The name of an NCCL result code.
pub fn result_name(r: ncclResult_t) -> String {
    format!("{r:?}")
}

/// An NCCL failure as a `CommError`, with the library's last-error text
/// (`detail`) when there is one.
pub fn nccl_error(ctx: ErrorContext, r: ncclResult_t, detail: &str) -> CommError {
    let detail = if detail.trim().is_empty() {
        match r {
            ncclResult_t::ncclUnhandledCudaError => "a CUDA call failed inside NCCL",
            ncclResult_t::ncclSystemError => {
                "a system call failed (often a socket or shared memory: in containers, give \
                 /dev/shm more space, e.g. `--shm-size=1g`, or set NCCL_SHM_DISABLE=1)"
            }
            ncclResult_t::ncclInternalError => "an internal NCCL error",
            ncclResult_t::ncclInvalidArgument => "NCCL rejected an argument",
            ncclResult_t::ncclInvalidUsage => "NCCL was called in an invalid way",
            ncclResult_t::ncclRemoteError => "a remote peer failed or disconnected",
            _ => "no further detail",
        }
        .to_string()
    } else {
        detail.trim().to_string()
    };
    CommError::Backend {
        ctx,
        backend: "NCCL",
        code: r as i32,
        detail: format!("{} ({detail})", result_name(r)),
    }
}
