//! consort-ddp: DistributedDataParallel over any `Backend`.
//!
//! - [`Ddp`] ([`reducer`]): checks that every rank holds the same model,
//!   broadcasts rank 0's parameters and buffers, reduces gradients in
//!   c10d's buckets while backward runs (rebuilt in ready order after the
//!   first step), with `no_sync`, `find_unused_parameters`, join for uneven
//!   inputs, buffer broadcast, comm hooks ([`hook`]) and rank-0 checkpoints.
//! - [`ParamSet`] ([`params`]): the parameter-set abstraction a framework
//!   adapter implements; [`PlainModel`] is the adapter for plain slices.
//! - [`device`]: buckets in device memory when the model lives on a device
//!   (CUDA, or the emulated device in tests), averaged on the device and
//!   ordered by streams, never by the host; [`DeviceModel`] is the adapter
//!   for tensors in device memory.
//! - [`Sharded`] ([`shard`]): ZeRO-1, ZeRO-2, FSDP and HSDP over any
//!   backend, with optimizers that update a shard ([`Sgd`], [`AdamW`]),
//!   full and sharded (resharding) checkpoints, and a memory report.
//! - [`buckets`]: c10d's bucket assignment.
//! - [`state_dict`]: PyTorch's `module.` and `_orig_mod.` key prefixes,
//!   added and stripped in both directions; loading accepts either form.
//! - [`checkpoint`]: safetensors files written atomically, which Python's
//!   `safetensors` and PyTorch load.
//!
//! # Example
//!
//! Two simulated ranks wrap the same one-parameter model; each computes
//! its own gradient, and [`Ddp::sync_grads`] leaves the mean in both, as
//! `loss.backward()` under `DistributedDataParallel` does:
//!
//! ```
//! use std::sync::Arc;
//! use consort_ddp::{Ddp, DdpOptions, PlainModel};
//! use consort_sim::{SimConfig, SimWorld};
//!
//! let world = SimWorld::new(SimConfig::new(2))?;
//! let grads = world.run_each(|rank| async move {
//!     let mut model = PlainModel::new();
//!     let w = model.add_param::<f32>("linear.weight", vec![2], &[0.5, -0.5])?;
//!     let rank = Arc::new(rank);
//!     let me = consort_comm::Backend::rank(&*rank) as f32;
//!     let mut ddp = Ddp::new(rank, &mut model, DdpOptions::default()).await?;
//!     model.grad_mut::<f32>(w)?.fill(me + 1.0); // this rank's backward
//!     ddp.sync_grads(&mut model).await?;
//!     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(model.grad::<f32>(w)?.unwrap().to_vec())
//! })?;
//! for g in grads {
//!     assert_eq!(g.unwrap(), [1.5, 1.5]); // the mean of 1 and 2
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Under a launcher the backend comes from `consort::init_from_env()` and
//! `Dist::process_group` instead of the simulator; nothing else changes.

pub mod buckets;
pub mod checkpoint;
pub mod device;
mod error;
pub mod hook;
mod launch;
pub mod params;
mod powersgd;
pub mod reducer;
mod setup;
pub mod shard;
pub mod state_dict;
mod tensor;
mod worker;

pub use device::DeviceModel;
pub use hook::CommHook;
pub use params::{ParamSet, ParamSpec, PlainModel, PlainModelError};
pub use reducer::{Ddp, DdpError, DdpOptions, NoSync, OnPeerLost};
pub use shard::{
    AdamW, DeviceStep, LossScaling, Memory, MixedPrecision, Sgd, ShardKernels, ShardOptimizer,
    ShardOptions, Sharded, StagedKernels, Strategy,
};

pub use checkpoint::{CheckpointError, Tensor, load_safetensors, save_safetensors};
pub use state_dict::{StateDict, StateDictError};
