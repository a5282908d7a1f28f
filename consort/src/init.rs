//! Rendezvous: [`init_from_env`] turns the launcher's variables into a
//! connected [`Dist`] with a shared [`Store`].
//!
//! This module owns who hosts the store (rank 0, unless the launcher's agent
//! does), how ranks announce themselves, and the checks that every rank
//! arrived exactly once. It does not create collectives; backends build
//! their process groups on top of `Dist::store`.

use std::{sync::Arc, time::Duration};

use consort_comm::store::{DEFAULT_STORE_TIMEOUT, MemStore, PrefixStore, Store, StoreError};
use consort_comm::{CommError, ProcessGroup, algo::AlgoConfig};
use consort_shm::ShmTransport;
use consort_tcp::{TcpBackend, TcpOptions, TcpStore, TcpStoreOptions, TcpStoreServer};

use crate::env::{DistEnv, EnvError, Launcher};

mod leave;

pub use leave::FAILED_EXIT_WAIT;

/// How [`init`] waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitOptions {
    /// Deadline for reaching the store and for every rank to arrive, and the
    /// store's request timeout (torch's default: 300 s).
    pub store_timeout: Duration,
    /// torch processes hold some of the job's ranks (a mixed job, for
    /// [`Dist::gloo_process_group`]): a torch rank never claims its rank in
    /// consort's rendezvous, so this rank claims and waits for nobody.
    /// `CONSORT_TORCH_PEERS=1` sets it.
    pub torch_peers: bool,
}

impl InitOptions {
    /// The defaults, with `CONSORT_STORE_TIMEOUT` (seconds, may be
    /// fractional) overriding the store timeout.
    pub fn from_env() -> Result<Self, EnvError> {
        let mut o = InitOptions::default();
        if let Some(v) = std::env::var("CONSORT_STORE_TIMEOUT")
            .ok()
            .filter(|v| !v.is_empty())
        {
            o.store_timeout =
                consort_comm::time::parse_seconds(&v, false).map_err(|_| EnvError::Malformed {
                    var: "CONSORT_STORE_TIMEOUT",
                    value: v.clone(),
                    expected: "a positive number of seconds, at most 100 years",
                })?;
        }
        o.torch_peers =
            bool_var("CONSORT_TORCH_PEERS", false).map_err(|_| EnvError::Malformed {
                var: "CONSORT_TORCH_PEERS",
                value: std::env::var("CONSORT_TORCH_PEERS").unwrap_or_default(),
                expected: "1 (or true) or 0 (or false)",
            })?;
        Ok(o)
    }
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            store_timeout: DEFAULT_STORE_TIMEOUT,
            torch_peers: false,
        }
    }
}

/// Why [`init`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// The launcher's variables are wrong.
    #[error("bad launcher environment: {0}")]
    Env(#[from] EnvError),
    /// The store could not be hosted or reached.
    #[error("rank {rank}: rendezvous store failed: {source}")]
    Store {
        /// This rank.
        rank: usize,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// Two processes were started with the same rank.
    #[error(
        "rank {rank} is claimed by two processes: {first} and {second}. Each process needs its \
         own RANK; check the launcher's configuration (or two jobs sharing one MASTER_PORT)"
    )]
    DuplicateRank {
        /// The rank.
        rank: usize,
        /// The process that claimed it first (`host:pid`).
        first: String,
        /// This process (`host:pid`).
        second: String,
    },
    /// Some ranks never arrived.
    #[error(
        "rank {rank}: timed out after {after:?} waiting for {} of {world_size} ranks to join \
         (missing: {missing:?}{}). Check that every rank was started, with the same \
         WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
        missing_count,
        if *missing_count > missing.len() { ", ..." } else { "" }
    )]
    Incomplete {
        /// This rank.
        rank: usize,
        /// The world size.
        world_size: usize,
        /// Some of the missing ranks.
        missing: Vec<usize>,
        /// How many are missing.
        missing_count: usize,
        /// How long this rank waited.
        after: Duration,
    },
}

