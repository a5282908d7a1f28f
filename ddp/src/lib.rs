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
