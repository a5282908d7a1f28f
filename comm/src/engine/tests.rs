use super::*;
use crate::{DType, ReduceOp};

fn fp(group: GroupId, seq: u64, op: OpKind, count: u64) -> Fingerprint {
    Fingerprint {
        group,
        seq,
        op,
        dtype: DType::F32,
        count,
        root: 0,
        reduce_op: (op == OpKind::AllReduce).then_some(ReduceOp::Sum),
    }
}

fn begin(e: &mut Engine<u32>, group: GroupId, op: OpKind, count: u64) -> Result<Begun> {
    let f = fp(group, 0, op, count);
    let shape = crate::Shape {
        op: f.op,
        dtype: f.dtype,
        count: f.count,
        root: f.root,
        reduce_op: f.reduce_op,
    };
    e.begin(group, shape)
}

#[test]
fn sequence_numbers_are_fixed_when_calls_are_made_and_several_run_at_once() {
    let mut e = Engine::<u32>::new(0, 3);
    let a = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 4).unwrap();
    let b = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 8).unwrap();
    assert_eq!((a.seq, b.seq), (0, 1));
    assert_eq!(e.in_flight(), 2);
    // Frames for either call find it, whatever order they arrive in.
    e.file(1, b.fp, 0, 11);
    e.file(1, a.fp, 0, 10);
    assert_eq!(e.take(b.id, 1, 0).unwrap().unwrap(), 11);
    assert_eq!(e.take(a.id, 1, 0).unwrap().unwrap(), 10);
    assert!(e.end(b.id, Ok(())).result.is_ok());
    assert!(e.end(a.id, Ok(())).result.is_ok());
    // A frame for a finished call breaks the protocol.
    e.file(2, a.fp, 0, 1);
    let c = begin(&mut e, GroupId::WORLD, OpKind::Barrier, 0).unwrap_err();
    assert!(matches!(c, CommError::Protocol { .. }), "{c}");
}

#[test]
fn a_frame_with_another_fingerprint_is_a_mismatch_that_poisons_only_its_group() {
    let mut e = Engine::<u32>::new(1, 4);
    let sub = e.next_group_id(GroupId::WORLD).unwrap();
    assert_eq!(e.add_group(sub, vec![1, 3]).unwrap(), 0);
    let a = begin(&mut e, sub, OpKind::AllReduce, 4).unwrap();
    e.file(3, fp(sub, 0, OpKind::AllReduce, 5), 0, 7);
    let err = e.take(a.id, 1, 0).unwrap().unwrap_err();
    assert!(
        matches!(err, CommError::Mismatch { remote_rank: 1, .. }),
        "{err}"
    );
    let ended = e.end(a.id, Err(err));
    let (_, _, to) = ended.abort.expect("an abort to send");
    assert_eq!(to, vec![3]);
    assert!(begin(&mut e, sub, OpKind::Barrier, 0).is_err());
    // The world group is untouched.
    assert!(begin(&mut e, GroupId::WORLD, OpKind::Barrier, 0).is_ok());
}

#[test]
fn subgroups_number_their_calls_apart_from_the_parent() {
    let mut e = Engine::<u32>::new(0, 2);
    let sub = e.next_group_id(GroupId::WORLD).unwrap();
    e.add_group(sub, vec![0, 1]).unwrap();
    let w = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 1).unwrap();
    let s = begin(&mut e, sub, OpKind::AllReduce, 1).unwrap();
    assert_eq!((w.seq, s.seq), (0, 0));
    assert_ne!(w.fp, s.fp);
    e.file(1, s.fp, 0, 2);
    assert!(
        e.take(w.id, 1, 0).is_none(),
        "the world call must not take the subgroup's frame"
    );
    assert_eq!(e.take(s.id, 1, 0).unwrap().unwrap(), 2);
}

#[test]
fn a_cancelled_call_poisons_its_group_with_a_clear_error() {
    let mut e = Engine::<u32>::new(0, 2);
    let a = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 1).unwrap();
    let b = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 1).unwrap();
    let (info, _, to) = e.cancel(a.id, None).expect("abort to send");
    assert_eq!(to, vec![1]);
    assert!(matches!(info, AbortInfo::Other { .. }));
    // The other call in flight fails, and so does the next one.
    let err = e.failure(b.id, &[1]).expect("b fails");
    assert!(err.to_string().contains("cancelled"), "{err}");
    let next = begin(&mut e, GroupId::WORLD, OpKind::Barrier, 0).unwrap_err();
    assert!(next.to_string().contains("cancelled"), "{next}");
    assert!(
        e.cancel(a.id, None).is_none(),
        "cancelling twice does nothing"
    );
}