/// A process that has joined its job: where it stands and the store it
/// shares with the other ranks.
#[derive(Debug)]
pub struct Dist {
    env: DistEnv,
    store: Arc<dyn Store>,
    server: Option<TcpStoreServer>,
    timeout: Duration,
    /// torch processes hold some ranks ([`InitOptions::torch_peers`]).
    torch_peers: bool,
    /// The NCCL process groups made here ([`Dist::nccl_process_group`]),
    /// held until the job is left: [`Dist::shutdown`] destroys them, as
    /// torch's `destroy_process_group` does, whether or not their
    /// `ProcessGroup` handles are still around.
    #[cfg(feature = "nccl")]
    nccl_groups: std::sync::Mutex<Vec<Arc<consort_nccl::NcclBackend>>>,
}

impl Dist {
    /// The launcher's description of this process.
    pub fn env(&self) -> &DistEnv {
        &self.env
    }

    /// Whether torch processes hold some of the job's ranks
    /// ([`InitOptions::torch_peers`]).
    pub fn torch_peers(&self) -> bool {
        self.torch_peers
    }

    /// Global rank.
    pub fn rank(&self) -> usize {
        self.env.rank
    }

    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    /// Rank on this node.
    pub fn local_rank(&self) -> usize {
        self.env.local_rank
    }

    /// Processes on this node.
    pub fn local_world_size(&self) -> usize {
        self.env.local_world_size
    }

    /// The store every rank shares (torch's keys: what a torch process sets
    /// under `k`, this store reads under `k`).
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The NCCL process group (feature `nccl`): one process per GPU, the
    /// GPU is `LOCAL_RANK`, and NCCL's unique id goes through this job's
    /// store under torch's key layout. `CONSORT_TIMEOUT` sets the op
    /// timeout (default 10 minutes, as torch's NCCL default). Without
    /// libcuda, libnccl or a GPU this is `BackendUnavailable`.
    ///
    /// The communicator lives until [`Dist::shutdown`] (or
    /// [`Dist::shutdown_without`], [`Dist::shutdown_failed`]) destroys it,
    /// as torch's default group lives until `destroy_process_group`:
    /// dropping the returned handle first is fine. Each call makes a new
    /// communicator (with its watchdog thread and NCCL's buffers), and each
    /// lives until then.
    #[cfg(feature = "nccl")]
    #[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
    pub async fn nccl_process_group(&self) -> Result<ProcessGroup, CommError> {
        let b = Arc::new(self.nccl_backend(None).await?);
        let mut held = consort_comm::lock(&self.nccl_groups);
        held.push(b.clone());
        Ok(ProcessGroup::new(b))
    }

