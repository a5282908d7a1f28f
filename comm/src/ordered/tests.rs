use std::time::{Duration, Instant};

use super::{Ordered, check::first_difference};
use crate::{
    CommError, Fingerprint, GroupId, OpKind,
    frame::{FrameHeader, HEADER_LEN},
};

use crate::fingerprint::test_shape as fp;

const SEC: Duration = Duration::from_secs(1);

/// A deadline that does not pass in these tests.
fn far(t0: Instant) -> Instant {
    t0 + 3600 * SEC
}

#[test]
fn calls_are_numbered_per_group_when_made_and_name_their_group() {
    let sub = GroupId(0x1234);
    let mut o = Ordered::<u32>::new(1, 3, sub);
    let a = o.make(fp(OpKind::AllReduce)).unwrap();
    let b = o.make(fp(OpKind::Broadcast)).unwrap();
    let p = o.make(fp(OpKind::Send)).unwrap();
    assert_eq!((a.fp.seq, b.fp.seq, p.fp.seq), (0, 1, 0));
    assert_eq!(a.ctx.group, Some(sub));
    assert_eq!(a.fp.group, sub);
    assert_eq!(a.ctx.rank, Some(1));
}

#[test]
fn a_call_waits_for_the_turns_of_calls_made_before_it() {
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let a = o.make(fp(OpKind::AllReduce)).unwrap();
    let b = o.make(fp(OpKind::AllReduce)).unwrap();
    assert!(o.is_turn(a.id) && !o.is_turn(b.id));
    o.launchable(a.id).unwrap();
    assert!(o.enqueued(a.id, 1, Instant::now(), SEC).is_none());
    assert!(o.is_turn(b.id));
    assert!(!o.is_idle());
}

#[test]
fn a_call_dropped_before_its_turn_poisons_the_group_and_frees_the_turn() {
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let a = o.make(fp(OpKind::AllReduce)).unwrap();
    let b = o.make(fp(OpKind::AllReduce)).unwrap();
    let abort = o.cancel(a.id).expect("the driver is told to abort");
    assert!(abort.to_string().contains("cancelled"), "{abort}");
    assert!(o.cancel(a.id).is_none(), "a call is cancelled once");
    assert!(o.is_turn(b.id));
    let e = o.launchable(b.id).unwrap_err();
    assert!(e.to_string().contains("cancelled"), "{e}");
    let later = o.make(fp(OpKind::Barrier)).unwrap_err();
    assert!(later.to_string().contains("cancelled"), "{later}");
    assert!(o.is_idle());
}

#[test]
fn a_cancel_with_a_cause_poisons_the_group_with_that_cause() {
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let a = o.make(fp(OpKind::AllReduce)).unwrap();
    let why = CommError::invalid("the side channel said so");
    struct Guard<'a>(
        &'a mut Ordered<u32>,
        crate::engine::CallId,
        Option<CommError>,
    );
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            self.2 = self.0.cancel(self.1);
            assert!(
                self.2
                    .as_ref()
                    .is_some_and(|e| e.to_string().contains("said so"))
            );
        }
    }
    crate::cancel::drop_because(Guard(&mut o, a.id, None), &why);
    let e = o.poisoned().expect("poisoned").to_string();
    assert!(e.contains("said so"), "{e}");
}

#[test]
fn a_call_that_times_out_behind_a_stuck_enqueue_names_it_and_poisons_the_group() {
    let mut o = Ordered::<u32>::new(1, 2, GroupId::WORLD);
    let a = o.make(fp(OpKind::Broadcast)).unwrap();
    let b = o.make(fp(OpKind::AllReduce)).unwrap();
    let c = o.make(fp(OpKind::AllReduce)).unwrap();
    assert!(!o.is_turn(b.id));
    let e = o.turn_timed_out(b.id, SEC);
    let said = e.to_string();
    assert!(said.contains("broadcast call (seq 0)"), "{said}");
    assert!(said.contains("seq 1") && said.contains("rank 1"), "{said}");
    let (e, first) = o.failed_before_enqueue(b.id, e);
    assert!(e.to_string().contains("waited 1s"), "{e}");
    assert!(
        first.to_string().contains("waited 1s"),
        "the cause told: {first}"
    );
    // The group failed: a later call need not wait for the turn to be told.
    assert!(o.is_turn(c.id));
    let later = o.launchable(c.id).unwrap_err().to_string();
    assert!(later.contains("broadcast call (seq 0)"), "{later}");
    // The stuck call, its enqueue done at last, is refused as well.
    assert!(o.is_turn(a.id) && o.launchable(a.id).is_err());
    assert!(o.is_idle());
}

