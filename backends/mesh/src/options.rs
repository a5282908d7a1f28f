//! [`MeshOptions`]: everything a mesh backend is built with.

use std::{net::IpAddr, path::PathBuf, sync::Arc, time::Duration};

use consort_comm::{algo::AlgoConfig, frame::FrameLimits};

use crate::{auth::Secret, link::LocalTransport};

/// How long a waiting call spins on its same-host links before it sleeps,
/// where every rank of the host has a core: long enough for a peer that is
/// running to answer (a flag's round trip between cores is about 0.5 µs),
/// short enough that a rank waiting on a slow peer gives its core back.
pub const SPIN_OWN_CORE: Duration = Duration::from_micros(50);

/// The same where ranks share cores (more ranks than cores on the host).
/// The spin yields the core between looks, so a waiting rank costs the
/// runnable ones little, and a peer that lost its core for a moment is
/// more often waited for than slept on: a sleep and its bell cost a
/// broadcast of 64 MiB over 3 ranks on 2 cores about a tenth of its time
/// (5.76 against 5.15 ms at 500 µs, paired medians, BENCHMARKS.md).
pub const SPIN_SHARED_CORES: Duration = Duration::from_micros(500);

/// How a [`crate::MeshBackend`] connects and runs (the TCP backend's
/// `TcpOptions`).
#[derive(Clone, Debug)]
pub struct MeshOptions {
    /// Default deadline of every op (torch's process-group default: 30 min).
    pub timeout: Duration,
    /// Deadline for building the mesh.
    pub connect_timeout: Duration,
    /// Address to listen on and advertise; `None`: the address this process
    /// uses to reach the store (it is routable from the store's host).
    pub bind_addr: Option<IpAddr>,
    /// Segment size, window and algorithm overrides.
    pub algo: AlgoConfig,
    /// How long a call may make no progress before it probes its peers.
    pub stall_probe: Duration,
    /// Largest frame payload accepted.
    pub limits: FrameLimits,
    /// Store key namespace of this group's addresses.
    pub namespace: String,
    /// Payloads of at least this many bytes are applied by the reader task
    /// straight into the call's buffer when the receive is already posted
    /// (no second copy); smaller ones are buffered. Default 64 KiB.
    pub in_place_min: usize,
    /// The transport for peers on this host, tried before the network
    /// (`consort_shm::ShmTransport`: shared-memory queues). `None`: every
    /// peer is reached over the network. Every rank must agree; a rank
    /// without it turns it off for the whole mesh.
    pub local: Option<Arc<dyn LocalTransport>>,
    /// Payloads of at least this many bytes go to peers that can read this
    /// process's memory as single-copy pull frames (only in schedules whose
    /// sources stay until taken, every one but recursive doubling's; see
    /// `consort_comm::algo::Schedule::sources_stay`).
    /// Default 64 KiB.
    pub single_copy_min: usize,
    /// How long a call waiting on a polled (same-host) link spins before it
    /// sleeps until the peer rings. While it spins it yields the core when
    /// this host runs more ranks than it has cores. `None` (the default):
    /// [`SPIN_OWN_CORE`] where every rank has a core, [`SPIN_SHARED_CORES`]
    /// where ranks share them. `CONSORT_SHM_SPIN_US` sets it under
    /// `init_from_env`.
    pub spin: Option<Duration>,
    /// Threads this rank splits a large copy or reduction over, itself
    /// included (`consort_comm::par`). `None` (the default): where every
    /// rank is on one host, the cores its ranks may use between them
    /// divided by the ranks, less one for the rank's runtime (1 where they
    /// have two cores each or fewer, span hosts, or the mesh cannot tell:
    /// no shared memory), at most `consort_comm::par::MAX_THREADS`.
    /// `CONSORT_SHM_THREADS` sets it under `init_from_env`.
    pub threads: Option<usize>,
    /// TCP connections per pair of ranks (1 to 8); frames spread over them
    /// by tag. On this project's loopback benches 2 streams measured no
    /// better than 1 (the sender writes every stream from one task), so
    /// the default is 1; it can help where one flow is capped.
    pub streams: usize,
    /// Shared secret: every connection starts with an HMAC challenge-response
    /// ([`crate::auth`]); `None` leaves the port open to anyone who can reach it.
    pub secret: Option<Secret>,
    /// Where this rank writes its flight record (`rank-K.json`) when a call
    /// fails, a peer aborts, or [`crate::dump_flight_records`] asks; `None` keeps
    /// the record in memory only. `consort run` sets `CONSORT_FLIGHT_DIR`
    /// for its workers, which `init_from_env` passes here.
    pub flight_dir: Option<PathBuf>,
    /// The faulty link, for tests: faults applied to this rank's outgoing
    /// data frames on every transport (see `consort_comm::fault`; times
    /// count from when the mesh is built, a crash closes every link of
    /// this rank as a dying process would). Empty: none.
    pub faults: Vec<consort_comm::fault::Fault>,
    /// Seed of the faults' random choices.
    pub fault_seed: u64,
    /// How long dropping the world handle may wait for the peers to take
    /// what this rank's streams still hold (a graceful close: each stream's
    /// write side is shut down after its last frame, and the socket closes
    /// once the peer has acknowledged all of it, or at this deadline).
    /// Default 10 s.
    pub linger: Duration,
    /// The heartbeat file this rank keeps for its agent's watchdog
    /// ([`crate::heartbeat`]); `consort run` sets `CONSORT_HEARTBEAT_FILE`.
    pub heartbeat_file: Option<PathBuf>,
}

impl Default for MeshOptions {
    fn default() -> Self {
        MeshOptions {
            timeout: Duration::from_secs(30 * 60),
            connect_timeout: Duration::from_secs(300),
            bind_addr: None,
            algo: AlgoConfig {
                segment_bytes: 1 << 20,
                window: 4,
                overrides: Vec::new(),
                oversubscribed: false,
                shared_stage: false,
            },
            stall_probe: Duration::from_millis(500),
            limits: FrameLimits::default(),
            namespace: "consort/tcp/world".into(),
            in_place_min: 64 * 1024,
            local: None,
            single_copy_min: 64 * 1024,
            spin: None,
            threads: None,
            streams: 1,
            secret: Secret::from_env(),
            flight_dir: None,
            heartbeat_file: None,
            linger: Duration::from_secs(10),
            faults: Vec::new(),
            fault_seed: 0,
        }
    }
}
