//! The conformance suite on the TCP backend: every world is N real
//! backends in this process, meeting through a store and talking over a
//! full mesh of loopback sockets; once with every byte on TCP (as between
//! hosts), once through shared memory (same host), and with the in-place
//! and multi-stream paths forced. (The multi-process tests run it across
//! OS processes.)

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, algo::AlgoConfig, store::MemStore};
use consort_shm::ShmTransport;
use consort_tcp::{TcpBackend, TcpOptions};
use consort_tests::WorldFuture;

/// The shared-memory transport with the smallest queues (64 KiB): worlds
/// of up to 16 ranks build n(n-1) queues, each mapped whole at set-up, and
/// small queues also fill and wrap often, which the suite should see.
fn small_queues() -> ShmTransport {
    ShmTransport {
        queue_bytes: 64 << 10,
        ..ShmTransport::default()
    }
}

fn tcp_world(n: usize) -> WorldFuture {
    world_with(n, 1, usize::MAX, false)
}

fn tcp_world_shm(n: usize) -> WorldFuture {
    world_with(n, 1, 0, true)
}

/// Shared memory with single-copy reads (CMA): payloads are read by the
/// receiver from the sender's memory (reductions through a bounce buffer).
fn tcp_world_cma(n: usize) -> WorldFuture {
    world_local(n, 0, "", cma)
}

/// Small queues with single-copy reads.
fn cma(_: usize) -> ShmTransport {
    ShmTransport {
        cma: true,
        ..small_queues()
    }
}

/// Single-copy reads with all_reduce forced to `algo` (the suite's sizes
/// would pick recursive doubling, which sends no pulls): the reductions
/// read their operands from the peers' memory, straight into place from
/// `in_place_min` bytes on (else into a buffer the call reduces from).
fn cma_all_reduce(n: usize, algo: &'static str, in_place_min: usize) -> WorldFuture {
    world_local(n, in_place_min, algo, cma)
}

fn tcp_world_cma_ring(n: usize) -> WorldFuture {
    cma_all_reduce(n, "all_reduce=ring", 0)
}

fn tcp_world_cma_halving_doubling(n: usize) -> WorldFuture {
    cma_all_reduce(n, "all_reduce=halving_doubling", 1 << 20)
}

fn tcp_world_cma_direct(n: usize) -> WorldFuture {
    cma_all_reduce(n, "all_reduce=direct,broadcast=direct", 0)
}

fn tcp_world_3_streams(n: usize) -> WorldFuture {
    world_with_streams(n, 3)
}

fn tcp_world_in_place(n: usize) -> WorldFuture {
    world_with(n, 1, 0, false)
}

fn world_with_streams(n: usize, streams: usize) -> WorldFuture {
    world_with(n, streams, usize::MAX, false)
}

/// Ring all_reduce and chain broadcast forced: the suite's lengths stay
/// below the size where the policy picks them, so without this the ring
/// and chain paths of the TCP driver would go untested in-process.
/// The one-shot all_reduce on shared memory.
fn tcp_world_one_shot(n: usize) -> WorldFuture {
    world_opts(n, 1, usize::MAX, true, "all_reduce=one_shot")
}

fn tcp_world_ring(n: usize) -> WorldFuture {
    world_opts(n, 1, usize::MAX, true, "all_reduce=ring,broadcast=chain")
}

/// `in_place_min = 0` sends every posted receive down the in-place path;
/// `usize::MAX` none. `shm` passes payloads through shared memory (every
/// rank of these worlds is on this host); without it, every byte crosses
/// a TCP socket, as between hosts.
fn world_with(n: usize, streams: usize, in_place_min: usize, shm: bool) -> WorldFuture {
    world_opts(n, streams, in_place_min, shm, "")
}

/// The suite's options: generous hang guards (up to 16 ranks build a full
/// mesh on a 2-core machine, where CI may be busy with other work), small
/// segments so that short buffers exercise pipelining, quick stall probes.
fn suite_options() -> TcpOptions {
    TcpOptions {
        timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(60),
        algo: AlgoConfig {
            segment_bytes: 64,
            window: 4,
            overrides: Vec::new(),
            oversubscribed: false,
            shared_stage: false,
        },
        stall_probe: Duration::from_millis(100),
        ..TcpOptions::default()
    }
}