    /// The NCCL backend itself (feature `nccl`), on GPU `device`, else
    /// `LOCAL_RANK`'s: what [`Dist::nccl_process_group`] wraps, for callers
    /// that need its stream or its device.
    ///
    /// Every collective's fingerprint is compared with the peers' over a
    /// small TCP mesh made here, while the kernel runs
    /// ([`consort_nccl::NcclBackend::check_fingerprints`]): a mismatched
    /// collective is `Mismatch` on every rank, not a hang or garbage.
    /// `CONSORT_NCCL_CHECK=0` turns that off.
    ///
    /// The communicator is nonblocking, so its init, subgroup splits and
    /// shutdown each end within `CONSORT_TIMEOUT` (a peer that never
    /// arrives is an error, and the process can exit);
    /// `CONSORT_NCCL_BLOCKING=1` makes a blocking one, as torch does by
    /// default (less host time per call; see `NcclOptions::blocking`).
    ///
    /// `CONSORT_SHARE_GPU=1` puts every rank on GPU 0, for correctness runs
    /// of several ranks on a one-GPU machine. NCCL allows that from 2.30
    /// with `NCCL_MULTI_RANK_GPU_ENABLE=1`; older releases need a distinct
    /// `NCCL_HOSTID` per rank (with `NCCL_NET=Socket`,
    /// `NCCL_SOCKET_IFNAME=lo`), set by whoever starts the ranks.
    #[cfg(feature = "nccl")]
    #[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
    pub async fn nccl_backend(
        &self,
        device: Option<usize>,
    ) -> Result<consort_nccl::NcclBackend, CommError> {
        let shared = match std::env::var("CONSORT_SHARE_GPU").as_deref() {
            Ok("1") => Some(0),
            Ok("0") | Ok("") | Err(_) => None,
            Ok(other) => {
                return Err(CommError::invalid(format!(
                    "CONSORT_SHARE_GPU={other:?}: expected 1 (every rank on GPU 0) or 0"
                )));
            }
        };
        let mut opts = consort_nccl::NcclOptions {
            device: Some(device.or(shared).unwrap_or(self.env.local_rank)),
            // The launcher's watchdog sees NCCL ranks' progress too.
            heartbeat_file: std::env::var_os("CONSORT_HEARTBEAT_FILE")
                .filter(|f| !f.is_empty())
                .map(Into::into),
            // ... and its flight records, written on a failure and on
            // SIGUSR1.
            flight_dir: std::env::var_os("CONSORT_FLIGHT_DIR")
                .filter(|f| !f.is_empty())
                .map(Into::into),
            // torch's keys and split colours: nccl2 unless the job set
            // TORCH_DIST_USE_NCCL2=0, as torch decides.
            torch: consort_nccl::keys::TorchNccl::from_env(),
            ..Default::default()
        };
        if opts.flight_dir.is_some() {
            dump_on_sigusr1();
        }
        if let Some(t) = seconds_var("CONSORT_TIMEOUT")? {
            opts.timeout = t;
        }
        opts.blocking = bool_var("CONSORT_NCCL_BLOCKING", false)?;
        // The torch job made its default group with a device_id: its
        // classic backend splits new_groups instead of keying them.
        opts.torch_eager = bool_var("CONSORT_TORCH_NCCL_EAGER", false)?;
        let (rank, world) = (self.env.rank, self.env.world_size);
        // A restarted round's unique id under its own prefix: the previous
        // round's is still in the launcher's store.
        let store: Arc<dyn consort_comm::store::Store> =
            match consort_nccl::keys::round_prefix(self.env.restart_count) {
                Some(p) => Arc::new(consort_comm::store::PrefixStore::new(p, self.store.clone())),
                None => self.store.clone(),
            };
        let b = consort_nccl::NcclBackend::new(&*store, rank, world, opts).await?;
        // Where survivors of a lost rank make their communicator.
        b.set_store(store.clone());
        // torch's ranks would never join the check's side channel.
        if world > 1 && !self.torch_peers && bool_var("CONSORT_NCCL_CHECK", true)? {
            b.check_fingerprints(Arc::new(self.check_channel("nccl-check").await?))?;
        }
        Ok(b)
    }

    /// The default process group: the TCP backend over a mesh between every
    /// rank, rendezvoused through [`Dist::store`], with shared memory
    /// between the ranks on one host.
    ///
    /// `CONSORT_TIMEOUT` (seconds) sets the default op timeout (torch's 30
    /// min otherwise) and bounds building the mesh (5 min otherwise). The address to listen on and advertise is
    /// `CONSORT_BIND_ADDR`, else the address of interface
    /// `CONSORT_SOCKET_IFNAME`, else the address this host uses to reach
    /// `MASTER_ADDR` (loopback for a single-node job). The mesh's other
    /// variables (schedules, segments, streams, shared memory) are in
    /// [`crate::env`].
    ///
    /// Here as a world of one, which runs anywhere (under a launcher,
    /// [`crate::init_from_env`] gives the `Dist`):
    ///
    /// ```
    /// use consort::{DistEnv, InitOptions, ReduceOp};
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let dist = consort::init(DistEnv::single_process(), InitOptions::default()).await?;
    /// let pg = dist.process_group().await?;
    /// let mut grads = vec![1.0f32; 8];
    /// pg.all_reduce(&mut grads, ReduceOp::Sum).await?;
    /// assert_eq!((pg.rank(), pg.world_size(), grads[0]), (0, 1, 1.0));
    /// drop(pg);
    /// dist.shutdown().await?;
    /// # Ok(()) }
    /// ```
    pub async fn process_group(&self) -> Result<ProcessGroup, CommError> {
        let opts = self.tcp_options().await?;
        let b = consort_tcp::connect(self.store.clone(), self.env.rank, self.env.world_size, opts)
            .await?;
        Ok(ProcessGroup::new(Arc::new(b)))
    }