#[test]
fn a_call_cancelled_because_of_a_mismatch_tells_the_peers_the_mismatch() {
    let mut e = Engine::<u32>::new(1, 3);
    let a = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 4).unwrap();
    let ours = fp(GroupId::WORLD, 0, OpKind::AllReduce, 4);
    let theirs = fp(GroupId::WORLD, 0, OpKind::AllReduce, 5);
    let verdict = CommError::Mismatch {
        ctx: Default::default(),
        local: ours,
        remote: theirs,
        remote_rank: 0,
    };
    let (info, fp, to) = e.cancel(a.id, Some(verdict)).expect("abort to send");
    assert_eq!(to, vec![0, 2]);
    assert_eq!(fp, ours);
    // Rank 2, which called what rank 0 called, reads it as rank 1's odd call.
    let AbortInfo::Mismatch { remote, .. } = &info else {
        panic!("{info:?}");
    };
    assert_eq!(*remote, theirs);
    let on_2 = from_abort((1, fp), info, theirs, vec![1]);
    assert!(
        matches!(on_2, CommError::Mismatch { local, remote, remote_rank: 1, .. } if local == theirs && remote == ours),
        "{on_2}"
    );
    let next = begin(&mut e, GroupId::WORLD, OpKind::Barrier, 0).unwrap_err();
    assert!(next.to_string().contains("collective mismatch"), "{next}");
}

#[test]
fn a_lost_peer_fails_calls_once_they_wait_on_it() {
    let mut e = Engine::<u32>::new(0, 3);
    let sub = e.next_group_id(GroupId::WORLD).unwrap();
    e.add_group(sub, vec![0, 1]).unwrap();
    let a = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 1).unwrap();
    e.peer_lost(2, "EOF");
    assert!(e.failure(a.id, &[1]).is_none(), "not waiting on rank 2");
    let err = e.failure(a.id, &[2]).unwrap();
    assert!(matches!(err, CommError::PeerLost { peer: 2, .. }), "{err}");
    // The subgroup does not contain rank 2: it goes on.
    assert!(begin(&mut e, sub, OpKind::Barrier, 0).is_ok());
    // A collective made after the loss may still take what rank 2 sent
    // before it left; it fails once it waits on rank 2.
    let b = begin(&mut e, GroupId::WORLD, OpKind::Barrier, 0).unwrap();
    assert!(e.failure(b.id, &[1]).is_none());
    assert!(matches!(
        e.failure(b.id, &[2]),
        Some(CommError::PeerLost { peer: 2, .. })
    ));
    // Once a call failed, the group is poisoned: later calls fail at once.
    let why = e.failure(b.id, &[2]).unwrap();
    let ended = e.end(b.id, Err(why));
    assert!(ended.result.is_err());
    assert!(begin(&mut e, GroupId::WORLD, OpKind::Barrier, 0).is_err());
}

#[test]
fn an_abort_from_a_peer_fails_its_group_and_is_not_sent_back() {
    let mut e = Engine::<u32>::new(0, 2);
    let a = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 1).unwrap();
    e.aborted(
        1,
        a.fp,
        AbortInfo::Other {
            message: "boom".into(),
        },
    );
    let err = e.failure(a.id, &[1]).unwrap();
    assert!(err.to_string().contains("boom"), "{err}");
    assert!(e.end(a.id, Err(err)).abort.is_none());
}

#[test]
fn a_leaving_rank_repeats_each_failed_groups_first_cause_to_its_members() {
    // Rank 0 of 3, with nothing failed: nothing to say. Then rank 1's abort
    // fails its world call: rank 0 repeats what rank 1 said to ranks 1 and 2.
    let mut e = Engine::<u32>::new(0, 3);
    assert!(e.parting_aborts().is_empty());
    let a = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 1).unwrap();
    let said = AbortInfo::Other {
        message: "boom".into(),
    };
    e.aborted(1, a.fp, said.clone());
    let err = e.failure(a.id, &[1, 2]).unwrap();
    assert!(e.end(a.id, Err(err)).abort.is_none());
    let parting = e.parting_aborts();
    assert_eq!(parting, vec![(said, a.fp, vec![1, 2])]);
    // A failure of this rank's own is said as its own abort would be.
    let mut e = Engine::<u32>::new(0, 2);
    let b = begin(&mut e, GroupId::WORLD, OpKind::Barrier, 0).unwrap();
    let own = CommError::Timeout {
        ctx: ErrorContext::default(),
        after: Duration::from_secs(1),
        waiting_on: vec![1],
    };
    let sent = e.end(b.id, Err(own)).abort.unwrap();
    assert_eq!(e.parting_aborts(), vec![sent]);
}

