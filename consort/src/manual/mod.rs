//! The user guide: consort from its first command to a cluster. Every Rust
//! block in it compiles as a doc test (`cargo test -p consort --doc`), and
//! those that need no launched job run; the chapters on burn and on the
//! GPU compile with their features (`--features burn`, `--features nccl`).
//!
//! - [`quickstart`]: the example trainer four ways, a training loop of your
//!   own, and PyTorch's names for everything.
//! - [`burn`]: DDP and the sharded strategies for burn modules.
//! - [`torch_jobs`]: Rust ranks inside a PyTorch job's `gloo` groups.
//! - [`nccl`]: NCCL on a cluster, stream-ordered as torch's backend.
//! - [`subgroups`]: subgroups and several calls in flight.
//! - [`sharded`]: ZeRO-1/2, FSDP and HSDP, on the host and on a device.
//! - [`pipeline`]: DeviceMesh and pipeline parallelism.
//! - [`survive`]: hang detection, flight records, restarts, elastic
//!   membership and shrinking.
//! - [`backends`]: choosing a backend, and the transports.
//! - [`environment`]: every environment variable (the table is in
//!   [`crate::env`]).
//! - [`troubleshooting`]: what an error means and what to do.
//! - [`status`]: what works today, crate by crate.

#[doc = include_str!("quickstart.md")]
pub mod quickstart {}
#[doc = include_str!("burn.md")]
pub mod burn {}
#[doc = include_str!("torch_jobs.md")]
pub mod torch_jobs {}
#[doc = include_str!("nccl.md")]
pub mod nccl {}
#[doc = include_str!("subgroups.md")]
pub mod subgroups {}
#[doc = include_str!("sharded.md")]
pub mod sharded {}
#[doc = include_str!("pipeline.md")]
pub mod pipeline {}
#[doc = include_str!("survive.md")]
pub mod survive {}
#[doc = include_str!("backends.md")]
pub mod backends {}
#[doc = include_str!("environment.md")]
pub mod environment {}
#[doc = include_str!("troubleshooting.md")]
pub mod troubleshooting {}
#[doc = include_str!("status.md")]
pub mod status {}
