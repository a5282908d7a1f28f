//! The fingerprint check of stream-ordered communicators
//! (`consort_comm::ordered::check`), over a real side channel of simulated
//! ranks: alone, and turned on in `EmulatedComm` as on NCCL.

use std::{sync::Arc, time::Duration};

use consort_comm::{
    Backend, BufferMut, CallOptions, CommError, DType, Fingerprint, GroupId, OpKind, ReduceOp,
    ordered::check::Checker,
};
use consort_sim::{
    EmulatedComm, EmulatedCommOptions, EmulatedDevice, EmulatedOptions, SimConfig, SimWorld,
};

fn fp(op: OpKind, seq: u64) -> Fingerprint {
    Fingerprint {
        group: GroupId::WORLD,
        seq,
        op,
        dtype: DType::F32,
        count: 8,
        root: 0,
        reduce_op: (op == OpKind::AllReduce).then_some(ReduceOp::Sum),
    }
}

type Reports = tokio::sync::mpsc::UnboundedReceiver<(usize, CommError)>;

/// A checker per rank of a simulated side channel of `n` ranks (less rank
/// `gone`, whose handle is dropped), each reporting (rank, verdict) to the
/// receiver, their tasks on the returned runtime.
fn checkers(
    n: usize,
    gone: Option<usize>,
    timeout: Duration,
) -> (tokio::runtime::Runtime, Vec<(usize, Checker)>, Reports) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let world = SimWorld::new(SimConfig::new(n)).unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut out = Vec::new();
    for r in world.ranks() {
        let rank = r.rank();
        if Some(rank) == gone {
            continue;
        }
        let tx = tx.clone();
        let report = Arc::new(move |e: CommError| {
            let _ = tx.send((rank, e));
        });
        let (c, task) = Checker::new(Arc::new(r), timeout, report);
        rt.spawn(task);
        out.push((rank, c));
    }
    (rt, out, rx)
}

/// Each rank's checker compares two calls; rank `odd` makes a broadcast
/// where the others make their second all_reduce. Every rank must report
/// `Mismatch` naming both sides, and nothing for the first call.
#[test]
fn every_rank_finds_the_mismatch_and_names_both_sides() {
    for (n, odd) in [(2, 1), (3, 0), (5, 3)] {
        let (rt, checkers, mut rx) = checkers(n, None, Duration::from_secs(10));
        let mut keep = Vec::new();
        for (rank, c) in checkers {
            c.check(fp(OpKind::AllReduce, 0));
            let second = if rank == odd {
                OpKind::Broadcast
            } else {
                OpKind::AllReduce
            };
            c.check(fp(second, 1));
            keep.push(c);
        }
        let mut got: Vec<(usize, CommError)> = rt.block_on(async {
            let mut v = Vec::new();
            for _ in 0..n {
                let r = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
                v.push(r.expect("every rank reports").expect("open"));
            }
            v
        });
        got.sort_by_key(|(r, _)| *r);
        for (rank, e) in got {
            let CommError::Mismatch {
                local,
                remote,
                remote_rank,
                ..
            } = &e
            else {
                panic!("rank {rank}: {e}");
            };
            assert_eq!(local.seq, 1, "rank {rank}: {e}");
            assert_ne!(local, remote, "rank {rank}: {e}");
            let want = if rank == odd {
                usize::from(odd == 0)
            } else {
                odd
            };
            assert_eq!(*remote_rank, want, "rank {rank}: {e}");
            assert!(e.to_string().contains("broadcast #1"), "{e}");
        }
        assert!(keep.iter().all(Checker::is_drained));
    }
}

