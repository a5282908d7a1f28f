//! Reading the launcher's environment ([`DistEnv::from_env`]), and the one
//! list of every environment variable consort reads.
//!
//! This module owns the rules for torchrun's variables, the Slurm fallback,
//! and the world of one when no launcher is present. It does no I/O beyond
//! reading variables; [`crate::init_from_env`] uses the result to meet the
//! other ranks. The other variables below are read where their setting is
//! used (named in the second column); their docs link here.
//!
//! ```
//! use consort::{DistEnv, Launcher};
//!
//! // What torchrun --nnodes 2 --nproc-per-node 4 gives the second node's first worker.
//! let vars = [("RANK", "4"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "0"),
//!             ("LOCAL_WORLD_SIZE", "4"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];
//! let env = DistEnv::from_lookup(&|k| vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string()))?;
//! assert_eq!((env.rank, env.local_rank, env.launcher), (4, 0, Launcher::Torchrun));
//! assert_eq!(env.store_addr(), "10.0.0.1:29500");
//! assert!(!env.hosts_store()); // rank 0 does
//!
//! // No launcher at all: a world of one.
//! assert_eq!(DistEnv::from_lookup(&|_| None)?.world_size, 1);
//! # Ok::<(), consort::EnvError>(())
//! ```
//!
//! Empty values count as unset. A malformed value is an error that names
//! the variable and the form it expects, never a silent default.
//!
//! # The launcher's variables
//!
//! Read by [`crate::init_from_env`] ([`DistEnv::from_env`] and
//! [`crate::InitOptions::from_env`]). torchrun and `consort run` set the
//! first five rows; Slurm's `srun` the `SLURM_` ones.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `RANK`, `WORLD_SIZE` | unset: Slurm's, else a world of one | global rank and size; both or neither, `RANK < WORLD_SIZE <=` [`MAX_WORLD_SIZE`] |
//! | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | `RANK`, `WORLD_SIZE` | rank and size on this node; both or neither, at most [`MAX_LOCAL_WORLD_SIZE`]. `LOCAL_RANK` is also the GPU of `NcclBackend` unless `NcclOptions::device` says otherwise (default 0) |
//! | `MASTER_ADDR`, `MASTER_PORT` | needed when `WORLD_SIZE > 1`; port 29500 under Slurm | where the store is: rank 0 hosts it there, or the launcher's agent does |
//! | `TORCHELASTIC_USE_AGENT_STORE` | `False` | `True` (or `1`): the launcher's agent hosts the store, rank 0 only connects |
//! | `TORCHELASTIC_RESTART_COUNT` | 0 | the restart round; each round rendezvouses under fresh store keys |
//! | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` | unset | rank, world size and local rank when `RANK` and `WORLD_SIZE` are unset; all three or none |
//! | `SLURM_NTASKS_PER_NODE`, `SLURM_TASKS_PER_NODE` | `SLURM_NTASKS` | the local world size under Slurm (the first count of `4(x2)`) |
//! | `SLURM_LAUNCH_NODE_IPADDR` | unset | `MASTER_ADDR` under Slurm when that is unset |
//! | `CONSORT_STORE_TIMEOUT` | 300 | seconds (fractions allowed) to reach the store and for every rank to arrive; the store client's request timeout (torch's 300 s) |
//! | `CONSORT_TORCH_PEERS` | 0 | `1`: torch processes hold some ranks (a mixed job with [`crate::Dist::gloo_process_group`]): claim and wait for no one in consort's own rendezvous |
//!
//! # The store
//!
//! | variable | read by | default | meaning |
//! |---|---|---|---|
//! | `CONSORT_SECRET` | the TCPStore server and client, every TCP and QUIC connection (`Secret::from_env`; not Gloo's, whose protocol is torch's) | unset: no handshake | shared secret: every store and data connection starts with a mutual HMAC-SHA256 challenge-response (see SECURITY.md). `consort run` passes its own to its workers. torch's clients cannot answer it |
//! | `CONSORT_STORE_MAX_BYTES` | the TCPStore server (rank 0's, `consort run`'s agent store, `consort store`: `ServerOptions::from_env`) | `1G` | the most bytes the store holds or owes (keys, values, requests being read, replies not yet sent, keys waited for); K, M, G, T suffixes (1024-based). One client may owe an eighth of it (at least 16 MiB); a request past its share drops that client, with a log line |
//! | `CONSORT_STORE_MAX_CLIENTS` | the TCPStore server | 16384 | the most clients connected at once; more are closed as they connect |
//!
//! # Process groups
//!
//! Read when a [`crate::Dist`] makes a group: [`crate::Dist::process_group`]
//! (TCP, shared memory on the same host), `Dist::quic_process_group`,
//! [`crate::Dist::gloo_process_group`], `Dist::nccl_process_group`,
//! [`crate::Dist::emulated_process_group`]. "Mesh" below is consort's own
//! CPU transport, under the TCP and QUIC groups and the emulated device's
//! host side alike. Counts are plain integers.
//!
//! | variable | read by | default | meaning |
//! |---|---|---|---|
//! | `CONSORT_TIMEOUT` | every group; [`crate::Dist::shutdown_failed`] | 1800 (TCP, QUIC, Gloo), 600 (NCCL), as torch | seconds before a collective fails with `Timeout`; also bounds building the TCP/QUIC mesh (300 otherwise), NCCL's init and splits, and how long a failed rank waits for goodbyes |
//! | `CONSORT_BIND_ADDR` | mesh | the address this host uses to reach `MASTER_ADDR` (loopback for a one-node job) | IPv4 or IPv6 address the mesh listens on and advertises |
//! | `CONSORT_SOCKET_IFNAME` | mesh | unset | network interface whose address the mesh listens on (as `GLOO_SOCKET_IFNAME`); `CONSORT_BIND_ADDR` wins |
//! | `CONSORT_ALGO` | mesh (`AlgoConfig::from_env`) | the selection policy | force algorithms: `ring`, or `all_reduce=ring,broadcast=chain` (ring, halving_doubling, recursive_doubling, one_shot, binomial_tree, chain, direct, pairwise, dissemination) |
//! | `CONSORT_SEGMENT_BYTES` | mesh | 1048576 | pipeline segment size in bytes; every rank must agree |
//! | `CONSORT_WINDOW` | mesh | 4 | segments in flight per link |
//! | `CONSORT_STREAMS` | mesh | 1 | connections per pair of ranks, at most 8 |
//! | `CONSORT_IN_PLACE_MIN` | mesh | 65536 | payloads of at least this many bytes are written straight into the posted receive's buffer |
//! | `CONSORT_SHM` | mesh | 1 | `0`: peers on this host go over the network too, instead of shared memory |
//! | `CONSORT_SHM_QUEUE_BYTES` | mesh | 4194304 | bytes of each direction's shared-memory queue: a power of two, at least 65536 |
//! | `CONSORT_SHM_STAGE_BYTES` | mesh | 4194304 | bytes of each rank's stage, which its same-host peers read: a large broadcast on one host copies each segment in once and every reader copies it out (`0`: no stage; every rank must have one for the direct broadcast to be chosen); a power of two, at least 65536 |
//! | `CONSORT_SHM_THREADS` | mesh | the rank's share of its host's cores less one (1 to 8) | threads a rank splits each large copy or reduction over, itself included (`consort_comm::par`): 1 where its host's ranks have a core each or share them |
//! | `CONSORT_SHM_SPIN_US` | mesh | 50, or 500 where ranks share cores | microseconds a waiting call polls its shared-memory queues before it sleeps until rung (yielding the core between polls when the host runs more ranks than cores) |
//! | `CONSORT_SHM_CMA` | mesh | 0 | `1`: peers on this host read large broadcast, all_gather, gather, scatter and all_to_all payloads straight from the sender's memory (`process_vm_readv`) |
//! | `CONSORT_QUIC_IDLE_TIMEOUT` | QUIC | 5 | seconds of silence after which a QUIC peer is lost |
//! | `CONSORT_HEARTBEAT_FILE` | every group | unset: none | the file the group touches as its calls progress, for `consort run --watchdog-timeout` (which sets it per worker) |
//! | `CONSORT_FLIGHT_DIR` | every group | unset: records kept in memory | where each rank writes its flight record (`rank-K.json`) on a failure and on SIGUSR1; `consort run` sets it per worker |
//! | `GLOO_SOCKET_IFNAME` | Gloo | this host's name if it resolves to a usable address, else 127.0.0.1 | the interface a Gloo rank listens on, as torch's |
//! | `TORCH_GLOO_LAZY_INIT`, `TORCH_DIST_INIT_BARRIER` | Gloo | unset | refused when on: torch's ranks would then connect, or wait, in ways consort's do not |
//!
//! # NCCL (feature `nccl`)
//!
//! | variable | read by | default | meaning |
//! |---|---|---|---|
//! | `CONSORT_NCCL_CHECK` | `Dist::nccl_process_group`, `Dist::nccl_backend` | 1 | `0` turns off the mismatch check over a TCP side channel (a world of one has none) |
//! | `CONSORT_NCCL_BLOCKING` | the same | 0 | `1`: a blocking communicator, torch's default (less host time per call; init not bounded) |
//! | `CONSORT_SHARE_GPU` | `Dist::nccl_backend` | 0 | `1`: every rank on GPU 0, for correctness runs on one GPU (NCCL 2.30+ also needs `NCCL_MULTI_RANK_GPU_ENABLE=1`; older releases one `NCCL_HOSTID` per rank) |
//! | `CONSORT_NCCL_LIBRARY` | `consort_nccl::sys` | unset | path of the `libnccl.so.2` to load; otherwise the active Python environment's wheel, then the loader's path |
//! | `VIRTUAL_ENV`, `CONDA_PREFIX` | `consort_nccl::sys` | unset | a Python environment whose `nvidia/nccl/lib` (torch's own NCCL wheel) is tried |
//! | `TORCH_DIST_USE_NCCL2` | `consort_nccl::keys` | nccl2 | `0`: the classic `ProcessGroupNCCL`'s store keys and split colours, as torch chooses |
//! | `CONSORT_TORCH_NCCL_EAGER` | `Dist::nccl_backend` | off | `1`: the torch job made its default group eagerly (`init_process_group(device_id=...)`), so the classic backend splits each `new_group` from it; otherwise a classic-backend `new_group` takes a fresh id from the store under the group's name (`consort_nccl::keys::torch_subgroup_bootstrap`) |
//! | `LD_LIBRARY_PATH`, `CUDA_VISIBLE_DEVICES` | `consort_nccl::probe`, `consort run --nproc-per-node gpu` | unset | not interpreted by consort: shown in the error when a library or a GPU is missing |
//! | `NCCL_*` | NCCL itself | NCCL's | passed through untouched (`NCCL_DEBUG`, `NCCL_SOCKET_IFNAME`, ...) |
//!
//! # The binary and the launcher
//!
//! | variable | read by | default | meaning |
//! |---|---|---|---|
//! | `CONSORT_THREADS` | the `consort` binary | one worker per core | async runtime worker threads; `1`: a single thread (more ranks than cores) |
//! | `CONSORT_LOG` | the `consort` binary, the examples | `info` | log filter, in `tracing`'s syntax |
//! | `OMP_NUM_THREADS` | `consort run` | set to 1 for the workers when unset | as torchrun |
//! | `HOSTNAME` | [`crate::init_from_env`] | unset | this process's name in a duplicate-rank error, when `/proc/sys/kernel/hostname` cannot be read |
//!
//! [`crate::launch`] (`consort run`) gives every worker torchrun's
//! variables: `RANK`, `LOCAL_RANK`, `GROUP_RANK`, `ROLE_RANK`, `ROLE_NAME`,
//! `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_WORLD_SIZE`, `ROLE_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RESTART_COUNT`,
//! `TORCHELASTIC_MAX_RESTARTS`, `TORCHELASTIC_RUN_ID`,
//! `TORCHELASTIC_USE_AGENT_STORE=True` and `TORCHELASTIC_ERROR_FILE`, and
//! consort's `CONSORT_FLIGHT_DIR`, `CONSORT_HEARTBEAT_FILE` (with
//! `--watchdog-timeout`) and `CONSORT_SECRET` (when it has one).
//!
//! # Tests only
//!
//! | variable | read by | meaning |
//! |---|---|---|
//! | `CONSORT_TORCH_PYTHON` | the interop tests (`torch_interop`, `gloo_mixed`, `python_safetensors`, the pipeline schedules') | a Python with torch; unset, those tests skip |
//! | `PROPTEST_CASES` | proptest | cases per property, over every test's own count (the TCP conformance worlds default to 32: their meshes are expensive) |
//! | `CONSORT_NCCL_WHEEL_DIR` | consort-nccl's discovery test | a directory holding NCCL's pip wheel |
//! | `CONSORT_TEST_MODE`, `CONSORT_TEST_BACKEND`, `CONSORT_TEST_WORKER`, `CONSORT_DISCOVERY_CHILD` | the tests' own child processes | set by a test for the process it starts |