/// `n` ranks meeting through one store, rank `r` with options `opts(r)`.
async fn connect_all(n: usize, opts: impl Fn(usize) -> TcpOptions) -> Vec<Arc<TcpBackend>> {
    let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
    let tasks: Vec<_> = (0..n)
        .map(|r| tokio::spawn(consort_tcp::connect(store.clone(), r, n, opts(r))))
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(Arc::new(t.await.expect("connect task").expect("connect")));
    }
    out
}

/// The handles of `connect_all` as a conformance world.
async fn as_world(b: Vec<Arc<TcpBackend>>) -> Vec<Arc<dyn Backend>> {
    b.into_iter().map(|b| b as Arc<dyn Backend>).collect()
}

/// Every rank on shared memory, rank `r` with transport `shm(r)`, the
/// choices of `overrides` forced.
async fn local_backends(
    n: usize,
    in_place_min: usize,
    overrides: &str,
    shm: impl Fn(usize) -> ShmTransport,
) -> Vec<Arc<TcpBackend>> {
    connect_all(n, |r| {
        let mut o = TcpOptions {
            in_place_min,
            // Every payload goes as a pull frame where single copies are
            // on (but recursive doubling's).
            single_copy_min: 0,
            local: Some(shm(r).shared()),
            ..suite_options()
        };
        o.algo.overrides = AlgoConfig::parse_overrides(overrides).expect("overrides");
        o
    })
    .await
}

fn world_local(
    n: usize,
    in_place_min: usize,
    overrides: &'static str,
    shm: impl Fn(usize) -> ShmTransport + Send + Sync + 'static,
) -> WorldFuture {
    Box::pin(async move { as_world(local_backends(n, in_place_min, overrides, shm).await).await })
}

fn world_opts(
    n: usize,
    streams: usize,
    in_place_min: usize,
    shm: bool,
    overrides: &'static str,
) -> WorldFuture {
    Box::pin(async move {
        let opts = |_| {
            let mut o = TcpOptions {
                streams,
                in_place_min,
                local: shm.then(|| small_queues().shared()),
                ..suite_options()
            };
            o.algo.overrides = AlgoConfig::parse_overrides(overrides).expect("overrides");
            o
        };
        as_world(connect_all(n, opts).await).await
    })
}

/// A TCP world that is a subgroup of a bigger one (see
/// `consort_tests::subworld`), through shared memory.
fn tcp_subgroup(n: usize) -> WorldFuture {
    consort_tests::on_subgroup(tcp_world_shm, n)
}

mod one_stream {
    consort_tests::conformance!(crate::tcp_world, cases = 32);
}

mod shared_memory {
    consort_tests::conformance!(crate::tcp_world_shm, cases = 32);
}

mod single_copy {
    consort_tests::conformance!(crate::tcp_world_cma, cases = 32);
}

mod single_copy_ring {
    consort_tests::conformance!(crate::tcp_world_cma_ring, cases = 16);
}

mod single_copy_halving_doubling {
    consort_tests::conformance!(crate::tcp_world_cma_halving_doubling, cases = 16);
}

mod single_copy_direct {
    consort_tests::conformance!(crate::tcp_world_cma_direct, cases = 16);
}

mod in_place {
    consort_tests::conformance!(crate::tcp_world_in_place, cases = 32);
}

mod subgroup {
    consort_tests::conformance!(crate::tcp_subgroup, cases = 16);
}

mod ring_and_chain {
    consort_tests::conformance!(crate::tcp_world_ring, cases = 16);
}

mod one_shot {
    consort_tests::conformance!(crate::tcp_world_one_shot, cases = 16);
}

