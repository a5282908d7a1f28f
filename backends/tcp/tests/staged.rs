//! The direct broadcast through each rank's stage (same-host shared
//! memory): the root copies each segment in once, every reader copies it
//! out. Real shared memory, real ranks (tasks of this process, each with
//! its own mesh), the schedule the policy picks.

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, CommError, MemStore, ProcessGroup, ReduceOp, algo::AlgoConfig};
use consort_shm::ShmTransport;
use consort_tcp::{TcpBackend, TcpOptions};
use proptest::prelude::*;

/// `n` ranks on shared memory, rank `r` with transport `shm(r)`, a call
/// timeout of `timeout`, default segments (1 MiB broadcast segments).
async fn world(
    n: usize,
    timeout: Duration,
    shm: impl Fn(usize) -> ShmTransport,
) -> Vec<Arc<TcpBackend>> {
    world_with(n, timeout, AlgoConfig::default(), shm).await
}

/// As [`world`], with the schedules' config `algo`.
async fn world_with(
    n: usize,
    timeout: Duration,
    algo: AlgoConfig,
    shm: impl Fn(usize) -> ShmTransport,
) -> Vec<Arc<TcpBackend>> {
    let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
    let tasks: Vec<_> = (0..n)
        .map(|r| {
            let opts = TcpOptions {
                timeout,
                connect_timeout: Duration::from_secs(60),
                algo: algo.clone(),
                local: Some(shm(r).shared()),
                ..TcpOptions::default()
            };
            tokio::spawn(consort_tcp::connect(store.clone(), r, n, opts))
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(Arc::new(t.await.unwrap().expect("connect")));
    }
    out
}

/// The value element `i` of the root's buffer holds.
fn value(i: usize) -> u8 {
    (i % 251) as u8 ^ 0x5A
}

/// Rank `r`'s buffer before a broadcast from `root`: the root's bytes on
/// the root, a filler elsewhere.
fn before_broadcast(r: usize, root: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| if r == root { value(i) } else { 0xEE })
        .collect()
}

/// Runs `f` on every rank at once (a task each); returns what each
/// returned, split into its two halves, in rank order.
async fn on_every_rank<A, B, Fut>(
    ranks: &[Arc<TcpBackend>],
    f: impl Fn(Arc<TcpBackend>) -> Fut,
) -> (Vec<A>, Vec<B>)
where
    Fut: Future<Output = (A, B)> + Send + 'static,
    A: Send + 'static,
    B: Send + 'static,
{
    let runs: Vec<_> = ranks.iter().cloned().map(|b| tokio::spawn(f(b))).collect();
    let mut out = (Vec::new(), Vec::new());
    for t in runs {
        let (a, b) = t.await.unwrap();
        out.0.push(a);
        out.1.push(b);
    }
    out
}

/// Broadcasts `len` bytes from `root` over `ranks`; returns, per rank,
/// whether it holds the root's bytes, and the frames each staged.
async fn broadcast(ranks: &[Arc<TcpBackend>], root: usize, len: usize) -> (Vec<bool>, Vec<u64>) {
    on_every_rank(ranks, |b| async move {
        let pg = ProcessGroup::new(b.clone());
        let mut x = before_broadcast(b.rank(), root, len);
        pg.broadcast(&mut x, root).await.expect("broadcast");
        let ok = x.iter().enumerate().all(|(i, &v)| v == value(i));
        (ok, b.staged_frames())
    })
    .await
}

/// A runtime for a proptest case: two workers, as the tests' own.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Segments of a `len`-byte direct broadcast at the default segment size.
fn segments(len: usize) -> u64 {
    len.div_ceil(AlgoConfig::default().fan_out_segment_bytes()) as u64
}

/// Rank `r`'s element `i` before an all_reduce: small integers, so that
/// f32 sums are exact in any order.
fn contribution(r: usize, i: usize) -> f32 {
    ((i * 7 + r * 3) % 17) as f32
}

