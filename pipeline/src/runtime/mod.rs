//! The pipeline runtime: runs one rank's action list over any backend.
//!
//! [`PipelineRuntime`] owns the rank's stages (the user's [`Stage`]s), its
//! list from a [`Schedule`], and the messages between ranks (`wire`). A
//! step splits the batch into microbatches (torch's `tensor_split` along
//! the first dimension), runs the list, computes each microbatch's loss on
//! the last stage, and hands each stage's accumulated gradients, scaled by
//! `1 / microbatches` (torch's `scale_grads`), to the stage's
//! [`Stage::reduce_grads`] right after its last backward, where a
//! data-parallel reduction across replicas overlaps the rest of the
//! pipeline (torch's `REDUCE_GRAD`).
//!
//! Errors name the pipeline rank, the stage, the microbatch and the
//! action; a failure is sticky: later steps report the first.

mod tensor;
mod wire;

use std::{
    collections::{BTreeMap, HashMap},
    error::Error as StdError,
    future::Future,
    task::Poll,
};

use consort_comm::{CommError, Element, ProcessGroup};

pub use tensor::{Tensor, merge, split};
use wire::{Inbox, Msg, Outbox, RecvError, SendError};

use crate::schedule::{Action, Kind, Schedule, Step};

/// What a stage's own code returns on failure.
pub type StageError = Box<dyn StdError + Send + Sync>;

/// One pipeline stage: the user's forward and backward for a part of the
/// model, in any tensor library. The stage keeps, per microbatch, what
/// its backward needs, and accumulates its parameters' gradients over the
/// microbatches of a step.
pub trait Stage<T: Element>: Send {
    /// Runs the forward of `microbatch` on `inputs` (the previous stage's
    /// outputs; the first stage gets its microbatch of the batch) and
    /// returns the outputs, keeping what the backward needs.
    fn forward(
        &mut self,
        microbatch: usize,
        inputs: Vec<Tensor<T>>,
    ) -> Result<Vec<Tensor<T>>, StageError>;

    /// On the last stage: the loss of `microbatch`'s outputs against its
    /// target, kept for the backward that starts from it. The default
    /// refuses: a last stage must compute a loss.
    fn loss(
        &mut self,
        microbatch: usize,
        outputs: &[Tensor<T>],
        target: &Tensor<T>,
    ) -> Result<f64, StageError> {
        let _ = (microbatch, outputs, target);
        Err("this stage is the last one but computes no loss (implement Stage::loss)".into())
    }

    /// The backward of `microbatch`: `output_grads` are the gradients of
    /// its outputs (`None` on the last stage: from its loss). Adds the
    /// parameters' gradients to the accumulated ones and returns the
    /// gradients of the inputs (the first stage may return none).
    fn backward(
        &mut self,
        microbatch: usize,
        output_grads: Option<Vec<Tensor<T>>>,
    ) -> Result<Vec<Tensor<T>>, StageError>;

    /// The zero-bubble schedules' first half of a backward: the inputs'
    /// gradients only, the weights' later in [`Stage::backward_weight`].
    /// The default runs the whole backward here (correct, with less
    /// overlap).
    fn backward_input(
        &mut self,
        microbatch: usize,
        output_grads: Option<Vec<Tensor<T>>>,
    ) -> Result<Vec<Tensor<T>>, StageError> {
        self.backward(microbatch, output_grads)
    }

    /// The weights' gradients of a microbatch whose
    /// [`Stage::backward_input`] ran. The default does nothing (its
    /// `backward_input` did them).
    fn backward_weight(&mut self, microbatch: usize) -> Result<(), StageError> {
        let _ = microbatch;
        Ok(())
    }

    /// Before the stage's first action in a step (torch's `UNSHARD`): an
    /// FSDP stage gathers its parameters here. The default does nothing.
    fn unshard(&mut self) -> impl Future<Output = Result<(), StageError>> + Send {
        async { Ok(()) }
    }

    /// After each of this stage's actions, before its results move on: a
    /// stage whose compute runs elsewhere (a device stream, a simulated
    /// clock) waits for it here. The default does nothing.
    fn settle(&mut self, action: &Action) -> impl Future<Output = Result<(), StageError>> + Send {
        let _ = action;
        async { Ok(()) }
    }