#[test]
fn work_completes_in_order_and_a_passed_deadline_fails_everything_in_flight() {
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let t0 = Instant::now();
    for w in 0..3 {
        let m = o.make(fp(OpKind::AllReduce)).unwrap();
        o.launchable(m.id).unwrap();
        assert!(o.enqueued(m.id, w, t0, SEC).is_none());
    }
    assert_eq!(o.poll_timeout(), Some(t0 + SEC));
    // Work 0 is done; work 1 is not, and it is not late yet.
    let w = o.watch(t0, |&w| Ok(w == 0), |_, _, _| None);
    assert_eq!(w.finished.len(), 1);
    assert!(w.finished[0].1.is_ok() && !w.abort);
    // Work 2's event fired, but work 1 comes first: nothing completes.
    let w = o.watch(t0, |&w| Ok(w == 2), |_, _, _| None);
    assert!(w.finished.is_empty() && !w.abort);
    let w = o.watch(t0 + SEC, |&w| Ok(w == 2), |_, _, _| None);
    assert!(w.abort);
    let errs: Vec<_> = w
        .finished
        .into_iter()
        .map(|(_, r)| r.unwrap_err())
        .collect();
    assert!(matches!(errs[0], CommError::Timeout { .. }), "{}", errs[0]);
    assert_eq!(errs[0].context().and_then(|c| c.seq), Some(1));
    assert!(matches!(errs[1], CommError::Aborted { .. }), "{}", errs[1]);
    let later = o.make(fp(OpKind::Barrier)).unwrap_err();
    assert!(later.to_string().contains("timed out"), "{later}");
    assert_eq!(o.poll_timeout(), None);
    assert!(o.synchronized().unwrap().is_err());
}

#[test]
fn an_asynchronous_error_aborts_and_sticks() {
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let m = o.make(fp(OpKind::AllReduce)).unwrap();
    assert!(o.enqueued(m.id, 0, Instant::now(), SEC).is_none());
    let w = o.watch(
        Instant::now(),
        |_| Ok(false),
        |_, ctx, _| Some(CommError::invalid("remote error").with_context(ctx)),
    );
    assert!(w.abort);
    assert!(
        w.finished[0]
            .1
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("remote error")
    );
    assert!(o.poisoned().is_some());
}

#[test]
fn a_mismatch_found_after_its_call_ended_still_poisons() {
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let m = o.make(fp(OpKind::AllReduce)).unwrap();
    assert!(o.enqueued(m.id, 0, Instant::now(), SEC).is_none());
    let _ = o.watch(Instant::now(), |_| Ok(true), |_, _, _| None);
    assert_eq!(o.synchronized().map(|r| r.is_ok()), Some(true));
    let other = fp(OpKind::Broadcast).at(GroupId::WORLD, 0);
    let e = first_difference(m.fp, 0, &both(m.fp, other)).unwrap();
    assert!(o.mismatch(e).is_empty());
    let later = o.make(fp(OpKind::Barrier)).unwrap_err();
    assert!(later.to_string().contains("mismatch"), "{later}");
    // A second verdict does not replace the first cause.
    assert!(o.mismatch(CommError::invalid("x")).is_empty());
}

#[test]
fn a_mismatch_found_before_its_call_reaches_the_stream_is_that_calls_error() {
    // NCCL's host calls stage before they enqueue; the check over the side
    // channel can answer first (seen on an H100: the call got "aborted by
    // an earlier failure" instead of the mismatch that named it).
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let m = o.make(fp(OpKind::AllReduce)).unwrap();
    let next = o.make(fp(OpKind::AllReduce)).unwrap();
    let other = fp(OpKind::Broadcast).at(GroupId::WORLD, 0);
    let e = first_difference(m.fp, 0, &both(m.fp, other)).unwrap();
    assert!(o.mismatch(e).is_empty());
    let got = o.launchable(m.id).unwrap_err();
    assert!(matches!(got, CommError::Mismatch { .. }), "{got}");
    // A later call is not the one named: it fails by the earlier failure.
    let got = o.launchable(next.id).unwrap_err();
    assert!(matches!(got, CommError::Aborted { .. }), "{got}");
    assert!(got.to_string().contains("mismatch"), "{got}");
    assert!(o.is_idle());
}

