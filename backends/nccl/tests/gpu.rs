//! The NCCL backend on a real GPU. Ignored by default (CI has none); run
//! on a machine with one GPU, libcuda and libnccl:
//!
//! ```sh
//! cargo test -p consort-nccl --test gpu -- --ignored --nocapture
//! ```
//!
//! Single-rank only: NCCL refuses two ranks on one device. The multi-rank
//! command for a multi-GPU node is in the README ("NCCL on a cluster").

use std::{sync::Arc, time::Instant};

use consort_comm::{Backend, BufferMut, CallOptions, DType, DeviceBuffer, MemStore, ReduceOp};
use consort_nccl::{NcclBackend, NcclOptions};
use consort_tests::{WorldFuture, checks};
use cudarc::driver::{CudaContext, DevicePtrMut};

fn nccl_world(n: usize) -> WorldFuture {
    Box::pin(async move {
        assert_eq!(n, 1, "one GPU: NCCL runs one rank per device");
        let store = MemStore::new(std::time::Duration::from_secs(30));
        let b = NcclBackend::new(&store, 0, 1, NcclOptions::default())
            .await
            .expect("NCCL on GPU 0");
        vec![Arc::new(b) as Arc<dyn Backend>]
    })
}

#[test]
#[ignore = "needs a GPU with libcuda and libnccl"]
fn single_rank_conformance_with_host_buffers() {
    for dtype in DType::ALL {
        for len in [0, 1, 7, 1000, 65_537] {
            for op in 0..5 {
                checks::all_reduce(nccl_world, 1, len, dtype, op, 11);
            }
            checks::broadcast(nccl_world, 1, len, dtype, 0, 12);
            checks::all_gather(nccl_world, 1, len, dtype, 13);
            checks::reduce_scatter(nccl_world, 1, len, dtype, 0, 14);
        }
        checks::all_to_all(nccl_world, 1, dtype, false, 15);
    }
}

#[tokio::test]
#[ignore = "needs a GPU with libcuda and libnccl"]
async fn device_buffers_go_to_nccl_without_a_host_copy() {
    let store = MemStore::new(std::time::Duration::from_secs(30));
    let b = NcclBackend::new(&store, 0, 1, NcclOptions::default())
        .await
        .expect("NCCL on GPU 0");
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let host: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let mut dev = stream.clone_htod(&host).unwrap();
    {
        let (ptr, _sync) = dev.device_ptr_mut(&stream);
        // SAFETY: 4096 f32 on device 0, alive for the call.
        let buf = unsafe { DeviceBuffer::new(ptr, host.len(), DType::F32, 0, 0) };
        b.all_reduce(
            BufferMut::Device(buf),
            ReduceOp::Sum,
            &CallOptions::default(),
        )
        .await
        .unwrap();
    }
    let back = stream.clone_dtoh(&dev).unwrap();
    assert_eq!(back, host, "a world of one sums to itself");
    b.shutdown().unwrap();
}

/// all_reduce algbw from 1 KiB to 1 GiB on device buffers, and the
/// wrapper's overhead against calling NCCL through cudarc directly.
#[tokio::test]
#[ignore = "needs a GPU with libcuda and libnccl"]
async fn bench_all_reduce_algbw_and_wrapper_overhead() {
    let store = MemStore::new(std::time::Duration::from_secs(30));
    let b = NcclBackend::new(&store, 0, 1, NcclOptions::default())
        .await
        .expect("NCCL on GPU 0");
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let comms = cudarc::nccl::Comm::from_devices(vec![ctx.new_stream().unwrap()]).unwrap();
    let direct = &comms[0];
    println!("| bytes | consort us | algbw GB/s | cudarc direct us | overhead |");
    println!("|---|---|---|---|---|");
    let mut bytes = 4usize;
    while bytes <= 1 << 30 {
        let n = bytes / 4;
        let mut dev = stream.alloc_zeros::<f32>(n).unwrap();
        let iters = if bytes < 1 << 20 { 200 } else { 20 };
        let ours = {
            let (ptr, _s) = dev.device_ptr_mut(&stream);
            let t = Instant::now();
            for _ in 0..iters {
                // SAFETY: n f32 on device 0.
                let buf = unsafe { DeviceBuffer::new(ptr, n, DType::F32, 0, 0) };
                b.all_reduce(
                    BufferMut::Device(buf),
                    ReduceOp::Sum,
                    &CallOptions::default(),
                )
                .await
                .unwrap();
            }
            t.elapsed().as_secs_f64() / iters as f64
        };
        let theirs = {
            let t = Instant::now();
            for _ in 0..iters {
                direct
                    .all_reduce_in_place(&mut dev, &cudarc::nccl::ReduceOp::Sum)
                    .unwrap();
                direct.stream().synchronize().unwrap();
            }
            t.elapsed().as_secs_f64() / iters as f64
        };
        println!(
            "| {bytes} | {:.2} | {:.2} | {:.2} | {:+.1}% |",
            ours * 1e6,
            bytes as f64 / ours / 1e9,
            theirs * 1e6,
            (ours / theirs - 1.0) * 100.0
        );
        bytes = if bytes < 1024 { 1024 } else { bytes * 4 };
    }
    b.shutdown().unwrap();
}
