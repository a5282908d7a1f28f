//! Programs kept for reuse. A program is immutable and depends only on its
//! call's spec, the algorithm and the tunables, and a training loop makes
//! the same few calls over and over: building each afresh (its action
//! lists, their allocations and frees) was a tenth of a small call's host
//! time. A [`ProgramCache`] belongs to one driver, whose tunables it holds.

use std::sync::Arc;

use super::{AlgoConfig, Algorithm, CallSpec, Program, Schedule, build};
use crate::{OpKind, Result};

/// Programs a cache holds: enough for the distinct calls of a training
/// step (DDP's bucket sizes, the loss, a barrier) without a long scan.
const SLOTS: usize = 16;

/// Everything a cached program depends on besides the tunables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    op: OpKind,
    algo: Algorithm,
    rank: usize,
    world: usize,
    count: usize,
    elem_size: usize,
    root: usize,
}

/// A cached program and whether its sources stay put until taken.
#[derive(Debug)]
struct Slot {
    key: Key,
    program: Arc<dyn Program>,
    sources_stay: bool,
}

/// The last 16 distinct collective programs one driver built; a hit
/// is a schedule over the shared program, as [`build`] would make it.
#[derive(Debug)]
pub struct ProgramCache {
    cfg: AlgoConfig,
    slots: Vec<Slot>,
    /// The slot the next miss replaces once all are used.
    next: usize,
}

impl ProgramCache {
    /// An empty cache for a driver with tunables `cfg`.
    pub fn new(cfg: AlgoConfig) -> Self {
        ProgramCache {
            cfg,
            slots: Vec::with_capacity(SLOTS),
            next: 0,
        }
    }

    /// The tunables the programs are built with.
    pub fn config(&self) -> &AlgoConfig {
        &self.cfg
    }

    /// The schedule of `spec` with `algo`: [`build`]'s, over a program
    /// built once. Point-to-point calls (their tags vary) and all_to_all
    /// (its splits) are built afresh each time.
    pub fn schedule(&mut self, spec: &CallSpec<'_>, algo: Algorithm) -> Result<Schedule> {
        let cacheable = !matches!(spec.op, OpKind::Send | OpKind::Recv | OpKind::AllToAll);
        if !cacheable {
            return build(spec, algo, &self.cfg);
        }
        let key = Key {
            op: spec.op,
            algo,
            rank: spec.rank,
            world: spec.world,
            count: spec.count,
            elem_size: spec.elem_size,
            root: spec.root,
        };
        if let Some(s) = self.slots.iter().find(|s| s.key == key) {
            return Ok(Schedule::shared(spec.op, s.program.clone(), s.sources_stay));
        }
        let built = build(spec, algo, &self.cfg)?;
        let slot = Slot {
            key,
            program: built.program().clone(),
            sources_stay: built.sources_stay(),
        };
        if self.slots.len() < SLOTS {
            self.slots.push(slot);
        } else {
            self.slots[self.next] = slot;
            self.next = (self.next + 1) % SLOTS;
        }
        Ok(built)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::Action;

    fn spec(op: OpKind, rank: usize, world: usize, count: usize) -> CallSpec<'static> {
        crate::algo::tests::spec(op, rank, world, count, 0, &[])
    }

    /// The actions a schedule asks for before any receive arrives.
    fn first_actions(mut s: Schedule) -> Vec<String> {
        std::iter::from_fn(|| s.poll())
            .map(|a| format!("{a:?}"))
            .collect()
    }

    #[test]
    fn a_hit_shares_the_program_and_runs_as_a_fresh_build() {
        let cfg = AlgoConfig::default();
        let mut c = ProgramCache::new(cfg.clone());
        for algo in [
            Algorithm::Ring,
            Algorithm::RecursiveDoubling,
            Algorithm::Direct,
        ] {
            let sp = spec(OpKind::AllReduce, 1, 4, 1000);
            let a = c.schedule(&sp, algo).unwrap();
            let b = c.schedule(&sp, algo).unwrap();
            assert!(Arc::ptr_eq(a.program(), b.program()), "{algo}");
            let fresh = build(&sp, algo, &cfg).unwrap();
            assert_eq!(b.sources_stay(), fresh.sources_stay(), "{algo}");
            assert_eq!(first_actions(b), first_actions(fresh), "{algo}");
        }
    }

