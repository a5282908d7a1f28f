//! consort-tests: the conformance suite, written once and instantiated per
//! backend with [`conformance!`] (as rustls-test mounts its tests once per
//! crypto provider), and the fault suite, mounted per transport with
//! [`faults!`].
//!
//! This crate owns the reference semantics every backend is checked
//! against: inputs built from integer-valued numbers (so every float result
//! is exact), a reference reduction computed directly, and the properties
//! themselves. A backend joins by providing a [`Factory`] that makes a
//! world of `n` connected handles in one process.

use std::{future::Future, pin::Pin, sync::Arc};

/// The dtype tag, re-exported for the suite's strategies.
pub use consort_comm::DType;

use consort_comm::{
    Backend, CommError, Element, ProcessGroup, ReduceOp,
    half::{bf16, f16},
};

pub mod child;
pub mod faults;
pub use proptest;

/// The future a [`Factory`] returns: the world's handles, in rank order.
pub type WorldFuture = Pin<Box<dyn Future<Output = Vec<Arc<dyn Backend>>> + Send>>;

/// Makes a world of `n` connected ranks, in rank order.
pub type Factory = fn(usize) -> WorldFuture;

/// Runs `f` on every rank of a fresh world of `n`, each rank on its own
/// task, and returns the results in rank order.
pub fn run_world<T, F, Fut>(factory: Factory, n: usize, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(ProcessGroup) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let handles = factory(n).await;
        assert_eq!(handles.len(), n, "factory made the wrong number of ranks");
        let tasks: Vec<_> = handles
            .into_iter()
            .map(|b| tokio::spawn(f(ProcessGroup::new(b))))
            .collect();
        let mut out = Vec::with_capacity(n);
        for t in tasks {
            out.push(t.await.expect("rank task panicked"));
        }
        out
    })
}

/// An element type with a reference implementation of every reduction.
pub trait TestElem: Element + Copy {
    /// The value `v` (small integers only).
    fn from_i64(v: i64) -> Self;
    /// `a ⊕ b`, computed directly from the documented semantics.
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self;
    /// `a / n` as `ReduceOp::Avg` finishes.
    fn divide(a: Self, n: usize) -> Self;
    /// Bitwise equality (NaN-safe).
    fn same(a: Self, b: Self) -> bool;
    /// The value as an f64 (exact for the suite's small integers).
    fn to_f64(self) -> f64;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl TestElem for $t {
            fn from_i64(v: i64) -> Self { v as $t }
            fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::BAnd => a & b,
                    ReduceOp::BOr => a | b,
                    ReduceOp::BXor => a ^ b,
                    ReduceOp::PremulSum(_) => unreachable!("premul_sum is refused on integers"),
                }
            }
            fn divide(a: Self, n: usize) -> Self { ((a as i128) / (n as i128)) as $t }
            fn same(a: Self, b: Self) -> bool { a == b }
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
int_elem!(i8, u8, i32, i64, u32, u64);

macro_rules! float_elem {
    ($t:ty, $to:expr, $from:expr) => {
        impl TestElem for $t {
            fn from_i64(v: i64) -> Self {
                $from(v as f32)
            }
            fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                let (x, y): (f32, f32) = ($to(a), $to(b));
                $from(match op {
                    // PremulSum: the caller scaled the inputs already.
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => x + y,
                    ReduceOp::Prod => x * y,
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                    _ => unreachable!("bitwise ops are refused on floats"),
                })
            }
            fn divide(a: Self, n: usize) -> Self {
                $from($to(a) / n as f32)
            }
            fn same(a: Self, b: Self) -> bool {
                $to(a).to_bits() == $to(b).to_bits()
            }
            fn to_f64(self) -> f64 {
                f64::from($to(self))
            }
        }
    };
}
float_elem!(f32, |x: f32| x, |x: f32| x);
float_elem!(f16, |x: f16| x.to_f32(), f16::from_f32);
float_elem!(bf16, |x: bf16| x.to_f32(), bf16::from_f32);

