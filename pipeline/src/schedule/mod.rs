//! Pipeline schedules as action lists, one per pipeline rank, equal to
//! what torch's `torch.distributed.pipelining` schedules run.
//!
//! This module owns the schedule IR ([`Action`], [`Step`]), the seven
//! schedules ([`ScheduleKind`]), which stage lives on which rank
//! ([`Schedule::rank_of`]) and the rules torch applies to their
//! arguments. The runtime ([`crate::runtime`]) runs a rank's list; the
//! cost model ([`crate::cost`]) times all of them together.
//!
//! A rank's list is a timeline: `None` is a slot torch leaves empty (a
//! bubble), kept so that the lists print as torch's `pipeline_order`
//! does. Single-stage schedules (GPipe, 1F1B) have no empty slots: torch
//! runs them with imperative code, whose order of calls is what this
//! module reproduces (torch 2.15's `Schedule1F1B._get_pipeline_order`,
//! used only for display, numbers the last rank's forwards from 1; what
//! torch runs starts at 0, as here).

mod interleaved;
mod single;
mod v;

use std::fmt;

/// What one action computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// The stage's forward of one microbatch (torch's `F`).
    Forward,
    /// The whole backward of one microbatch: input and weight gradients
    /// (torch's `B`).
    FullBackward,
    /// The backward to the stage's input only (torch's `I`); the weight
    /// gradients follow in a [`Kind::BackwardWeight`].
    BackwardInput,
    /// The weight gradients of a microbatch whose input gradient was
    /// computed before (torch's `W`).
    BackwardWeight,
}

impl Kind {
    fn letter(self) -> &'static str {
        match self {
            Kind::Forward => "F",
            Kind::FullBackward => "B",
            Kind::BackwardInput => "I",
            Kind::BackwardWeight => "W",
        }
    }
}

/// One computation: a kind, on a stage, for a microbatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Action {
    /// The stage's index in the whole pipeline (0 is the first).
    pub stage: usize,
    /// What it computes.
    pub kind: Kind,
    /// The microbatch, from 0.
    pub microbatch: usize,
}

impl Action {
    /// `kind` of `microbatch` on `stage`.
    pub fn new(stage: usize, kind: Kind, microbatch: usize) -> Self {
        Action {
            stage,
            kind,
            microbatch,
        }
    }
}

impl fmt::Display for Action {
    /// torch's `str(_Action)`: `0F1` is the forward of microbatch 1 on stage 0.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.kind.letter(), self.microbatch)
    }
}

/// One slot of a rank's list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// One computation.
    Compute(Action),
    /// A forward and a full backward run together, as DualPipeV overlaps
    /// them (torch's `OVERLAP_F_B`); the runtime runs the forward first.
    Overlap(Action, Action),
    /// The stage's gradients are complete (its last backward is done): the
    /// runtime scales them and hands them to the stage's data-parallel
    /// reduction (torch's `REDUCE_GRAD`).
    ReduceGrad(usize),
}

impl Step {
    /// The computations of this step, in the order they run.
    pub fn actions(&self) -> impl Iterator<Item = Action> {
        let (a, b) = match *self {
            Step::Compute(a) => (Some(a), None),
            Step::Overlap(f, b) => (Some(f), Some(b)),
            Step::ReduceGrad(_) => (None, None),
        };
        a.into_iter().chain(b)
    }
}

impl fmt::Display for Step {
    /// As torch prints its actions: `0F1`, `(0F3;3B1)OVERLAP_F_B`,
    /// `0REDUCE_GRAD`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Compute(a) => write!(f, "{a}"),
            Step::Overlap(a, b) => write!(f, "({a};{b})OVERLAP_F_B"),
            Step::ReduceGrad(s) => write!(f, "{s}REDUCE_GRAD"),
        }
    }
}

