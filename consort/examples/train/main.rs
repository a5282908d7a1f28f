//! The example trainer: an MLP on the UCI handwritten digits, trained with
//! DistributedSampler and DDP, checkpointed every epoch, resumable.
//!
//! ```sh
//! # 4 simulated ranks in this process (the default)
//! cargo run --release -p consort --example train
//! # 4 processes over TCP
//! cargo build --release -p consort --examples
//! target/release/consort run --standalone --nproc-per-node 4 -- target/release/examples/train
//! ```
//!
//! The global batch (`--batch-size`) is split evenly across the ranks, so
//! the result does not depend on the world size. Rank 0 shows progress,
//! prints each epoch's loss and test accuracy, writes
//! `OUT/checkpoint.safetensors` every epoch and `OUT/training.png` and
//! `OUT/metrics.json` at the end.

mod canvas;
mod data;
#[cfg(feature = "nccl")]
mod gpu;
#[cfg(feature = "nccl")]
mod gpu_loop;
#[cfg(feature = "nccl")]
mod gpu_run;
mod mlp;
mod plot;
mod sharded;

use std::{collections::BTreeMap, path::PathBuf, process::ExitCode, sync::Arc};

use clap::Parser;
use consort::{
    Backend, ProcessGroup, ReduceOp,
    ddp::{Ddp, DdpError, DdpOptions, OnPeerLost, PlainModel, Sharded, load_safetensors},
    sampler::{DistributedSampler, EvalSampler},
    sim::{SimConfig, SimWorld},
    store::{MemStore, Store},
};
use data::{Digits, Sample};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use mlp::{B1, B2, Params, W1, W2};
use plot::Epoch;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Train an MLP on the UCI digits with DistributedSampler and DDP.
#[derive(Parser, Debug, Clone)]
#[command(name = "train")]
struct Args {
    /// sim (N ranks in this process), tcp (one process per rank, launched
    /// by `consort run` or torchrun), emulated (as tcp, through NCCL's
    /// model on the emulated device) or nccl. Default: tcp when launched
    /// (RANK is set), sim otherwise.
    #[arg(long)]
    backend: Option<String>,
    /// Ranks to simulate with `--backend sim`.
    #[arg(long, default_value_t = 4)]
    world_size: usize,
    /// Epochs to train (with --resume: the total, counting those done).
    #[arg(long, default_value_t = 20)]
    epochs: usize,
    /// Global batch size, split evenly across the ranks.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.2)]
    lr: f32,
    /// Hidden units.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Seed of the initial weights and the sampler's shuffle.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where checkpoints, the plot and the metrics go.
    #[arg(long, default_value = "runs/digits")]
    out: PathBuf,
    /// Continue from OUT/checkpoint.safetensors.
    #[arg(long)]
    resume: bool,
    /// Where the model computes: cpu, or cuda (with `--backend nccl`:
    /// parameters, activations and gradients on GPU LOCAL_RANK).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// How the model is split across ranks: ddp (replicated), zero1
    /// (optimizer state sharded), zero2 (and gradients), fsdp (and
    /// parameters, one unit per layer) or hsdp (fsdp within groups of
    /// --shard-size ranks, replicated across them).
    #[arg(long, default_value = "ddp")]
    strategy: String,
    /// HSDP's shard-group size. Default: LOCAL_WORLD_SIZE when launched on
    /// more than one node, otherwise half the world (or 1 when odd).
    #[arg(long)]
    shard_size: Option<usize>,
    /// What DDP does when a rank is lost: fail (a launcher restarts the
    /// world) or shrink (the survivors agree through the store and go on
    /// without it, redoing the step; the global batch is kept).
    #[arg(long, default_value = "fail")]
    on_peer_lost: String,
    /// SGD momentum (0: plain SGD). The sharded strategies keep its buffer
    /// sharded and in OUT/sharded/; DDP supports only 0.
    #[arg(long, default_value_t = 0.0)]
    momentum: f64,
    /// Mixed precision for a sharded --strategy (torch's FSDP2
    /// MixedPrecisionPolicy): none, bf16, or f16 (with dynamic loss
    /// scaling). The shards stay f32 master weights; each layer is gathered
    /// and its gradients reduced in that dtype. CPU only.
    #[arg(long, default_value = "none")]
    mixed_precision: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // consort's warnings (an abort that waited, a stream that did not
    // drain) and, with CONSORT_LOG=debug, its progress, on stderr.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CONSORT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The largest `--hidden`: a 64-65536-10 MLP has 4.9M parameters, far
/// more than the digits need.
const MAX_HIDDEN: usize = 1 << 16;

/// What the simulated ranks' models may take together (each rank holds
/// its parameters, gradients, DDP's buckets and checkpoint copies: about
/// 32 bytes a parameter): 8 GiB.
const MAX_SIM_MODEL_BYTES: u128 = 8 << 30;

/// Figures from the command line, checked before anything is allocated:
/// a NaN learning rate would train NaNs into a checkpoint that a resume
/// then refuses; a huge model or world would abort on allocation.
fn check_figures(args: &Args, backend: &str) -> Result<(), BoxError> {
    if args.epochs == 0 {
        return Err("--epochs 0: expected at least 1 epoch".into());
    }
    if !(args.lr.is_finite() && args.lr >= 0.0) {
        return Err(format!(
            "--lr {}: expected a finite rate, 0 or more, like 0.2",
            args.lr
        )
        .into());
    }
    if !(args.momentum.is_finite() && args.momentum >= 0.0) {
        return Err(format!(
            "--momentum {}: expected a finite number, 0 or more",
            args.momentum
        )
        .into());
    }
    if args.hidden == 0 || args.hidden > MAX_HIDDEN {
        return Err(format!("--hidden {}: expected 1 to {MAX_HIDDEN} units", args.hidden).into());
    }
    if backend != "sim" {
        return Ok(());
    }
    let world = args.world_size;
    if world == 0 || world > consort::MAX_LOCAL_WORLD_SIZE {
        return Err(format!(
            "--world-size {world}: expected 1 to {} simulated ranks",
            consort::MAX_LOCAL_WORLD_SIZE
        )
        .into());
    }
    let bytes = world as u128 * (75 * args.hidden as u128 + 10) * 32;
    if bytes > MAX_SIM_MODEL_BYTES {
        return Err(format!(
            "--world-size {world} with --hidden {} needs about {:.1} GiB for the simulated \
             ranks' models, over this example's {} GiB: choose fewer ranks or hidden units",
            args.hidden,
            bytes as f64 / (1u64 << 30) as f64,
            MAX_SIM_MODEL_BYTES >> 30
        )
        .into());
    }
    Ok(())
}

/// The options that only make sense together (CPU and GPU runs).
fn check_options(args: &Args, backend: &str) -> Result<(), BoxError> {
    check_figures(args, backend)?;
    if !matches!(args.on_peer_lost.as_str(), "fail" | "shrink") {
        return Err(format!(
            "unknown --on-peer-lost {:?}: expected fail or shrink",
            args.on_peer_lost
        )
        .into());
    }
    // The name now; HSDP's shard size once the world size is known.
    if backend == "sim" || args.strategy != "hsdp" {
        sharded::strategy(args, if backend == "sim" { args.world_size } else { 1 })?;
    }
    sharded::mixed_precision(args)?;
    if args.strategy == "ddp" && args.momentum != 0.0 {
        return Err(
            "--momentum needs a sharded --strategy (zero1, zero2, fsdp, hsdp): DDP's \
                    trainer applies plain SGD"
                .into(),
        );
    }
    Ok(())
}

async fn run(args: Args) -> Result<(), BoxError> {
    let data = Arc::new(data::load()?);
    let launched = std::env::var_os("RANK").is_some();
    let backend = args
        .backend
        .clone()
        .unwrap_or_else(|| if launched { "tcp" } else { "sim" }.into());
    let args = Arc::new(args);
    check_options(&args, &backend)?;
    match (backend.as_str(), args.device.as_str()) {
        ("nccl", "cuda") => return nccl_cuda(args, data).await,
        (_, "cpu") => {}
        (b, "cuda") => {
            return Err(format!(
                "--device cuda trains on the GPU through NCCL: use --backend nccl (not {b})"
            )
            .into());
        }
        (_, other) => {
            return Err(format!("unknown --device {other:?}: expected cpu or cuda").into());
        }
    }
    match backend.as_str() {
        "sim" => {
            let world = SimWorld::new(SimConfig::new(args.world_size))?;
            let store: Arc<dyn Store> =
                Arc::new(MemStore::new(std::time::Duration::from_secs(300)));
            let tasks = world.spawn_each(|r| {
                let store = Some(store.clone());
                train_any(Arc::new(r), args.clone(), data.clone(), store)
            });
            let mut first = None;
            for t in tasks {
                if let Err(e) = t.await.map_err(BoxError::from).and_then(|r| r.map(drop)) {
                    first.get_or_insert(e);
                }
            }
            first.map_or(Ok(()), Err)
        }
        "tcp" | "emulated" => {
            let dist = consort::init_from_env().await?;
            let pg = if backend == "tcp" {
                dist.process_group().await?
            } else {
                // NCCL's model on the emulated device, over TCP: the GPU
                // code paths of a launched job (call rules, the mismatch
                // check, the heartbeat), on CPU.
                dist.emulated_process_group().await?
            };
            let store = Some(dist.store().clone());
            let res = train_any(pg.backend().clone(), args, data, store).await;
            drop(pg);
            leave(dist, &res).await?;
            res.map(drop)
        }
        "nccl" => nccl(args, data).await,
        other => {
            Err(format!("unknown --backend {other:?}: expected sim, tcp, emulated or nccl").into())
        }
    }
}

/// One process per GPU, launched by `consort run`, torchrun or srun.
#[cfg(feature = "nccl")]
async fn nccl(args: Arc<Args>, data: Arc<Digits>) -> Result<(), BoxError> {
    let dist = consort::init_from_env().await?;
    let pg = dist.nccl_process_group().await?;
    let store = Some(dist.store().clone());
    let res = train_any(pg.backend().clone(), args, data, store).await;
    drop(pg);
    leave(dist, &res).await?;
    res.map(drop)
}

/// Leaves the job: ranks DDP shrank past are gone, and nobody waits for
/// them; after a failure, dead peers are waited for only a while, and the
/// failure is what the job reports.
async fn leave(dist: consort::Dist, res: &Result<Vec<usize>, BoxError>) -> Result<(), BoxError> {
    match res {
        Ok(lost) => dist.shutdown_without(lost).await?,
        Err(_) => dist.shutdown_failed(&[]).await,
    }
    Ok(())
}

/// One process per GPU, the model on the GPU.
#[cfg(feature = "nccl")]
async fn nccl_cuda(args: Arc<Args>, data: Arc<Digits>) -> Result<(), BoxError> {
    let dist = consort::init_from_env().await?;
    let b = Arc::new(dist.nccl_backend(None).await?);
    let res = gpu_loop::train_rank_gpu(b.clone(), &args, &data).await;
    let done = consort::Backend::synchronize(&*b).await;
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
async fn nccl_cuda(args: Arc<Args>, data: Arc<Digits>) -> Result<(), BoxError> {
    nccl(args, data).await
}

#[cfg(not(feature = "nccl"))]
async fn nccl(_: Arc<Args>, _: Arc<Digits>) -> Result<(), BoxError> {
    Err(
        "this trainer was built without NCCL: rebuild with `cargo build --release -p consort \
         --features nccl --examples` (it needs libnccl and a GPU at run time, not to build)"
            .into(),
    )
}

/// Whether rank 0 continues from the checkpoint: `--resume`, or a world
/// that a launcher restarted (`TORCHELASTIC_RESTART_COUNT` > 0) after a
/// failure, when there is a checkpoint to continue from.
fn resuming(args: &Args) -> bool {
    let restarted = std::env::var("TORCHELASTIC_RESTART_COUNT")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .is_some_and(|n| n > 0);
    args.resume || (restarted && args.out.join("checkpoint.safetensors").exists())
}

/// What rank 0 reads back from a checkpoint to continue.
fn read_checkpoint(args: &Args, model: &mut PlainModel) -> Result<(usize, Vec<Epoch>), BoxError> {
    let path = args.out.join("checkpoint.safetensors");
    if !path.exists() {
        return Err(format!(
            "--resume: no checkpoint at {}; run without --resume first (or pass the same --out)",
            path.display()
        )
        .into());
    }
    let (sd, meta) = load_safetensors(&path)?;
    model.load_state_dict(&sd)?;
    let epoch: usize = meta
        .get("epoch")
        .and_then(|e| e.parse().ok())
        .ok_or_else(|| format!("{} has no epoch in its metadata", path.display()))?;
    if epoch > args.epochs {
        return Err(format!(
            "{} is at epoch {epoch}, past --epochs {}: raise --epochs to train on, or start \
             afresh without --resume",
            path.display(),
            args.epochs
        )
        .into());
    }
    let history: Vec<Epoch> = meta
        .get("history")
        .map(|h| serde_json::from_str(h))
        .transpose()?
        .unwrap_or_default();
    check_history(&history, epoch).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((epoch, history))
}

/// Figures read back from a checkpoint are checked before use: epochs in
/// order and within the checkpoint's, losses finite and not negative,
/// accuracies between 0 and 100.
fn check_history(history: &[Epoch], epoch: usize) -> Result<(), String> {
    if history.len() > epoch {
        return Err(format!(
            "its history holds {} epochs, more than its epoch {epoch}",
            history.len()
        ));
    }
    for (i, e) in history.iter().enumerate() {
        let bad = |what: &str| format!("history entry {i} (epoch {}): {what}", e.epoch);
        if e.epoch == 0 || e.epoch > epoch || (i > 0 && e.epoch <= history[i - 1].epoch) {
            return Err(bad("epoch out of order or past the checkpoint's"));
        }
        if !e.train_loss.is_finite() || e.train_loss < 0.0 || e.train_loss > MAX_LOSS {
            return Err(bad(&format!(
                "training loss {} is not a loss (finite, 0 to {MAX_LOSS:e})",
                e.train_loss
            )));
        }
        if !(0.0..=100.0).contains(&e.test_accuracy) {
            return Err(bad(&format!(
                "test accuracy {} is not a percentage",
                e.test_accuracy
            )));
        }
    }
    Ok(())
}

/// The largest loss a checkpoint's history may hold (cross-entropy of a
/// real run is far below it).
const MAX_LOSS: f64 = 1e12;

struct Bars {
    multi: MultiProgress,
    epochs: ProgressBar,
    steps: ProgressBar,
}

impl Bars {
    fn new(epochs: usize, done: usize, steps: usize) -> Self {
        let multi = MultiProgress::new();
        let style = ProgressStyle::with_template("{prefix:>6} [{bar:40}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        let epochs = multi.add(ProgressBar::new(epochs as u64).with_style(style.clone()));
        epochs.set_prefix("epoch");
        epochs.set_position(done as u64);
        let steps = multi.add(ProgressBar::new(steps as u64).with_style(style));
        steps.set_prefix("step");
        Bars {
            multi,
            epochs,
            steps,
        }
    }

    /// A line above the bars (or plainly, when they are hidden: no TTY).
    fn println(&self, line: &str) {
        if self.multi.is_hidden() {
            println!("{line}");
        } else {
            let _ = self.multi.println(line);
        }
    }
}

/// What the epoch loop needs, on the CPU and on the GPU alike.
struct Job {
    pg: ProcessGroup,
    world: usize,
    local_batch: usize,
    start: usize,
    history: Vec<Epoch>,
    sampler: DistributedSampler,
    eval: EvalSampler,
    bars: Option<Bars>,
    path: PathBuf,
}

/// Checks the batch, builds the host model (rank 0 resumes it from the
/// checkpoint; `Ddp::new`'s broadcast then gives everyone its values), and
/// the samplers.
async fn prepare(
    backend: Arc<dyn Backend>,
    args: &Args,
    data: &Digits,
) -> Result<(Job, PlainModel), BoxError> {
    let pg = ProcessGroup::new(backend);
    let (rank, world) = (pg.rank(), pg.world_size());
    if args.batch_size == 0 || !args.batch_size.is_multiple_of(world) {
        return Err(format!(
            "--batch-size {} must be a positive multiple of the world size {world}, so that \
             every rank gets the same share of each global batch",
            args.batch_size
        )
        .into());
    }
    let local_batch = args.batch_size / world;
    let mut model = mlp::init(args.hidden, args.seed)?;
    let mut history = Vec::new();
    let mut header = [0u64, 0u64]; // [status, start epoch]
    if rank == 0 {
        std::fs::create_dir_all(&args.out)
            .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
        if resuming(args) {
            match read_checkpoint(args, &mut model) {
                Ok((epoch, h)) => {
                    header[1] = epoch as u64;
                    history = h;
                }
                Err(e) => {
                    header[0] = 1;
                    eprintln!("rank 0: {e}");
                }
            }
        }
    }
    pg.broadcast(&mut header, 0).await?;
    if header[0] != 0 {
        return Err(format!("rank {rank}: rank 0 could not resume (see its error)").into());
    }
    let start = header[1] as usize;
    let sampler =
        DistributedSampler::new(data.train.len() as u64, world, rank, true, args.seed, false)?;
    let eval = EvalSampler::new(data.test.len() as u64, world, rank)?;
    let steps = (sampler.len() as usize).div_ceil(local_batch);
    let bars = (rank == 0).then(|| Bars::new(args.epochs, start, steps));
    if let Some(b) = &bars {
        b.println(&format!(
            "training a 64-{}-10 MLP on {} digits ({} held out): {world} rank(s), global batch {}, \
             epochs {}..{}{}",
            args.hidden,
            data.train.len(),
            data.test.len(),
            args.batch_size,
            start + 1,
            args.epochs,
            if args.device == "cuda" {
                ", on the GPU"
            } else {
                ""
            }
        ));
    }
    let job = Job {
        pg,
        world,
        local_batch,
        start,
        history,
        sampler,
        eval,
        bars,
        path: args.out.join("checkpoint.safetensors"),
    };
    Ok((job, model))
}

impl Job {
    /// Sums `loss` ([sum, samples]) and `acc` ([correct, seen]) over the
    /// ranks, records the epoch, checkpoints through `save`, and reports.
    async fn end_epoch<B: Backend + ?Sized + 'static>(
        &mut self,
        args: &Args,
        save: Saver<'_, B>,
        epoch: usize,
        (mut loss, mut acc): ([f64; 2], [f64; 2]),
    ) -> Result<(), BoxError> {
        self.pg.all_reduce(&mut loss, ReduceOp::Sum).await?;
        self.pg.all_reduce(&mut acc, ReduceOp::Sum).await?;
        let e = Epoch {
            epoch: epoch + 1,
            train_loss: loss[0] / loss[1].max(1.0),
            test_accuracy: 100.0 * acc[0] / acc[1].max(1.0),
        };
        self.history.push(e.clone());
        let mut meta = BTreeMap::new();
        meta.insert("epoch".to_string(), (epoch + 1).to_string());
        meta.insert("history".to_string(), serde_json::to_string(&self.history)?);
        meta.insert("world_size".to_string(), self.world.to_string());
        meta.insert("strategy".to_string(), args.strategy.clone());
        meta.insert("format".to_string(), "pt".to_string());
        match save {
            Saver::Ddp(ddp, state) => ddp.save_checkpoint(&self.path, state, &meta).await?,
            Saver::Sharded(sh) => {
                sh.save_full_checkpoint(&self.path, &Default::default(), &meta)
                    .await?;
                sh.save_sharded(&args.out.join("sharded"), &meta).await?;
            }
        }
        if let Some(b) = &self.bars {
            b.epochs.inc(1);
            b.println(&format!(
                "epoch {:>3}/{}  train loss {:.4}  test accuracy {:.2}%",
                e.epoch, args.epochs, e.train_loss, e.test_accuracy
            ));
        }
        Ok(())
    }

    /// After `DdpError::Shrunk`: forgets the lost ranks and moves the job
    /// onto DDP's new group at (epoch, step).
    fn regroup(
        &mut self,
        ddp: &Ddp<dyn Backend>,
        who: &mut Survivors,
        lost: &[usize],
        args: &Args,
        data: &Digits,
        (epoch, step): (usize, usize),
    ) -> Result<(), BoxError> {
        who.forget(lost);
        let group = ddp.group().cloned().ok_or("a shrink without a group")?;
        self.shrink(group, args, data, epoch, step, lost)
    }

    /// After DDP shrank past lost ranks: the survivors' group, its world,
    /// the local batch for the same global batch, and epoch `epoch`
    /// re-sharded over the survivors (training goes on at step `step`).
    fn shrink(
        &mut self,
        group: Arc<dyn Backend>,
        args: &Args,
        data: &Digits,
        epoch: usize,
        step: usize,
        lost: &[usize],
    ) -> Result<(), BoxError> {
        let (rank, world) = (group.rank(), group.world_size());
        if !args.batch_size.is_multiple_of(world) {
            return Err(format!(
                "rank {rank}: lost rank(s) {lost:?}, and the global batch {} does not split over \
                 the {world} survivors; restart with a --batch-size that does",
                args.batch_size
            )
            .into());
        }
        self.pg = ProcessGroup::new(group);
        self.world = world;
        self.local_batch = args.batch_size / world;
        self.sampler =
            DistributedSampler::new(data.train.len() as u64, world, rank, true, args.seed, false)?;
        self.sampler.set_epoch(epoch as u64);
        self.eval = EvalSampler::new(data.test.len() as u64, world, rank)?;
        if rank == 0 {
            let steps = (self.sampler.len() as usize).div_ceil(self.local_batch);
            let bars = self
                .bars
                .get_or_insert_with(|| Bars::new(args.epochs, epoch, steps));
            bars.println(&format!(
                "lost rank(s) {lost:?}: continuing on {world} rank(s) at step {} of epoch {}, \
                 global batch {}",
                step + 1,
                epoch + 1,
                args.batch_size
            ));
        }
        Ok(())
    }

    /// Rank 0 draws the plot and writes the metrics.
    fn finish(self, args: &Args) -> Result<(), BoxError> {
        let Some(b) = self.bars else {
            return Ok(());
        };
        b.steps.finish_and_clear();
        b.epochs.finish_and_clear();
        let png = args.out.join("training.png");
        plot::draw(
            &png,
            &self.history,
            &format!(
                "MLP on UCI digits, {} rank(s), global batch {}",
                self.world, args.batch_size
            ),
        )?;
        // Never through a link planted in the output directory.
        let metrics = args.out.join("metrics.json");
        consort_comm::files::write_replacing(
            &metrics,
            serde_json::to_string_pretty(&self.history)?.as_bytes(),
        )
        .map_err(|e| format!("writing {}: {e}", metrics.display()))?;
        let last = self.history.last();
        b.println(&format!(
            "done: test accuracy {:.2}%, checkpoint {}, plot {}",
            last.map_or(0.0, |e| e.test_accuracy),
            self.path.display(),
            png.display()
        ));
        Ok(())
    }
}

/// Where an epoch's checkpoint goes: DDP's rank-0 file, or a sharded
/// model's full file plus its sharded directory.
enum Saver<'a, B: Backend + ?Sized + 'static> {
    Ddp(&'a mut Ddp<B>, &'a consort::ddp::StateDict),
    Sharded(&'a mut Sharded),
}

/// DDP, or the sharded strategy `--strategy` names. Returns the world
/// ranks DDP shrank past (`--on-peer-lost shrink`).
async fn train_any(
    backend: Arc<dyn Backend>,
    args: Arc<Args>,
    data: Arc<Digits>,
    store: Option<Arc<dyn Store>>,
) -> Result<Vec<usize>, BoxError> {
    match sharded::strategy(&args, backend.world_size())? {
        None => train_rank(backend, args, data, store).await,
        Some(s) => sharded::train_rank(backend, &args, &data, s)
            .await
            .map(|()| Vec::new()),
    }
}

async fn train_rank(
    backend: Arc<dyn Backend>,
    args: Arc<Args>,
    data: Arc<Digits>,
    store: Option<Arc<dyn Store>>,
) -> Result<Vec<usize>, BoxError> {
    let mut who = Survivors::new(backend.world_size());
    let (mut job, mut model) = prepare(backend.clone(), &args, &data).await?;
    let mut opts = DdpOptions::default();
    if let ("shrink", Some(store)) = (args.on_peer_lost.as_str(), store) {
        opts = opts.on_peer_lost(OnPeerLost::Shrink {
            store,
            timeout: std::time::Duration::from_secs(60),
        });
    }
    let mut ddp = Ddp::new(backend, &mut model, opts).await?;
    for epoch in job.start..args.epochs {
        job.sampler.set_epoch(epoch as u64);
        let mut idx = job.sampler.indices()?;
        let mut loss = [0f64, 0f64]; // [sum, samples]
        if let Some(b) = &job.bars {
            b.steps.reset();
        }
        let mut k = 0;
        while k * job.local_batch < idx.len() {
            let chunk = &idx[k * job.local_batch..((k + 1) * job.local_batch).min(idx.len())];
            let batch: Vec<&Sample> = chunk.iter().map(|&i| &data.train[i as usize]).collect();
            let params = Params::of(&model)?;
            let mut early = Ok(());
            let g = mlp::backward(&params, &batch, |w2, b2| {
                early = ddp.mark_ready(B2, b2).and_then(|()| ddp.mark_ready(W2, w2));
            });
            early?;
            ddp.mark_ready(B1, &g.b1)?;
            ddp.mark_ready(W1, &g.w1)?;
            match ddp.finish().await {
                Ok(()) => {}
                Err(DdpError::Shrunk { lost, cause, .. }) => {
                    tracing::warn!("lost rank(s) {lost:?}: {cause}");
                    // The step did not happen: redo it on the survivors,
                    // this epoch re-sharded over them.
                    job.regroup(&ddp, &mut who, &lost, &args, &data, (epoch, k))?;
                    idx = job.sampler.indices()?;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
            sgd(&mut model, &mut ddp, args.lr)?;
            loss[0] += g.loss_sum;
            loss[1] += batch.len() as f64;
            if let Some(b) = &job.bars {
                b.steps.inc(1);
            }
            k += 1;
        }
        let acc = accuracy(&Params::of(&model)?, &job, &data);
        let state = model.state_dict();
        let steps = idx.len().div_ceil(job.local_batch);
        let sums = (loss, acc);
        close_epoch(
            &mut job,
            &mut ddp,
            &mut who,
            &args,
            &data,
            &state,
            (epoch, steps),
            sums,
        )
        .await?;
    }
    job.finish(&args)?;
    Ok(who.lost)
}

/// Plain SGD with DDP's averaged gradients.
fn sgd(model: &mut PlainModel, ddp: &mut Ddp<dyn Backend>, lr: f32) -> Result<(), BoxError> {
    for i in [W1, B1, W2, B2] {
        let grad = ddp.grad::<f32>(i)?;
        for (p, d) in model.param_mut::<f32>(i)?.iter_mut().zip(grad) {
            *p -= lr * d;
        }
    }
    Ok(())
}

/// `[correct, seen]` on this rank's part of the test set.
fn accuracy(params: &Params<'_>, job: &Job, data: &Digits) -> [f64; 2] {
    let mut acc = [0f64, 0f64];
    for i in job.eval.indices() {
        let s = &data.test[i as usize];
        acc[0] += f64::from(u8::from(params.predict(&s.x) == s.y));
        acc[1] += 1.0;
    }
    acc
}

/// The epoch's metrics and checkpoint. A rank lost there makes the
/// survivors shrink too (`Ddp::shrink_after`), and they close the epoch
/// again on the smaller group.
#[allow(clippy::too_many_arguments)]
async fn close_epoch(
    job: &mut Job,
    ddp: &mut Ddp<dyn Backend>,
    who: &mut Survivors,
    args: &Args,
    data: &Digits,
    state: &consort::ddp::StateDict,
    (epoch, steps): (usize, usize),
    sums: ([f64; 2], [f64; 2]),
) -> Result<(), BoxError> {
    loop {
        let Err(e) = job
            .end_epoch(args, Saver::Ddp(&mut *ddp, state), epoch, sums)
            .await
        else {
            return Ok(());
        };
        let e = match e.downcast::<DdpError>() {
            Ok(d) => *d,
            Err(e) => match e.downcast::<consort::CommError>() {
                Ok(c) => DdpError::Comm {
                    what: "the epoch's metrics".into(),
                    source: c,
                },
                Err(e) => return Err(e),
            },
        };
        match ddp.shrink_after(e).await {
            DdpError::Shrunk { lost, .. } => {
                job.history.retain(|h| h.epoch != epoch + 1);
                job.regroup(ddp, who, &lost, args, data, (epoch, steps))?;
            }
            e => return Err(e.into()),
        }
    }
}

/// The world ranks still in DDP's group (in group order) and those lost.
struct Survivors {
    alive: Vec<usize>,
    lost: Vec<usize>,
}

impl Survivors {
    fn new(world: usize) -> Self {
        Survivors {
            alive: (0..world).collect(),
            lost: Vec::new(),
        }
    }

    /// Group ranks `lost` (of the group `alive` lists) are gone.
    fn forget(&mut self, lost: &[usize]) {
        self.lost
            .extend(lost.iter().filter_map(|&i| self.alive.get(i).copied()));
        let mut i = 0;
        self.alive.retain(|_| {
            i += 1;
            !lost.contains(&(i - 1))
        });
    }
}
