//! consort-sim: a deterministic world of N ranks in one process.
//!
//! This crate owns the drivers that run `consort_comm::algo`'s schedules
//! without a network:
//!
//! - [`SimWorld`] (functional mode): N ranks in one process, each a
//!   [`SimRank`] handle that implements `Backend` with real payloads on a
//!   virtual clock; seeded, deterministic, with a message trace;
//! - [`fault`]: the fault plan (crash, drop, delay, duplicate, corrupt,
//!   partition/heal, hold/release);
//! - [`device`]: [`EmulatedDevice`], device memory whose work completes
//!   late and out of order across streams, and [`device_comm`]:
//!   [`EmulatedComm`], collectives on its buffers ordered as NCCL orders
//!   them, so that stream-ordered code is tested without a GPU;
//! - [`cost`]: the α–β cost model over a topology, and the cost-only driver
//!   that predicts time, algbw and busbw for up to 65,536 ranks;
//! - [`cluster`]: NCCL's own tuning model of a GPU cluster (ring, tree,
//!   NVLS, PAT; LL, LL128, Simple), presets held to published nccl-tests
//!   figures, and the step time of DDP, FSDP and pipelines on them.
//!
//! It owns no algorithm: every schedule comes from `consort_comm::algo`.

pub mod cluster;
pub mod cost;
pub mod device;
pub mod device_comm;
/// The fault vocabulary, shared with the real transports' faulty link.
pub use consort_comm::fault;
mod world;

pub use device::{EmulatedDevice, EmulatedOptions};
pub use device_comm::{EmulatedComm, EmulatedCommOptions};
pub use world::{SimConfig, SimRank, SimWorld, TraceEvent, TraceKind};
