//! `consort run`: torchrun's flags, checked and resolved into a
//! [`LaunchSpec`] for the launcher library ([`consort::launch`]), which
//! runs this node's agent.

use std::path::PathBuf;

use consort::launch::LaunchSpec;

use super::gpus;

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
    /// Number of nodes: N, or MIN:MAX for elastic membership (rounds
    /// close with MAX nodes, or with at least MIN after --rdzv-last-call;
    /// node ranks follow the join order).
    #[arg(long, default_value = "1", value_name = "N|MIN:MAX")]
    nnodes: Nodes,
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
    /// Seconds an elastic round (--nnodes MIN:MAX) waits for more nodes once
    /// MIN have joined (torch's last_call_timeout).
    #[arg(long, alias = "rdzv_last_call", default_value_t = 30.0)]
    rdzv_last_call: f64,
    /// Run the program as given even if it ends in .py (torchrun's flag).
    #[arg(long, alias = "no_python")]
    no_python: bool,
    /// Seconds a worker may go without progress (a finished collective)
    /// before the agent names it as hung, collects the flight records and
    /// stops the group, which counts as a failure under --max-restarts.
    /// Off by default, as torchrun's.
    #[arg(long, alias = "watchdog_timeout")]
    watchdog_timeout: Option<f64>,
    /// A shared secret for the agent store and every worker's connections
    /// (given to the workers as CONSORT_SECRET): `auto` makes a random one
    /// (one node only), anything else is the secret itself (the same on
    /// every node; a value on the command line is visible to local users in
    /// the process list: prefer CONSORT_SECRET). torch's own clients cannot
    /// authenticate: leave it unset when the workers are torch. Default:
    /// the CONSORT_SECRET of this process, if any.
    #[arg(long)]
    secret: Option<String>,
    /// `core`: each worker on a core of its own (the first
    /// --nproc-per-node cores this agent may use), where there are that
    /// many; small collectives between unbound ranks that the scheduler
    /// put on one core take about 40 us a turn. `none` (default, as
    /// torchrun): the scheduler places them.
    #[arg(long, alias = "bind_to", default_value = "none", value_parser = ["core", "none"])]
    bind_to: String,
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
}

/// `--nnodes`: `N`, or `MIN:MAX` (torchrun's `parse_min_max_nnodes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Nodes {
    min: usize,
    max: usize,
}

impl std::str::FromStr for Nodes {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let n = |v: &str| {
            v.trim().parse::<usize>().map_err(|_| {
                format!("{s:?} is not N or MIN:MAX (such as 2, or 1:4 for elastic membership)")
            })
        };
        match s.split_once(':') {
            Some((lo, hi)) => Ok(Nodes {
                min: n(lo)?,
                max: n(hi)?,
            }),
            None => n(s).map(|v| Nodes { min: v, max: v }),
        }
    }
}

impl std::fmt::Display for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.max)
        } else {
            write!(f, "{}:{}", self.min, self.max)
        }
    }
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

fn validate(a: &RunArgs) -> Result<(), String> {
    if let NprocPerNode::Count(n) = a.nproc_per_node
        && (n == 0 || n > consort::MAX_LOCAL_WORLD_SIZE)
    {
        return Err(format!(
            "--nproc-per-node {n}: expected 1 to {} workers on this node",
            consort::MAX_LOCAL_WORLD_SIZE
        ));
    }
    let Nodes { min, max } = a.nnodes;
    if min == 0 || min > max || max > consort::MAX_WORLD_SIZE {
        return Err(format!(
            "--nnodes {}: expected 1 to {} nodes (MIN:MAX with MIN <= MAX)",
            a.nnodes,
            consort::MAX_WORLD_SIZE
        ));
    }
    if min == max && a.node_rank >= max {
        return Err(format!(
            "--node-rank {} is out of range for --nnodes {} (valid: 0..={})",
            a.node_rank,
            a.nnodes,
            max - 1
        ));
    }
    if min < max && a.node_rank != 0 {
        return Err(format!(
            "--node-rank {}: with --nnodes {} the nodes are numbered in the order they join; \
             leave --node-rank out",
            a.node_rank, a.nnodes
        ));
    }
    if a.standalone && max > 1 {
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
        ("--rdzv-last-call", a.rdzv_last_call, true),
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
    let local_world_size = a.nproc_per_node.resolve()?;
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
    let spec = LaunchSpec {
        program,
        min_nodes: a.nnodes.min,
        max_nodes: a.nnodes.max,
        last_call: a.rdzv_last_call,
        node_rank: a.node_rank,
        local_world_size,
        master_addr: a.master_addr,
        master_port: a.master_port,
        max_restarts: a.max_restarts,
        monitor_interval: a.monitor_interval,
        rdzv_id: a.rdzv_id,
        rdzv_timeout: a.rdzv_timeout,
        log_dir: a.log_dir,
        grace_period: a.grace_period,
        watchdog_timeout: a.watchdog_timeout,
        bind_to_core: a.bind_to == "core",
        secret: job_secret(a.secret.as_deref(), a.nnodes.max)?,
    };
    Ok(consort::launch::launch(spec).await?)
}

/// `--secret`: `auto` is a random secret of this job (one node: the others
/// could not know it), anything else is used as given.
fn job_secret(
    flag: Option<&str>,
    max_nodes: usize,
) -> Result<Option<String>, Box<dyn std::error::Error>> {
    match flag {
        None => Ok(None),
        Some("") => Err("--secret must not be empty".into()),
        Some("auto") if max_nodes > 1 => Err(
            "--secret auto makes a secret on this node alone; a job across nodes needs the same \
             --secret VALUE (or CONSORT_SECRET) on every node"
                .into(),
        ),
        Some("auto") => {
            let mut b = [0u8; 24];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
                .map_err(|e| format!("--secret auto: cannot read /dev/urandom: {e}"))?;
            Ok(Some(b.iter().map(|x| format!("{x:02x}")).collect()))
        }
        Some(s) => Ok(Some(s.to_string())),
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
