//! The NCCL backend on a real GPU. Ignored by default (CI has none); run
//! on a machine with a GPU, libcuda and libnccl (`scripts/gpu-check` runs
//! these and the multi-rank checks):
//!
//! ```sh
//! cargo test -p consort-nccl --test gpu -- --ignored --nocapture --test-threads 1
//! ```
//!
//! One communicator serves the whole host-buffer conformance run (creating
//! and destroying one costs about a second each on an H100).

use std::{
    sync::{Arc, OnceLock},
    time::{Duration, Instant},
};

use consort_comm::{Backend, BufferMut, CallOptions, DType, Device, MemStore, Placement, ReduceOp};
use consort_ddp::{Ddp, DdpOptions, DeviceModel};
use consort_nccl::{CudaDevice, NcclBackend, NcclOptions};
use consort_tests::{WorldFuture, checks};

/// The one communicator of this process, made on first use.
fn shared() -> Arc<NcclBackend> {
    static ONE: OnceLock<Arc<NcclBackend>> = OnceLock::new();
    ONE.get_or_init(|| {
        // Made on a thread of its own: callers may already be inside a
        // runtime's block_on.
        std::thread::spawn(|| Arc::new(world_of_one(&runtime(), NcclOptions::default())))
            .join()
            .expect("NCCL init thread")
    })
    .clone()
}

/// A current-thread runtime with timers.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A fresh communicator of one rank on GPU 0, made on `rt`.
fn world_of_one(rt: &tokio::runtime::Runtime, opts: NcclOptions) -> NcclBackend {
    let store = MemStore::new(Duration::from_secs(30));
    rt.block_on(NcclBackend::new(&store, 0, 1, opts))
        .expect("NCCL on GPU 0")
}

fn nccl_world(n: usize) -> WorldFuture {
    Box::pin(async move {
        assert_eq!(
            n, 1,
            "one process, one rank: multi-rank runs are in gpu-check"
        );
        vec![shared() as Arc<dyn Backend>]
    })
}

#[test]
#[ignore = "needs a GPU with libcuda and libnccl"]
fn one_communicator_runs_the_host_buffer_conformance() {
    let t = Instant::now();
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
    // Calls made before any is awaited, awaited in reverse.
    consort_tests::concurrency::in_flight(nccl_world, 1, 1000, 16);
    println!(
        "host-buffer conformance on one communicator: {:?}",
        t.elapsed()
    );
}

/// PremulSum through `ncclRedOpCreatePreMulSum` and f16/bf16 Avg on host
/// buffers, and a subgroup (`ncclCommSplit` on NCCL 2.18+, else a new
/// communicator from a broadcast id) that all-reduces next to its parent.
#[test]
#[ignore = "needs a GPU with libcuda and libnccl"]
fn premul_sum_half_avg_and_a_subgroup() {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for kind in 0..3 {
            consort_tests::scaled::premul_sum(nccl_world, 1, 1000, dtype, kind, 21);
        }
    }
    consort_tests::scaled::half_avg_in_range(nccl_world, 1);
    consort_tests::scaled::premul_sum_on_integers(nccl_world, 1);
    consort_tests::concurrency::subgroup(nccl_world, 1, 1, true, 1000, DType::F32, 0, 22);
}

/// A device call returns once enqueued; the caller's stream, not the host,
/// waits for it.
#[test]
#[ignore = "needs a GPU with libcuda and libnccl"]
fn device_calls_are_stream_ordered() {
    let b = shared();
    let dev = CudaDevice::new(0).unwrap();
    let s = dev.new_stream().unwrap();
    let p = Placement {
        device: dev.clone(),
        stream: s,
    };
    let n = 1 << 20;
    let host: Vec<f32> = (0..n).map(|i| (i % 97) as f32).collect();
    let x = dev.alloc_zeroed(n * 4, s).unwrap();
    // SAFETY: x holds n f32.
    unsafe { dev.copy_from_host(x, consort_comm::dtype::as_bytes(&host), s) }.unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for _ in 0..3 {
        // SAFETY: x holds n f32 on GPU 0 until freed below.
        let buf = unsafe { p.buffer(x, n, DType::F32) };
        rt.block_on(b.all_reduce(
            BufferMut::Device(buf),
            ReduceOp::Avg,
            &CallOptions::default(),
        ))
        .unwrap();
    }
    let mut back = vec![0f32; n];
    // SAFETY: as above; copy_to_host waits for stream s only.
    unsafe { dev.copy_to_host(consort_comm::dtype::as_bytes_mut(&mut back), x, s) }.unwrap();
    assert_eq!(back, host, "Avg over a world of one is the identity");
    rt.block_on(b.synchronize()).unwrap();
    // SAFETY: freed once, after the work above.
    unsafe { dev.free(x, s) }.unwrap();
    dev.synchronize(s).unwrap();
}

