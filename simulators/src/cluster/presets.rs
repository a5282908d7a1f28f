//! Clusters described by their hardware, each beside the published
//! nccl-tests figures it is held to.
//!
//! Owns: the presets and their citations. A preset states hardware facts
//! only (GPUs per node, the NVLink bandwidth NCCL counts per GPU, the NICs
//! and the rate NCCL reads from them, the host CPU, the GPU's dense BF16
//! peak); nothing in it is fitted. The figures are what the model is
//! tested against (`tests/cluster_presets.rs`: within 15%), quoted where
//! they were published. Owns no formula: those are [`super::nccl`]'s.

use super::{ClusterError, Collective};

/// A GPU generation, as NCCL indexes its tables (`compCapIndex`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Arch {
    /// sm70.
    Volta,
    /// sm80 (A100).
    Ampere,
    /// sm90 (H100, H200).
    Hopper,
    /// sm100 (B200).
    Blackwell,
}

impl Arch {
    pub(crate) fn idx(self) -> usize {
        self as usize
    }
}

/// The host CPU's vendor: NCCL's LL cap across nodes and its network
/// post overhead (`getNetOverhead`) depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cpu {
    /// Intel x86.
    Intel,
    /// AMD x86.
    Amd,
}

/// NCCL's NVLink bandwidth per link on Hopper (`SM90_NVLINK_BW`, GB/s).
const SM90_NVLINK: f64 = 20.6;
/// On Ampere (`SM80_NVLINK_BW`).
const SM80_NVLINK: f64 = 20.0;
/// NCCL's IB plugin reports a port's rate in Mb/s and the topology
/// divides by 8,000: an NDR (400 Gb/s) port is 50 GB/s, HDR (200 Gb/s) 25.
const NDR_GBS: f64 = 50.0;
const HDR_GBS: f64 = 25.0;

/// A cluster of identical nodes.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// The preset's name (`consort sim --cluster NAME`).
    pub name: &'static str,
    /// What the nodes are, in a line.
    pub description: &'static str,
    /// GPU generation.
    pub arch: Arch,
    /// GPUs on each node.
    pub gpus_per_node: usize,
    /// NVLink bandwidth per GPU as NCCL counts it: links × NCCL's per-link
    /// figure, GB/s.
    pub nvlink_gbs: f64,
    /// Whether the GPUs meet in NVSwitches (NVLS needs them).
    pub nvswitch: bool,
    /// Network adapters on each node.
    pub nics_per_node: usize,
    /// Each adapter's rate as NCCL reads it, GB/s.
    pub nic_gbs: f64,
    /// The network's own latency NCCL adds (`latencyInter`; 0 for IB).
    pub net_latency_us: f64,
    /// Host CPU vendor.
    pub cpu: Cpu,
    /// Dense BF16 peak per GPU, TFLOP/s (the step model's compute).
    pub peak_tflops: f64,
    /// The published figures this preset is held to.
    pub published: &'static [Published],
}

/// One published nccl-tests figure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Published {
    /// The collective.
    pub op: Collective,
    /// GPUs in the run.
    pub world_size: usize,
    /// The message size the figure is for (nccl-tests' "size").
    pub bytes: usize,
    /// The bus bandwidth published, GB/s.
    pub busbw_gbs: f64,
    /// Where it was published and what it says.
    pub source: &'static str,
}

const GIB: usize = 1 << 30;
const MIB: usize = 1 << 20;

const H100_FIGURES: &[Published] = &[
    Published {
        op: Collective::AllReduce,
        world_size: 8,
        bytes: 8 * GIB,
        busbw_gbs: 480.0,
        source: "https://github.com/NVIDIA/nccl-tests/issues/212 (sjeaugey, NVIDIA, 2024-05-06): \
                 allreduce uses NVLink SHARP by default; on 8 H100 \"a peak busBw of ~480GB/s \
                 (algbw ~275GB/s)\" at large sizes",
    },
    Published {
        op: Collective::AllGather,
        world_size: 8,
        bytes: 8 * GIB,
        busbw_gbs: 370.0,
        source: "https://github.com/NVIDIA/nccl-tests/issues/212 (sjeaugey, NVIDIA): \"NCCL can \
                 get an effective NVLink bandwidth of 370GB/s, which you can observe as BusBw \
                 when running non-allreduce operations\"",
    },
    Published {
        op: Collective::ReduceScatter,
        world_size: 8,
        bytes: 8 * GIB,
        busbw_gbs: 370.0,
        source: "https://github.com/NVIDIA/nccl-tests/issues/212 (sjeaugey, NVIDIA): the same \
                 370GB/s for non-allreduce operations",
    },
    Published {
        op: Collective::AllReduce,
        world_size: 32,
        bytes: 8 * GIB,
        busbw_gbs: 330.93,
        source: "https://github.com/ZiyanIshani/vpbenchmarking README (Voltage Park, 4 nodes x \
                 8 H100 SXM5, 3.2 Tb/s InfiniBand per node, NCCL 2.24.3, 8 B to 8 GiB): \
                 AllReduce bus bandwidth 330.93 GB/s",
    },
    Published {
        op: Collective::AllReduce,
        world_size: 256,
        bytes: 2 * GIB,
        busbw_gbs: 340.0,
        source: "https://github.com/NVIDIA/nccl/issues/1218 (32 nodes x 8 H100, 8 NICs each, \
                 2 GiB, NCCL_MIN/MAX_NCHANNELS=16): all_reduce_perf \"340GB\" beside \
                 all_gather's 200 GB/s",
    },
];

