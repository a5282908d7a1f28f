//! The conformance properties that a Gloo group can meet, on consort ranks
//! alone: N real [`GlooBackend`]s in this process, meeting through a store
//! under torch's keys and talking Gloo's protocol over loopback sockets.
//! (gloo_mixed.rs puts torch's ranks among them.)
//!
//! Gloo groups leave out what Gloo's wire has no room for: consort's
//! mismatch check (a Gloo rank that calls another collective waits for its
//! timeout, as between torch ranks; see `a_mismatch_fails_every_rank`),
//! and uneven all_to_all (gloo's alltoallv), which the backend refuses.

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, CommError, ProcessGroup, ReduceOp, store::MemStore};
use consort_tcp::{GlooBackend, GlooOptions};
use consort_tests::{WorldFuture, checks, run_world};
use proptest::prelude::*;

fn gloo_world(n: usize) -> WorldFuture {
    gloo_world_with(n, Duration::from_secs(30))
}

fn gloo_world_with(n: usize, timeout: Duration) -> WorldFuture {
    Box::pin(async move {
        let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
        let tasks: Vec<_> = (0..n)
            .map(|r| {
                let opts = GlooOptions {
                    timeout,
                    ip: Some("127.0.0.1".parse().unwrap()),
                    ..Default::default()
                };
                tokio::spawn(GlooBackend::connect(store.clone(), r, n, opts))
            })
            .collect();
        let mut out: Vec<Arc<dyn Backend>> = Vec::with_capacity(n);
        for t in tasks {
            out.push(Arc::new(t.await.expect("connect task").expect("connect")));
        }
        out
    })
}

fn short_timeout_world(n: usize) -> WorldFuture {
    gloo_world_with(n, Duration::from_millis(500))
}

fn dtype() -> impl Strategy<Value = consort_comm::DType> {
    prop::sample::select(consort_comm::DType::ALL.to_vec())
}

/// Lengths from 0 up, including ones the world does not divide.
fn len() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(1), 0usize..40, 0usize..3000]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn all_reduce(n in 1usize..=6, len in len(), dtype in dtype(), op in 0usize..8, seed in any::<u64>()) {
        checks::all_reduce(gloo_world, n, len, dtype, op, seed);
    }

    #[test]
    fn broadcast(n in 1usize..=6, len in len(), dtype in dtype(), root in 0usize..6, seed in any::<u64>()) {
        checks::broadcast(gloo_world, n, len, dtype, root % n, seed);
    }

    #[test]
    fn all_gather(n in 1usize..=6, len in len(), dtype in dtype(), seed in any::<u64>()) {
        checks::all_gather(gloo_world, n, len, dtype, seed);
    }

    #[test]
    fn reduce_scatter(n in 1usize..=6, len in 0usize..40, dtype in dtype(), op in 0usize..8, seed in any::<u64>()) {
        checks::reduce_scatter(gloo_world, n, len, dtype, op, seed);
    }

    #[test]
    fn reduce(n in 1usize..=6, len in len(), dtype in dtype(), op in 0usize..8, root in 0usize..6, seed in any::<u64>()) {
        checks::reduce(gloo_world, n, len, dtype, op, root % n, seed);
    }

    #[test]
    fn gather_scatter(n in 1usize..=6, len in len(), dtype in dtype(), root in 0usize..6, seed in any::<u64>()) {
        checks::gather_scatter(gloo_world, n, len, dtype, root % n, seed);
    }

    #[test]
    fn all_to_all(n in 1usize..=6, dtype in dtype(), seed in any::<u64>()) {
        checks::all_to_all(gloo_world, n, dtype, false, seed);
    }

    #[test]
    fn barrier_and_p2p(n in 1usize..=6, len in len(), seed in any::<u64>()) {
        checks::barrier_and_p2p(gloo_world, n, len, seed);
    }
}

/// One buffer past gloo's 1 MiB ring segment on 3 ranks: several segments
/// per rank, the last one short.
#[test]
fn all_reduce_past_one_segment() {
    checks::all_reduce(
        gloo_world,
        3,
        (3 << 20) / 4 + 5,
        consort_comm::DType::F32,
        0,
        7,
    );
}

#[test]
fn bitwise_ops_on_floats_are_refused() {
    checks::unsupported(gloo_world);
}

#[test]
fn invalid_arguments_are_refused_on_every_rank() {
    checks::invalid_arguments(gloo_world);
}