    /// After the stage's last backward in a step (torch's `REDUCE_GRAD`):
    /// multiply the accumulated gradients by `scale` (`1 / microbatches`,
    /// so that they are the batch mean when the loss is a microbatch
    /// mean), then reduce them across data-parallel replicas if there are
    /// any (DDP's all_reduce, FSDP's reduce_scatter).
    fn reduce_grads(&mut self, scale: f64) -> impl Future<Output = Result<(), StageError>> + Send;

    /// After [`Stage::reduce_grads`] (torch's `RESHARD`): an FSDP stage
    /// frees its gathered parameters. The default does nothing.
    fn reshard(&mut self) -> impl Future<Output = Result<(), StageError>> + Send {
        async { Ok(()) }
    }
}

/// Why a pipeline step failed.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The runtime or a step was given something it cannot use.
    #[error("pipeline rank {rank}: {reason}")]
    Usage {
        /// This rank in the pipeline group.
        rank: usize,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The user's stage code failed.
    #[error("pipeline rank {rank}, {at}: the stage failed: {source}")]
    Stage {
        /// This rank in the pipeline group.
        rank: usize,
        /// The action, its stage and microbatch.
        at: String,
        /// The stage's error.
        source: StageError,
    },
    /// Sending or receiving between stages failed.
    #[error("pipeline rank {rank}, {at}: {source}")]
    Comm {
        /// This rank in the pipeline group.
        rank: usize,
        /// The action, its stage and microbatch, and the message.
        at: String,
        /// The backend's error (a lost peer names the peer).
        source: Box<CommError>,
    },
    /// An earlier step failed; the pipeline cannot go on.
    #[error("pipeline rank {rank}: an earlier step failed, so this one cannot run: {first}")]
    Failed {
        /// This rank in the pipeline group.
        rank: usize,
        /// The first failure.
        first: String,
    },
}

/// What a step returns on the rank that holds the last stage.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput<T> {
    /// Each microbatch's loss, in microbatch order (empty on other ranks).
    pub losses: Vec<f64>,
    /// The last stage's outputs, merged along the batch (empty on other
    /// ranks).
    pub outputs: Vec<Tensor<T>>,
}

/// Runs one pipeline rank's schedule, step after step.
pub struct PipelineRuntime<T: Element, S: Stage<T>> {
    pg: ProcessGroup,
    schedule: Schedule,
    steps: Vec<Step>,
    stages: BTreeMap<usize, S>,
    outbox: Outbox<T>,
    inbox: Inbox<T>,
    failed: Option<String>,
}

/// Stages and microbatches the message tags can tell apart.
const MAX_STAGES: usize = 1 << 15;
const MAX_MICROBATCHES: usize = 1 << 16;

fn describe(a: &Action) -> String {
    let what = match a.kind {
        Kind::Forward => "forward",
        Kind::FullBackward => "backward",
        Kind::BackwardInput => "backward to the input",
        Kind::BackwardWeight => "backward to the weights",
    };
    format!(
        "{what} {a} (stage {}, microbatch {})",
        a.stage, a.microbatch
    )
}

/// One step's per-microbatch data on this rank.
struct StepData<T> {
    inputs: Vec<Tensor<T>>,
    targets: Vec<Tensor<T>>,
    losses: Vec<Option<f64>>,
    outputs: Vec<Option<Vec<Tensor<T>>>>,
    out_shapes: HashMap<(usize, usize), Vec<Vec<usize>>>,
}

