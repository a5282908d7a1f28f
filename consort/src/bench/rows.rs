//! What a collective bench rank measures and reports, shared by the host
//! ranks ([`super::collective`]) and the NCCL ranks ([`super::nccl`]): the
//! spec, the row, the bus factor, and the exact inputs and expected outputs
//! that every row's `#wrong` is checked against.

use consort::OpKind;
/// nccl-tests' bus bandwidth factor: the cost model's, one rule for both.
pub(crate) use consort_sim::cost::bus_factor;
use serde::{Deserialize, Serialize};

/// What every rank measures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct BenchSpec {
    pub(crate) backend: String,
    pub(crate) world: usize,
    pub(crate) ops: Vec<String>,
    pub(crate) sizes: Vec<usize>,
    pub(crate) dtype: String,
    pub(crate) iters: Option<usize>,
    /// Untimed iterations before the timed ones (see [`BenchSpec::warmup`]).
    #[serde(default)]
    pub(crate) warmup: Option<usize>,
    /// nccl: every rank on GPU 0 (see `consort bench --share-gpu`).
    #[serde(default)]
    pub(crate) share_gpu: bool,
    /// `max` (each iteration is the slowest rank's) or `rank0`.
    #[serde(default = "max_timing")]
    pub(crate) timing: String,
    /// `core`: each rank the bench starts on a core of its own when there
    /// are enough (as Open MPI binds), or `none`.
    #[serde(default = "core_binding")]
    pub(crate) bind_to: String,
}

/// Messages up to this many bytes get [`SMALL_WARMUP`] untimed iterations.
const SMALL_WARMUP_BYTES: usize = 8 << 10;

/// Untimed iterations of a small message (OSU's micro-benchmarks skip 200
/// below 8 KiB). A job's first ~50 small calls here ran at 15-25 µs each
/// instead of ~2 (seen on 2 ranks, each on a core of its own, in 5 of 6
/// runs with 2 warm-up iterations and in none of 6 with 50), so a row
/// measured from the second call on reported the start-up, not the
/// collective. Open MPI's Python anchor has run for a good 100 ms when it
/// starts timing.
const SMALL_WARMUP: usize = 200;

/// Untimed iterations of a larger message, as `gloo_bench.py` and
/// `mpi_bench.py` run.
const LARGE_WARMUP: usize = 2;

impl BenchSpec {
    /// Untimed iterations before a row of `bytes` is timed: `--warmup`,
    /// else [`SMALL_WARMUP`] (at most `--iters`, at least
    /// [`LARGE_WARMUP`]) up to [`SMALL_WARMUP_BYTES`] and [`LARGE_WARMUP`]
    /// above.
    pub(crate) fn warmup(&self, bytes: usize) -> usize {
        self.warmup.unwrap_or(if bytes <= SMALL_WARMUP_BYTES {
            // No more untimed than timed runs where `--iters` asks for few
            // (the checks that run every op at once).
            SMALL_WARMUP
                .min(self.iters.unwrap_or(SMALL_WARMUP))
                .max(LARGE_WARMUP)
        } else {
            LARGE_WARMUP
        })
    }
}

fn max_timing() -> String {
    "max".into()
}

fn core_binding() -> String {
    "core".into()
}

/// One measured row (rank 0's view, with every rank's #wrong summed in).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Row {
    pub(crate) op: String,
    pub(crate) bytes: usize,
    pub(crate) count: usize,
    pub(crate) time_us: f64,
    pub(crate) algbw_gbs: f64,
    pub(crate) busbw_gbs: f64,
    pub(crate) wrong: u64,
    /// Host time to issue one call (NCCL: the call returns once enqueued).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) host_us: Option<f64>,
    /// The same, calling NCCL's own entry point directly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) direct_host_us: Option<f64>,
}

/// Rank `r`'s input for the correctness run of `op` over `count`
/// elements (`count / n` for all_gather). In reductions exactly one rank
/// contributes a non-zero value (at most 7) to each element, so every sum
/// is exact in every dtype at any world size.
pub(crate) fn input<T: Small>(op: OpKind, r: usize, n: usize, count: usize) -> Vec<T> {
    let part = (count / n).max(1);
    match op {
        // One rank contributes to each element, so every sum is exact in
        // every dtype at any world size.
        OpKind::AllReduce | OpKind::ReduceScatter => (0..count)
            .map(|i| T::small(if i % n == r { i % 7 + 1 } else { 0 }))
            .collect(),
        OpKind::Broadcast => (0..count).map(|i| T::small(r * 3 + i % 5)).collect(),
        OpKind::AllGather => (0..count / n).map(|i| T::small(r + i % 3)).collect(),
        _ => (0..count).map(|i| T::small(r * 2 + i / part)).collect(),
    }
}

/// Element `i` of rank `r`'s correct output for [`input`]'s run.
pub(crate) fn expected<T: Small>(op: OpKind, r: usize, n: usize, count: usize, i: usize) -> T {
    let part = (count / n).max(1);
    T::small(match op {
        OpKind::AllReduce => i % 7 + 1,
        OpKind::Broadcast => i % 5,
        OpKind::ReduceScatter => (r * part + i) % 7 + 1,
        OpKind::AllGather => i / part + (i % part) % 3,
        _ => (i / part) * 2 + r,
    })
}

/// Elements in rank `r`'s output of `op` over `count` elements.
pub(crate) fn output_len(op: OpKind, n: usize, count: usize) -> usize {
    if op == OpKind::ReduceScatter {
        count / n
    } else {
        count
    }
}

/// Counts elements of `got` that differ from `want(i)`.
pub(crate) fn wrong<T: PartialEq + Copy>(got: &[T], want: impl Fn(usize) -> T) -> u64 {
    got.iter()
        .enumerate()
        .filter(|(i, g)| **g != want(*i))
        .count() as u64
}

/// A non-negative integer as an element: exact in floats while it fits
/// their mantissa, wrapping (as integer sums do) in integer types.
pub(crate) trait Small: consort::Element + Copy + PartialEq {
    fn small(x: usize) -> Self;
}

macro_rules! small {
    ($($t:ty => $conv:expr),* $(,)?) => {$(
        impl Small for $t {
            fn small(x: usize) -> Self {
                $conv(x)
            }
        }
    )*};
}
small! {
    f32 => |v: usize| v as f32, f64 => |v: usize| v as f64,
    consort::half::f16 => |v: usize| consort::half::f16::from_f64(v as f64),
    consort::half::bf16 => |v: usize| consort::half::bf16::from_f64(v as f64),
    i8 => |v: usize| v as i8, u8 => |v: usize| v as u8, i32 => |v: usize| v as i32,
    i64 => |v: usize| v as i64, u32 => |v: usize| v as u32, u64 => |v: usize| v as u64,
}
