//! The GPT split into pipeline stages (`--pp N`), with data parallelism
//! across pipelines (`--dp M`): ranks on a (dp, pp) mesh, as torch's
//! `init_device_mesh(..., (dp, pp), mesh_dim_names=("dp", "pp"))`.
//!
//! Every rank builds the whole model's parts from one seed, in one order
//! (embeddings, blocks, final norm and head), and keeps its stages' parts:
//! so `--pp 1 --dp 1` is the unsplit model, with the same values. Stage 0
//! embeds the tokens, the last stage ends with the norm, the head and the
//! loss; blocks are shared out in order. Each stage accumulates burn's
//! gradients over the microbatches; at the schedule's `REDUCE_GRAD` they
//! are scaled to the batch mean and averaged across the replicas with
//! consort's DDP; then each stage's Adam steps.

use std::collections::HashMap;

use consort::{
    Backend, DeviceMesh, ProcessGroup, ReduceOp,
    burn::{
        BurnModel,
        burn::{
            self, Tensor,
            module::Module,
            nn::{
                Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig,
                attention::generate_autoregressive_mask,
                loss::CrossEntropyLossConfig,
                transformer::{
                    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
                },
            },
            optim::{AdamConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer},
            tensor::{Device, Int, TensorData},
        },
    },
    ddp::{Ddp, DdpOptions, ParamSet},
    pipeline::{PipelineRuntime, Schedule, Stage, Tensor as HostTensor, runtime::StageError},
};

use crate::{Args, BoxError, Windows, model::Sizes};

/// One stage's part of the GPT.
#[derive(Module, Debug)]
pub(crate) struct StageNet {
    tokens: Option<Embedding>,
    positions: Option<Embedding>,
    blocks: Vec<TransformerEncoder>,
    norm: Option<LayerNorm>,
    head: Option<Linear>,
}

/// `m` with its parameters' values drawn now: burn initializes a
/// parameter when it is first read, which would draw from the seeded
/// generator in whatever order the ranks' tasks happen to run.
fn drawn<M: Module>(m: M) -> Result<M, BoxError> {
    BurnModel::from_module(&m)?;
    Ok(m)
}

/// The whole model's parts, built and drawn in one order from `seed`,
/// shared out into `stages` stages (blocks in order; stage 0 embeds, the
/// last one has the head).
fn build(s: Sizes, stages: usize, seed: u64, device: &Device) -> Result<Vec<StageNet>, BoxError> {
    device.seed(seed);
    let tokens = drawn(EmbeddingConfig::new(s.vocab, s.d_model).init(device))?;
    let positions = drawn(EmbeddingConfig::new(s.context, s.d_model).init(device))?;
    let mut blocks: Vec<TransformerEncoder> = (0..s.layers)
        .map(|_| {
            drawn(
                TransformerEncoderConfig::new(s.d_model, 4 * s.d_model, s.heads, 1)
                    .with_dropout(0.0)
                    .with_norm_first(true)
                    .init(device),
            )
        })
        .collect::<Result<_, _>>()?;
    let norm = drawn(LayerNormConfig::new(s.d_model).init(device))?;
    let head = drawn(LinearConfig::new(s.d_model, s.vocab).init(device))?;
    let mut out: Vec<StageNet> = Vec::new();
    let mut first = Some((tokens, positions));
    for st in 0..stages {
        let take = (st + 1) * s.layers / stages - st * s.layers / stages;
        let (tokens, positions) = first.take().unzip();
        out.push(StageNet {
            tokens,
            positions,
            blocks: blocks.drain(..take).collect(),
            norm: None,
            head: None,
        });
    }
    if let Some(last) = out.last_mut() {
        last.norm = Some(norm);
        last.head = Some(head);
    }
    Ok(out)
}

/// What a microbatch's backward needs: the stage's input (a leaf that
/// requires its gradient; none on stage 0) and its output or loss.
enum Kept {
    Out(Option<Tensor<3>>, Tensor<3>),
    Loss(Option<Tensor<3>>, Tensor<1>),
}

/// One pipeline stage of the GPT on burn.
pub(crate) struct GptStage {
    net: StageNet,
    device: Device,
    kept: HashMap<usize, Kept>,
    accum: GradientsAccumulator<StageNet>,
    /// This step's gradients, scaled and averaged, for the optimizer.
    ready: Option<GradientsParams>,
    host: BurnModel,
    ddp: Option<Ddp<dyn Backend>>,
    optim: ModuleOptimizer,
}

fn host_tensor<const D: usize>(t: &Tensor<D>) -> Result<HostTensor<f32>, StageError> {
    let data = t
        .to_data()
        .try_to_vec::<f32>()
        .map_err(|e| format!("{e:?}"))?;
    HostTensor::new(t.dims().to_vec(), data).ok_or_else(|| "a tensor's size".into())
}