/// The one-shot all_reduce sums in rank order on every rank: floats whose
/// sum depends on the order come out with the same bits everywhere, the
/// bits of `((x0 + x1) + x2) + ...`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_shot_sum_has_the_same_bits_on_every_rank() {
    let n = 5;
    let ranks = connect_all(n, |_| {
        let mut o = TcpOptions {
            local: Some(small_queues().shared()),
            ..suite_options()
        };
        o.algo.overrides = AlgoConfig::parse_overrides("all_reduce=one_shot").unwrap();
        o
    })
    .await;
    // Magnitudes 1e-8 to 1e8: any other order rounds differently.
    let x = |r: usize, i: usize| -> f32 {
        let e = ((i * 7 + r * 13) % 17) as i32 - 8;
        (1.0 + (i % 10) as f32 * 0.1 + r as f32 * 0.37) * 10f32.powi(e)
    };
    let len = 3000;
    let runs: Vec<_> = ranks
        .iter()
        .cloned()
        .map(|b| {
            tokio::spawn(async move {
                let r = b.rank();
                let pg = consort_comm::ProcessGroup::new(b);
                let mut v: Vec<f32> = (0..len).map(|i| x(r, i)).collect();
                pg.all_reduce(&mut v, consort_comm::ReduceOp::Sum)
                    .await
                    .unwrap();
                v
            })
        })
        .collect();
    let want: Vec<u32> = (0..len)
        .map(|i| (1..n).fold(x(0, i), |acc, q| acc + x(q, i)).to_bits())
        .collect();
    let rotated = (0..len)
        .filter(|&i| {
            (1..n)
                .fold(x(2, i), |acc, q| acc + x((q + 2) % n, i))
                .to_bits()
                != want[i]
        })
        .count();
    assert!(
        rotated > 0,
        "the inputs must be order-sensitive for this test to mean anything"
    );
    for (r, t) in runs.into_iter().enumerate() {
        let got: Vec<u32> = t.await.unwrap().iter().map(|v| v.to_bits()).collect();
        assert!(
            got == want,
            "rank {r}'s sum differs from the rank-order sum"
        );
    }
}

mod three_streams {
    consort_tests::conformance!(crate::tcp_world_3_streams, cases = 8);
}

/// Ranks that run with different segment sizes (CONSORT_SEGMENT_BYTES) on
/// one host: the mesh agrees on the smallest before any schedule runs, and
/// every pair really goes through shared memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_with_different_segment_sizes_agree_through_shared_memory() {
    let n = 3;
    let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
    let segments = [64 << 10, 1 << 20, 256 << 10];
    let tasks: Vec<_> = (0..n)
        .map(|r| {
            let opts = TcpOptions {
                timeout: Duration::from_secs(20),
                connect_timeout: Duration::from_secs(60),
                algo: AlgoConfig {
                    segment_bytes: segments[r],
                    window: 4,
                    overrides: AlgoConfig::parse_overrides("broadcast=chain").unwrap(),
                    oversubscribed: false,
                    shared_stage: false,
                },
                local: Some(ShmTransport::default().shared()),
                ..TcpOptions::default()
            };
            tokio::spawn(consort_tcp::connect(store.clone(), r, n, opts))
        })
        .collect();
    let mut ranks = Vec::new();
    for t in tasks {
        ranks.push(Arc::new(t.await.unwrap().unwrap()));
    }
    // Every pair really goes through shared memory (sealed memfds here).
    for b in &ranks {
        let t = b.transports();
        assert_eq!(t.iter().filter(|&&t| t == "shm").count(), n - 1, "{t:?}");
    }
    for (r, b) in ranks.iter().enumerate() {
        let want: Vec<usize> = (0..n).filter(|&p| p != r).collect();
        assert_eq!(
            b.shared_memory_peers(),
            want,
            "rank {r}'s shared-memory peers"
        );
    }
    let runs: Vec<_> = ranks
        .iter()
        .cloned()
        .map(|b| {
            tokio::spawn(async move {
                let r = b.rank();
                let pg = consort_comm::ProcessGroup::new(b);
                // A broadcast larger than a queue: the chain moves whole
                // segments through the queues as the readers free room.
                let len = 3 * (4 << 20) / 4 + 5;
                let mut x: Vec<f32> = (0..len)
                    .map(|i| if r == 0 { (i % 97) as f32 } else { -1.0 })
                    .collect();
                pg.broadcast(&mut x, 0).await.unwrap();
                x.iter().enumerate().all(|(i, &v)| v == (i % 97) as f32)
            })
        })
        .collect();
    for (r, t) in runs.into_iter().enumerate() {
        assert!(t.await.unwrap(), "rank {r} received a wrong broadcast");
    }
}

