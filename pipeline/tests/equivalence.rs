//! Training through the pipeline runtime equals training in one process:
//! for random schedules, stage counts, microbatch counts, batch sizes
//! (divided by the microbatches or not) and layouts on a 2-D mesh of
//! (dp, pp) ranks (pipeline alone, PP x DDP, PP x FSDP), on the simulator,
//! the parameters after a few SGD steps equal the one-process run's
//! (gradient accumulation over the same microbatches, mean over
//! replicas) within float tolerance.

mod common;

use common::{Dp, Layer, MlpStage, layers, run_sim};
use consort_comm::{DeviceMesh, ProcessGroup};
use consort_pipeline::{PipelineRuntime, Schedule, ScheduleKind, Stage, Tensor, runtime::split};
use consort_sim::SimConfig;
use proptest::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Alone,
    Ddp,
    Fsdp,
}

#[derive(Clone, Debug)]
struct Case {
    kind: ScheduleKind,
    pp: usize,
    spr: usize,
    m: usize,
    dp: usize,
    mode: Mode,
    rows: usize,
    /// Layer widths: `layers_per_stage` layers per stage.
    dims: Vec<usize>,
    layers_per_stage: usize,
    steps: usize,
}

impl Case {
    fn stages(&self) -> usize {
        self.pp * self.spr
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        0..ScheduleKind::ALL.len(),
        1usize..=4,
        2usize..=3,
        1usize..=8,
        prop_oneof![
            Just((1, Mode::Alone)),
            Just((2, Mode::Ddp)),
            Just((2, Mode::Fsdp))
        ],
        0usize..=3,
        1usize..=2,
        any::<u64>(),
    )
        .prop_filter_map(
            "a schedule torch refuses",
            |(k, pp, spr, m, (dp, mode), extra, lps, seed)| {
                let kind = ScheduleKind::ALL[k];
                let spr = if kind.single_stage() {
                    1
                } else if kind.v_shaped() {
                    2
                } else {
                    spr
                };
                Schedule::new(kind, pp, m, spr).ok()?;
                let n = pp * spr * lps + 1;
                let dims = (0..n)
                    .map(|i| 1 + ((seed >> (i % 60)) as usize + i) % 3)
                    .collect();
                Some(Case {
                    kind,
                    pp,
                    spr,
                    m,
                    dp,
                    mode,
                    rows: m + extra,
                    dims,
                    layers_per_stage: lps,
                    steps: 2,
                })
            },
        )
}

/// Replica `d`'s batch at step `k`: inputs and targets.
fn batch(c: &Case, d: usize, k: usize) -> (Tensor<f64>, Tensor<f64>) {
    let (i, o) = (c.dims[0], *c.dims.last().unwrap());
    let v = |n: usize, salt: usize| -> Vec<f64> {
        (0..n)
            .map(|j| (((j * 7 + d * 13 + k * 29 + salt) % 17) as f64) / 8.5 - 1.0)
            .collect()
    };
    (
        Tensor::new(vec![c.rows, i], v(c.rows * i, 1)).unwrap(),
        Tensor::new(
            vec![c.rows, o],
            v(c.rows * o, 5).iter().map(|x| x * 0.9).collect(),
        )
        .unwrap(),
    )
}

const LR: f64 = 0.1;

/// Stage `s`'s layers.
fn stage_layers(all: &[Layer], c: &Case, s: usize) -> Vec<Layer> {
    all[s * c.layers_per_stage..(s + 1) * c.layers_per_stage].to_vec()
}

/// One process: every replica's microbatches through the whole model,
/// gradients accumulated, scaled by 1/m, averaged over replicas; SGD.
fn reference(c: &Case) -> (Vec<Layer>, Vec<f64>) {
    let mut model = layers(&c.dims, 7);
    let mut losses = Vec::new();
    for k in 0..c.steps {
        let mut sum: Option<Vec<Layer>> = None;
        for d in 0..c.dp {
            let mut st = MlpStage::new(model.clone(), true, Dp::None);
            let (x, y) = batch(c, d, k);
            let (xs, ys) = (split(&x, c.m).unwrap(), split(&y, c.m).unwrap());
            for (mb, (x, y)) in xs.into_iter().zip(ys).enumerate() {
                let out = st.forward(mb, vec![x]).unwrap();
                let l = st.loss(mb, &out, &y).unwrap();
                if d == 0 {
                    losses.push(l);
                }
                st.backward(mb, None).unwrap();
            }
            let g = st.grads.clone();
            sum = Some(match sum {
                None => g,
                Some(mut acc) => {
                    for (a, b) in acc.iter_mut().zip(&g) {
                        a.w.iter_mut().zip(&b.w).for_each(|(x, y)| *x += y);
                        a.b.iter_mut().zip(&b.b).for_each(|(x, y)| *x += y);
                    }
                    acc
                }
            });
        }
        let scale = 1.0 / (c.m * c.dp) as f64;
        for (l, g) in model.iter_mut().zip(sum.unwrap()) {
            l.w.iter_mut()
                .zip(&g.w)
                .for_each(|(p, d)| *p -= LR * d * scale);
            l.b.iter_mut()
                .zip(&g.b)
                .for_each(|(p, d)| *p -= LR * d * scale);
        }
    }
    (model, losses)
}