    /// A process group on the emulated device (consort-sim's
    /// `EmulatedComm`): NCCL's stream-ordered model, call rules, mismatch
    /// check and heartbeat, over a TCP mesh, with no GPU. For testing the
    /// GPU code paths of a job on CPU (the launcher's restarts and
    /// watchdog, init bounds, the fingerprint side channel); its buffers
    /// are the emulated device's or the host's.
    ///
    /// The check's side channel is a TCP mesh of its own, as on NCCL.
    pub async fn emulated_process_group(&self) -> Result<ProcessGroup, CommError> {
        Ok(ProcessGroup::new(Arc::new(self.emulated_comm().await?)))
    }

    /// The communicator [`Dist::emulated_process_group`] wraps, for callers
    /// that need its device (`EmulatedComm::device`) to place a model on.
    pub async fn emulated_comm(&self) -> Result<consort_sim::EmulatedComm, CommError> {
        let (rank, world) = (self.env.rank, self.env.world_size);
        let mut tcp = self.tcp_options().await?;
        tcp.namespace = format!("consort/tcp/{}/emulated", self.env.restart_count);
        let heartbeat = tcp.heartbeat_file.take();
        // The emulated communicator keeps the record, as NCCL does; the
        // host mesh under it keeps none of its own.
        let flight = tcp.flight_dir.take();
        let host = consort_tcp::connect(self.store.clone(), rank, world, tcp).await?;
        let device = consort_sim::EmulatedDevice::new(consort_sim::EmulatedOptions {
            seed: rank as u64,
            ..Default::default()
        });
        let comm = consort_sim::EmulatedComm::new(
            Arc::new(host),
            device,
            consort_sim::EmulatedCommOptions {
                seed: rank as u64,
                ..Default::default()
            },
        )?;
        if let Some(path) = heartbeat {
            comm.set_heartbeat(&path)?;
        }
        if let Some(dir) = flight {
            comm.set_flight_dir(&dir);
        }
        if world > 1 {
            comm.check_fingerprints(Arc::new(self.check_channel("emulated-check").await?))?;
        }
        Ok(comm)
    }

    /// The side channel of a stream-ordered communicator's mismatch check
    /// (NCCL's, the emulated device's): a TCP mesh of its own under
    /// `consort/tcp/{restart}/{name}`, used by nothing else, with no
    /// heartbeat or flight records of its own.
    async fn check_channel(&self, name: &str) -> Result<TcpBackend, CommError> {
        let mut tcp = self.tcp_options().await?;
        tcp.namespace = format!("consort/tcp/{}/{name}", self.env.restart_count);
        tcp.heartbeat_file = None;
        tcp.flight_dir = None;
        consort_tcp::connect(self.store.clone(), self.env.rank, self.env.world_size, tcp).await
    }