impl TestElem for f64 {
    fn from_i64(v: i64) -> Self {
        v as f64
    }
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            _ => unreachable!("bitwise ops are refused on floats"),
        }
    }
    fn divide(a: Self, n: usize) -> Self {
        a / n as f64
    }
    fn same(a: Self, b: Self) -> bool {
        a.to_bits() == b.to_bits()
    }
    fn to_f64(self) -> f64 {
        self
    }
}

/// Rank `rank`'s input element `i`: small integers, chosen so that every
/// reduction over up to 16 ranks is exact in every dtype (products use
/// ±1 and a few 2s).
pub fn input<T: TestElem>(seed: u64, rank: usize, i: usize, op: ReduceOp) -> T {
    let h = (seed ^ 0x9E37_79B9_7F4A_7C15)
        .wrapping_mul(rank as u64 + 1)
        .wrapping_add((i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .rotate_left(17)
        .wrapping_mul(0x94D0_49BB_1331_11EB);
    let v = match op {
        ReduceOp::Prod => match h % 8 {
            0 => 2,
            1..=3 => -1,
            _ => 1,
        },
        _ => (h % 15) as i64 - 7,
    };
    // Unsigned types see small non-negative values.
    let v = if matches!(T::DTYPE, DType::U8 | DType::U32 | DType::U64) {
        v.abs()
    } else {
        v
    };
    T::from_i64(v)
}

/// The reduction of every rank's input, element by element, in rank order.
pub fn reference<T: TestElem>(seed: u64, n: usize, len: usize, op: ReduceOp) -> Vec<T> {
    (0..len)
        .map(|i| {
            let mut acc = input::<T>(seed, 0, i, op);
            for r in 1..n {
                acc = T::reference(op, acc, input::<T>(seed, r, i, op));
            }
            if op == ReduceOp::Avg {
                T::divide(acc, n)
            } else {
                acc
            }
        })
        .collect()
}

/// Checks `got` against elements `start..start + got.len()` of the
/// reduction of every rank's input. Exact, except `Avg` on f16 and bf16:
/// each rank scales by `1/n` before the sum (as NCCL does, so that partial
/// sums stay in range), which rounds n + 1 times, so the result is checked
/// against the true mean within that rounding.
pub fn check_reduced<T: TestElem>(
    got: &[T],
    seed: u64,
    n: usize,
    start: usize,
    op: ReduceOp,
    what: &str,
) -> Result<(), String> {
    let half = matches!(T::DTYPE, DType::F16 | DType::BF16);
    if !(half && op == ReduceOp::Avg) {
        let whole = reference::<T>(seed, n, start + got.len(), op);
        return assert_same_result(got, &whole[start..], what);
    }
    let eps = if T::DTYPE == DType::F16 {
        2f64.powi(-11)
    } else {
        2f64.powi(-8)
    };
    for (k, g) in got.iter().enumerate() {
        let xs: Vec<f64> = (0..n)
            .map(|r| input::<T>(seed, r, start + k, op).to_f64())
            .collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let scale = xs.iter().map(|x| x.abs()).sum::<f64>() / n as f64;
        let tol = eps * (n as f64 + 1.0) * scale + 1e-7;
        if (g.to_f64() - mean).abs() > tol {
            return Err(format!(
                "{what}: element {}: got {:?}, want {mean} within {tol}",
                start + k,
                g
            ));
        }
    }
    Ok(())
}

/// Compares two slices element by element (NaN-safe); `Err` names the
/// first difference.
pub fn assert_same_result<T: TestElem>(got: &[T], want: &[T], what: &str) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: length {} where {} was expected",
            got.len(),
            want.len()
        ));
    }
    match got.iter().zip(want).position(|(g, w)| !T::same(*g, *w)) {
        Some(i) => Err(format!(
            "{what}: element {i}: got {:?}, want {:?}",
            got[i], want[i]
        )),
        None => Ok(()),
    }
}

