//! The trainer under a sharded strategy (`--strategy zero1|zero2|fsdp|hsdp`):
//! the same samplers, steps, metrics and checkpoints as DDP's loop, with
//! the parameters, gradients and SGD state split across the ranks. Each
//! layer is one wrapping unit, gathered for use and dropped after.

use std::sync::Arc;

use consort::{
    Backend, DType,
    ddp::{MixedPrecision, Sgd, ShardOptions, Sharded, Strategy, shard::Gathered},
    half::{bf16, f16},
};

use crate::{
    Args, BoxError, Saver,
    data::{Digits, Sample},
    mlp::{self, B1, B2, Params, W1, W2},
    prepare,
};

/// The strategy `--strategy` names for a world of `world` (`None`: DDP).
pub(crate) fn strategy(args: &Args, world: usize) -> Result<Option<Strategy>, BoxError> {
    Ok(Some(match args.strategy.as_str() {
        "ddp" => return Ok(None),
        "zero1" => Strategy::Zero1,
        "zero2" => Strategy::Zero2,
        "fsdp" => Strategy::Fsdp,
        "hsdp" => Strategy::Hsdp {
            shard_size: shard_size(args, world)?,
        },
        other => {
            return Err(format!(
                "unknown --strategy {other:?}: expected ddp, zero1, zero2, fsdp or hsdp"
            )
            .into());
        }
    }))
}

/// The policy `--mixed-precision` names (`None`: none); refused with DDP
/// and on the GPU (its kernels compute in f32).
pub(crate) fn mixed_precision(args: &Args) -> Result<Option<MixedPrecision>, BoxError> {
    let policy = match args.mixed_precision.as_str() {
        "none" => return Ok(None),
        "bf16" => MixedPrecision::bf16(),
        "f16" => MixedPrecision::f16(),
        other => {
            return Err(
                format!("unknown --mixed-precision {other:?}: expected none, bf16 or f16").into(),
            );
        }
    };
    if args.strategy == "ddp" {
        return Err(
            "--mixed-precision needs a sharded --strategy (zero1, zero2, fsdp, hsdp)".into(),
        );
    }
    if args.device != "cpu" {
        return Err(
            "--mixed-precision runs on --device cpu: the GPU trainer's kernels compute in f32"
                .into(),
        );
    }
    Ok(Some(policy))
}

/// HSDP's shard-group size: `--shard-size`, or one node's ranks when the
/// job spans several, or half the world.
fn shard_size(args: &Args, world: usize) -> Result<usize, BoxError> {
    let local = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&l| l > 0 && l < world);
    let g = args
        .shard_size
        .or(local)
        .unwrap_or(if world.is_multiple_of(2) {
            world / 2
        } else {
            1
        })
        .max(1);
    if !world.is_multiple_of(g) {
        return Err(format!(
            "--shard-size {g} must divide the world size {world} (HSDP shards within groups of \
             that many ranks)"
        )
        .into());
    }
    Ok(g)
}

/// One rank's training under `strategy`.
pub(crate) async fn train_rank(
    backend: Arc<dyn Backend>,
    args: &Args,
    data: &Digits,
    strategy: Strategy,
) -> Result<(), BoxError> {
    let (mut job, mut model) = prepare(backend.clone(), args, data).await?;
    let mut opts = ShardOptions::new(strategy).units(vec![vec![W1, B1], vec![W2, B2]]);
    let mixed = mixed_precision(args)?;
    if let Some(m) = mixed {
        opts = opts.mixed_precision(m);
    }
    let sgd = Sgd::new(f64::from(args.lr)).momentum(args.momentum);
    let mut sh = Sharded::new(backend, &mut model, sgd, opts).await?;
    resume(&mut sh, &mut job, args).await?;
    if let Some(b) = &job.bars {
        let mp = mixed.map_or(String::new(), |m| {
            format!(", {} mixed precision", m.param_dtype)
        });
        b.println(&format!("strategy {strategy}{mp}"));
    }
    for epoch in job.start..args.epochs {
        job.sampler.set_epoch(epoch as u64);
        let idx = job.sampler.indices()?;
        let mut loss = [0f64, 0f64];
        if let Some(b) = &job.bars {
            b.steps.reset();
        }
        for chunk in idx.chunks(job.local_batch) {
            let batch: Vec<&Sample> = chunk.iter().map(|&i| &data.train[i as usize]).collect();
            loss[0] += step(&mut sh, &batch).await?;
            loss[1] += batch.len() as f64;
            if let Some(b) = &job.bars {
                b.steps.inc(1);
            }
        }
        let (l1, l2) = (sh.gather(0).await?, sh.gather(1).await?);
        let vals = f32_params(&l1, &l2)?;
        let acc = crate::accuracy(&as_params(&vals), &job, data);
        drop((l1, l2));
        let save = Saver::<dyn Backend>::Sharded(&mut sh);
        job.end_epoch(args, save, epoch, (loss, acc)).await?;
    }
    job.finish(args)
}

