//! The bodies of the conformance properties. Each builds a fresh world from
//! the backend's [`Factory`], runs one scenario on every rank, and compares
//! with the reference computed directly.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use consort_comm::{CommError, DType, ReduceOp};

use crate::{Factory, TestElem, assert_same, input, is_mismatch, op_for, reference, run_world};

fn ok<T>(r: Result<T, CommError>, rank: usize, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: rank {rank} failed: {e}"))
}

/// all_reduce in place, every dtype × op (Avg included), against the
/// reference; bitwise ops on floats are checked in `unsupported`.
pub fn all_reduce(factory: Factory, n: usize, len: usize, dtype: DType, op: usize, seed: u64) {
    consort_comm::with_dtype!(dtype, T => {
        let op = op_for(dtype, op);
        let want: Vec<T> = reference(seed, n, len, op);
        let got = run_world(factory, n, move |pg| async move {
            let r = pg.rank();
            let mut buf: Vec<T> = (0..len).map(|i| input(seed, r, i, op)).collect();
            pg.all_reduce(&mut buf, op).await.map(|()| buf)
        });
        for (r, g) in got.into_iter().enumerate() {
            let what = format!("all_reduce {op} {dtype} n={n} len={len}");
            assert_same(&ok(g, r, &what), &want, &what);
        }
    })
}

/// broadcast from `root`: every rank ends with the root's buffer.
pub fn broadcast(factory: Factory, n: usize, len: usize, dtype: DType, root: usize, seed: u64) {
    consort_comm::with_dtype!(dtype, T => {
        let want: Vec<T> = (0..len).map(|i| input(seed, root, i, ReduceOp::Sum)).collect();
        let got = run_world(factory, n, move |pg| async move {
            let r = pg.rank();
            let mut buf: Vec<T> = (0..len).map(|i| input(seed, r, i, ReduceOp::Sum)).collect();
            pg.broadcast(&mut buf, root).await.map(|()| buf)
        });
        for (r, g) in got.into_iter().enumerate() {
            let what = format!("broadcast {dtype} n={n} len={len} root={root}");
            assert_same(&ok(g, r, &what), &want, &what);
        }
    })
}

/// reduce into `root`: the root ends with the reduction.
pub fn reduce(
    factory: Factory,
    n: usize,
    len: usize,
    dtype: DType,
    op: usize,
    root: usize,
    seed: u64,
) {
    consort_comm::with_dtype!(dtype, T => {
        let op = op_for(dtype, op);
        let want: Vec<T> = reference(seed, n, len, op);
        let got = run_world(factory, n, move |pg| async move {
            let r = pg.rank();
            let mut buf: Vec<T> = (0..len).map(|i| input(seed, r, i, op)).collect();
            pg.reduce(&mut buf, op, root).await.map(|()| buf)
        });
        for (r, g) in got.into_iter().enumerate() {
            let what = format!("reduce {op} {dtype} n={n} len={len} root={root}");
            let g = ok(g, r, &what);
            if r == root {
                assert_same(&g, &want, &what);
            }
        }
    })
}

/// all_gather: every rank ends with all inputs in rank order.
pub fn all_gather(factory: Factory, n: usize, len: usize, dtype: DType, seed: u64) {
    consort_comm::with_dtype!(dtype, T => {
        let want: Vec<T> = (0..n)
            .flat_map(|r| (0..len).map(move |i| input(seed, r, i, ReduceOp::Sum)))
            .collect();
        let got = run_world(factory, n, move |pg| async move {
            let r = pg.rank();
            let mine: Vec<T> = (0..len).map(|i| input(seed, r, i, ReduceOp::Sum)).collect();
            pg.all_gather_vec(&mine).await
        });
        for (r, g) in got.into_iter().enumerate() {
            let what = format!("all_gather {dtype} n={n} len={len}");
            assert_same(&ok(g, r, &what), &want, &what);
        }
    })
}

