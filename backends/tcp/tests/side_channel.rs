//! The fingerprint check's side channel over real TCP sockets, as NCCL
//! runs it: a rank whose communicator failed on its own (a call it
//! cancelled, one it could not enqueue) tells its peers why. NCCL tells
//! them nothing, and their kernels would wait on that rank's part until
//! their deadline.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use consort_comm::{
    Backend, CommError, DType, ErrorContext, Fingerprint, GroupId, OpKind, ReduceOp,
    ordered::check::Checker, store::MemStore,
};
use consort_tcp::{TcpBackend, TcpOptions};

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

/// A checker per rank of a TCP side channel of `n` ranks, their tasks on
/// `rt`, each reporting (rank, verdict) to the receiver.
fn checkers(rt: &tokio::runtime::Runtime, n: usize) -> (Vec<Checker>, Reports) {
    let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
    let opts = TcpOptions {
        timeout: Duration::from_secs(20),
        local: None,
        ..TcpOptions::default()
    };
    let hosts: Vec<TcpBackend> = rt.block_on(async {
        let tasks: Vec<_> = (0..n)
            .map(|r| tokio::spawn(consort_tcp::connect(store.clone(), r, n, opts.clone())))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("connect task").expect("connect"));
        }
        out
    });
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let checkers = hosts
        .into_iter()
        .map(|h| {
            let (rank, tx) = (h.rank(), tx.clone());
            let report = Arc::new(move |e: CommError| {
                let _ = tx.send((rank, e));
            });
            let (c, task) = Checker::new(Arc::new(h), Duration::from_secs(20), report);
            rt.spawn(task);
            c
        })
        .collect();
    (checkers, rx)
}

/// Every peer's side channel knows the rank that told and its cause
/// without making a call (what the stall rule asks), and the next
/// comparison there reports it as the verdict. A mismatch or a lost rank,
/// which every rank finds itself, is not told.
#[test]
fn a_rank_that_failed_on_its_own_tells_every_peer_why() {
    let n = 3;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (checkers, mut rx) = checkers(&rt, n);

    checkers[0].tell(CommError::Mismatch {
        ctx: ErrorContext::default(),
        local: fp(OpKind::AllReduce, 7),
        remote: fp(OpKind::Broadcast, 7),
        remote_rank: 1,
    });
    checkers[0].tell(CommError::PeerLost {
        ctx: ErrorContext::default(),
        peer: 2,
        reason: "its process exited".into(),
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        checkers[1].peer_aborts().is_empty(),
        "a mismatch or a lost rank is not told"
    );

    checkers[0].tell(CommError::Aborted {
        ctx: ErrorContext::new(OpKind::AllReduce, 0, 7, GroupId::WORLD),
        cause: "a all_reduce call (seq 7) was cancelled: its future was dropped".into(),
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    for (rank, c) in checkers.iter().enumerate().skip(1) {
        let said = loop {
            let said = c.peer_aborts();
            if !said.is_empty() || Instant::now() > deadline {
                break said;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(said.len(), 1, "rank {rank}: {said:?}");
        assert_eq!(said[0].0, 0, "rank {rank}: {said:?}");
        assert!(said[0].1.contains("was cancelled"), "rank {rank}: {said:?}");
    }
    assert!(
        checkers[0].peer_aborts().is_empty(),
        "its own abort is not a peer's"
    );

    for c in &checkers[1..] {
        c.check(fp(OpKind::AllReduce, 8));
    }
    let mut got: Vec<(usize, CommError)> = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 1..n {
            let r = tokio::time::timeout(Duration::from_secs(20), rx.recv()).await;
            v.push(r.expect("every peer reports").expect("open"));
        }
        v
    });
    got.sort_by_key(|(r, _)| *r);
    for (rank, e) in got {
        let s = e.to_string();
        assert!(
            s.contains("rank 0") && s.contains("was cancelled"),
            "rank {rank}: {s}"
        );
    }
}
