//! PyTorch's TCPStore: [`TcpStoreServer`] and the [`TcpStore`] client.
//!
//! The protocol is torch's (≥ 2.4, libuv server): a one-byte command, then
//! arguments, with strings as a u64 little-endian length and bytes. There
//! is no frame header. A torch client can use our server and our client can
//! use a torch server; the tests check the bytes against a recording of
//! torch's own client and server.
//!
//! The semantics (`compare_set`, `add`, limits) come from
//! [`consort_comm::store`]; this module adds only the wire.

mod client;
mod server;
mod wire;

pub use client::{TcpStore, TcpStoreOptions};
pub use server::{
    DEFAULT_STORE_MAX_BYTES, DEFAULT_STORE_MAX_CLIENTS, ServerOptions, TcpStoreServer, parse_bytes,
};
pub use wire::VALIDATION_MAGIC;

/// The server's request decoder over given bytes, for fuzzing.
#[doc(hidden)]
pub mod fuzzing {
    pub use super::server::{Fed, feed};
}
