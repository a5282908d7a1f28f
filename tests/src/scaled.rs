//! Conformance bodies for the pre-multiplied reductions: `PremulSum` with a
//! factor of each rank's own, and `Avg` on f16 and bf16, which scales
//! before it sums so that a mean that fits the type never overflows.

use consort_comm::{
    CommError, DType, ProcessGroup, ReduceOp,
    half::{bf16, f16},
};

use crate::{
    Factory, TestElem,
    checks::{Outcome, everywhere},
    input,
};

/// Rank `r`'s factor: 2, 1 and -1 in turn, so ranks differ and every
/// product and partial sum of the suite's inputs stays exact in every
/// float dtype (|sum| <= 16 × 7 × 2 = 224 < 2^8, bf16's mantissa).
pub fn factor(r: usize) -> f64 {
    [2.0, 1.0, -1.0][r % 3]
}

/// Element `i` of the sum over `n` ranks of input × factor.
fn want<T: TestElem>(seed: u64, n: usize, i: usize) -> T {
    let op = ReduceOp::Sum;
    let v: f64 = (0..n)
        .map(|r| input::<T>(seed, r, i, op).to_f64() * factor(r))
        .sum();
    T::from_i64(v as i64)
}

fn check<T: TestElem>(got: &[T], seed: u64, n: usize, start: usize, what: &str) -> Outcome {
    let want: Vec<T> = (start..start + got.len())
        .map(|i| want::<T>(seed, n, i))
        .collect();
    crate::assert_same_result(got, &want, what)
}

/// all_reduce (`kind` 0), reduce to the last rank (1) or reduce_scatter (2)
/// with `PremulSum(factor(rank))`, checked exactly.
pub async fn premul_sum_rank(
    pg: ProcessGroup,
    len: usize,
    dtype: DType,
    kind: usize,
    seed: u64,
) -> Outcome {
    let (n, r) = (pg.world_size(), pg.rank());
    let op = ReduceOp::premul_sum(factor(r));
    let sum = ReduceOp::Sum;
    consort_comm::with_dtype!(dtype, T => {
        let what = format!("premul_sum kind {kind} {dtype} n={n} len={len}");
        let fail = |e: CommError| format!("{what}: {e}");
        match kind % 3 {
            0 => {
                let mut buf: Vec<T> = (0..len).map(|i| input(seed, r, i, sum)).collect();
                pg.all_reduce(&mut buf, op).await.map_err(fail)?;
                check(&buf, seed, n, 0, &what)
            }
            1 => {
                let mut buf: Vec<T> = (0..len).map(|i| input(seed, r, i, sum)).collect();
                pg.reduce(&mut buf, op, n - 1).await.map_err(fail)?;
                if r == n - 1 { check(&buf, seed, n, 0, &what) } else { Ok(()) }
            }
            _ => {
                let inp: Vec<T> = (0..n * len).map(|i| input(seed, r, i, sum)).collect();
                let mut out = vec![T::from_i64(0); len];
                pg.reduce_scatter(&mut out, &inp, op).await.map_err(fail)?;
                // The caller's input is left as it was.
                let again: Vec<T> = (0..n * len).map(|i| input(seed, r, i, sum)).collect();
                crate::assert_same_result(&inp, &again, "reduce_scatter's input")?;
                check(&out, seed, n, r * len, &what)
            }
        }
    })
}

/// [`premul_sum_rank`] on every rank of a world of `n`; `dtype` is a float.
pub fn premul_sum(factory: Factory, n: usize, len: usize, dtype: DType, kind: usize, seed: u64) {
    everywhere(factory, n, move |pg| {
        premul_sum_rank(pg, len, dtype, kind, seed)
    });
}

/// Every rank holds a value near the top of f16's and bf16's range; their
/// mean fits, their sum does not. `Avg` gives the mean, not infinity.
pub async fn half_avg_rank(pg: ProcessGroup) -> Outcome {
    let big16 = 60000.0f32;
    let mut a = vec![f16::from_f32(big16); 3];
    pg.all_reduce(&mut a, ReduceOp::Avg)
        .await
        .map_err(|e| format!("f16 avg: {e}"))?;
    let bigb = 3.0e38f32;
    let mut b = vec![bf16::from_f32(bigb); 3];
    pg.all_reduce(&mut b, ReduceOp::Avg)
        .await
        .map_err(|e| format!("bf16 avg: {e}"))?;
    let near = |got: f32, want: f32, eps: f32| got.is_finite() && (got - want).abs() <= want * eps;
    let n = pg.world_size() as f32;
    for x in &a {
        if !near(x.to_f32(), big16, 2f32.powi(-11) * (n + 1.0)) {
            return Err(format!("f16 avg of {big16} on every rank gave {x}"));
        }
    }
    for x in &b {
        if !near(x.to_f32(), bigb, 2f32.powi(-8) * (n + 1.0)) {
            return Err(format!("bf16 avg of {bigb} on every rank gave {x}"));
        }
    }
    Ok(())
}

/// [`half_avg_rank`] on every rank of a world of `n`.
pub fn half_avg_in_range(factory: Factory, n: usize) {
    everywhere(factory, n, half_avg_rank);
}

/// `PremulSum` on an integer dtype is `Unsupported` on every rank, before
/// any byte moves; the group still works afterwards.
pub async fn premul_sum_on_integers_rank(pg: ProcessGroup) -> Outcome {
    let mut x = [3i32; 4];
    match pg.all_reduce(&mut x, ReduceOp::premul_sum(2.0)).await {
        Err(CommError::Unsupported { .. }) => {}
        other => return Err(format!("premul_sum on i32 gave {other:?}")),
    }
    let mut y = [1u32];
    pg.all_reduce(&mut y, ReduceOp::Sum)
        .await
        .map_err(|e| format!("all_reduce after the refusal: {e}"))?;
    if y[0] as usize != pg.world_size() {
        return Err(format!("all_reduce after the refusal gave {}", y[0]));
    }
    Ok(())
}

/// [`premul_sum_on_integers_rank`] on every rank of a world of `n`.
pub fn premul_sum_on_integers(factory: Factory, n: usize) {
    everywhere(factory, n, premul_sum_on_integers_rank);
}
