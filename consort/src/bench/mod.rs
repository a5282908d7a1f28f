//! `consort bench`'s measurements, apart from the command line that asks
//! for them ([`crate::cli`] parses the flags):
//!
//! - [`collective`]: collectives over N local ranks, nccl-tests style, with
//!   [`rows`] (the spec, the rows and the exact inputs every row's
//!   `#wrong` is checked against), [`bound`] (each row's fraction of what
//!   this node's memory allows) and [`nccl`] (the same on GPUs);
//! - [`machine`]: this machine's ceilings (reduce throughput against
//!   memcpy, loopback TCP, the simulator, the sampler);
//! - [`ddp`], [`ddp_device`]: DDP's cost on a training step, host and
//!   device;
//! - [`sharded`], [`sharded_device`]: the sharded strategies against DDP.

pub(crate) mod bound;
pub(crate) mod collective;
pub(crate) mod ddp;
pub(crate) mod ddp_device;
pub(crate) mod machine;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
pub(crate) mod rows;
pub(crate) mod sharded;
pub(crate) mod sharded_device;
