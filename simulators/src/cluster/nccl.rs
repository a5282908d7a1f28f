//! NCCL's tuning model, rewritten from NCCL 2.30.7 (`src/graph/tuning.cc`,
//! `src/graph/search.cc`, `src/enqueue.cc`; NVIDIA/nccl at 5067397).
//!
//! Owns: NCCL's per-algorithm and per-protocol constants (base and
//! per-hop latencies, LL and LL128 bandwidth caps, per-channel tree caps,
//! NVLS efficiency, the tree correction factors), the bandwidth and
//! latency formulas of `ncclTopoTuneModel`, the time of
//! `ncclTopoGetAlgoTime`, and the choice of `topoGetAlgoInfo` (the
//! smallest predicted time, then the channels).
//!
//! Owns no topology search: NCCL's `ncclTopoCompute` walks the machine's
//! PCI and NVLink tree; [`graphs`] stands in for it with the rules that
//! decide its result on the NVSwitch machines the presets describe (the
//! speed arrays, one channel per NIC across nodes, `ncclTopoDupChannels`).
//! CollNet (SHARP in the switch) is not modelled: NCCL enables it only
//! where the network offers it, and then also NVLS across nodes.

use std::fmt;

use super::{
    ClusterError, Collective, Placement,
    presets::{Arch, Cluster, Cpu},
};

/// NCCL's algorithms, by `NCCL_ALGO`'s names (CollNet left out).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    /// Double binary tree (all_reduce only).
    Tree,
    /// Ring.
    Ring,
    /// NVLink SHARP: the NVSwitch reduces (one node, Hopper and later).
    Nvls,
    /// NVLS inside each node, a tree across nodes.
    NvlsTree,
    /// Parallel aggregated trees (all_gather and reduce_scatter, one GPU
    /// per node).
    Pat,
}

impl Algo {
    /// Every algorithm modelled.
    pub const ALL: [Algo; 5] = [
        Algo::Tree,
        Algo::Ring,
        Algo::Nvls,
        Algo::NvlsTree,
        Algo::Pat,
    ];

    /// `NCCL_ALGO`'s name.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Tree => "Tree",
            Algo::Ring => "Ring",
            Algo::Nvls => "NVLS",
            Algo::NvlsTree => "NVLSTree",
            Algo::Pat => "PAT",
        }
    }

    fn idx(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algo {
    type Err = String;
    /// `NCCL_ALGO`'s names, case-insensitively.
    fn from_str(s: &str) -> Result<Self, String> {
        Algo::ALL
            .into_iter()
            .find(|a| a.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                format!("unknown NCCL algorithm {s:?}: Tree, Ring, NVLS, NVLSTree or PAT")
            })
    }
}

/// NCCL's protocols, by `NCCL_PROTO`'s names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    /// 8-byte stores with a flag in each: lowest latency, half the bandwidth.
    LL,
    /// 128-byte lines with a flag in each: 120/128 of the bandwidth.
    LL128,
    /// Plain copies behind a fence: full bandwidth, highest latency.
    Simple,
}

impl Proto {
    /// Every protocol.
    pub const ALL: [Proto; 3] = [Proto::LL, Proto::LL128, Proto::Simple];

    /// `NCCL_PROTO`'s name.
    pub fn name(self) -> &'static str {
        match self {
            Proto::LL => "LL",
            Proto::LL128 => "LL128",
            Proto::Simple => "Simple",
        }
    }

    fn idx(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Proto {
    type Err = String;
    /// `NCCL_PROTO`'s names, case-insensitively.
    fn from_str(s: &str) -> Result<Self, String> {
        Proto::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| format!("unknown NCCL protocol {s:?}: LL, LL128 or Simple"))
    }
}

