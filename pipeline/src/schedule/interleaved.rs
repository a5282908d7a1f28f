//! The looped multi-stage schedules: rank r holds stages r, r+p, r+2p...
//! LoopedBFS, Interleaved1F1B and InterleavedZeroBubble, as torch's
//! `_calculate_single_rank_operations`, `_get_1f1b_rank_ops`,
//! `_get_warmup_ops` and `_add_bubbles_to_actions` lay them out.

use std::collections::{HashMap, HashSet};

use super::{Action, Kind, Step};

fn act(stage: usize, kind: Kind, mb: usize) -> Option<Step> {
    Some(Step::Compute(Action::new(stage, kind, mb)))
}

/// `ScheduleLoopedBFS`: each local stage's forwards in turn, then each
/// local stage's backwards, last stage and last microbatch first.
pub(super) fn looped_bfs(pp: usize, m: usize, spr: usize) -> Vec<Vec<Option<Step>>> {
    (0..pp)
        .map(|r| {
            let stages: Vec<usize> = (0..spr).map(|l| r + l * pp).collect();
            let mut ops = vec![None; r];
            for &s in &stages {
                ops.extend((0..m).map(|i| act(s, Kind::Forward, i)));
            }
            ops.extend(std::iter::repeat_n(None, 2 * (pp - 1 - r)));
            for &s in stages.iter().rev() {
                ops.extend((0..m).rev().map(|i| act(s, Kind::FullBackward, i)));
            }
            ops
        })
        .collect()
}

/// The shape of one rank's interleaved list.
struct Plan {
    pp: usize,
    spr: usize,
    rank: usize,
    per_round: usize,
    warmup: usize,
    total: usize,
}

impl Plan {
    fn new(pp: usize, m: usize, spr: usize, rank: usize, factor: usize) -> Plan {
        let rounds = (m / pp).max(1);
        let per_round = m / rounds;
        let warmup = ((spr - 1) * per_round + factor * (pp - 1 - rank)).min(m * spr);
        Plan {
            pp,
            spr,
            rank,
            per_round,
            warmup,
            total: m * spr,
        }
    }

    fn forward_stage(&self, op: usize) -> usize {
        (op / self.per_round) % self.spr * self.pp + self.rank
    }

    fn backward_stage(&self, op: usize) -> usize {
        let local = self.spr - 1 - ((op - self.warmup) / self.per_round) % self.spr;
        local * self.pp + self.rank
    }
}

/// Next microbatch of a stage, counted per stage.
fn next(counts: &mut HashMap<usize, usize>, stage: usize) -> usize {
    let c = counts.entry(stage).or_insert(0);
    *c += 1;
    *c - 1
}

/// `_get_1f1b_rank_ops`: warmup forwards, then a forward and a backward
/// (input only with zero bubble, the weights following `rank` steps
/// behind), then the remaining backwards.
fn rank_ops(p: &Plan, zero_bubble: bool) -> Vec<Option<Step>> {
    let (mut fwd, mut bwd, mut wgt) = (HashMap::new(), HashMap::new(), HashMap::new());
    let back = if zero_bubble {
        Kind::BackwardInput
    } else {
        Kind::FullBackward
    };
    let post_warmup = if zero_bubble {
        p.pp - p.rank - 1
    } else {
        (p.spr * p.pp + 2 * (p.pp - 1 - p.rank)).saturating_sub(p.warmup + p.rank)
    };
    let mut ops = vec![None; p.rank];
    let (mut backward_ops, mut weights_done) = (Vec::new(), 0);
    // torch's three phases: `warmup` forwards; forward and backward until
    // every forward is made (op < total); `warmup` more backwards.
    for op in 0..p.total + p.warmup {
        if op < p.total {
            let s = p.forward_stage(op);
            ops.push(act(s, Kind::Forward, next(&mut fwd, s)));
            if op + 1 == p.warmup {
                ops.extend(std::iter::repeat_n(None, post_warmup));
            }
            if op < p.warmup {
                continue;
            }
        } else if !zero_bubble {
            ops.push(None);
        }
        let s = p.backward_stage(op);
        ops.push(act(s, back, next(&mut bwd, s)));
        backward_ops.push(op);
        if zero_bubble && op - p.warmup >= p.rank {
            let s = p.backward_stage(backward_ops[weights_done]);
            ops.push(act(s, Kind::BackwardWeight, next(&mut wgt, s)));
            weights_done += 1;
        }
    }
    while zero_bubble && weights_done < backward_ops.len() {
        let s = p.backward_stage(backward_ops[weights_done]);
        ops.push(act(s, Kind::BackwardWeight, next(&mut wgt, s)));
        weights_done += 1;
    }
    ops
}

/// `ScheduleInterleaved1F1B` (`zero_bubble` false: warmup factor 2) and
/// `ScheduleInterleavedZeroBubble` (true: factor 1, split backwards, then
/// bubbles where a dependency is not yet met).
pub(super) fn interleaved(
    pp: usize,
    m: usize,
    spr: usize,
    zero_bubble: bool,
) -> Result<Vec<Vec<Option<Step>>>, String> {
    let factor = if zero_bubble { 1 } else { 2 };
    let orders = (0..pp)
        .map(|r| rank_ops(&Plan::new(pp, m, spr, r, factor), zero_bubble))
        .collect();
    if zero_bubble {
        add_bubbles(orders, pp * spr)
    } else {
        Ok(orders)
    }
}

/// `_add_bubbles_to_actions`: the ranks' lists advanced in lockstep; a
/// forward whose previous stage has not run that microbatch yet, or a full
/// backward whose next stage (or, on the last stage, forward) has not,
/// waits for a round in an empty slot.
fn add_bubbles(
    orders: Vec<Vec<Option<Step>>>,
    num_stages: usize,
) -> Result<Vec<Vec<Option<Step>>>, String> {
    let mut seen: HashSet<(usize, Kind, usize)> = HashSet::new();
    let mut out: Vec<Vec<Option<Step>>> = vec![Vec::new(); orders.len()];
    let mut next = vec![0usize; orders.len()];
    let bound: usize = 4 * orders.iter().map(Vec::len).sum::<usize>() + 16;
    for _ in 0..bound {
        let mut now = Vec::new();
        let mut running = false;
        for (rank, order) in orders.iter().enumerate() {
            let Some(slot) = order.get(next[rank]) else {
                continue;
            };
            running = true;
            let Some(Step::Compute(a)) = slot else {
                next[rank] += 1;
                out[rank].push(*slot);
                continue;
            };
            let waits = match a.kind {
                Kind::Forward => {
                    a.stage != 0 && !seen.contains(&(a.stage - 1, Kind::Forward, a.microbatch))
                }
                Kind::FullBackward if a.stage == num_stages - 1 => {
                    !seen.contains(&(a.stage, Kind::Forward, a.microbatch))
                }
                Kind::FullBackward => {
                    !seen.contains(&(a.stage + 1, Kind::FullBackward, a.microbatch))
                }
                Kind::BackwardInput | Kind::BackwardWeight => false,
            };
            if waits {
                out[rank].push(None);
            } else {
                out[rank].push(*slot);
                now.push((a.stage, a.kind, a.microbatch));
                next[rank] += 1;
            }
        }
        if !running {
            return Ok(out);
        }
        seen.extend(now);
    }
    Err("the schedule's dependencies are never met (no rank can go on)".into())
}