#[test]
fn a_mismatch_found_while_its_call_is_being_enqueued_is_that_calls_error() {
    // The verdict can also come while the call is inside its enqueue: the
    // abort it starts stops that enqueue (seen on an H100: the call got
    // "the communicator was aborted while this call was being enqueued").
    let mut o = Ordered::<u32>::new(1, 2, GroupId::WORLD);
    let m = o.make(fp(OpKind::AllReduce)).unwrap();
    let next = o.make(fp(OpKind::AllReduce)).unwrap();
    o.launchable(m.id).unwrap();
    let other = fp(OpKind::Broadcast).at(GroupId::WORLD, 0);
    let e = first_difference(m.fp, 1, &both(m.fp, other)).unwrap();
    assert!(o.mismatch(e).is_empty());
    let stopped = || CommError::Aborted {
        ctx: Default::default(),
        cause: "the communicator was aborted while this call was being enqueued".into(),
    };
    let (got, first) = o.failed_before_enqueue(m.id, stopped());
    assert!(matches!(got, CommError::Mismatch { .. }), "{got}");
    assert!(matches!(first, CommError::Mismatch { .. }), "{first}");
    // A later call stopped the same way fails by the earlier failure.
    let got = o.launch_failed(next.id, stopped());
    assert!(matches!(got, CommError::Aborted { .. }), "{got}");
    assert!(got.to_string().contains("mismatch"), "{got}");
    // In a group that had not failed, the call's own error stands.
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let m = o.make(fp(OpKind::AllReduce)).unwrap();
    let later = o.make(fp(OpKind::Broadcast)).unwrap();
    let last = o.make(fp(OpKind::AllReduce)).unwrap();
    let (got, _) = o.failed_before_enqueue(m.id, stopped());
    assert!(got.to_string().contains("being enqueued"), "{got}");
    // So does a failure that is not an abort's, in a failed group; and a
    // later call stopped by that abort reports its own op and seq.
    let nccl = CommError::Backend {
        ctx: Default::default(),
        backend: "NCCL",
        code: 3,
        detail: "ncclInternalError".into(),
    };
    let (got, _) = o.failed_before_enqueue(later.id, nccl);
    assert!(matches!(got, CommError::Backend { .. }), "{got}");
    let got = o.launch_failed(last.id, stopped());
    assert_eq!(got.context().and_then(|c| c.seq), Some(2), "{got}");
    assert!(got.to_string().contains("being enqueued"), "{got}");
}

fn both(a: Fingerprint, b: Fingerprint) -> Vec<u8> {
    let mut v = FrameHeader::data(a, 0, 0, 0).encode().to_vec();
    v.extend_from_slice(&FrameHeader::data(b, 0, 0, 0).encode());
    v
}

#[test]
fn the_comparison_names_both_sides_and_refuses_garbage() {
    let a = fp(OpKind::AllReduce).at(GroupId::WORLD, 3);
    let b = fp(OpKind::Broadcast).at(GroupId::WORLD, 3);
    assert!(first_difference(a, 0, &both(a, a)).is_none());
    let e = first_difference(a, 0, &both(a, b)).unwrap();
    match &e {
        CommError::Mismatch {
            local,
            remote,
            remote_rank,
            ctx,
        } => {
            assert_eq!((*local, *remote, *remote_rank), (a, b, 1));
            assert_eq!(ctx.seq, Some(3));
        }
        other => panic!("{other}"),
    }
    let e = first_difference(b, 1, &both(a, b)).unwrap();
    assert!(matches!(e, CommError::Mismatch { remote_rank: 0, .. }));
    let garbage = vec![7u8; HEADER_LEN];
    assert!(matches!(
        first_difference(a, 0, &garbage),
        Some(CommError::Protocol { .. })
    ));
}

/// A side channel whose transport has lost the ranks in `lost` (and makes
/// no calls: the rule only asks it who is gone).
#[derive(Debug, Default)]
struct Side {
    lost: std::sync::Mutex<Vec<(usize, String)>>,
    said: std::sync::Mutex<Vec<(usize, String)>>,
}

