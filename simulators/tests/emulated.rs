//! EmulatedComm: stream-ordered collectives on emulated device buffers,
//! rank per thread (device synchronization blocks the host, as on a GPU).

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, BufferMut, CallOptions, DType, Device, ReduceOp};
use consort_sim::{
    EmulatedComm, EmulatedCommOptions, EmulatedDevice, EmulatedOptions, SimConfig, SimRank,
    SimWorld,
};

fn per_thread<T: Send + 'static>(
    world: usize,
    f: impl Fn(SimRank) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    per_thread_in(SimConfig::new(world), f)
}

fn per_thread_in<T: Send + 'static>(
    cfg: SimConfig,
    f: impl Fn(SimRank) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let w = SimWorld::new(cfg).unwrap();
    let threads: Vec<_> = w
        .ranks()
        .into_iter()
        .map(|r| {
            let f = f.clone();
            std::thread::spawn(move || f(r))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Runs `f` on a current-thread runtime of this thread (a rank's thread).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

fn setup(rank: SimRank, seed: u64) -> (Arc<EmulatedDevice>, EmulatedComm) {
    let r = rank.rank() as u64;
    let dev = EmulatedDevice::new(EmulatedOptions {
        seed: seed ^ r,
        max_delay: Duration::from_micros(50),
        ..Default::default()
    });
    let comm =
        EmulatedComm::new(Arc::new(rank), dev.clone(), EmulatedCommOptions::default()).unwrap();
    (dev, comm)
}

#[test]
fn all_reduce_and_broadcast_on_device_buffers_are_stream_ordered() {
    let out = per_thread(3, |rank| {
        block_on(async move {
            let r = rank.rank();
            let (dev, comm) = setup(rank, 7);
            let s = dev.new_stream().unwrap();
            let x = dev.alloc_zeroed(16, s).unwrap();
            let vals = [r as f32 + 1.0; 4];
            // SAFETY: x holds 16 bytes.
            let buf = unsafe {
                dev.copy_from_host(x, consort_comm::dtype::as_bytes(&vals), s)
                    .unwrap();
                consort_comm::DeviceBuffer::new(x, 4, DType::F32, 0, s)
            };
            comm.all_reduce(
                BufferMut::Device(buf),
                ReduceOp::Sum,
                &CallOptions::default(),
            )
            .await
            .unwrap();
            let mut sum = [0f32; 4];
            // SAFETY: x holds 16 bytes.
            unsafe { dev.copy_to_host(consort_comm::dtype::as_bytes_mut(&mut sum), x, s) }.unwrap();
            comm.broadcast(BufferMut::Device(buf), &CallOptions::root(2))
                .await
                .unwrap();
            comm.synchronize().await.unwrap();
            (sum, r)
        })
    });
    for (sum, r) in out {
        assert_eq!(sum, [6.0; 4], "rank {r}");
    }
}

/// Dropping a communicator while one of its subgroups lives on (DDP's
/// bucket worker holds the survivors' group until the runtime goes) ends
/// the rank's communication thread instead of waiting for the subgroup:
/// the rank's process exits (its peers see it go), and the subgroup's
/// later calls fail.
#[test]
fn dropping_the_parent_while_a_subgroup_lives_does_not_hang() {
    let out = per_thread(2, |rank| {
        block_on(async move {
            let (_dev, comm) = setup(rank, 3);
            let o = CallOptions::default();
            let sub = comm.new_group(&[0, 1], &o).await.unwrap().unwrap();
            let mut v = [1.0f32; 4];
            sub.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum, &o)
                .await
                .unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                drop(comm);
                let _ = tx.send(());
            });
            let dropped = rx.recv_timeout(Duration::from_secs(20)).is_ok();
            let later = sub
                .all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum, &o)
                .await;
            (v, dropped, later.is_err())
        })
    });
    for (v, dropped, later_failed) in out {
        assert_eq!(v, [2.0; 4]);
        assert!(dropped, "dropping the parent hung on its subgroup");
        assert!(
            later_failed,
            "a subgroup call after its parent's drop must fail"
        );
    }
}