fn one(mut ts: Vec<HostTensor<f32>>) -> Result<HostTensor<f32>, StageError> {
    match (ts.pop(), ts.is_empty()) {
        (Some(t), true) => Ok(t),
        _ => Err("a GPT stage takes exactly one tensor".into()),
    }
}

fn ids(t: &HostTensor<f32>, device: &Device) -> Result<Tensor<2, Int>, StageError> {
    let [b, s] = t.shape[..] else {
        return Err(format!("token ids of shape {:?}, not [batch, context]", t.shape).into());
    };
    let v: Vec<i64> = t.data.iter().map(|&x| x as i64).collect();
    Ok(Tensor::<2, Int>::from_data(
        TensorData::new(v, [b, s]),
        device,
    ))
}

impl GptStage {
    async fn new(net: StageNet, device: Device, dp: &ProcessGroup) -> Result<Self, BoxError> {
        let mut host = BurnModel::from_module(&net)?;
        let ddp = if dp.world_size() > 1 {
            Some(Ddp::new(dp.backend().clone(), &mut host, DdpOptions::default()).await?)
        } else {
            None
        };
        Ok(GptStage {
            net,
            device,
            kept: HashMap::new(),
            accum: GradientsAccumulator::new(),
            ready: None,
            host,
            ddp,
            optim: AdamConfig::new().init(),
        })
    }

    /// Steps this stage's Adam with this step's gradients.
    fn step(&mut self, lr: f64) -> Result<(), BoxError> {
        let grads = self.ready.take().ok_or("no gradients this step")?;
        self.net = self.optim.step(lr, self.net.clone(), grads);
        Ok(())
    }

    fn embed_or_leaf(
        &self,
        x: HostTensor<f32>,
    ) -> Result<(Option<Tensor<3>>, Tensor<3>), StageError> {
        if let (Some(tok), Some(pos)) = (&self.net.tokens, &self.net.positions) {
            let ids = ids(&x, &self.device)?;
            let [b, s] = ids.dims();
            let at = Tensor::<1, Int>::arange(0..s as i64, &self.device)
                .reshape([1, s])
                .repeat_dim(0, b);
            return Ok((None, tok.forward(ids) + pos.forward(at)));
        }
        let [b, s, d] = x.shape[..] else {
            return Err(format!("hidden states of shape {:?}", x.shape).into());
        };
        let t =
            Tensor::<3>::from_data(TensorData::new(x.data, [b, s, d]), &self.device).require_grad();
        Ok((Some(t.clone()), t))
    }
}

impl Stage<f32> for GptStage {
    fn forward(
        &mut self,
        mb: usize,
        inputs: Vec<HostTensor<f32>>,
    ) -> Result<Vec<HostTensor<f32>>, StageError> {
        let (leaf, mut x) = self.embed_or_leaf(one(inputs)?)?;
        let [b, s, _] = x.dims();
        let mask = generate_autoregressive_mask(b, s, &self.device);
        for block in &self.net.blocks {
            x = block.forward(TransformerEncoderInput::new(x).mask_attn(mask.clone()));
        }
        if let (Some(norm), Some(head)) = (&self.net.norm, &self.net.head) {
            x = head.forward(norm.forward(x));
        }
        let out = host_tensor(&x)?;
        self.kept.insert(mb, Kept::Out(leaf, x));
        Ok(vec![out])
    }

    fn loss(
        &mut self,
        mb: usize,
        _outputs: &[HostTensor<f32>],
        target: &HostTensor<f32>,
    ) -> Result<f64, StageError> {
        let Some(Kept::Out(leaf, logits)) = self.kept.remove(&mb) else {
            return Err("loss before forward".into());
        };
        let [b, s, v] = logits.dims();
        let targets = ids(target, &self.device)?;
        let ce = CrossEntropyLossConfig::new().init(&self.device);
        let loss = ce.forward(logits.reshape([b * s, v]), targets.reshape([b * s]));
        let value = f64::from(loss.clone().into_scalar::<f32>());
        self.kept.insert(mb, Kept::Loss(leaf, loss));
        Ok(value)
    }

    fn backward(
        &mut self,
        mb: usize,
        grads: Option<Vec<HostTensor<f32>>>,
    ) -> Result<Vec<HostTensor<f32>>, StageError> {
        let (leaf, g) = match (self.kept.remove(&mb), grads) {
            (Some(Kept::Loss(leaf, loss)), None) => (leaf, loss.backward()),
            (Some(Kept::Out(leaf, y)), Some(g)) => {
                let g = one(g)?;
                let gy = Tensor::<3>::from_data(TensorData::new(g.data, g.shape), &self.device);
                (leaf, (y * gy).sum().backward())
            }
            _ => return Err("backward without its forward (or loss)".into()),
        };
        let dx = leaf.and_then(|x| x.grad(&g));
        self.accum
            .accumulate(&self.net, GradientsParams::from_grads(g, &self.net));
        match dx {
            Some(dx) => Ok(vec![host_tensor(&dx)?]),
            None => Ok(Vec::new()),
        }
    }