#[async_trait::async_trait]
impl crate::Backend for Side {
    fn name(&self) -> &'static str {
        "side"
    }
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        3
    }
    fn default_timeout(&self) -> Duration {
        SEC
    }
    fn submit<'a>(&'a self, _: crate::Op<'a>, _: &crate::CallOptions) -> crate::Work<'a> {
        crate::Work::ready(Err(CommError::unsupported(
            "the test's side channel makes no calls",
        )))
    }
    fn lost_peers(&self) -> Vec<(usize, String)> {
        self.lost.lock().unwrap().clone()
    }
    /// The told ranks, as told calls' aborts (a barrier), beside a
    /// comparison's abort (an all-gather), which is not a told one.
    fn peer_aborts(&self) -> Vec<crate::PeerAbort> {
        let said = self.said.lock().unwrap().clone();
        let other = crate::PeerAbort {
            rank: 1,
            call: fp(OpKind::AllGather).at(GroupId::WORLD, 3),
            said: "timed out comparing".into(),
        };
        let told = said.into_iter().map(|(rank, said)| crate::PeerAbort {
            rank,
            call: fp(OpKind::Barrier).at(GroupId::WORLD, 4),
            said,
        });
        std::iter::once(other).chain(told).collect()
    }
}

/// A rank that said its communicator failed (a call it cancelled: NCCL
/// tells its peers nothing) will not run its part: a call waiting on it
/// fails after the grace, naming it and what it said; a lost rank is
/// named first, as `PeerLost`.
#[test]
fn a_call_stalled_on_a_rank_that_said_it_failed_names_it_and_its_cause() {
    use super::check::{Checker, LostPeer, STALL_GRACE};
    let side = std::sync::Arc::new(Side::default());
    let (checker, _task) = Checker::new(side.clone(), SEC, std::sync::Arc::new(|_| {}));
    let c = Some(&checker);
    let ctx = |op| crate::ErrorContext::new(op, 0, 4, GroupId::WORLD);
    let t0 = Instant::now();
    side.said
        .lock()
        .unwrap()
        .push((2, "a all_reduce call (seq 4) was cancelled".into()));
    let mut rule = LostPeer::default();
    assert!(
        rule.stalled(c, (ctx(OpKind::AllReduce), None), t0)
            .is_none()
    );
    let late = t0 + STALL_GRACE;
    let mut p2p = LostPeer::default();
    assert!(p2p.stalled(c, (ctx(OpKind::Send), Some(1)), t0).is_none());
    assert!(p2p.stalled(c, (ctx(OpKind::Send), Some(1)), late).is_none());
    match rule.stalled(c, (ctx(OpKind::AllReduce), None), late) {
        Some(e @ CommError::Aborted { .. }) => {
            let s = e.to_string();
            assert!(s.contains("rank 2's communicator failed"), "{s}");
            assert!(s.contains("was cancelled"), "{s}");
            assert!(s.contains("seq 4"), "{s}");
        }
        other => panic!("{other:?}"),
    }
    side.lost
        .lock()
        .unwrap()
        .push((1, "its process exited".into()));
    let mut both = LostPeer::default();
    assert!(
        both.stalled(c, (ctx(OpKind::AllReduce), None), t0)
            .is_none()
    );
    let named = both.stalled(c, (ctx(OpKind::AllReduce), None), late);
    assert!(
        matches!(named, Some(CommError::PeerLost { peer: 1, .. })),
        "{named:?}"
    );
}

fn remote() -> CommError {
    CommError::Backend {
        ctx: crate::ErrorContext {
            rank: Some(0),
            ..Default::default()
        },
        backend: "NCCL",
        code: 6,
        detail: "ncclRemoteError (socketProgress: Connection closed by remote peer)".into(),
    }
}

#[test]
fn an_anonymous_failure_is_named_by_the_side_channel_that_lost_the_rank() {
    use super::check::{Checker, LostPeer};
    let side = std::sync::Arc::new(Side::default());
    let (checker, _task) = Checker::new(side.clone(), SEC, std::sync::Arc::new(|_| {}));
    let mut rule = LostPeer::default();
    let t0 = Instant::now();
    // Nobody lost yet: the failure is held back (the calls stay in flight).
    assert!(rule.name(Some(&checker), remote(), (t0, far(t0))).is_none());
    side.lost
        .lock()
        .unwrap()
        .push((2, "connection reset".into()));
    let named = rule
        .name(Some(&checker), remote(), (t0 + SEC / 10, far(t0)))
        .unwrap();
    match &named {
        CommError::PeerLost { peer, reason, ctx } => {
            assert_eq!((*peer, ctx.rank), (2, Some(0)));
            assert!(reason.contains("connection reset"), "{reason}");
            assert!(reason.contains("ncclRemoteError"), "{reason}");
        }
        other => panic!("{other}"),
    }
}