use std::fmt;

/// Which launcher the variables came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun, `consort run`, or anything else that sets `RANK` and
    /// `WORLD_SIZE`.
    Torchrun,
    /// Slurm's `srun` (`SLURM_PROCID`, ...).
    Slurm,
    /// No launcher: a world of one process.
    None,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "slurm",
            Launcher::None => "none",
        })
    }
}

/// `host:port`, bracketing an IPv6 literal (`[::1]:29500`).
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The default `MASTER_PORT` (torchrun's).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// This process's place in the job, as the launcher described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Processes on this node.
    pub local_world_size: usize,
    /// Host of the store.
    pub master_addr: String,
    /// Port of the store.
    pub master_port: u16,
    /// Whether the launcher's agent already hosts the store.
    pub use_agent_store: bool,
    /// How many times the launcher restarted the workers.
    pub restart_count: u32,
    /// Where these values came from.
    pub launcher: Launcher,
}

/// A launcher variable that is missing or malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// A variable does not parse.
    #[error("{var}={value:?} is not valid: expected {expected}")]
    Malformed {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// The form it should have.
        expected: &'static str,
    },
    /// Some variables of a set are present and a required one is not.
    #[error(
        "{missing} is not set, but {present} is. Set {missing} too (a launcher such as \
         torchrun, srun or `consort run` sets all of them), or unset {present} to run as a \
         single process"
    )]
    Missing {
        /// The variable that is missing.
        missing: &'static str,
        /// A variable of the same set that is present.
        present: &'static str,
    },
    /// The values contradict each other.
    #[error("{0}")]
    Inconsistent(String),
}

