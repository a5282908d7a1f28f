//! Mixed precision under every sharded strategy, as torch's FSDP2
//! `MixedPrecisionPolicy`: f32 master shards, parameters gathered in bf16
//! or f16, gradients given in that dtype and reduced in the reduce dtype,
//! the optimizer on the f32 masters. N ranks train as one process that
//! rounds alike (within the reduce dtype's rounding of the sums), on the
//! simulator and with everything on the emulated device; f16's dynamic
//! loss scaling skips a step with an inf on any rank, on every rank, and
//! follows torch's GradScaler.

mod common;

use std::sync::Arc;

use common::{
    Case,
    shard::{cases, on_emulated_ranks, strategy_for},
};
use consort_comm::{
    Backend, DType,
    half::{bf16, f16},
};
use consort_ddp::{
    DeviceModel, LossScaling, MixedPrecision, PlainModel, Sgd, ShardOptimizer, ShardOptions,
    Sharded, Strategy,
};
use consort_sim::SimConfig;
use proptest::prelude::*;

fn round(v: f64, d: DType) -> f64 {
    match d {
        DType::BF16 => bf16::from_f64(v).to_f64(),
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        _ => v,
    }
}

fn sgd() -> Sgd {
    Sgd::new(0.05).momentum(0.9).weight_decay(0.01)
}

/// One process: f32 masters; each step computes with the masters rounded
/// to `param_dtype`, rounds each rank's gradient to it, averages them
/// (rounded to the reduce dtype, then to f32) and steps SGD in f32.
/// Returns the masters and the tolerance of the comparison: a sum the
/// collective makes in bf16 or f16 rounds each partial sum, so each step
/// may differ by the world's rounding of the largest gradient, which
/// momentum carries on (at most 10 times, at 0.9).
fn reference(c: &Case, mp: MixedPrecision) -> (Vec<Vec<f64>>, f64) {
    let eps = match mp.reduce() {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => 0.0,
    };
    let mut tol = 2e-3;
    let opt = sgd();
    let mut master: Vec<Vec<f32>> = (c.init.iter())
        .map(|p| p.iter().map(|&v| v as f32).collect())
        .collect();
    let mut bufs: Vec<Vec<f32>> = master.iter().map(|p| vec![0.0; p.len()]).collect();
    for (t, step) in c.data.iter().enumerate() {
        let compute: Vec<Vec<f64>> = (master.iter())
            .map(|p| {
                p.iter()
                    .map(|&v| round(f64::from(v), mp.param_dtype))
                    .collect()
            })
            .collect();
        let mut sum: Vec<Vec<f64>> = master.iter().map(|p| vec![0.0; p.len()]).collect();
        for batch in &step[0] {
            let (xs, ys): (Vec<_>, Vec<_>) = batch.iter().cloned().unzip();
            c.mlp
                .backward(&compute, &xs, &ys, 1.0 / c.batch as f64, |i, g| {
                    for (s, v) in sum[i].iter_mut().zip(g) {
                        *s += round(v, mp.param_dtype);
                    }
                });
        }
        let largest = sum.iter().flatten().fold(0f64, |m, v| m.max(v.abs()));
        tol += 0.05 * 10.0 * c.world as f64 * eps * largest;
        for ((p, s), b) in master.iter_mut().zip(&sum).zip(&mut bufs) {
            let g: Vec<f32> = (s.iter())
                .map(|v| round(round(v / c.world as f64, mp.reduce()), DType::F32) as f32)
                .collect();
            opt.step_f32(t as u64 + 1, p, &g, &mut [b.as_mut_slice()]);
        }
    }
    let master = (master.iter())
        .map(|p| p.iter().map(|&v| f64::from(v)).collect())
        .collect();
    (master, tol)
}

/// A gathered parameter as f64 (host or device), whatever its compute
/// dtype; `None` when `p` is not in this unit.
fn values(g: &consort_ddp::shard::Gathered, p: usize, d: DType) -> Option<Vec<f64>> {
    let bytes = g.param_bytes(p).ok()?;
    let half = bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]));
    match d {
        DType::BF16 => Some(half.map(|b| bf16::from_bits(b).to_f64()).collect()),
        DType::F16 => Some(half.map(|b| f16::from_bits(b).to_f64()).collect()),
        _ => None,
    }
}

/// Hands gradient `g` over in `d` (rounded), scaled by the loss scale.
fn mark(sh: &mut Sharded, p: usize, g: &[f64], d: DType) -> Result<(), consort_ddp::DdpError> {
    let s = sh.loss_scale();
    match d {
        DType::BF16 => {
            let v: Vec<bf16> = g.iter().map(|&x| bf16::from_f64(x * s)).collect();
            sh.mark_ready(p, &v)
        }
        _ => {
            let v: Vec<f16> = g.iter().map(|&x| f16::from_f64(x * s)).collect();
            sh.mark_ready(p, &v)
        }
    }
}