#[test]
fn an_anonymous_failure_stands_after_the_grace_or_without_a_side_channel() {
    use super::check::{Checker, LOST_PEER_GRACE, LostPeer};
    let side = std::sync::Arc::new(Side::default());
    let (checker, _task) = Checker::new(side, SEC, std::sync::Arc::new(|_| {}));
    let mut rule = LostPeer::default();
    let t0 = Instant::now();
    assert!(rule.name(Some(&checker), remote(), (t0, far(t0))).is_none());
    assert!(
        rule.name(
            Some(&checker),
            remote(),
            (t0 + LOST_PEER_GRACE / 2, far(t0))
        )
        .is_none()
    );
    let late = rule.name(Some(&checker), remote(), (t0 + LOST_PEER_GRACE, far(t0)));
    assert!(
        matches!(late, Some(CommError::Backend { code: 6, .. })),
        "{late:?}"
    );
    let alone = LostPeer::default().name(None, remote(), (t0, far(t0)));
    assert!(
        matches!(alone, Some(CommError::Backend { code: 6, .. })),
        "{alone:?}"
    );
    // A failure a call returned: with no rank lost it stands after the
    // grace, on the calling thread.
    let start = Instant::now();
    let (checker, _task) = Checker::new(
        std::sync::Arc::new(Side::default()),
        SEC,
        std::sync::Arc::new(|_| {}),
    );
    let blocked = LostPeer::name_blocking(Some(&checker), remote(), 2 * LOST_PEER_GRACE);
    assert!(matches!(blocked, CommError::Backend { code: 6, .. }));
    assert!(start.elapsed() >= LOST_PEER_GRACE);
    // A nearer deadline waits less.
    let start = Instant::now();
    let _ = LostPeer::name_blocking(Some(&checker), remote(), Duration::from_millis(5));
    assert!(start.elapsed() < LOST_PEER_GRACE);
}

/// A call whose deadline falls inside the grace fails with the failure the
/// communicator reported (its real cause), not with `Timeout`, when no rank
/// is named by then.
#[test]
fn a_held_failure_stands_when_the_calls_deadline_passes_inside_the_grace() {
    use super::check::{Checker, LOST_PEER_GRACE, LostPeer};
    let (checker, _task) = Checker::new(
        std::sync::Arc::new(Side::default()),
        SEC,
        std::sync::Arc::new(|_| {}),
    );
    let t0 = Instant::now();
    let mut rule = LostPeer::default();
    let deadline = t0 + LOST_PEER_GRACE / 4;
    assert!(
        rule.name(Some(&checker), remote(), (t0, deadline))
            .is_none()
    );
    let at = rule.name(Some(&checker), remote(), (deadline, deadline));
    assert!(
        matches!(at, Some(CommError::Backend { code: 6, .. })),
        "{at:?}"
    );
    // The same through the call rules: the oldest call's deadline passes
    // while the failure is held, and every call fails with the failure.
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    for w in 0..2 {
        let m = o.make(fp(OpKind::AllReduce)).unwrap();
        o.launchable(m.id).unwrap();
        assert!(o.enqueued(m.id, w, t0, LOST_PEER_GRACE / 4).is_none());
    }
    let mut rule = LostPeer::default();
    let mut watch = |now| {
        o.watch(
            now,
            |_| Ok(false),
            |_, _, deadline| rule.name(Some(&checker), remote(), (now, deadline)),
        )
    };
    let held = watch(t0);
    assert!(held.finished.is_empty() && !held.abort);
    let failed = watch(deadline);
    assert!(failed.abort);
    assert_eq!(failed.finished.len(), 2);
    let first = failed.finished[0].1.as_ref().unwrap_err();
    assert!(
        matches!(first, CommError::Backend { code: 6, .. }),
        "{first}"
    );
}

