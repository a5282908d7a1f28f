//! Every fault surfaces as the right error on every affected rank, never
//! as a hang or a wrong result reported as success; and a scenario replays
//! identically from its seed.

use std::{sync::Arc, time::Duration};

use consort_comm::{CommError, ProcessGroup, ReduceOp};
use consort_sim::{
    SimConfig, SimWorld, TraceEvent, TraceKind,
    fault::{Fault, MsgFilter, Trigger},
};

const N: usize = 4;
const LEN: usize = 64;

type Outcome = Vec<Result<Vec<f32>, CommError>>;

/// Every rank runs `calls` all_reduces of `[rank + 1; LEN]` on a
/// multi-threaded runtime (so real-time interleaving varies).
fn run(cfg: SimConfig, calls: usize) -> (Outcome, Vec<TraceEvent>, Duration) {
    let world = SimWorld::new(cfg).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let out = rt.block_on(async {
        let tasks: Vec<_> = world
            .ranks()
            .into_iter()
            .map(|rank| {
                tokio::spawn(async move {
                    let pg = ProcessGroup::new(Arc::new(rank));
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
            out.push(t.await.unwrap());
        }
        out
    });
    (out, world.trace(), world.elapsed())
}

fn cfg() -> SimConfig {
    SimConfig::new(N).timeout(Duration::from_secs(60))
}

#[test]
fn no_faults_gives_the_right_answer() {
    let (out, trace, elapsed) = run(cfg(), 3);
    // Sum of 1..=4 is 10; three rounds: 10 * 4^2 ... each round sums the
    // previous round's equal vectors: 10, 40, 160.
    for r in out {
        assert_eq!(r.unwrap(), vec![160.0; LEN]);
    }
    assert!(trace.iter().any(|e| e.kind == TraceKind::Send));
    assert!(elapsed > Duration::ZERO);
}

#[test]
fn a_crashed_rank_is_peer_lost_on_every_survivor() {
    let (out, trace, _) = run(
        cfg().fault(Fault::Crash {
            rank: 2,
            at: Trigger::AfterMessages(1),
        }),
        1,
    );
    for (r, o) in out.into_iter().enumerate() {
        match (r, o) {
            (2, Err(CommError::Aborted { cause, .. })) => {
                assert!(cause.contains("crashed"), "{cause}")
            }
            (_, Err(CommError::PeerLost { peer: 2, .. })) => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(
        trace
            .iter()
            .any(|e| e.kind == TraceKind::Crash && e.from == 2)
    );
}

#[test]
fn a_crash_at_a_time_before_any_call() {
    let (out, _, _) = run(
        cfg().fault(Fault::Crash {
            rank: 1,
            at: Trigger::At(Duration::ZERO),
        }),
        2,
    );
    for (r, o) in out.into_iter().enumerate() {
        match (r, o) {
            (1, Err(CommError::Aborted { .. })) => {}
            (_, Err(CommError::PeerLost { peer: 1, .. })) => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn a_dropped_message_is_a_timeout_naming_the_peer() {
    let (out, trace, elapsed) = run(cfg().fault(Fault::Drop(MsgFilter::link(0, 1).nth(0))), 1);
    // Rank 1 times out on rank 0 (or, once rank 0 has finished and left,
    // which recursive doubling lets it do, sees it lost); the others fail
    // too or, where the schedule let them finish without the lost frame,
    // have the right sum.
    let mut timed_out = false;
    for (r, o) in out.into_iter().enumerate() {
        match o {
            Err(CommError::Timeout { waiting_on, .. }) => {
                timed_out = true;
                if r == 1 {
                    assert!(
                        waiting_on.contains(&0),
                        "rank 1 waits on rank 0: {waiting_on:?}"
                    );
                }
            }
            Err(CommError::PeerLost { peer: 0, .. }) if r == 1 => {}
            Ok(x) if r != 1 => assert_eq!(x, vec![10.0; LEN], "rank {r}"),
            Err(CommError::Aborted { .. } | CommError::PeerLost { .. }) if r != 1 => {}
            other => panic!("rank {r}: want Timeout, got {other:?}"),
        }
    }
    assert!(trace.iter().any(|e| e.kind == TraceKind::Drop));
    assert!(
        !timed_out || elapsed >= Duration::from_secs(60),
        "the timeout is virtual: {elapsed:?}"
    );
}

#[test]
fn a_corrupted_message_is_a_protocol_error() {
    let (out, _, _) = run(cfg().fault(Fault::Corrupt(MsgFilter::link(0, 1).nth(0))), 1);
    for (r, o) in out.into_iter().enumerate() {
        match (r, o) {
            (
                1,
                Err(CommError::Protocol {
                    peer: Some(0),
                    reason,
                    ..
                }),
            ) => assert!(reason.contains("corrupted"), "{reason}"),
            (1, other) => panic!("rank 1: want Protocol, got {other:?}"),
            (_, Err(CommError::Aborted { cause, .. })) => {
                assert!(cause.contains("protocol error"), "{cause}")
            }
            (_, other) => panic!("rank {r}: want Aborted naming the protocol error, got {other:?}"),
        }
    }
}

#[test]
fn a_duplicated_message_is_a_protocol_error() {
    // The duplicate may land after rank 0's call already finished with the
    // right data; then it poisons the group and the next call reports it.
    let (out, _, _) = run(
        cfg().fault(Fault::Duplicate(MsgFilter::link(1, 0).nth(0))),
        2,
    );
    match &out[0] {
        Err(CommError::Protocol {
            peer: Some(1),
            reason,
            ..
        }) => assert!(reason.contains("duplicate"), "{reason}"),
        Err(CommError::Aborted { cause, .. }) => assert!(cause.contains("duplicate"), "{cause}"),
        other => panic!("rank 0: want Protocol, got {other:?}"),
    }
    assert!(
        out.iter().all(Result::is_err),
        "no rank reports success: {out:?}"
    );
}

#[test]
fn a_partition_times_out_everyone() {
    let f = Fault::Partition {
        a: vec![0, 1],
        b: vec![2, 3],
        from: Duration::ZERO,
        heal_at: None,
    };
    let (out, _, _) = run(cfg().fault(f), 1);
    for (r, o) in out.into_iter().enumerate() {
        assert!(
            matches!(o, Err(CommError::Timeout { .. })),
            "rank {r}: {o:?}"
        );
    }
}

#[test]
fn a_healed_partition_and_a_released_hold_only_cost_time() {
    let base = run(cfg(), 2).2;
    let f = Fault::Hold {
        from: 0,
        to: 1,
        at: Duration::ZERO,
        release_at: Duration::from_secs(5),
    };
    let (out, _, elapsed) = run(cfg().fault(f), 2);
    for o in out {
        assert_eq!(o.unwrap(), vec![40.0; LEN]);
    }
    assert!(
        elapsed >= Duration::from_secs(5) && elapsed > base,
        "{elapsed:?} vs {base:?}"
    );

    // Cut for the first microsecond only: the first messages are lost.
    let f = Fault::Partition {
        a: vec![0],
        b: vec![1, 2, 3],
        from: Duration::ZERO,
        heal_at: Some(Duration::from_micros(1)),
    };
    let (out, _, _) = run(cfg().fault(f), 1);
    assert!(
        out.iter().all(Result::is_err),
        "messages sent during the cut are lost"
    );
}

#[test]
fn a_delay_past_the_deadline_is_a_timeout() {
    let f = Fault::Delay {
        filter: MsgFilter::link(2, 3),
        by: Duration::from_secs(120),
    };
    let (out, _, _) = run(cfg().fault(f), 1);
    // Rank 3 never gets rank 2's frame: a timeout, or, once rank 2 has
    // finished and left (recursive doubling lets it), rank 2 lost.
    assert!(
        matches!(
            out[3],
            Err(CommError::Timeout { .. } | CommError::PeerLost { peer: 2, .. })
        ),
        "{:?}",
        out[3]
    );
    let f = Fault::Delay {
        filter: MsgFilter::link(2, 3),
        by: Duration::from_millis(5),
    };
    let (out, _, _) = run(cfg().fault(f), 1);
    assert!(
        out.iter().all(Result::is_ok),
        "a short delay is only slower"
    );
}

#[test]
fn a_fault_scenario_replays_identically_from_its_seed() {
    let scenario = |seed| {
        cfg()
            .seed(seed)
            .fault(Fault::Drop(MsgFilter::default().with_probability(0.02)))
            .fault(Fault::Delay {
                filter: MsgFilter::default().with_probability(0.3),
                by: Duration::from_micros(50),
            })
    };
    let show = |o: &Outcome| o.iter().map(|r| format!("{r:?}")).collect::<Vec<_>>();
    let (a, ta, ea) = run(scenario(7), 6);
    for _ in 0..3 {
        let (b, tb, eb) = run(scenario(7), 6);
        assert_eq!(show(&a), show(&b), "same seed, same results");
        assert_eq!(ta, tb, "same seed, same trace");
        assert_eq!(ea, eb);
    }
    let distinct = (8..16).any(|s| run(scenario(s), 6).1 != ta);
    assert!(distinct, "other seeds make other traces");
}

#[test]
fn bad_fault_plans_and_worlds_are_rejected() {
    assert!(SimWorld::new(SimConfig::new(0)).is_err());
    let e = SimWorld::new(SimConfig::new(2).fault(Fault::Crash {
        rank: 5,
        at: Trigger::At(Duration::ZERO),
    }))
    .unwrap_err();
    assert!(e.to_string().contains("outside a world of 2"), "{e}");
}

/// A call queued behind one that never ends times out at its own deadline
/// and names the rank holding the group up (here rank 1, which stays out
/// of every call), as a running call's timeout does.
#[test]
fn a_queued_call_times_out_naming_the_rank_that_holds_it_up() {
    use consort_comm::{Backend, BufferMut, CallOptions};
    let world = SimWorld::new(SimConfig::new(2).timeout(Duration::from_secs(60))).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut ranks = world.ranks();
    let one = ranks.pop().unwrap();
    let zero = ranks.pop().unwrap();
    let (done, wait) = tokio::sync::oneshot::channel::<()>();
    let err = rt.block_on(async move {
        // Rank 1 stays out of every call until rank 0 is done.
        let idle = tokio::spawn(async move {
            let _ = wait.await;
            drop(one);
        });
        let mut a = [1.0f32; 4];
        let mut b = [1.0f32; 4];
        let long = CallOptions::default().with_timeout(Duration::from_secs(30));
        let short = CallOptions::default().with_timeout(Duration::from_millis(200));
        let first = zero.all_reduce(BufferMut::from(&mut a[..]), ReduceOp::Sum, &long);
        let queued = zero.all_reduce(BufferMut::from(&mut b[..]), ReduceOp::Sum, &short);
        let (_, e) = tokio::join!(
            async { tokio::time::timeout(Duration::from_millis(600), first).await },
            queued
        );
        let _ = done.send(());
        let _ = idle.await;
        e.unwrap_err()
    });
    match &err {
        CommError::Timeout { waiting_on, .. } => assert_eq!(waiting_on, &vec![1], "{err}"),
        other => panic!("want a Timeout naming rank 1, got {other}"),
    }
}

/// A rank whose handle is dropped (its process exited) is known lost to
/// its peers without a call, in their group's numbering: the side channel
/// of a stream-ordered communicator names a lost peer this way.
#[test]
fn an_exited_rank_is_among_its_peers_lost_peers_in_group_ranks() {
    use consort_comm::{Backend, CallOptions};
    let world = SimWorld::new(SimConfig::new(3)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut ranks = world.ranks().into_iter();
    let (r0, r1, r2) = (
        ranks.next().unwrap(),
        ranks.next().unwrap(),
        ranks.next().unwrap(),
    );
    let opts = CallOptions::default();
    let subs = rt.block_on(async {
        let (a, b, c) = tokio::join!(
            r0.new_group(&[0, 2], &opts),
            r1.new_group(&[0, 2], &opts),
            r2.new_group(&[0, 2], &opts),
        );
        let _ = b.unwrap();
        (a.unwrap().unwrap(), c.unwrap().unwrap())
    });
    assert!(r0.lost_peers().is_empty());
    drop(subs.1);
    drop(r2);
    let lost = r0.lost_peers();
    assert_eq!(
        lost.iter().map(|l| l.0).collect::<Vec<_>>(),
        [2],
        "{lost:?}"
    );
    assert!(lost[0].1.contains("exited"), "{lost:?}");
    // In the subgroup of world ranks [0, 2], world rank 2 is group rank 1.
    let in_sub = subs.0.lost_peers();
    assert_eq!(
        in_sub.iter().map(|l| l.0).collect::<Vec<_>>(),
        [1],
        "{in_sub:?}"
    );
    assert!(r1.lost_peers().iter().any(|l| l.0 == 2));
}
