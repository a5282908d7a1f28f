//! Where a rank's burn module lives (`--device`) and how DDP reaches it:
//! through host copies (the CPU, TCP, or `--host-copies`), or in burn's
//! device memory (feature `burn-cuda`, over NCCL).

use consort::burn::{BurnModel, burn::tensor::Device};

use crate::{Args, BoxError, Place, model::Gpt};

/// The burn device of this rank's module, with autodiff.
pub(crate) fn burn_device(args: &Args) -> Result<Device, BoxError> {
    match args.device {
        Place::Cpu => {
            // Named, not `Device::default()`: with burn's CUDA backend
            // compiled in, the default is the GPU.
            #[allow(deprecated)] // ndarray is the adapter's CPU backend
            Ok(Device::ndarray().autodiff())
        }
        Place::Cuda => cuda(args),
    }
}

/// This rank's GPU: NCCL's (`--backend nccl`), else `LOCAL_RANK`'s, or 0
/// with `CONSORT_SHARE_GPU=1`.
#[cfg(feature = "burn-cuda")]
fn cuda(args: &Args) -> Result<Device, BoxError> {
    let ordinal = match args.gpu {
        Some(g) => g,
        None if std::env::var("CONSORT_SHARE_GPU").as_deref() == Ok("1") => 0,
        None => match std::env::var("LOCAL_RANK") {
            Ok(v) => v
                .parse()
                .map_err(|_| format!("LOCAL_RANK={v:?} is not a GPU index"))?,
            Err(_) => 0,
        },
    };
    Ok(Device::cuda(ordinal).autodiff())
}

#[cfg(not(feature = "burn-cuda"))]
fn cuda(_: &Args) -> Result<Device, BoxError> {
    Err(
        "--device cuda needs burn's CUDA backend: build with `--features burn-cuda` \
         (where GitHub is unreachable, also `--config .cargo/burn-cuda.toml`)"
            .into(),
    )
}

/// The model DDP works on, and the module: `host` (the host-copy path),
/// or, over NCCL on a GPU without `--host-copies`, one that reads and
/// writes burn's device memory, made after `host`'s values (a resumed
/// checkpoint's) went into the module.
pub(crate) fn ddp_model(
    net: Gpt,
    host: BurnModel,
    args: &Args,
    device: &Device,
) -> Result<(Gpt, BurnModel), BoxError> {
    if args.device != Place::Cuda || args.host_copies || args.gpu.is_none() {
        return Ok((net, host));
    }
    on_device(net, host, device)
}

#[cfg(feature = "burn-cuda")]
fn on_device(net: Gpt, mut host: BurnModel, device: &Device) -> Result<(Gpt, BurnModel), BoxError> {
    let net = host.push_values(net)?;
    let model = BurnModel::from_module_on(&net, consort::burn::placement(device)?)?;
    Ok((net, model))
}

#[cfg(not(feature = "burn-cuda"))]
fn on_device(net: Gpt, host: BurnModel, _: &Device) -> Result<(Gpt, BurnModel), BoxError> {
    Ok((net, host)) // not reached: burn_device refused --device cuda
}
