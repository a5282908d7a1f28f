//! DDP's defining property, on the simulator: N ranks with per-rank batch
//! b train exactly like one rank with batch N·b (and no_sync over k
//! micro-batches like one batch of k·b), over random models, world sizes,
//! bucket caps and steps.

mod common;

use std::sync::Arc;

use common::{Mlp, run_sim};
use consort_ddp::{Ddp, DdpOptions, PlainModel};
use consort_sim::{SimConfig, SimRank};
use proptest::prelude::*;

/// One rank's micro-batch: (x, y) samples.
type Batch = Vec<(Vec<f64>, Vec<f64>)>;

#[derive(Clone, Debug)]
struct Case {
    mlp: Mlp,
    world: usize,
    batch: usize,
    micro: usize,
    cap: Option<usize>,
    view: bool,
    /// Integer-valued data, lr 1 and a loss scaled so that every sum is
    /// exact: results must match bit for bit.
    exact: bool,
    init: Vec<Vec<f64>>,
    /// `data[step][micro][rank][sample] = (x, y)`
    data: Vec<Vec<Vec<Batch>>>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(1usize..6, 2..4),
        1usize..=8,
        1usize..4,
        1usize..4,
        1usize..4,
        prop::option::of(8usize..400),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(dims, world, batch, micro, steps, cap, view, exact, seed)| {
                let mlp = Mlp { dims };
                let mut rng = seed | 1;
                let mut next = move |exact: bool| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    if exact {
                        (rng % 5) as f64 - 2.0
                    } else {
                        (rng % 2001) as f64 / 1000.0 - 1.0
                    }
                };
                let steps = if exact { steps.min(2) } else { steps };
                let init = mlp
                    .sizes()
                    .iter()
                    .map(|&s| (0..s).map(|_| next(exact)).collect())
                    .collect();
                let (i, o) = (mlp.dims[0], *mlp.dims.last().unwrap());
                let data = (0..steps)
                    .map(|_| {
                        (0..micro)
                            .map(|_| {
                                (0..world)
                                    .map(|_| {
                                        (0..batch)
                                            .map(|_| {
                                                let x = (0..i).map(|_| next(exact)).collect();
                                                let y = (0..o).map(|_| next(exact)).collect();
                                                (x, y)
                                            })
                                            .collect()
                                    })
                                    .collect()
                            })
                            .collect()
                    })
                    .collect();
                Case {
                    mlp,
                    world,
                    batch,
                    micro,
                    cap,
                    view,
                    exact,
                    init,
                    data,
                }
            },
        )
}

fn lr(c: &Case) -> f64 {
    if c.exact { 1.0 } else { 0.05 }
}

/// One process, the whole global batch of every step.
fn reference(c: &Case) -> Vec<Vec<f64>> {
    let mut params = c.init.clone();
    let scale = if c.exact {
        1.0
    } else {
        1.0 / (c.world * c.batch * c.micro) as f64
    };
    for step in &c.data {
        let (xs, ys): (Vec<_>, Vec<_>) = step.iter().flatten().flatten().cloned().unzip();
        let mut grads = vec![Vec::new(); params.len()];
        c.mlp
            .backward(&params, &xs, &ys, scale, |i, g| grads[i] = g);
        for (p, g) in params.iter_mut().zip(grads) {
            for (v, d) in p.iter_mut().zip(g) {
                *v -= lr(c) * d;
            }
        }
    }
    params
}

/// Every rank under DDP; returns each rank's final parameters.
fn distributed(c: &Case) -> Vec<Vec<Vec<f64>>> {
    let c = Arc::new(c.clone());
    let (out, _) = run_sim(SimConfig::new(c.world), move |rank| {
        let c = c.clone();
        async move {
            use consort_comm::Backend;
            let r = rank.rank();
            // Ranks other than 0 start from garbage: the broadcast fixes it.
            let init: Vec<Vec<f64>> = if r == 0 {
                c.init.clone()
            } else {
                c.init
                    .iter()
                    .map(|p| vec![7.0 + r as f64; p.len()])
                    .collect()
            };
            let mut model = c.mlp.model(&init);
            let mut opts = DdpOptions::default();
            if let Some(cap) = c.cap {
                opts.bucket_cap_bytes = Some(cap);
            }
            let mut ddp = Ddp::new(rank, &mut model, opts).await.unwrap();
            let scale = if c.exact {
                c.world as f64
            } else {
                1.0 / (c.batch * c.micro) as f64
            };
            for step in &c.data {
                let params: Vec<Vec<f64>> = (0..model.len())
                    .map(|i| model.param::<f64>(i).unwrap().to_vec())
                    .collect();
                if c.view {
                    ddp.zero_grad();
                } else {
                    model.zero_grad();
                }
                for (m, micro) in step.iter().enumerate() {
                    let (xs, ys): (Vec<_>, Vec<_>) = micro[r].iter().cloned().unzip();
                    let last = m + 1 == c.micro;
                    if last {
                        micro_step(&mut ddp, &mut model, &c, &params, &xs, &ys, scale).await;
                    } else {
                        let mut g = ddp.no_sync();
                        micro_step(&mut g, &mut model, &c, &params, &xs, &ys, scale).await;
                    }
                }
                for i in 0..model.len() {
                    let g = ddp.grad::<f64>(i).unwrap().to_vec();
                    for (v, d) in model.param_mut::<f64>(i).unwrap().iter_mut().zip(g) {
                        *v -= lr(&c) * d;
                    }
                }
            }
            (0..model.len())
                .map(|i| model.param::<f64>(i).unwrap().to_vec())
                .collect::<Vec<_>>()
        }
    });
    out
}

/// One micro-batch's backward (gradients marked as they come) and finish.
async fn micro_step(
    ddp: &mut Ddp<SimRank>,
    model: &mut PlainModel,
    c: &Case,
    params: &[Vec<f64>],
    xs: &[Vec<f64>],
    ys: &[Vec<f64>],
    scale: f64,
) {
    let mut err = None;
    c.mlp.backward(params, xs, ys, scale, |i, grad| {
        let res = if c.view {
            let slot = ddp.grad_mut::<f64>(i).unwrap();
            for (s, d) in slot.iter_mut().zip(&grad) {
                *s += d;
            }
            ddp.mark_ready_in_place(i)
        } else {
            let acc = model.grad_mut::<f64>(i).unwrap();
            for (s, d) in acc.iter_mut().zip(&grad) {
                *s += d;
            }
            let acc = acc.to_vec();
            ddp.mark_ready(i, &acc)
        };
        if let Err(e) = res {
            err.get_or_insert(e);
        }
    });
    if let Some(e) = err {
        panic!("{e}");
    }
    ddp.finish().await.unwrap();
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn ddp_on_n_ranks_equals_one_rank_with_the_global_batch(c in case()) {
        let want = reference(&c);
        let got = distributed(&c);
        for (r, params) in got.iter().enumerate() {
            for (p, (g, w)) in params.iter().zip(&want).enumerate() {
                for (k, (a, b)) in g.iter().zip(w).enumerate() {
                    if c.exact {
                        prop_assert!(b.abs() < 2f64.powi(50), "exactness needs smaller values");
                        prop_assert_eq!(a.to_bits(), b.to_bits(),
                            "rank {} param {} [{}]: {} vs {} (exact)", r, p, k, a, b);
                    } else {
                        prop_assert!(close(*a, *b),
                            "rank {} param {} [{}]: {} vs {}", r, p, k, a, b);
                    }
                }
            }
        }
    }
}