impl<T: Element, S: Stage<T>> PipelineRuntime<T, S> {
    /// This rank's runtime: `pg` is the pipeline group (its size is the
    /// schedule's pipeline ranks, this rank's group rank its place in the
    /// pipeline), `stages` the stages this rank holds, by stage index
    /// ([`Schedule::stages_of`]).
    pub fn new(
        pg: ProcessGroup,
        schedule: Schedule,
        stages: Vec<(usize, S)>,
    ) -> Result<Self, PipelineError> {
        let rank = pg.rank();
        let usage = |reason: String| PipelineError::Usage { rank, reason };
        if pg.world_size() != schedule.pp() {
            return Err(usage(format!(
                "the pipeline group has {} ranks but the schedule {} ({} pipeline ranks); make \
                 the schedule for the group's size",
                pg.world_size(),
                schedule.kind(),
                schedule.pp()
            )));
        }
        if schedule.num_stages() > MAX_STAGES || schedule.microbatches() > MAX_MICROBATCHES {
            return Err(usage(format!(
                "at most {MAX_STAGES} stages and {MAX_MICROBATCHES} microbatches; got {} and {}",
                schedule.num_stages(),
                schedule.microbatches()
            )));
        }
        let want = schedule.stages_of(rank);
        let mut have: Vec<usize> = stages.iter().map(|(s, _)| *s).collect();
        have.sort_unstable();
        if have != want {
            return Err(usage(format!(
                "this rank holds stages {want:?} in {} over {} ranks, but was given stages \
                 {have:?}",
                schedule.kind(),
                schedule.pp()
            )));
        }
        Ok(PipelineRuntime {
            steps: schedule.steps(rank),
            outbox: Outbox::new(pg.clone()),
            inbox: Inbox::new(),
            pg,
            schedule,
            stages: stages.into_iter().collect(),
            failed: None,
        })
    }

    /// The schedule this rank runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// This rank's stages, by stage index.
    pub fn stages(&self) -> &BTreeMap<usize, S> {
        &self.stages
    }

    /// This rank's stages, to step their optimizers between steps.
    pub fn stages_mut(&mut self) -> &mut BTreeMap<usize, S> {
        &mut self.stages
    }

    /// Whether this rank holds stage 0 (it needs the batch's inputs).
    pub fn holds_first(&self) -> bool {
        self.stages.contains_key(&0)
    }

    /// Whether this rank holds the last stage (it needs the targets).
    pub fn holds_last(&self) -> bool {
        self.stages.contains_key(&(self.schedule.num_stages() - 1))
    }

    /// One training step (torch's `schedule.step`): `input` is the batch on
    /// the rank holding stage 0, `target` its targets on the rank holding
    /// the last stage (other ranks pass `None`). Every stage's gradients
    /// are complete and reduced when it returns.
    pub async fn step(
        &mut self,
        input: Option<&Tensor<T>>,
        target: Option<&Tensor<T>>,
    ) -> Result<StepOutput<T>, PipelineError> {
        let rank = self.pg.rank();
        if let Some(first) = &self.failed {
            return Err(PipelineError::Failed {
                rank,
                first: first.clone(),
            });
        }
        let r = self.run(input, target).await;
        if let Err(e) = &r {
            self.failed = Some(e.to_string());
        }
        r
    }

    fn split_batch(
        &self,
        t: Option<&Tensor<T>>,
        what: &str,
        needed: bool,
    ) -> Result<Vec<Tensor<T>>, PipelineError> {
        let rank = self.pg.rank();
        match (t, needed) {
            (_, false) => Ok(Vec::new()),
            (None, true) => Err(PipelineError::Usage {
                rank,
                reason: format!(
                    "this rank holds the {what} stage, so step needs the batch's {what}s"
                ),
            }),
            (Some(t), true) => {
                split(t, self.schedule.microbatches()).map_err(|e| PipelineError::Usage {
                    rank,
                    reason: format!("the {what}s: {e}"),
                })
            }
        }
    }

    async fn run(
        &mut self,
        input: Option<&Tensor<T>>,
        target: Option<&Tensor<T>>,
    ) -> Result<StepOutput<T>, PipelineError> {
        let m = self.schedule.microbatches();
        let mut d = StepData {
            inputs: self.split_batch(input, "first", self.holds_first())?,
            targets: self.split_batch(target, "last", self.holds_last())?,
            losses: vec![None; m],
            outputs: (0..m).map(|_| None).collect(),
            out_shapes: HashMap::new(),
        };
        self.inbox.begin(&self.schedule, self.pg.rank());
        let mut unsharded = Vec::new();
        for i in 0..self.steps.len() {
            match self.steps[i] {
                Step::ReduceGrad(s) => self.reduce(s, m).await?,
                step => {
                    for a in step.actions() {
                        if !unsharded.contains(&a.stage) {
                            unsharded.push(a.stage);
                            let at = format!("unsharding stage {}", a.stage);
                            let stage = self.stages.get_mut(&a.stage).expect("checked in new");
                            stage.unshard().await.map_err(|e| self.stage_err(at, e))?;
                        }
                        self.act(&a, &mut d).await?;
                        // Sends still under way move on between actions
                        // too, not only while this rank waits.
                        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                        self.outbox
                            .drive(&mut cx)
                            .map_err(|(to, source)| PipelineError::Comm {
                                rank: self.pg.rank(),
                                at: format!("after {}: an earlier send to rank {to}", describe(&a)),
                                source,
                            })?;
                    }
                }
            }
        }
        self.outbox
            .flush()
            .await
            .map_err(|(peer, source)| PipelineError::Comm {
                rank: self.pg.rank(),
                at: format!("sending this step's last messages to rank {peer}"),
                source,
            })?;
        self.finish(d)
    }

