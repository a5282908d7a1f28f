//! The cost model against a measured run: the runtime on the simulator,
//! each action taking the model's time on the rank's simulated clock,
//! takes the step time the model predicts (the simulator adds only its
//! message latencies), so the bubble fractions agree too.

mod common;

use std::{sync::Arc, time::Duration};

use common::{Dp, MlpStage, layers};
use consort_comm::ProcessGroup;
use consort_pipeline::{
    Action, Kind, PipelineRuntime, Schedule, ScheduleKind, Stage, Tensor,
    cost::{Costs, simulate},
    runtime::StageError,
};
use consort_sim::{SimConfig, SimRank, SimWorld};

const MS: f64 = 1e-3;

/// An MLP stage whose every action takes `costs` on the simulated clock.
struct Timed {
    inner: MlpStage,
    rank: Arc<SimRank>,
    costs: Costs,
    /// Microbatches whose activations this rank holds now, and at most
    /// (shared by the rank's stages).
    held: Arc<std::sync::Mutex<(usize, usize)>>,
}

impl Stage<f64> for Timed {
    fn forward(&mut self, mb: usize, x: Vec<Tensor<f64>>) -> Result<Vec<Tensor<f64>>, StageError> {
        self.inner.forward(mb, x)
    }
    fn loss(&mut self, mb: usize, y: &[Tensor<f64>], t: &Tensor<f64>) -> Result<f64, StageError> {
        self.inner.loss(mb, y, t)
    }
    fn backward(
        &mut self,
        mb: usize,
        g: Option<Vec<Tensor<f64>>>,
    ) -> Result<Vec<Tensor<f64>>, StageError> {
        self.inner.backward(mb, g)
    }
    fn backward_input(
        &mut self,
        mb: usize,
        g: Option<Vec<Tensor<f64>>>,
    ) -> Result<Vec<Tensor<f64>>, StageError> {
        self.inner.backward_input(mb, g)
    }
    fn backward_weight(&mut self, mb: usize) -> Result<(), StageError> {
        self.inner.backward_weight(mb)
    }
    async fn reduce_grads(&mut self, scale: f64) -> Result<(), StageError> {
        self.inner.reduce_grads(scale).await
    }
    async fn settle(&mut self, a: &Action) -> Result<(), StageError> {
        let c = &self.costs;
        let secs = match a.kind {
            Kind::Forward => c.forward,
            Kind::FullBackward => c.backward_input + c.backward_weight,
            Kind::BackwardInput => c.backward_input,
            Kind::BackwardWeight => c.backward_weight,
        };
        // The host computes once the inputs it waited for are in.
        self.rank.synchronize();
        self.rank.compute(Duration::from_secs_f64(secs)).await;
        let mut h = self.held.lock().unwrap();
        match a.kind {
            Kind::Forward => h.0 += 1,
            Kind::FullBackward | Kind::BackwardWeight => h.0 -= 1,
            Kind::BackwardInput => {}
        }
        h.1 = h.1.max(h.0);
        // What the stage itself keeps agrees with the count.
        debug_assert!(self.inner.held() <= h.0);
        Ok(())
    }
}

/// One step of `s` on the simulator: its virtual length in seconds, and
/// each rank's most microbatches held at once.
fn measured(s: &Schedule, costs: Costs) -> (f64, Vec<usize>) {
    let world = SimWorld::new(SimConfig::new(s.pp())).unwrap();
    let peaks = world
        .run_each(|r| {
            let s = s.clone();
            async move {
                let rank = Arc::new(r);
                let pg = ProcessGroup::new(rank.clone());
                let all = layers(&vec![4; s.num_stages() + 1], 1);
                let held = Arc::new(std::sync::Mutex::new((0, 0)));
                let stages = s
                    .stages_of(pg.rank())
                    .into_iter()
                    .map(|i| {
                        let last = i + 1 == s.num_stages();
                        let inner = MlpStage::new(vec![all[i].clone()], last, Dp::None);
                        let (rank, held) = (rank.clone(), held.clone());
                        (
                            i,
                            Timed {
                                inner,
                                rank,
                                costs,
                                held,
                            },
                        )
                    })
                    .collect();
                let mut rt = PipelineRuntime::new(pg, s.clone(), stages).unwrap();
                let x = Tensor::new(vec![16, 4], vec![0.5; 64]).unwrap();
                rt.step(Some(&x), Some(&x)).await.unwrap();
                let (_, peak) = *held.lock().unwrap();
                peak
            }
        })
        .unwrap();
    (world.elapsed().as_secs_f64(), peaks)
}

#[test]
fn the_simulated_step_takes_the_time_the_cost_model_predicts() {
    let costs = Costs {
        forward: 10.0 * MS,
        backward_input: 10.0 * MS,
        backward_weight: 10.0 * MS,
        p2p: 0.0,
    };
    let cases = [
        (ScheduleKind::GPipe, 2, 2, 1),
        (ScheduleKind::GPipe, 4, 8, 1),
        (ScheduleKind::OneFOneB, 4, 8, 1),
        (ScheduleKind::Interleaved1F1B, 4, 8, 2),
        (ScheduleKind::LoopedBfs, 2, 4, 2),
        (ScheduleKind::InterleavedZeroBubble, 4, 8, 2),
        (ScheduleKind::ZbvZeroBubble, 4, 8, 2),
        (ScheduleKind::DualPipeV, 2, 8, 2),
    ];
    for (kind, p, m, spr) in cases {
        let s = Schedule::new(kind, p, m, spr).unwrap();
        let model = simulate(&s, &costs).unwrap();
        let (got, peaks) = measured(&s, costs);
        assert_eq!(
            peaks, model.peak_activations,
            "{kind}: activations held at the peak"
        );
        let work = 3.0 * costs.forward * (m * spr) as f64;
        let bubble = 1.0 - work / got;
        eprintln!(
            "{kind} p={p} m={m} spr={spr}: model {:.1} ms (bubble {:.3}), simulator {:.1} ms \
             (bubble {:.3}); peak activations per rank {peaks:?}",
            model.makespan / MS,
            model.bubble,
            got / MS,
            bubble
        );
        // The simulator adds message latencies (microseconds) only.
        assert!(
            got >= model.makespan - 1e-9,
            "{kind}: {got} < {}",
            model.makespan
        );
        assert!(
            got - model.makespan < 0.01 * model.makespan,
            "{kind}: {got} vs {}",
            model.makespan
        );
    }
}
