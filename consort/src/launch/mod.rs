//! The launcher as a library: what `consort run` does, in the shape torch
//! gives `torch.distributed.elastic` under its thin `torchrun`.
//!
//! - [`launch`] (`agent`): the agent of one node. Node 0's agent hosts
//!   the agent store; every agent meets the others there once per round,
//!   starts its workers, and on a failure stops the round and starts the
//!   next, up to `max_restarts`.
//! - `rendezvous`: static (`--nnodes N`) or elastic (`--nnodes MIN:MAX`)
//!   membership per round.
//! - `round`: one round's workers, started with torchrun's variables and
//!   watched until they end.
//! - `workers`: the child processes: reaping exits and naming the cause,
//!   copying output with `[rankN]: `, stopping (SIGTERM, then SIGKILL).
//! - `watchdog`: `--watchdog-timeout`, from each worker's heartbeat.
//! - [`records`]: the workers' flight records and their verdict.
//! - [`cpus`]: `--bind-to core`, a core of its own for each worker.
//!
//! The CLI (`consort run`) parses torchrun's flags into a [`LaunchSpec`].
//! The variables each worker gets are listed in [`crate::env`].
//!
//! # Example
//!
//! `consort run --standalone --nproc-per-node 4 --max-restarts 1 -- ./train
//! --epochs 3` from a program of one's own (torch's
//! `elastic_launch(config, entrypoint)(args)`):
//!
//! ```no_run
//! use consort::launch::{LaunchSpec, launch};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let spec = LaunchSpec {
//!     program: ["./train", "--epochs", "3"].map(String::from).to_vec(),
//!     min_nodes: 1,
//!     max_nodes: 1,
//!     node_rank: 0,
//!     last_call: 0.0,
//!     local_world_size: 4,                  // --nproc-per-node
//!     master_addr: "127.0.0.1".into(),
//!     master_port: 29500,
//!     max_restarts: 1,                      // restart the whole group once
//!     monitor_interval: 0.1,
//!     rdzv_id: "job-1".into(),
//!     rdzv_timeout: 300.0,
//!     log_dir: None,                        // a temporary directory, kept on failure
//!     grace_period: 5.0,                    // SIGTERM, then SIGKILL
//!     watchdog_timeout: Some(600.0),        // a rank silent this long counts as hung
//!     secret: None,
//!     bind_to_core: false,                  // --bind-to core: a core per worker
//! };
//! let code = launch(spec).await?;          // 0, or the failing worker's exit code
//! std::process::exit(code);
//! # }
//! ```

mod agent;
pub mod cpus;
mod dirs;
mod exit;
pub mod records;
mod rendezvous;
mod round;
mod watchdog;
mod workers;

use std::path::PathBuf;

pub use agent::launch;

/// What to launch, with every flag resolved (`consort run`'s flags, as
/// torchrun names them). Durations are seconds, as torchrun's flags are.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// The worker's program and its arguments.
    pub program: Vec<String>,
    /// Nodes in the job, at least (`--nnodes MIN:MAX`; equal to
    /// `max_nodes` for a fixed membership).
    pub min_nodes: usize,
    /// Nodes in the job, at most.
    pub max_nodes: usize,
    /// This node's index, `0..max_nodes` (fixed membership only; elastic
    /// rounds number nodes in the order they join).
    pub node_rank: usize,
    /// Seconds an elastic round stays open for more nodes once `min_nodes`
    /// have joined (torch's `last_call_timeout`).
    pub last_call: f64,
    /// Workers on this node.
    pub local_world_size: usize,
    /// Host of the agent store (node 0).
    pub master_addr: String,
    /// Its port.
    pub master_port: u16,
    /// Restarts of the whole group after a failure.
    pub max_restarts: u32,
    /// Seconds between checks on the workers.
    pub monitor_interval: f64,
    /// The run's id (`TORCHELASTIC_RUN_ID`).
    pub rdzv_id: String,
    /// Seconds to wait for the store and for every node to join.
    pub rdzv_timeout: f64,
    /// Where per-rank logs and flight records go (`None`: a temporary
    /// directory, kept when the job fails).
    pub log_dir: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    pub grace_period: f64,
    /// Seconds without progress before a worker counts as hung (`None`:
    /// no watchdog).
    pub watchdog_timeout: Option<f64>,
    /// The shared secret of the agent store and of every worker's
    /// connections (`CONSORT_SECRET` in their environment); `None`: the
    /// agent's own `CONSORT_SECRET`, if any. torch's clients cannot speak
    /// the handshake: leave it unset for torch workers.
    pub secret: Option<String>,
    /// Each worker on a core of its own from the agent's affinity mask, in
    /// local-rank order (`--bind-to core`), where the mask holds one per
    /// worker; otherwise (and by default, as torchrun) unbound.
    pub bind_to_core: bool,
}

impl LaunchSpec {
    /// Checks the values the agent depends on.
    pub fn validate(&self) -> Result<(), LaunchError> {
        let bad = |why: String| Err(LaunchError::Config(why));
        if self.program.is_empty() {
            return bad("no program given: consort run [flags] -- program [args...]".into());
        }
        if self.min_nodes == 0
            || self.min_nodes > self.max_nodes
            || self.node_rank >= self.max_nodes
            || self.local_world_size == 0
        {
            return bad(format!(
                "node {} of {}:{} nodes with {} workers: expected at least one node and one \
                 worker, MIN <= MAX, and a node rank below the node count",
                self.node_rank, self.min_nodes, self.max_nodes, self.local_world_size
            ));
        }
        for (what, v, zero) in [
            ("rdzv_timeout", self.rdzv_timeout, false),
            ("grace_period", self.grace_period, true),
            ("monitor_interval", self.monitor_interval, false),
            ("last_call", self.last_call, true),
            (
                "watchdog_timeout",
                self.watchdog_timeout.unwrap_or(1.0),
                false,
            ),
        ] {
            consort_comm::time::check_seconds(v, zero)
                .map_err(|why| LaunchError::Config(format!("{what}: {why}")))?;
        }
        Ok(())
    }
}

/// Why the launcher could not run the job (a worker's failure is not an
/// error: it is the exit code [`launch`] returns).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// The spec is not valid.
    #[error("{0}")]
    Config(String),
    /// The agent store could not be started or reached.
    #[error("{0}")]
    Store(String),
    /// The nodes did not all join a round.
    #[error("{0}")]
    Rendezvous(String),
    /// A store operation failed.
    #[error("agent store: {0}")]
    StoreOp(#[from] consort_comm::StoreError),
    /// A worker could not be started.
    #[error("cannot start {program:?}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// SIGINT or SIGTERM stopped the job (forwarded to every worker).
    #[error("{0}")]
    Interrupted(String),
    /// A file or process operation failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
