//! Structural properties of every schedule, without moving data: each
//! transmit has exactly one matching receive of the same length, and a
//! world of schedules runs to completion (no deadlock) when messages are
//! delivered in any order. Data correctness is the conformance suite's job.

use std::collections::{HashMap, VecDeque};

use proptest::prelude::*;

use super::*;

/// A call of 4-byte elements (also the cache's tests').
pub(super) fn spec(
    op: OpKind,
    rank: usize,
    world: usize,
    count: usize,
    root: usize,
    splits: &[Vec<usize>],
) -> CallSpec<'_> {
    CallSpec {
        op,
        rank,
        world,
        count,
        elem_size: 4,
        root,
        tag: 0,
        input_splits: splits.get(rank).map_or(&[][..], |v| v.as_slice()),
        output_splits: &[],
    }
}

/// Runs a world of schedules, delivering in an order picked by `pick`
/// among the messages in flight. Returns the number of messages.
fn run_world(mut scheds: Vec<Schedule>, mut pick: impl FnMut(usize) -> usize) -> usize {
    let n = scheds.len();
    // (to, from, tag) -> lengths in flight
    let mut wire: HashMap<(usize, usize, u32), VecDeque<usize>> = HashMap::new();
    let mut posted: Vec<HashMap<(usize, u32), usize>> = vec![HashMap::new(); n];
    let mut in_flight: Vec<(usize, usize, u32)> = Vec::new();
    let mut messages = 0;
    loop {
        for (r, s) in scheds.iter_mut().enumerate() {
            while let Some(a) = s.poll() {
                match a {
                    Action::Transmit(t) => {
                        assert_ne!(t.to, r, "rank {r} transmits to itself");
                        assert!(t.to < n);
                        wire.entry((t.to, r, t.tag))
                            .or_default()
                            .push_back(t.range.len());
                        in_flight.push((t.to, r, t.tag));
                        messages += 1;
                    }
                    Action::Receive(rv) => {
                        posted[r].insert((rv.from, rv.tag), rv.range.len());
                    }
                    Action::Copy(c) => assert_eq!(c.src.len(), c.dst.len()),
                }
            }
        }
        if in_flight.is_empty() {
            break;
        }
        // Deliver one message whose receive is posted, chosen by `pick`.
        let ready: Vec<usize> = (0..in_flight.len())
            .filter(|&i| {
                let (to, from, tag) = in_flight[i];
                posted[to].contains_key(&(from, tag))
            })
            .collect();
        assert!(
            !ready.is_empty(),
            "deadlock: messages in flight, none expected: {in_flight:?}"
        );
        let i = ready[pick(ready.len()) % ready.len()];
        let (to, from, tag) = in_flight.swap_remove(i);
        let len = wire.get_mut(&(to, from, tag)).unwrap().pop_front().unwrap();
        let want = posted[to].remove(&(from, tag)).unwrap();
        assert_eq!(
            len, want,
            "rank {from} sent {len} elements to rank {to} (tag {tag}), which expects {want}"
        );
        scheds[to].handle_recv(from, tag).unwrap();
    }
    for (r, s) in scheds.iter().enumerate() {
        assert!(
            s.is_done(),
            "rank {r} did not finish; waiting on {:?}",
            s.waiting_on()
        );
    }
    messages
}

fn world_of(
    op: OpKind,
    algo: Algorithm,
    n: usize,
    count: usize,
    root: usize,
    cfg: &AlgoConfig,
) -> Vec<Schedule> {
    let splits: Vec<Vec<usize>> = (0..n)
        .map(|r| (0..n).map(|q| (r + 2 * q + count) % 3).collect())
        .collect();
    (0..n)
        .map(|r| {
            let mut s = spec(op, r, n, count, root, &splits);
            let out: Vec<usize> = (0..n).map(|q| splits[q][r]).collect();
            s.output_splits = Box::leak(out.into_boxed_slice());
            build(&s, algo, cfg).unwrap()
        })
        .collect()
}

fn collective_algos() -> Vec<(OpKind, Algorithm)> {
    Algorithm::ALL
        .into_iter()
        .flat_map(|a| a.ops().iter().map(move |o| (*o, a)))
        .filter(|(o, _)| !matches!(o, OpKind::Send | OpKind::Recv))
        .collect()
}

proptest! {
    #[test]
    fn every_schedule_completes_in_any_delivery_order(
        world in 1usize..=17,
        count in prop_oneof![Just(0usize), Just(1), 0usize..200],
        root_seed in any::<usize>(),
        order_seed in any::<u64>(),
        small_segments in any::<bool>(),
        oversubscribed in any::<bool>(),
    ) {
        let mut cfg = AlgoConfig { oversubscribed, ..AlgoConfig::default() };
        if small_segments {
            cfg.segment_bytes = 8; // two f32 per segment: many lanes
        }
        let mut rng = order_seed | 1;
        for (op, algo) in collective_algos() {
            let root = root_seed % world;
            let scheds = world_of(op, algo, world, count, root, &cfg);
            run_world(scheds, |k| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng % k as u64) as usize
            });
        }
    }
}