type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn get(env: Lookup<'_>, var: &str) -> Option<String> {
    env(var).filter(|v| !v.is_empty())
}

fn parse_usize(env: Lookup<'_>, var: &'static str) -> Result<Option<usize>, EnvError> {
    get(env, var)
        .map(|v| {
            v.trim().parse::<usize>().map_err(|_| EnvError::Malformed {
                var,
                value: v,
                expected: "a non-negative integer",
            })
        })
        .transpose()
}

fn need(env: Lookup<'_>, var: &'static str, present: &'static str) -> Result<usize, EnvError> {
    parse_usize(env, var)?.ok_or(EnvError::Missing {
        missing: var,
        present,
    })
}

fn parse_port(env: Lookup<'_>) -> Result<Option<u16>, EnvError> {
    get(env, "MASTER_PORT")
        .map(|v| match v.trim().parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(EnvError::Malformed {
                var: "MASTER_PORT",
                value: v,
                expected: "a TCP port from 1 to 65535",
            }),
        })
        .transpose()
}

fn parse_bool(env: Lookup<'_>, var: &'static str) -> Result<bool, EnvError> {
    match get(env, var).as_deref().map(str::trim) {
        None => Ok(false),
        Some("True" | "true" | "1") => Ok(true),
        Some("False" | "false" | "0") => Ok(false),
        Some(v) => Err(EnvError::Malformed {
            var,
            value: v.to_string(),
            expected: "True or False",
        }),
    }
}