/// A rank leaves (`wait_drained`) only once its subgroups' comparisons are
/// done too: leaving with one pending fails that comparison on its peers
/// as a lost rank. Found as a flaky DDP shrink on emulated communicators,
/// whose survivors' subgroup still compared the last step as a rank left.
#[test]
fn a_checker_is_drained_only_when_its_subgroups_are() {
    use super::check::Checker;
    let side = std::sync::Arc::new(Side::default());
    let (parent, _task) = Checker::new(side.clone(), SEC, std::sync::Arc::new(|_| {}));
    let (child, child_task) =
        Checker::in_tree(side, SEC, std::sync::Arc::new(|_| {}), parent.tree.clone());
    assert!(parent.is_drained());
    child.check(fp(OpKind::AllReduce).at(GroupId(7), 0));
    assert!(!parent.is_drained(), "the subgroup's comparison is pending");
    assert!(!child.is_drained());
    // Its task is gone: nothing more will be compared there.
    drop(child_task);
    assert!(parent.is_drained() && child.is_drained());
}

/// The call rules' share of a call's host time: make, take the turn,
/// launch, enqueue and complete one call under a mutex, as a driver does
/// (NCCL's watchdog takes the same steps). A benchmark: prints, asserts
/// nothing about time. `cargo test --release -p consort-comm --lib
/// bench_call_rules -- --ignored --nocapture`
#[test]
#[ignore = "a benchmark: prints the host time per call"]
fn bench_call_rules_per_call() {
    let track = std::sync::Mutex::new(Ordered::<u32>::new(0, 1, GroupId::WORLD));
    let calls = 200_000;
    let t = Instant::now();
    for w in 0..calls {
        let mut o = track.lock().unwrap();
        let m = o.make(fp(OpKind::AllReduce)).unwrap();
        assert!(o.is_turn(m.id));
        o.launchable(m.id).unwrap();
        assert!(o.enqueued(m.id, w, Instant::now(), SEC).is_none());
        let seen = o.watch(Instant::now(), |_| Ok(true), |_, _, _| None);
        assert_eq!(seen.finished.len(), 1);
    }
    let per = t.elapsed().as_secs_f64() / f64::from(calls) * 1e6;
    println!("call rules per call (make, turn, launch, enqueue, complete): {per:.3} us");
}

/// A call whose group fails while it is being enqueued (an abort that did
/// not wait for the launch) is not left on the aborted communicator's
/// queue, where nothing would finish it: it comes back failed.
#[test]
fn a_call_enqueued_after_its_group_failed_comes_back_failed() {
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let m = o.make(fp(OpKind::AllReduce)).unwrap();
    o.launchable(m.id).unwrap();
    let cause = CommError::PeerLost {
        ctx: crate::ErrorContext::default(),
        peer: 1,
        reason: "its process exited".into(),
    };
    assert!(o.fail_all(cause).is_empty());
    let (w, r) = o
        .enqueued(m.id, 7, Instant::now(), SEC)
        .expect("handed back");
    assert_eq!(w, 7);
    let e = r.unwrap_err();
    assert!(e.to_string().contains("rank 1"), "{e}");
    assert_eq!(o.in_flight(), 0);
    assert!(o.is_idle());
}