/// Device-resident DDP on CUDA buckets: the averaged gradient lands in the
/// model's gradient storage, ordered on the compute stream.
#[test]
#[ignore = "needs a GPU with libcuda and libnccl"]
fn ddp_with_cuda_buckets() {
    let dev = CudaDevice::new(0).unwrap();
    let s = dev.new_stream().unwrap();
    let p = Placement {
        device: dev.clone(),
        stream: s,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut model = DeviceModel::new(p);
        model.add_param("w", vec![3, 2], &[1f32; 6]).unwrap();
        model.add_param("b", vec![3], &[0f32; 3]).unwrap();
        let mut ddp = Ddp::new(shared(), &mut model, DdpOptions::default())
            .await
            .unwrap();
        for step in 0..3 {
            let g: Vec<f32> = (0..6).map(|i| (i + step) as f32).collect();
            model.write_grad(0, &g).unwrap();
            model.write_grad(1, &[step as f32; 3]).unwrap();
            ddp.sync_grads(&mut model).await.unwrap();
            assert_eq!(model.read_grad::<f32>(0).unwrap(), g, "step {step}");
        }
    });
}

/// Host time per call on device buffers, consort against the same NCCL
/// call made directly (settled, as the communicator requires), 4 B to
/// 1 GiB, on consort's nonblocking communicator and on a blocking one
/// (`NcclOptions::blocking`, torch's default). Each call is awaited as a
/// training step's task awaits it ([`in_task`]): a device call's work is
/// done when `submit` returns, so that await is one poll; what entering a
/// runtime per call would add (`block_on`) is a row of the pieces table.
/// A benchmark: prints, asserts nothing about time.
#[test]
#[ignore = "needs a GPU with libcuda and libnccl"]
fn bench_host_overhead_per_call() {
    let blocking = blocking_comm(NcclOptions::default().poll_interval);
    println!(
        "| communicator | bytes | consort host us/call (mean / median) | direct host us/call \
         (mean / median) | overhead us (medians) |"
    );
    println!("|---|---|---|---|---|");
    overhead_rows("nonblocking", &shared());
    overhead_rows("blocking", &blocking);
    pieces(&blocking);
    blocking.shutdown().unwrap();
}

/// What one call's host time is made of, at 4 B on `b`'s stream: the
/// runtime's `block_on`, the CUDA calls a call makes around NCCL's, and the
/// whole call while the watchdog polls rarely (its polling competes for the
/// tracking lock and the driver). Prints a table of medians.
fn pieces(b: &NcclBackend) {
    use cudarc::driver::{result as cu, sys as cusys};
    let dev = CudaDevice::new(0).unwrap();
    let s = b.comm_stream();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let flags = cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
    let ev = cu::event::create(flags).unwrap();
    let other = cu::stream::create(cu::stream::StreamKind::NonBlocking).unwrap();
    let wait = cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
    let stream = s as cusys::CUstream;
    let mut rows = vec![(
        "block_on(async {}) on a current-thread runtime",
        per_call(2000, || {
            rt.block_on(async {});
        }),
    )];
    // SAFETY: our event and streams, alive until destroyed below.
    rows.push((
        "cuEventRecord on the communication stream",
        per_call(2000, || unsafe {
            cu::event::record(ev, stream).unwrap();
        }),
    ));
    // SAFETY: as above.
    rows.push((
        "cuEventRecord + cuStreamWaitEvent (another stream waits)",
        per_call(2000, || unsafe {
            cu::event::record(ev, stream).unwrap();
            cu::stream::wait_event(other, ev, wait).unwrap();
        }),
    ));
    // SAFETY: as above.
    rows.push((
        "cuEventQuery",
        per_call(2000, || unsafe {
            let _ = cu::event::query(ev);
        }),
    ));
    // SAFETY: the event and stream are ours, no longer used.
    unsafe {
        let _ = cu::event::destroy(ev);
        let _ = cu::stream::destroy(other);
    }
    dev.synchronize(s).unwrap();
    rows.push((
        "consort all_reduce, blocking, the watchdog polling every 10 ms",
        quiet_watchdog(&dev, &rt),
    ));
    println!("| piece of a call (4 B, device buffers) | host us (mean / median) |");
    println!("|---|---|");
    for (what, t) in rows {
        println!("| {what} | {:.2} / {:.2} |", t.mean * 1e6, t.median * 1e6);
    }
}

