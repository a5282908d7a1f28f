//! consort-tcp: the Gloo-style CPU backend and PyTorch's TCPStore.
//!
//! This crate owns:
//!
//! - [`store`]: a TCPStore server and client that speak PyTorch's wire
//!   protocol byte for byte, so that torch processes and consort processes
//!   rendezvous through one store;
//! - [`TcpBackend`]: TCP as a transport of consort-mesh's driver
//!   ([`TcpNet`]: listening, dialling, socket tuning);
//! - [`gloo`]: a consort rank inside a torch `gloo` process group
//!   ([`GlooBackend`]), over Gloo's own TCP pair protocol;
//! - [`iface`]: the address of a named network interface;
//! - `close`: the graceful close of a stream (the peer acknowledges every
//!   byte before the socket closes).
//!
//! # Example
//!
//! Two ranks in one process join a TCP group through a shared store and
//! all-reduce over loopback; in a job each rank is its own process, and
//! `consort::init_from_env()` and `Dist::process_group` do this from
//! torchrun's variables (see `consort::env` for every variable read).
//!
//! ```
//! use std::sync::Arc;
//! use consort_comm::{MemStore, ProcessGroup, ReduceOp, Store};
//! use consort_tcp::TcpOptions;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store: Arc<dyn Store> = Arc::new(MemStore::default());
//! let ranks = (0..2).map(|rank| {
//!     let store = store.clone();
//!     tokio::spawn(async move {
//!         let opts = TcpOptions { secret: None, ..TcpOptions::default() };
//!         let pg = ProcessGroup::new(Arc::new(consort_tcp::connect(store, rank, 2, opts).await?));
//!         let mut x = [rank as f32 + 1.0; 4];
//!         pg.all_reduce(&mut x, ReduceOp::Sum).await?;
//!         Ok::<_, consort_comm::CommError>(x)
//!     })
//! });
//! for r in ranks.collect::<Vec<_>>() {
//!     assert_eq!(r.await??, [3.0; 4]);
//! }
//! # Ok(()) }
//! ```

mod backend;
mod close;
pub mod gloo;
pub mod iface;
pub mod store;

pub use backend::{TcpBackend, TcpNet, TcpOptions, connect};
/// The `CONSORT_SECRET` handshake the store and every stream share.
pub use consort_comm::{auth, auth::Secret};
pub use gloo::{GlooBackend, GlooOptions};
pub use store::{
    DEFAULT_STORE_MAX_BYTES, DEFAULT_STORE_MAX_CLIENTS, ServerOptions, TcpStore, TcpStoreOptions,
    TcpStoreServer,
};
