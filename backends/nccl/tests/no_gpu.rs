//! What the NCCL backend guarantees on a machine without CUDA (CI): a
//! missing library is `BackendUnavailable`, never a panic; the store key
//! layout is torch's; dtypes, ops and error codes map correctly.

use std::time::Duration;

use consort_comm::{CommError, DType, ErrorContext, MemStore, ReduceOp, Store};
use consort_nccl::sys::{op, result};
use consort_nccl::{
    NcclBackend, NcclOptions,
    keys::{UNIQUE_ID_BYTES, check_unique_id, unique_id_key},
    map::{nccl_dtype, nccl_error, nccl_op},
    probe, probe_with,
};

fn libs_present() -> bool {
    probe().is_ok()
}

#[test]
fn a_missing_library_is_backend_unavailable_with_the_fix() {
    let e = probe_with(&["libcuda-not-here.so".into()], &["libnccl.so.2".into()]).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, CommError::BackendUnavailable { .. }), "{e:?}");
    assert!(msg.contains("libcuda-not-here.so"), "{msg}");
    assert!(msg.contains("NVIDIA driver"), "{msg}");
    // A loadable CUDA name (the C library stands in) and a missing NCCL.
    let e = probe_with(&["libc.so.6".into()], &["libnccl-not-here.so".into()]).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("libnccl-not-here.so"), "{msg}");
    assert!(
        msg.contains("libnccl2") && msg.contains("nvidia-nccl-cu12"),
        "{msg}"
    );
    assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
}

#[tokio::test]
async fn constructing_without_cuda_returns_an_error_not_a_panic() {
    if libs_present() {
        eprintln!("skipped: this machine has libcuda and libnccl (the GPU tests cover it)");
        return;
    }
    let store = MemStore::new(Duration::from_secs(5));
    let e = NcclBackend::new(&store, 0, 1, NcclOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, CommError::BackendUnavailable { .. }), "{e:?}");
    assert!(
        e.to_string().contains("backend `nccl` is unavailable"),
        "{e}"
    );
}

#[tokio::test]
async fn bad_ranks_are_refused_before_any_cuda_call() {
    let store = MemStore::new(Duration::from_secs(5));
    let e = NcclBackend::new(&store, 2, 2, NcclOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e:?}");
    let e = NcclBackend::new(&store, 0, 0, NcclOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e:?}");
}

#[tokio::test]
async fn the_unique_id_sits_under_torchs_key() {
    assert_eq!(unique_id_key("0", 0), "default_pg/0//cuda//0");
    assert_eq!(unique_id_key("3", 2), "default_pg/3//cuda//2");
    // Rank 0 sets 128 raw bytes; another rank reads them back whole.
    let store = MemStore::new(Duration::from_secs(5));
    let id: Vec<u8> = (0..UNIQUE_ID_BYTES as u8).collect();
    store.set(&unique_id_key("0", 0), &id).await.unwrap();
    let got = store.get(&unique_id_key("0", 0)).await.unwrap();
    assert_eq!(check_unique_id("k", &got).unwrap().to_vec(), id);
    let e = check_unique_id("default_pg/0//cuda//0", &[1, 2, 3]).unwrap_err();
    assert!(e.contains("3 bytes") && e.contains("128"), "{e}");
    let _ = Duration::ZERO;
}

#[test]
fn dtypes_and_ops_map_to_ncclcodes() {
    let mut seen = std::collections::HashSet::new();
    for d in DType::ALL {
        assert!(seen.insert(nccl_dtype(d)), "{d} shares an NCCL type");
    }
    assert_eq!(nccl_op(ReduceOp::Sum).unwrap(), op::SUM);
    assert_eq!(nccl_op(ReduceOp::Avg).unwrap(), op::AVG);
    assert_eq!(nccl_op(ReduceOp::Prod).unwrap(), op::PROD);
    assert_eq!(nccl_op(ReduceOp::Min).unwrap(), op::MIN);
    assert_eq!(nccl_op(ReduceOp::Max).unwrap(), op::MAX);
    for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
        let e = nccl_op(op).unwrap_err();
        assert!(matches!(e, CommError::Unsupported { .. }), "{e:?}");
        assert!(e.to_string().contains("bitwise"), "{e}");
    }
}

#[test]
fn premul_sum_scalars_are_in_the_calls_dtype() {
    use consort_comm::half::{bf16, f16};
    use consort_nccl::map::premul_scalar;
    let f = 0.25f64;
    assert_eq!(premul_scalar(f, DType::F64).unwrap(), f.to_ne_bytes());
    assert_eq!(
        premul_scalar(f, DType::F32).unwrap()[..4],
        (f as f32).to_ne_bytes()
    );
    let h = f16::from_f64(f).to_bits().to_ne_bytes();
    assert_eq!(premul_scalar(f, DType::F16).unwrap()[..2], h);
    let b = bf16::from_f64(f).to_bits().to_ne_bytes();
    assert_eq!(premul_scalar(f, DType::BF16).unwrap()[..2], b);
    assert_eq!(premul_scalar(f, DType::I32), None);
    // Made per call, never a built-in op.
    assert!(nccl_op(ReduceOp::premul_sum(f)).is_err());
}

#[test]
fn nccl_errors_carry_the_code_the_text_and_what_to_try() {
    let ctx = ErrorContext {
        rank: Some(3),
        ..Default::default()
    };
    let e = nccl_error(ctx, result::SYSTEM_ERROR, "");
    let msg = e.to_string();
    assert!(msg.contains("rank 3"), "{msg}");
    assert!(msg.contains("NCCL error 2: ncclSystemError ("), "{msg}");
    assert!(
        msg.contains("shm-size") && msg.contains("NCCL_DEBUG"),
        "{msg}"
    );
    let e = nccl_error(ctx, result::REMOTE_ERROR, "peer 5 closed the connection\n");
    assert!(
        e.to_string().contains("(peer 5 closed the connection)."),
        "{e}"
    );
}