/// A rank's process dies while its peers are launching a burst of
/// stream-ordered device collectives (NCCL's "abort during launch"): on
/// every survivor each call either ran or fails naming the lost rank, the
/// first failure is sticky, `synchronize` reports it, and every launch
/// after that fails at once naming it too; nothing hangs (the world's
/// thread ends within its bound). The data path reports the loss as NCCL
/// does, without the rank; the fingerprint check's side channel names it
/// (a second world, which sees the rank go when its process does).
#[test]
fn a_rank_lost_during_a_burst_of_launches_fails_every_survivor_clearly() {
    const BURST: usize = 30;
    let mut cfg = SimConfig::new(3);
    cfg.faults = vec![consort_comm::fault::Fault::Crash {
        rank: 2,
        at: consort_comm::fault::Trigger::AfterMessages(12),
    }];
    let side = SimWorld::new(SimConfig::new(3)).unwrap();
    let sides = Arc::new(std::sync::Mutex::new(
        side.ranks().into_iter().map(Some).collect::<Vec<_>>(),
    ));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let out = per_thread_in(cfg, move |rank| {
            let side = sides.lock().unwrap()[rank.rank()].take().unwrap();
            block_on(async move {
                let r = rank.rank();
                let (dev, comm) = setup(rank, 11);
                comm.check_fingerprints(Arc::new(side)).unwrap();
                let s = dev.new_stream().unwrap();
                let x = dev.alloc_zeroed(4096, s).unwrap();
                // SAFETY: x holds 4096 bytes, live until the thread ends.
                let buf = unsafe { consort_comm::DeviceBuffer::new(x, 1024, DType::F32, 0, s) };
                let o = CallOptions::default().with_timeout(Duration::from_secs(10));
                let launch = || comm.all_reduce(BufferMut::Device(buf), ReduceOp::Sum, &o);
                let mut burst = Vec::new();
                for _ in 0..BURST {
                    burst.push(launch().await.map_err(|e| e.to_string()));
                    if r == 2 && burst.last().is_some_and(Result::is_err) {
                        // Crashed: its process, side channel included, is gone.
                        drop(comm);
                        return (r, burst, Err("crashed".into()), Vec::new());
                    }
                    // Host work between launches (a layer's backward): the
                    // stream runs meanwhile, so the loss lands mid-burst.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                let synced = comm.synchronize().await.map_err(|e| e.to_string());
                let mut after = Vec::new();
                for _ in 0..5 {
                    after.push(launch().await.map_err(|e| e.to_string()));
                }
                (r, burst, synced, after)
            })
        });
        let _ = tx.send(out);
    });
    let out = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a burst of launches hung after a rank was lost");
    let names_it = |e: &str| e.contains("rank 2") || e.contains("peer 2");
    for (r, burst, synced, after) in out.into_iter().filter(|o| o.0 != 2) {
        if let Some(i) = burst.iter().position(Result::is_err) {
            for (j, o) in burst[i..].iter().enumerate() {
                let e = o
                    .as_ref()
                    .expect_err("a launch after a failed one succeeded");
                assert!(names_it(e), "rank {r}, launch {}: {e}", i + j);
            }
        }
        let e = synced.expect_err("synchronize after a lost rank succeeded");
        assert!(names_it(&e), "rank {r}: synchronize: {e}");
        for (j, o) in after.iter().enumerate() {
            let e = o
                .as_ref()
                .expect_err("a launch after the failure succeeded");
            assert!(names_it(e), "rank {r}, launch {j} after synchronize: {e}");
        }
    }
}

/// A rank whose enqueue fails (`fail_enqueue_at`, as an NCCL call that
/// returns an error) aborts its communicator and tells its peers over the
/// fingerprint check's side channel: their part of that call waits on the
/// rank (NCCL tells them nothing), and fails after the stall grace naming
/// the rank and its error, not at the call's deadline.
#[test]
fn a_failed_enqueue_is_told_to_every_peer_over_the_side_channel() {
    let side = SimWorld::new(SimConfig::new(3)).unwrap();
    let sides = Arc::new(std::sync::Mutex::new(
        side.ranks().into_iter().map(Some).collect::<Vec<_>>(),
    ));
    let done = Arc::new(std::sync::Barrier::new(3));
    let out = per_thread(3, move |rank| {
        let side = sides.lock().unwrap()[rank.rank()].take().unwrap();
        let done = done.clone();
        block_on(async move {
            let r = rank.rank();
            let dev = EmulatedDevice::new(EmulatedOptions::default());
            let opts = EmulatedCommOptions {
                fail_enqueue_at: (r == 0).then_some(1),
                ..Default::default()
            };
            let comm = EmulatedComm::new(Arc::new(rank), dev, opts).unwrap();
            comm.check_fingerprints(Arc::new(side)).unwrap();
            let o = CallOptions::default().with_timeout(Duration::from_secs(60));
            let mut got = Vec::new();
            for _ in 0..2 {
                let mut x = [1f32; 4];
                let r = comm.all_reduce(BufferMut::from(&mut x[..]), ReduceOp::Sum, &o);
                got.push(r.await.map(|()| x).map_err(|e| e.to_string()));
            }
            // The side channel stays up until every peer has its verdict.
            let _ = tokio::task::spawn_blocking(move || done.wait()).await;
            (r, got)
        })
    });
    for (r, got) in out {
        assert_eq!(got[0], Ok([3.0; 4]), "rank {r}");
        let e = got[1].as_ref().expect_err("the call rank 0 never ran");
        assert!(e.contains("fail_enqueue_at"), "rank {r}: {e}");
        if r != 0 {
            assert!(e.contains("rank 0's communicator failed"), "rank {r}: {e}");
        }
    }
}