    fn finish(&self, d: StepData<T>) -> Result<StepOutput<T>, PipelineError> {
        if !self.holds_last() {
            return Ok(StepOutput {
                losses: Vec::new(),
                outputs: Vec::new(),
            });
        }
        let losses: Vec<f64> = d.losses.into_iter().flatten().collect();
        let outs: Vec<Vec<Tensor<T>>> = d.outputs.into_iter().flatten().collect();
        let n = outs.first().map_or(0, Vec::len);
        let mut per_output: Vec<Vec<Tensor<T>>> = (0..n).map(|_| Vec::new()).collect();
        for mb in outs {
            for (k, t) in mb.into_iter().enumerate() {
                if let Some(v) = per_output.get_mut(k) {
                    v.push(t);
                }
            }
        }
        let outputs = per_output
            .into_iter()
            .map(merge)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|reason| PipelineError::Usage {
                rank: self.pg.rank(),
                reason: format!("merging the last stage's outputs: {reason}"),
            })?;
        Ok(StepOutput { losses, outputs })
    }

    fn stage_err(&self, at: String, source: StageError) -> PipelineError {
        PipelineError::Stage {
            rank: self.pg.rank(),
            at,
            source,
        }
    }

    async fn reduce(&mut self, s: usize, m: usize) -> Result<(), PipelineError> {
        let stage = self
            .stages
            .get_mut(&s)
            .expect("a rank's list names only its stages");
        let r = stage.reduce_grads(1.0 / m as f64).await;
        if let Err(e) = r {
            return Err(self.stage_err(format!("reducing stage {s}'s gradients"), e));
        }
        let stage = self
            .stages
            .get_mut(&s)
            .expect("a rank's list names only its stages");
        let r = stage.reshard().await;
        r.map_err(|e| self.stage_err(format!("resharding stage {s}"), e))
    }
}

impl<T: Element, S: Stage<T>> PipelineRuntime<T, S> {
    /// The stage that sends `msg`.
    fn source(msg: Msg) -> usize {
        match msg {
            Msg::Act { stage, .. } => stage - 1,
            Msg::Grad { stage, .. } => stage + 1,
        }
    }

    /// The stage that receives `msg`.
    fn dest(msg: Msg) -> usize {
        match msg {
            Msg::Act { stage, .. } | Msg::Grad { stage, .. } => stage,
        }
    }

    /// `msg`, for action `a`: kept here or received from its sender's rank.
    async fn get(
        &mut self,
        msg: Msg,
        a: &Action,
        d: &StepData<T>,
    ) -> Result<Vec<Tensor<T>>, PipelineError> {
        let rank = self.pg.rank();
        let peer = self.schedule.rank_of(Self::source(msg));
        if peer == rank {
            return self
                .inbox
                .take_kept(msg)
                .ok_or_else(|| PipelineError::Usage {
                    rank,
                    reason: format!("{}: {msg} were never made on this rank", describe(a)),
                });
        }
        let shapes = |m: Msg| match m {
            Msg::Grad { stage, mb } => d.out_shapes.get(&(stage, mb)).cloned(),
            Msg::Act { .. } => None,
        };
        // The sends made so far move on while this rank waits.
        let outbox = &mut self.outbox;
        let mut recv = std::pin::pin!(self.inbox.recv(&self.pg, peer, msg, shapes));
        let r = std::future::poll_fn(|cx| {
            if let Err((to, e)) = outbox.drive(cx) {
                return Poll::Ready(Err(Err((to, e))));
            }
            recv.as_mut().poll(cx).map(|r| r.map_err(Ok))
        })
        .await;
        r.map_err(|e| match e {
            Ok(RecvError { receiving, error }) => PipelineError::Comm {
                rank,
                at: format!(
                    "{}: receiving {receiving} from rank {peer} (stage {})",
                    describe(a),
                    Self::source(receiving)
                ),
                source: error,
            },
            Err((to, error)) => PipelineError::Comm {
                rank,
                at: format!("{}: an earlier send to rank {to}", describe(a)),
                source: error,
            },
        })
    }

