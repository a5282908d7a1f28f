//! `consort bench --backend nccl`: one rank per GPU, every op on device
//! buffers, nccl-tests' columns with `#wrong` checked, and two host-time
//! columns: how long the host spends issuing one call through consort, and
//! issuing the same NCCL call directly through NCCL's own entry point on
//! the same communicator (the floor any wrapper can reach).
//!
//! It owns only the device side of the bench: inputs, expected values and
//! the table come from [`super::rows`].

use std::{sync::Arc, time::Instant};

use consort::{
    Backend, BufferMut, CallOptions, CommError, Device, DeviceBuffer, Dist, OpKind, Placement,
    ReduceOp, with_dtype,
};
use consort_nccl::{CudaDevice, NcclBackend, sys};

use super::rows::{BenchSpec, Row, Small, bus_factor, expected, input, output_len, wrong};

type BoxError = Box<dyn std::error::Error>;

/// One rank's rows on its GPU (`LOCAL_RANK`'s, or GPU 0 for every rank
/// under `CONSORT_SHARE_GPU=1`, which `--share-gpu` sets).
pub(crate) async fn rank(dist: &Dist, spec: &BenchSpec) -> Result<Vec<Row>, BoxError> {
    let b = Arc::new(dist.nccl_backend(None).await?);
    let dev = CudaDevice::new(b.device())?;
    let p = Placement {
        device: dev.clone(),
        stream: dev.new_stream()?,
    };
    let dtype = crate::flags::parse_dtypes(&spec.dtype)?.0[0];
    let ops = crate::flags::parse_ops(&spec.ops.join(","))?;
    let mut rows = Vec::new();
    for &op in &ops {
        for &bytes in &spec.sizes {
            let slowest = spec.timing != "rank0";
            let row = with_dtype!(dtype, T => one_row::<T>(&b, &p, op, bytes, spec.iters, slowest).await?);
            rows.push(row);
        }
    }
    b.synchronize().await?;
    b.shutdown()?;
    Ok(rows)
}

/// Device buffers of one (op, size): input, and output (the input itself
/// for in-place ops).
struct Bufs {
    input: u64,
    output: u64,
    count: usize,
    part: usize,
}

impl Bufs {
    fn view<T: Small>(&self, p: &Placement, ptr: u64, len: usize) -> DeviceBuffer {
        // SAFETY: `ptr` is one of this struct's allocations of at least
        // `len` elements of T, freed only in `free` after the stream drains.
        unsafe { p.buffer(ptr, len, T::DTYPE) }
    }

    fn free(&self, p: &Placement) -> Result<(), CommError> {
        p.device.synchronize(p.stream)?;
        // SAFETY: allocated in `one_row`, freed once, the stream idle.
        unsafe {
            p.device.free(self.input, p.stream)?;
            if self.output != self.input {
                p.device.free(self.output, p.stream)?;
            }
        }
        p.device.synchronize(p.stream)
    }
}

/// Enqueues `op` on the buffers (returns once enqueued).
async fn enqueue<T: Small>(
    b: &NcclBackend,
    p: &Placement,
    op: OpKind,
    x: &Bufs,
) -> Result<(), CommError> {
    let o = CallOptions::default();
    let (input, output) = (x.view::<T>(p, x.input, x.count), x.output);
    match op {
        OpKind::AllReduce => b.all_reduce(input.into(), ReduceOp::Sum, &o).await,
        OpKind::Broadcast => b.broadcast(input.into(), &o).await,
        OpKind::ReduceScatter => {
            let out = x.view::<T>(p, output, x.part);
            b.reduce_scatter(out.into(), input.into(), ReduceOp::Sum, &o)
                .await
        }
        OpKind::AllGather => {
            let (out, inp) = (
                x.view::<T>(p, output, x.count),
                x.view::<T>(p, x.input, x.part),
            );
            b.all_gather(out.into(), inp.into(), &o).await
        }
        _ => {
            let out = x.view::<T>(p, output, x.count);
            b.all_to_all_single(out.into(), input.into(), None, None, &o)
                .await
        }
    }
}

