//! PowerSGD (torch's `powerSGD_hook`): low-rank gradient compression with
//! error feedback, for f32 buckets.
//!
//! Each gradient matrix `M` (`rows × cols`, the parameter's first dimension
//! by the rest) that rank `r` compresses, `(rows + cols)·r < rows·cols`, is
//! sent as two thin factors instead:
//!
//! 1. `M += E` (the error this rank left out last step);
//! 2. `P = M·Q`, all-reduced and averaged, then orthonormalised;
//! 3. `Q = Mᵀ·P`, all-reduced and averaged;
//! 4. `M̂ = P·Qᵀ` replaces the gradient, and `E = M − M̂` is kept.
//!
//! `Q` starts from the same seeded random matrix on every rank and is kept
//! between steps (warm start). Vectors and matrices too small to gain are
//! averaged uncompressed, in one all-reduce per bucket.

use std::collections::HashMap;

use consort_comm::{Backend, BufferMut, CallOptions, CommError, ReduceOp};

/// One parameter's place in a bucket, as a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Parameter index (the key of its state).
    pub(crate) param: usize,
    /// Offset in the bucket, in elements.
    pub(crate) offset: usize,
    /// First dimension (1 for a vector).
    pub(crate) rows: usize,
    /// Product of the other dimensions.
    pub(crate) cols: usize,
}

/// Per-parameter factors and errors, kept across steps by the bucket
/// worker.
#[derive(Debug, Default)]
pub(crate) struct State {
    q: HashMap<usize, Vec<f32>>,
    err: HashMap<usize, Vec<f32>>,
}

fn compresses(p: &Piece, r: usize) -> bool {
    p.rows > 1 && p.cols > 1 && (p.rows + p.cols) * r < p.rows * p.cols
}

/// The same pseudo-random `cols × r` start on every rank.
fn initial_q(param: usize, cols: usize, r: usize) -> Vec<f32> {
    let mut s = (param as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..cols * r)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Orthonormalises the `r` columns of the `rows × r` matrix `p` (modified
/// Gram-Schmidt); a column that vanishes stays zero.
fn orthonormalise(p: &mut [f32], rows: usize, r: usize) {
    for j in 0..r {
        for k in 0..j {
            let dot: f32 = (0..rows).map(|i| p[i * r + j] * p[i * r + k]).sum();
            for i in 0..rows {
                p[i * r + j] -= dot * p[i * r + k];
            }
        }
        let norm = (0..rows)
            .map(|i| p[i * r + j] * p[i * r + j])
            .sum::<f32>()
            .sqrt();
        if norm > 1e-12 {
            for i in 0..rows {
                p[i * r + j] /= norm;
            }
        }
    }
}

async fn average<B: Backend + ?Sized>(
    backend: &B,
    v: &mut [f32],
    opts: &CallOptions,
) -> Result<(), CommError> {
    if v.is_empty() {
        return Ok(());
    }
    backend
        .all_reduce(BufferMut::from(&mut *v), ReduceOp::Sum, opts)
        .await?;
    let w = backend.world_size() as f32;
    v.iter_mut().for_each(|x| *x /= w);
    Ok(())
}

/// Reduces one f32 bucket (`data`, laid out as `pieces`) with rank-`r`
/// PowerSGD: afterwards `data` holds the (approximate) average.
pub(crate) async fn reduce<B: Backend + ?Sized>(
    backend: &B,
    opts: &CallOptions,
    r: usize,
    state: &mut State,
    pieces: &[Piece],
    data: &mut [f32],
) -> Result<(), CommError> {
    let r = r.max(1);
    let (small, big): (Vec<&Piece>, Vec<&Piece>) = pieces.iter().partition(|p| !compresses(p, r));
    // Uncompressed: one all-reduce of their concatenation.
    let mut flat: Vec<f32> = small
        .iter()
        .flat_map(|p| data[p.offset..p.offset + p.rows * p.cols].iter().copied())
        .collect();
    average(backend, &mut flat, opts).await?;
    let mut at = 0;
    for p in &small {
        let n = p.rows * p.cols;
        data[p.offset..p.offset + n].copy_from_slice(&flat[at..at + n]);
        at += n;
    }
    if big.is_empty() {
        return Ok(());
    }
    // 1-2: error feedback, then P = M·Q for every matrix, averaged.
    let mut ps: Vec<f32> = Vec::new();
    for p in &big {
        let m = &mut data[p.offset..p.offset + p.rows * p.cols];
        if let Some(e) = state.err.get(&p.param) {
            for (x, e) in m.iter_mut().zip(e) {
                *x += e;
            }
        }
        let q = state
            .q
            .entry(p.param)
            .or_insert_with(|| initial_q(p.param, p.cols, r));
        for i in 0..p.rows {
            for j in 0..r {
                ps.push((0..p.cols).map(|k| m[i * p.cols + k] * q[k * r + j]).sum());
            }
        }
    }
    average(backend, &mut ps, opts).await?;
    // 3: orthonormalise each P, then Q = Mᵀ·P, averaged.
    let mut qs: Vec<f32> = Vec::new();
    let mut at = 0;
    for p in &big {
        let pm = &mut ps[at..at + p.rows * r];
        orthonormalise(pm, p.rows, r);
        let m = &data[p.offset..p.offset + p.rows * p.cols];
        for k in 0..p.cols {
            for j in 0..r {
                qs.push((0..p.rows).map(|i| m[i * p.cols + k] * pm[i * r + j]).sum());
            }
        }
        at += p.rows * r;
    }
    average(backend, &mut qs, opts).await?;
    // 4: M̂ = P·Qᵀ replaces the gradient; the rest is kept as error.
    let (mut pa, mut qa) = (0, 0);
    for p in &big {
        let pm = &ps[pa..pa + p.rows * r];
        let qm = &qs[qa..qa + p.cols * r];
        let m = &mut data[p.offset..p.offset + p.rows * p.cols];
        let mut err = vec![0f32; m.len()];
        for i in 0..p.rows {
            for k in 0..p.cols {
                let approx: f32 = (0..r).map(|j| pm[i * r + j] * qm[k * r + j]).sum();
                err[i * p.cols + k] = m[i * p.cols + k] - approx;
                m[i * p.cols + k] = approx;
            }
        }
        state.err.insert(p.param, err);
        state.q.insert(p.param, qm.to_vec());
        pa += p.rows * r;
        qa += p.cols * r;
    }
    Ok(())
}