// NCCL's default tuner constants (`ncclTunerConstantsDefaults`), rows in
// our `Algo` order (Tree, Ring, NVLS, NVLSTree, PAT), columns LL, LL128,
// Simple; microseconds.
const BASE_LAT: [[f64; 3]; 5] = [
    [6.8, 14.0, 8.4],
    [6.6, 14.0, 8.4],
    [0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0],
    [8.0, 8.0, 8.0],
];
const HW_LAT_NVLINK: [[f64; 3]; 5] = [
    [0.6, 1.25, 4.0],
    [0.6, 1.9, 3.4],
    [0.0, 0.0, 25.0],
    [0.0, 0.0, 25.0],
    [0.0, 0.0, 4.0],
];
const HW_LAT_NET: [[f64; 3]; 5] = [
    [5.0, 8.5, 14.0],
    [2.7, 4.0, 14.0],
    [0.0, 0.0, 18.0],
    [0.0, 0.0, 20.9],
    [0.0, 0.0, 14.0],
];
// GB/s; rows Volta..Blackwell (or, across nodes, CPU: Intel, AMD), columns
// one node, two nodes, more.
const LL_MAX_BWS: [[f64; 3]; 4] = [
    [39.0, 39.0, 20.4],
    [87.7, 22.5, 19.0],
    [141.0, 45.0, 35.0],
    [282.0, 90.0, 70.0],
];
const PER_CH_MAX_RING_LL128: [[f64; 3]; 4] = [
    [20.0, 20.0, 20.0],
    [20.0, 20.0, 20.0],
    [36.7, 36.7, 36.7],
    [40.0, 40.0, 40.0],
];
const PER_CH_MAX_TREE_LL128: [[f64; 3]; 4] = [
    [20.0, 20.0, 20.0],
    [20.0, 20.0, 20.0],
    [36.7, 36.7, 29.0],
    [55.6, 31.67, 20.0],
];
const PER_CH_MAX_TREE: [[f64; 3]; 4] = [
    [26.5, 18.5, 10.0],
    [24.0, 23.6, 17.8],
    [38.7, 41.4, 36.0],
    [70.0, 42.8, 24.0],
];
const PER_CH_MAX_NVLS_TREE: [[f64; 3]; 4] = [
    [26.5, 18.5, 10.0],
    [24.0, 23.6, 17.8],
    [0.0, 57.7, 45.5],
    [0.0, 96.0, 80.0],
];
const NVLS_EFFICIENCY: [f64; 4] = [0.0, 0.0, 0.85, 0.74];
/// `treeCorrectionFactor`: tree all_reduce's bandwidth by power of two
/// from 64 B, per protocol ("trees are not perfectly sticking to the
/// model for medium sizes").
const TREE_CORRECTION: [[f64; 24]; 3] = [
    [
        1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.6, 0.5, 0.4, 0.4, 0.5, 0.6, 0.7, 0.8,
        0.9, 1.0, 1.0, 1.0, 1.0, 1.0,
    ],
    [
        1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.8, 0.8, 0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.8, 0.9,
        0.9, 0.9, 0.9, 1.0, 1.0, 1.0,
    ],
    [
        0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5, 0.5, 0.5, 0.5, 0.6, 0.7, 0.8,
        0.7, 0.7, 0.8, 0.9, 0.9, 0.9,
    ],
];
// `search.cc`'s speeds (GB/s per channel) the search tries, fastest first.
const SPEED_INTRA: [&[f64]; 3] = [
    &[
        40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0,
    ],
    &[
        60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0,
    ],
    &[
        90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0,
    ],
];
const SPEED_INTER: [&[f64]; 3] = [
    &[
        48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4,
        1.2, 0.24, 0.12,
    ],
    &[
        48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24,
        0.12,
    ],
    &[
        96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0,
        3.0, 2.4, 1.2, 0.24, 0.12,
    ],
];
/// `MAXCHANNELS / 2`: the ring graph's most channels.
const MAX_RING_CHANNELS: u32 = 32;
/// `NCCL_MAX_NTHREADS` and the per-protocol thread counts and thresholds
/// `topoGetAlgoInfo` shrinks the channels by.
const THREADS: [u32; 3] = [512, 640, 512];
const THREAD_THRESHOLD: [u64; 3] = [8, 8, 64];