fn overhead_rows(label: &str, b: &NcclBackend) {
    let dev = CudaDevice::new(0).unwrap();
    let s = b.comm_stream();
    let p = Placement {
        device: dev.clone(),
        stream: s,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut bytes = 4usize;
    while bytes <= 1 << 30 {
        let n = bytes / 4;
        let x = dev.alloc_zeroed(bytes, s).unwrap();
        // SAFETY: x holds n f32 until freed below.
        let buf = unsafe { p.buffer(x, n, DType::F32) };
        let iters = 200;
        // Both measured on an idle stream (the allocation's memset done).
        dev.synchronize(s).unwrap();
        let _in_rt = rt.enter();
        let ours = per_call(iters, || {
            in_task(
                &rt,
                b.all_reduce(
                    BufferMut::Device(buf),
                    ReduceOp::Sum,
                    &CallOptions::default(),
                ),
            )
            .unwrap();
        });
        rt.block_on(b.synchronize()).unwrap();
        let nccl = b.nccl().clone();
        // SAFETY: raw calls on the comm stream, from this thread only, all
        // ranks (one) making the same ones, each settled before the next.
        let comm = unsafe { b.raw_comm() };
        let direct = per_call(iters, || {
            // SAFETY: as above; x holds n f32 on this GPU.
            let r = unsafe {
                b.settle_raw((nccl.all_reduce)(
                    x as *const _,
                    x as *mut _,
                    n,
                    consort_nccl::sys::dtype::FLOAT32,
                    consort_nccl::sys::op::SUM,
                    comm,
                    s as *mut _,
                ))
            };
            assert_eq!(r, 0);
        });
        dev.synchronize(s).unwrap();
        println!(
            "| {label} | {bytes} | {:.2} / {:.2} | {:.2} / {:.2} | {:+.2} |",
            ours.mean * 1e6,
            ours.median * 1e6,
            direct.mean * 1e6,
            direct.median * 1e6,
            (ours.median - direct.median) * 1e6
        );
        // SAFETY: freed once after the stream drained.
        unsafe { dev.free(x, s) }.unwrap();
        bytes = if bytes < 1 << 20 {
            bytes * 32
        } else {
            bytes * 8
        };
    }
}

/// A blocking communicator of one rank on GPU 0 (torch's default kind),
/// its watchdog polling every `poll`; made on a thread of its own, as
/// [`shared`] is.
fn blocking_comm(poll: Duration) -> NcclBackend {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let store = MemStore::new(Duration::from_secs(30));
        let opts = NcclOptions {
            blocking: true,
            poll_interval: poll,
            ..NcclOptions::default()
        };
        rt.block_on(NcclBackend::new(&store, 0, 1, opts))
            .expect("a blocking NCCL communicator on GPU 0")
    })
    .join()
    .expect("NCCL init thread")
}

