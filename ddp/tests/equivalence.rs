//! DDP's defining property, on the simulator: N ranks with per-rank batch
//! b train exactly like one rank with batch N·b (and no_sync over k
//! micro-batches like one batch of k·b), over random models, world sizes,
//! bucket caps and steps.

mod common;

use std::sync::Arc;

use common::{Case, case, close, lr, reference, run_sim};
use consort_ddp::{Ddp, DdpOptions, PlainModel};
use consort_sim::{SimConfig, SimRank};
use proptest::prelude::*;

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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn ddp_on_n_ranks_equals_one_rank_with_the_global_batch(c in case(8)) {
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
