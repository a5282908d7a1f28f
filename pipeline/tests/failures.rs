//! What goes wrong is named: a rank that dies mid-schedule on every
//! survivor, a stage's own error with its stage, microbatch and action,
//! and arguments the runtime cannot use, before any call.

mod common;

use std::time::Duration;

use common::{Dp, MlpStage, layers, run_sim};
use consort_comm::ProcessGroup;
use consort_pipeline::{PipelineError, PipelineRuntime, Schedule, ScheduleKind, Tensor};
use consort_sim::{
    SimConfig,
    fault::{Fault, Trigger},
};

fn stages(schedule: &Schedule, rank: usize, width: usize) -> Vec<(usize, MlpStage)> {
    let all = layers(&vec![width; schedule.num_stages() + 1], 3);
    schedule
        .stages_of(rank)
        .into_iter()
        .map(|s| {
            let last = s + 1 == schedule.num_stages();
            (s, MlpStage::new(vec![all[s].clone()], last, Dp::None))
        })
        .collect()
}

fn batch(rows: usize, width: usize) -> Tensor<f64> {
    Tensor::new(
        vec![rows, width],
        (0..rows * width).map(|i| i as f64 / 10.0).collect(),
    )
    .unwrap()
}

/// Runs `steps` steps of `kind` on `pp` simulated ranks; each rank's
/// first error.
fn run(cfg: SimConfig, kind: ScheduleKind, pp: usize, steps: usize) -> Vec<Option<String>> {
    run_sim(cfg, move |r| async move {
        let pg = ProcessGroup::new(r);
        let spr = if kind.single_stage() { 1 } else { 2 };
        let schedule = Schedule::new(kind, pp, 8, spr).unwrap();
        let st = stages(&schedule, pg.rank(), 3);
        let mut rt = PipelineRuntime::new(pg, schedule, st).unwrap();
        for _ in 0..steps {
            if let Err(e) = rt.step(Some(&batch(8, 3)), Some(&batch(8, 3))).await {
                return Some(e.to_string());
            }
        }
        None
    })
}

#[test]
fn a_rank_that_dies_mid_schedule_is_named_on_every_survivor() {
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::DualPipeV,
    ] {
        let cfg = SimConfig::new(4)
            .timeout(Duration::from_secs(5))
            .fault(Fault::Crash {
                rank: 1,
                at: Trigger::AfterMessages(6),
            });
        let out = run(cfg, kind, 4, 3);
        for (rank, e) in out.iter().enumerate() {
            if rank == 1 {
                continue;
            }
            let e = e
                .as_deref()
                .unwrap_or_else(|| panic!("{kind}: rank {rank} did not fail"));
            assert!(
                e.contains(&format!("pipeline rank {rank}")),
                "{kind} rank {rank}: {e}"
            );
            assert!(
                e.contains("rank 1")
                    && (e.contains("lost") || e.contains("crash") || e.contains("reset")),
                "{kind}: rank {rank} does not name the dead rank 1: {e}"
            );
        }
    }
}

#[test]
fn a_stage_error_names_its_stage_microbatch_and_action() {
    let out = run_sim(
        SimConfig::new(2).timeout(Duration::from_secs(5)),
        |r| async move {
            let pg = ProcessGroup::new(r);
            let schedule = Schedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap();
            let mut st = stages(&schedule, pg.rank(), 3);
            if pg.rank() == 1 {
                // Stage 1 expects 3 features; its input will have them, but the
                // target has the wrong width: the loss fails on microbatch 0.
                st[0].1 = MlpStage::new(layers(&[3, 3], 1), true, Dp::None);
            }
            let mut rt = PipelineRuntime::new(pg, schedule, st).unwrap();
            let first = rt.step(Some(&batch(4, 3)), Some(&batch(4, 2))).await;
            let again = rt.step(Some(&batch(4, 3)), Some(&batch(4, 2))).await;
            (
                first.err().map(|e| e.to_string()),
                again.err().map(|e| e.to_string()),
            )
        },
    );
    let (first, again) = &out[1];
    let first = first.as_deref().unwrap();
    assert!(
        first.contains("pipeline rank 1") && first.contains("loss of forward 1F0"),
        "{first}"
    );
    assert!(first.contains("stage 1, microbatch 0"), "{first}");
    // Sticky: the next step reports the first failure.
    assert!(
        again.as_deref().unwrap().contains("an earlier step failed"),
        "{again:?}"
    );
}

#[test]
fn arguments_the_runtime_cannot_use_are_refused_before_any_call() {
    let out = run_sim(SimConfig::new(2), |r| async move {
        let pg = ProcessGroup::new(r);
        let rank = pg.rank();
        let mut errs = Vec::new();
        let s3 = Schedule::new(ScheduleKind::GPipe, 3, 2, 1).unwrap();
        errs.push(PipelineRuntime::new(pg.clone(), s3.clone(), stages(&s3, rank, 2)).err());
        let s = Schedule::new(ScheduleKind::Interleaved1F1B, 2, 2, 2).unwrap();
        let mut wrong = stages(&s, rank, 2);
        wrong.pop();
        errs.push(PipelineRuntime::new(pg.clone(), s.clone(), wrong).err());
        let g = Schedule::new(ScheduleKind::GPipe, 2, 4, 1).unwrap();
        let mut rt = PipelineRuntime::new(pg, g.clone(), stages(&g, rank, 2)).unwrap();
        // Too few rows for 4 microbatches; no input at all on the first stage.
        errs.push(rt.step(Some(&batch(3, 2)), Some(&batch(3, 2))).await.err());
        errs.into_iter()
            .map(|e| match e {
                Some(PipelineError::Usage { reason, .. }) => reason,
                other => panic!("expected a usage error, got {other:?}"),
            })
            .collect::<Vec<_>>()
    });
    for errs in &out {
        assert!(errs[0].contains("3 pipeline ranks"), "{}", errs[0]);
        assert!(errs[1].contains("holds stages"), "{}", errs[1]);
        assert!(
            errs[2].contains("cannot be split into 4 microbatches"),
            "{}",
            errs[2]
        );
    }
}