#[test]
fn stall_probes_find_a_peer_in_another_call_at_the_same_place() {
    let mut e = Engine::<u32>::new(0, 2);
    let a = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 1).unwrap();
    assert_eq!(e.probe_answer(GroupId::WORLD, 0), Some(a.fp));
    assert_eq!(e.probe_answer(GroupId::WORLD, 1), None);
    e.probe_reply(1, fp(GroupId::WORLD, 0, OpKind::Broadcast, 1));
    let err = e.failure(a.id, &[1]).unwrap();
    assert!(matches!(err, CommError::Mismatch { .. }), "{err}");
}

#[test]
fn point_to_point_frames_match_in_order_by_peer_and_tag() {
    let mut e = Engine::<u32>::new(0, 2);
    let r = begin(&mut e, GroupId::WORLD, OpKind::Recv, 1).unwrap();
    e.file(1, fp(GroupId::WORLD, 0, OpKind::Send, 1), 5, 1);
    e.file(1, fp(GroupId::WORLD, 0, OpKind::Send, 1), 5, 2);
    assert!(e.has_p2p(r.id, 1, 5));
    assert_eq!(e.take(r.id, 1, 5).unwrap().unwrap(), 1);
    assert_eq!(e.take(r.id, 1, 5).unwrap().unwrap(), 2);
    assert!(e.take(r.id, 1, 5).is_none());
    assert!(e.take(r.id, 1, 6).is_none());
}

#[test]
fn group_ids_agree_across_ranks_and_never_collide() {
    let mut a = Engine::<u32>::new(0, 4);
    let mut b = Engine::<u32>::new(3, 4);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..50 {
        let (x, y) = (
            a.next_group_id(GroupId::WORLD).unwrap(),
            b.next_group_id(GroupId::WORLD).unwrap(),
        );
        assert_eq!(x, y);
        assert_ne!(x, GroupId::WORLD);
        assert!(seen.insert(x));
    }
}

#[test]
fn a_stalled_call_probes_its_group_once_per_stall_then_times_out() {
    use std::time::Instant;
    let t0 = Instant::now();
    let s = |ms| t0 + Duration::from_millis(ms);
    let mut e = Engine::<u32>::new(1, 4);
    let a = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 4).unwrap();
    assert_eq!(e.poll_timeout(), None, "not armed yet");
    e.arm(
        a.id,
        t0,
        Duration::from_millis(100),
        Some(Duration::from_millis(10)),
    );
    e.progressed(a.id, t0, &[3]);
    assert_eq!(e.poll_timeout(), Some(s(10)));
    assert_eq!(e.handle_timeout(s(9)), (vec![], false));
    // Due: every other member, the one it waits on first.
    let (probes, expired) = e.handle_timeout(s(10));
    let to: Vec<_> = probes.iter().map(|p| p.to).collect();
    assert_eq!((to, expired), (vec![3, 0, 2], false));
    assert!(probes.iter().all(|p| p.fp == a.fp));
    // Once per stall: the next wake is the deadline, then progress re-arms.
    assert_eq!(e.poll_timeout(), Some(s(100)));
    e.progressed(a.id, s(50), &[0]);
    assert_eq!(e.poll_timeout(), Some(s(60)));
    assert_eq!(e.handle_timeout(s(60)).0.len(), 3);
    assert!(e.failure(a.id, &[0]).is_none());
    let (_, expired) = e.handle_timeout(s(100));
    assert!(expired);
    assert_eq!(e.poll_timeout(), None, "an expired call needs no wake");
    let err = e.failure(a.id, &[0]).unwrap();
    let CommError::Timeout {
        after, waiting_on, ..
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(
        (*after, waiting_on.as_slice()),
        (Duration::from_millis(100), &[0][..])
    );
    // A probe answer that differs explains the wait better than the clock.
    e.probe_reply(0, fp(GroupId::WORLD, 0, OpKind::Broadcast, 4));
    let err = e.failure(a.id, &[0]).unwrap();
    assert!(
        matches!(err, CommError::Mismatch { remote_rank: 0, .. }),
        "{err}"
    );
}

