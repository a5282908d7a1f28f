//! An NCCL-like cost model of a GPU cluster, for planning on paper.
//!
//! This module owns three things:
//!
//! - [`nccl`]: NCCL's own tuning model (ring, tree, NVLS, NVLS tree and
//!   PAT; LL, LL128 and Simple; channels; intra- and inter-node latencies
//!   and bandwidths), rewritten from NCCL 2.30.7's `src/graph/tuning.cc`
//!   and `src/enqueue.cc`, with the algorithm and protocol NCCL would
//!   choose for each call;
//! - [`mod@presets`]: clusters described by their hardware (GPUs per node,
//!   NVLink rate, NICs and their rate), each beside the published
//!   nccl-tests figures it is held to (cited where they are quoted);
//! - [`train`]: the step time of DDP, FSDP and a pipeline's costs for a
//!   model size on such a cluster.
//!
//! It owns no schedule and runs nothing: the times are closed forms, as
//! NCCL's own are. The α–β model fitted to consort's runs is
//! [`crate::cost`]; this one is for clusters consort has not run on.
//!
//! ```
//! use consort_sim::cluster::{self, Collective};
//!
//! let dgx = cluster::preset("dgx-h100").unwrap();
//! let p = cluster::predict(&dgx, 8, Collective::AllReduce, 8 << 30).unwrap();
//! assert_eq!(p.algo.name(), "NVLS"); // NVLink SHARP on one node
//! assert!((p.busbw_gbs - 480.0).abs() < 0.15 * 480.0);
//! ```

pub mod nccl;
pub mod presets;
pub mod train;

use std::fmt;

pub use nccl::{Algo, Proto};
pub use presets::{Arch, Cluster, Cpu, Published, preset, presets};

/// The collectives the model predicts, by `torch.distributed`'s names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// `all_reduce`.
    AllReduce,
    /// `all_gather` (sizes are the gathered total, as nccl-tests prints).
    AllGather,
    /// `reduce_scatter` (sizes are the input total, as nccl-tests prints).
    ReduceScatter,
}

impl Collective {
    /// All three, in the order the table prints them.
    pub const ALL: [Collective; 3] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
    ];

    /// `torch.distributed`'s name.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
        }
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks (its
    /// `doc/PERFORMANCE.md`): `2(n-1)/n` for all_reduce, `(n-1)/n` else.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter => (n - 1.0) / n,
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Collective {
    type Err = ClusterError;
    fn from_str(s: &str) -> Result<Self, ClusterError> {
        Collective::ALL
            .into_iter()
            .find(|c| c.name() == s.trim())
            .ok_or_else(|| ClusterError::UnknownOp(s.to_string()))
    }
}

/// The most ranks the model takes: NCCL's own model has no limit, but
/// beyond this the figures it is held to are far away.
pub const MAX_WORLD: usize = 1 << 20;

/// What the model refuses, and what to do instead.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum ClusterError {
    /// A world of no ranks.
    NoGpus,
    /// A world larger than [`MAX_WORLD`].
    TooManyGpus {
        /// The world size asked for.
        world_size: usize,
    },
    /// Several nodes, but not whole ones.
    NotWholeNodes {
        /// The world size asked for.
        world_size: usize,
        /// GPUs on each of the cluster's nodes.
        gpus_per_node: usize,
    },
    /// A cluster name the presets do not know.
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The names they know.
        valid: Vec<&'static str>,
    },
    /// An op the model does not predict.
    UnknownOp(String),
    /// A message of no bytes.
    ZeroSize {
        /// The collective.
        op: Collective,
    },
    /// An algorithm forced (as `NCCL_ALGO` forces it) that cannot run the
    /// call on this cluster.
    AlgoUnavailable {
        /// The collective.
        op: Collective,
        /// The algorithm forced.
        algo: Algo,
        /// Why not.
        why: &'static str,
    },
    /// Training arguments the step model cannot use.
    BadTraining(String),
}

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterError::NoGpus => write!(f, "world_size 0: expected at least one GPU"),
            ClusterError::TooManyGpus { world_size } => write!(
                f,
                "world_size {world_size}: the cluster model takes at most {MAX_WORLD} GPUs"
            ),
            ClusterError::NotWholeNodes {
                world_size,
                gpus_per_node,
            } => write!(
                f,
                "world_size {world_size} is more than one node but not a multiple of the \
                 cluster's {gpus_per_node} GPUs per node: use whole nodes, or at most \
                 {gpus_per_node} GPUs"
            ),
            ClusterError::UnknownPreset { name, valid } => {
                write!(f, "unknown cluster {name:?}: one of {}", valid.join(", "))
            }
            ClusterError::UnknownOp(s) => write!(
                f,
                "unknown op {s:?} for the cluster model: all_reduce, all_gather or reduce_scatter"
            ),
            ClusterError::ZeroSize { op } => {
                write!(f, "{op} of 0 bytes: expected a size of at least one byte")
            }
            ClusterError::AlgoUnavailable { op, algo, why } => {
                write!(f, "NCCL_ALGO={algo} cannot run {op} here: {why}")
            }
            ClusterError::BadTraining(s) => f.write_str(s),
        }
    }
}