/// The leading count of a Slurm tasks-per-node value such as `4(x2)` or `4,2`.
fn slurm_first_count(v: &str) -> Option<usize> {
    let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().filter(|n| *n > 0)
}

impl DistEnv {
    /// A world of one process, with the store on loopback.
    pub fn single_process() -> Self {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".to_string(),
            master_port: DEFAULT_MASTER_PORT,
            use_agent_store: false,
            restart_count: 0,
            launcher: Launcher::None,
        }
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Reads variables through `env` (a test can pass a map). Empty values
    /// count as unset.
    pub fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let has = |v: &str| get(env, v).is_some();
        let torch_vars = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"];
        let slurm_vars = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"];
        // `local_given`: whether the processes on this node were given (not
        // defaulted to the whole world): only then is the per-host bound
        // checked.
        let (mut e, local_given) = if let Some(present) = torch_vars.into_iter().find(|v| has(v)) {
            torchrun_ranks(env, present)?
        } else if let Some(present) = slurm_vars.into_iter().find(|v| has(v)) {
            slurm_ranks(env, present)?
        } else if let Some(present) = ["MASTER_ADDR", "MASTER_PORT"].into_iter().find(|v| has(v)) {
            return Err(EnvError::Missing {
                missing: "RANK",
                present,
            });
        } else {
            return Ok(DistEnv::single_process());
        };
        check_ranks(&e)?;
        check_sizes(&e, local_given)?;
        e.rendezvous(env)?;
        Ok(e)
    }

    /// The store's address and port, and torchelastic's agent-store flag
    /// and restart count, once the ranks are known.
    fn rendezvous(&mut self, env: Lookup<'_>) -> Result<(), EnvError> {
        let port = parse_port(env)?;
        let slurm = self.launcher == Launcher::Slurm;
        let addr = get(env, "MASTER_ADDR").or_else(|| {
            slurm
                .then(|| get(env, "SLURM_LAUNCH_NODE_IPADDR"))
                .flatten()
        });
        self.master_addr = match addr {
            Some(a) => a.trim().to_string(),
            // A world of one never talks to anyone: loopback is enough.
            None if self.world_size == 1 => "127.0.0.1".to_string(),
            None => {
                return Err(EnvError::Missing {
                    missing: "MASTER_ADDR",
                    present: if slurm { "SLURM_PROCID" } else { "RANK" },
                });
            }
        };
        self.master_port = match port {
            Some(p) => p,
            None if slurm || self.world_size == 1 => DEFAULT_MASTER_PORT,
            None => {
                return Err(EnvError::Missing {
                    missing: "MASTER_PORT",
                    present: "MASTER_ADDR",
                });
            }
        };
        self.use_agent_store = parse_bool(env, "TORCHELASTIC_USE_AGENT_STORE")?;
        self.restart_count = match get(env, "TORCHELASTIC_RESTART_COUNT") {
            None => 0,
            Some(v) => v.trim().parse().map_err(|_| EnvError::Malformed {
                var: "TORCHELASTIC_RESTART_COUNT",
                value: v,
                expected: "a non-negative integer",
            })?,
        };
        Ok(())
    }

    /// `MASTER_ADDR:MASTER_PORT`, bracketing IPv6 literals.
    pub fn store_addr(&self) -> String {
        host_port(&self.master_addr, self.master_port)
    }

    /// Whether this process hosts the store: rank 0, unless the launcher's
    /// agent already does.
    pub fn hosts_store(&self) -> bool {
        self.rank == 0 && !self.use_agent_store
    }
}

