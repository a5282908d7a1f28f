//! The single-stage schedules, GPipe and 1F1B, in the order torch's
//! `_step_microbatches` makes its calls: rank r holds stage r.

use super::{Action, Kind, Step};

fn f(stage: usize, mb: usize) -> Option<Step> {
    Some(Step::Compute(Action::new(stage, Kind::Forward, mb)))
}

fn b(stage: usize, mb: usize) -> Option<Step> {
    Some(Step::Compute(Action::new(stage, Kind::FullBackward, mb)))
}

/// `ScheduleGPipe`: every forward, then every backward.
pub(super) fn gpipe(pp: usize, m: usize) -> Vec<Vec<Option<Step>>> {
    (0..pp)
        .map(|r| {
            (0..m)
                .map(|i| f(r, i))
                .chain((0..m).map(|i| b(r, i)))
                .collect()
        })
        .collect()
}

/// `Schedule1F1B`: `min(m, p - r)` forwards, then a backward and a forward
/// in turn until the forwards are done, then the remaining backwards.
pub(super) fn one_f_one_b(pp: usize, m: usize) -> Vec<Vec<Option<Step>>> {
    (0..pp)
        .map(|r| {
            let warmup = m.min(pp - r);
            let mut ops: Vec<Option<Step>> = (0..warmup).map(|i| f(r, i)).collect();
            let (mut fwd, mut bwd) = (warmup, 0);
            loop {
                ops.push(b(r, bwd));
                bwd += 1;
                if fwd == m {
                    break;
                }
                ops.push(f(r, fwd));
                fwd += 1;
            }
            ops.extend((bwd..m).map(|i| b(r, i)));
            ops
        })
        .collect()
}
