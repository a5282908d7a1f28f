//! consort-quic: the QUIC backend, for links across untrusted networks.
//!
//! This crate owns the QUIC transport: quinn endpoints (one connection per
//! pair of ranks, a few bidirectional streams on each), TLS 1.3 through
//! rustls with per-job certificates made by rcgen, and the pinning of every
//! peer's certificate fingerprint as published through the store ([`tls`]).
//! It owns no algorithm and no frame format: the connected streams go to
//! the same driver as the TCP backend (consort-mesh's `MeshBackend`),
//! which runs `consort_comm::algo`'s schedules. Rendezvous is TCP's: the
//! job's store (with `CONSORT_SECRET`, an authenticated one).

mod backend;
pub mod tls;

pub use backend::{QuicBackend, QuicOptions};
