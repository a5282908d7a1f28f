//! [`GpuRun`]: what a GPU rank of the trainer trains with, made once for
//! DDP's loop ([`crate::gpu_loop`]) and the sharded strategies' loop
//! ([`crate::sharded::train_rank_gpu`]).

use std::sync::Arc;

use crate::{Args, BoxError, Job, data::Digits, gpu, prepare};

/// What a GPU rank trains with: the job, its GPU and compute stream, the
/// model uploaded there, the kernels and the data sets in device memory.
pub(crate) struct GpuRun {
    pub(crate) job: Job,
    pub(crate) dev: Arc<consort::nccl::CudaDevice>,
    pub(crate) model: consort::ddp::DeviceModel,
    pub(crate) g: gpu::Gpu,
    pub(crate) train: gpu::DeviceSet,
    pub(crate) test: gpu::DeviceSet,
}

impl GpuRun {
    pub(crate) async fn new(
        b: &Arc<consort::nccl::NcclBackend>,
        args: &Args,
        data: &Digits,
    ) -> Result<Self, BoxError> {
        use consort::{Device, Placement, nccl::CudaDevice};
        let (job, host) = prepare(b.clone(), args, data).await?;
        let dev = CudaDevice::new(b.device())?;
        let p = Placement {
            device: dev.clone(),
            stream: dev.new_stream()?,
        };
        let model = gpu::upload_model(&p, &host)?;
        let g = gpu::Gpu::new(&dev, p.clone(), args.hidden, job.local_batch.max(256))?;
        let train = gpu::DeviceSet::upload(&p, &data.train)?;
        let test = gpu::DeviceSet::upload(&p, &data.test)?;
        Ok(GpuRun {
            job,
            dev,
            model,
            g,
            train,
            test,
        })
    }
}