/// `EmulatedComm` with the check on: matched calls (on the world and on a
/// subgroup made through the checker) pass, and a mismatched one is
/// `Mismatch` on every rank. Every rank keeps its communicator until all
/// have their verdicts: a rank that leaves at once (its abort ends its
/// calls) can reach a slower peer's data path as a lost rank first.
#[test]
fn an_emulated_communicator_with_the_check_on() {
    let n = 3;
    let all_done = Arc::new(std::sync::Barrier::new(n));
    let data = SimWorld::new(SimConfig::new(n).timeout(Duration::from_secs(5))).unwrap();
    let side = SimWorld::new(SimConfig::new(n).timeout(Duration::from_secs(5))).unwrap();
    let threads: Vec<_> = data
        .ranks()
        .into_iter()
        .zip(side.ranks())
        .map(|(d, s)| {
            let all_done = all_done.clone();
            std::thread::spawn(move || {
                let rank = d.rank();
                let dev = EmulatedDevice::new(EmulatedOptions::default());
                let comm =
                    EmulatedComm::new(Arc::new(d), dev, EmulatedCommOptions::default()).unwrap();
                comm.check_fingerprints(Arc::new(s)).unwrap();
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let out = rt.block_on(async {
                    let o = CallOptions::default();
                    let mut v = vec![1.0f32; 8];
                    comm.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum, &o)
                        .await
                        .unwrap();
                    assert_eq!(v, vec![n as f32; 8]);
                    let sub = comm.new_group(&[0, 2], &o).await.unwrap();
                    if let Some(sub) = sub {
                        let mut w = vec![1.0f32; 4];
                        sub.all_reduce(BufferMut::from(&mut w[..]), ReduceOp::Sum, &o)
                            .await
                            .unwrap();
                        assert_eq!(w, vec![2.0f32; 4]);
                        // Gone once its checker has compared its call: each
                        // checker runs on a thread of its own, and a
                        // simulated side channel runs a rank's calls on all
                        // its groups in one order, so the subgroup's
                        // comparison and the next parent call's must not
                        // race (they did, rarely: both waited out the 5 s).
                        drop(sub);
                    }
                    let mut v = [1.0f32; 8];
                    let r = if rank == 1 {
                        comm.broadcast(BufferMut::from(&mut v[..]), &o).await
                    } else {
                        comm.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum, &o)
                            .await
                    };
                    let later = comm.barrier(&o).await;
                    (rank, r, later)
                });
                all_done.wait();
                out
            })
        })
        .collect();
    for t in threads {
        let (rank, r, later) = t.join().unwrap();
        let e = r.expect_err("the mismatched call fails");
        assert!(matches!(e, CommError::Mismatch { .. }), "rank {rank}: {e}");
        let later = later.expect_err("the failure sticks");
        assert!(
            later.to_string().contains("mismatch"),
            "rank {rank}: {later}"
        );
    }
}

/// A rank whose process is gone (its side-channel handle dropped, as its
/// sockets close when it dies) is reported by every survivor's checker as
/// `PeerLost` naming it, at the next collective: on NCCL that fails the
/// calls in flight, where a kernel waiting on the dead rank might never
/// fail by itself. A checker that stopped on it would report nothing.
#[test]
fn a_lost_rank_is_reported_by_every_survivors_checker() {
    let n = 3;
    // Rank 2's handle is dropped: its process is gone.
    let (rt, checkers, mut rx) = checkers(n, Some(2), Duration::from_secs(30));
    let mut keep = Vec::new();
    for (_, c) in checkers {
        c.check(fp(OpKind::AllReduce, 0));
        keep.push(c);
    }
    let mut got: Vec<(usize, CommError)> = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..n - 1 {
            let r = tokio::time::timeout(Duration::from_secs(20), rx.recv()).await;
            v.push(r.expect("every survivor reports").expect("open"));
        }
        v
    });
    got.sort_by_key(|(r, _)| *r);
    for (rank, e) in got {
        assert!(
            matches!(e, CommError::PeerLost { peer: 2, .. }),
            "rank {rank}: {e}"
        );
    }
    // The checkers still make subgroups: the survivors make theirs.
    let subs = rt.block_on(async {
        let report: consort_comm::ordered::check::Report = Arc::new(|_| {});
        let made = keep.iter().map(|c| c.new_group(&[0, 1], report.clone()));
        futures_join(made).await
    });
    for s in subs {
        assert!(s.expect("a subgroup of the survivors").is_some());
    }
}

async fn futures_join<F: std::future::Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = fs.map(Box::pin).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await);
    }
    out
}
