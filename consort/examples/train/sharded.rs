//! The trainer under a sharded strategy (`--strategy zero1|zero2|fsdp|hsdp`):
//! the same samplers, steps, metrics and checkpoints as DDP's loop, with
//! the parameters, gradients and SGD state split across the ranks. Each
//! layer is one wrapping unit, gathered for use and dropped after.

use std::sync::Arc;

use consort::{
    Backend,
    ddp::{Sgd, ShardOptions, Sharded, Strategy, shard::Gathered},
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
        .unwrap_or(if world % 2 == 0 { world / 2 } else { 1 })
        .max(1);
    if world % g != 0 {
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
    let opts = ShardOptions::new(strategy).units(vec![vec![W1, B1], vec![W2, B2]]);
    let sgd = Sgd::new(f64::from(args.lr)).momentum(args.momentum);
    let mut sh = Sharded::new(backend, &mut model, sgd, opts).await?;
    resume(&mut sh, &mut job, args).await?;
    if let Some(b) = &job.bars {
        b.println(&format!("strategy {strategy}"));
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
        let acc = crate::accuracy(&params(&l1, &l2)?, &job, data);
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
    let params = params(&l1, &l2)?;
    let mut early = Ok(());
    let g = mlp::backward(&params, batch, |w2, b2| {
        early = sh.mark_ready(B2, b2).and_then(|()| sh.mark_ready(W2, w2));
    });
    early?;
    drop((l1, l2));
    sh.mark_ready(B1, &g.b1)?;
    sh.mark_ready(W1, &g.w1)?;
    sh.step().await?;
    Ok(g.loss_sum)
}

/// The MLP's parameters from its two gathered layers.
fn params<'a>(l1: &'a Gathered, l2: &'a Gathered) -> Result<Params<'a>, BoxError> {
    Ok(Params {
        w1: l1.param(W1)?,
        b1: l1.param(B1)?,
        w2: l2.param(W2)?,
        b2: l2.param(B2)?,
    })
}

/// [`train_rank`] with the model on the GPU (`--backend nccl --device
/// cuda`): parameters, gradients, momentum and gathered layers in device
/// memory, the forward and backward of [`crate::gpu`], SGD with momentum as
/// a CUDA kernel on each rank's shard.
#[cfg(feature = "nccl")]
pub(crate) async fn train_rank_gpu(
    b: Arc<consort::nccl::NcclBackend>,
    run: crate::gpu_loop::GpuRun,
    args: &Args,
    strategy: Strategy,
) -> Result<(), BoxError> {
    let crate::gpu_loop::GpuRun {
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