/// One step of rank `r`: gather every unit, compute, mark, step.
async fn train_step(c: &Case, sh: &mut Sharded, batch: &[(Vec<f64>, Vec<f64>)]) {
    let d = sh.compute_dtype().unwrap();
    let units = sh.layout().units.len();
    let mut got = Vec::new();
    for u in 0..units {
        got.push(sh.gather(u).await.unwrap());
    }
    let params: Vec<Vec<f64>> = (0..sh.params().len())
        .map(|p| got.iter().find_map(|g| values(g, p, d)).unwrap())
        .collect();
    drop(got);
    let (xs, ys): (Vec<_>, Vec<_>) = batch.iter().cloned().unzip();
    let mut grads = vec![Vec::new(); params.len()];
    c.mlp
        .backward(&params, &xs, &ys, 1.0 / c.batch as f64, |i, g| grads[i] = g);
    for i in (0..grads.len()).rev() {
        mark(sh, i, &grads[i], d).unwrap();
    }
    sh.step().await.unwrap();
}

/// The initial f32 model of rank `r` (garbage off rank 0).
fn model_for(c: &Case, r: usize) -> PlainModel {
    let mut m = PlainModel::new();
    for (p, init) in c.init.iter().enumerate() {
        let v: Vec<f32> = init
            .iter()
            .map(|&x| if r == 0 { x as f32 } else { 7.0 + r as f32 })
            .collect();
        m.add_param(format!("p{p}"), vec![v.len()], &v).unwrap();
    }
    m
}

fn read(m: &PlainModel) -> Vec<Vec<f64>> {
    (0..m.len())
        .map(|i| {
            m.param::<f32>(i)
                .unwrap()
                .iter()
                .map(|&v| f64::from(v))
                .collect()
        })
        .collect()
}

fn options(s: Strategy, mp: MixedPrecision, cap: usize) -> ShardOptions {
    let mut o = ShardOptions::new(s).mixed_precision(mp);
    o.unit_cap_bytes = Some(cap);
    o
}

/// Every rank on the simulator; each rank's final masters.
fn on_host(c: &Case, s: Strategy, mp: MixedPrecision, cap: usize) -> Vec<Vec<Vec<f64>>> {
    let c = Arc::new(c.clone());
    let (out, _) = common::run_sim(SimConfig::new(c.world), move |rank| {
        let c = c.clone();
        async move {
            let rank: Arc<dyn Backend> = rank;
            let r = rank.rank();
            let mut m = model_for(&c, r);
            let mut sh = Sharded::new(rank, &mut m, sgd(), options(s, mp, cap))
                .await
                .unwrap();
            for step in &c.data {
                train_step(&c, &mut sh, &step[0][r]).await;
            }
            sh.copy_params_to(&mut m).await.unwrap();
            read(&m)
        }
    });
    out
}

/// Every rank on its own thread with an emulated device; final masters.
fn on_device(c: &Case, s: Strategy, mp: MixedPrecision, cap: usize) -> Vec<Vec<Vec<f64>>> {
    let cc = c.clone();
    on_emulated_ranks(c.world, c.seed, move |er| {
        let c = cc.clone();
        async move {
            let host = model_for(&c, er.rank);
            let mut m = DeviceModel::new(er.place);
            for p in 0..host.len() {
                let v = host.param::<f32>(p).unwrap();
                m.add_param(format!("p{p}"), vec![v.len()], v).unwrap();
            }
            let mut sh = Sharded::new(er.comm, &mut m, sgd(), options(s, mp, cap))
                .await
                .unwrap();
            for step in &c.data {
                train_step(&c, &mut sh, &step[0][er.rank]).await;
            }
            sh.copy_params_to(&mut m).await.unwrap();
            (0..m.len())
                .map(|i| {
                    let v = m.read_param::<f32>(i).unwrap();
                    v.iter().map(|&x| f64::from(x)).collect()
                })
                .collect()
        }
    })
}

fn check(got: &[Vec<Vec<f64>>], (want, tol): &(Vec<Vec<f64>>, f64)) -> Result<(), TestCaseError> {
    for (r, params) in got.iter().enumerate() {
        for (p, (g, w)) in params.iter().zip(want.iter()).enumerate() {
            for (k, (a, b)) in g.iter().zip(w).enumerate() {
                prop_assert!(
                    (a - b).abs() <= tol * (1.0 + b.abs()),
                    "rank {} param {} [{}]: {} vs {} (tolerance {})",
                    r,
                    p,
                    k,
                    a,
                    b,
                    tol
                );
            }
        }
    }
    Ok(())
}