/// The same op through NCCL's entry point, on the backend's own stream;
/// `None` for ops that are not one NCCL call (all_to_all).
fn direct<T: Small>(b: &NcclBackend, op: OpKind, x: &Bufs) -> Option<i32> {
    let nccl = b.nccl();
    let dt = consort_nccl::map::nccl_dtype(T::DTYPE);
    let s = b.comm_stream() as *mut std::ffi::c_void;
    let (i, o) = (
        x.input as *mut std::ffi::c_void,
        x.output as *mut std::ffi::c_void,
    );
    // SAFETY: every rank makes the same raw calls in the same order, on the
    // backend's stream, from this thread only, between consort calls; the
    // buffers hold `count` (or `part`) elements of T on this GPU.
    unsafe {
        let c = b.raw_comm();
        let r = match op {
            OpKind::AllReduce => (nccl.all_reduce)(i, i, x.count, dt, sys::op::SUM, c, s),
            OpKind::Broadcast => (nccl.broadcast)(i, i, x.count, dt, 0, c, s),
            OpKind::ReduceScatter => (nccl.reduce_scatter)(i, o, x.part, dt, sys::op::SUM, c, s),
            OpKind::AllGather => (nccl.all_gather)(i, o, x.part, dt, c, s),
            _ => return None,
        };
        // The communicator may be nonblocking: the call is done enqueuing
        // once settled, and the next may only come then.
        Some(b.settle_raw(r))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Uploads the correctness inputs, allocates the output.
fn setup<T: Small>(
    p: &Placement,
    op: OpKind,
    r: usize,
    n: usize,
    count: usize,
) -> Result<Bufs, CommError> {
    let x: Vec<T> = input(op, r, n, count);
    let size = size_of::<T>();
    let in_len = if op == OpKind::AllGather {
        count / n
    } else {
        count
    };
    let input_ptr = p.device.alloc_zeroed(in_len * size, p.stream)?;
    // SAFETY: the allocation holds `x` (in_len elements of T).
    unsafe {
        p.device
            .copy_from_host(input_ptr, consort::dtype::as_bytes(&x), p.stream)
    }?;
    let output = if matches!(op, OpKind::AllReduce | OpKind::Broadcast) {
        input_ptr
    } else {
        p.device
            .alloc_zeroed(output_len(op, n, count) * size, p.stream)?
    };
    Ok(Bufs {
        input: input_ptr,
        output,
        count,
        part: count / n,
    })
}

async fn one_row<T: Small>(
    b: &NcclBackend,
    p: &Placement,
    op: OpKind,
    bytes: usize,
    iters: Option<usize>,
    slowest: bool,
) -> Result<Row, BoxError> {
    let (r, n) = (b.rank(), b.world_size());
    let count = (bytes / size_of::<T>()).max(n) / n * n;
    let x = setup::<T>(p, op, r, n, count)?;
    enqueue::<T>(b, p, op, &x).await?;
    let mut got = vec![T::small(0); output_len(op, n, count)];
    // SAFETY: the output holds `got.len()` elements of T.
    unsafe {
        p.device
            .copy_to_host(consort::dtype::as_bytes_mut(&mut got), x.output, p.stream)
    }?;
    let bad = wrong(&got, |i| expected::<T>(op, r, n, count, i));
    let iters = iters.unwrap_or_else(|| (2e9 as usize / bytes.max(1)).clamp(5, 200));
    let (mut total, mut host, mut raw) = (Vec::new(), Vec::new(), Vec::new());
    for it in 0..iters + 2 {
        b.barrier(&CallOptions::default()).await?;
        let t = Instant::now();
        enqueue::<T>(b, p, op, &x).await?;
        let h = t.elapsed().as_secs_f64();
        p.device.synchronize(p.stream)?;
        if it >= 2 {
            host.push(h);
            total.push(t.elapsed().as_secs_f64());
        }
    }
    for it in 0..iters + 2 {
        b.barrier(&CallOptions::default()).await?;
        let t = Instant::now();
        match direct::<T>(b, op, &x) {
            Some(0) => {}
            Some(code) => return Err(format!("direct NCCL call failed with code {code}").into()),
            None => break,
        }
        let h = t.elapsed().as_secs_f64();
        p.device.synchronize(b.comm_stream())?;
        if it >= 2 {
            raw.push(h);
        }
    }
    let mut total_bad = [bad];
    b.all_reduce(
        BufferMut::from(&mut total_bad[..]),
        ReduceOp::Sum,
        &CallOptions::default(),
    )
    .await?;
    if slowest {
        // Each iteration's time is the slowest rank's (host times stay this
        // rank's own: they measure issuing, not the collective).
        let all = BufferMut::from(&mut total[..]);
        b.all_reduce(all, ReduceOp::Max, &CallOptions::default())
            .await?;
    }
    x.free(p)?;
    let med = median(total);
    let moved = count * size_of::<T>();
    let alg = moved as f64 / med / 1e9;
    Ok(Row {
        op: op.name().trim_end_matches("_single").to_string(),
        bytes: moved,
        count,
        time_us: med * 1e6,
        algbw_gbs: alg,
        busbw_gbs: alg * bus_factor(op, n),
        wrong: total_bad[0],
        host_us: Some(median(host) * 1e6),
        direct_host_us: (!raw.is_empty()).then(|| median(raw) * 1e6),
    })
}
