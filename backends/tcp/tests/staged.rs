//! The direct broadcast through each rank's stage (same-host shared
//! memory): the root copies each segment in once, every reader copies it
//! out. Real shared memory, real ranks (tasks of this process, each with
//! its own mesh), the schedule the policy picks.

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, CommError, MemStore, ProcessGroup, algo::AlgoConfig};
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
    let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
    let tasks: Vec<_> = (0..n)
        .map(|r| {
            let opts = TcpOptions {
                timeout,
                connect_timeout: Duration::from_secs(60),
                algo: AlgoConfig::default(),
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

/// Broadcasts `len` bytes from `root` over `ranks`; returns, per rank,
/// whether it holds the root's bytes, and the frames each staged.
async fn broadcast(ranks: &[Arc<TcpBackend>], root: usize, len: usize) -> (Vec<bool>, Vec<u64>) {
    let runs: Vec<_> = ranks
        .iter()
        .cloned()
        .map(|b| {
            tokio::spawn(async move {
                let pg = ProcessGroup::new(b.clone());
                let mut x = before_broadcast(b.rank(), root, len);
                pg.broadcast(&mut x, root).await.expect("broadcast");
                let ok = x.iter().enumerate().all(|(i, &v)| v == value(i));
                (ok, b.staged_frames())
            })
        })
        .collect();
    let mut oks = Vec::new();
    let mut staged = Vec::new();
    for t in runs {
        let (ok, s) = t.await.unwrap();
        oks.push(ok);
        staged.push(s);
    }
    (oks, staged)
}

/// Segments of a `len`-byte direct broadcast at the default segment size.
fn segments(len: usize) -> u64 {
    len.div_ceil(AlgoConfig::default().fan_out_segment_bytes()) as u64
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// Any world of 3 to 5 ranks, any root, lengths on and off the segment
    /// size (odd ones too): every rank holds the root's bytes, and the root
    /// staged one frame per reader and segment (so the stage, not a
    /// fallback, carried them), through a stage that holds all of them or
    /// one that holds only two segments (the root waits for the readers).
    #[test]
    fn every_reader_gets_the_roots_bytes_through_its_stage(
        n in 3usize..=5,
        root_pick in 0usize..5,
        extra in prop_oneof![Just(0usize), Just(1), 0usize..(3 << 20)],
        small_stage in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
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