/// What NCCL's topology search hands the tuning model for one algorithm
/// (`ncclTopoGraph`'s `nChannels`, `bwIntra`, `bwInter`, `latencyInter`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Graph {
    /// Channels.
    pub channels: u32,
    /// GB/s per channel inside a node.
    pub bw_intra: f64,
    /// GB/s per channel across nodes.
    pub bw_inter: f64,
    /// The network's own latency, microseconds (0 for NCCL's IB plugin).
    pub latency_inter_us: f64,
}

/// The graphs of one communicator.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Graphs {
    /// Rings.
    pub ring: Graph,
    /// Trees (NCCL searches them with the ring's channel count).
    pub tree: Graph,
    /// NVLS heads, where NVLink SHARP is there (Hopper and later behind
    /// NVSwitches).
    pub nvls: Option<Graph>,
}

/// The fastest of `speeds` at or below `limit` (the slowest if none is).
fn speed_at_most(speeds: &[f64], limit: f64) -> f64 {
    speeds
        .iter()
        .copied()
        .find(|&s| s <= limit)
        .unwrap_or(speeds[speeds.len() - 1])
}

fn speed_row(arch: Arch) -> usize {
    match arch {
        Arch::Volta | Arch::Ampere => 0,
        Arch::Hopper => 1,
        Arch::Blackwell => 2,
    }
}

/// The graphs NCCL's search settles on for `at` on `c`'s nodes.
///
/// One node: the fastest intra speed one channel fits in the GPU's NVLink
/// bandwidth, as many channels as that bandwidth holds, then
/// `ncclTopoDupChannels` (twice the channels at half the speed, unless the
/// speed is under 25 GB/s or, after Ampere, under 50 GB/s on more than 4
/// channels). NVLS: one channel per GPU (the search forces it on one
/// node), at the fastest speed all fit at. Across nodes: one channel per
/// NIC the node's ranks use (rail rings, NCCL's `crossNic` 0), at the
/// fastest inter speed within both the NIC and the NVLink share.
pub fn graphs(c: &Cluster, at: Placement) -> Graphs {
    let row = speed_row(c.arch);
    let nvlink = c.nvlink_gbs;
    let cc_after_ampere = c.arch > Arch::Ampere;
    let (ring, nvls_speed, nvls_channels) = if at.nodes == 1 {
        let s = speed_at_most(SPEED_INTRA[row], nvlink);
        let mut ch = ((nvlink / s).floor() as u32).clamp(1, MAX_RING_CHANNELS);
        let mut s_ring = s;
        if s >= 25.0 && !(cc_after_ampere && s < 50.0 && ch > 4) {
            let dup = (ch * 2).min(MAX_RING_CHANNELS);
            s_ring /= f64::from(dup.div_ceil(ch));
            ch = dup;
        }
        // Non-ring searches may count the GPU's NVLink as heads/(heads-1)
        // of itself; pass 2 then raises NVLS's bwInter (no NIC on one
        // node) a step at a time while under twice bwIntra.
        let heads = at.ranks_per_node as u32;
        let s_nvls = speed_at_most(SPEED_INTRA[row], nvlink / f64::from(heads.max(2) - 1));
        let g = Graph {
            channels: ch,
            bw_intra: s_ring,
            bw_inter: s_ring,
            latency_inter_us: 0.0,
        };
        (g, (s_nvls, raise_inter(SPEED_INTRA[row], s_nvls)), heads)
    } else {
        // The NICs nearest the node's ranks (all of them on whole nodes).
        let share = at.ranks_per_node as f64 / c.gpus_per_node as f64;
        let nics = ((c.nics_per_node as f64 * share).round() as u32).max(1);
        let s = speed_at_most(SPEED_INTER[row], c.nic_gbs.min(nvlink / f64::from(nics)));
        let g = Graph {
            channels: nics.min(MAX_RING_CHANNELS),
            bw_intra: s,
            bw_inter: s,
            latency_inter_us: c.net_latency_us,
        };
        let heads = nics.min(at.ranks_per_node as u32);
        let s_nvls = speed_at_most(
            SPEED_INTER[row],
            c.nic_gbs.min(nvlink / f64::from(heads.max(2) - 1)),
        );
        (g, (s_nvls, s_nvls), heads)
    };
    let nvls = (c.nvswitch && c.arch >= Arch::Hopper && at.ranks_per_node > 1).then_some(Graph {
        channels: nvls_channels,
        bw_intra: nvls_speed.0,
        bw_inter: nvls_speed.1,
        latency_inter_us: ring.latency_inter_us,
    });
    Graphs {
        ring,
        tree: ring,
        nvls,
    }
}

