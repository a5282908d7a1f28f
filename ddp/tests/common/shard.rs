//! What the sharded strategies' tests share (host and device): the
//! optimizers, the one-process reference, the cases and the comparison.

use consort_ddp::{AdamW, Sgd, ShardOptimizer, Strategy};
use proptest::{prelude::*, strategy::Strategy as _};

use super::{Case, Shape, make_case};

/// Which optimizer a case uses.
#[derive(Clone, Copy, Debug)]
pub enum Opt {
    /// SGD, momentum 0.5, lr 1 (exact: every value stays a short binary
    /// fraction).
    SgdExact,
    /// SGD with momentum 0.9, weight decay 0.01.
    Sgd,
    /// AdamW, lr 0.01.
    AdamW,
}

pub fn optimizer(o: Opt) -> Box<dyn ShardOptimizer> {
    match o {
        Opt::SgdExact => Box::new(Sgd::new(1.0).momentum(0.5)),
        Opt::Sgd => Box::new(Sgd::new(0.05).momentum(0.9).weight_decay(0.01)),
        Opt::AdamW => Box::new(AdamW::new(0.01)),
    }
}

/// One process, the global batch, the optimizer on each whole parameter
/// (elementwise, so the same as on any split of it). Returns parameters
/// and each parameter's optimizer slots.
pub fn reference(
    c: &Case,
    o: Opt,
    steps: std::ops::Range<usize>,
    start: Vec<Vec<f64>>,
) -> Vec<Vec<f64>> {
    let opt = optimizer(o);
    let mut params = start;
    let mut state: Vec<Vec<Vec<f64>>> = params
        .iter()
        .map(|p| vec![vec![0.0; p.len()]; opt.slots()])
        .collect();
    let scale = if c.exact {
        1.0
    } else {
        1.0 / (c.world * c.batch) as f64
    };
    for (t, step) in c.data.iter().enumerate() {
        let (xs, ys): (Vec<_>, Vec<_>) = step.iter().flatten().flatten().cloned().unzip();
        let mut grads = vec![Vec::new(); params.len()];
        c.mlp
            .backward(&params, &xs, &ys, scale, |i, g| grads[i] = g);
        if !steps.contains(&t) {
            continue;
        }
        for ((p, g), s) in params.iter_mut().zip(&grads).zip(&mut state) {
            let mut slots: Vec<&mut [f64]> = s.iter_mut().map(|v| v.as_mut_slice()).collect();
            opt.step_f64(t as u64 + 1, p, g, &mut slots);
        }
    }
    params
}

/// Cases: an MLP, a world, steps and data (one micro-batch per step).
pub fn cases(max_world: usize) -> impl proptest::strategy::Strategy<Value = Case> {
    (
        prop::collection::vec(1usize..6, 2..4),
        1usize..=max_world,
        1usize..4,
        1usize..4,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(dims, world, batch, steps, exact, seed)| {
            make_case(Shape {
                dims,
                world,
                batch,
                micro: 1,
                steps,
                cap: None,
                view: false,
                exact,
                seed,
            })
        })
}

/// A strategy for a world of `world` (HSDP's shard size divides it).
pub fn strategy_for(world: usize, pick: usize, g: usize) -> Strategy {
    match pick % 4 {
        0 => Strategy::Zero1,
        1 => Strategy::Zero2,
        2 => Strategy::Fsdp,
        _ => {
            let divisors: Vec<usize> = (1..=world).filter(|d| world % d == 0).collect();
            Strategy::Hsdp {
                shard_size: divisors[g % divisors.len()],
            }
        }
    }
}

pub fn check(c: &Case, got: &[Vec<Vec<f64>>], want: &[Vec<f64>]) -> Result<(), TestCaseError> {
    for (r, params) in got.iter().enumerate() {
        for (p, (g, w)) in params.iter().zip(want).enumerate() {
            prop_assert_eq!(g.len(), w.len());
            for (k, (a, b)) in g.iter().zip(w).enumerate() {
                if c.exact {
                    prop_assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "rank {} param {} [{}]: {} vs {} (exact)",
                        r,
                        p,
                        k,
                        a,
                        b
                    );
                } else {
                    prop_assert!(
                        (a - b).abs() <= 1e-6 * (1.0 + a.abs().max(b.abs())),
                        "rank {} param {} [{}]: {} vs {}",
                        r,
                        p,
                        k,
                        a,
                        b
                    );
                }
            }
        }
    }
    Ok(())
}