    async fn reduce_grads(&mut self, scale: f64) -> Result<(), StageError> {
        let mut grads = self.accum.grads();
        self.host.pull_grads(&mut grads)?;
        for i in 0..self.host.params().len() {
            for c in self.host.grad_bytes_mut(i).chunks_exact_mut(4) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * scale as f32;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        if let Some(ddp) = &mut self.ddp {
            ddp.sync_grads(&mut self.host).await?;
        }
        self.host.push_grads(&mut grads)?;
        self.ready = Some(grads);
        Ok(())
    }
}

/// One rank's pipeline training: its stages on the (dp, pp) mesh.
pub(crate) async fn train(
    rank: std::sync::Arc<dyn Backend>,
    args: Args,
    sizes: Sizes,
) -> Result<(), BoxError> {
    let world = ProcessGroup::new(rank);
    let (pp, dp) = (args.pp.unwrap_or(1), args.dp);
    if world.world_size() != pp * dp {
        return Err(format!(
            "--pp {pp} x --dp {dp} = {} ranks, but the job has {}",
            pp * dp,
            world.world_size()
        )
        .into());
    }
    let mesh = DeviceMesh::init(&world, &[dp, pp], &["dp", "pp"]).await?;
    let (pp_pg, dp_pg) = (mesh.get_group("pp")?, mesh.get_group("dp")?);
    let replica = mesh.get_local_rank("dp")?;
    let spr = if args.schedule.single_stage() { 1 } else { 2 };
    let schedule = Schedule::new(args.schedule, pp, args.microbatches, spr)?;
    let device = crate::gpus::burn_device(&args)?; // the CPU: main refuses --pp with cuda
    let mut nets: Vec<Option<StageNet>> = build(sizes, schedule.num_stages(), 42, &device)?
        .into_iter()
        .map(Some)
        .collect();
    let mut stages = Vec::new();
    for s in schedule.stages_of(pp_pg.rank()) {
        let net = nets[s].take().ok_or("a stage given twice")?;
        stages.push((s, GptStage::new(net, device.clone(), &dp_pg).await?));
    }
    let mut rt = PipelineRuntime::new(pp_pg, schedule, stages)?;
    let mut windows = Windows::new(&args, dp, replica)?;
    let report = rt.holds_last() && replica == 0;
    let begin = std::time::Instant::now();
    let mut times = Vec::new();
    for step in 0..args.steps {
        let t0 = std::time::Instant::now();
        let (x, y) = windows.raw(step, &args)?;
        let shape = vec![args.batch_size, args.context];
        let to_f32 =
            |v: Vec<i64>| HostTensor::new(shape.clone(), v.into_iter().map(|t| t as f32).collect());
        let (x, y) = (
            to_f32(x).ok_or("batch shape")?,
            to_f32(y).ok_or("batch shape")?,
        );
        let out = rt.step(Some(&x), Some(&y)).await?;
        for st in rt.stages_mut().values_mut() {
            st.step(args.lr)?;
        }
        times.push(t0.elapsed().as_secs_f64());
        if rt.holds_last() {
            let mut mean = [out.losses.iter().sum::<f64>() as f32 / out.losses.len().max(1) as f32];
            dp_pg.all_reduce(&mut mean, ReduceOp::Avg).await?;
            if report && ((step + 1) % 20 == 0 || step + 1 == args.steps) {
                let tokens = (step + 1) * dp * args.batch_size * args.context;
                let rate = tokens as f64 / begin.elapsed().as_secs_f64();
                println!(
                    "step {:>4}/{}: loss {:.4}, {rate:.0} tokens/s",
                    step + 1,
                    args.steps,
                    mean[0]
                );
            }
        }
    }
    if report {
        say_step_time(&args, (pp, dp), &mut times);
    }
    Ok(())
}

/// The median step after 5 warm-up steps, as scripts/torch_pipeline_gpt.py
/// times torch.
fn say_step_time(args: &Args, (pp, dp): (usize, usize), times: &mut Vec<f64>) {
    let mut steady = times.split_off(times.len().min(5));
    if steady.is_empty() {
        steady = std::mem::take(times);
    }
    steady.sort_by(f64::total_cmp);
    let median = steady.get(steady.len() / 2).copied().unwrap_or(f64::NAN);
    println!(
        "pipeline {} over {pp} stages x {dp} replicas, {} microbatches: {:.1} ms a step \
         (median after 5 warm-up steps)",
        args.schedule,
        args.microbatches,
        median * 1e3
    );
}
