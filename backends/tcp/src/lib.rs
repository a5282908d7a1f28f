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
