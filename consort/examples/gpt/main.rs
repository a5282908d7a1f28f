//! A small GPT-style language model (burn 0.22) trained with consort's DDP:
//! every rank draws its windows of a generated corpus through the
//! DistributedSampler, burn computes the gradients, consort averages them
//! across the ranks, and burn's Adam steps. It prints the loss and
//! tokens/s, draws the loss curve (`OUT/loss.png`), writes a checkpoint
//! (`OUT/checkpoint.safetensors`, in torch's names and layouts: module
//! paths, `Linear` weights as `[out, in]`, norms' `weight` and `bias`; see
//! `BurnModel::torch_state_dict`) and the loss so far
//! (`OUT/metrics.json`) every `--checkpoint-every` steps, and resumes from
//! them when run again.
//!
//! ```text
//! cargo run --release -p consort --features burn --example gpt              # 4 simulated ranks
//! cargo build --release -p consort --features burn --examples --bins
//! target/release/consort run --standalone --nproc-per-node 2 -- \
//!     target/release/examples/gpt --backend tcp                              # 2 processes over TCP
//! ```
//!
//! On GPUs (feature `burn-cuda`; where GitHub is unreachable add
//! `--config .cargo/burn-cuda.toml`), one process per GPU over NCCL, DDP
//! averaging burn's gradients where burn keeps them (`--host-copies` for
//! the adapter's host-copy path, to compare):
//!
//! ```text
//! cargo build --release -p consort --features burn-cuda --examples --bins
//! target/release/consort run --standalone --nproc-per-node 8 -- \
//!     target/release/examples/gpt --backend nccl --device cuda
//! ```
//!
//! The last line rank 0 prints is a JSON summary (`summary {...}`: world,
//! path, tokens/s after two warm-up steps, final loss). `torch_ddp.py`
//! beside this file trains the same model shape on the same data with
//! torch's DDP and prints the same line, for a comparison in one sitting.
//!
//! The resumed run goes on with Adam's moments: the checkpoint's metadata
//! names the optimizer record written beside it (`OUT/optimizer-{step}.bpk`,
//! burn's format) and each parameter's burn id by module path, which the
//! new module adopts (burn keys optimizer state by parameter id).

#[path = "../train/canvas.rs"]
mod canvas;
mod data;
mod gpus;
mod model;
mod pipe;

use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Instant};

use clap::Parser;
use consort::{
    Backend, ProcessGroup, ReduceOp,
    burn::{
        BurnModel,
        burn::{
            Tensor,
            optim::{AdamConfig, GradientsParams, ModuleOptimizer, OptimizerRecord},
            tensor::{Bytes, Device, Int, TensorData},
        },
    },
    ddp::{Ddp, DdpOptions, ParamSet, load_safetensors, save_safetensors},
    sampler::DistributedSampler,
    sim::{SimConfig, SimWorld},
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A small GPT trained with consort's DDP on burn.
#[derive(Parser, Clone, Debug)]
struct Args {
    /// sim (ranks in this process; the default when not launched) or tcp
    /// (one process per rank, under `consort run` or torchrun).
    #[arg(long)]
    backend: Option<String>,
    /// Simulated ranks (--backend sim).
    #[arg(long, default_value_t = 4)]
    world_size: usize,
    /// Optimizer steps in all (a resumed run continues to this many).
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Windows per rank per step.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Tokens the model sees at once.
    #[arg(long, default_value_t = 32)]
    context: usize,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Where the checkpoint and the plot go.
    #[arg(long, default_value = "gpt-out")]
    out: PathBuf,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 50)]
    checkpoint_every: usize,
    /// Pipeline stages' ranks: split the model's blocks into a pipeline
    /// (with `--dp`, on a (dp, pp) mesh). Without it: DDP.
    #[arg(long)]
    pp: Option<usize>,
    /// Pipeline replicas (data parallel across pipelines), with `--pp`.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Microbatches per step, with `--pp`.
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// Pipeline schedule, with `--pp` (torch's names: GPipe, 1F1B,
    /// Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
    /// DualPipeV; multi-stage ones hold two stages per rank).
    #[arg(long, default_value = "1F1B")]
    schedule: consort::pipeline::ScheduleKind,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// The model's width (embedding size; heads are 16 wide).
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    /// cpu (burn's CPU backend) or cuda (this rank's GPU: `LOCAL_RANK`'s,
    /// or NCCL's with `--backend nccl`; feature `burn-cuda`).
    #[arg(long, value_enum, default_value_t = Place::Cpu)]
    device: Place,
    /// With `--device cuda --backend nccl`: keep host copies of the
    /// parameters and gradients (the adapter's CPU path) instead of
    /// averaging in device memory, for comparison.
    #[arg(long)]
    host_copies: bool,
    /// This rank's GPU, when NCCL chose it (not a flag).
    #[arg(skip)]
    gpu: Option<usize>,
}

