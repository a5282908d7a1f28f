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
//! - [`cost`]: the α–β cost model over a topology, and the cost-only driver
//!   that predicts time, algbw and busbw for up to 65,536 ranks.
//!
//! It owns no algorithm: every schedule comes from `consort_comm::algo`.

pub mod cost;
pub mod fault;
mod world;

pub use world::{SimConfig, SimRank, SimWorld, TraceEvent, TraceKind};