#[test]
fn without_a_stall_period_the_probe_comes_at_the_deadline_and_p2p_never_probes() {
    use std::time::Instant;
    let t0 = Instant::now();
    let mut e = Engine::<u32>::new(0, 2);
    let a = begin(&mut e, GroupId::WORLD, OpKind::Barrier, 0).unwrap();
    let r = begin(&mut e, GroupId::WORLD, OpKind::Recv, 1).unwrap();
    e.arm(a.id, t0, Duration::from_secs(1), None);
    e.arm(r.id, t0, Duration::from_secs(2), Some(Duration::ZERO));
    let end = t0 + Duration::from_secs(2);
    let (probes, expired) = e.handle_timeout(end);
    assert_eq!(probes, vec![Probe { to: 1, fp: a.fp }]);
    assert!(expired);
    assert!(matches!(
        e.failure(r.id, &[1]),
        Some(CommError::Timeout { .. })
    ));
    // A deadline far past Instant's range is clamped, never a panic.
    let b = begin(&mut e, GroupId::WORLD, OpKind::Barrier, 0).unwrap();
    e.arm(b.id, t0, Duration::MAX, None);
    assert!(e.deadline(b.id).unwrap() > end);
    assert!(matches!(e.timed_out(b.id, &[1]), CommError::Timeout { .. }));
}

#[test]
fn a_mismatch_heard_from_the_odd_rank_and_relayed_names_the_odd_call_on_every_rank() {
    // Ranks 0 and 1 call all_reduce of 4; rank 2 of 5. Rank 2 finds rank
    // 0's frame odd (to rank 2) and aborts, naming rank 0's call.
    let mut odd = Engine::<u32>::new(2, 3);
    let o = begin(&mut odd, GroupId::WORLD, OpKind::AllReduce, 5).unwrap();
    let normal = fp(GroupId::WORLD, 0, OpKind::AllReduce, 4);
    odd.file(0, normal, 0, 1);
    let err = odd.take(o.id, 0, 0).unwrap().unwrap_err();
    let (said, said_fp, _) = odd.end(o.id, Err(err)).abort.unwrap();
    assert_eq!(said_fp, o.fp);
    // Rank 0 hears it: the other side is rank 2's call, not its own.
    let mut r0 = Engine::<u32>::new(0, 3);
    let a = begin(&mut r0, GroupId::WORLD, OpKind::AllReduce, 4).unwrap();
    r0.aborted(2, said_fp, said);
    let err = r0.failure(a.id, &[1, 2]).unwrap();
    let CommError::Mismatch {
        local,
        remote,
        remote_rank,
        ..
    } = err.clone()
    else {
        panic!("{err}")
    };
    assert_eq!((local, remote, remote_rank), (a.fp, o.fp, 2));
    r0.end(a.id, Err(err));
    // Rank 0 leaves and relays it to rank 1 under its own fingerprint:
    // rank 1 must still hear that rank 2's call is the odd one.
    let (relayed, relay_fp, to) = r0.parting_aborts().pop().unwrap();
    assert_eq!((relay_fp, to), (a.fp, vec![1, 2]));
    let mut r1 = Engine::<u32>::new(1, 3);
    let b = begin(&mut r1, GroupId::WORLD, OpKind::AllReduce, 4).unwrap();
    r1.aborted(0, relay_fp, relayed);
    let err = r1.failure(b.id, &[0]).unwrap();
    assert!(
        matches!(err, CommError::Mismatch { remote, remote_rank: 2, .. } if remote == o.fp),
        "{err}"
    );
}

#[test]
fn a_parting_abort_names_the_call_that_failed_not_a_later_one() {
    // Two calls in flight (DDP buckets); the first meets a mismatch.
    let mut e = Engine::<u32>::new(0, 2);
    let a = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 4).unwrap();
    let b = begin(&mut e, GroupId::WORLD, OpKind::AllReduce, 8).unwrap();
    e.file(1, fp(GroupId::WORLD, 0, OpKind::Broadcast, 4), 0, 1);
    let err = e.take(a.id, 1, 0).unwrap().unwrap_err();
    e.end(a.id, Err(err));
    let later = e.failure(b.id, &[1]).unwrap();
    e.end(b.id, Err(later));
    let (said, fp, _) = e.parting_aborts().pop().unwrap();
    assert_eq!(
        fp, a.fp,
        "the parting abort names seq {} instead of 0",
        fp.seq
    );
    assert!(
        matches!(said, AbortInfo::Mismatch { remote, .. } if remote.op == OpKind::Broadcast),
        "{said:?}"
    );
}