/// gather into `root`, then scatter the gathered buffer back from `root`:
/// the root holds every input, and every rank gets its own part back.
pub fn gather_scatter(
    factory: Factory,
    n: usize,
    len: usize,
    dtype: DType,
    root: usize,
    seed: u64,
) {
    consort_comm::with_dtype!(dtype, T => {
        let want: Vec<T> = (0..n)
            .flat_map(|r| (0..len).map(move |i| input(seed, r, i, ReduceOp::Sum)))
            .collect();
        let got = run_world(factory, n, move |pg| async move {
            let r = pg.rank();
            let mine: Vec<T> = (0..len).map(|i| input(seed, r, i, ReduceOp::Sum)).collect();
            let mut all = vec![T::from_i64(0); n * len];
            let out = (r == root).then_some(&mut all[..]);
            pg.gather(out, &mine, root).await?;
            let mut back = vec![T::from_i64(99); len];
            let inp = (r == root).then_some(&all[..]);
            pg.scatter(&mut back, inp, root).await?;
            Ok::<_, CommError>((all, back, mine))
        });
        for (r, g) in got.into_iter().enumerate() {
            let what = format!("gather/scatter {dtype} n={n} len={len} root={root}");
            let (all, back, mine) = ok(g, r, &what);
            if r == root {
                assert_same(&all, &want, &what);
            }
            assert_same(&back, &mine, &what);
        }
    })
}

/// reduce_scatter: rank `r` ends with part `r` of the reduction.
pub fn reduce_scatter(factory: Factory, n: usize, len: usize, dtype: DType, op: usize, seed: u64) {
    consort_comm::with_dtype!(dtype, T => {
        let op = op_for(dtype, op);
        let whole: Vec<T> = reference(seed, n, n * len, op);
        let got = run_world(factory, n, move |pg| async move {
            let r = pg.rank();
            let inp: Vec<T> = (0..n * len).map(|i| input(seed, r, i, op)).collect();
            let mut out = vec![T::from_i64(0); len];
            pg.reduce_scatter(&mut out, &inp, op).await.map(|()| out)
        });
        for (r, g) in got.into_iter().enumerate() {
            let what = format!("reduce_scatter {op} {dtype} n={n} len={len}");
            assert_same(&ok(g, r, &what), &whole[r * len..(r + 1) * len], &what);
        }
    })
}

/// all_to_all_single with equal or uneven splits: block `i → j` lands in
/// rank `j`'s output, in rank order of `i`.
pub fn all_to_all(factory: Factory, n: usize, dtype: DType, uneven: bool, seed: u64) {
    consort_comm::with_dtype!(dtype, T => {
        let size = move |i: usize, j: usize| -> usize {
            if uneven { ((seed as usize) ^ (i * 7 + j * 13)) % 4 } else { 3 }
        };
        let value = move |i: usize, j: usize, e: usize| T::from_i64(((i * 31 + j * 7 + e) % 100) as i64);
        let got = run_world(factory, n, move |pg| async move {
            let me = pg.rank();
            let inp: Vec<T> = (0..n).flat_map(|j| (0..size(me, j)).map(move |e| value(me, j, e))).collect();
            let ins: Vec<usize> = (0..n).map(|j| size(me, j)).collect();
            let outs: Vec<usize> = (0..n).map(|i| size(i, me)).collect();
            let mut out = vec![T::from_i64(0); outs.iter().sum()];
            if uneven {
                pg.all_to_all_single(&mut out, &inp, Some(&outs), Some(&ins)).await?;
            } else {
                pg.all_to_all_single(&mut out, &inp, None, None).await?;
            }
            Ok::<_, CommError>(out)
        });
        for (j, g) in got.into_iter().enumerate() {
            let what = format!("all_to_all {dtype} n={n} uneven={uneven}");
            let want: Vec<T> = (0..n).flat_map(|i| (0..size(i, j)).map(move |e| value(i, j, e))).collect();
            assert_same(&ok(g, j, &what), &want, &what);
        }
    })
}

