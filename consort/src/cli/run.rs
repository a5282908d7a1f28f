//! `consort run`: a torchrun-compatible launcher (the elastic agent).
//!
//! One agent per node. Node 0's agent hosts the TCPStore as the agent
//! store; every agent meets the others through it, once per restart round,
//! then starts `--nproc-per-node` workers with the variables torchrun sets.
//! It prefixes their output with the rank, watches them, and on a failure
//! stops the whole group (SIGTERM, then SIGKILL), and restarts every node's
//! workers with `TORCHELASTIC_RESTART_COUNT + 1`, up to `--max-restarts`.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use consort::{TcpStore, TcpStoreOptions, TcpStoreServer, store::Store};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
    signal::unix::{SignalKind, signal},
};

use super::{gpus, watchdog::Watchdog};

/// The flags, as torchrun names them.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "torchrun's underscore spellings (--nproc_per_node, ...) are accepted too.")]
pub(crate) struct RunArgs {
    /// Workers on this node: a number; `gpu`, one per visible CUDA GPU (an
    /// error if there is none); `auto`, one per GPU, or one per CPU without
    /// a GPU; or `cpu`, one per CPU (std::thread::available_parallelism).
    /// With `gpu`, each worker should use GPU LOCAL_RANK (e.g. cuda:LOCAL_RANK).
    #[arg(
        long,
        alias = "nproc_per_node",
        default_value = "1",
        value_name = "N|gpu|auto|cpu"
    )]
    nproc_per_node: NprocPerNode,
    /// Number of nodes.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's rank among the nodes.
    #[arg(long, alias = "node_rank", default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0 (the store).
    #[arg(long, alias = "master_addr", default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the store.
    #[arg(long, alias = "master_port", default_value_t = 29500)]
    master_port: u16,
    /// A single node on a free local port.
    #[arg(long)]
    standalone: bool,
    /// Restarts of the whole group after a failure.
    #[arg(long, alias = "max_restarts", default_value_t = 0)]
    max_restarts: u32,
    /// Seconds between checks on the workers.
    #[arg(long, alias = "monitor_interval", default_value_t = 0.1)]
    monitor_interval: f64,
    /// Id of this run (TORCHELASTIC_RUN_ID).
    #[arg(long, alias = "rdzv_id", default_value = "none")]
    rdzv_id: String,
    /// Directory for per-rank log files (attempt_N/RANK/stdout.log, stderr.log).
    #[arg(long, alias = "log_dir")]
    log_dir: Option<PathBuf>,
    /// Run the program as given even if it ends in .py (torchrun's flag).
    #[arg(long, alias = "no_python")]
    no_python: bool,
    /// Seconds a worker may go without progress (a finished collective)
    /// before the agent names it as hung, collects the flight records and
    /// stops the group, which counts as a failure under --max-restarts.
    /// Off by default, as torchrun's.
    #[arg(long, alias = "watchdog_timeout")]
    watchdog_timeout: Option<f64>,
    /// Seconds between SIGTERM and SIGKILL when stopping the group.
    #[arg(long, alias = "grace_period", default_value_t = 5.0)]
    grace_period: f64,
    /// Seconds to wait for the master's store and for every node to join
    /// (torchrun's rendezvous `join_timeout`, 600 s by default).
    #[arg(long, alias = "rdzv_timeout", default_value_t = 600.0)]
    rdzv_timeout: f64,
    /// Rendezvous backend: static or c10d (both meet on the agent store at
    /// the endpoint; membership is fixed at --nnodes).
    #[arg(long, alias = "rdzv_backend", default_value = "static")]
    rdzv_backend: String,
    /// Rendezvous endpoint HOST[:PORT]; overrides --master-addr and
    /// --master-port (torchrun's c10d default port is 29400).
    #[arg(long, alias = "rdzv_endpoint")]
    rdzv_endpoint: Option<String>,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    program: Vec<String>,
    /// Workers on this node: `--nproc-per-node`, resolved by `run`.
    #[arg(skip)]
    local_world_size: usize,
}

/// `--nproc-per-node`, as torchrun's `determine_local_world_size` reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NprocPerNode {
    /// That many workers.
    Count(usize),
    /// One per visible CUDA GPU; an error without one.
    Gpu,
    /// One per GPU if there are any, else one per CPU.
    Auto,
    /// One per CPU.
    Cpu,
}