/// Rank 0 decides whether to resume (so that every rank makes the same
/// calls); then the optimizer state and the step count come from the
/// sharded checkpoint, at whatever world size it was written, and must be
/// of the epoch the full checkpoint is.
async fn resume(sh: &mut Sharded, job: &mut crate::Job, args: &Args) -> Result<(), BoxError> {
    let dir = args.out.join("sharded");
    // Rank 0 decides, so that every rank makes the same calls.
    let mut found = [u8::from(
        job.pg.rank() == 0 && crate::resuming(args) && dir.join("index.json").exists(),
    )];
    job.pg.broadcast(&mut found, 0).await?;
    if found[0] == 1 {
        // The optimizer state (and the step count) from the sharded
        // checkpoint, at whatever world size it was written; it must be of
        // the epoch the full checkpoint is.
        let meta = sh.load_sharded(&dir).await?;
        let epoch = meta.get("epoch").and_then(|e| e.parse::<usize>().ok());
        if epoch != Some(job.start) {
            return Err(format!(
                "rank {}: {} holds epoch {epoch:?} but checkpoint.safetensors epoch {}: a save \
                 was interrupted between the two. Remove {} to resume from the full checkpoint \
                 (without the optimizer state)",
                job.pg.rank(),
                dir.display(),
                job.start,
                dir.display()
            )
            .into());
        }
    }
    Ok(())
}

/// One optimizer step on `batch`; returns its summed loss.
async fn step(sh: &mut Sharded, batch: &[&Sample]) -> Result<f64, BoxError> {
    let (l1, l2) = (sh.gather(0).await?, sh.gather(1).await?);
    let vals = f32_params(&l1, &l2)?;
    let params = as_params(&vals);
    let mut early = Ok(());
    let g = mlp::backward(&params, batch, |w2, b2| {
        early = mark(sh, B2, b2).and_then(|()| mark(sh, W2, w2));
    });
    early?;
    drop((l1, l2));
    mark(sh, B1, &g.b1)?;
    mark(sh, W1, &g.w1)?;
    sh.step().await?;
    Ok(g.loss_sum)
}

/// Parameter `p`'s f32 gradient to the strategy: as it is, or (mixed
/// precision) times the loss scale, rounded to the compute dtype, as a
/// backward in that dtype would produce it.
fn mark(sh: &mut Sharded, p: usize, g: &[f32]) -> Result<(), consort::ddp::DdpError> {
    let scale = sh.loss_scale() as f32;
    match sh.compute_dtype() {
        Some(DType::BF16) => {
            let v: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x * scale)).collect();
            sh.mark_ready(p, &v)
        }
        Some(DType::F16) => {
            let v: Vec<f16> = g.iter().map(|&x| f16::from_f32(x * scale)).collect();
            sh.mark_ready(p, &v)
        }
        _ => sh.mark_ready(p, g),
    }
}

/// The two gathered layers' parameters as f32 (`[w1, b1, w2, b2]`),
/// widened from mixed precision's compute dtype.
fn f32_params(l1: &Gathered, l2: &Gathered) -> Result<[Vec<f32>; 4], BoxError> {
    let get = |g: &Gathered, p: usize| -> Result<Vec<f32>, BoxError> {
        if let Ok(v) = g.param::<f32>(p) {
            return Ok(v.to_vec());
        }
        if let Ok(v) = g.param::<bf16>(p) {
            return Ok(v.iter().map(|x| x.to_f32()).collect());
        }
        Ok(g.param::<f16>(p)?.iter().map(|x| x.to_f32()).collect())
    };
    Ok([get(l1, W1)?, get(l1, B1)?, get(l2, W2)?, get(l2, B2)?])
}

/// The MLP's parameters, from [`f32_params`].
fn as_params(v: &[Vec<f32>; 4]) -> Params<'_> {
    Params {
        w1: &v[0],
        b1: &v[1],
        w2: &v[2],
        b2: &v[3],
    }
}

/// [`train_rank`] with the model on the GPU (`--backend nccl --device
/// cuda`): parameters, gradients, momentum and gathered layers in device
/// memory, the forward and backward of [`crate::gpu`], SGD with momentum as
/// a CUDA kernel on each rank's shard.
#[cfg(feature = "nccl")]
pub(crate) async fn train_rank_gpu(
    b: Arc<consort::nccl::NcclBackend>,
    run: crate::gpu_run::GpuRun,
    args: &Args,
    strategy: Strategy,
) -> Result<(), BoxError> {
    let crate::gpu_run::GpuRun {
        mut job,
        dev,
        mut model,
        g,
        train,
        test,
    } = run;
    let kernels = consort::cuda::CudaKernels::new(&dev)?;
    let opts = ShardOptions::new(strategy)
        .units(vec![vec![W1, B1], vec![W2, B2]])
        .kernels(kernels);
    let sgd = Sgd::new(f64::from(args.lr)).momentum(args.momentum);
    let mut sh = Sharded::new(b, &mut model, sgd, opts).await?;
    resume(&mut sh, &mut job, args).await?;
    if let Some(b) = &job.bars {
        b.println(&format!("strategy {strategy} on the GPU"));
    }
    for epoch in job.start..args.epochs {
        job.sampler.set_epoch(epoch as u64);
        let idx: Vec<u32> = job.sampler.indices()?.iter().map(|&i| i as u32).collect();
        if let Some(b) = &job.bars {
            b.steps.reset();
        }
        for chunk in idx.chunks(job.local_batch) {
            g.step_sharded(&mut sh, &model, &train, chunk).await?;
            if let Some(b) = &job.bars {
                b.steps.inc(1);
            }
        }
        let eval: Vec<u32> = job.eval.indices().map(|i| i as u32).collect();
        let (l1, l2) = (sh.gather(0).await?, sh.gather(1).await?);
        g.evaluate(crate::gpu::gathered_params(&l1, &l2)?, &test, &eval)?;
        let (loss_sum, correct) = g.take_counters()?;
        drop((l1, l2));
        let sums = ([loss_sum, idx.len() as f64], [correct, eval.len() as f64]);
        let save = Saver::<dyn Backend>::Sharded(&mut sh);
        job.end_epoch(args, save, epoch, sums).await?;
    }
    job.finish(args)
}