/// Where a rank's model lives.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// burn's CPU backend.
    Cpu,
    /// A GPU, through burn's CUDA backend.
    Cuda,
}

fn main() -> std::process::ExitCode {
    match run(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), BoxError> {
    let launched = std::env::var_os("RANK").is_some();
    let backend = args
        .backend
        .clone()
        .unwrap_or_else(|| if launched { "tcp" } else { "sim" }.into());
    if [
        args.steps,
        args.batch_size,
        args.context,
        args.world_size,
        args.checkpoint_every,
        args.dp,
        args.microbatches,
        args.layers,
        args.pp.unwrap_or(1),
        args.d_model,
    ]
    .contains(&0)
    {
        return Err(
            "--steps, --batch-size, --context, --world-size, --checkpoint-every, --pp, --dp, \
             --microbatches, --layers and --d-model must be at least 1"
                .into(),
        );
    }
    if !args.d_model.is_multiple_of(16) || args.d_model > 4096 {
        return Err(format!(
            "--d-model {} must be a multiple of 16 (the heads' width), at most 4096",
            args.d_model
        )
        .into());
    }
    if args.pp.is_some() && args.device == Place::Cuda {
        return Err("the pipelined GPT runs on the CPU here; --device cuda is for DDP".into());
    }
    if args.context > 512 {
        return Err(format!("--context {} is more than this example's 512", args.context).into());
    }
    std::fs::create_dir_all(&args.out)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match backend.as_str() {
            "sim" => {
                let n = args.pp.map_or(args.world_size, |pp| pp * args.dp);
                let world = SimWorld::new(SimConfig::new(n))?;
                for t in world.spawn_each(|r| train(Arc::new(r), args.clone())) {
                    t.await??;
                }
                Ok(())
            }
            "tcp" => {
                let dist = consort::init_from_env().await?;
                let pg = dist.process_group().await?;
                let res = train(pg.backend().clone(), args).await;
                drop(pg);
                dist.shutdown().await?;
                res
            }
            "nccl" => nccl(args).await,
            other => Err(format!("unknown --backend {other:?}: expected sim, tcp or nccl").into()),
        }
    })
}

/// One process per GPU over NCCL, launched by `consort run` or torchrun.
#[cfg(feature = "nccl")]
async fn nccl(mut args: Args) -> Result<(), BoxError> {
    let dist = consort::init_from_env().await?;
    let b = Arc::new(dist.nccl_backend(None).await?);
    args.gpu = Some(b.device());
    let res = train(b.clone(), args).await;
    let done = Backend::synchronize(&*b).await;
    let closed = b.shutdown();
    if res.is_ok() && done.is_ok() {
        dist.shutdown().await?;
    } else {
        dist.shutdown_failed(&[]).await;
    }
    res.and(done.map_err(BoxError::from))
        .and(closed.map_err(BoxError::from))
}

#[cfg(not(feature = "nccl"))]
async fn nccl(_: Args) -> Result<(), BoxError> {
    Err(
        "this example was built without NCCL: rebuild with `--features burn,nccl` \
         (or burn-cuda for --device cuda)"
            .into(),
    )
}