/// A reduce op a dtype supports (bitwise only on integers).
pub fn op_for(dtype: DType, pick: usize) -> ReduceOp {
    let ops: &[ReduceOp] = if dtype.is_float() {
        &[
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Prod,
            ReduceOp::Min,
            ReduceOp::Max,
        ]
    } else {
        &ReduceOp::ALL
    };
    ops[pick % ops.len()]
}

pub use consort_comm::with_dtype;

pub mod checks;
pub mod concurrency;
pub mod scaled;
pub mod shutdown;
pub mod subworld;

pub use subworld::on_subgroup;

/// Whether an error is a collective mismatch that names two different
/// calls: this rank's and the other side's (a message saying both sides
/// called the same thing would send the user looking in the wrong place).
pub fn is_mismatch(e: &CommError) -> bool {
    matches!(e, CommError::Mismatch { local, remote, .. } if local != remote)
}

/// Instantiates the whole conformance suite for a backend: `$factory` is a
/// [`Factory`]. `cases = N` sets the proptest cases per property (default:
/// proptest's, 256); backends whose worlds are expensive to build (real
/// sockets) pass fewer. `PROPTEST_CASES`, when set, overrides `cases` for
/// every property (proptest applies it last), so set it only to run more
/// or fewer cases on purpose: 256 cases of the TCP worlds open ~10^5
/// loopback connections.
///
/// ```ignore
/// consort_tests::conformance!(my_backend_world);
/// ```
#[macro_export]
macro_rules! conformance {
    ($factory:path) => {
        $crate::conformance!($factory, cases = $crate::proptest::test_runner::Config::default().cases);
    };
    ($factory:path, cases = $cases:expr) => {
        mod conformance {
            use $crate::checks;
            use $crate::proptest::prelude::*;

            fn dtype() -> impl Strategy<Value = $crate::DType> {
                prop::sample::select($crate::DType::ALL.to_vec())
            }

            /// Lengths from 0 up to several segments (the factory's worlds
            /// use small segments), including ones `world` does not divide.
            fn len() -> impl Strategy<Value = usize> {
                prop_oneof![Just(0usize), Just(1), 0usize..40, 0usize..400]
            }

            proptest! {
                #![proptest_config(ProptestConfig::with_cases($cases))]

                #[test]
                fn all_reduce(n in 1usize..=16, len in len(), dtype in dtype(), op in 0usize..8, seed in any::<u64>()) {
                    checks::all_reduce($factory, n, len, dtype, op, seed);
                }

                #[test]
                fn broadcast(n in 1usize..=16, len in len(), dtype in dtype(), root in any::<usize>(), seed in any::<u64>()) {
                    checks::broadcast($factory, n, len, dtype, root % n, seed);
                }

                #[test]
                fn reduce(n in 1usize..=16, len in len(), dtype in dtype(), op in 0usize..8, root in any::<usize>(), seed in any::<u64>()) {
                    checks::reduce($factory, n, len, dtype, op, root % n, seed);
                }

                #[test]
                fn all_gather(n in 1usize..=16, len in 0usize..60, dtype in dtype(), seed in any::<u64>()) {
                    checks::all_gather($factory, n, len, dtype, seed);
                }

                #[test]
                fn gather_and_scatter(n in 1usize..=16, len in 0usize..60, dtype in dtype(), root in any::<usize>(), seed in any::<u64>()) {
                    checks::gather_scatter($factory, n, len, dtype, root % n, seed);
                }

                #[test]
                fn reduce_scatter(n in 1usize..=16, len in 0usize..60, dtype in dtype(), op in 0usize..8, seed in any::<u64>()) {
                    checks::reduce_scatter($factory, n, len, dtype, op, seed);
                }

                #[test]
                fn all_to_all(n in 1usize..=16, dtype in dtype(), uneven in any::<bool>(), seed in any::<u64>()) {
                    checks::all_to_all($factory, n, dtype, uneven, seed);
                }

                #[test]
                fn barrier_and_point_to_point(n in 1usize..=16, len in len(), seed in any::<u64>()) {
                    checks::barrier_and_p2p($factory, n, len, seed);
                }

                #[test]
                fn object_collectives_uneven_all_gather_and_monitored_barrier(n in 1usize..=8, root in any::<usize>(), seed in any::<u64>()) {
                    checks::objects($factory, n, root % n, seed);
                }

                #[test]
                fn collectives_on_a_subgroup_then_on_its_parent(n in 1usize..=6, mask in any::<u64>(), sort in any::<bool>(), len in len(), dtype in dtype(), op in 0usize..8, seed in any::<u64>()) {
                    $crate::concurrency::subgroup($factory, n, mask, sort, len, dtype, op, seed);
                }

                #[test]
                fn disjoint_halves_and_the_world_all_in_flight_at_once(n in 2usize..=6, len in len(), seed in any::<u64>()) {
                    $crate::concurrency::halves($factory, n, len, seed);
                }

                #[test]
                fn several_calls_in_flight_awaited_in_reverse(n in 1usize..=6, len in len(), seed in any::<u64>()) {
                    $crate::concurrency::in_flight($factory, n, len, seed);
                }

                #[test]
                fn mismatched_calls_give_mismatch_on_every_rank(n in 2usize..=12, odd in any::<usize>(), kind in 0usize..4, len in 1usize..50) {
                    checks::mismatch($factory, n, odd % n, kind, len);
                }
            }

            proptest! {
                #![proptest_config(ProptestConfig::with_cases($cases))]

                #[test]
                fn premul_sum_with_a_factor_per_rank(n in 1usize..=16, len in len(), dtype in prop::sample::select(vec![$crate::DType::F32, $crate::DType::F64, $crate::DType::F16, $crate::DType::BF16]), kind in 0usize..3, seed in any::<u64>()) {
                    $crate::scaled::premul_sum($factory, n, len, dtype, kind, seed);
                }
            }

            #[test]
            fn half_precision_avg_does_not_overflow_where_the_mean_fits() {
                $crate::scaled::half_avg_in_range($factory, 5);
            }

            #[test]
            fn premul_sum_on_integers_is_unsupported_everywhere() {
                $crate::scaled::premul_sum_on_integers($factory, 3);
            }

            #[test]
            fn bitwise_reductions_on_floats_are_unsupported_everywhere() {
                checks::unsupported($factory);
            }

            #[test]
            fn bad_arguments_are_invalid_on_every_rank_without_hanging() {
                checks::invalid_arguments($factory);
            }

            #[test]
            fn calls_after_a_failure_fail_fast_with_the_first_cause() {
                checks::sticky($factory);
            }

            #[test]
            fn many_calls_in_a_row_keep_their_order() {
                checks::sequence($factory);
            }

            #[test]
            fn a_timeout_of_duration_max_is_clamped_not_a_panic() {
                checks::endless_timeout($factory);
            }

            #[test]
            fn new_subgroups_and_split_follow_torch() {
                $crate::concurrency::splits($factory, 6, 3);
                $crate::concurrency::splits($factory, 5, 1);
            }

            #[test]
            fn bad_rank_lists_are_refused_on_every_rank() {
                $crate::concurrency::bad_groups($factory);
            }

            #[test]
            fn a_dropped_call_aborts_its_group_with_a_clear_error() {
                $crate::concurrency::cancelled($factory, 3);
            }

            #[test]
            fn a_forgotten_call_s_buffer_is_never_written() {
                $crate::concurrency::leaked($factory, 3);
            }

            #[test]
            fn monitored_barrier_names_the_rank_that_did_not_arrive() {
                checks::monitored_barrier_names_the_missing_rank($factory, 3);
            }
        }
    };
}