    /// The TCP options from the environment (see [`Dist::process_group`]).
    async fn tcp_options(&self) -> Result<TcpOptions, CommError> {
        let mut opts = TcpOptions {
            namespace: format!("consort/tcp/{}/world", self.env.restart_count),
            bind_addr: Some(bind_ip(&self.env).await?),
            ..TcpOptions::default()
        };
        if let Some(t) = seconds_var("CONSORT_TIMEOUT")? {
            // torch's init_process_group timeout bounds the rendezvous too.
            opts.timeout = t;
            opts.connect_timeout = t;
        }
        opts.algo.overrides = AlgoConfig::from_env()
            .map_err(|e| CommError::invalid(format!("CONSORT_ALGO: {e}")))?
            .overrides;
        if let Some(b) = count_var("CONSORT_SEGMENT_BYTES")? {
            opts.algo.segment_bytes = b;
        }
        if let Some(w) = count_var("CONSORT_WINDOW")? {
            opts.algo.window = w;
        }
        if let Some(k) = count_var("CONSORT_STREAMS")? {
            opts.streams = k;
        }
        if let Some(b) = count_var("CONSORT_IN_PLACE_MIN")? {
            opts.in_place_min = b;
        }
        if let Some(f) = std::env::var_os("CONSORT_HEARTBEAT_FILE").filter(|d| !d.is_empty()) {
            opts.heartbeat_file = Some(f.into());
        }
        if let Some(dir) = std::env::var_os("CONSORT_FLIGHT_DIR").filter(|d| !d.is_empty()) {
            opts.flight_dir = Some(dir.into());
            dump_on_sigusr1();
        }
        let mut shm = ShmTransport::default();
        if let Some(b) = count_var("CONSORT_SHM_QUEUE_BYTES")? {
            shm.queue_bytes = b;
        }
        // 0: no stage.
        if let Some(b) = uint_var("CONSORT_SHM_STAGE_BYTES", 0)? {
            shm.stage_bytes = b;
        }
        match std::env::var("CONSORT_SHM_CMA")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            None | Some("") => {}
            Some("1" | "true" | "True") => shm.cma = true,
            Some("0" | "false" | "False") => shm.cma = false,
            Some(v) => {
                return Err(CommError::invalid(format!(
                    "CONSORT_SHM_CMA={v:?} is not valid: expected 1 or 0"
                )));
            }
        }
        if let Some(n) = count_var("CONSORT_SHM_THREADS")? {
            if n == 0 || n > consort_comm::par::MAX_THREADS {
                return Err(CommError::invalid(format!(
                    "CONSORT_SHM_THREADS={n} is not valid: expected 1 to {} threads per rank",
                    consort_comm::par::MAX_THREADS
                )));
            }
            opts.threads = Some(n);
        }
        if let Some(us) = count_var("CONSORT_SHM_SPIN_US")? {
            opts.spin = Some(Duration::from_micros(us as u64));
        }
        match std::env::var("CONSORT_SHM").ok().as_deref().map(str::trim) {
            None | Some("" | "1" | "true" | "True") => opts.local = Some(shm.shared()),
            Some("0" | "false" | "False") => opts.local = None,
            Some(v) => {
                return Err(CommError::invalid(format!(
                    "CONSORT_SHM={v:?} is not valid: expected 1 or 0"
                )));
            }
        }
        Ok(opts)
    }

    /// The QUIC process group (feature `quic`): the same schedules as
    /// [`Dist::process_group`], over QUIC connections with TLS 1.3 and
    /// per-job certificates pinned through the store. Reads the same
    /// variables as TCP (bind address, timeouts, schedules, streams,
    /// `CONSORT_SECRET`, and `CONSORT_SHM`: as over TCP, the ranks on one
    /// host share memory, and only the links between hosts are QUIC).
    /// `CONSORT_QUIC_IDLE_TIMEOUT` (seconds, default 5) bounds how long a
    /// silent peer counts as alive.
    #[cfg(feature = "quic")]
    pub async fn quic_process_group(&self) -> Result<ProcessGroup, CommError> {
        let tcp = self.tcp_options().await?;
        let mut opts = consort_quic::QuicOptions {
            bind_addr: tcp.bind_addr,
            namespace: format!("consort/quic/{}/world", self.env.restart_count),
            streams: tcp.streams,
            secret: tcp.secret.clone(),
            driver: tcp,
            ..Default::default()
        };
        if let Some(t) = seconds_var("CONSORT_QUIC_IDLE_TIMEOUT")? {
            opts.idle_timeout = t;
        }
        let b = consort_quic::connect(self.store.clone(), self.env.rank, self.env.world_size, opts)
            .await?;
        Ok(ProcessGroup::new(Arc::new(b)))
    }

    /// Without feature `quic` (the default build carries no TLS stack):
    /// `BackendUnavailable`, saying how to build it in.
    #[cfg(not(feature = "quic"))]
    pub async fn quic_process_group(&self) -> Result<ProcessGroup, CommError> {
        Err(CommError::BackendUnavailable {
            backend: "quic".into(),
            reason: "this consort was built without QUIC; build it with `--features quic` \
                     (cargo build -p consort --features quic), or use the TCP process group"
                .into(),
        })
    }

    /// torch's `gloo` process group, with torch ranks in it or not: this
    /// rank joins the job's default group as `init_process_group("gloo")`
    /// does (torch's store keys and tags, Gloo's wire protocol and
    /// algorithms; see [`consort_tcp::gloo`]), so torch's ranks and
    /// consort's run collectives together. Init with
    /// [`InitOptions::torch_peers`] (`CONSORT_TORCH_PEERS=1`) when torch
    /// holds some ranks. `GLOO_SOCKET_IFNAME` picks the interface, as for
    /// torch; `CONSORT_TIMEOUT` (seconds) the op timeout (default 30
    /// minutes, as torch's). Subgroups: [`ProcessGroup::new_group`] on
    /// this group, called where torch's ranks call `dist.new_group`.
    pub async fn gloo_process_group(&self) -> Result<ProcessGroup, CommError> {
        let mut opts = consort_tcp::GlooOptions::default();
        if let Some(t) = seconds_var("CONSORT_TIMEOUT")? {
            opts.timeout = t;
        }
        // The launcher's watchdog sees a Gloo group's progress, and its
        // ranks leave flight records, as on every other backend.
        opts.heartbeat_file = std::env::var_os("CONSORT_HEARTBEAT_FILE")
            .filter(|f| !f.is_empty())
            .map(Into::into);
        opts.flight_dir = std::env::var_os("CONSORT_FLIGHT_DIR")
            .filter(|f| !f.is_empty())
            .map(Into::into);
        if opts.flight_dir.is_some() {
            dump_on_sigusr1();
        }
        let b = consort_tcp::GlooBackend::connect(
            self.store.clone(),
            self.env.rank,
            self.env.world_size,
            opts,
        )
        .await?;
        Ok(ProcessGroup::new(Arc::new(b)))
    }

    /// Whether this process hosts the store server.
    pub fn hosts_store(&self) -> bool {
        self.server.is_some()
    }
}