/// One rank's training.
async fn train(rank: Arc<dyn Backend>, args: Args) -> Result<(), BoxError> {
    let (r, world) = (rank.rank(), rank.world_size());
    let sizes = model::Sizes {
        vocab: data::VOCAB.len(),
        context: args.context,
        d_model: args.d_model,
        heads: args.d_model / 16,
        layers: args.layers,
    };
    if args.pp.is_some() {
        return pipe::train(rank, args, sizes).await;
    }
    let pg = ProcessGroup::new(rank.clone());
    let device = gpus::burn_device(&args)?;
    let net = model::Gpt::new(sizes, &device);
    // A checkpoint goes through a host copy on either path.
    let mut host = BurnModel::from_module(&net)?;
    let (ckpt, metrics) = (
        args.out.join("checkpoint.safetensors"),
        args.out.join("metrics.json"),
    );
    let (start, mut history, saved) = resume(&mut host, (&ckpt, &metrics), args.steps, r == 0)?;
    let (net, mut host) = gpus::ddp_model(net, host, &args, &device)?;
    let mut ddp = Ddp::new(rank.clone(), &mut host, DdpOptions::default()).await?;
    let mut net = host.push_values(net)?;
    let mut optim = AdamConfig::new().init();
    if let Some((record, ids)) = saved {
        net = host.adopt_ids(net, &ids)?;
        optim = optim.load_record(load_record(&args.out.join(record))?);
    }
    let mut windows = Windows::new(&args, world, r)?;
    let bar = (r == 0).then(|| {
        let b = indicatif::ProgressBar::new(args.steps as u64);
        b.set_position(start as u64);
        b
    });
    let begin = Instant::now();
    let mut timed = Timed::new(start, args.steps);
    for step in start..args.steps {
        timed.at(step);
        let (ids, targets) = windows.batch(step, &args, &device)?;
        let loss = net.loss(ids, targets);
        let mut mean = [loss.clone().into_scalar::<f32>()];
        let mut grads = GradientsParams::from_grads(loss.backward(), &net);
        host.pull_grads(&mut grads)?;
        ddp.sync_grads(&mut host).await?;
        host.push_grads(&mut grads)?;
        net = optim.step(args.lr, net, grads);
        pg.all_reduce(&mut mean, ReduceOp::Avg).await?;
        timed.done(step);
        history.push((step + 1, f64::from(mean[0])));
        if let Some(b) = &bar {
            let tokens = (step + 1 - start) * world * args.batch_size * args.context;
            let rate = tokens as f64 / begin.elapsed().as_secs_f64();
            progress(b, step + 1, args.steps, mean[0], rate);
        }
        if (step + 1) % args.checkpoint_every == 0 || step + 1 == args.steps {
            let saving = Instant::now();
            if r == 0 {
                checkpoint(&args.out, step + 1, (&mut host, &net), &optim, &history)?;
            }
            // No rank leaves a step before the checkpoint of it exists.
            pg.barrier().await?;
            timed.exclude(step, saving.elapsed());
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
        let plot = args.out.join("loss.png");
        plot::draw(&plot, &history)?;
        let last = history.last().map_or(f64::NAN, |h| h.1);
        println!(
            "{world} ranks, {} steps: loss {last:.4}; checkpoint {}, loss curve {}",
            args.steps,
            ckpt.display(),
            plot.display()
        );
        let summary = summary(&args, world, &host, &timed, last, &windows.corpus);
        println!("summary {summary}");
    }
    Ok(())
}

/// Rank 0's checkpoint after step `step`: the parameters burn's optimizer
/// stepped (not the host copy's starting ones) and the loss so far.
fn checkpoint(
    out: &std::path::Path,
    step: usize,
    (host, net): (&mut BurnModel, &model::Gpt),
    optim: &ModuleOptimizer,
    history: &History,
) -> Result<(), BoxError> {
    let snapshot;
    let of = if host.on_device() {
        snapshot = BurnModel::from_module(net)?;
        &snapshot
    } else {
        host.pull_values(net)?;
        &*host
    };
    save(out, &out.join("checkpoint.safetensors"), step, of, optim)?;
    // Never through a link planted in the output directory.
    let metrics = out.join("metrics.json");
    consort_comm::files::write_replacing(&metrics, &serde_json::to_vec(history)?)
        .map_err(|e| format!("writing {}: {e}", metrics.display()).into())
}

/// The run's last line, as torch_ddp.py prints it: where it ran, tokens/s
/// over the timed steps, the final loss, and what makes two runs
/// comparable (the model's size, a fingerprint of the corpus).
fn summary(
    args: &Args,
    world: usize,
    host: &BurnModel,
    timed: &Timed,
    last: f64,
    corpus: &[u8],
) -> serde_json::Value {
    let path = match (args.device, host.on_device()) {
        (Place::Cpu, _) => "cpu",
        (Place::Cuda, true) => "cuda, in device memory",
        (Place::Cuda, false) => "cuda, host copies",
    };
    serde_json::json!({
        "library": "consort",
        "world": world,
        "path": path,
        "d_model": args.d_model,
        "layers": args.layers,
        "parameters": host.params().iter().map(|p| p.numel()).sum::<usize>(),
        "timed_steps": timed.steps(),
        "tokens_per_s": timed.rate(world * args.batch_size * args.context),
        "final_loss": last,
        "corpus_fnv1a": format!("{:016x}", data::fnv1a(corpus)),
    })
}

/// The steps after two of warm-up (burn compiles its kernels on the
/// first), timed for the summary's tokens/s without the checkpoints
/// (torch_ddp.py writes none); all of them if there are fewer than four.
struct Timed {
    from: usize,
    to: usize,
    t0: Instant,
    /// Checkpoint time inside the timed steps.
    excluded: std::time::Duration,
    /// The timed steps' time, once the last is done.
    took: Option<std::time::Duration>,
}

impl Timed {
    fn new(start: usize, steps: usize) -> Self {
        let from = if steps - start >= 4 { start + 2 } else { start };
        Timed {
            from,
            to: steps,
            t0: Instant::now(),
            excluded: std::time::Duration::ZERO,
            took: None,
        }
    }

    /// Step `step` begins.
    fn at(&mut self, step: usize) {
        if step == self.from {
            self.t0 = Instant::now();
        }
    }

    /// Step `step`'s work is done (before its checkpoint).
    fn done(&mut self, step: usize) {
        if step + 1 == self.to {
            self.took = Some(self.t0.elapsed().saturating_sub(self.excluded));
        }
    }

    /// Step `step` spent `d` on its checkpoint.
    fn exclude(&mut self, step: usize, d: std::time::Duration) {
        if step >= self.from && step + 1 < self.to {
            self.excluded += d;
        }
    }

    fn steps(&self) -> usize {
        self.to - self.from
    }

    fn rate(&self, tokens_per_step: usize) -> f64 {
        let took = self.took.unwrap_or_else(|| self.t0.elapsed());
        (self.steps() * tokens_per_step) as f64 / took.as_secs_f64()
    }
}

/// Writes the checkpoint of step `step`: the optimizer record first, then
/// the parameters with the metadata that names it (the checkpoint is what
/// a resume trusts), then drops older records.
fn save(
    out: &std::path::Path,
    ckpt: &std::path::Path,
    step: usize,
    host: &BurnModel,
    optim: &ModuleOptimizer,
) -> Result<(), BoxError> {
    let record = format!("optimizer-{step}.bpk");
    // In memory, then written new and renamed into place: burn's own
    // `save` would open the path by name, through a planted link.
    let at = out.join(&record);
    consort_comm::files::write_replacing(&at, &optim.to_record().into_bytes()?)
        .map_err(|e| format!("writing {}: {e}", at.display()))?;
    let meta = BTreeMap::from([
        ("step".to_string(), step.to_string()),
        ("optimizer".to_string(), record.clone()),
        (
            "param_ids".to_string(),
            serde_json::to_string(&host.param_ids())?,
        ),
    ]);
    save_safetensors(ckpt, &host.torch_state_dict(), &meta)?;
    for e in std::fs::read_dir(out)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("optimizer-") && name.ends_with(".bpk") && name != record {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(())
}

/// What a resume restores besides the values: the optimizer record's
/// file name and the burn ids it is keyed by.
type Saved = Option<(String, BTreeMap<String, u64>)>;

/// The loss after each step so far.
type History = Vec<(usize, f64)>;

/// The step to start from, the loss so far and the optimizer state: from
/// the checkpoint and metrics of an earlier run, if there are any (its
/// values go into `host`). What the files say is checked before use: the
/// step within `--steps`, the optimizer record the one written beside the
/// checkpoint, the losses finite.
fn resume(
    host: &mut BurnModel,
    (ckpt, metrics): (&std::path::Path, &std::path::Path),
    steps: usize,
    say: bool,
) -> Result<(usize, History, Saved), BoxError> {
    if !ckpt.exists() {
        return Ok((0, Vec::new(), None));
    }
    let (sd, meta) = load_safetensors(ckpt)?;
    host.load_torch_state_dict(&sd)?;
    let bad = |what: String| format!("{}: {what}; remove it to start afresh", ckpt.display());
    let start: usize = meta
        .get("step")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no step in its metadata".into()))?;
    if start > steps {
        return Err(bad(format!("it is at step {start}, past --steps {steps}")).into());
    }
    let saved = match (meta.get("optimizer"), meta.get("param_ids")) {
        (Some(record), Some(ids)) => {
            // Only the record this run writes beside the checkpoint: the
            // name comes from a file, and must not lead anywhere else.
            if *record != format!("optimizer-{start}.bpk") {
                return Err(bad(format!("it names the optimizer record {record:?}")).into());
            }
            Some((record.clone(), serde_json::from_str(ids)?))
        }
        _ => None,
    };
    if say {
        println!("resuming from {} at step {start}", ckpt.display());
    }
    let mut history = read_history(metrics)?;
    history.retain(|h| h.0 <= start);
    Ok((start, history, saved))
}

/// The largest optimizer record a resume reads (this model's is a few MB).
const MAX_RECORD: u64 = 1 << 30;

/// burn's optimizer record at `path`: a regular file, read with a bound.
fn load_record(path: &std::path::Path) -> Result<OptimizerRecord, BoxError> {
    let bytes = consort_comm::files::read_regular(path, MAX_RECORD)
        .map_err(|e| format!("reading the optimizer record {}: {e}", path.display()))?;
    OptimizerRecord::from_bytes(Bytes::from_bytes_vec(bytes))
        .map_err(|e| format!("{} is not an optimizer record: {e:?}", path.display()).into())
}

/// The loss so far from `metrics` (none if it is absent), checked: steps
/// in order, losses finite and not negative.
fn read_history(metrics: &std::path::Path) -> Result<History, BoxError> {
    if !metrics.exists() {
        return Ok(Vec::new());
    }
    let bad = |what: String| format!("{}: {what}; remove it to start afresh", metrics.display());
    let bytes =
        consort_comm::files::read_regular(metrics, 64 << 20).map_err(|e| bad(e.to_string()))?;
    let history: History = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    for (i, &(step, loss)) in history.iter().enumerate() {
        if step == 0 || (i > 0 && step <= history[i - 1].0) {
            return Err(bad(format!("entry {i}: step {step} is out of order")).into());
        }
        if !(loss.is_finite() && (0.0..=1e12).contains(&loss)) {
            return Err(bad(format!("entry {i}: loss {loss} is not a loss (0 to 1e12)")).into());
        }
    }
    Ok(history)
}

/// One line every 20 steps (shown with or without a terminal: the bar
/// hides without one), and the bar's message.
fn progress(b: &indicatif::ProgressBar, step: usize, steps: usize, loss: f32, rate: f64) {
    b.set_message(format!("loss {loss:.3}, {rate:.0} tokens/s"));
    b.set_position(step as u64);
    if step.is_multiple_of(20) || step == steps {
        b.suspend(|| println!("step {step:>4}/{steps}: loss {loss:.4}, {rate:.0} tokens/s"));
    }
}

/// This rank's windows of the corpus, drawn through the sampler epoch by
/// epoch.
struct Windows {
    corpus: Vec<u8>,
    stride: usize,
    sampler: DistributedSampler,
    per_epoch: usize,
    epoch: usize,
    picks: Vec<u64>,
}

impl Windows {
    fn new(args: &Args, world: usize, rank: usize) -> Result<Self, BoxError> {
        let corpus = data::corpus(20_000);
        let stride = 3;
        let windows = data::windows(corpus.len(), args.context, stride);
        let per_rank = windows / world;
        if args.batch_size > per_rank {
            return Err(format!(
                "--batch-size {} is more than the {per_rank} windows each of {world} ranks has",
                args.batch_size
            )
            .into());
        }
        Ok(Windows {
            sampler: DistributedSampler::new(windows as u64, world, rank, true, 0, true)?,
            per_epoch: per_rank / args.batch_size,
            epoch: usize::MAX,
            picks: Vec::new(),
            corpus,
            stride,
        })
    }

    /// Step `step`'s inputs and targets, `[batch, context]` token ids,
    /// row-major.
    fn raw(&mut self, step: usize, args: &Args) -> Result<(Vec<i64>, Vec<i64>), BoxError> {
        if step / self.per_epoch != self.epoch {
            self.epoch = step / self.per_epoch;
            self.sampler.set_epoch(self.epoch as u64);
            self.picks = self.sampler.indices()?;
        }
        let k = step % self.per_epoch * args.batch_size;
        let picks = &self.picks[k..k + args.batch_size];
        Ok(data::batch(&self.corpus, picks, args.context, self.stride))
    }

    /// Step `step`'s inputs and targets, `[batch, context]` token ids.
    fn batch(
        &mut self,
        step: usize,
        args: &Args,
        device: &Device,
    ) -> Result<(Tensor<2, Int>, Tensor<2, Int>), BoxError> {
        let (x, y) = self.raw(step, args)?;
        let shape = [args.batch_size, args.context];
        Ok((
            Tensor::<2, Int>::from_data(TensorData::new(x, shape), device),
            Tensor::<2, Int>::from_data(TensorData::new(y, shape), device),
        ))
    }
}

mod plot {
    //! The loss curve as a PNG, with the trainer's embedded font, drawn in
    //! memory and written new (never through a link planted at `path`).

    use plotters::prelude::*;

    use crate::canvas::{on_axis, save_png, top};

    const FONT: &[u8] = include_bytes!("../train/assets/DejaVuSans.ttf");

    pub(crate) fn draw(path: &std::path::Path, history: &[(usize, f64)]) -> Result<(), String> {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| "the embedded font does not load".to_string())?;
        let err = |e: &dyn std::fmt::Display| e.to_string();
        save_png(path, (800, 450), |root| {
            root.fill(&WHITE).map_err(|e| err(&e))?;
            let first = history.first().map_or(0, |h| h.0);
            let last = history
                .last()
                .map_or(1, |h| h.0)
                .max(first.saturating_add(1));
            let losses = history.iter().map(|h| h.1).filter(|l| l.is_finite());
            let top = top(losses.fold(0.0, f64::max));
            let mut c = ChartBuilder::on(root)
                .caption(
                    "GPT on burn, consort DDP: training loss",
                    ("sans-serif", 20),
                )
                .margin(15)
                .x_label_area_size(40)
                .y_label_area_size(50)
                .build_cartesian_2d(first..last, 0.0..top)
                .map_err(|e| err(&e))?;
            c.configure_mesh()
                .x_desc("step")
                .y_desc("cross entropy")
                .draw()
                .map_err(|e| err(&e))?;
            let points = on_axis(history.iter().copied(), (0.0, top));
            c.draw_series(LineSeries::new(points, &BLUE))
                .map_err(|e| err(&e))?;
            Ok(())
        })
    }
}