/// Blocks until `comm` (whose heartbeat file is `beat`) has made its call
/// of sequence number `seq`.
fn until_made(beat: &std::path::Path, seq: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while consort_comm::heartbeat::read(beat)
        .and_then(|b| b.last)
        .map(|l| l.1)
        != Some(seq)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "call {seq} was never made"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A heartbeat file of its own for `comm`, so a test can see its calls made.
fn watch_calls(comm: &EmulatedComm, name: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!(
        "consort-emulated-{name}-{}-{}",
        std::process::id(),
        comm.rank()
    ));
    consort_comm::heartbeat::Heartbeat::create(&path).unwrap();
    comm.set_heartbeat(&path).unwrap();
    path
}

/// Two threads of rank 0 make calls at once: the second is made while the
/// first is still in its enqueue (`stall_enqueue_at`, as an NCCL enqueue
/// polling `ncclInProgress`), so it waits for its turn, and the stream runs
/// the calls in the order they were made, the order every peer made them
/// in. Without turns the second would run first, against the peer's first
/// call, and both results would be wrong.
#[test]
fn a_call_made_while_an_earlier_one_is_still_enqueued_waits_its_turn() {
    let out = per_thread(2, |rank| {
        let r = rank.rank();
        let dev = EmulatedDevice::new(EmulatedOptions::default());
        let opts = EmulatedCommOptions {
            stall_enqueue_at: (r == 0).then_some((0, Duration::from_millis(300))),
            ..Default::default()
        };
        let comm = EmulatedComm::new(Arc::new(rank), dev, opts).unwrap();
        let beat = watch_calls(&comm, "turn");
        let o = CallOptions::default().with_timeout(Duration::from_secs(20));
        let (mut x, mut y) = ([1f32; 4], [10f32; 4]);
        let sum = ReduceOp::Sum;
        let (a, b) = std::thread::scope(|s| {
            let first = s.spawn(|| block_on(comm.all_reduce(BufferMut::from(&mut x[..]), sum, &o)));
            until_made(&beat, 0);
            let second = block_on(comm.all_reduce(BufferMut::from(&mut y[..]), sum, &o));
            (first.join().unwrap(), second)
        });
        let _ = std::fs::remove_file(&beat);
        (r, a.map(|()| x), b.map(|()| y))
    });
    for (r, a, b) in out {
        assert_eq!(a.unwrap(), [2.0; 4], "rank {r}: the first call");
        assert_eq!(b.unwrap(), [20.0; 4], "rank {r}: the second call");
    }
}

/// A call made on one thread while another thread's call, made just before
/// it, is stuck in its enqueue waits (in `submit`) for its turn, then fails
/// at its timeout naming that call; the group is then done: the stuck call
/// is refused when its enqueue ends, and later calls say why at once.
/// (World 1: the rules, without peers.)
#[test]
fn a_call_behind_a_stuck_enqueue_names_it_and_ends_the_group() {
    let rank = SimWorld::new(SimConfig::new(1)).unwrap().ranks().remove(0);
    let opts = EmulatedCommOptions {
        stall_enqueue_at: Some((0, Duration::from_millis(600))),
        ..Default::default()
    };
    let dev = EmulatedDevice::new(EmulatedOptions::default());
    let comm = EmulatedComm::new(Arc::new(rank), dev, opts).unwrap();
    let beat = watch_calls(&comm, "stuck");
    let short = CallOptions::default().with_timeout(Duration::from_millis(100));
    let (sum, (mut x, mut y)) = (ReduceOp::Sum, ([1f32; 4], [2f32; 4]));
    let (first, second) = std::thread::scope(|s| {
        let first = s.spawn(|| block_on(comm.broadcast(BufferMut::from(&mut x[..]), &short)));
        until_made(&beat, 0);
        let second = block_on(comm.all_reduce(BufferMut::from(&mut y[..]), sum, &short));
        (first.join().unwrap(), second)
    });
    let e = second.unwrap_err().to_string();
    assert!(e.contains("broadcast call (seq 0)"), "{e}");
    let e = first.unwrap_err().to_string();
    assert!(e.contains("broadcast call (seq 0)"), "the stuck call: {e}");
    let later = block_on(comm.barrier(&short)).unwrap_err().to_string();
    assert!(later.contains("broadcast call (seq 0)"), "{later}");
    drop(comm);
    let _ = std::fs::remove_file(&beat);
}
