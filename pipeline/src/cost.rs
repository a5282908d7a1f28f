//! A schedule timed on a cost model: every rank runs its list in order,
//! each action as soon as its inputs exist, so the step's length, each
//! rank's idle time (the bubble) and the activations each rank holds at
//! its peak follow from the lists alone.
//!
//! With uniform costs and free messages, GPipe's and 1F1B's bubble is the
//! textbook `(p - 1) / (m + p - 1)`; GPipe holds all `m` microbatches'
//! activations on every rank, 1F1B at most `p - r` on rank `r`.

use std::collections::HashMap;

use crate::schedule::{Action, Kind, Schedule, Step};

/// What each action costs, in any unit of time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// One stage's forward of one microbatch.
    pub forward: f64,
    /// The backward to the input (a full backward costs this plus
    /// `backward_weight`).
    pub backward_input: f64,
    /// The backward to the weights.
    pub backward_weight: f64,
    /// A message between two ranks (none between stages on one rank).
    pub p2p: f64,
}

impl Default for Costs {
    /// torch's usual assumption: a backward costs two forwards, halved
    /// between input and weights; messages free.
    fn default() -> Self {
        Costs {
            forward: 1.0,
            backward_input: 1.0,
            backward_weight: 1.0,
            p2p: 0.0,
        }
    }
}

/// A schedule's step on the cost model.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    /// When the last action ends.
    pub makespan: f64,
    /// Each rank's time computing.
    pub busy: Vec<f64>,
    /// The share of the ranks' time spent idle: `1 - mean(busy) / makespan`.
    pub bubble: f64,
    /// Each rank's most microbatches whose forward ran and whose
    /// backward (weights included) had not yet: activations held at once.
    pub peak_activations: Vec<usize>,
}

fn cost(a: &Action, c: &Costs) -> f64 {
    match a.kind {
        Kind::Forward => c.forward,
        Kind::FullBackward => c.backward_input + c.backward_weight,
        Kind::BackwardInput => c.backward_input,
        Kind::BackwardWeight => c.backward_weight,
    }
}

/// Key of the action whose end `a` waits for, if any, and whether a
/// message carries it.
fn dependency(s: &Schedule, a: &Action) -> Option<((usize, bool, usize), usize)> {
    let last = s.num_stages() - 1;
    // (stage, is a backward, microbatch); the rank it runs on.
    match a.kind {
        Kind::Forward if a.stage > 0 => {
            Some(((a.stage - 1, false, a.microbatch), s.rank_of(a.stage - 1)))
        }
        Kind::FullBackward | Kind::BackwardInput if a.stage < last => {
            Some(((a.stage + 1, true, a.microbatch), s.rank_of(a.stage + 1)))
        }
        Kind::FullBackward | Kind::BackwardInput => {
            Some(((a.stage, false, a.microbatch), s.rank_of(a.stage)))
        }
        Kind::BackwardWeight => Some(((a.stage, true, a.microbatch), s.rank_of(a.stage))),
        Kind::Forward => None,
    }
}

