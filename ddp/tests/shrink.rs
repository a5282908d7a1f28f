//! DDP that continues without a lost rank (`OnPeerLost::Shrink`), on the
//! simulator: in a world of 4, rank 2 stops at step 5 of 10. The other
//! three agree through the store, move onto a group of the three, redo
//! step 5 there, and finish with the parameters of one process training on
//! the same global batches (which is what 4 ranks, then 3, compute).

mod common;

use std::{sync::Arc, time::Duration};

use common::{Mlp, close, run_sim};
use consort_comm::{Backend, MemStore, store::Store};
use consort_ddp::{Ddp, DdpError, DdpOptions, OnPeerLost};
use consort_sim::{
    EmulatedComm, EmulatedCommOptions, EmulatedDevice, EmulatedOptions, SimConfig, SimWorld,
};

const STEPS: usize = 10;
const GLOBAL: usize = 12;
const CRASH_AT: usize = 5;

/// Integer-valued data (every sum exact), a fixed MLP, and each step's
/// global batch.
struct Setup {
    mlp: Mlp,
    init: Vec<Vec<f64>>,
    data: Vec<Vec<(Vec<f64>, Vec<f64>)>>,
}

fn setup() -> Setup {
    let mlp = Mlp {
        dims: vec![3, 5, 2],
    };
    let mut s = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % 5) as f64 - 2.0
    };
    let init = mlp
        .sizes()
        .iter()
        .map(|&n| (0..n).map(|_| next()).collect())
        .collect();
    let data = (0..STEPS)
        .map(|_| {
            (0..GLOBAL)
                .map(|_| {
                    (
                        (0..3).map(|_| next()).collect(),
                        (0..2).map(|_| next()).collect(),
                    )
                })
                .collect()
        })
        .collect();
    Setup { mlp, init, data }
}

/// One process, each whole global batch (sum of the per-sample losses,
/// lr 2^-6).
fn reference(s: &Setup) -> Vec<Vec<f64>> {
    let mut params = s.init.clone();
    for batch in &s.data {
        let (xs, ys): (Vec<_>, Vec<_>) = batch.iter().cloned().unzip();
        let mut grads = vec![Vec::new(); params.len()];
        s.mlp.backward(&params, &xs, &ys, 1.0, |i, g| grads[i] = g);
        for (p, g) in params.iter_mut().zip(grads) {
            for (v, d) in p.iter_mut().zip(g) {
                *v -= d / 64.0;
            }
        }
    }
    params
}

/// What one rank returns: its parameters, (step, lost, world) of its
/// shrink, and its rank and world at the end; `None` for the lost rank.
type Outcome = Option<(
    Vec<Vec<f64>>,
    Option<(usize, Vec<usize>, usize)>,
    usize,
    usize,
)>;

/// One rank's training: rank 2 stops at step `CRASH_AT`, the others shrink
/// past it and redo that step on the survivors.
async fn train(s: Arc<Setup>, store: Arc<dyn Store>, b: Arc<dyn Backend>) -> Outcome {
    let r0 = b.rank();
    let mut model = s.mlp.model(&s.init);
    let opts = DdpOptions::default().on_peer_lost(OnPeerLost::Shrink {
        store,
        timeout: Duration::from_secs(60),
    });
    let mut ddp = Ddp::new(b, &mut model, opts).await.unwrap();
    let (mut r, mut world) = (r0, 4);
    let mut shrunk = None;
    let mut step = 0;
    while step < STEPS {
        if r0 == 2 && step == CRASH_AT {
            return None; // this rank's process is gone
        }
        let params: Vec<Vec<f64>> = (0..model.len())
            .map(|i| model.param::<f64>(i).unwrap().to_vec())
            .collect();
        let per = GLOBAL / world;
        let (xs, ys): (Vec<_>, Vec<_>) =
            s.data[step][r * per..(r + 1) * per].iter().cloned().unzip();
        // Scaled by the world so that the average is the sum.
        let mut err = Ok(());
        s.mlp.backward(&params, &xs, &ys, world as f64, |i, g| {
            if err.is_ok() {
                err = ddp.mark_ready(i, &g);
            }
        });
        err.unwrap();
        match ddp.finish().await {
            Ok(()) => {}
            Err(DdpError::Shrunk {
                rank,
                world: w,
                lost,
                ..
            }) => {
                shrunk = Some((step, lost.clone(), w));
                (r, world) = (rank, w);
                continue; // redo this step on the survivors
            }
            Err(e) => panic!("rank {r0}: {e}"),
        }
        for i in 0..model.len() {
            let g = ddp.grad::<f64>(i).unwrap().to_vec();
            for (v, d) in model.param_mut::<f64>(i).unwrap().iter_mut().zip(g) {
                *v -= d / 64.0;
            }
        }
        step += 1;
    }
    let params: Vec<Vec<f64>> = (0..model.len())
        .map(|i| model.param::<f64>(i).unwrap().to_vec())
        .collect();
    Some((params, shrunk, r, ddp.world_size()))
}

/// The three survivors shrank at the crash, took ranks 0, 1, 2 in the old
/// order, and hold one process's parameters.
fn check(out: Vec<Outcome>, want: &[Vec<f64>]) {
    for (r0, got) in out.into_iter().enumerate() {
        let Some((params, shrunk, r, world)) = got else {
            assert_eq!(r0, 2);
            continue;
        };
        assert_eq!(shrunk, Some((CRASH_AT, vec![2], 3)), "rank {r0}");
        assert_eq!((r, world), ([0, 1, 9, 2][r0], 3), "rank {r0}'s new rank");
        for (p, (g, w)) in params.iter().zip(want).enumerate() {
            for (k, (a, b)) in g.iter().zip(w).enumerate() {
                assert!(close(*a, *b), "rank {r0} param {p}[{k}]: {a} vs {b}");
            }
        }
    }
}