/// A transmission not taken yet: the `(to, tag)` that takes it, and what
/// it sent.
type Untaken = ((usize, u32), (Buf, Range<usize>));

/// Whether two element ranges of one buffer share an element.
fn overlap(a: &(Buf, Range<usize>), b: &(Buf, Range<usize>)) -> bool {
    a.0 == b.0 && a.1.start < b.1.end && b.1.start < a.1.end
}

proptest! {
    /// No schedule writes, by a receive or a copy, a range it transmitted
    /// before the receiver has taken that transmission, in any delivery
    /// order: so a receiver may read a transmitted range from the sender's
    /// memory when it takes the message (single-copy transfers) instead of
    /// the sender capturing the bytes at once.
    #[test]
    fn no_schedule_writes_a_sent_range_before_its_receiver_took_it(
        n in 1usize..9,
        count in 0usize..300,
        root_pick in 0usize..8,
        seg in prop::sample::select(vec![4usize, 64, 1 << 20]),
        seed in any::<u64>(),
        oversubscribed in any::<bool>(),
    ) {
        let cfg = AlgoConfig {
            segment_bytes: seg,
            window: 3,
            overrides: Vec::new(),
            oversubscribed,
            shared_stage: false,
        };
        for (op, algo) in collective_algos() {
            let mut scheds = world_of(op, algo, n, count, root_pick % n, &cfg);
            if !scheds[0].sources_stay() {
                continue;
            }
            // Per rank: what it sent that its receiver has not taken yet,
            // with the (to, tag) that takes it.
            let mut untaken: Vec<Vec<Untaken>> = vec![Vec::new(); n];
            let mut rng = seed;
            let mut in_flight: Vec<(usize, usize, u32)> = Vec::new();
            let mut posted: Vec<std::collections::HashSet<(usize, u32)>> =
                vec![Default::default(); n];
            loop {
                for (r, s) in scheds.iter_mut().enumerate() {
                    while let Some(a) = s.poll() {
                        let written = match a {
                            Action::Transmit(t) => {
                                untaken[r].push(((t.to, t.tag), (t.buf, t.range.clone())));
                                in_flight.push((t.to, r, t.tag));
                                None
                            }
                            Action::Receive(rv) => {
                                // Written when the message comes (below).
                                posted[r].insert((rv.from, rv.tag));
                                None
                            }
                            Action::Copy(c) => Some((c.dst_buf, c.dst)),
                        };
                        if let Some(w) = written {
                            prop_assert!(
                                !untaken[r].iter().any(|(_, x)| overlap(x, &w)),
                                "{op:?}/{algo:?}: rank {r} copies into {w:?}, which it sent and is not taken yet"
                            );
                        }
                    }
                }
                let ready: Vec<usize> = (0..in_flight.len())
                    .filter(|&i| posted[in_flight[i].0].contains(&(in_flight[i].1, in_flight[i].2)))
                    .collect();
                if ready.is_empty() {
                    break;
                }
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let (to, from, tag) = in_flight.swap_remove(ready[(rng >> 33) as usize % ready.len()]);
                posted[to].remove(&(from, tag));
                let i = untaken[from].iter().position(|(k, _)| *k == (to, tag)).unwrap();
                untaken[from].remove(i);
                let w = scheds[to].posted_receive(from, tag).map(|rv| (rv.buf, rv.range.clone())).unwrap();
                prop_assert!(
                    !untaken[to].iter().any(|(_, x)| overlap(x, &w)),
                    "{op:?}/{algo:?}: rank {to} receives into {w:?}, which it sent and is not taken yet"
                );
                scheds[to].handle_recv(from, tag).unwrap();
            }
            prop_assert!(scheds.iter().all(Schedule::is_done), "{op:?}/{algo:?} stalled");
        }
    }
}

#[test]
fn recursive_doubling_reduces_into_what_its_partner_has_not_taken() {
    // The rule is not vacuous: both partners send the whole vector, and one
    // may reduce the other's into it before the other has taken its own.
    let mut s = world_of(
        OpKind::AllReduce,
        Algorithm::RecursiveDoubling,
        2,
        8,
        0,
        &AlgoConfig::default(),
    );
    assert!(!s[0].sources_stay());
    let mut sent = Vec::new();
    let mut posted = None;
    while let Some(a) = s[0].poll() {
        match a {
            Action::Transmit(t) => sent.push((t.buf, t.range)),
            Action::Receive(rv) => posted = Some((rv.buf, rv.range)),
            Action::Copy(_) => {}
        }
    }
    // Rank 0 has sent its vector and posted a receive into it; nothing
    // orders rank 1's message after rank 1 has taken rank 0's.
    let posted = posted.expect("a receive");
    assert!(sent.iter().any(|x| overlap(x, &posted)));
    assert!(
        world_of(
            OpKind::AllReduce,
            Algorithm::Ring,
            2,
            8,
            0,
            &AlgoConfig::default()
        )[0]
        .sources_stay()
    );
}