/// Times `schedule` under `costs`. Fails if the lists wait on each other
/// for ever (no schedule of torch's does).
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Result<Timing, String> {
    let pp = schedule.pp();
    let lists: Vec<Vec<Step>> = (0..pp).map(|r| schedule.steps(r)).collect();
    let mut next = vec![0usize; pp];
    let mut free = vec![0f64; pp];
    let mut busy = vec![0f64; pp];
    let mut ended: HashMap<(usize, bool, usize), f64> = HashMap::new();
    loop {
        let mut moved = false;
        for r in 0..pp {
            while let Some(step) = lists[r].get(next[r]) {
                // Each action of a step (an overlapped forward and
                // backward: two) starts once its input is in, in order.
                let mut t = free[r];
                let mut ends = Vec::new();
                for a in step.actions() {
                    if let Some((key, from)) = dependency(schedule, &a) {
                        let Some(&end) = ended.get(&key) else {
                            break;
                        };
                        t = t.max(end + if from == r { 0.0 } else { costs.p2p });
                    }
                    t += cost(&a, costs);
                    busy[r] += cost(&a, costs);
                    ends.push((a, t));
                }
                if ends.len() < step.actions().count() {
                    // Not ready: undo this attempt's busy time.
                    busy[r] -= ends.iter().map(|(a, _)| cost(a, costs)).sum::<f64>();
                    break;
                }
                for (a, end) in ends {
                    let is_back = matches!(a.kind, Kind::FullBackward | Kind::BackwardInput);
                    if a.kind != Kind::BackwardWeight {
                        ended.insert((a.stage, is_back, a.microbatch), end);
                    }
                }
                free[r] = t;
                next[r] += 1;
                moved = true;
            }
        }
        if (0..pp).all(|r| next[r] == lists[r].len()) {
            break;
        }
        if !moved {
            let stuck: Vec<String> = (0..pp)
                .filter_map(|r| lists[r].get(next[r]).map(|s| format!("rank {r} at {s}")))
                .collect();
            return Err(format!(
                "the ranks wait on each other for ever: {}",
                stuck.join(", ")
            ));
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let mean_busy = busy.iter().sum::<f64>() / pp as f64;
    let bubble = if makespan > 0.0 {
        1.0 - mean_busy / makespan
    } else {
        0.0
    };
    Ok(Timing {
        makespan,
        busy,
        bubble,
        peak_activations: lists.iter().map(|l| peak(l)).collect(),
    })
}

/// The most microbatches a rank's list holds activations for at once.
fn peak(list: &[Step]) -> usize {
    let (mut now, mut most) = (0usize, 0usize);
    for a in list.iter().flat_map(Step::actions) {
        match a.kind {
            Kind::Forward => {
                now += 1;
                most = most.max(now);
            }
            Kind::FullBackward | Kind::BackwardWeight => now = now.saturating_sub(1),
            Kind::BackwardInput => {}
        }
    }
    most
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::ScheduleKind;

    #[test]
    fn gpipe_and_1f1b_match_the_textbook_bubble_and_memory() {
        for p in 1..=6 {
            for m in p..=12 {
                let want = (p - 1) as f64 / (m + p - 1) as f64;
                for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                    let t = simulate(&Schedule::new(kind, p, m, 1).unwrap(), &Costs::default())
                        .unwrap();
                    assert!(
                        (t.bubble - want).abs() < 1e-12,
                        "{kind} p={p} m={m}: {} vs {want}",
                        t.bubble
                    );
                    assert_eq!(t.makespan, 3.0 * (m + p - 1) as f64, "{kind} p={p} m={m}");
                    for (r, &peak) in t.peak_activations.iter().enumerate() {
                        let want = if kind == ScheduleKind::GPipe {
                            m
                        } else {
                            m.min(p - r)
                        };
                        assert_eq!(peak, want, "{kind} p={p} m={m} rank {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_torch_schedule_runs_to_its_end_and_interleaving_shrinks_the_bubble() {
        for kind in ScheduleKind::ALL {
            for p in 1..=4 {
                for m in 1..=8 {
                    for spr in [1, 2, 3] {
                        let Ok(s) = Schedule::new(kind, p, m, spr) else {
                            continue;
                        };
                        let t = simulate(&s, &Costs::default()).unwrap();
                        let work = (m * spr) as f64 * 3.0;
                        for b in &t.busy {
                            assert!((b - work).abs() < 1e-9, "{kind} p={p} m={m} spr={spr}");
                        }
                    }
                }
            }
        }
        let one = simulate(
            &Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap(),
            &Costs::default(),
        )
        .unwrap();
        let inter = simulate(
            &Schedule::new(ScheduleKind::Interleaved1F1B, 4, 8, 2).unwrap(),
            &Costs::default(),
        )
        .unwrap();
        assert!(
            inter.bubble < one.bubble,
            "{} vs {}",
            inter.bubble,
            one.bubble
        );
    }

    #[test]
    fn messages_add_to_the_step() {
        let s = Schedule::new(ScheduleKind::GPipe, 3, 4, 1).unwrap();
        let free = simulate(&s, &Costs::default()).unwrap();
        let slow = simulate(
            &s,
            &Costs {
                p2p: 0.5,
                ..Costs::default()
            },
        )
        .unwrap();
        // Two hops forward, two back, each on the critical path.
        assert!(
            (slow.makespan - free.makespan - 2.0).abs() < 1e-12,
            "{} {}",
            slow.makespan,
            free.makespan
        );
    }
}
