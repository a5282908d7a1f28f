//! consort-quic: the QUIC backend (to be built).
//!
//! It will own the QUIC driver: quinn connections between ranks, rustls
//! certificates and peer authentication, and the loop that runs
//! `consort_comm`'s sans-IO schedules over QUIC streams. It will own no
//! algorithm of its own.
