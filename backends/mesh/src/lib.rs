//! consort-mesh: the transport seam of consort's CPU backends.
//!
//! This crate owns what every CPU transport shares, so that the transports
//! own only moving bytes and failure signals:
//!
//! - [`MeshBackend`]: the one driver loop between the call engine
//!   (`consort_comm::engine`) and the links, with the in-place receive
//!   registry and the flight recorder's dumps;
//! - [`link`]: the seam itself ([`PeerLink`], [`PolledLink`],
//!   [`LocalTransport`]);
//! - [`rendezvous`]: the mesh rendezvous through the store, and the choice
//!   of transport per peer;
//! - [`auth`]: the `CONSORT_SECRET` challenge every stream starts with;
//! - [`heartbeat`]: the file the launcher's watchdog reads (it lives in
//!   `consort_comm::heartbeat`, shared with NCCL and the emulated device).
//!
//! consort-tcp (TCP streams), consort-quic (QUIC streams) and consort-shm
//! (same-host queues) build on it; none depends on another.
//!
//! # Example
//!
//! A transport owns moving bytes only: it implements [`StreamTransport`]
//! (listen, dial, split a stream) and hands itself to the mesh's
//! rendezvous, which makes the group. This is the whole of what
//! `consort_tcp::connect` adds to the mesh:
//!
//! ```
//! use std::sync::Arc;
//! use consort_comm::{ProcessGroup, Store};
//! use consort_mesh::{MeshOptions, StreamTransport, rendezvous};
//!
//! async fn join<T: StreamTransport>(
//!     store: Arc<dyn Store>,
//!     rank: usize,
//!     world_size: usize,
//!     net: T,
//! ) -> consort_comm::Result<ProcessGroup> {
//!     // Timeouts, schedules, the same-host transport, CONSORT_SECRET.
//!     let opts = MeshOptions::default();
//!     let mesh = rendezvous::connect(store, rank, world_size, opts, net).await?;
//!     Ok(ProcessGroup::new(Arc::new(mesh)))
//! }
//! ```

/// The `CONSORT_SECRET` handshake (in the comm layer; the TCPStore uses it
/// too).
pub use consort_comm::auth;
mod cpus;
mod driver;
pub use consort_comm::heartbeat;
pub mod link;
mod options;
pub mod rendezvous;

pub use auth::Secret;
pub use driver::{MeshBackend, MeshCloser, dump_flight_records, finish_in_drop};
pub use link::{BoxRead, BoxWrite, LocalSetup, LocalTransport, PeerLink, PolledLink};
pub use options::{MeshOptions, SPIN_OWN_CORE, SPIN_SHARED_CORES};
pub use rendezvous::StreamTransport;