/// This rank's groups on the (dp, pp) mesh: pp innermost, as torch's
/// `init_device_mesh(..., (dp, pp), mesh_dim_names=("dp", "pp"))`.
async fn groups(world: &ProcessGroup, c: &Case) -> (ProcessGroup, ProcessGroup) {
    let mesh = DeviceMesh::init(world, &[c.dp, c.pp], &["dp", "pp"])
        .await
        .unwrap();
    (mesh.get_group("pp").unwrap(), mesh.get_group("dp").unwrap())
}

/// Each rank's stages' final parameters, and rank 0's losses on each rank.
async fn rank_body(c: Case, world: ProcessGroup) -> (Vec<(usize, Vec<f64>)>, Vec<f64>) {
    let (pp, dp) = groups(&world, &c).await;
    let d = world.rank() / c.pp;
    let schedule = Schedule::new(c.kind, c.pp, c.m, c.spr).unwrap();
    let all = layers(&c.dims, 7);
    let mode = |g: &ProcessGroup| match c.mode {
        Mode::Alone => Dp::None,
        Mode::Ddp => Dp::Ddp(g.clone()),
        Mode::Fsdp => Dp::Fsdp(g.clone()),
    };
    let stages: Vec<(usize, MlpStage)> = schedule
        .stages_of(pp.rank())
        .into_iter()
        .map(|s| {
            (
                s,
                MlpStage::new(stage_layers(&all, &c, s), s + 1 == c.stages(), mode(&dp)),
            )
        })
        .collect();
    let mut rt = PipelineRuntime::new(pp, schedule, stages).unwrap();
    let mut losses = Vec::new();
    for k in 0..c.steps {
        let (x, y) = batch(&c, d, k);
        let out = rt.step(Some(&x), Some(&y)).await.unwrap();
        if d == 0 {
            losses.extend(out.losses);
        }
        for st in rt.stages_mut().values_mut() {
            st.sgd(LR);
        }
    }
    let mut params = Vec::new();
    for (&s, st) in rt.stages_mut().iter_mut() {
        if c.mode == Mode::Fsdp {
            st.unshard().await.unwrap();
        }
        params.push((s, st.params()));
    }
    (params, losses)
}

fn check(c: &Case) -> Result<(), TestCaseError> {
    let (want, want_losses) = reference(c);
    let cc = c.clone();
    let out = run_sim(SimConfig::new(c.dp * c.pp), move |r| {
        let c = cc.clone();
        async move { rank_body(c, ProcessGroup::new(r)).await }
    });
    let mut losses = Vec::new();
    for (rank, (params, l)) in out.into_iter().enumerate() {
        losses.extend(l);
        for (s, got) in params {
            let w: Vec<f64> = stage_layers(&want, c, s)
                .iter()
                .flat_map(|l| l.w.iter().chain(&l.b).copied())
                .collect();
            prop_assert_eq!(got.len(), w.len());
            for (g, w) in got.iter().zip(&w) {
                prop_assert!(
                    (g - w).abs() < 1e-9,
                    "rank {rank} stage {s}: {g} vs {w} ({c:?})"
                );
            }
        }
    }
    // The last stage's rank in replica 0 reported every microbatch's loss.
    prop_assert_eq!(losses.len(), want_losses.len());
    for (g, w) in losses.iter().zip(&want_losses) {
        prop_assert!((g - w).abs() < 1e-9, "loss {g} vs {w}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn pipeline_training_equals_one_process(c in case()) {
        check(&c)?;
    }
}

#[test]
fn every_schedule_trains_as_one_process_under_ddp_and_fsdp() {
    for kind in ScheduleKind::ALL {
        for mode in [Mode::Alone, Mode::Ddp, Mode::Fsdp] {
            let spr = if kind.single_stage() { 1 } else { 2 };
            let c = Case {
                kind,
                pp: 2,
                spr,
                m: 4,
                dp: if mode == Mode::Alone { 1 } else { 2 },
                mode,
                rows: 6,
                dims: vec![3; 2 * spr + 1],
                layers_per_stage: 1,
                steps: 2,
            };
            check(&c).unwrap_or_else(|e| panic!("{kind} {mode:?}: {e}"));
        }
    }
}
