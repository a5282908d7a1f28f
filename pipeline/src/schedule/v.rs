//! The V-shaped schedules: rank r holds stages r and 2p-1-r. ZBVZeroBubble
//! and DualPipeV, as torch's `_calculate_single_rank_operations` lays
//! them out.

use std::collections::{HashMap, VecDeque};

use super::{Action, Kind, Step};

/// `ScheduleZBVZeroBubble`: forwards down the V, then input gradients,
/// forwards and weight gradients in turn, the weights last; laid out for
/// at least 2p-1 microbatches, the ones past `m` left empty.
pub(super) fn zbv(pp: usize, m: usize) -> Vec<Vec<Option<Step>>> {
    (0..pp).map(|r| zbv_rank(pp, m, r)).collect()
}

fn zbv_rank(pp: usize, m: usize, r: usize) -> Vec<Option<Step>> {
    let n = (2 * pp - 1).max(m);
    let (c0, c1) = (r, 2 * pp - 1 - r);
    let mut ops: Vec<Option<Action>> = vec![None; r];
    let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
    let push = |ops: &mut Vec<Option<Action>>, s, k, i| ops.push(Some(Action::new(s, k, i)));
    for _ in 0..2 * (pp - r) - 1 {
        push(&mut ops, c0, Kind::Forward, f0);
        f0 += 1;
    }
    for _ in 0..r {
        push(&mut ops, c1, Kind::Forward, f1);
        f1 += 1;
        push(&mut ops, c0, Kind::Forward, f0);
        f0 += 1;
    }
    for _ in 0..pp - r {
        push(&mut ops, c1, Kind::Forward, f1);
        f1 += 1;
        push(&mut ops, c1, Kind::BackwardInput, b1);
        push(&mut ops, c1, Kind::BackwardWeight, b1);
        b1 += 1;
    }
    while f1 < f0 || f0 < n {
        if f0 < n {
            push(&mut ops, c0, Kind::Forward, f0);
            f0 += 1;
        }
        push(&mut ops, c0, Kind::BackwardInput, b0);
        push(&mut ops, c0, Kind::BackwardWeight, b0);
        b0 += 1;
        push(&mut ops, c1, Kind::Forward, f1);
        f1 += 1;
        push(&mut ops, c1, Kind::BackwardInput, b1);
        push(&mut ops, c1, Kind::BackwardWeight, b1);
        b1 += 1;
    }
    let (mut w0, mut w1) = (b0, b1);
    for _ in 0..r {
        push(&mut ops, c0, Kind::BackwardInput, b0);
        b0 += 1;
        push(&mut ops, c1, Kind::BackwardInput, b1);
        b1 += 1;
    }
    for _ in 0..pp - r {
        push(&mut ops, c0, Kind::BackwardInput, b0);
        b0 += 1;
        push(&mut ops, c0, Kind::BackwardWeight, w0);
        w0 += 1;
    }
    while w1 < b1 {
        push(&mut ops, c1, Kind::BackwardWeight, w1);
        w1 += 1;
    }
    while w0 < b0 {
        push(&mut ops, c0, Kind::BackwardWeight, w0);
        w0 += 1;
    }
    ops.into_iter()
        .map(|a| a.filter(|a| a.microbatch < m).map(Step::Compute))
        .collect()
}

/// One rank's DualPipeV list being built: per-stage counters as torch's
/// (a full backward counts as an input and a weight gradient) and the
/// queue of weight gradients owed.
struct DualPipe {
    ops: Vec<Option<Step>>,
    counts: HashMap<(usize, Kind), usize>,
    weights: VecDeque<(usize, usize)>,
}

impl DualPipe {
    fn take(&mut self, stage: usize, kind: Kind) -> usize {
        let key = match kind {
            Kind::FullBackward => (stage, Kind::BackwardInput),
            k => (stage, k),
        };
        let mb = self.counts.get(&key).copied().unwrap_or(0);
        match kind {
            Kind::FullBackward => {
                for k in [Kind::BackwardInput, Kind::BackwardWeight] {
                    *self.counts.entry((stage, k)).or_insert(0) += 1;
                }
            }
            k => {
                if k == Kind::BackwardInput {
                    self.weights.push_back((stage, mb));
                }
                self.counts.insert(key, mb + 1);
            }
        }
        mb
    }

    fn add(&mut self, stage: usize, kind: Kind) {
        let mb = self.take(stage, kind);
        self.ops
            .push(Some(Step::Compute(Action::new(stage, kind, mb))));
    }

    fn overlap(&mut self, fwd: usize, bwd: usize) {
        let f = self.take(fwd, Kind::Forward);
        let b = self.take(bwd, Kind::FullBackward);
        self.ops.push(Some(Step::Overlap(
            Action::new(fwd, Kind::Forward, f),
            Action::new(bwd, Kind::FullBackward, b),
        )));
    }

    fn weight_if_owed(&mut self) {
        if let Some((stage, mb)) = self.weights.pop_front() {
            *self
                .counts
                .entry((stage, Kind::BackwardWeight))
                .or_insert(0) += 1;
            self.ops.push(Some(Step::Compute(Action::new(
                stage,
                Kind::BackwardWeight,
                mb,
            ))));
        }
    }
}

/// `ScheduleDualPipeV`, in torch's eight steps.
pub(super) fn dualpipe_v(pp: usize, m: usize) -> Vec<Vec<Option<Step>>> {
    (0..pp).map(|r| dualpipe_rank(pp, m, r)).collect()
}

fn dualpipe_rank(pp: usize, m: usize, r: usize) -> Vec<Option<Step>> {
    let (s0, s1) = (r, 2 * pp - 1 - r);
    let mut d = DualPipe {
        ops: Vec::new(),
        counts: HashMap::new(),
        weights: VecDeque::new(),
    };
    for _ in 0..(pp - r - 1) * 2 {
        d.add(s0, Kind::Forward);
    }
    for _ in 0..r + 1 {
        d.add(s0, Kind::Forward);
        d.add(s1, Kind::Forward);
    }
    for _ in 0..pp - r - 1 {
        d.add(s1, Kind::BackwardInput);
        d.weight_if_owed();
        d.add(s1, Kind::Forward);
    }
    // m >= 2p was checked, so this is at least r + 1.
    for i in 0..m + r + 1 - 2 * pp {
        if i == 0 && r == pp - 1 {
            d.add(s0, Kind::Forward);
            d.add(s1, Kind::FullBackward);
        } else {
            d.overlap(s0, s1);
        }
        d.overlap(s1, s0);
    }
    for _ in 0..pp - r - 1 {
        d.add(s1, Kind::FullBackward);
        d.overlap(s1, s0);
    }
    let mut zero_bubble = false;
    let back = |zb: bool| {
        if zb {
            Kind::BackwardInput
        } else {
            Kind::FullBackward
        }
    };
    // torch: (rank + 1) // 2, the middle of this step's rank + 1 pairs.
    let half = r.div_ceil(2);
    for i in 0..r + 1 {
        if i == half && r % 2 == 1 {
            zero_bubble = true;
        }
        d.add(s1, back(zero_bubble));
        if i == half && r.is_multiple_of(2) {
            zero_bubble = true;
        }
        d.add(s0, back(zero_bubble));
    }
    for _ in 0..pp - r - 1 {
        d.weight_if_owed();
        d.add(s0, back(zero_bubble));
    }
    for _ in 0..r + 1 {
        d.weight_if_owed();
    }
    d.ops
}
