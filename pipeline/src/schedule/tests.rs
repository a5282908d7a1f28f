use super::*;

#[test]
fn actions_print_as_torch_prints_them() {
    let f = Action::new(0, Kind::Forward, 3);
    let b = Action::new(3, Kind::FullBackward, 1);
    assert_eq!(Step::Compute(f).to_string(), "0F3");
    assert_eq!(Step::Overlap(f, b).to_string(), "(0F3;3B1)OVERLAP_F_B");
    assert_eq!(Step::ReduceGrad(2).to_string(), "2REDUCE_GRAD");
    assert_eq!(Action::new(1, Kind::BackwardInput, 0).to_string(), "1I0");
    assert_eq!(Action::new(1, Kind::BackwardWeight, 0).to_string(), "1W0");
}

#[test]
fn names_round_trip() {
    for k in ScheduleKind::ALL {
        assert_eq!(k.name().parse::<ScheduleKind>(), Ok(k));
        assert_eq!(k.name().to_lowercase().parse::<ScheduleKind>(), Ok(k));
    }
    assert!(
        "zb".parse::<ScheduleKind>()
            .unwrap_err()
            .contains("DualPipeV")
    );
}

#[test]
fn stages_sit_in_a_loop_or_a_v() {
    let s = Schedule::new(ScheduleKind::Interleaved1F1B, 3, 3, 2).unwrap();
    assert_eq!(s.stages_of(0), vec![0, 3]);
    assert_eq!(s.stages_of(2), vec![2, 5]);
    let v = Schedule::new(ScheduleKind::ZbvZeroBubble, 3, 3, 2).unwrap();
    assert_eq!(v.stages_of(0), vec![0, 5]);
    assert_eq!(v.stages_of(2), vec![2, 3]);
}

#[test]
fn each_stage_reduces_its_gradients_once_after_its_last_backward() {
    for kind in ScheduleKind::ALL {
        let spr = if kind.single_stage() { 1 } else { 2 };
        let s = Schedule::new(kind, 2, 4, spr).unwrap();
        for r in 0..2 {
            let steps = s.steps(r);
            for stage in s.stages_of(r) {
                let at: Vec<usize> = (0..steps.len())
                    .filter(|&i| steps[i] == Step::ReduceGrad(stage))
                    .collect();
                assert_eq!(at.len(), 1, "{kind} rank {r} stage {stage}");
                let grads_after = steps[at[0]..].iter().flat_map(Step::actions).any(|a| {
                    a.stage == stage && matches!(a.kind, Kind::FullBackward | Kind::BackwardWeight)
                });
                assert!(!grads_after, "{kind} rank {r} stage {stage}");
            }
        }
    }
}

#[test]
fn arguments_torch_refuses_are_refused_naming_the_rule() {
    let e = Schedule::new(ScheduleKind::OneFOneB, 4, 3, 1).unwrap_err();
    assert!(
        e.to_string().contains("at least as many microbatches"),
        "{e}"
    );
    let e = Schedule::new(ScheduleKind::ZbvZeroBubble, 2, 4, 3).unwrap_err();
    assert!(e.to_string().contains("exactly 2 stages"), "{e}");
    let e = Schedule::new(ScheduleKind::GPipe, 2, 4, 2).unwrap_err();
    assert!(e.to_string().contains("one stage per rank"), "{e}");
    assert!(Schedule::new(ScheduleKind::GPipe, 0, 4, 1).is_err());
    assert!(Schedule::new(ScheduleKind::GPipe, 2, 0, 1).is_err());
    assert!(Schedule::new(ScheduleKind::GPipe, usize::MAX, usize::MAX, 1).is_err());
}