impl std::str::FromStr for NprocPerNode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gpu" => Ok(Self::Gpu),
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            _ => s.parse().map(Self::Count).map_err(|_| {
                "expected a number of workers (such as 4), gpu (one per GPU), \
                 auto (one per GPU, else one per CPU) or cpu (one per CPU)"
                    .into()
            }),
        }
    }
}

impl std::fmt::Display for NprocPerNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Count(n) => write!(f, "{n}"),
            Self::Gpu => f.write_str("gpu"),
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
        }
    }
}

impl NprocPerNode {
    /// The number of workers, counting this machine's GPUs
    /// ([`gpus::cuda_device_count`]) or CPUs ([`cpu_count`]) when asked to.
    fn resolve(self) -> Result<usize, String> {
        self.resolve_with(gpus::cuda_device_count, cpu_count)
    }

    /// [`Self::resolve`] with the counts given (tests).
    fn resolve_with(
        self,
        gpus: impl FnOnce() -> Result<usize, String>,
        cpus: impl FnOnce() -> usize,
    ) -> Result<usize, String> {
        let n = match self {
            Self::Count(n) => return Ok(n),
            Self::Cpu => cpus(),
            Self::Gpu => gpus().map_err(|why| gpus::no_gpu_message(&why))?,
            Self::Auto => gpus().unwrap_or_else(|why| {
                tracing::info!("--nproc-per-node auto: no CUDA GPU ({why}); one worker per CPU");
                cpus()
            }),
        };
        tracing::info!("--nproc-per-node {self}: {n} workers on this node");
        Ok(n)
    }
}

/// This machine's CPUs, as `std::thread::available_parallelism` counts
/// them (torch uses `os.cpu_count()`; this also honours CPU affinity and
/// cgroup quotas), or 1 if it cannot tell.
fn cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// The signals the agent forwards to its workers.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

/// How one worker ended.
#[derive(Debug, Clone)]
struct Exit {
    rank: usize,
    status: ExitStatus,
    tail: Vec<String>,
    /// What happened, when the status does not say (a hung worker).
    note: Option<String>,
}

impl Exit {
    fn describe(&self) -> String {
        use std::os::unix::process::ExitStatusExt;
        if let Some(n) = &self.note {
            return n.clone();
        }
        match (self.status.code(), self.status.signal()) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("signal {s}"),
            _ => "unknown status".into(),
        }
    }

    fn code(&self) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        self.status
            .code()
            .unwrap_or_else(|| 128 + self.status.signal().unwrap_or(1))
    }
}

fn validate(a: &RunArgs) -> Result<(), String> {
    if let NprocPerNode::Count(n) = a.nproc_per_node
        && (n == 0 || n > consort::MAX_LOCAL_WORLD_SIZE)
    {
        return Err(format!(
            "--nproc-per-node {n}: expected 1 to {} workers on this node",
            consort::MAX_LOCAL_WORLD_SIZE
        ));
    }
    if a.nnodes == 0 || a.nnodes > consort::MAX_WORLD_SIZE {
        return Err(format!(
            "--nnodes {}: expected 1 to {} nodes",
            a.nnodes,
            consort::MAX_WORLD_SIZE
        ));
    }
    if a.node_rank >= a.nnodes {
        return Err(format!(
            "--node-rank {} is out of range for --nnodes {} (valid: 0..={})",
            a.node_rank,
            a.nnodes,
            a.nnodes - 1
        ));
    }
    if a.standalone && a.nnodes > 1 {
        return Err("--standalone means a single node; it cannot go with --nnodes > 1".into());
    }
    if !matches!(a.rdzv_backend.as_str(), "static" | "c10d") {
        return Err(format!(
            "--rdzv-backend {:?} is not supported: use static or c10d (etcd is not built in)",
            a.rdzv_backend
        ));
    }
    for (flag, value, zero) in [
        ("--rdzv-timeout", a.rdzv_timeout, false),
        ("--grace-period", a.grace_period, true),
        ("--monitor-interval", a.monitor_interval, false),
        (
            "--watchdog-timeout",
            a.watchdog_timeout.unwrap_or(1.0),
            false,
        ),
    ] {
        consort_comm::time::check_seconds(value, zero).map_err(|why| format!("{flag}: {why}"))?;
    }
    Ok(())
}

