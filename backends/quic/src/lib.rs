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
//!
//! # Example
//!
//! In a job, `Dist::quic_process_group` (the facade's feature `quic`)
//! does this from the environment (`consort::env` lists the variables).
//! By hand, given the job's store:
//!
//! ```no_run
//! use std::{net::IpAddr, sync::Arc, time::Duration};
//! use consort_comm::{ProcessGroup, ReduceOp, Store};
//! use consort_quic::QuicOptions;
//!
//! # async fn demo(store: Arc<dyn Store>, rank: usize, world_size: usize, my_ip: IpAddr)
//! #     -> consort_comm::Result<()> {
//! let opts = QuicOptions {
//!     bind_addr: Some(my_ip),                 // what the other hosts reach
//!     idle_timeout: Duration::from_secs(5),   // silence after which a peer is lost
//!     ..QuicOptions::default()
//! };
//! let pg = ProcessGroup::new(Arc::new(consort_quic::connect(store, rank, world_size, opts).await?));
//! let mut grads = vec![0.0f32; 1 << 20];
//! pg.all_reduce(&mut grads, ReduceOp::Avg).await?;
//! # Ok(()) }
//! ```

mod backend;
mod net;
pub mod tls;

pub use backend::{QuicBackend, QuicOptions, connect};