#[test]
fn every_rank_receives_a_frame_in_every_collective() {
    // So that a mismatched call is seen by every rank (see Fingerprint).
    for (op, algo) in collective_algos() {
        for n in 2..=9 {
            for root in [0, n - 1] {
                for mut s in world_of(op, algo, n, 5, root, &AlgoConfig::default()) {
                    let mut receives = 0;
                    let mut stack = vec![];
                    // Walk the whole program by pretending receives complete.
                    loop {
                        match s.poll() {
                            Some(Action::Receive(r)) => {
                                receives += 1;
                                stack.push((r.from, r.tag));
                            }
                            Some(_) => {}
                            None => match stack.pop() {
                                Some((f, t)) => s.handle_recv(f, t).unwrap(),
                                None => break,
                            },
                        }
                    }
                    assert!(
                        receives > 0,
                        "{op} with {algo}, world {n}, root {root}: a rank receives nothing"
                    );
                }
            }
        }
    }
}

#[test]
fn ring_all_reduce_sends_the_bandwidth_optimal_volume() {
    let (n, count) = (5usize, 1000usize);
    let mut sent = 0usize;
    for r in 0..n {
        let mut s = build(
            &spec(OpKind::AllReduce, r, n, count, 0, &[]),
            Algorithm::Ring,
            &AlgoConfig::default(),
        )
        .unwrap();
        let mut stack = vec![];
        loop {
            match s.poll() {
                Some(Action::Transmit(t)) => sent += t.range.len(),
                Some(Action::Receive(rv)) => stack.push((rv.from, rv.tag)),
                Some(Action::Copy(_)) => {}
                None => match stack.pop() {
                    Some((f, t)) => s.handle_recv(f, t).unwrap(),
                    None => break,
                },
            }
        }
    }
    // 2(n-1)/n of the buffer per rank.
    assert_eq!(sent, 2 * (n - 1) * count);
}

#[test]
fn recursive_doubling_takes_half_the_steps_of_halving_doubling() {
    for (n, want) in [(2usize, 1usize), (4, 2), (8, 3), (16, 4)] {
        let mut s = build(
            &spec(OpKind::AllReduce, 0, n, 64, 0, &[]),
            Algorithm::RecursiveDoubling,
            &AlgoConfig::default(),
        )
        .unwrap();
        let mut transmits = 0;
        while let Some(a) = s.poll() {
            match a {
                Action::Transmit(t) => {
                    transmits += 1;
                    assert_eq!(t.range, 0..64, "the whole vector each step");
                }
                Action::Receive(rv) => s.handle_recv(rv.from, rv.tag).unwrap(),
                Action::Copy(_) => {}
            }
        }
        assert_eq!(transmits, want, "n={n}");
        assert!(s.is_done());
    }
}

#[test]
fn halving_doubling_uses_log_steps() {
    for (n, want) in [(2usize, 2usize), (4, 4), (8, 6), (16, 8)] {
        let mut s = build(
            &spec(OpKind::AllReduce, 0, n, 64, 0, &[]),
            Algorithm::HalvingDoubling,
            &AlgoConfig::default(),
        )
        .unwrap();
        let mut transmits = 0;
        let mut stack = vec![];
        loop {
            match s.poll() {
                Some(Action::Transmit(_)) => transmits += 1,
                Some(Action::Receive(rv)) => stack.push((rv.from, rv.tag)),
                Some(_) => {}
                None => match stack.pop() {
                    Some((f, t)) => s.handle_recv(f, t).unwrap(),
                    None => break,
                },
            }
        }
        assert_eq!(transmits, want, "world {n}");
    }
}

#[test]
fn segmented_ring_keeps_the_window_in_flight() {
    let cfg = AlgoConfig {
        segment_bytes: 16,
        window: 2,
        ..Default::default()
    };
    // 4 ranks x 64 f32: chunk 16 elements = 64 bytes = 4 segments.
    let mut s = build(
        &spec(OpKind::AllReduce, 0, 4, 64, 0, &[]),
        Algorithm::Ring,
        &cfg,
    )
    .unwrap();
    let mut first = Vec::new();
    while let Some(a) = s.poll() {
        first.push(a);
    }
    let transmits = first
        .iter()
        .filter(|a| matches!(a, Action::Transmit(_)))
        .count();
    let receives = first
        .iter()
        .filter(|a| matches!(a, Action::Receive(_)))
        .count();
    assert_eq!(
        (transmits, receives),
        (2, 2),
        "two segments in flight before any receive"
    );
    assert_eq!(s.waiting_on(), vec![3]);
}