impl std::error::Error for ClusterError {}

/// Where the ranks sit: whole nodes, or part of one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Nodes.
    pub nodes: usize,
    /// Ranks (GPUs) on each node.
    pub ranks_per_node: usize,
}

impl Placement {
    /// The ranks in all.
    pub fn world_size(&self) -> usize {
        self.nodes * self.ranks_per_node
    }

    /// `world_size` GPUs of `cluster`: whole nodes, or one node's first
    /// `world_size` GPUs.
    pub fn of(cluster: &Cluster, world_size: usize) -> Result<Placement, ClusterError> {
        if world_size == 0 {
            return Err(ClusterError::NoGpus);
        }
        if world_size > MAX_WORLD {
            return Err(ClusterError::TooManyGpus { world_size });
        }
        let gpn = cluster.gpus_per_node;
        if world_size <= gpn {
            return Ok(Placement {
                nodes: 1,
                ranks_per_node: world_size,
            });
        }
        if !world_size.is_multiple_of(gpn) {
            return Err(ClusterError::NotWholeNodes {
                world_size,
                gpus_per_node: gpn,
            });
        }
        Ok(Placement {
            nodes: world_size / gpn,
            ranks_per_node: gpn,
        })
    }
}

/// One call's prediction, as an nccl-tests row reads.
#[derive(Clone, Copy, Debug, PartialEq)]
#[must_use]
pub struct Prediction {
    /// The collective.
    pub op: Collective,
    /// Ranks.
    pub world_size: usize,
    /// Bytes (nccl-tests' "size": the whole buffer for all_gather and
    /// reduce_scatter).
    pub bytes: usize,
    /// The algorithm NCCL's model chooses (or the one forced).
    pub algo: Algo,
    /// The protocol.
    pub proto: Proto,
    /// Channels NCCL would run it on (`topoGetAlgoInfo`'s `nMaxChannels`).
    pub channels: u32,
    /// Predicted time, microseconds.
    pub time_us: f64,
    /// `bytes / time`, GB/s (10^9 bytes).
    pub algbw_gbs: f64,
    /// nccl-tests' bus bandwidth, GB/s.
    pub busbw_gbs: f64,
    /// The bus bandwidth this algorithm and protocol reach at infinite
    /// size: no row's `busbw_gbs` is above it.
    pub bus_bound_gbs: f64,
}

/// Predicts `op` of `bytes` on `world_size` GPUs of `cluster`, with the
/// algorithm and protocol NCCL's model would choose.
pub fn predict(
    cluster: &Cluster,
    world_size: usize,
    op: Collective,
    bytes: usize,
) -> Result<Prediction, ClusterError> {
    let at = Placement::of(cluster, world_size)?;
    predict_on(cluster, at, op, bytes, None)
}

/// [`predict`] on an explicit placement, optionally forcing an algorithm
/// and protocol as `NCCL_ALGO` and `NCCL_PROTO` do.
pub fn predict_on(
    cluster: &Cluster,
    at: Placement,
    op: Collective,
    bytes: usize,
    force: Option<(Option<Algo>, Option<Proto>)>,
) -> Result<Prediction, ClusterError> {
    if bytes == 0 {
        return Err(ClusterError::ZeroSize { op });
    }
    if at.nodes == 0 || at.ranks_per_node == 0 {
        return Err(ClusterError::NoGpus);
    }
    let n = at.world_size();
    if n == 1 {
        // NCCL copies in place; nothing crosses a link.
        return Ok(Prediction {
            op,
            world_size: 1,
            bytes,
            algo: Algo::Ring,
            proto: Proto::Simple,
            channels: 1,
            time_us: 0.0,
            algbw_gbs: f64::INFINITY,
            busbw_gbs: 0.0,
            bus_bound_gbs: 0.0,
        });
    }
    let table = nccl::Tuning::new(cluster, at);
    let (algo, proto) = force.unwrap_or((None, None));
    let c = table.choose(op, bytes, algo, proto)?;
    let algbw = bytes as f64 / (c.time_us * 1e3);
    Ok(Prediction {
        op,
        world_size: n,
        bytes,
        algo: c.algo,
        proto: c.proto,
        channels: c.channels,
        time_us: c.time_us,
        algbw_gbs: algbw,
        busbw_gbs: algbw * op.bus_factor(n),
        bus_bound_gbs: c.algbw_bound * op.bus_factor(n),
    })
}