#[test]
fn three_survivors_finish_like_one_process_with_the_global_batch() {
    let s = Arc::new(setup());
    let store: Arc<dyn Store> = Arc::new(MemStore::new(Duration::from_secs(30)));
    let want = reference(&s);
    let (out, _) = run_sim(SimConfig::new(4), move |rank| {
        train(s.clone(), store.clone(), rank)
    });
    check(out, &want);
}

/// The same on stream-ordered communicators (the emulated device, which
/// runs NCCL's call rules), each rank on its own thread: host buffers are
/// staged through each rank's device, the lost rank fails the survivors'
/// calls, and their group is a new communicator made on the failed one, as
/// on NCCL. The data path reports the loss as NCCL does, without the rank
/// (`ncclRemoteError`); the fingerprint check's side channel (a second
/// simulated world, as the TCP group beside NCCL) names it, so that DDP
/// can shrink. Measured on an H100: before the side channel named it, the
/// survivor of a killed rank failed with the bare remote error, which DDP
/// could not shrink past. It hung twice before: the emulated communicator did not pass
/// DDP's idle waits (during the survivors' agreement) to its simulated
/// rank, whose clock then held back its peers' aborts; and dropping a
/// communicator waited for its subgroups (DDP's worker holds the
/// survivors' group until the runtime goes), so the first rank to finish
/// never left and held its peers' last frames.
#[test]
fn three_survivors_shrink_on_emulated_communicators() {
    shrink_on_emulated(EmulatedCommOptions::default());
}

/// The same when the data path reports nothing at all (NCCL over NVLink,
/// PCIe or shared memory: the kernel waits on the dead peer until an
/// abort): the survivors' calls stay in flight, and the fingerprint
/// check's side channel names the rank (comparing the calls made after
/// the loss; with nothing left to compare, `LostPeer::stalled` does after
/// the grace), which fails them and aborts the communicator.
#[test]
fn three_survivors_shrink_when_the_data_path_reports_no_loss() {
    shrink_on_emulated(EmulatedCommOptions {
        silent_loss: true,
        ..Default::default()
    });
}

fn shrink_on_emulated(opts: EmulatedCommOptions) {
    let s = Arc::new(setup());
    let store: Arc<dyn Store> = Arc::new(MemStore::new(Duration::from_secs(30)));
    let want = reference(&s);
    let world = SimWorld::new(SimConfig::new(4)).expect("sim world");
    let side = SimWorld::new(SimConfig::new(4)).expect("side channel world");
    let threads: Vec<_> = world
        .ranks()
        .into_iter()
        .zip(side.ranks())
        .map(|(rank, side)| {
            let (s, store, opts) = (s.clone(), store.clone(), opts.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let device = EmulatedDevice::new(EmulatedOptions {
                        seed: rank.rank() as u64 + 1,
                        max_delay: Duration::from_micros(40),
                        sync_timeout: Duration::from_secs(20),
                        ..Default::default()
                    });
                    let comm = EmulatedComm::new(Arc::new(rank), device, opts).unwrap();
                    comm.check_fingerprints(Arc::new(side)).unwrap();
                    train(s, store, Arc::new(comm)).await
                })
            })
        })
        .collect();
    let out = threads
        .into_iter()
        .map(|t| t.join().expect("rank thread panicked"))
        .collect();
    check(out, &want);
}

/// A call that failed as aborted by an earlier failure (a stream-ordered
/// communicator fails the calls after its first so) is shrunk past when
/// the backend knows a peer is gone, and stands when none is: 3 simulated
/// ranks, rank 2 leaves, ranks 0 and 1 hand DDP an `Aborted` error.
#[test]
fn an_aborted_call_is_shrunk_past_only_when_a_peer_is_known_lost() {
    use consort_comm::{CallOptions, CommError};
    let store: Arc<dyn Store> = Arc::new(MemStore::new(Duration::from_secs(30)));
    let aborted = || DdpError::Comm {
        what: "the caller's all_reduce".into(),
        source: Box::new(CommError::Aborted {
            ctx: Default::default(),
            cause: "aborted by an earlier failure of the group".into(),
        }),
    };
    let (out, _) = run_sim(SimConfig::new(3), move |b| {
        let store = store.clone();
        async move {
            let mut model = setup().mlp.model(&setup().init);
            let opts = DdpOptions::default().on_peer_lost(OnPeerLost::Shrink {
                store,
                timeout: Duration::from_secs(60),
            });
            let me = b.clone();
            let mut ddp = Ddp::new(b, &mut model, opts).await.unwrap();
            // Nobody lost: the error stands.
            let stood = ddp.shrink_after(aborted()).await;
            assert!(matches!(stood, DdpError::Comm { .. }), "{stood}");
            me.barrier(&CallOptions::default()).await.unwrap();
            if me.rank() == 2 {
                return None;
            }
            while me.lost_peers().is_empty() {
                me.idle(Duration::from_millis(1)).await;
            }
            match ddp.shrink_after(aborted()).await {
                DdpError::Shrunk { world, lost, .. } => Some((world, lost)),
                other => panic!("rank {}: {other}", me.rank()),
            }
        }
    });
    assert_eq!(out, vec![Some((2, vec![2])), Some((2, vec![2])), None]);
}