/// torch's pipeline schedules, by the names `get_schedule_class` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (`ScheduleGPipe`); one stage per rank.
    GPipe,
    /// One forward, one backward in the steady state (`Schedule1F1B`); one
    /// stage per rank, at least as many microbatches as stages.
    OneFOneB,
    /// 1F1B over several stages per rank, depth first
    /// (`ScheduleInterleaved1F1B`).
    Interleaved1F1B,
    /// Several stages per rank, breadth first (`ScheduleLoopedBFS`).
    LoopedBfs,
    /// Interleaved 1F1B with backward split into input and weight
    /// gradients, the weights filling the bubbles
    /// (`ScheduleInterleavedZeroBubble`, the paper's ZB1P).
    InterleavedZeroBubble,
    /// Zero bubble on a V: two stages per rank, rank r holding stages r and
    /// 2p-1-r (`ScheduleZBVZeroBubble`).
    ZbvZeroBubble,
    /// DeepSeek's DualPipe on a V, forwards and backwards overlapped
    /// (`ScheduleDualPipeV`); two stages per rank, at least as many
    /// microbatches as stages.
    DualPipeV,
}

impl ScheduleKind {
    /// Every schedule, in torch's order of introduction.
    pub const ALL: [ScheduleKind; 7] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::LoopedBfs,
        ScheduleKind::InterleavedZeroBubble,
        ScheduleKind::ZbvZeroBubble,
        ScheduleKind::DualPipeV,
    ];

    /// torch's name (`get_schedule_class` accepts it).
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "GPipe",
            ScheduleKind::OneFOneB => "1F1B",
            ScheduleKind::Interleaved1F1B => "Interleaved1F1B",
            ScheduleKind::LoopedBfs => "LoopedBFS",
            ScheduleKind::InterleavedZeroBubble => "InterleavedZeroBubble",
            ScheduleKind::ZbvZeroBubble => "ZBVZeroBubble",
            ScheduleKind::DualPipeV => "DualPipeV",
        }
    }

    /// Whether it runs one stage per rank (torch's `PipelineScheduleSingle`).
    pub fn single_stage(self) -> bool {
        matches!(self, ScheduleKind::GPipe | ScheduleKind::OneFOneB)
    }

    /// Whether stages sit on ranks in a V (rank r: stages r and 2p-1-r)
    /// rather than in a loop (stage s on rank s mod p).
    pub fn v_shaped(self) -> bool {
        matches!(self, ScheduleKind::ZbvZeroBubble | ScheduleKind::DualPipeV)
    }

    /// Whether its backward is split into input and weight gradients.
    pub fn splits_backward(self) -> bool {
        matches!(
            self,
            ScheduleKind::InterleavedZeroBubble
                | ScheduleKind::ZbvZeroBubble
                | ScheduleKind::DualPipeV
        )
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = String;
    /// torch's names, case-insensitively (`get_schedule_class`'s rule).
    fn from_str(s: &str) -> Result<Self, String> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<&str> = ScheduleKind::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown pipeline schedule {s:?}; one of {}",
                    names.join(", ")
                )
            })
    }
}

/// A schedule's arguments torch would refuse, said as torch says them,
/// with what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{schedule} with {pp} pipeline ranks, {microbatches} microbatches and {stages_per_rank} stages per rank: {reason}"
)]
pub struct ScheduleError {
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Pipeline ranks.
    pub pp: usize,
    /// Microbatches.
    pub microbatches: usize,
    /// Stages per rank.
    pub stages_per_rank: usize,
    /// What is wrong and what to do.
    pub reason: String,
}

/// A schedule laid out for every pipeline rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    kind: ScheduleKind,
    pp: usize,
    microbatches: usize,
    stages_per_rank: usize,
    orders: Vec<Vec<Option<Step>>>,
}

/// Above this many actions in all (stages times microbatches times 3) a
/// schedule is refused rather than built: its lists would not fit.
const MAX_ACTIONS: usize = 1 << 24;

impl Schedule {
    /// Lays `kind` out for `pp` pipeline ranks, `microbatches` microbatches
    /// and `stages_per_rank` stages on each rank (`pp * stages_per_rank`
    /// stages in all), refusing what torch refuses.
    pub fn new(
        kind: ScheduleKind,
        pp: usize,
        microbatches: usize,
        stages_per_rank: usize,
    ) -> Result<Schedule, ScheduleError> {
        let err = |reason: String| ScheduleError {
            schedule: kind,
            pp,
            microbatches,
            stages_per_rank,
            reason,
        };
        check(kind, pp, microbatches, stages_per_rank).map_err(err)?;
        let orders = match kind {
            ScheduleKind::GPipe => single::gpipe(pp, microbatches),
            ScheduleKind::OneFOneB => single::one_f_one_b(pp, microbatches),
            ScheduleKind::LoopedBfs => interleaved::looped_bfs(pp, microbatches, stages_per_rank),
            ScheduleKind::Interleaved1F1B => {
                interleaved::interleaved(pp, microbatches, stages_per_rank, false).map_err(err)?
            }
            ScheduleKind::InterleavedZeroBubble => {
                interleaved::interleaved(pp, microbatches, stages_per_rank, true).map_err(err)?
            }
            ScheduleKind::ZbvZeroBubble => v::zbv(pp, microbatches),
            ScheduleKind::DualPipeV => v::dualpipe_v(pp, microbatches),
        };
        Ok(Schedule {
            kind,
            pp,
            microbatches,
            stages_per_rank,
            orders,
        })
    }

