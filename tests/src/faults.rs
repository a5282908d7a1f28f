//! The fault suite: the simulator's fault scenarios run on a real
//! transport through its faulty link (`MeshOptions::faults`), mounted once
//! per transport with [`crate::faults!`]. Every fault must surface as the
//! right error on the affected ranks, never as a hang or a wrong result
//! reported as success.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use consort_comm::{
    Backend, CommError, ProcessGroup, ReduceOp,
    fault::{Fault, MsgFilter, Trigger},
};

/// Makes a world of `n` ranks whose links apply `faults`, with a short op
/// timeout (a few seconds).
pub type FaultyFactory =
    fn(usize, Vec<Fault>) -> Pin<Box<dyn Future<Output = Vec<Arc<dyn Backend>>> + Send>>;

/// Ranks in each scenario.
pub const N: usize = 4;
const LEN: usize = 64;

/// Every rank runs `calls` all_reduces of `[rank + 1; LEN]`; the results in
/// rank order.
pub fn run(
    factory: FaultyFactory,
    faults: Vec<Fault>,
    calls: usize,
) -> Vec<Result<Vec<f32>, CommError>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let tasks: Vec<_> = factory(N, faults)
            .await
            .into_iter()
            .map(|b| {
                tokio::spawn(async move {
                    let pg = ProcessGroup::new(b);
                    let mut x = vec![(pg.rank() + 1) as f32; LEN];
                    for _ in 0..calls {
                        pg.all_reduce(&mut x, ReduceOp::Sum).await?;
                    }
                    Ok(x)
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("rank task panicked"));
        }
        out
    })
}

/// Every rank failed or, where the schedule let it finish without what was
/// lost, holds the right sum: never a wrong result reported as success.
fn right_or_failed(out: &[Result<Vec<f32>, CommError>], sum: f32) {
    for (r, o) in out.iter().enumerate() {
        if let Ok(x) = o {
            assert_eq!(x, &vec![sum; LEN], "rank {r} reports a wrong result");
        }
    }
}

/// No faults: the right answer everywhere.
pub fn no_faults(factory: FaultyFactory) {
    for (r, o) in run(factory, Vec::new(), 2).into_iter().enumerate() {
        assert_eq!(
            o.unwrap_or_else(|e| panic!("rank {r}: {e}")),
            vec![40.0; LEN]
        );
    }
}

/// A crashed rank (its links closed after its first frame) is `PeerLost`
/// on the ranks that wait on it, and no rank reports success.
pub fn crash(factory: FaultyFactory) {
    let f = Fault::Crash {
        rank: 1,
        at: Trigger::AfterMessages(1),
    };
    let out = run(factory, vec![f], 3);
    assert!(
        out.iter()
            .any(|o| matches!(o, Err(CommError::PeerLost { peer: 1, .. }))),
        "someone reports rank 1 lost: {out:?}"
    );
    for (r, o) in out.iter().enumerate() {
        assert!(
            o.is_err(),
            "rank {r} reports success after rank 1 crashed: {o:?}"
        );
    }
}

/// A dropped frame is a timeout on its receiver, naming the sender; no
/// rank reports a wrong result.
pub fn drop(factory: FaultyFactory) {
    let out = run(factory, vec![Fault::Drop(MsgFilter::link(0, 1).nth(0))], 1);
    match &out[1] {
        Err(CommError::Timeout { waiting_on, .. }) => {
            assert!(
                waiting_on.contains(&0),
                "rank 1 waits on rank 0: {waiting_on:?}"
            )
        }
        // Rank 0 may finish without rank 1's answer and leave first.
        Err(CommError::PeerLost { peer: 0, .. }) => {}
        other => panic!("rank 1: want Timeout, got {other:?}"),
    }
    right_or_failed(&out, 10.0);
}

/// A corrupted frame is refused by its receiver (`Protocol`); no rank
/// reports a wrong result.
pub fn corrupt(factory: FaultyFactory) {
    let out = run(
        factory,
        vec![Fault::Corrupt(MsgFilter::link(0, 1).nth(0))],
        1,
    );
    match &out[1] {
        Err(CommError::Protocol { peer: Some(0), .. }) => {}
        other => panic!("rank 1: want Protocol from rank 0, got {other:?}"),
    }
    right_or_failed(&out, 10.0);
}

/// A duplicated frame is detected (`Protocol` naming the duplicate), and
/// no rank reports success.
pub fn duplicate(factory: FaultyFactory) {
    let out = run(
        factory,
        vec![Fault::Duplicate(MsgFilter::link(1, 0).nth(0))],
        2,
    );
    match &out[0] {
        Err(CommError::Protocol {
            peer: Some(1),
            reason,
            ..
        }) => {
            assert!(reason.contains("duplicate"), "{reason}")
        }
        Err(CommError::Aborted { cause, .. }) => assert!(cause.contains("duplicate"), "{cause}"),
        other => panic!("rank 0: want Protocol, got {other:?}"),
    }
}

/// A partition times everyone out.
pub fn partition(factory: FaultyFactory) {
    let f = Fault::Partition {
        a: vec![0, 1],
        b: vec![2, 3],
        from: Duration::ZERO,
        heal_at: None,
    };
    for (r, o) in run(factory, vec![f], 1).into_iter().enumerate() {
        assert!(
            matches!(
                o,
                Err(CommError::Timeout { .. }) | Err(CommError::Aborted { .. })
            ),
            "rank {r}: {o:?}"
        );
    }
}

/// Delays and a released hold only cost time.
pub fn delay_and_hold(factory: FaultyFactory) {
    let faults = vec![
        Fault::Delay {
            filter: MsgFilter::link(2, 3),
            by: Duration::from_millis(30),
        },
        Fault::Hold {
            from: 0,
            to: 1,
            at: Duration::ZERO,
            release_at: Duration::from_millis(200),
        },
    ];
    for (r, o) in run(factory, faults, 2).into_iter().enumerate() {
        assert_eq!(
            o.unwrap_or_else(|e| panic!("rank {r}: {e}")),
            vec![40.0; LEN]
        );
    }
}

/// Mounts the fault suite on `$factory` (a [`FaultyFactory`]).
#[macro_export]
macro_rules! faults {
    ($factory:path) => {
        mod faults {
            #[test]
            fn no_faults_gives_the_right_answer() {
                $crate::faults::no_faults($factory);
            }
            #[test]
            fn a_crashed_rank_is_peer_lost_and_nobody_succeeds() {
                $crate::faults::crash($factory);
            }
            #[test]
            fn a_dropped_frame_is_a_timeout_naming_the_sender() {
                $crate::faults::drop($factory);
            }
            #[test]
            fn a_corrupted_frame_is_a_protocol_error() {
                $crate::faults::corrupt($factory);
            }
            #[test]
            fn a_duplicated_frame_is_a_protocol_error() {
                $crate::faults::duplicate($factory);
            }
            #[test]
            fn a_partition_times_out_everyone() {
                $crate::faults::partition($factory);
            }
            #[test]
            fn delays_and_a_released_hold_only_cost_time() {
                $crate::faults::delay_and_hold($factory);
            }
        }
    };
}