/// The most ranks a job may have (torch's largest jobs are well below it;
/// past it a typo, say WORLD_SIZE=1000000000, would make every rank
/// allocate per-rank state until it runs out of memory).
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// The most processes one host runs (`LOCAL_WORLD_SIZE`, `consort run
/// --nproc-per-node`, `consort bench --world-size`).
pub const MAX_LOCAL_WORLD_SIZE: usize = 4096;

/// The ranks torchrun's variables give (`present` is one that is set),
/// and whether the node's own processes were given.
fn torchrun_ranks(env: Lookup<'_>, present: &'static str) -> Result<(DistEnv, bool), EnvError> {
    let rank = need(env, "RANK", present)?;
    let world_size = need(env, "WORLD_SIZE", present)?;
    let (local_rank, local_world_size, local_given) = match (
        parse_usize(env, "LOCAL_RANK")?,
        parse_usize(env, "LOCAL_WORLD_SIZE")?,
    ) {
        (Some(r), Some(n)) => (r, n, true),
        (None, None) => (rank, world_size, false),
        (Some(_), None) => {
            return Err(EnvError::Missing {
                missing: "LOCAL_WORLD_SIZE",
                present: "LOCAL_RANK",
            });
        }
        (None, Some(_)) => {
            return Err(EnvError::Missing {
                missing: "LOCAL_RANK",
                present: "LOCAL_WORLD_SIZE",
            });
        }
    };
    let e = DistEnv {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr: String::new(),
        master_port: 0,
        use_agent_store: false,
        restart_count: 0,
        launcher: Launcher::Torchrun,
    };
    Ok((e, local_given))
}