/// The store namespace of one rendezvous round (torchelastic restarts get
/// fresh keys).
fn rendezvous_store(store: &Arc<dyn Store>, env: &DistEnv) -> PrefixStore {
    PrefixStore::new(format!("consort/rdzv/{}", env.restart_count), store.clone())
}

/// `host:pid` of this process, for error messages.
fn identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_string());
    format!("{host}:{}", std::process::id())
}

/// Claims this rank in consort's rendezvous (a second process with the same
/// rank is refused) and waits until every rank has claimed its own.
async fn claim_rank(
    store: &Arc<dyn Store>,
    env: &DistEnv,
    opts: &InitOptions,
) -> Result<(), InitError> {
    let rank = env.rank;
    let err = |source| InitError::Store { rank, source };
    let rdzv = rendezvous_store(store, env);

    let me = identity();
    let key = format!("rank/{rank}");
    let owner = rdzv
        .compare_set(&key, b"", me.as_bytes())
        .await
        .map_err(err)?;
    if owner != me.as_bytes() {
        return Err(InitError::DuplicateRank {
            rank,
            first: String::from_utf8_lossy(&owner).into_owned(),
            second: me,
        });
    }
    let keys: Vec<String> = (0..env.world_size).map(|r| format!("rank/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    match rdzv.wait(&refs, opts.store_timeout).await {
        Ok(()) => {}
        Err(StoreError::Timeout { after, .. }) => {
            let mut missing = Vec::new();
            let mut missing_count = 0;
            for (r, k) in refs.iter().enumerate() {
                if !rdzv.check(&[k]).await.map_err(err)? {
                    missing_count += 1;
                    if missing.len() < 16 {
                        missing.push(r);
                    }
                }
            }
            return Err(InitError::Incomplete {
                rank,
                world_size: env.world_size,
                missing,
                missing_count,
                after,
            });
        }
        Err(e) => return Err(err(e)),
    }
    Ok(())
}

/// Reads torchrun's (or Slurm's) variables and joins the job; see [`init`].
/// `torch.distributed.init_process_group()` with `init_method="env://"`.
///
/// With no launcher variables at all, this is a world of one process with
/// an in-memory store, and it logs that it did so: the same program runs
/// alone or under a launcher. The variables it reads, and every other one
/// consort reads, are listed in [`crate::env`].
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // consort run --nproc-per-node 4 -- my_trainer  (or torchrun, or srun)
/// let dist = consort::init_from_env().await?;
/// let pg = dist.process_group().await?; // the default group (torch's WORLD), over TCP
/// let mut loss = [0.5f32];
/// pg.all_reduce(&mut loss, consort::ReduceOp::Avg).await?;
/// if dist.rank() == 0 {
///     println!("mean loss over {} ranks: {}", dist.world_size(), loss[0]);
/// }
/// dist.shutdown().await?; // destroy_process_group()
/// # Ok(()) }
/// ```
pub async fn init_from_env() -> Result<Dist, InitError> {
    init(DistEnv::from_env()?, InitOptions::from_env()?).await
}

/// Joins the job `env` describes: rank 0 hosts a TCPStore on
/// `MASTER_ADDR:MASTER_PORT` (unless the agent already does), every rank
/// connects to it, claims its rank, and waits until all ranks have.
pub async fn init(env: DistEnv, opts: InitOptions) -> Result<Dist, InitError> {
    let rank = env.rank;
    let err = |source| InitError::Store { rank, source };
    if env.launcher == Launcher::None {
        tracing::info!(
            "no launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, ... or SLURM_PROCID) found: \
             running as a world of one process"
        );
        return Ok(Dist {
            env,
            store: Arc::new(MemStore::new(opts.store_timeout)),
            server: None,
            timeout: opts.store_timeout,
            torch_peers: opts.torch_peers,
            #[cfg(feature = "nccl")]
            nccl_groups: Default::default(),
        });
    }
    let server = if env.hosts_store() {
        let bind = store_bind_addr(&env.master_addr, env.master_port).await;
        let opts = consort_tcp::ServerOptions::from_env().map_err(err)?;
        let server = TcpStoreServer::bind_opts(bind.as_str(), opts)
            .await
            .map_err(err)?;
        tracing::info!(addr = %server.local_addr(), "rank 0 hosts the store");
        Some(server)
    } else {
        None
    };
    let client = TcpStore::connect(
        env.store_addr(),
        TcpStoreOptions {
            timeout: opts.store_timeout,
            connect_timeout: opts.store_timeout,
            ..Default::default()
        },
    )
    .await
    .map_err(err)?;
    let store: Arc<dyn Store> = Arc::new(client);
    if opts.torch_peers {
        tracing::debug!(rank, "torch ranks share this job: no consort rendezvous");
        return Ok(Dist {
            env,
            store,
            server,
            timeout: opts.store_timeout,
            torch_peers: true,
            #[cfg(feature = "nccl")]
            nccl_groups: Default::default(),
        });
    }
    claim_rank(&store, &env, &opts).await?;
    tracing::debug!(rank, world_size = env.world_size, "rendezvous complete");
    Ok(Dist {
        env,
        store,
        server,
        timeout: opts.store_timeout,
        torch_peers: false,
        #[cfg(feature = "nccl")]
        nccl_groups: Default::default(),
    })
}

/// Where a store for `host:port` should listen: on that address when it
/// resolves to loopback only (a single-host job stays off the network),
/// otherwise on every interface (`0.0.0.0`, or `[::]` for an IPv6 host),
/// so the other hosts reach it whatever name they use for this one.
pub async fn store_bind_addr(host: &str, port: u16) -> String {
    let addr = crate::env::host_port(host, port);
    let addrs: Vec<_> = match tokio::net::lookup_host(addr.as_str()).await {
        Ok(a) => a.collect(),
        Err(_) => Vec::new(),
    };
    if !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback()) {
        addr
    } else if !addrs.is_empty() && addrs.iter().all(|a| a.is_ipv6()) {
        format!("[::]:{port}")
    } else {
        format!("0.0.0.0:{port}")
    }
}