/// Sums `count` f32s over `ranks` (the policy's schedule); returns, per
/// rank, the elements that differ from the exact sum, and the frames each
/// staged.
async fn all_reduce(ranks: &[Arc<TcpBackend>], count: usize) -> (Vec<usize>, Vec<u64>) {
    let n = ranks.len();
    on_every_rank(ranks, |b| async move {
        let pg = ProcessGroup::new(b.clone());
        let r = b.rank();
        let mut x: Vec<f32> = (0..count).map(|i| contribution(r, i)).collect();
        pg.all_reduce(&mut x, ReduceOp::Sum)
            .await
            .expect("all_reduce");
        let exact = |i: usize| (0..n).map(|p| contribution(p, i)).sum::<f32>();
        let wrong = x
            .iter()
            .enumerate()
            .filter(|&(i, &v)| v != exact(i))
            .count();
        (wrong, b.staged_frames())
    })
    .await
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// The direct all_reduce over 2 to 5 ranks, part lengths on and off
    /// the segment and the world: every rank holds the exact sums, and
    /// each staged every segment it sent (its peers' parts once each, its
    /// reduced part once for all readers: one frame per peer and segment
    /// each way), through a stage that holds them all or only a few
    /// segments (ranks wait for their readers), twice in a row.
    #[test]
    fn the_direct_all_reduce_goes_through_every_ranks_stage(
        n in 2usize..=5,
        extra in prop_oneof![Just(0usize), Just(1), 0usize..(1 << 20)],
        small_stage in any::<bool>(),
    ) {
        runtime().block_on(async {
            let stage = if small_stage { 1 << 20 } else { 16 << 20 };
            let algo = AlgoConfig {
                overrides: AlgoConfig::parse_overrides("all_reduce=direct").unwrap(),
                ..AlgoConfig::default()
            };
            let ranks = world_with(n, Duration::from_secs(30), algo, |_| ShmTransport {
                stage_bytes: stage,
                ..ShmTransport::default()
            })
            .await;
            // Every part at least one segment: every segment is staged.
            let count = n * (AlgoConfig::default().fan_out_segment_bytes() / 4) + extra;
            let segs = (count / n * 4).div_ceil(AlgoConfig::default().fan_out_segment_bytes());
            let want = 2 * (n as u64 - 1) * segs as u64;
            for round in 1..=2u64 {
                let (wrong, staged) = all_reduce(&ranks, count).await;
                prop_assert!(wrong.iter().all(|&w| w == 0), "wrong elements: {wrong:?}");
                for (r, &s) in staged.iter().enumerate() {
                    prop_assert_eq!(s, round * want, "rank {}", r);
                }
            }
            Ok(())
        })?;
    }

    /// Any world of 2 to 5 ranks, any root, lengths on and off the segment
    /// size (odd ones too): every rank holds the root's bytes, and the root
    /// staged one frame per reader and segment (so the stage, not a
    /// fallback, carried them), through a stage that holds all of them or
    /// one that holds only two segments (the root waits for the readers).
    #[test]
    fn every_reader_gets_the_roots_bytes_through_its_stage(
        n in 2usize..=5,
        root_pick in 0usize..5,
        extra in prop_oneof![Just(0usize), Just(1), 0usize..(3 << 20)],
        small_stage in any::<bool>(),
    ) {
        runtime().block_on(async {
            let stage = if small_stage { 2 << 20 } else { 16 << 20 };
            let ranks = world(n, Duration::from_secs(30), |_| ShmTransport {
                stage_bytes: stage,
                ..ShmTransport::default()
            })
            .await;
            let root = root_pick % n;
            let len = (4 << 20) + extra;
            let (oks, staged) = broadcast(&ranks, root, len).await;
            prop_assert!(oks.iter().all(|&ok| ok), "wrong bytes: {oks:?}");
            let want = (n as u64 - 1) * segments(len);
            for (r, &s) in staged.iter().enumerate() {
                prop_assert_eq!(s, if r == root { want } else { 0 }, "rank {}", r);
            }
            // The root's stage is free again: a second broadcast from it
            // stages as much, and so does one from another root.
            let (oks, again) = broadcast(&ranks, root, len).await;
            prop_assert!(oks.iter().all(|&ok| ok));
            prop_assert_eq!(again[root], 2 * want);
            let other = (root + 1) % n;
            let (oks, third) = broadcast(&ranks, other, len).await;
            prop_assert!(oks.iter().all(|&ok| ok));
            prop_assert_eq!(third[other], want);
            Ok(())
        })?;
    }
}

/// A rank without a stage (`CONSORT_SHM_STAGE_BYTES=0`) makes every rank
/// keep the chain: nothing is staged, and the bytes are right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rank_without_a_stage_keeps_everyone_on_the_chain() {
    let ranks = world(3, Duration::from_secs(30), |r| ShmTransport {
        stage_bytes: if r == 2 { 0 } else { 4 << 20 },
        ..ShmTransport::default()
    })
    .await;
    let (oks, staged) = broadcast(&ranks, 0, 8 << 20).await;
    assert!(oks.iter().all(|&ok| ok), "{oks:?}");
    assert_eq!(staged, vec![0, 0, 0]);
}