#[test]
fn handle_recv_for_an_unposted_receive_is_an_error() {
    let mut s = build(
        &spec(OpKind::Barrier, 0, 4, 0, 0, &[]),
        Algorithm::Dissemination,
        &AlgoConfig::default(),
    )
    .unwrap();
    assert_eq!(
        s.handle_recv(2, 0),
        Err(ScheduleError::NotPosted { from: 2, tag: 0 })
    );
}

#[test]
fn selection_policy_and_overrides() {
    let c = AlgoConfig::default();
    assert_eq!(
        c.select(OpKind::AllReduce, 4096, 8),
        Algorithm::RecursiveDoubling
    );
    assert_eq!(
        c.select(OpKind::AllReduce, 32 << 10, 8),
        Algorithm::HalvingDoubling
    );
    assert_eq!(c.select(OpKind::AllReduce, 64 << 20, 8), Algorithm::Ring);
    assert_eq!(
        c.select(OpKind::Broadcast, 4096, 8),
        Algorithm::BinomialTree
    );
    assert_eq!(c.select(OpKind::Broadcast, 64 << 20, 8), Algorithm::Chain);
    assert_eq!(c.select(OpKind::Barrier, 0, 8), Algorithm::Dissemination);
    // A shared stage: the direct broadcast from 4 MiB up, at any world
    // (between 2 ranks too: see `select`).
    let st = AlgoConfig {
        shared_stage: true,
        ..Default::default()
    };
    assert_eq!(st.fan_out_segment_bytes(), 256 << 10);
    assert_eq!(st.select(OpKind::Broadcast, 64 << 20, 3), Algorithm::Direct);
    assert_eq!(st.select(OpKind::Broadcast, 4 << 20, 16), Algorithm::Direct);
    assert_eq!(st.select(OpKind::Broadcast, 64 << 20, 2), Algorithm::Direct);
    assert_eq!(
        st.select(OpKind::Broadcast, (4 << 20) - 4, 3),
        Algorithm::Chain
    );
    assert_eq!(
        st.select(OpKind::AllReduce, 64 << 20, 3),
        Algorithm::Ring,
        "only broadcast fans out"
    );
    // More ranks than cores: a small broadcast goes one hop from 4 ranks.
    let over = AlgoConfig {
        oversubscribed: true,
        ..Default::default()
    };
    assert_eq!(over.select(OpKind::Broadcast, 4096, 4), Algorithm::Direct);
    assert_eq!(
        over.select(OpKind::Broadcast, 4096, 3),
        Algorithm::BinomialTree
    );
    assert_eq!(
        over.select(OpKind::Broadcast, SMALL_BYTES + 4, 8),
        Algorithm::BinomialTree
    );
    assert_eq!(
        c.select(OpKind::Broadcast, 4096, 8),
        Algorithm::BinomialTree
    );
    let o = AlgoConfig {
        overrides: AlgoConfig::parse_overrides("ring").unwrap(),
        ..Default::default()
    };
    assert_eq!(o.select(OpKind::AllReduce, 8, 8), Algorithm::Ring);
    assert_eq!(
        o.select(OpKind::Broadcast, 8, 8),
        Algorithm::BinomialTree,
        "ring does not broadcast"
    );
    let o = AlgoConfig {
        overrides: AlgoConfig::parse_overrides("all_reduce=binomial_tree,broadcast=chain").unwrap(),
        ..Default::default()
    };
    assert_eq!(
        o.select(OpKind::AllReduce, 1 << 30, 8),
        Algorithm::BinomialTree
    );
    assert_eq!(o.select(OpKind::Broadcast, 1, 8), Algorithm::Chain);
    assert!(
        AlgoConfig::parse_overrides("warp_drive")
            .unwrap_err()
            .to_string()
            .contains("halving_doubling")
    );
    assert!(
        build(
            &spec(OpKind::Broadcast, 0, 2, 1, 0, &[]),
            Algorithm::Ring,
            &c
        )
        .is_err()
    );
}

#[test]
fn parts_are_balanced_and_cover() {
    for len in 0..50 {
        for parts in 1..9 {
            let mut next = 0;
            for i in 0..parts {
                let p = part(len, parts, i);
                assert_eq!(p.start, next);
                assert!(p.len() == len / parts || p.len() == len / parts + 1);
                next = p.end;
            }
            assert_eq!(next, len);
        }
    }
    assert_eq!(part(usize::MAX, 2, 1).end, usize::MAX);
}