/// The ops Gloo groups do not speak say so, and take no tag: the group
/// goes on.
#[test]
fn unsupported_ops_say_so() {
    let out = run_world(gloo_world, 2, |pg: ProcessGroup| async move {
        let mut buf = vec![1.0f32; 4];
        let (mut out, splits) = (vec![0.0f32; 4], [1usize, 3]);
        let uneven = pg.all_to_all_single(&mut out, &buf, Some(&splits), Some(&splits));
        match uneven.await {
            Err(CommError::Unsupported { reason, .. }) if reason.contains("gloo") => {}
            other => {
                return Err(format!(
                    "uneven all_to_all: want Unsupported, got {other:?}"
                ));
            }
        }
        pg.all_reduce(&mut buf, ReduceOp::Sum)
            .await
            .map_err(|e| e.to_string())?;
        if buf != [2.0; 4] {
            return Err(format!("all_reduce after the refusal: {buf:?}"));
        }
        Ok(())
    });
    for (r, o) in out.into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// Rank 1 broadcasts where the others all_reduce: every rank fails within
/// its timeout (Gloo has no mismatch check), and the failure is sticky.
#[test]
fn a_mismatch_fails_every_rank() {
    let out = run_world(short_timeout_world, 3, |pg: ProcessGroup| async move {
        let mut buf = vec![1.0f32; 4];
        let first = if pg.rank() == 1 {
            pg.broadcast(&mut buf, 0).await
        } else {
            pg.all_reduce(&mut buf, ReduceOp::Sum).await
        };
        if first.is_ok() {
            return Err("the mismatched call succeeded".into());
        }
        match pg.barrier().await {
            Err(CommError::Aborted { .. }) => Ok(()),
            other => Err(format!("after the failure: want Aborted, got {other:?}")),
        }
    });
    for (r, o) in out.into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// A size mismatch is refused at once, not at the timeout.
#[test]
fn a_size_mismatch_is_refused() {
    let out = run_world(gloo_world, 2, |pg: ProcessGroup| async move {
        let mut buf = vec![1.0f32; 4 + 4 * pg.rank()];
        let t = std::time::Instant::now();
        let res = pg.all_reduce(&mut buf, ReduceOp::Sum).await;
        match res {
            Err(_) if t.elapsed() < Duration::from_secs(10) => Ok(()),
            other => Err(format!(
                "want a prompt error, got {other:?} after {:?}",
                t.elapsed()
            )),
        }
    });
    for (r, o) in out.into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// A rank that finishes first and closes its connections (leaves the job)
/// does not fail the others' last call: what it sent is still theirs.
#[test]
fn a_rank_that_leaves_after_its_last_call_fails_no_one() {
    for _ in 0..5 {
        let out = run_world(gloo_world, 4, |pg: ProcessGroup| async move {
            // The root of a broadcast is done once its payloads are
            // written: it leaves while the others still read them.
            let mut buf = vec![pg.rank() as f32; 1 << 16];
            for _ in 0..3 {
                pg.broadcast(&mut buf, 0).await.map_err(|e| e.to_string())?;
            }
            if buf.iter().any(|&x| x != 0.0) {
                return Err("the broadcast brought other values".into());
            }
            // The group (and its sockets) go when this rank's task ends.
            drop(pg);
            Ok::<_, String>(())
        });
        for (r, o) in out.into_iter().enumerate() {
            o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
    }
}

/// The same on a multi-threaded runtime with a large payload, where the
/// root's writer, a peer's reader and the peer's waiting call really run
/// at once (a payload handed to the writer must count as sent even if the
/// peer reads it and leaves before the writer says so).
#[test]
fn a_root_that_leaves_races_no_one_on_many_threads() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for round in 0..10 {
            let world = gloo_world(4).await;
            let tasks: Vec<_> = world
                .into_iter()
                .map(|b| {
                    tokio::spawn(async move {
                        let pg = ProcessGroup::new(b);
                        let mut buf = vec![pg.rank() as f32; 1 << 20];
                        pg.broadcast(&mut buf, 0).await.map_err(|e| e.to_string())?;
                        pg.barrier().await.map_err(|e| e.to_string())?;
                        pg.broadcast(&mut buf, 0).await.map_err(|e| e.to_string())?;
                        Ok::<_, String>(buf.iter().all(|&x| x == 0.0))
                    })
                })
                .collect();
            for (r, t) in tasks.into_iter().enumerate() {
                match t.await.unwrap() {
                    Ok(true) => {}
                    other => panic!("round {round}, rank {r}: {other:?}"),
                }
            }
        }
    });
}