    /// Every action a schedule asks for, receives answered in the order
    /// posted, to the end.
    fn run_to_end(mut s: Schedule) -> Vec<String> {
        let mut out = Vec::new();
        let mut pending = std::collections::VecDeque::new();
        for _ in 0..100_000 {
            while let Some(a) = s.poll() {
                if let Action::Receive(r) = &a {
                    pending.push_back((r.from, r.tag));
                }
                out.push(format!("{a:?}"));
            }
            match pending.pop_front() {
                Some((from, tag)) => s.handle_recv(from, tag).unwrap(),
                None => break,
            }
        }
        assert!(s.is_done(), "the schedule did not finish");
        out
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

        /// The second and later calls of a shape run the very actions a
        /// fresh build does, for every collective, world and count the
        /// selection policy meets (lengths 0, 1 and ones the world does not
        /// divide among them).
        #[test]
        fn a_cached_program_runs_as_a_fresh_build(
            op in proptest::sample::select(vec![
                OpKind::AllReduce, OpKind::Broadcast, OpKind::Reduce, OpKind::AllGather,
                OpKind::ReduceScatter, OpKind::Gather, OpKind::Scatter, OpKind::Barrier,
            ]),
            world in 1usize..9,
            rank_seed in 0usize..64,
            root_seed in 0usize..64,
            count in proptest::prop_oneof![0usize..3, 3usize..5000, 1usize << 18..1usize << 20],
        ) {
            let cfg = AlgoConfig::default();
            let mut c = ProgramCache::new(cfg.clone());
            let sp = CallSpec {
                root: root_seed % world,
                ..spec(op, rank_seed % world, world, count)
            };
            let algo = cfg.select(op, sp.bytes(), world);
            let fresh = run_to_end(build(&sp, algo, &cfg).unwrap());
            let first = c.schedule(&sp, algo).unwrap();
            proptest::prop_assert_eq!(run_to_end(first), fresh.clone());
            let hit = c.schedule(&sp, algo).unwrap();
            proptest::prop_assert_eq!(run_to_end(hit), fresh);
        }
    }

    #[test]
    fn another_rank_count_or_world_is_another_program() {
        let mut c = ProgramCache::new(AlgoConfig::default());
        let a = c.schedule(&spec(OpKind::AllReduce, 1, 4, 1000), Algorithm::Ring);
        let b = c.schedule(&spec(OpKind::AllReduce, 1, 4, 1001), Algorithm::Ring);
        let d = c.schedule(&spec(OpKind::AllReduce, 2, 4, 1000), Algorithm::Ring);
        let e = c.schedule(&spec(OpKind::AllReduce, 1, 5, 1000), Algorithm::Ring);
        let (a, b, d, e) = (a.unwrap(), b.unwrap(), d.unwrap(), e.unwrap());
        for other in [&b, &d, &e] {
            assert!(!Arc::ptr_eq(a.program(), other.program()));
        }
    }

    #[test]
    fn point_to_point_is_never_cached_and_old_programs_are_replaced() {
        let mut c = ProgramCache::new(AlgoConfig::default());
        let send = spec(OpKind::Send, 0, 2, 8);
        c.schedule(&send, Algorithm::Direct).unwrap();
        assert!(c.slots.is_empty());
        for n in 0..SLOTS + 3 {
            c.schedule(&spec(OpKind::AllReduce, 0, 2, n + 1), Algorithm::Ring)
                .unwrap();
        }
        assert_eq!(c.slots.len(), SLOTS);
        assert!(
            c.slots.iter().all(|s| s.key.count > 3),
            "the oldest went first"
        );
    }

    #[test]
    fn an_algorithm_that_does_not_fit_the_op_is_refused_and_not_kept() {
        let mut c = ProgramCache::new(AlgoConfig::default());
        let err = c.schedule(
            &spec(OpKind::Broadcast, 0, 4, 8),
            Algorithm::RecursiveDoubling,
        );
        assert!(err.is_err());
        assert!(c.slots.is_empty());
    }
}
