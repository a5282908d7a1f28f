//! consort-tcp: the Gloo-style CPU backend and PyTorch's TCPStore.
//!
//! This crate owns:
//!
//! - [`store`]: a TCPStore server and client that speak PyTorch's wire
//!   protocol byte for byte, so that torch processes and consort processes
//!   rendezvous through one store;
//! - [`TcpBackend`]: the driver that runs `consort_comm`'s sans-IO
//!   schedules over a full mesh of TCP connections.

pub mod auth;
pub mod heartbeat;
pub mod iface;
mod pg;
mod shm;
pub mod store;

pub use auth::Secret;
pub use pg::{BoxRead, BoxWrite, TcpBackend, TcpOptions, dump_flight_records};
pub use store::{
    DEFAULT_STORE_MAX_BYTES, ServerOptions, TcpStore, TcpStoreOptions, TcpStoreServer,
};