/// The ranks Slurm's variables give (`present` is one that is set), and
/// whether the node's task count was given.
fn slurm_ranks(env: Lookup<'_>, present: &'static str) -> Result<(DistEnv, bool), EnvError> {
    let rank = need(env, "SLURM_PROCID", present)?;
    let world_size = need(env, "SLURM_NTASKS", present)?;
    let local_rank = need(env, "SLURM_LOCALID", present)?;
    let per_node = ["SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
        .into_iter()
        .find_map(|v| get(env, v).and_then(|s| slurm_first_count(&s)));
    let e = DistEnv {
        rank,
        world_size,
        local_rank,
        local_world_size: per_node.unwrap_or(world_size),
        master_addr: String::new(),
        master_port: DEFAULT_MASTER_PORT,
        use_agent_store: false,
        restart_count: 0,
        launcher: Launcher::Slurm,
    };
    Ok((e, per_node.is_some()))
}

/// The ranks fit their world and their node.
fn check_ranks(e: &DistEnv) -> Result<(), EnvError> {
    if e.world_size == 0 {
        let var = if e.launcher == Launcher::Slurm {
            "SLURM_NTASKS"
        } else {
            "WORLD_SIZE"
        };
        return Err(EnvError::Malformed {
            var,
            value: "0".into(),
            expected: "a positive integer",
        });
    }
    if e.rank >= e.world_size {
        return Err(EnvError::Inconsistent(format!(
            "rank {} is out of range for a world of {} processes (rank must be below the world \
             size)",
            e.rank, e.world_size
        )));
    }
    if e.local_world_size == 0
        || e.local_rank >= e.local_world_size
        || e.local_world_size > e.world_size
    {
        return Err(EnvError::Inconsistent(format!(
            "local rank {} of {} processes on this node does not fit a world of {} (need \
             local_rank < local_world_size <= world_size)",
            e.local_rank, e.local_world_size, e.world_size
        )));
    }
    Ok(())
}

fn check_sizes(e: &DistEnv, local_given: bool) -> Result<(), EnvError> {
    if e.world_size > MAX_WORLD_SIZE {
        return Err(EnvError::Inconsistent(format!(
            "a world of {} processes is more than consort supports ({MAX_WORLD_SIZE}); check \
             WORLD_SIZE (or SLURM_NTASKS)",
            e.world_size
        )));
    }
    if local_given && e.local_world_size > MAX_LOCAL_WORLD_SIZE {
        return Err(EnvError::Inconsistent(format!(
            "{} processes on this node is more than one host can hold ({MAX_LOCAL_WORLD_SIZE}); \
             check LOCAL_WORLD_SIZE (or SLURM_NTASKS_PER_NODE)",
            e.local_world_size
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<DistEnv, EnvError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_lookup(&move |k| m.get(k).cloned())
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29400"),
    ];

    fn with(
        base: &[(&'static str, &'static str)],
        over: &[(&'static str, &'static str)],
    ) -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = base
            .iter()
            .filter(|(k, _)| !over.iter().any(|(o, _)| o == k))
            .copied()
            .collect();
        v.extend(over.iter().filter(|(_, val)| *val != "<unset>").copied());
        v
    }

    #[test]
    fn no_launcher_is_a_world_of_one() {
        let e = parse(&[]).unwrap();
        assert_eq!(e, DistEnv::single_process());
        assert_eq!(e.launcher, Launcher::None);
        // Empty values count as unset.
        assert_eq!(parse(&[("RANK", "")]).unwrap().world_size, 1);
    }

    #[test]
    fn torchrun_variables() {
        let e = parse(TORCHRUN).unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (3, 8, 1, 2)
        );
        assert_eq!(e.store_addr(), "node0:29400");
        assert_eq!(e.launcher, Launcher::Torchrun);
        assert!(!e.hosts_store());
        let agent = parse(&with(
            TORCHRUN,
            &[
                ("RANK", "0"),
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                ("TORCHELASTIC_RESTART_COUNT", "2"),
            ],
        ))
        .unwrap();
        assert!(agent.use_agent_store && !agent.hosts_store());
        assert_eq!(agent.restart_count, 2);
        let host = parse(&with(
            TORCHRUN,
            &[("RANK", "0"), ("TORCHELASTIC_USE_AGENT_STORE", "False")],
        ))
        .unwrap();
        assert!(host.hosts_store());
        let v6 = parse(&with(TORCHRUN, &[("MASTER_ADDR", "::1")])).unwrap();
        assert_eq!(v6.store_addr(), "[::1]:29400");
        // Without LOCAL_*: one node.
        let e = parse(&with(
            TORCHRUN,
            &[("LOCAL_RANK", "<unset>"), ("LOCAL_WORLD_SIZE", "<unset>")],
        ))
        .unwrap();
        assert_eq!((e.local_rank, e.local_world_size), (3, 8));
        // A world of one needs no master.
        let e = parse(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!(e.store_addr(), "127.0.0.1:29500");
    }

    #[test]
    fn slurm_fallback() {
        let e = parse(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("MASTER_ADDR", "10.0.0.1"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(e.store_addr(), "10.0.0.1:29500");
        assert_eq!(e.launcher, Launcher::Slurm);
        // torchrun's variables win over Slurm's.
        let e = parse(&with(
            TORCHRUN,
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_LOCALID", "0"),
            ],
        ))
        .unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
        let e = parse(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.1.1"),
        ])
        .unwrap();
        assert_eq!(e.store_addr(), "10.1.1.1:29500");
    }

    /// The error matrix: every case names the variable and what it expects.
    #[test]
    fn bad_and_partial_values_name_the_variable() {
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (
                with(TORCHRUN, &[("RANK", "three")]),
                "RANK=\"three\" is not valid: expected a non-negative integer",
            ),
            (with(TORCHRUN, &[("RANK", "-1")]), "RANK=\"-1\""),
            (
                with(TORCHRUN, &[("WORLD_SIZE", "0")]),
                "WORLD_SIZE=\"0\" is not valid: expected a positive integer",
            ),
            (
                with(TORCHRUN, &[("WORLD_SIZE", "<unset>")]),
                "WORLD_SIZE is not set, but RANK is",
            ),
            (
                with(TORCHRUN, &[("RANK", "<unset>")]),
                "RANK is not set, but WORLD_SIZE is",
            ),
            (
                with(TORCHRUN, &[("RANK", "8")]),
                "rank 8 is out of range for a world of 8",
            ),
            (
                with(TORCHRUN, &[("LOCAL_RANK", "2")]),
                "local rank 2 of 2 processes",
            ),
            (
                with(TORCHRUN, &[("LOCAL_WORLD_SIZE", "<unset>")]),
                "LOCAL_WORLD_SIZE is not set, but LOCAL_RANK is",
            ),
            (
                with(TORCHRUN, &[("LOCAL_RANK", "<unset>")]),
                "LOCAL_RANK is not set, but LOCAL_WORLD_SIZE is",
            ),
            (
                with(TORCHRUN, &[("MASTER_PORT", "http")]),
                "MASTER_PORT=\"http\" is not valid: expected a TCP port from 1 to 65535",
            ),
            (
                with(TORCHRUN, &[("MASTER_PORT", "70000")]),
                "MASTER_PORT=\"70000\"",
            ),
            (with(TORCHRUN, &[("MASTER_PORT", "0")]), "MASTER_PORT=\"0\""),
            (
                with(TORCHRUN, &[("MASTER_PORT", "<unset>")]),
                "MASTER_PORT is not set, but MASTER_ADDR is",
            ),
            (
                with(TORCHRUN, &[("MASTER_ADDR", "<unset>")]),
                "MASTER_ADDR is not set, but RANK is",
            ),
            (
                with(TORCHRUN, &[("TORCHELASTIC_USE_AGENT_STORE", "yes")]),
                "TORCHELASTIC_USE_AGENT_STORE=\"yes\" is not valid: expected True or False",
            ),
            (
                with(TORCHRUN, &[("TORCHELASTIC_RESTART_COUNT", "x")]),
                "TORCHELASTIC_RESTART_COUNT=\"x\"",
            ),
            (
                vec![("MASTER_ADDR", "h"), ("MASTER_PORT", "1")],
                "RANK is not set, but MASTER_ADDR is",
            ),
            (
                vec![("SLURM_PROCID", "0")],
                "SLURM_NTASKS is not set, but SLURM_PROCID is",
            ),
            (
                vec![("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")],
                "SLURM_LOCALID is not set",
            ),
            (
                vec![
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_LOCALID", "0"),
                ],
                "MASTER_ADDR is not set, but SLURM_PROCID is",
            ),
            (
                vec![
                    ("SLURM_PROCID", "x"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_LOCALID", "0"),
                ],
                "SLURM_PROCID=\"x\"",
            ),
        ];
        for (vars, want) in cases {
            let e = parse(&vars).expect_err(want);
            assert!(
                e.to_string().contains(want),
                "{vars:?}: got `{e}`, want `{want}`"
            );
        }
    }

    mod proptests {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Any values at all: an Ok that respects the invariants, or an
            /// error; never a panic.
            #[test]
            fn arbitrary_values_never_panic(
                rank in prop::option::of("[0-9a-z-]{0,4}"),
                world in prop::option::of("[0-9]{0,3}"),
                port in prop::option::of("[0-9]{0,6}"),
                agent in prop::option::of("(True|False|maybe)"),
            ) {
                let mut vars = vec![("MASTER_ADDR", "h".to_string())];
                if let Some(r) = rank { vars.push(("RANK", r)); }
                if let Some(w) = world { vars.push(("WORLD_SIZE", w)); }
                if let Some(p) = port { vars.push(("MASTER_PORT", p)); }
                if let Some(a) = agent { vars.push(("TORCHELASTIC_USE_AGENT_STORE", a)); }
                let m: HashMap<&str, String> = vars.into_iter().collect();
                if let Ok(e) = DistEnv::from_lookup(&move |k| m.get(k).cloned()) {
                    prop_assert!(e.rank < e.world_size);
                    prop_assert!(e.local_rank < e.local_world_size);
                    prop_assert!(e.master_port > 0);
                }
            }
        }
    }
}