/// Pass 2 of NCCL's NVLS search on one node: from `intra`, the next
/// faster speed while the current one is under twice `intra`.
fn raise_inter(speeds: &[f64], intra: f64) -> f64 {
    let mut i = speeds
        .iter()
        .position(|&s| s <= intra)
        .unwrap_or(speeds.len() - 1);
    while i > 0 && speeds[i] < 2.0 * intra {
        i -= 1;
    }
    speeds[i]
}

/// `log2i`: the floor of log2, -1 for 0.
fn log2i(n: u64) -> i32 {
    if n == 0 {
        -1
    } else {
        63 - n.leading_zeros() as i32
    }
}

/// One (collective, algorithm, protocol) entry of the tuning table.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Entry {
    /// Algorithm bandwidth, GB/s (0: not available).
    bw: f64,
    /// Latency, microseconds.
    lat: f64,
}

/// The chosen algorithm and protocol for one call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// Algorithm.
    pub algo: Algo,
    /// Protocol.
    pub proto: Proto,
    /// Channels it runs on.
    pub channels: u32,
    /// Predicted time, microseconds.
    pub time_us: f64,
    /// Its algorithm bandwidth at infinite size, GB/s.
    pub algbw_bound: f64,
}

/// A communicator's tuning table: `comm->bandwidths` and
/// `comm->latencies` after `ncclTopoTuneModel`.
#[derive(Clone, Debug)]
pub struct Tuning {
    at: Placement,
    arch: Arch,
    graphs: Graphs,
    /// `comm->nChannels` (the ring's, doubled by `ncclTopoPostset`).
    comm_channels: u32,
    table: [[[Entry; 3]; 5]; 3],
}

fn coll_idx(op: Collective) -> usize {
    match op {
        Collective::AllReduce => 0,
        Collective::AllGather => 1,
        Collective::ReduceScatter => 2,
    }
}

impl Tuning {
    /// `ncclTopoTuneModel` for `at` on `c` (default environment: no
    /// `NCCL_ALGO`, `NCCL_PROTO`, CollNet off, LL128 on as it is by
    /// default on NVLink machines).
    pub fn new(c: &Cluster, at: Placement) -> Tuning {
        let graphs = graphs(c, at);
        let mut table = [[[Entry { bw: 0.0, lat: 0.0 }; 3]; 5]; 3];
        for op in Collective::ALL {
            for algo in Algo::ALL {
                for proto in Proto::ALL {
                    table[coll_idx(op)][algo.idx()][proto.idx()] =
                        entry(c, at, &graphs, op, algo, proto);
                }
            }
        }
        Tuning {
            at,
            arch: c.arch,
            graphs,
            comm_channels: (graphs.ring.channels * 2).min(2 * MAX_RING_CHANNELS),
            table,
        }
    }

    /// The graphs the table was built from.
    pub fn graphs(&self) -> &Graphs {
        &self.graphs
    }

