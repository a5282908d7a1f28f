//! Candle on CUDA beside the NCCL backend (feature `cuda`): the
//! [`Placement`] through which DDP reads and writes a candle model's GPU
//! memory, so that `CandleModel::from_varmap_on` needs no host copy.
//!
//! ```no_run
//! # use consort::candle::{candle_core, candle_nn};
//! # async fn demo(varmap: candle_nn::VarMap, gpu: candle_core::CudaDevice)
//! #     -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use consort::{ddp::{Ddp, DdpOptions}, candle::CandleModel};
//! let dist = consort::init_from_env().await?;
//! let nccl = Arc::new(dist.nccl_backend(None).await?);
//! let mut model = CandleModel::from_varmap_on(&varmap, consort::candle::placement(&gpu)?)?;
//! let mut ddp = Ddp::new(nccl, &mut model, DdpOptions::default()).await?;
//! // each step: let mut grads = loss.backward()?; model.pull_grads(&grads)?;
//! // ddp.sync_grads(&mut model).await?; model.push_grads(&mut grads)?;
//! # Ok(()) }
//! ```
//!
//! This module owns only that bridge; the device is the NCCL backend's
//! [`consort_nccl::CudaDevice`], on the same primary context candle uses.

use candle_core::backend::BackendDevice;
use consort_comm::{CommError, Placement};

/// The placement of a model on candle's GPU `gpu`: the NCCL backend's view
/// of that GPU (the same primary context candle uses), and candle's stream
/// (where candle's kernels write the gradients, and which DDP's copies are
/// ordered against), kept alive by the placement.
/// `BackendUnavailable` without a CUDA driver or that GPU.
pub fn placement(gpu: &candle_core::CudaDevice) -> Result<Placement, CommError> {
    let ordinal = match gpu.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
        other => {
            return Err(CommError::invalid(format!(
                "{other:?} is not a CUDA device"
            )));
        }
    };
    let device = consort_nccl::CudaDevice::new(ordinal)?;
    let stream = gpu.cuda_stream();
    let id = stream.cu_stream() as u64;
    // Candle destroys a stream of its own (`CudaDevice::new_with_stream`)
    // with its last tensor; DDP may still free its buckets on it after
    // that, so the placement's device holds it too.
    device.keep_alive(stream);
    Ok(Placement { device, stream: id })
}
