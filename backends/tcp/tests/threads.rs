//! Threads within a rank (`MeshOptions::threads`, `consort_comm::par`):
//! every large copy and reduction of a same-host collective split over 4
//! threads gives the same bytes as one thread. Its own test binary, so
//! every mesh of this process sets the process's pool to 4 threads (2
//! cores here: this proves correctness, not speed; see BENCHMARKS.md).

use std::{sync::Arc, time::Duration};

use consort_comm::{
    Backend, MemStore, ProcessGroup, ReduceOp,
    algo::AlgoConfig,
    par::{PART_MIN, Pool},
};
use consort_shm::ShmTransport;
use consort_tcp::{TcpBackend, TcpOptions};
use proptest::prelude::*;

const THREADS: usize = 4;

/// `n` ranks on shared memory (small queues, so pieces wrap), each
/// splitting its copies over [`THREADS`] threads, schedules `overrides`.
async fn world(n: usize, overrides: &str) -> Vec<Arc<TcpBackend>> {
    let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
    let algo = AlgoConfig {
        overrides: AlgoConfig::parse_overrides(overrides).unwrap(),
        ..AlgoConfig::default()
    };
    let tasks: Vec<_> = (0..n)
        .map(|r| {
            let opts = TcpOptions {
                timeout: Duration::from_secs(60),
                connect_timeout: Duration::from_secs(60),
                algo: algo.clone(),
                threads: Some(THREADS),
                local: Some(
                    ShmTransport {
                        queue_bytes: 1 << 20,
                        ..ShmTransport::default()
                    }
                    .shared(),
                ),
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

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Rank `r`'s element `i`: small integers, so that sums are exact in any
/// order and any split.
fn x(r: usize, i: usize) -> f32 {
    ((i * 7 + r * 3) % 17) as f32
}

/// Rank `r`'s i64 element `i`: large, so that every byte of it matters.
fn y(r: usize, i: usize) -> i64 {
    ((i as i64) << 33) ^ (r as i64 * 0x1_0000_0001) ^ (i as i64 * 977)
}

/// Runs every op on every rank; returns each rank's count of wrong
/// elements per op.
async fn every_op(ranks: &[Arc<TcpBackend>], count: usize, root: usize) -> Vec<[usize; 5]> {
    let n = ranks.len();
    let runs: Vec<_> = ranks
        .iter()
        .cloned()
        .map(|b| {
            tokio::spawn(async move {
                let pg = ProcessGroup::new(b.clone());
                let r = b.rank();
                let mut wrong = [0; 5];
                // all_reduce, f32 sum.
                let mut a: Vec<f32> = (0..count).map(|i| x(r, i)).collect();
                pg.all_reduce(&mut a, ReduceOp::Sum)
                    .await
                    .expect("all_reduce");
                wrong[0] = (0..count)
                    .filter(|&i| a[i] != (0..n).map(|q| x(q, i)).sum::<f32>())
                    .count();
                // all_reduce, i64 xor (a reduction of every byte).
                let mut c: Vec<i64> = (0..count).map(|i| y(r, i)).collect();
                pg.all_reduce(&mut c, ReduceOp::BXor)
                    .await
                    .expect("all_reduce xor");
                wrong[1] = (0..count)
                    .filter(|&i| c[i] != (0..n).fold(0, |acc, q| acc ^ y(q, i)))
                    .count();
                // broadcast from `root` (through the stage from 4 MiB).
                let mut d: Vec<i64> = (0..count)
                    .map(|i| if r == root { y(root, i) } else { -1 })
                    .collect();
                pg.broadcast(&mut d, root).await.expect("broadcast");
                wrong[2] = (0..count).filter(|&i| d[i] != y(root, i)).count();
                // all_gather and reduce_scatter of `count / n` each.
                let part = count / n;
                let mine: Vec<i64> = (0..part).map(|i| y(r, i)).collect();
                let all = pg.all_gather_vec(&mine).await.expect("all_gather");
                wrong[3] = (0..part * n)
                    .filter(|&i| all[i] != y(i / part.max(1), i % part.max(1)))
                    .count();
                let whole: Vec<f32> = (0..part * n).map(|i| x(r, i)).collect();
                let mut out = vec![0f32; part];
                pg.reduce_scatter(&mut out, &whole, ReduceOp::Sum)
                    .await
                    .expect("reduce_scatter");
                wrong[4] = (0..part)
                    .filter(|&i| out[i] != (0..n).map(|q| x(q, r * part + i)).sum::<f32>())
                    .count();
                wrong
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in runs {
        out.push(t.await.unwrap());
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]

    /// Worlds of 2 to 4, every schedule the policy picks or a forced ring or
    /// direct all_reduce, lengths up to 6 MiB and odd ones: every element
    /// right, and the pool really split work.
    #[test]
    fn split_copies_and_reductions_give_the_same_bytes(
        n in 2usize..=4,
        count in prop_oneof![Just(1usize), Just(PART_MIN / 4 + 1), (PART_MIN / 2)..(3 << 20) / 2],
        root in 0usize..4,
        overrides in prop_oneof![Just(""), Just("all_reduce=ring"), Just("all_reduce=direct")],
    ) {
        let root = root % n;
        let before = Pool::shared().split_jobs();
        let wrong = runtime().block_on(async {
            let ranks = world(n, overrides).await;
            let first = every_op(&ranks, count, root).await;
            let second = every_op(&ranks, count, root).await;
            (first, second)
        });
        prop_assert!(wrong.0.iter().chain(&wrong.1).all(|w| *w == [0; 5]), "wrong elements per rank and op: {wrong:?}");
        prop_assert_eq!(Pool::shared().threads(), THREADS);
        if count * 8 >= 4 * PART_MIN * n {
            prop_assert!(Pool::shared().split_jobs() > before, "no copy was split");
        }
    }
}