/// A positive number of seconds from `var`, if set.
fn seconds_var(var: &'static str) -> Result<Option<Duration>, CommError> {
    match std::env::var(var).ok().filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => consort_comm::time::parse_seconds(&v, false)
            .map(Some)
            .map_err(|why| {
                CommError::invalid(format!(
                    "{var}={v:?} is not valid: {why}; expected a positive number of seconds"
                ))
            }),
    }
}

/// A positive integer from `var`, if set.
fn count_var(var: &'static str) -> Result<Option<usize>, CommError> {
    uint_var(var, 1)
}

/// An integer variable of at least `least` (unset or empty: `None`).
fn uint_var(var: &'static str, least: usize) -> Result<Option<usize>, CommError> {
    match std::env::var(var).ok().filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| *n >= least)
            .map(Some)
            .ok_or_else(|| {
                let what = if least == 0 {
                    "a whole number"
                } else {
                    "a positive integer"
                };
                CommError::invalid(format!("{var}={v:?} is not valid: expected {what}"))
            }),
    }
}

/// The address the data mesh listens on and advertises.
async fn bind_ip(env: &DistEnv) -> Result<std::net::IpAddr, CommError> {
    if let Ok(v) = std::env::var("CONSORT_BIND_ADDR")
        && !v.is_empty()
    {
        return v.trim().parse().map_err(|_| {
            CommError::invalid(format!(
                "CONSORT_BIND_ADDR={v:?} is not valid: expected an IPv4 or IPv6 address"
            ))
        });
    }
    if let Ok(name) = std::env::var("CONSORT_SOCKET_IFNAME")
        && !name.is_empty()
    {
        return consort_tcp::iface::interface_addr(name.trim())
            .map_err(|e| CommError::invalid(format!("CONSORT_SOCKET_IFNAME={name:?}: {e}")));
    }
    let addrs: Vec<std::net::SocketAddr> = match tokio::net::lookup_host(env.store_addr()).await {
        Ok(a) => a.collect(),
        Err(_) => Vec::new(),
    };
    let Some(master) = addrs.first().copied() else {
        return Ok(std::net::Ipv4Addr::LOCALHOST.into());
    };
    if master.ip().is_loopback() {
        if env.world_size > env.local_world_size {
            tracing::warn!(
                "MASTER_ADDR={} resolves to loopback but the job spans several nodes; set MASTER_ADDR \
                 to an address the other nodes can reach, or CONSORT_BIND_ADDR",
                env.master_addr
            );
        }
        return Ok(master.ip());
    }
    // The local address of a (never used) UDP "connection" to the master is
    // the interface that routes there.
    let local = std::net::UdpSocket::bind(if master.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })
    .and_then(|s| s.connect(master).and_then(|()| s.local_addr()))
    .map_err(|e| {
        CommError::invalid(format!(
            "cannot find a route to MASTER_ADDR {master}: {e}; set CONSORT_BIND_ADDR"
        ))
    })?;
    Ok(local.ip())
}

/// On SIGUSR1, every group's flight record (mesh, NCCL, emulated device,
/// Gloo) is written to its `CONSORT_FLIGHT_DIR`.
fn dump_on_sigusr1() {
    consort_comm::flight::dump_on_sigusr1();
}

/// A switch from `var` (`1`/`true` or `0`/`false`), `default` when unset.
fn bool_var(var: &'static str, default: bool) -> Result<bool, CommError> {
    match std::env::var(var).ok().as_deref().map(str::trim) {
        None | Some("") => Ok(default),
        Some("1" | "true" | "True") => Ok(true),
        Some("0" | "false" | "False") => Ok(false),
        Some(v) => Err(CommError::invalid(format!(
            "{var}={v:?} is not valid: expected 1 or 0"
        ))),
    }
}