/// A rank that does not let peers read its memory (CMA off there, as where
/// ptrace policy or a container forbids it) gets and sends its payloads
/// through the queues, while the other pairs read each other's memory: the
/// fallback is per pair, and the results are the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_without_single_copy_falls_back_to_the_queues_per_pair() {
    let n = 3;
    let world = local_backends(n, 0, "", |r| ShmTransport {
        cma: r != 1,
        ..ShmTransport::default()
    })
    .await;
    // Ranks 0 and 2 read each other; nobody reads rank 1, and rank 1 reads
    // nobody.
    let readers: Vec<Vec<usize>> = world.iter().map(|b| b.single_copy_peers()).collect();
    assert_eq!(readers, vec![vec![2], vec![], vec![0]]);
    let runs: Vec<_> = world
        .into_iter()
        .map(|b| {
            tokio::spawn(async move {
                let r = b.rank();
                let pg = consort_comm::ProcessGroup::new(b);
                let len = (1 << 20) + 3;
                let mut x: Vec<f32> = (0..len)
                    .map(|i| if r == 1 { (i % 89) as f32 } else { -1.0 })
                    .collect();
                pg.broadcast(&mut x, 1).await.unwrap();
                let mut all = vec![0f32; 3 * len];
                let mine: Vec<f32> = (0..len).map(|i| (r * 1000 + i % 7) as f32).collect();
                pg.all_gather(&mut all, &mine).await.unwrap();
                x.iter().enumerate().all(|(i, &v)| v == (i % 89) as f32)
                    && (0..3).all(|q| {
                        all[q * len..(q + 1) * len]
                            .iter()
                            .enumerate()
                            .all(|(i, &v)| v == (q * 1000 + i % 7) as f32)
                    })
            })
        })
        .collect();
    for (r, t) in runs.into_iter().enumerate() {
        assert!(t.await.unwrap(), "rank {r} got wrong data");
    }
}

/// A rank that comes late to a call finds a large frame already begun in
/// a buffer (its idle poll took the first queueful): the rest of it goes
/// straight into the receive once the call posts it, in a copy and in a
/// reduction, and the results are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_begun_before_its_receive_is_posted_finishes_in_place() {
    late_receives(Some(small_queues()), 1 << 20).await;
}

/// The same on TCP streams, where the reader task took the first part of
/// the frame (what the sockets' buffers held) before the receive was
/// posted: one frame of 64 MiB, more than loopback buffers hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_begun_on_a_stream_before_its_receive_is_posted_finishes_in_place() {
    late_receives(None, 16 << 20).await;
}

/// Rank 1 comes late to a broadcast and an all_reduce of `len` f32 each
/// (one frame per message), on shared memory `local` or on TCP, while
/// rank 0 leaves its calls for a while after starting them.
///
/// Rank 1 runs on a runtime of its own, which it blocks while rank 0
/// starts each call: its reader cannot keep pace meanwhile, so rank 0's
/// first polls write only what the sockets or queues hold, and the frame is
/// still coming in when rank 1 posts its receive. (With both ranks on one
/// runtime, a reader that kept pace let rank 0's first poll write the whole
/// frame, and nothing was late.)
async fn late_receives(local: Option<ShmTransport>, len: usize) {
    let opts = move || TcpOptions {
        timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(60),
        in_place_min: 0,
        algo: AlgoConfig {
            overrides: AlgoConfig::parse_overrides("all_reduce=ring,broadcast=chain").unwrap(),
            // One frame per message (and per ring step).
            segment_bytes: 4 * len,
            ..AlgoConfig::default()
        },
        local: local.clone().map(ShmTransport::shared),
        ..TcpOptions::default()
    };
    let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
    let (s1, o1) = (store.clone(), opts());
    let one = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let b = consort_tcp::connect(s1, 1, 2, o1).await.expect("connect");
            late_rank(Arc::new(b), len).await
        })
    });
    let b0 = consort_tcp::connect(store, 0, 2, opts())
        .await
        .expect("connect");
    let got0 = late_rank(Arc::new(b0), len).await;
    let got1 = tokio::task::spawn_blocking(move || one.join().unwrap())
        .await
        .unwrap();
    let got = [got0, got1];
    assert!(got.iter().all(|g| g.0), "wrong results: {got:?}");
    assert!(
        got[0].2 + got[1].2 >= 1,
        "late receives (after the broadcast, at the end) on each rank: {got:?}"
    );
}