/// Host time per 4 B all_reduce on a blocking communicator whose watchdog
/// polls every 10 ms instead of every 50 us.
fn quiet_watchdog(dev: &Arc<CudaDevice>, rt: &tokio::runtime::Runtime) -> PerCall {
    let quiet = blocking_comm(Duration::from_millis(10));
    let s = quiet.comm_stream();
    let x = dev.alloc_zeroed(4, s).unwrap();
    let p = Placement {
        device: dev.clone(),
        stream: s,
    };
    // SAFETY: x holds one f32 until freed below.
    let buf = unsafe { p.buffer(x, 1, DType::F32) };
    dev.synchronize(s).unwrap();
    let in_rt = rt.enter();
    let t = per_call(2000, || {
        in_task(
            rt,
            quiet.all_reduce(
                BufferMut::Device(buf),
                ReduceOp::Sum,
                &CallOptions::default(),
            ),
        )
        .unwrap();
    });
    drop(in_rt);
    rt.block_on(quiet.synchronize()).unwrap();
    // SAFETY: freed once, the stream drained.
    unsafe { dev.free(x, s) }.unwrap();
    quiet.shutdown().unwrap();
    t
}

/// Awaits `work` as a task of a running runtime awaits it: one poll (a
/// device call's work is ready when made); a pending one is driven by `rt`.
/// The caller has entered `rt`.
fn in_task(rt: &tokio::runtime::Runtime, work: consort_comm::Work<'_>) -> consort_comm::Result<()> {
    use std::task::{Context, Poll, Waker};
    let mut work = std::pin::pin!(work);
    match work.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(r) => r,
        Poll::Pending => rt.block_on(work),
    }
}

/// Host seconds per call of `f` over `iters` calls, after warm-up.
struct PerCall {
    mean: f64,
    median: f64,
}

/// Times `iters` calls of `f` one by one: the mean shows rare slow calls
/// (a lock the watchdog held, a wake-up), the median the usual one.
fn per_call(iters: usize, mut f: impl FnMut()) -> PerCall {
    for _ in 0..10 {
        f();
    }
    let mut each: Vec<f64> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    each.sort_by(f64::total_cmp);
    PerCall {
        mean: each.iter().sum::<f64>() / iters as f64,
        median: each[iters / 2],
    }
}

/// The survivors' path of a failed communicator on a real GPU: after an
/// abort, `new_group` meets in the store and inits a new communicator (a
/// 1-rank one here, as step 10's survivor makes) once NCCL's abort of the
/// old one has returned; a call on it works.
#[test]
#[ignore = "needs a GPU with libcuda and libnccl"]
fn a_failed_communicators_survivors_make_a_new_one_through_the_store() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = Arc::new(MemStore::new(Duration::from_secs(30)));
    let b = rt
        .block_on(NcclBackend::new(&*store, 0, 1, NcclOptions::default()))
        .expect("NCCL on GPU 0");
    b.set_store(store.clone());
    b.abort().unwrap();
    let t = Instant::now();
    let sub = rt
        .block_on(b.new_group(&[0], &CallOptions::default()))
        .expect("the survivors' communicator")
        .expect("rank 0 is a survivor");
    let mut x = [1.5f32, -2.0, 3.0];
    rt.block_on(sub.all_reduce(
        BufferMut::from(&mut x[..]),
        ReduceOp::Sum,
        &CallOptions::default(),
    ))
    .unwrap();
    assert_eq!(x, [1.5, -2.0, 3.0]);
    println!(
        "survivors' communicator after an abort: made and used in {:.2} s",
        t.elapsed().as_secs_f64()
    );
}

