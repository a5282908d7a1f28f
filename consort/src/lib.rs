//! consort: collective communication and data-parallel training for Rust.
//!
//! This facade is what users depend on. It re-exports the vocabulary of
//! [`consort_comm`] (the [`Backend`] trait, [`ProcessGroup`], [`ReduceOp`],
//! dtypes, errors, stores, the [`algo`] schedules) and the simulator
//! ([`sim`]), owns the rendezvous ([`init_from_env`], which reads
//! torchrun's or Slurm's variables), and ships the `consort` binary.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // Alone, under torchrun, under srun or under `consort run`: same code.
//! let dist = consort::init_from_env().await?;
//! println!("rank {} of {}", dist.rank(), dist.world_size());
//! dist.store().set("hello", b"world").await?;
//! dist.shutdown().await?;
//! # Ok(()) }
//! ```
//!
//! The user guide is [`manual`]; every environment variable consort reads
//! is listed in [`env`](mod@env).
//!
//! # Features
//!
//! | feature | adds |
//! |---|---|
//! | `quic` | the QUIC backend (`consort::quic`, `Dist::quic_process_group`): quinn, rustls, ring |
//! | `nccl` | the NCCL backend (`consort::nccl`, `Dist::nccl_process_group`) and `consort::cuda`'s optimizer kernels; builds without CUDA (loaded at run time) |
//! | `burn` | DDP and the sharded strategies for burn modules (`consort::burn`) |
//! | `candle` | the same for candle models (`consort::candle`) |
//! | `candle-cuda` | candle models on CUDA into NCCL with no host copies; needs nvcc to build |

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub mod cuda;
pub mod env;
mod init;
pub mod launch;
pub mod manual;

pub use consort_comm::{
    Backend, Buffer, BufferMut, CallOptions, CommError, DType, Device, DeviceBuffer, DeviceMesh,
    Element, ErrorContext, Fingerprint, GroupId, OpKind, Placement, ProcessGroup, ReduceOp, Result,
    dtype, half, store, with_dtype,
};
pub use consort_tcp::{Secret, ServerOptions, TcpStore, TcpStoreOptions, TcpStoreServer};

/// The deterministic in-process simulator (functional and cost-only).
pub use consort_sim as sim;

/// DDP for burn modules (feature `burn`).
#[cfg(feature = "burn")]
#[cfg_attr(docsrs, doc(cfg(feature = "burn")))]
pub use consort_burn as burn;
/// DDP and the sharded strategies for candle models (feature `candle`; on
/// CUDA with no host copies, feature `candle-cuda`).
#[cfg(feature = "candle")]
#[cfg_attr(docsrs, doc(cfg(feature = "candle")))]
pub use consort_candle as candle;
/// DistributedDataParallel (`Ddp`), state dicts (`module.`/`_orig_mod.`
/// prefixes) and safetensors checkpoints.
pub use consort_ddp as ddp;
/// The NCCL backend (feature `nccl`).
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub use consort_nccl as nccl;
/// Pipeline parallelism: torch's seven schedules, their cost model, and a
/// runtime that runs a rank's stages over any backend.
pub use consort_pipeline as pipeline;
/// The QUIC backend (feature `quic`, off by default).
#[cfg(feature = "quic")]
#[cfg_attr(docsrs, doc(cfg(feature = "quic")))]
pub use consort_quic as quic;
/// DistributedSampler (bit-exact with PyTorch), streaming, batch and eval samplers.
pub use consort_sampler as sampler;

/// Collective algorithms as sans-IO schedules, and their selection policy.
pub use consort_comm::algo;
/// The flight recorder's records and their analysis.
pub use consort_comm::flight;
pub use env::{DistEnv, EnvError, Launcher, MAX_LOCAL_WORLD_SIZE, MAX_WORLD_SIZE};
pub use init::{
    Dist, FAILED_EXIT_WAIT, InitError, InitOptions, init, init_from_env, store_bind_addr,
};