/// One rank of [`late_receives`]: whether its results are exact, and its
/// late receives after the broadcast and at the end.
async fn late_rank(b: Arc<TcpBackend>, len: usize) -> (bool, u64, u64) {
    let r = b.rank();
    let pg = consort_comm::ProcessGroup::new(b.clone());
    let mut x: Vec<f32> = (0..len)
        .map(|i| if r == 0 { (i % 89) as f32 } else { -1.0 })
        .collect();
    let mut y: Vec<f32> = (0..len).map(|i| (r * 1000 + i % 7) as f32).collect();
    late_call(r, pg.broadcast(&mut x, 0)).await;
    let after_broadcast = b.late_receives();
    late_call(r, pg.all_reduce(&mut y, consort_comm::ReduceOp::Sum)).await;
    let right = x.iter().enumerate().all(|(i, &v)| v == (i % 89) as f32)
        && y.iter()
            .enumerate()
            .all(|(i, &v)| v == (1000 + 2 * (i % 7)) as f32);
    (right, after_broadcast, b.late_receives())
}

/// Runs `call` on rank `r`. Rank 1 blocks its runtime for 60 ms, lets its
/// reader take what has come for 40 ms, and then posts its receive; rank
/// 0, 20 ms into that block, starts the call (its first polls write the
/// start of its first frame) and then leaves it until 300 ms.
async fn late_call<E: std::fmt::Debug>(
    r: usize,
    call: impl std::future::Future<Output = Result<(), E>>,
) {
    let mut call = std::pin::pin!(call);
    let done = if r == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let done = poll_a_little(call.as_mut()).await;
        tokio::time::sleep(Duration::from_millis(280)).await;
        done
    } else {
        std::thread::sleep(Duration::from_millis(60));
        tokio::time::sleep(Duration::from_millis(40)).await;
        None
    };
    match done {
        Some(out) => out.unwrap(),
        None => call.await.unwrap(),
    }
}

/// Polls `f` five times, a millisecond apart (its output, if it is done):
/// enough to start writing its first frame, and mostly too little to
/// finish it.
async fn poll_a_little<F: std::future::Future>(mut f: std::pin::Pin<&mut F>) -> Option<F::Output> {
    for _ in 0..5 {
        let out = std::future::poll_fn(|cx| std::task::Poll::Ready(f.as_mut().poll(cx))).await;
        if let std::task::Poll::Ready(out) = out {
            return Some(out);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    None
}

/// A world whose links apply `faults` (the faulty link), on TCP streams or
/// shared memory, with a 3 s op timeout.
fn faulty(n: usize, faults: Vec<consort_comm::fault::Fault>, shm: bool) -> WorldFuture {
    Box::pin(async move {
        let opts = |_| TcpOptions {
            timeout: Duration::from_secs(3),
            local: shm.then(|| ShmTransport::default().shared()),
            faults: faults.clone(),
            fault_seed: 7,
            ..suite_options()
        };
        as_world(connect_all(n, opts).await).await
    })
}

fn faulty_tcp(n: usize, faults: Vec<consort_comm::fault::Fault>) -> WorldFuture {
    faulty(n, faults, false)
}

fn faulty_shm(n: usize, faults: Vec<consort_comm::fault::Fault>) -> WorldFuture {
    faulty(n, faults, true)
}

mod tcp_faults {
    consort_tests::faults!(crate::faulty_tcp);
}

mod shm_faults {
    consort_tests::faults!(crate::faulty_shm);
}