    /// Hands `msg` to its stage: kept here, or queued for its rank.
    fn deliver(&mut self, msg: Msg, ts: Vec<Tensor<T>>, a: &Action) -> Result<(), PipelineError> {
        let rank = self.pg.rank();
        let peer = self.schedule.rank_of(Self::dest(msg));
        if peer == rank {
            self.inbox.keep(msg, ts);
            return Ok(());
        }
        self.outbox.send(peer, msg, ts).map_err(|e| match e {
            SendError::Usage(reason) => PipelineError::Usage {
                rank,
                reason: format!("{}: {reason}", describe(a)),
            },
            SendError::Comm((to, source)) => PipelineError::Comm {
                rank,
                at: format!("{}: sending {msg} to rank {to}", describe(a)),
                source,
            },
        })
    }

    /// The stage's [`Stage::settle`] after `a`.
    async fn settle(&mut self, a: &Action) -> Result<(), PipelineError> {
        let stage = self
            .stages
            .get_mut(&a.stage)
            .expect("a rank's list names only its stages");
        let r = stage.settle(a).await;
        r.map_err(|e| self.stage_err(describe(a), e))
    }

    async fn act(&mut self, a: &Action, d: &mut StepData<T>) -> Result<(), PipelineError> {
        let (s, mb) = (a.stage, a.microbatch);
        let last = self.schedule.num_stages() - 1;
        match a.kind {
            Kind::Forward => {
                let inputs = if s == 0 {
                    // Each microbatch enters stage 0 once a step.
                    vec![std::mem::replace(
                        &mut d.inputs[mb],
                        Tensor {
                            shape: Vec::new(),
                            data: Vec::new(),
                        },
                    )]
                } else {
                    self.get(Msg::Act { stage: s, mb }, a, d).await?
                };
                let stage = self
                    .stages
                    .get_mut(&s)
                    .expect("a rank's list names only its stages");
                let outs = stage.forward(mb, inputs);
                let outs = outs.map_err(|e| self.stage_err(describe(a), e))?;
                self.settle(a).await?;
                d.out_shapes
                    .insert((s, mb), outs.iter().map(|t| t.shape.clone()).collect());
                if s == last {
                    let stage = self.stages.get_mut(&s).expect("held");
                    let loss = stage.loss(mb, &outs, &d.targets[mb]);
                    let loss =
                        loss.map_err(|e| self.stage_err(format!("loss of {}", describe(a)), e))?;
                    d.losses[mb] = Some(loss);
                    d.outputs[mb] = Some(outs);
                } else {
                    self.deliver(Msg::Act { stage: s + 1, mb }, outs, a)?;
                }
            }
            Kind::FullBackward | Kind::BackwardInput => {
                let grads = if s == last {
                    None
                } else {
                    Some(self.get(Msg::Grad { stage: s, mb }, a, d).await?)
                };
                let stage = self.stages.get_mut(&s).expect("held");
                let r = if a.kind == Kind::FullBackward {
                    stage.backward(mb, grads)
                } else {
                    stage.backward_input(mb, grads)
                };
                let input_grads = r.map_err(|e| self.stage_err(describe(a), e))?;
                self.settle(a).await?;
                if s > 0 {
                    self.deliver(Msg::Grad { stage: s - 1, mb }, input_grads, a)?;
                }
            }
            Kind::BackwardWeight => {
                let stage = self.stages.get_mut(&s).expect("held");
                let r = stage.backward_weight(mb);
                r.map_err(|e| self.stage_err(describe(a), e))?;
                self.settle(a).await?;
            }
        }
        Ok(())
    }
}
