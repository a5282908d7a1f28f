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
//!
//! # Example
//!
//! An SPMD body on four simulated ranks, with rank 2's process dying
//! right after it sends its first message: the survivors' `all_reduce` fails (the peer is
//! lost) instead of hanging, as it would over TCP. The same seed gives the
//! same run.
//!
//! ```
//! use std::sync::Arc;
//! use consort_comm::{ProcessGroup, ReduceOp};
//! use consort_sim::{SimConfig, SimWorld, fault::{Fault, Trigger}};
//!
//! let crash = Fault::Crash { rank: 2, at: Trigger::AfterMessages(1) };
//! let world = SimWorld::new(SimConfig::new(4).seed(7).fault(crash))?;
//! let results = world.run_each(|rank| async move {
//!     let pg = ProcessGroup::new(Arc::new(rank));
//!     let mut x = vec![1.0f32; 64];
//!     pg.all_reduce(&mut x, ReduceOp::Sum).await
//! })?;
//! assert!(results.iter().all(|r| r.is_err()));
//! println!("{} of simulated time", world.elapsed().as_secs_f64());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

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
