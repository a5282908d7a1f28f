//! consort-comm: the vocabulary and the contract of consort.
//!
//! This crate owns what every backend and every layer above them agree on:
//!
//! - element types ([`DType`], [`Element`]) and reductions ([`ReduceOp`]),
//!   with the one implementation of the arithmetic;
//! - buffer views that cross the trait ([`Buffer`], [`BufferMut`]), host or
//!   device memory;
//! - the [`Backend`] trait, per-call [`CallOptions`], and the typed
//!   [`ProcessGroup`] wrapper, with torch's object collectives, list and
//!   uneven `all_gather`, and `monitored_barrier` built on it;
//! - errors ([`CommError`]) and the shared argument checks ([`validate`]);
//! - the identity of a call ([`Fingerprint`]) and the wire header that
//!   carries it ([`frame`]);
//! - the rendezvous [`Store`] trait, with [`MemStore`] and [`PrefixStore`];
//! - device memory behind the [`Device`] trait ([`device`]), which DDP
//!   uses for buckets that live where the gradients live;
//! - the collective algorithms ([`algo`]), as sans-IO schedules that the
//!   simulator and the mesh driver (TCP, QUIC, shared memory) share;
//! - the call engine ([`engine`]): one sans-IO endpoint per rank with the
//!   call rules (sequence numbers, fingerprints and mismatch, poisoning,
//!   aborts, cancellation, stall probes), and the flight recorder
//!   ([`flight`]) it fills; a cancelled call's cause ([`cancel`]);
//! - the rules of stream-ordered communicators ([`ordered`]), on that
//!   engine, with time as an argument: what NCCL and the emulated device
//!   both drive, and the fingerprint check over a host side channel;
//! - the stream-ordered driver ([`stream`]) that runs those rules on
//!   threads for every device (NCCL's CUDA events, the emulated device's
//!   gates), which implements only [`stream::DeviceComm`];
//! - fault injection that the simulator and the mesh's faulty links share
//!   ([`fault`]), and bounded waits ([`time`]).
//!
//! It never imports a backend or a socket, and runs no async runtime: the
//! stream driver only asks tokio which runtime a blocking wait is on.
//!
//! # Example
//!
//! Code written against [`ProcessGroup`] (or `Arc<dyn Backend>`) runs on
//! any backend. Here each rank of a simulated world (consort-sim) averages
//! its gradients, as `dist.all_reduce(t, op=ReduceOp.AVG)` does:
//!
//! ```
//! use std::sync::Arc;
//! use consort_comm::{ProcessGroup, ReduceOp};
//! use consort_sim::{SimConfig, SimWorld};
//!
//! let world = SimWorld::new(SimConfig::new(4))?;
//! let grads = world.run_each(|rank| async move {
//!     let pg = ProcessGroup::new(Arc::new(rank));
//!     let mut grad = vec![pg.rank() as f32; 3];
//!     pg.all_reduce(&mut grad, ReduceOp::Avg).await?;
//!     Ok::<_, consort_comm::CommError>(grad)
//! })?;
//! for g in grads {
//!     assert_eq!(g?, [1.5; 3]); // the mean of 0, 1, 2 and 3
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Under a launcher, `consort::init_from_env()` makes the group instead;
//! the environment it reads is listed in one place, `consort::env`.

pub mod algo;
pub mod auth;
mod backend;
mod buffer;
pub mod cancel;
pub mod device;
pub mod device_mesh;
pub mod dtype;
pub mod engine;
mod error;
pub mod fault;
pub mod files;
mod fingerprint;
pub mod flight;
pub mod frame;
mod group;
pub mod heartbeat;
mod objects;
pub mod ordered;
pub mod par;
pub mod reduce;
pub mod store;
pub mod stream;
mod subgroups;
pub mod time;
pub mod validate;

pub use backend::{Backend, CallOptions, Op, PeerAbort, Work};
pub use buffer::{Buffer, BufferMut, DeviceBuffer, HostSlice, HostSliceMut};
pub use device::{Device, Event, EventId, Placement, StreamId};
pub use device_mesh::DeviceMesh;
pub use dtype::{DType, Element};
pub use error::{AbortCause, CommError, ErrorContext, Result};
pub use fingerprint::{Fingerprint, GroupId, OpKind, Shape};
pub use group::ProcessGroup;
pub use reduce::ReduceOp;
pub use store::{MemStore, PrefixStore, Store, StoreError, StoreResult};
pub use subgroups::GroupOptions;

/// Re-exported so that users name `consort_comm::half::bf16` without adding
/// the crate themselves.
pub use half;

/// Locks `m`, taking the state over from a thread that panicked while it
/// held it: every state consort guards so is changed by one method at a
/// time, completed or not begun, so the panic is reported where it
/// happened and the other threads go on (std's poisoning would turn one
/// panic into one per thread). The one lock helper of the workspace.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
