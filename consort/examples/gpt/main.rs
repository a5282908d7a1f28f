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
//! The resumed run goes on with Adam's moments: the checkpoint's metadata
//! names the optimizer record written beside it (`OUT/optimizer-{step}.bpk`,
//! burn's format) and each parameter's burn id by module path, which the
//! new module adopts (burn keys optimizer state by parameter id).

mod data;
mod model;

use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Instant};

use clap::Parser;
use consort::{
    Backend, ProcessGroup, ReduceOp,
    burn::{
        BurnModel,
        burn::{
            Tensor,
            optim::{AdamConfig, GradientsParams, ModuleOptimizer, OptimizerRecord},
            tensor::{Device, Int, TensorData},
        },
    },
    ddp::{Ddp, DdpOptions, load_safetensors, save_safetensors},
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
    ]
    .contains(&0)
    {
        return Err(
            "--steps, --batch-size, --context, --world-size and --checkpoint-every must be at \
             least 1"
                .into(),
        );
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
                let world = SimWorld::new(SimConfig::new(args.world_size))?;
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
            other => Err(format!("unknown --backend {other:?}: expected sim or tcp").into()),
        }
    })
}

/// One rank's training.
async fn train(rank: Arc<dyn Backend>, args: Args) -> Result<(), BoxError> {
    let (r, world) = (rank.rank(), rank.world_size());
    let pg = ProcessGroup::new(rank.clone());
    let device = Device::default().autodiff();
    let sizes = model::Sizes {
        vocab: data::VOCAB.len(),
        context: args.context,
        d_model: 64,
        heads: 4,
        layers: 2,
    };
    let net = model::Gpt::new(sizes, &device);
    let mut host = BurnModel::from_module(&net)?;
    let (ckpt, metrics) = (
        args.out.join("checkpoint.safetensors"),
        args.out.join("metrics.json"),
    );
    let (start, mut history, saved) = resume(&mut host, &ckpt, &metrics, r == 0)?;
    let mut ddp = Ddp::new(rank.clone(), &mut host, DdpOptions::default()).await?;
    let mut net = host.push_values(net)?;
    let mut optim = AdamConfig::new().init();
    if let Some((record, ids)) = saved {
        net = host.adopt_ids(net, &ids)?;
        optim = optim.load_record(OptimizerRecord::load(args.out.join(record))?);
    }
    let mut windows = Windows::new(&args, world, r)?;
    let bar = (r == 0).then(|| {
        let b = indicatif::ProgressBar::new(args.steps as u64);
        b.set_position(start as u64);
        b
    });
    let begin = Instant::now();
    for step in start..args.steps {
        let (ids, targets) = windows.batch(step, &args, &device)?;
        let loss = net.loss(ids, targets);
        let mut mean = [loss.clone().into_scalar::<f32>()];
        let mut grads = GradientsParams::from_grads(loss.backward(), &net);
        host.pull_grads(&grads)?;
        ddp.sync_grads(&mut host).await?;
        host.push_grads(&mut grads)?;
        net = optim.step(args.lr, net, grads);
        pg.all_reduce(&mut mean, ReduceOp::Avg).await?;
        history.push((step + 1, f64::from(mean[0])));
        if let Some(b) = &bar {
            let tokens = (step + 1 - start) * world * args.batch_size * args.context;
            let rate = tokens as f64 / begin.elapsed().as_secs_f64();
            progress(b, step + 1, args.steps, mean[0], rate);
        }
        if (step + 1) % args.checkpoint_every == 0 || step + 1 == args.steps {
            if r == 0 {
                // burn's optimizer stepped the module: its values, not the
                // host copy's starting ones, go in the checkpoint.
                host.pull_values(&net)?;
                save(&args.out, &ckpt, step + 1, &host, &optim)?;
                std::fs::write(&metrics, serde_json::to_vec(&history)?)?;
            }
            // No rank leaves a step before the checkpoint of it exists.
            pg.barrier().await?;
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
    }
    Ok(())
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
    optim.to_record().save(out.join(&record))?;
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
/// values go into `host`).
fn resume(
    host: &mut BurnModel,
    ckpt: &std::path::Path,
    metrics: &std::path::Path,
    say: bool,
) -> Result<(usize, History, Saved), BoxError> {
    if !ckpt.exists() {
        return Ok((0, Vec::new(), None));
    }
    let (sd, meta) = load_safetensors(ckpt)?;
    host.load_torch_state_dict(&sd)?;
    let start = meta.get("step").and_then(|s| s.parse().ok()).unwrap_or(0);
    let saved = match (meta.get("optimizer"), meta.get("param_ids")) {
        (Some(record), Some(ids)) => Some((record.clone(), serde_json::from_str(ids)?)),
        _ => None,
    };
    if say {
        println!("resuming from {} at step {start}", ckpt.display());
    }
    let mut history: History = consort_comm::files::read_regular(metrics, 64 << 20)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    history.retain(|h| h.0 <= start);
    Ok((start, history, saved))
}

/// One line every 20 steps (shown with or without a terminal: the bar
/// hides without one), and the bar's message.
fn progress(b: &indicatif::ProgressBar, step: usize, steps: usize, loss: f32, rate: f64) {
    b.set_message(format!("loss {loss:.3}, {rate:.0} tokens/s"));
    b.set_position(step as u64);
    if step % 20 == 0 || step == steps {
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

    /// Step `step`'s inputs and targets, `[batch, context]` token ids.
    fn batch(
        &mut self,
        step: usize,
        args: &Args,
        device: &Device,
    ) -> Result<(Tensor<2, Int>, Tensor<2, Int>), BoxError> {
        if step / self.per_epoch != self.epoch {
            self.epoch = step / self.per_epoch;
            self.sampler.set_epoch(self.epoch as u64);
            self.picks = self.sampler.indices()?;
        }
        let k = step % self.per_epoch * args.batch_size;
        let picks = &self.picks[k..k + args.batch_size];
        let (x, y) = data::batch(&self.corpus, picks, args.context, self.stride);
        let shape = [args.batch_size, args.context];
        Ok((
            Tensor::<2, Int>::from_data(TensorData::new(x, shape), device),
            Tensor::<2, Int>::from_data(TensorData::new(y, shape), device),
        ))
    }
}

mod plot {
    //! The loss curve as a PNG, with the trainer's embedded font.

    use plotters::prelude::*;

    const FONT: &[u8] = include_bytes!("../train/assets/DejaVuSans.ttf");

    pub(crate) fn draw(path: &std::path::Path, history: &[(usize, f64)]) -> Result<(), String> {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| "the embedded font does not load".to_string())?;
        let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
        let root = BitMapBackend::new(path, (800, 450)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let first = history.first().map_or(0, |h| h.0);
        let last = history.last().map_or(1, |h| h.0).max(first + 1);
        let top = history.iter().map(|h| h.1).fold(0.0, f64::max).max(1e-3) * 1.1;
        let mut c = ChartBuilder::on(&root)
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
        c.draw_series(LineSeries::new(history.iter().copied(), &BLUE))
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))
    }
}