const H200_FIGURES: &[Published] = &[
    Published {
        op: Collective::AllReduce,
        world_size: 8,
        bytes: 4 * GIB,
        busbw_gbs: 475.0,
        source: "https://github.com/NVIDIA/nccl-tests/issues/272 (8 H200 on NVLink 4, NCCL \
                 2.20.3, 64 KiB to 4 GiB): \"peak bandwidth of 475 GB/s\"",
    },
    Published {
        op: Collective::AllReduce,
        world_size: 1984,
        bytes: 512 * MIB,
        busbw_gbs: 350.0,
        source: "https://github.com/NVIDIA/nccl-tests/issues/283 (248 servers x 8 H200, 8 IB \
                 HCAs each, default NCCL_ALGO, 512 MiB): bus bandwidth \"typically measuring \
                 around 350G\"",
    },
];

const A100_FIGURES: &[Published] = &[
    Published {
        op: Collective::AllReduce,
        world_size: 8,
        bytes: 4 * GIB,
        busbw_gbs: 232.54,
        source: "https://github.com/NVIDIA/nccl/issues/1048 (8 A100, 4 x 200 Gb/s IB per node): \
                 single node all_reduce_perf -b 8 -e 4G -g 8, 232.54GB/s",
    },
    Published {
        op: Collective::AllReduce,
        world_size: 16,
        bytes: 128 * MIB,
        busbw_gbs: 93.25,
        source: "https://github.com/NVIDIA/nccl-tests/issues/152 (2 nodes x 8 A100-SXM4-80GB, \
                 4 HDR ConnectX-6 per node, after raising MAX_ACC_OUT_READ): 93.25 GB/s at \
                 134217728 B",
    },
    Published {
        op: Collective::AllReduce,
        world_size: 24,
        bytes: 128 * MIB,
        busbw_gbs: 96.0,
        source: "https://github.com/NVIDIA/nccl-tests/issues/119 (3 servers x 8 A100 SXM4 40G, \
                 4 HDR IB each, up to 128 MiB): \"peak performance reaches about 96GB/s\"",
    },
];

/// Every preset.
pub fn presets() -> Vec<Cluster> {
    vec![
        Cluster {
            name: "dgx-h100",
            description: "8x H100 SXM5 (18 NVLink 4 links, NVSwitch), 8x 400 Gb/s NDR IB per node",
            arch: Arch::Hopper,
            gpus_per_node: 8,
            nvlink_gbs: 18.0 * SM90_NVLINK,
            nvswitch: true,
            nics_per_node: 8,
            nic_gbs: NDR_GBS,
            net_latency_us: 0.0,
            cpu: Cpu::Intel,
            peak_tflops: 989.0,
            published: H100_FIGURES,
        },
        Cluster {
            name: "hgx-h200",
            description: "8x H200 SXM (18 NVLink 4 links, NVSwitch), 8x 400 Gb/s NDR IB per node",
            arch: Arch::Hopper,
            gpus_per_node: 8,
            nvlink_gbs: 18.0 * SM90_NVLINK,
            nvswitch: true,
            nics_per_node: 8,
            nic_gbs: NDR_GBS,
            net_latency_us: 0.0,
            cpu: Cpu::Intel,
            peak_tflops: 989.0,
            published: H200_FIGURES,
        },
        Cluster {
            name: "a100-4hdr",
            description: "8x A100 SXM4 (12 NVLink 3 links, NVSwitch), 4x 200 Gb/s HDR IB per node",
            arch: Arch::Ampere,
            gpus_per_node: 8,
            nvlink_gbs: 12.0 * SM80_NVLINK,
            nvswitch: true,
            nics_per_node: 4,
            nic_gbs: HDR_GBS,
            net_latency_us: 0.0,
            cpu: Cpu::Intel,
            peak_tflops: 312.0,
            published: A100_FIGURES,
        },
    ]
}

/// The preset called `name`.
pub fn preset(name: &str) -> Result<Cluster, ClusterError> {
    let all = presets();
    all.iter()
        .find(|c| c.name.eq_ignore_ascii_case(name.trim()))
        .cloned()
        .ok_or_else(|| ClusterError::UnknownPreset {
            name: name.to_string(),
            valid: all.iter().map(|c| c.name).collect(),
        })
}