/// A collective that waits with no error from the communicator on a rank
/// the side channel saw go (NCCL over NVLink or shared memory reports
/// none) fails naming it once the grace has passed; a send or receive only
/// when its own peer is the lost rank; a world with nobody lost waits on.
#[test]
fn a_collective_stalled_on_a_lost_rank_fails_naming_it_after_the_grace() {
    use super::check::{Checker, LostPeer, STALL_GRACE};
    let side = std::sync::Arc::new(Side::default());
    let (checker, _task) = Checker::new(side.clone(), SEC, std::sync::Arc::new(|_| {}));
    let ctx = |op| crate::ErrorContext::new(op, 0, 4, GroupId::WORLD);
    let t0 = Instant::now();
    let mut rule = LostPeer::default();
    let c = Some(&checker);
    assert!(
        rule.stalled(c, (ctx(OpKind::AllReduce), None), t0)
            .is_none()
    );
    side.lost
        .lock()
        .unwrap()
        .push((1, "its process exited".into()));
    assert!(
        rule.stalled(c, (ctx(OpKind::AllReduce), None), t0)
            .is_none()
    );
    let half = t0 + STALL_GRACE / 2;
    assert!(
        rule.stalled(c, (ctx(OpKind::AllReduce), None), half)
            .is_none()
    );
    let late = t0 + STALL_GRACE;
    // A send or receive waits only on its peer.
    assert!(rule.stalled(c, (ctx(OpKind::Send), None), late).is_none());
    let mut p2p = LostPeer::default();
    assert!(p2p.stalled(c, (ctx(OpKind::Send), Some(0)), t0).is_none());
    assert!(p2p.stalled(c, (ctx(OpKind::Send), Some(0)), late).is_none());
    assert!(p2p.stalled(c, (ctx(OpKind::Recv), Some(1)), t0).is_none());
    let named = p2p.stalled(c, (ctx(OpKind::Recv), Some(1)), late);
    assert!(
        matches!(named, Some(CommError::PeerLost { peer: 1, .. })),
        "{named:?}"
    );
    // Another call at the front starts its own wait.
    let other = crate::ErrorContext::new(OpKind::AllReduce, 0, 5, GroupId::WORLD);
    assert!(rule.stalled(c, (other, None), late).is_none());
    assert!(
        rule.stalled(c, (ctx(OpKind::AllReduce), None), late)
            .is_none()
    );
    let later = late + STALL_GRACE;
    match rule.stalled(c, (ctx(OpKind::AllReduce), None), later) {
        Some(CommError::PeerLost { peer, reason, ctx }) => {
            assert_eq!((peer, ctx.seq), (1, Some(4)));
            assert!(reason.contains("its process exited"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        LostPeer::default()
            .stalled(None, (ctx(OpKind::AllReduce), None), late)
            .is_none()
    );
    // Through the call rules: the pending collective fails with it.
    let mut o = Ordered::<u32>::new(0, 2, GroupId::WORLD);
    let m = o.make(fp(OpKind::AllReduce)).unwrap();
    o.launchable(m.id).unwrap();
    assert!(o.enqueued(m.id, 0, t0, 60 * SEC).is_none());
    let mut rule = LostPeer::default();
    let mut watch = |now: Instant| {
        o.watch(
            now,
            |_| Ok(false),
            |_, ctx, _| rule.stalled(c, (ctx, None), now),
        )
    };
    assert!(!watch(t0).abort);
    let seen = watch(late);
    assert!(seen.abort);
    let e = seen.finished[0].1.as_ref().unwrap_err();
    assert!(matches!(e, CommError::PeerLost { peer: 1, .. }), "{e}");
}

/// Another NCCL failure (an internal error) is named once, never waited
/// for: `PeerLost` when the side channel already knows a rank gone.
#[test]
fn another_failure_is_named_only_if_a_rank_is_already_known_lost() {
    use super::check::{Checker, LostPeer};
    let side = std::sync::Arc::new(Side::default());
    let (checker, _task) = Checker::new(side.clone(), SEC, std::sync::Arc::new(|_| {}));
    let internal = || CommError::Backend {
        ctx: crate::ErrorContext::default(),
        backend: "NCCL",
        code: 3,
        detail: "ncclInternalError (proxy connection failed)".into(),
    };
    let start = Instant::now();
    let stands = LostPeer::named_now(Some(&checker), internal());
    assert!(matches!(stands, CommError::Backend { code: 3, .. }));
    assert!(start.elapsed() < SEC / 10);
    side.lost
        .lock()
        .unwrap()
        .push((2, "connection reset".into()));
    match LostPeer::named_now(Some(&checker), internal()) {
        CommError::PeerLost { peer, reason, .. } => {
            assert_eq!(peer, 2);
            assert!(reason.contains("ncclInternalError"), "{reason}");
        }
        other => panic!("{other}"),
    }
    assert!(matches!(
        LostPeer::named_now(None, internal()),
        CommError::Backend { code: 3, .. }
    ));
}

/// A checker whose task never runs again (a communicator dropped while
/// its runtime shuts down drops its tasks one after another on its own
/// thread) is not waited for beyond the stall bound, whatever its timeout:
/// a rank leaving then used to hang for the whole op timeout.
#[test]
fn leaving_does_not_wait_for_a_checker_that_never_runs_again() {
    use super::check::{Checker, DRAIN_STALL};
    let side = std::sync::Arc::new(Side::default());
    let hour = std::time::Duration::from_secs(3600);
    let (checker, _task) = Checker::new(side, hour, std::sync::Arc::new(|_| {}));
    checker.check(fp(OpKind::AllReduce).at(GroupId::WORLD, 0));
    assert!(!checker.is_drained());
    let t0 = Instant::now();
    checker.wait_drained();
    // It waited for a comparison to end, then gave up: not an hour.
    assert!(t0.elapsed() >= DRAIN_STALL);
}