/// A reader that never joins the broadcast: its idle rank buffers what
/// comes early, but never acknowledges, so the root's call fails by its
/// deadline, naming the rank; it does not hang. The reader that came
/// finishes with the root's bytes, or fails with the root's abort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_never_comes_fails_the_root_by_the_deadline() {
    let ranks = world(3, Duration::from_secs(2), |_| ShmTransport::default()).await;
    let len = 16 << 20;
    let runs: Vec<_> = ranks[..2]
        .iter()
        .cloned()
        .map(|b| {
            tokio::spawn(async move {
                let pg = ProcessGroup::new(b.clone());
                let mut x = before_broadcast(b.rank(), 0, len);
                let started = std::time::Instant::now();
                let got = pg.broadcast(&mut x, 0).await;
                let right = x.iter().enumerate().all(|(i, &v)| v == value(i));
                (got, right, started.elapsed())
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in runs {
        out.push(t.await.unwrap());
    }
    let (root, reader) = (&out[0], &out[1]);
    match &root.0 {
        Err(e @ CommError::Timeout { .. }) => {
            assert!(e.to_string().contains("waiting for rank 2"), "{e}")
        }
        other => panic!("the root: {other:?}"),
    }
    assert!(
        root.2 < Duration::from_secs(20),
        "the root took {:?}",
        root.2
    );
    match &reader.0 {
        Ok(()) => assert!(reader.1, "rank 1 returned Ok with wrong bytes"),
        Err(e) => assert!(
            matches!(e, CommError::Timeout { .. } | CommError::Aborted { .. }),
            "{e}"
        ),
    }
    assert!(
        reader.2 < Duration::from_secs(20),
        "rank 1 took {:?}",
        reader.2
    );
}

/// A staged broadcast dropped mid-call (its root's future cancelled while
/// rank 2 has not come) gives the stage back: a broadcast from the same
/// root in a new group stages every segment again (a stage still held by
/// the dropped call would send them all through the queues), and every
/// rank holds its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_staged_call_gives_the_stage_back() {
    let n = 3;
    let ranks = world(n, Duration::from_secs(5), |_| ShmTransport {
        stage_bytes: 1 << 20,
        ..ShmTransport::default()
    })
    .await;
    let len = 8 << 20;
    let runs: Vec<_> = ranks
        .iter()
        .cloned()
        .map(|b| {
            tokio::spawn(async move {
                let world = ProcessGroup::new(b.clone());
                let first = world.new_group(&[0, 1, 2]).await.unwrap().unwrap();
                let r = b.rank();
                let mut x = before_broadcast(r, 0, len);
                // The root: cut short; rank 1: no wrong bytes.
                let first_ok = match r {
                    // Cut short while rank 2 has not come: the stage is
                    // full of segments it has not read.
                    0 => {
                        tokio::time::timeout(Duration::from_millis(300), first.broadcast(&mut x, 0))
                            .await
                            .is_err()
                    }
                    // Done before the root was cut short, or failed by its
                    // abort: either way not with wrong bytes.
                    1 => match first.broadcast(&mut x, 0).await {
                        Ok(()) => x.iter().enumerate().all(|(i, &v)| v == value(i)),
                        Err(_) => true,
                    },
                    _ => {
                        tokio::time::sleep(Duration::from_millis(600)).await;
                        true
                    }
                };
                let staged_before = b.staged_frames();
                let second = world.new_group(&[0, 1, 2]).await.unwrap().unwrap();
                let mut y = before_broadcast(r, 0, len);
                second
                    .broadcast(&mut y, 0)
                    .await
                    .expect("broadcast in the new group");
                let ok = y.iter().enumerate().all(|(i, &v)| v == value(i));
                (first_ok, ok, b.staged_frames() - staged_before)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in runs {
        out.push(t.await.unwrap());
    }
    assert!(out[0].0, "the root's first broadcast was to be cut short");
    assert!(
        out[1].0,
        "rank 1's first broadcast returned Ok with wrong bytes"
    );
    assert!(
        out.iter().all(|o| o.1),
        "wrong bytes after the dropped call"
    );
    assert_eq!(out[0].2, (n as u64 - 1) * segments(len), "staged frames");
}
