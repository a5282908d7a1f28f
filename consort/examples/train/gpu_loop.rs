//! The GPU run of the trainer (`--backend nccl --device cuda`): what a
//! rank trains with, and DDP's loop on it; the sharded strategies' loop is
//! `sharded::train_rank_gpu`.

use std::sync::Arc;

use consort::{
    Backend,
    ddp::{Ddp, DdpOptions},
};

use crate::{Args, BoxError, Saver, data::Digits, gpu, gpu_run::GpuRun, sharded};

/// [`train_rank`] with the model on the GPU: the same samplers, steps,
/// metrics and checkpoints, the math in [`gpu`]; a sharded `--strategy`
/// runs [`sharded::train_rank_gpu`].
pub(crate) async fn train_rank_gpu(
    b: Arc<consort::nccl::NcclBackend>,
    args: &Args,
    data: &Digits,
) -> Result<(), BoxError> {
    let run = GpuRun::new(&b, args, data).await?;
    if let Some(s) = sharded::strategy(args, b.world_size())? {
        return sharded::train_rank_gpu(b, run, args, s).await;
    }
    let GpuRun {
        mut job,
        mut model,
        g,
        train,
        test,
        ..
    } = run;
    let mut ddp = Ddp::new(b, &mut model, DdpOptions::default()).await?;
    for epoch in job.start..args.epochs {
        job.sampler.set_epoch(epoch as u64);
        let idx: Vec<u32> = job.sampler.indices()?.iter().map(|&i| i as u32).collect();
        if let Some(b) = &job.bars {
            b.steps.reset();
        }
        for chunk in idx.chunks(job.local_batch) {
            g.step(&mut ddp, &model, &train, chunk, args.lr).await?;
            if let Some(b) = &job.bars {
                b.steps.inc(1);
            }
        }
        let eval: Vec<u32> = job.eval.indices().map(|i| i as u32).collect();
        g.evaluate(gpu::params_of(&model)?, &test, &eval)?;
        let (loss_sum, correct) = g.take_counters()?;
        let state = model.state_dict()?;
        let sums = ([loss_sum, idx.len() as f64], [correct, eval.len() as f64]);
        job.end_epoch(args, Saver::Ddp(&mut ddp, &state), epoch, sums)
            .await?;
    }
    job.finish(args)
}