fn policy(pick: usize) -> MixedPrecision {
    let mut mp = match pick % 4 {
        0 => MixedPrecision::bf16(),
        1 => MixedPrecision::bf16().reduce_dtype(DType::F32),
        2 => MixedPrecision::f16(),
        _ => MixedPrecision::f16().reduce_dtype(DType::F32),
    };
    // The property compares unscaled sums: scaling is tested below.
    mp.loss_scaling = None;
    mp
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn mixed_precision_on_n_ranks_equals_one_process_that_rounds_alike(
        c in cases(4),
        pick in 0usize..4,
        g in 0usize..8,
        mp in 0usize..4,
        cap in 8usize..400,
    ) {
        let (s, mp) = (strategy_for(c.world, pick, g), policy(mp));
        let want = reference(&c, mp);
        check(&on_host(&c, s, mp, cap), &want)?;
    }

    #[test]
    fn mixed_precision_on_the_emulated_device_equals_one_process(
        c in cases(3),
        pick in 0usize..4,
        g in 0usize..8,
        mp in 0usize..4,
        cap in 8usize..400,
    ) {
        let (s, mp) = (strategy_for(c.world, pick, g), policy(mp));
        let want = reference(&c, mp);
        check(&on_device(&c, s, mp, cap), &want)?;
    }
}

/// f16 with loss scaling, 2 ranks: a step where rank 1's gradient holds an
/// inf is skipped on both ranks (no update, no optimizer step counted) and
/// halves the scale; two good steps in a row double it again (torch's
/// GradScaler with growth_interval 2).
#[test]
fn an_inf_on_one_rank_skips_the_step_on_every_rank_and_backs_off() {
    for s in [Strategy::Zero1, Strategy::Fsdp] {
        let (out, _) = common::run_sim(SimConfig::new(2), move |rank| async move {
            let rank: Arc<dyn Backend> = rank;
            let r = rank.rank();
            let mut m = PlainModel::new();
            m.add_param("w", vec![5], &[1.0f32, 2.0, 3.0, 4.0, 5.0])
                .unwrap();
            let mut mp = MixedPrecision::f16();
            mp.loss_scaling = Some(LossScaling {
                init_scale: 1024.0,
                growth_interval: 2,
                ..LossScaling::default()
            });
            let opts = ShardOptions::new(s).mixed_precision(mp);
            let mut sh = Sharded::new(rank, &mut m, Sgd::new(0.5), opts)
                .await
                .unwrap();
            let mut log = Vec::new();
            for step in 0..4 {
                let scale = sh.loss_scale();
                let mut g = vec![f16::from_f64(0.25 * scale); 5];
                if step == 1 && r == 1 {
                    g[3] = f16::INFINITY;
                }
                sh.mark_ready(0, &g).unwrap();
                sh.step().await.unwrap();
                sh.copy_params_to(&mut m).await.unwrap();
                let w = m.param::<f32>(0).unwrap()[0];
                log.push((sh.step_skipped(), scale, sh.loss_scale(), w, sh.steps()));
            }
            log
        });
        for (r, log) in out.iter().enumerate() {
            let want = [
                (false, 1024.0, 1024.0, 0.875, 1),
                (true, 1024.0, 512.0, 0.875, 1),
                (false, 512.0, 512.0, 0.75, 2),
                (false, 512.0, 1024.0, 0.625, 3),
            ];
            assert_eq!(log.as_slice(), &want, "{s} rank {r}");
        }
    }
}

/// What is refused: a mixed policy on f64 parameters, a compute dtype that
/// is no half type, gradients in the master dtype.
#[test]
fn mixed_precision_mistakes_are_named() {
    let (out, _) = common::run_sim(SimConfig::new(1), |rank| async move {
        let rank: Arc<dyn Backend> = rank;
        let mut m = PlainModel::new();
        m.add_param("w", vec![2], &[1.0f64, 2.0]).unwrap();
        let opts = ShardOptions::new(Strategy::Fsdp).mixed_precision(MixedPrecision::bf16());
        let e1 = Sharded::new(rank.clone(), &mut m, Sgd::new(0.1), opts)
            .await
            .unwrap_err()
            .to_string();
        let mut m = PlainModel::new();
        m.add_param("w", vec![2], &[1.0f32, 2.0]).unwrap();
        let bad = MixedPrecision {
            param_dtype: DType::F32,
            ..MixedPrecision::bf16()
        };
        let opts = ShardOptions::new(Strategy::Fsdp).mixed_precision(bad);
        let e2 = Sharded::new(rank.clone(), &mut m, Sgd::new(0.1), opts)
            .await
            .unwrap_err()
            .to_string();
        let opts = ShardOptions::new(Strategy::Fsdp).mixed_precision(MixedPrecision::bf16());
        let mut sh = Sharded::new(rank, &mut m, Sgd::new(0.1), opts)
            .await
            .unwrap();
        let e3 = sh.mark_ready(0, &[1.0f32, 1.0]).unwrap_err().to_string();
        (e1, e2, e3)
    });
    let (e1, e2, e3) = &out[0];
    assert!(e1.contains("f32 master weights"), "{e1}");
    assert!(e2.contains("bf16 or f16"), "{e2}");
    assert!(
        e3.contains("mixed precision: gradients in bfloat16"),
        "{e3}"
    );
}