/// A call made on one thread while another thread's call, made just before
/// it, is stuck in its enqueue (`stall_enqueue_at`) waits for its turn in
/// `submit`, then fails at its timeout naming that call; the group is then
/// done: the stuck call is refused when its enqueue ends, and later calls
/// say why at once (the emulated device's test of the same rules).
#[test]
#[ignore = "needs a GPU with libcuda and libnccl"]
fn a_call_behind_a_stuck_enqueue_names_it_and_ends_the_group() {
    let beat = std::env::temp_dir().join(format!("consort-gpu-turn-{}", std::process::id()));
    let opts = NcclOptions {
        stall_enqueue_at: Some((0, Duration::from_millis(600))),
        heartbeat_file: Some(beat.clone()),
        ..Default::default()
    };
    let b = world_of_one(&runtime(), opts);
    let short = CallOptions::default().with_timeout(Duration::from_millis(100));
    let (mut x, mut y) = ([1f32; 4], [2f32; 4]);
    let t = Instant::now();
    let (first, second) = std::thread::scope(|s| {
        let first =
            s.spawn(|| runtime().block_on(b.broadcast(BufferMut::from(&mut x[..]), &short)));
        let made = |h: consort_comm::heartbeat::Beat| h.last.map(|l| l.1) == Some(0);
        while !consort_comm::heartbeat::read(&beat).is_some_and(made) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the first call was never made"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let made_at = Instant::now();
        let second =
            runtime().block_on(b.all_reduce(BufferMut::from(&mut y[..]), ReduceOp::Sum, &short));
        println!(
            "a call behind a stuck enqueue: failed naming it in {:?}",
            made_at.elapsed()
        );
        (first.join().unwrap(), second)
    });
    let e = second.unwrap_err().to_string();
    assert!(e.contains("broadcast call (seq 0)"), "{e}");
    let e = first.unwrap_err().to_string();
    assert!(e.contains("broadcast call (seq 0)"), "the stuck call: {e}");
    let later = runtime()
        .block_on(b.barrier(&short))
        .unwrap_err()
        .to_string();
    assert!(later.contains("broadcast call (seq 0)"), "{later}");
    drop(b);
    let _ = std::fs::remove_file(&beat);
}

/// Host calls are staged and enqueued when they are made: their works may
/// be awaited in any order (here in reverse, sizes that make the staging
/// pool grow and reuse its buffers), each gets its own result, and a work
/// dropped unpolled runs to its end, its staging memory kept until then,
/// while the group goes on. Two threads making calls at once each get
/// their own results.
#[test]
#[ignore = "needs a GPU with libcuda and libnccl"]
fn host_calls_awaited_in_any_order_each_get_their_own_result() {
    let rt = runtime();
    let b = world_of_one(&rt, NcclOptions::default());
    let opts = CallOptions::default().with_timeout(Duration::from_secs(20));
    let lens = [1usize, 4, 1000, 5000, 1 << 16, 3, 1 << 20, 7];
    let mut bufs: Vec<Vec<f32>> = (lens.iter().enumerate())
        .map(|(i, &n)| (0..n).map(|j| (i * 1000 + j % 997) as f32).collect())
        .collect();
    let want = bufs.clone();
    let t = Instant::now();
    let works: Vec<_> = (bufs.iter_mut())
        .map(|x| b.all_reduce(BufferMut::from(&mut x[..]), ReduceOp::Sum, &opts))
        .collect();
    for w in works.into_iter().rev() {
        rt.block_on(w).expect("a host call awaited out of order");
    }
    assert_eq!(bufs, want);
    println!(
        "{} host calls awaited in reverse: each right, in {:?}",
        lens.len(),
        t.elapsed()
    );
    let mut x = vec![5f32; 1 << 18];
    drop(b.all_reduce(BufferMut::from(&mut x[..]), ReduceOp::Sum, &opts));
    let mut y = [2f32; 4];
    rt.block_on(b.broadcast(BufferMut::from(&mut y[..]), &opts))
        .expect("the group goes on after a dropped host call");
    rt.block_on(b.barrier(&opts)).unwrap();
    // Two threads making calls at once: each waits for its turn in submit
    // (world 1: any interleaving is right).
    std::thread::scope(|s| {
        for t in 0..2 {
            let (b, opts) = (&b, &opts);
            s.spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                for i in 0..200 {
                    let v = (t * 1000 + i) as f32;
                    let mut x = vec![v; 1 + i % 300];
                    rt.block_on(b.all_reduce(BufferMut::from(&mut x[..]), ReduceOp::Sum, opts))
                        .expect("a host call made beside another thread's");
                    assert!(x.iter().all(|&y| y == v), "thread {t}, call {i}");
                }
            });
        }
    });
    rt.block_on(b.synchronize()).unwrap();
    b.shutdown().expect("shutdown after a dropped host call");
}