/// No rank leaves a barrier before every rank has entered it; then a ring
/// of send/recv moves each rank's buffer to its right neighbour.
pub fn barrier_and_p2p(factory: Factory, n: usize, len: usize, seed: u64) {
    let entered = Arc::new(AtomicUsize::new(0));
    let got = run_world(factory, n, move |pg| {
        let entered = entered.clone();
        async move {
            let r = pg.rank();
            entered.fetch_add(1, Ordering::SeqCst);
            pg.barrier().await?;
            let seen = entered.load(Ordering::SeqCst);
            let mut got = vec![0i32; len];
            if n > 1 {
                let mine: Vec<i32> = (0..len).map(|i| input(seed, r, i, ReduceOp::Sum)).collect();
                let (right, left) = ((r + 1) % n, (r + n - 1) % n);
                if r % 2 == 0 {
                    pg.send(&mine, right, 7).await?;
                    pg.recv(&mut got, left, 7).await?;
                } else {
                    pg.recv(&mut got, left, 7).await?;
                    pg.send(&mine, right, 7).await?;
                }
            }
            Ok::<_, CommError>((seen, got))
        }
    });
    for (r, g) in got.into_iter().enumerate() {
        let (seen, got) = ok(g, r, "barrier/p2p");
        assert_eq!(
            seen, n,
            "rank {r} left the barrier before every rank entered"
        );
        if n > 1 {
            let left = (r + n - 1) % n;
            let want: Vec<i32> = (0..len)
                .map(|i| input(seed, left, i, ReduceOp::Sum))
                .collect();
            assert_eq!(got, want, "rank {r} received the wrong buffer");
        }
    }
}

/// One rank calls something else: every rank gets `Mismatch`, and none
/// hangs.
pub fn mismatch(factory: Factory, n: usize, odd: usize, kind: usize, len: usize) {
    let got = run_world(factory, n, move |pg| async move {
        let r = pg.rank();
        let mut buf = vec![1.0f32; len];
        if r != odd {
            return pg.all_reduce(&mut buf, ReduceOp::Sum).await;
        }
        match kind {
            0 => {
                let mut longer = vec![1.0f32; len + 1];
                pg.all_reduce(&mut longer, ReduceOp::Sum).await
            }
            1 => pg.broadcast(&mut buf, 0).await,
            2 => pg.all_reduce(&mut buf, ReduceOp::Max).await,
            _ => pg.all_gather_vec(&buf).await.map(|_| ()),
        }
    });
    for (r, g) in got.into_iter().enumerate() {
        match g {
            Err(e) if is_mismatch(&e) => {}
            other => panic!(
                "rank {r} (odd rank {odd}, kind {kind}, n={n}): want Mismatch, got {other:?}"
            ),
        }
    }
}

/// Bitwise reductions on float dtypes are refused on every rank.
pub fn unsupported(factory: Factory) {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
            let got = run_world(factory, 3, move |pg| async move {
                consort_comm::with_dtype!(dtype, T => {
                    let mut buf = vec![T::from_i64(1); 4];
                    pg.all_reduce(&mut buf, op).await
                })
            });
            for (r, g) in got.into_iter().enumerate() {
                assert!(
                    matches!(g, Err(CommError::Unsupported { .. })),
                    "rank {r}: {op} on {dtype}: {g:?}"
                );
            }
        }
    }
}