    /// The schedule.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// Pipeline ranks.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// Microbatches per step.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// Stages in the whole pipeline.
    pub fn num_stages(&self) -> usize {
        self.pp * self.stages_per_rank
    }

    /// Stages on each rank.
    pub fn stages_per_rank(&self) -> usize {
        self.stages_per_rank
    }

    /// The pipeline rank that holds `stage`: `stage % pp` in a loop, and on
    /// a V rank r holds stages r and 2p-1-r.
    pub fn rank_of(&self, stage: usize) -> usize {
        if self.kind.v_shaped() && stage >= self.pp {
            2 * self.pp - 1 - stage
        } else {
            stage % self.pp
        }
    }

    /// The stages `rank` holds, in increasing order.
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        (0..self.num_stages())
            .filter(|&s| self.rank_of(s) == rank)
            .collect()
    }

    /// `rank`'s list as torch's `pipeline_order[rank]` has it (empty slots
    /// included, no gradient reductions).
    pub fn order(&self, rank: usize) -> &[Option<Step>] {
        &self.orders[rank]
    }

    /// What `rank` runs: its steps without empty slots, each stage's
    /// [`Step::ReduceGrad`] right after its last backward or weight
    /// action (torch's `_add_reduce_grad`).
    pub fn steps(&self, rank: usize) -> Vec<Step> {
        let mut done = vec![0usize; self.num_stages()];
        let mut out = Vec::new();
        for step in self.orders[rank].iter().flatten() {
            out.push(*step);
            for a in step.actions() {
                let grads = match a.kind {
                    Kind::FullBackward | Kind::BackwardWeight => true,
                    Kind::Forward | Kind::BackwardInput => false,
                };
                if grads {
                    done[a.stage] += 1;
                    if done[a.stage] == self.microbatches {
                        out.push(Step::ReduceGrad(a.stage));
                    }
                }
            }
        }
        out
    }
}

/// torch's checks of a schedule's arguments.
fn check(kind: ScheduleKind, pp: usize, m: usize, spr: usize) -> Result<(), String> {
    if pp == 0 || m == 0 || spr == 0 {
        return Err(
            "pipeline ranks, microbatches and stages per rank must each be at least 1".into(),
        );
    }
    if pp.saturating_mul(spr).saturating_mul(m).saturating_mul(3) > MAX_ACTIONS {
        return Err(format!(
            "more than {MAX_ACTIONS} actions in all; use fewer stages or microbatches"
        ));
    }
    if kind.single_stage() && spr != 1 {
        return Err(format!(
            "{kind} runs one stage per rank; use Interleaved1F1B (or another multi-stage schedule) for {spr}"
        ));
    }
    if kind.v_shaped() && spr != 2 {
        return Err(format!("{kind} requires exactly 2 stages per rank"));
    }
    let stages = pp * spr;
    match kind {
        ScheduleKind::OneFOneB if m < stages => Err(format!(
            "1F1B needs at least as many microbatches as stages ({stages}); use more microbatches, or GPipe"
        )),
        ScheduleKind::DualPipeV if m < stages => Err(format!(
            "DualPipeV needs at least as many microbatches as stages ({stages})"
        )),
        ScheduleKind::Interleaved1F1B | ScheduleKind::InterleavedZeroBubble => {
            let rounds = (m / pp).max(1);
            if !m.is_multiple_of(rounds) {
                return Err(format!(
                    "the number of microbatches must be a multiple of the number of rounds \
                     ({rounds} = max(1, microbatches / pipeline ranks))"
                ));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