    /// `ncclTopoGetAlgoTime`: microseconds, or `None` where the entry is
    /// not available.
    pub fn time_us(&self, op: Collective, algo: Algo, proto: Proto, bytes: usize) -> Option<f64> {
        let e = self.table[coll_idx(op)][algo.idx()][proto.idx()];
        if e.bw <= 0.0 {
            return None;
        }
        let (mut bw, mut lat) = (e.bw, e.lat);
        let log_size = log2i(bytes as u64 >> 6);
        if algo == Algo::Tree && op == Collective::AllReduce && (0..23).contains(&log_size) {
            bw *= TREE_CORRECTION[proto.idx()][log_size as usize];
        }
        // NVLSTree's correction applies on Blackwell x86 hosts only.
        if algo == Algo::NvlsTree
            && op == Collective::AllReduce
            && self.arch >= Arch::Blackwell
            && (0..24).contains(&log_size)
        {
            bw *= TREE_CORRECTION[proto.idx()][log_size as usize];
        }
        let per_channel_rank = bytes as u64 / u64::from(self.comm_channels) / self.n() as u64;
        if algo == Algo::Ring
            && proto == Proto::Simple
            && self.at.nodes > 1
            && op == Collective::AllReduce
            && per_channel_rank >= 64
        {
            // "Plateau effect of ring".
            lat *= if self.arch < Arch::Ampere { 1.9 } else { 1.4 };
        }
        Some(lat + bytes as f64 / (1000.0 * bw))
    }

    fn n(&self) -> usize {
        self.at.world_size()
    }

    /// `topoGetAlgoInfo`: the entry of smallest time, among those `algo`
    /// and `proto` allow (`None`: all, as without `NCCL_ALGO`/`NCCL_PROTO`).
    pub fn choose(
        &self,
        op: Collective,
        bytes: usize,
        algo: Option<Algo>,
        proto: Option<Proto>,
    ) -> Result<Choice, ClusterError> {
        let mut best: Option<(Algo, Proto, f64)> = None;
        for a in Algo::ALL
            .into_iter()
            .filter(|a| algo.is_none_or(|f| f == *a))
        {
            for p in Proto::ALL
                .into_iter()
                .filter(|p| proto.is_none_or(|f| f == *p))
            {
                if let Some(t) = self.time_us(op, a, p, bytes)
                    && best.is_none_or(|(_, _, b)| t < b)
                {
                    best = Some((a, p, t));
                }
            }
        }
        let Some((a, p, t)) = best else {
            let algo = algo.unwrap_or(Algo::Ring);
            return Err(ClusterError::AlgoUnavailable {
                op,
                algo,
                why: unavailable_why(op, algo, self.at, self.graphs.nvls.is_some()),
            });
        };
        Ok(Choice {
            algo: a,
            proto: p,
            channels: self.channels_for(a, p, bytes),
            time_us: t,
            algbw_bound: self.table[coll_idx(op)][a.idx()][p.idx()].bw,
        })
    }

    /// The channels `topoGetAlgoInfo` keeps: all NVLS heads for NVLS; for
    /// ring and tree, one fewer while the message is under
    /// channels × threads × the protocol's per-thread threshold.
    fn channels_for(&self, a: Algo, p: Proto, bytes: usize) -> u32 {
        if let (Algo::Nvls | Algo::NvlsTree, Some(g)) = (a, self.graphs.nvls) {
            return g.channels;
        }
        let mut threshold = THREAD_THRESHOLD[p.idx()];
        if a == Algo::Ring && p == Proto::LL {
            threshold *= self.n() as u64;
        }
        let per_channel = u64::from(THREADS[p.idx()]) * threshold;
        let mut nc = self.comm_channels;
        while nc >= 2 && (bytes as u64) < u64::from(nc) * per_channel {
            nc -= 1;
        }
        nc
    }
}

