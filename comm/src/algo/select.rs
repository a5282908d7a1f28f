//! Which schedule runs: [`Algorithm`], [`AlgoConfig`] (segment size,
//! window, overrides) and the selection policy.

use std::{fmt, str::FromStr};

use crate::OpKind;

/// A collective algorithm. The names are the snake_case ones that
/// `CONSORT_ALGO` and `consort sim --algo` take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// Segmented, pipelined ring (all_reduce, all_gather, reduce_scatter).
    Ring,
    /// Recursive halving then doubling, any world size (all_reduce).
    HalvingDoubling,
    /// Recursive doubling, any world size (all_reduce of small messages):
    /// the whole vector is exchanged and reduced at each of log2(n) steps,
    /// half the steps of halving-doubling.
    RecursiveDoubling,
    /// One shot (all_reduce of small messages): every rank sends its whole
    /// vector to every peer and reduces all of them itself, in rank order,
    /// so every rank ends with the same bits. One step at any world size,
    /// n - 1 messages each way per rank.
    OneShot,
    /// Binomial tree (broadcast, reduce; all_reduce as reduce + broadcast).
    BinomialTree,
    /// Pipelined chain (broadcast of large messages).
    Chain,
    /// Every rank talks to the root (gather, scatter, broadcast), to its
    /// peer (send, recv), or to every rank (all_reduce: each rank reduces
    /// its part from every peer's, then sends it to every peer).
    Direct,
    /// Pairwise exchange (all_to_all_single).
    Pairwise,
    /// Dissemination (barrier).
    Dissemination,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 9] = [
        Algorithm::Ring,
        Algorithm::HalvingDoubling,
        Algorithm::RecursiveDoubling,
        Algorithm::OneShot,
        Algorithm::BinomialTree,
        Algorithm::Chain,
        Algorithm::Direct,
        Algorithm::Pairwise,
        Algorithm::Dissemination,
    ];

    /// The snake_case name.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::HalvingDoubling => "halving_doubling",
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::OneShot => "one_shot",
            Algorithm::BinomialTree => "binomial_tree",
            Algorithm::Chain => "chain",
            Algorithm::Direct => "direct",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Dissemination => "dissemination",
        }
    }

    /// The ops this algorithm implements.
    pub fn ops(self) -> &'static [OpKind] {
        match self {
            Algorithm::Ring => &[OpKind::AllReduce, OpKind::AllGather, OpKind::ReduceScatter],
            Algorithm::HalvingDoubling | Algorithm::RecursiveDoubling | Algorithm::OneShot => {
                &[OpKind::AllReduce]
            }
            Algorithm::BinomialTree => &[OpKind::AllReduce, OpKind::Broadcast, OpKind::Reduce],
            Algorithm::Chain => &[OpKind::Broadcast],
            Algorithm::Direct => &[
                OpKind::AllReduce,
                OpKind::Broadcast,
                OpKind::Gather,
                OpKind::Scatter,
                OpKind::Send,
                OpKind::Recv,
            ],
            Algorithm::Pairwise => &[OpKind::AllToAll],
            Algorithm::Dissemination => &[OpKind::Barrier],
        }
    }

    /// Whether this algorithm implements `op`.
    pub fn supports(self, op: OpKind) -> bool {
        self.ops().contains(&op)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An algorithm name that is not one of [`Algorithm::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown algorithm {0:?}: expected one of ring, halving_doubling, recursive_doubling, one_shot, binomial_tree, \
     chain, direct, pairwise, dissemination (or op=algo pairs such as all_reduce=ring,broadcast=chain)"
)]
pub struct ParseAlgoError(pub String);

impl FromStr for Algorithm {
    type Err = ParseAlgoError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == t)
            .ok_or_else(|| ParseAlgoError(t.to_string()))
    }
}

/// Tunables of the schedules, shared by every driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlgoConfig {
    /// Largest segment a pipelined schedule sends, in bytes (256 KiB: hot
    /// in L2 when it is reduced).
    pub segment_bytes: usize,
    /// Segments in flight per schedule (at least 2).
    pub window: usize,
    /// Forced choices: `(None, algo)` applies to every op `algo`
    /// implements; `(Some(op), algo)` to that op only.
    pub overrides: Vec<(Option<OpKind>, Algorithm)>,
    /// Every rank is on one host, linked by a local transport, and the host
    /// runs more ranks than it has cores. Hops that run at once then share
    /// the cores, so the chain broadcast forwards whole messages (up to
    /// [`STORE_AND_FORWARD_BYTES`]) instead of pipelining segments: each
    /// hop runs alone at full speed and the root is done after one. The
    /// mesh rendezvous sets it the same on every rank.
    pub oversubscribed: bool,
    /// Every rank is on one host, linked by a local transport, and each
    /// has a stage its peers read (the shared-memory transport's): a large
    /// broadcast's root then copies each segment once and every reader
    /// copies it out at once (the segmented [`Algorithm::Direct`]), instead
    /// of two copies per hop down a chain. The mesh rendezvous sets it the
    /// same on every rank.
    pub shared_stage: bool,
}

/// Largest segment of the direct broadcast (see
/// [`AlgoConfig::shared_stage`]): L2-sized, so that the readers copy a
/// segment out while it is still in the root's cache. 64 MiB over 3 and 4
/// ranks on a 2-core AMD EPYC VM, paired runs: 11.2-12.2 and 8.7-9.2 GB/s
/// at 256 KiB, 6.9-7.2 and 5.8-6.7 at 1 MiB; the chain 10.1-10.2 and
/// 6.3-6.9. (Smaller segments cost a frame per reader each: 128 KiB was
/// slower than 256.)
pub const FAN_OUT_SEGMENT_MAX: usize = 256 << 10;

/// Smallest broadcast that goes through the stage (see
/// [`AlgoConfig::shared_stage`]).
pub const FAN_OUT_MIN_BYTES: usize = 4 << 20;

/// Largest piece the chain broadcast forwards whole on an oversubscribed
/// host (see [`AlgoConfig::oversubscribed`]); below the frame limit.
pub const STORE_AND_FORWARD_BYTES: usize = 64 << 20;

/// Smallest segment of a chain broadcast of two ranks. A chain of one hop
/// has nothing to pipeline: its segments only bound what is in flight, and
/// each costs a frame, a posted receive and a lane. 2-rank 64 MiB broadcast
/// on shared memory: 9.5 GB/s at 4 MiB segments against 7.7 at 1 MiB
/// (medians of 5 paired runs; the root is done once rank 1 has the first).
pub const ONE_HOP_SEGMENT_BYTES: usize = 4 << 20;

impl Default for AlgoConfig {
    fn default() -> Self {
        AlgoConfig {
            segment_bytes: 256 * 1024,
            window: 2,
            overrides: Vec::new(),
            oversubscribed: false,
            shared_stage: false,
        }
    }
}

/// all_reduce of at most this many bytes uses recursive doubling: the step
/// count decides, not the bytes (4 KiB took 2 steps instead of 1 at 2
/// ranks on shared memory).
pub const SMALL_BYTES: usize = 16 * 1024;

/// Messages below this many bytes are latency-bound on TCP (reference.md:
/// about 55 KB on this class of machine).
pub const LATENCY_BOUND_BYTES: usize = 64 * 1024;

impl AlgoConfig {
    /// Bytes of one segment of the direct broadcast: a pipeline segment,
    /// at most [`FAN_OUT_SEGMENT_MAX`].
    pub fn fan_out_segment_bytes(&self) -> usize {
        self.segment_bytes.clamp(1, FAN_OUT_SEGMENT_MAX)
    }

    /// Parses an override list: `ring`, or `all_reduce=ring,broadcast=chain`.
    pub fn parse_overrides(s: &str) -> Result<Vec<(Option<OpKind>, Algorithm)>, ParseAlgoError> {
        s.split(',')
            .filter(|x| !x.trim().is_empty())
            .map(|item| match item.split_once('=') {
                None => Ok((None, item.parse()?)),
                Some((op, algo)) => {
                    let op = OpKind::ALL
                        .into_iter()
                        .find(|o| {
                            o.name() == op.trim()
                                || (op.trim() == "all_to_all" && *o == OpKind::AllToAll)
                        })
                        .ok_or_else(|| ParseAlgoError(op.trim().to_string()))?;
                    Ok((Some(op), algo.parse()?))
                }
            })
            .collect()
    }

    /// The defaults, with `CONSORT_ALGO` (if set) as overrides.
    pub fn from_env() -> Result<Self, ParseAlgoError> {
        let mut c = AlgoConfig::default();
        if let Ok(v) = std::env::var("CONSORT_ALGO") {
            c.overrides = Self::parse_overrides(&v)?;
        }
        Ok(c)
    }

    /// The algorithm for `op` moving `bytes` over `world` ranks: an override
    /// that implements the op, else the policy.
    ///
    /// Policy: all_reduce uses recursive doubling up to [`SMALL_BYTES`],
    /// halving-doubling below [`LATENCY_BOUND_BYTES`] (log-depth latency)
    /// and the ring above
    /// (bandwidth-optimal); broadcast uses the direct broadcast for large
    /// messages with a shared stage (2 ranks too: the reader takes each
    /// 256 KiB segment while it is in cache, where the one hop's 4 MiB
    /// frames ran at 12-13 GB/s half the time), and for small
    /// ones (up to [`SMALL_BYTES`]) over 4 or more ranks on an
    /// oversubscribed host, where each hop of a tree waits for a core (4 KiB
    /// over 4 ranks on 2 vCPUs: 8.3-8.7 µs against the tree's 11.5-18.3; 3
    /// ranks keep the tree, 6.4-7.0 against 7.4-7.7), the pipelined chain
    /// for large messages on small worlds, and the binomial tree otherwise.
    /// The one-shot all_reduce runs only when forced: on 2 vCPUs recursive
    /// doubling stayed ahead of it at every world (4 KiB, 2-4 ranks).
    pub fn select(&self, op: OpKind, bytes: usize, world: usize) -> Algorithm {
        let forced = self
            .overrides
            .iter()
            .find(|(o, a)| *o == Some(op) && a.supports(op))
            .or_else(|| {
                self.overrides
                    .iter()
                    .find(|(o, a)| o.is_none() && a.supports(op))
            });
        if let Some((_, a)) = forced {
            return *a;
        }
        match op {
            OpKind::AllReduce if bytes <= SMALL_BYTES => Algorithm::RecursiveDoubling,
            OpKind::AllReduce if bytes < LATENCY_BOUND_BYTES => Algorithm::HalvingDoubling,
            OpKind::AllReduce | OpKind::AllGather | OpKind::ReduceScatter => Algorithm::Ring,
            // Every hop of a tree waits for a core there: one hop for all.
            OpKind::Broadcast if self.oversubscribed && world >= 4 && bytes <= SMALL_BYTES => {
                Algorithm::Direct
            }
            OpKind::Broadcast if self.shared_stage && bytes >= FAN_OUT_MIN_BYTES => {
                Algorithm::Direct
            }
            OpKind::Broadcast if bytes >= 4 * self.segment_bytes && world <= 16 => Algorithm::Chain,
            OpKind::Broadcast | OpKind::Reduce => Algorithm::BinomialTree,
            OpKind::AllToAll => Algorithm::Pairwise,
            OpKind::Barrier => Algorithm::Dissemination,
            _ => Algorithm::Direct,
        }
    }
}
