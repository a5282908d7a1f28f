//! consort-quic: the QUIC backend, for links across untrusted networks.
//!
//! This crate owns the QUIC transport: quinn endpoints (one connection per
//! stream, `streams` per pair of ranks), TLS 1.3 through rustls with
//! per-job certificates made by rcgen, and the pinning of every peer's
//! certificate fingerprint as published through the store ([`tls`]).
//! It owns no algorithm, no frame format and no rendezvous: QUIC is a
//! `StreamTransport` of consort-mesh, whose rendezvous (cards in the job's
//! store, hellos, the `CONSORT_SECRET` challenge, the missing-ranks
//! timeout) and driver it shares with TCP.

mod backend;
mod net;
pub mod tls;

pub use backend::{QuicBackend, QuicOptions, connect};