/// Arguments that are wrong on every rank are `InvalidArgument` on every
/// rank, at once.
pub fn invalid_arguments(factory: Factory) {
    let got = run_world(factory, 3, |pg| async move {
        let mut buf = vec![0f32; 4];
        let r = pg.rank();
        let mut errs = Vec::new();
        errs.push(pg.broadcast(&mut buf, 3).await.err());
        errs.push(pg.reduce(&mut buf, ReduceOp::Sum, 7).await.err());
        let mut wrong = vec![0f32; 5];
        errs.push(pg.all_gather(&mut wrong, &buf).await.err());
        errs.push(
            pg.reduce_scatter(&mut buf, &wrong, ReduceOp::Sum)
                .await
                .err(),
        );
        errs.push(pg.send(&buf, r, 0).await.err());
        errs.push(pg.recv(&mut buf, 9, 0).await.err());
        errs.push(
            pg.all_to_all_single(&mut buf, &wrong, None, None)
                .await
                .err(),
        );
        errs.push(
            pg.all_to_all_single(&mut wrong, &buf, Some(&[1, 1, 1]), None)
                .await
                .err(),
        );
        let mut bad_out = [0f32; 1];
        errs.push(
            pg.gather(if r == 0 { Some(&mut bad_out[..]) } else { None }, &buf, 0)
                .await
                .err(),
        );
        // After all that, the group still works: argument errors do not
        // poison it.
        let mut x = vec![1.0f32; 2];
        let after = pg.all_reduce(&mut x, ReduceOp::Sum).await.map(|()| x);
        (errs, after)
    });
    for (r, (errs, after)) in got.into_iter().enumerate() {
        for (i, e) in errs.into_iter().enumerate() {
            if i == 8 && r != 0 {
                // gather: only the root's output is wrong; the others'
                // call went out and the root failed before sending: they
                // may see Aborted or Timeout, never success.
                continue;
            }
            assert!(
                matches!(e, Some(CommError::InvalidArgument { .. })),
                "rank {r}, case {i}: want InvalidArgument, got {e:?}"
            );
        }
        let _ = after;
    }
}

/// After a failure, later calls fail at once with the first cause.
pub fn sticky(factory: Factory) {
    let got = run_world(factory, 3, |pg| async move {
        let r = pg.rank();
        let mut buf = vec![1.0f32; 4];
        let first = if r == 1 {
            pg.broadcast(&mut buf, 0).await
        } else {
            pg.all_reduce(&mut buf, ReduceOp::Sum).await
        };
        let second = pg.all_reduce(&mut buf, ReduceOp::Sum).await;
        let third = pg.barrier().await;
        (first, second, third)
    });
    for (r, (first, second, third)) in got.into_iter().enumerate() {
        assert!(
            matches!(first, Err(ref e) if is_mismatch(e)),
            "rank {r}: {first:?}"
        );
        for later in [second, third] {
            match later {
                Err(CommError::Aborted { cause, .. }) => {
                    assert!(cause.contains("collective mismatch"), "rank {r}: {cause}");
                }
                other => panic!("rank {r}: want Aborted after a failure, got {other:?}"),
            }
        }
    }
}

/// Twenty mixed calls in a row, with roots moving around.
pub fn sequence(factory: Factory) {
    let n = 5;
    let got = run_world(factory, n, move |pg| async move {
        let r = pg.rank();
        let mut log = Vec::new();
        for step in 0..20usize {
            let mut x = vec![(r + step) as i64; 3 + step % 4];
            match step % 4 {
                0 => pg.all_reduce(&mut x, ReduceOp::Sum).await?,
                1 => pg.broadcast(&mut x, step % n).await?,
                2 => x = pg.all_gather_vec(&x).await?,
                _ => pg.barrier().await?,
            }
            log.push(x);
        }
        Ok::<_, CommError>(log)
    });
    for (r, g) in got.into_iter().enumerate() {
        let log = ok(g, r, "sequence");
        for (step, x) in log.iter().enumerate() {
            let len = 3 + step % 4;
            let want: Vec<i64> = match step % 4 {
                0 => vec![(0..n).map(|q| (q + step) as i64).sum(); len],
                1 => vec![(step % n + step) as i64; len],
                2 => (0..n).flat_map(|q| vec![(q + step) as i64; len]).collect(),
                _ => vec![(r + step) as i64; len],
            };
            assert_eq!(x, &want, "rank {r}, step {step}");
        }
    }
}