fn unavailable_why(op: Collective, algo: Algo, at: Placement, nvls: bool) -> &'static str {
    match algo {
        Algo::Tree => "NCCL's tree runs all_reduce only",
        Algo::Pat if op == Collective::AllReduce => "PAT runs all_gather and reduce_scatter only",
        Algo::Pat => "PAT needs one GPU per node",
        Algo::Nvls | Algo::NvlsTree if !nvls => {
            "NVLS needs Hopper or later GPUs behind NVSwitches, two or more on a node"
        }
        Algo::Nvls if at.nodes > 1 => "NVLS across nodes needs CollNet (SHARP), not modelled",
        Algo::NvlsTree if at.nodes == 1 => "NVLSTree needs two or more nodes",
        Algo::NvlsTree => "NVLSTree runs all_reduce only",
        _ => "no protocol of it is available here",
    }
}

/// Whether NCCL's tuning loop considers (`op`, `algo`, `proto`) at all.
fn considered(op: Collective, algo: Algo, proto: Proto, at: Placement, nvls: bool) -> bool {
    let ag_rs = op != Collective::AllReduce;
    match algo {
        Algo::Tree => !ag_rs,
        Algo::Ring => true,
        // NVLS across nodes is CollNet+NVLS; without CollNet it is off, and
        // all_gather/reduce_scatter NVLS across nodes needs CollNet too.
        Algo::Nvls => nvls && proto == Proto::Simple && at.nodes == 1,
        Algo::NvlsTree => nvls && proto == Proto::Simple && at.nodes > 1 && !ag_rs,
        // `ncclPatEnable`: one GPU per node.
        Algo::Pat => ag_rs && proto == Proto::Simple && at.nodes == at.world_size(),
    }
}

/// One entry of `ncclTopoTuneModel`'s loop.
fn entry(
    c: &Cluster,
    at: Placement,
    g: &Graphs,
    op: Collective,
    algo: Algo,
    proto: Proto,
) -> Entry {
    let none = Entry { bw: 0.0, lat: 0.0 };
    if !considered(op, algo, proto, at, g.nvls.is_some()) {
        return none;
    }
    let graph = match algo {
        Algo::Nvls | Algo::NvlsTree => match g.nvls {
            Some(n) => n,
            None => return none,
        },
        Algo::Tree => g.tree,
        Algo::Ring | Algo::Pat => g.ring,
    };
    let bw = bus_bw(c, at, &graph, op, algo, proto);
    Entry {
        bw,
        lat: latency(c, at, &graph, op, algo, proto),
    }
}