/// `host`, `host:port`, or `[v6]:port`; the port defaults to 29400, as
/// torchrun's c10d endpoint.
fn split_endpoint(ep: &str) -> Result<(String, u16), String> {
    let bad = || format!("--rdzv-endpoint {ep:?} is not HOST[:PORT] (for IPv6: [ADDR]:PORT)");
    let (host, port) = if let Some(rest) = ep.strip_prefix('[') {
        let (h, tail) = rest.split_once(']').ok_or_else(bad)?;
        (h.to_string(), tail.strip_prefix(':'))
    } else if ep.matches(':').count() > 1 {
        (ep.to_string(), None)
    } else {
        match ep.split_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (ep.to_string(), None),
        }
    };
    let port = match port {
        Some(p) => p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(bad)?,
        None => 29400,
    };
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host, port))
}

fn command(a: &RunArgs) -> Vec<String> {
    let mut p = a.program.clone();
    if p.first().is_some_and(|s| s == "--") {
        p.remove(0);
    }
    if !a.no_python && p.first().is_some_and(|s| s.ends_with(".py")) {
        p.insert(0, "python3".into());
    }
    p
}

/// Runs the agent; returns the process exit code.
pub(crate) async fn run(mut a: RunArgs) -> Result<i32, Box<dyn std::error::Error>> {
    validate(&a)?;
    a.local_world_size = a.nproc_per_node.resolve()?;
    // Installed before any worker starts, so no signal slips past them.
    let mut signals = Signals {
        int: signal(SignalKind::interrupt())?,
        term: signal(SignalKind::terminate())?,
    };
    let program = command(&a);
    if program.is_empty() {
        return Err("no program given: consort run [flags] -- program [args...]".into());
    }
    if let Some(ep) = a.rdzv_endpoint.take() {
        let (host, port) = split_endpoint(&ep)?;
        a.master_addr = host;
        a.master_port = port;
    }
    if a.standalone {
        a.master_addr = "127.0.0.1".into();
        a.master_port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
    }
    let addr = consort::env::host_port(&a.master_addr, a.master_port);
    let rdzv_timeout = Duration::from_secs_f64(a.rdzv_timeout);
    // Node 0 hosts the agent store (where init_from_env's rank 0 would).
    let server = if a.node_rank == 0 {
        let bind = consort::store_bind_addr(&a.master_addr, a.master_port).await;
        Some(
            TcpStoreServer::bind_opts(bind.as_str(), consort_tcp::ServerOptions::from_env()?)
                .await
                .map_err(|e| format!("{e} (or use --standalone for a free port)"))?,
        )
    } else {
        None
    };
    let store: Arc<dyn Store> = Arc::new(
        TcpStore::connect(
            addr.clone(),
            TcpStoreOptions {
                connect_timeout: rdzv_timeout,
                timeout: rdzv_timeout.max(TcpStoreOptions::default().timeout),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| {
            format!(
                "node {} of the launcher cannot reach the agent store (--rdzv-timeout {}s): {e}. \
                 Start node 0 (it hosts the store) with the same --master-addr/--master-port",
                a.node_rank, a.rdzv_timeout
            )
        })?,
    );
    let world = a.nnodes * a.local_world_size;
    if world > consort::MAX_WORLD_SIZE {
        return Err(format!(
            "--nnodes {} x {} workers is a world of {world}, more than consort supports ({})",
            a.nnodes,
            a.local_world_size,
            consort::MAX_WORLD_SIZE
        )
        .into());
    }
    let ns = format!("consort/agent/{}", a.rdzv_id);
    let mut restart = 0u32;
    let code = loop {
        // Every node's agent meets the others for this round.
        let round = format!("{ns}/{restart}");
        store
            .set(&format!("{round}/node/{}", a.node_rank), b"1")
            .await?;
        let keys: Vec<String> = (0..a.nnodes).map(|n| format!("{round}/node/{n}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        store
            .wait(&keys, rdzv_timeout)
            .await
            .map_err(|e| {
                format!(
                    "rendezvous of {} nodes (round {restart}) failed: {e}. Start `consort run --node-rank N` \
                     on every node, with the same --nnodes, --master-addr, --master-port and --rdzv-id",
                    a.nnodes
                )
            })?;

        let failure = run_round(&a, &program, &store, &round, restart, world, &mut signals).await?;
        match failure {
            None => break 0,
            Some(f) if restart < a.max_restarts => {
                eprintln!(
                    "[consort run] rank {} failed ({}); restarting the group (attempt {} of {}). \
                     Its last output:",
                    f.rank,
                    f.describe(),
                    restart + 1,
                    a.max_restarts
                );
                for l in &f.tail {
                    eprintln!("[consort run]   {l}");
                }
                restart += 1;
            }
            Some(f) => {
                eprintln!(
                    "[consort run] rank {} failed with {} after {} restart(s). Its last output:",
                    f.rank,
                    f.describe(),
                    restart
                );
                for l in &f.tail {
                    eprintln!("[consort run]   {l}");
                }
                break f.code();
            }
        }
    };
    // A failed job keeps its temporary directory: the summary names the
    // flight records in it.
    if a.log_dir.is_none() && code == 0 {
        let _ = std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("consort-run-{}", std::process::id())),
        );
    }
    // Node 0 keeps the store up until every node has finished.
    store
        .set(&format!("{ns}/done/{}", a.node_rank), b"1")
        .await?;
    if let Some(server) = server {
        let keys: Vec<String> = (0..a.nnodes).map(|n| format!("{ns}/done/{n}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let _ = store.wait(&keys, Duration::from_secs(60)).await;
        drop(store);
        server.shutdown().await;
    }
    Ok(code)
}

/// Starts this node's workers for one round and watches them. Returns the
/// first failure (here or, through the store, on another node), or `None`
/// when every local worker exited 0.
async fn run_round(
    a: &RunArgs,
    program: &[String],
    store: &Arc<dyn Store>,
    round: &str,
    restart: u32,
    world: usize,
    signals: &mut Signals,
) -> Result<Option<Exit>, Box<dyn std::error::Error>> {
    let mut children: Vec<(usize, Child, i32)> = Vec::new();
    let tails: Vec<Arc<Mutex<VecDeque<String>>>> = (0..a.local_world_size)
        .map(|_| Arc::new(Mutex::new(VecDeque::new())))
        .collect();
    let mut pumps = Vec::new();
    let mut error_files = Vec::with_capacity(a.local_world_size);
    // Where the workers' flight records go when the job fails.
    let flight_dir = a
        .log_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("consort-run-{}", std::process::id())))
        .join(format!("attempt_{restart}"))
        .join("flight");
    let _ = std::fs::remove_dir_all(&flight_dir);
    for (local, tail) in tails.iter().enumerate() {
        let rank = a.node_rank * a.local_world_size + local;
        // Per-rank directory: log files (with --log-dir) and the error
        // file torch's @record writes (TORCHELASTIC_ERROR_FILE).
        let dir = a
            .log_dir
            .clone()
            .unwrap_or_else(|| {
                std::env::temp_dir().join(format!("consort-run-{}", std::process::id()))
            })
            .join(format!("attempt_{restart}"))
            .join(rank.to_string());
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create the log directory {}: {e}", dir.display()))?;
        let error_file = dir.join("error.json");
        let _ = std::fs::remove_file(&error_file);
        error_files.push(error_file.clone());
        let logs = a.log_dir.is_some().then_some(dir);
        let mut cmd = Command::new(&program[0]);
        cmd.args(&program[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("GROUP_RANK", a.node_rank.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_NAME", "default")
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", a.local_world_size.to_string())
            .env("GROUP_WORLD_SIZE", a.nnodes.to_string())
            .env("ROLE_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", &a.master_addr)
            .env("MASTER_PORT", a.master_port.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", restart.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", a.max_restarts.to_string())
            .env("TORCHELASTIC_RUN_ID", &a.rdzv_id)
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env("TORCHELASTIC_ERROR_FILE", &error_file)
            .env("CONSORT_FLIGHT_DIR", &flight_dir)
            .envs(
                a.watchdog_timeout
                    .map(|_| ("CONSORT_HEARTBEAT_FILE", beat_file(&flight_dir, rank))),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so stopping a worker stops what it
            // started too (a shell's children hold its pipes open).
            .process_group(0)
            .kill_on_drop(true);
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            cmd.env("OMP_NUM_THREADS", "1");
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {:?}: {e}", program[0]))?;
        let log = |name: &str| logs.as_ref().map(|d| d.join(name));
        if let Some(out) = child.stdout.take() {
            pumps.push(tokio::spawn(pump(
                out,
                false,
                rank,
                tail.clone(),
                log("stdout.log"),
            )));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(tokio::spawn(pump(
                err,
                true,
                rank,
                tail.clone(),
                log("stderr.log"),
            )));
        }
        let pgid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        children.push((rank, child, pgid));
    }

    let failed_key = format!("{round}/failed");
    let interval = Duration::from_secs_f64(a.monitor_interval);
    let mut done = vec![false; children.len()];
    let mut watchdog = a.watchdog_timeout.map(|t| {
        let files = children
            .iter()
            .map(|(rank, _, _)| beat_file(&flight_dir, *rank))
            .collect();
        Watchdog::new(Duration::from_secs_f64(t), files)
    });
    let failure = loop {
        let mut failed = reap(&mut children, &mut done)?;
        if !failed.is_empty() {
            // The peers of a crashed worker fail within milliseconds of it;
            // let their exits land, then name the cause.
            tokio::time::sleep(Duration::from_millis(100)).await;
            failed.extend(reap(&mut children, &mut done)?);
        }
        let mut failure = cause(failed);
        if failure.is_none()
            && let Some(w) = &mut watchdog
        {
            failure = hung(w, &mut children, &done).await;
        }
        if let Some(f) = failure {
            let _ = store
                .set(&failed_key, format!("{} {}", f.rank, f.code()).as_bytes())
                .await;
            break Some(f);
        }
        if done.iter().all(|d| *d) {
            break None;
        }
        // Another node's failure stops this node's workers too.
        if store.check(&[&failed_key]).await.unwrap_or(false) {
            let who = store.get(&failed_key).await.unwrap_or_default();
            let who = String::from_utf8_lossy(&who).into_owned();
            let mut parts = who.split(' ').map(|p| p.parse::<i64>().ok());
            let rank = parts.next().flatten().unwrap_or(-1);
            let code = parts.next().flatten().unwrap_or(1).clamp(1, 255) as i32;
            use std::os::unix::process::ExitStatusExt;
            break Some(Exit {
                rank: usize::try_from(rank).unwrap_or(usize::MAX),
                status: ExitStatus::from_raw(code << 8),
                tail: vec![format!(
                    "(rank {rank} failed on another node; its output is in that node's log)"
                )],
                note: None,
            });
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = signals.int.recv() => {
                stop(&mut children, a.grace_period, libc::SIGINT).await;
                return Err("interrupted (SIGINT): forwarded it to every worker and stopped them".into());
            }
            _ = signals.term.recv() => {
                stop(&mut children, a.grace_period, libc::SIGTERM).await;
                return Err("terminated (SIGTERM): forwarded it to every worker and stopped them".into());
            }
        }
    };
    // After a failure this stops the survivors; after a clean round it
    // only clears what the workers left running in their groups.
    stop(&mut children, a.grace_period, libc::SIGTERM).await;
    // The pipes close when the workers (and what they started) are gone;
    // don't wait forever on a grandchild that escaped its process group.
    for p in pumps {
        let _ = tokio::time::timeout(Duration::from_secs(5), p).await;
    }
    Ok(failure.map(|mut f| {
        if let Some(local) = f
            .rank
            .checked_sub(a.node_rank * a.local_world_size)
            .filter(|l| *l < a.local_world_size)
        {
            let report = std::mem::take(&mut f.tail);
            f.tail = tails[local]
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect();
            f.tail.extend(report);
            if let Ok(text) = std::fs::read_to_string(&error_files[local]) {
                let text: String = text.chars().take(4000).collect();
                f.tail.push(format!(
                    "error file {}: {text}",
                    error_files[local].display()
                ));
            }
        }
        if let Ok(lines) = super::debug::verdict(&flight_dir) {
            f.tail.push(format!(
                "flight records in {} (`consort debug flight` reads them):",
                flight_dir.display()
            ));
            f.tail
                .extend(lines.into_iter().skip(1).map(|l| format!("  {l}")));
        }
        f
    }))
}

/// Collects the workers that have exited since the last look; returns the
/// failed ones.
fn reap(children: &mut [(usize, Child, i32)], done: &mut [bool]) -> std::io::Result<Vec<Exit>> {
    let mut failed = Vec::new();
    for (i, (rank, child, _)) in children.iter_mut().enumerate() {
        if done[i] {
            continue;
        }
        if let Some(status) = child.try_wait()? {
            done[i] = true;
            if !status.success() {
                failed.push(Exit {
                    rank: *rank,
                    status,
                    tail: Vec::new(),
                    note: None,
                });
            }
        }
    }
    Ok(failed)
}

/// The failure to report among workers that failed together: one killed
/// by a signal (a crash, the OOM killer, a kill) before one that exited
/// with an error (often a peer's loss that the crash caused), then the
/// lowest rank. The others are named in its summary.
fn cause(mut failed: Vec<Exit>) -> Option<Exit> {
    use std::os::unix::process::ExitStatusExt;
    failed.sort_by_key(|f| (f.status.signal().is_none(), f.rank));
    let mut it = failed.into_iter();
    let mut first = it.next()?;
    let rest: Vec<String> = it
        .map(|f| format!("rank {} ({})", f.rank, f.describe()))
        .collect();
    if !rest.is_empty() {
        first
            .tail
            .push(format!("also failed after it: {}", rest.join(", ")));
    }
    Some(first)
}

/// Rank `rank`'s heartbeat file, beside the round's flight records.
fn beat_file(flight_dir: &Path, rank: usize) -> PathBuf {
    flight_dir
        .parent()
        .unwrap_or(flight_dir)
        .join("heartbeat")
        .join(format!("rank-{rank}"))
}

/// The watchdog's check: a hung worker becomes this round's failure. The
/// other workers are asked for their flight records (SIGUSR1; the hung one
/// may not be able to answer) before the group is stopped.
async fn hung(
    w: &mut Watchdog,
    children: &mut [(usize, Child, i32)],
    done: &[bool],
) -> Option<Exit> {
    let ranks: Vec<usize> = children.iter().map(|c| c.0).collect();
    let pids: Vec<i32> = children.iter().map(|c| c.2).collect();
    let alive: Vec<bool> = done.iter().map(|d| !d).collect();
    let h = w.check(&ranks, &pids, &alive)?;
    for (i, &pid) in pids.iter().enumerate() {
        if alive[i] && i != h.local && pid > 0 {
            // SAFETY: kill(2) on our own worker with a valid signal.
            unsafe { libc::kill(pid, libc::SIGUSR1) };
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    use std::os::unix::process::ExitStatusExt;
    Some(Exit {
        rank: ranks[h.local],
        status: ExitStatus::from_raw(libc::SIGKILL),
        note: Some("a hang (the watchdog stopped it)".into()),
        tail: h.report,
    })
}

/// Copies one worker stream to ours, line by line with `[rankN]: `, keeps
/// its last lines, and tees it to a log file.
async fn pump<R: tokio::io::AsyncRead + Unpin>(
    stream: R,
    to_stderr: bool,
    rank: usize,
    tail: Arc<Mutex<VecDeque<String>>>,
    log: Option<PathBuf>,
) {
    use std::io::Write;
    let mut file = log.and_then(|path| std::fs::File::create(path).ok());
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let text = format!("[rank{rank}]: {line}\n");
        // One write per line, under the stream's lock, so ranks' lines
        // never interleave mid-line.
        let _ = if to_stderr {
            std::io::stderr().lock().write_all(text.as_bytes())
        } else {
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes()).and_then(|()| out.flush())
        };
        if let Some(f) = file.as_mut() {
            let _ = writeln!(f, "{line}");
        }
        let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
        t.push_back(line);
        if t.len() > TAIL_LINES {
            t.pop_front();
        }
    }
}

/// Lines of a failed worker's output repeated in the summary.
const TAIL_LINES: usize = 20;

/// Stops the group: `signal` (SIGTERM, or the SIGINT the agent got) to
/// every worker's process group, then SIGKILL to whatever is left of them
/// after the grace period. Also used after a clean round, so nothing a
/// worker started outlives it (as torchrun closes its process contexts).
async fn stop(children: &mut [(usize, Child, i32)], grace: f64, signal: libc::c_int) {
    let alive = |pgid: i32| {
        // SAFETY: signal 0 only checks that the group `pgid` (a worker we
        // started as a group leader, `process_group(0)`) has a member.
        pgid > 1 && unsafe { libc::kill(-pgid, 0) == 0 }
    };
    // A pgid of 0 would mean "our own group": never signal that.
    for (_, _, pgid) in children.iter().filter(|(_, _, g)| *g > 1) {
        // SAFETY: as above; sends `signal` to that group.
        unsafe { libc::kill(-*pgid, signal) };
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(grace.max(0.0));
    for (_, c, _) in children.iter_mut() {
        let _ = tokio::time::timeout_at(deadline, c.wait()).await;
    }
    while children.iter().any(|(_, _, g)| alive(*g)) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (_, c, pgid) in children.iter_mut() {
        if alive(*pgid) {
            // SAFETY: as above.
            unsafe { libc::kill(-*pgid, libc::SIGKILL) };
        }
        let _ = c.kill().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_like_torchrun() {
        assert_eq!(split_endpoint("h:1234").unwrap(), ("h".into(), 1234));
        assert_eq!(split_endpoint("h").unwrap(), ("h".into(), 29400));
        assert_eq!(split_endpoint("[::1]:5").unwrap(), ("::1".into(), 5));
        assert_eq!(split_endpoint("::1").unwrap(), ("::1".into(), 29400));
        for bad in ["h:0", "h:http", ":80", "[::1", "h:70000"] {
            assert!(split_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn nproc_per_node_parses_like_torchrun() {
        use NprocPerNode::*;
        for (arg, want) in [
            ("4", Count(4)),
            ("0", Count(0)),
            ("gpu", Gpu),
            ("auto", Auto),
            ("cpu", Cpu),
        ] {
            assert_eq!(arg.parse::<NprocPerNode>(), Ok(want), "{arg}");
            assert_eq!(want.to_string(), arg);
        }
        for bad in ["bogus", "GPU", "-1", "", "4.5", "cuda"] {
            let e = bad.parse::<NprocPerNode>().unwrap_err();
            for form in ["number", "gpu", "auto", "cpu"] {
                assert!(e.contains(form), "{bad}: {e}");
            }
        }
    }

    #[test]
    fn nproc_per_node_counts_gpus_or_cpus() {
        use NprocPerNode::*;
        let two_gpus = || Ok(2);
        let no_gpu = || Err("no libcuda".to_string());
        let cpus = || 8;
        assert_eq!(Count(3).resolve_with(no_gpu, cpus), Ok(3));
        assert_eq!(Cpu.resolve_with(two_gpus, cpus), Ok(8));
        assert_eq!(Gpu.resolve_with(two_gpus, cpus), Ok(2));
        assert_eq!(Auto.resolve_with(two_gpus, cpus), Ok(2));
        assert_eq!(Auto.resolve_with(no_gpu, cpus), Ok(8));
        let e = Gpu.resolve_with(no_gpu, cpus).unwrap_err();
        assert!(
            e.contains("no CUDA GPU was found") && e.contains("no libcuda"),
            "{e}"
        );
        assert!(e.contains("--nproc-per-node cpu"), "{e}");
        assert!(cpu_count() >= 1);
    }

    #[test]
    fn python_programs_get_an_interpreter_unless_no_python() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            a: RunArgs,
        }
        let a = T::parse_from(["t", "--nproc_per_node=2", "train.py", "--lr", "1"]).a;
        assert_eq!(a.nproc_per_node, NprocPerNode::Count(2));
        assert_eq!(command(&a), ["python3", "train.py", "--lr", "1"]);
        let a = T::parse_from(["t", "--no-python", "train.py"]).a;
        assert_eq!(command(&a), ["train.py"]);
        let a = T::parse_from(["t", "--", "prog", "--flag"]).a;
        assert_eq!(command(&a), ["prog", "--flag"]);
    }
}