/// The algorithm bandwidth of one entry (GB/s), `ncclTopoTuneModel`'s
/// "bus BW" with its refinements, converted as it converts it.
fn bus_bw(c: &Cluster, at: Placement, g: &Graph, op: Collective, algo: Algo, proto: Proto) -> f64 {
    let (nodes, n) = (at.nodes, at.world_size() as f64);
    let ppn = at.ranks_per_node as f64;
    let a = c.arch.idx();
    let index2 = if nodes <= 2 { nodes - 1 } else { 2 };
    // LL's cap: the GPU's on one node, the CPU's across nodes.
    let ll_row = if nodes == 1 {
        a
    } else if c.cpu == Cpu::Amd {
        1
    } else {
        0
    };
    let ll_max = LL_MAX_BWS[ll_row][index2];
    let ch = f64::from(g.channels);
    let mut per_ch = if nodes <= 2 { g.bw_intra } else { g.bw_inter };
    if matches!(algo, Algo::Nvls | Algo::NvlsTree) {
        if g.channels < 2 {
            return 0.0;
        }
        let mut intra = g.bw_intra * NVLS_EFFICIENCY[a] * (ch - 1.0) / ch;
        // all_reduce pipelines two operations through the switch.
        intra *= if op == Collective::AllReduce {
            2.0
        } else {
            (ppn - 1.0) / ppn
        };
        let inter = g.bw_inter
            * if nodes <= 2 && algo == Algo::NvlsTree {
                2.0
            } else {
                1.0
            };
        let cap = if algo == Algo::NvlsTree {
            PER_CH_MAX_NVLS_TREE[a][index2]
        } else {
            f64::MAX
        };
        per_ch = intra.min(inter).min(cap);
    }
    let mut bus = ch * per_ch;
    match (algo, proto) {
        (Algo::Ring, Proto::LL) => bus = ll_max.min(bus * 0.5),
        (Algo::Ring, Proto::LL128) => bus = (bus * 0.92).min(ch * PER_CH_MAX_RING_LL128[a][index2]),
        _ => {}
    }
    if algo == Algo::Tree && op == Collective::AllReduce {
        bus = (bus * 0.92).min(ch * PER_CH_MAX_TREE[a][index2]);
    }
    match (algo, proto) {
        (Algo::Tree, Proto::LL) => bus = (bus / 3.8).min(ll_max),
        (Algo::Tree, Proto::LL128) => {
            let f = if nodes == 1 { 7.0 / 9.0 } else { 120.0 / 128.0 };
            bus = (bus * f).min(ch * PER_CH_MAX_TREE_LL128[a][index2]);
        }
        (Algo::Pat, _) => bus *= 0.75,
        _ => {}
    }
    // Bus bandwidth to algorithm bandwidth (not for non-ring
    // all_gather/reduce_scatter, whose figure already is one).
    let ag_rs = op != Collective::AllReduce;
    if !(algo != Algo::Ring && ag_rs) {
        let nsteps = if ag_rs { n - 1.0 } else { 2.0 * (n - 1.0) };
        bus *= if algo == Algo::Tree { 0.5 } else { n / nsteps };
    }
    bus
}

/// The latency of one entry (microseconds), `ncclTopoTuneModel`'s.
fn latency(c: &Cluster, at: Placement, g: &Graph, op: Collective, algo: Algo, proto: Proto) -> f64 {
    let (a, p) = (algo.idx(), proto.idx());
    let nodes = at.nodes;
    let n = at.world_size() as f64;
    let ppn = at.ranks_per_node;
    let ag_rs = op != Collective::AllReduce;
    let mut lat = BASE_LAT[a][p];
    let mut intra = HW_LAT_NVLINK[a][p];
    // With one rank per node every hop is exposed: the tree's network latency.
    let mut inter = if ppn == 1 {
        HW_LAT_NET[Algo::Tree.idx()][p]
    } else {
        HW_LAT_NET[a][p]
    };
    inter += g.latency_inter_us;
    if proto == Proto::Simple {
        inter += g.latency_inter_us; // the flush
    }
    let log_nodes = f64::from(log2i(nodes as u64).max(0));
    match algo {
        Algo::Ring => {
            let nsteps = if ag_rs { n - 1.0 } else { 2.0 * (n - 1.0) };
            if nodes > 1 {
                let overhead = if c.cpu == Cpu::Amd { 2.0 } else { 1.0 };
                let overhead = overhead * if proto == Proto::Simple { 3.0 } else { 1.0 };
                intra = intra.max(overhead);
            }
            let inter_steps = match (nodes, ag_rs) {
                (1, _) => 0.0,
                (_, false) => 2.0 * (nodes as f64 - 1.0),
                (_, true) => nodes as f64 - 1.0,
            };
            lat += (nsteps - inter_steps) * intra + inter_steps * inter;
        }
        Algo::Tree => {
            lat += 2.0 * ((ppn as f64 - 1.0) * intra + log_nodes * inter);
        }
        Algo::Nvls => {
            lat = intra + if nodes > 1 { inter } else { 0.0 };
        }
        Algo::NvlsTree => lat += intra + 2.0 * log_nodes * inter,
        Algo::Pat => lat += log_nodes * (inter / 3.5) + n * 2.8,
    }
    lat
}
