//! The bodies of the conformance properties.
//!
//! Each check is a rank-local async function (`*_rank`) that runs one
//! scenario on one rank and verifies that rank's result against the
//! reference, which every rank can compute on its own. The in-process
//! runners build a world from the backend's [`Factory`] and run the rank
//! function everywhere; multi-process tests run the same functions, one
//! rank per OS process ([`battery`]).

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use consort_comm::{CommError, DType, ProcessGroup, ReduceOp};

use crate::{
    Factory, TestElem, assert_same_result, check_reduced, input, is_mismatch, op_for, run_world,
};

/// What a rank-local check returns: `Err` says what was wrong.
pub type Outcome = Result<(), String>;

fn failed<T>(r: Result<T, CommError>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// Runs `f` on every rank of a world from `factory` and panics with every
/// rank's failure.
pub(crate) fn everywhere<F, Fut>(factory: Factory, n: usize, f: F)
where
    F: Fn(ProcessGroup) -> Fut,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    let errs: Vec<String> = run_world(factory, n, f)
        .into_iter()
        .enumerate()
        .filter_map(|(r, o)| o.err().map(|e| format!("rank {r}: {e}")))
        .collect();
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}

/// all_reduce in place on this rank, checked against the reference.
pub async fn all_reduce_rank(
    pg: ProcessGroup,
    len: usize,
    dtype: DType,
    op: usize,
    seed: u64,
) -> Outcome {
    let n = pg.world_size();
    consort_comm::with_dtype!(dtype, T => {
        let op = op_for(dtype, op);
        let what = format!("all_reduce {op} {dtype} n={n} len={len}");
        let r = pg.rank();
        let mut buf: Vec<T> = (0..len).map(|i| input(seed, r, i, op)).collect();
        failed(pg.all_reduce(&mut buf, op).await, &what)?;
        check_reduced(&buf, seed, n, 0, op, &what)
    })
}

/// broadcast from `root`: this rank ends with the root's buffer.
pub async fn broadcast_rank(
    pg: ProcessGroup,
    len: usize,
    dtype: DType,
    root: usize,
    seed: u64,
) -> Outcome {
    let n = pg.world_size();
    consort_comm::with_dtype!(dtype, T => {
        let what = format!("broadcast {dtype} n={n} len={len} root={root}");
        let r = pg.rank();
        let mut buf: Vec<T> = (0..len).map(|i| input(seed, r, i, ReduceOp::Sum)).collect();
        failed(pg.broadcast(&mut buf, root).await, &what)?;
        let want: Vec<T> = (0..len).map(|i| input(seed, root, i, ReduceOp::Sum)).collect();
        assert_same_result(&buf, &want, &what)
    })
}

/// reduce into `root`: the root ends with the reduction.
pub async fn reduce_rank(
    pg: ProcessGroup,
    len: usize,
    dtype: DType,
    op: usize,
    root: usize,
    seed: u64,
) -> Outcome {
    let n = pg.world_size();
    consort_comm::with_dtype!(dtype, T => {
        let op = op_for(dtype, op);
        let what = format!("reduce {op} {dtype} n={n} len={len} root={root}");
        let r = pg.rank();
        let mut buf: Vec<T> = (0..len).map(|i| input(seed, r, i, op)).collect();
        failed(pg.reduce(&mut buf, op, root).await, &what)?;
        if r == root {
            check_reduced(&buf, seed, n, 0, op, &what)?;
        }
        Ok(())
    })
}

/// all_gather: this rank ends with every input in rank order.
pub async fn all_gather_rank(pg: ProcessGroup, len: usize, dtype: DType, seed: u64) -> Outcome {
    let n = pg.world_size();
    consort_comm::with_dtype!(dtype, T => {
        let what = format!("all_gather {dtype} n={n} len={len}");
        let mine: Vec<T> = (0..len).map(|i| input(seed, pg.rank(), i, ReduceOp::Sum)).collect();
        let got = failed(pg.all_gather_vec(&mine).await, &what)?;
        let want: Vec<T> = (0..n).flat_map(|r| (0..len).map(move |i| input(seed, r, i, ReduceOp::Sum))).collect();
        assert_same_result(&got, &want, &what)
    })
}

/// gather into `root`, then scatter it back.
pub async fn gather_scatter_rank(
    pg: ProcessGroup,
    len: usize,
    dtype: DType,
    root: usize,
    seed: u64,
) -> Outcome {
    let n = pg.world_size();
    consort_comm::with_dtype!(dtype, T => {
        let what = format!("gather/scatter {dtype} n={n} len={len} root={root}");
        let r = pg.rank();
        let mine: Vec<T> = (0..len).map(|i| input(seed, r, i, ReduceOp::Sum)).collect();
        let mut all = vec![T::from_i64(0); n * len];
        failed(pg.gather((r == root).then_some(&mut all[..]), &mine, root).await, &what)?;
        if r == root {
            let want: Vec<T> = (0..n).flat_map(|q| (0..len).map(move |i| input(seed, q, i, ReduceOp::Sum))).collect();
            assert_same_result(&all, &want, &what)?;
        }
        let mut back = vec![T::from_i64(99); len];
        failed(pg.scatter(&mut back, (r == root).then_some(&all[..]), root).await, &what)?;
        assert_same_result(&back, &mine, &what)
    })
}

/// reduce_scatter: this rank ends with its part of the reduction.
pub async fn reduce_scatter_rank(
    pg: ProcessGroup,
    len: usize,
    dtype: DType,
    op: usize,
    seed: u64,
) -> Outcome {
    let n = pg.world_size();
    consort_comm::with_dtype!(dtype, T => {
        let op = op_for(dtype, op);
        let what = format!("reduce_scatter {op} {dtype} n={n} len={len}");
        let r = pg.rank();
        let inp: Vec<T> = (0..n * len).map(|i| input(seed, r, i, op)).collect();
        let mut out = vec![T::from_i64(0); len];
        failed(pg.reduce_scatter(&mut out, &inp, op).await, &what)?;
        check_reduced(&out, seed, n, r * len, op, &what)
    })
}

/// all_to_all_single with equal or uneven splits.
pub async fn all_to_all_rank(pg: ProcessGroup, dtype: DType, uneven: bool, seed: u64) -> Outcome {
    let n = pg.world_size();
    consort_comm::with_dtype!(dtype, T => {
        let what = format!("all_to_all {dtype} n={n} uneven={uneven}");
        let size = move |i: usize, j: usize| -> usize {
            if uneven { ((seed as usize) ^ (i * 7 + j * 13)) % 4 } else { 3 }
        };
        let value = move |i: usize, j: usize, e: usize| T::from_i64(((i * 31 + j * 7 + e) % 100) as i64);
        let me = pg.rank();
        let inp: Vec<T> = (0..n).flat_map(|j| (0..size(me, j)).map(move |e| value(me, j, e))).collect();
        let ins: Vec<usize> = (0..n).map(|j| size(me, j)).collect();
        let outs: Vec<usize> = (0..n).map(|i| size(i, me)).collect();
        let mut out = vec![T::from_i64(0); outs.iter().sum()];
        let r = if uneven {
            pg.all_to_all_single(&mut out, &inp, Some(&outs), Some(&ins)).await
        } else {
            pg.all_to_all_single(&mut out, &inp, None, None).await
        };
        failed(r, &what)?;
        let want: Vec<T> = (0..n).flat_map(|i| (0..size(i, me)).map(move |e| value(i, me, e))).collect();
        assert_same_result(&out, &want, &what)
    })
}

/// A barrier, then a ring of send/recv moving each rank's buffer right.
pub async fn p2p_rank(pg: ProcessGroup, len: usize, seed: u64) -> Outcome {
    let (r, n) = (pg.rank(), pg.world_size());
    failed(pg.barrier().await, "barrier")?;
    if n == 1 {
        return Ok(());
    }
    let mine: Vec<i32> = (0..len).map(|i| input(seed, r, i, ReduceOp::Sum)).collect();
    let mut got = vec![0i32; len];
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    if r % 2 == 0 {
        failed(pg.send(&mine, right, 7).await, "send")?;
        failed(pg.recv(&mut got, left, 7).await, "recv")?;
    } else {
        failed(pg.recv(&mut got, left, 7).await, "recv")?;
        failed(pg.send(&mine, right, 7).await, "send")?;
    }
    let want: Vec<i32> = (0..len)
        .map(|i| input(seed, left, i, ReduceOp::Sum))
        .collect();
    if got == want {
        Ok(())
    } else {
        Err(format!("recv from rank {left}: got {got:?}, want {want:?}"))
    }
}

/// Rank `odd` calls something else; this rank must get `Mismatch`.
pub async fn mismatch_rank(pg: ProcessGroup, odd: usize, kind: usize, len: usize) -> Outcome {
    let r = pg.rank();
    let mut buf = vec![1.0f32; len];
    let res = if r != odd {
        pg.all_reduce(&mut buf, ReduceOp::Sum).await
    } else {
        match kind {
            0 => {
                let mut longer = vec![1.0f32; len + 1];
                pg.all_reduce(&mut longer, ReduceOp::Sum).await
            }
            1 => pg.broadcast(&mut buf, 0).await,
            2 => pg.all_reduce(&mut buf, ReduceOp::Max).await,
            _ => pg.all_gather_vec(&buf).await.map(|_| ()),
        }
    };
    match res {
        Err(e) if is_mismatch(&e) => Ok(()),
        other => Err(format!(
            "odd rank {odd}, kind {kind}: want Mismatch, got {other:?}"
        )),
    }
}

/// all_reduce in place, every dtype × op, against the reference.
pub fn all_reduce(factory: Factory, n: usize, len: usize, dtype: DType, op: usize, seed: u64) {
    everywhere(factory, n, move |pg| {
        all_reduce_rank(pg, len, dtype, op, seed)
    });
}

/// broadcast from `root`.
pub fn broadcast(factory: Factory, n: usize, len: usize, dtype: DType, root: usize, seed: u64) {
    everywhere(factory, n, move |pg| {
        broadcast_rank(pg, len, dtype, root, seed)
    });
}

/// reduce into `root`.
pub fn reduce(
    factory: Factory,
    n: usize,
    len: usize,
    dtype: DType,
    op: usize,
    root: usize,
    seed: u64,
) {
    everywhere(factory, n, move |pg| {
        reduce_rank(pg, len, dtype, op, root, seed)
    });
}

/// all_gather.
pub fn all_gather(factory: Factory, n: usize, len: usize, dtype: DType, seed: u64) {
    everywhere(factory, n, move |pg| all_gather_rank(pg, len, dtype, seed));
}

/// gather then scatter.
pub fn gather_scatter(
    factory: Factory,
    n: usize,
    len: usize,
    dtype: DType,
    root: usize,
    seed: u64,
) {
    everywhere(factory, n, move |pg| {
        gather_scatter_rank(pg, len, dtype, root, seed)
    });
}

/// reduce_scatter.
pub fn reduce_scatter(factory: Factory, n: usize, len: usize, dtype: DType, op: usize, seed: u64) {
    everywhere(factory, n, move |pg| {
        reduce_scatter_rank(pg, len, dtype, op, seed)
    });
}

/// all_to_all_single, equal or uneven.
pub fn all_to_all(factory: Factory, n: usize, dtype: DType, uneven: bool, seed: u64) {
    everywhere(factory, n, move |pg| {
        all_to_all_rank(pg, dtype, uneven, seed)
    });
}

/// No rank leaves a barrier before every rank entered (checked with a
/// counter shared in this process), then the send/recv ring.
pub fn barrier_and_p2p(factory: Factory, n: usize, len: usize, seed: u64) {
    let entered = Arc::new(AtomicUsize::new(0));
    everywhere(factory, n, move |pg| {
        let entered = entered.clone();
        async move {
            entered.fetch_add(1, Ordering::SeqCst);
            failed(pg.barrier().await, "barrier")?;
            let seen = entered.load(Ordering::SeqCst);
            if seen != n {
                return Err(format!(
                    "left the barrier after {seen} of {n} ranks entered"
                ));
            }
            p2p_rank(pg, len, seed).await
        }
    });
}

/// Every rank gets `Mismatch` when one rank calls something else.
pub fn mismatch(factory: Factory, n: usize, odd: usize, kind: usize, len: usize) {
    everywhere(factory, n, move |pg| mismatch_rank(pg, odd, kind, len));
}

/// Bitwise reductions on float dtypes are refused on every rank.
pub fn unsupported(factory: Factory) {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
            everywhere(factory, 3, move |pg| async move {
                consort_comm::with_dtype!(dtype, T => {
                    let mut buf = vec![T::from_i64(1); 4];
                    match pg.all_reduce(&mut buf, op).await {
                        Err(CommError::Unsupported { .. }) => Ok(()),
                        other => Err(format!("{op} on {dtype}: want Unsupported, got {other:?}")),
                    }
                })
            });
        }
    }
}

/// Arguments that are wrong on every rank are `InvalidArgument` on every
/// rank, at once, and do not poison the group.
pub fn invalid_arguments(factory: Factory) {
    everywhere(factory, 3, |pg| async move {
        let mut buf = vec![0f32; 4];
        let r = pg.rank();
        let mut wrong = vec![0f32; 5];
        let mut bad_out = [0f32; 1];
        let errs = vec![
            pg.broadcast(&mut buf, 3).await.err(),
            pg.reduce(&mut buf, ReduceOp::Sum, 7).await.err(),
            pg.all_gather(&mut wrong, &buf).await.err(),
            pg.reduce_scatter(&mut buf, &wrong, ReduceOp::Sum)
                .await
                .err(),
            pg.send(&buf, r, 0).await.err(),
            pg.recv(&mut buf, 9, 0).await.err(),
            pg.all_to_all_single(&mut buf, &wrong, None, None)
                .await
                .err(),
            pg.all_to_all_single(&mut wrong, &buf, Some(&[1, 1, 1]), None)
                .await
                .err(),
        ];
        for (i, e) in errs.into_iter().enumerate() {
            if !matches!(e, Some(CommError::InvalidArgument { .. })) {
                return Err(format!("case {i}: want InvalidArgument, got {e:?}"));
            }
        }
        if r == 0 {
            let e = pg.gather(Some(&mut bad_out[..]), &buf, 0).await.err();
            if !matches!(e, Some(CommError::InvalidArgument { .. })) {
                return Err(format!("gather with a short output: {e:?}"));
            }
        }
        Ok(())
    });
}

/// After a failure, later calls fail at once with the first cause.
pub fn sticky(factory: Factory) {
    everywhere(factory, 3, |pg| async move {
        let r = pg.rank();
        let mut buf = vec![1.0f32; 4];
        let first = if r == 1 {
            pg.broadcast(&mut buf, 0).await
        } else {
            pg.all_reduce(&mut buf, ReduceOp::Sum).await
        };
        if !matches!(first, Err(ref e) if is_mismatch(e)) {
            return Err(format!("first call: want Mismatch, got {first:?}"));
        }
        for later in [
            pg.all_reduce(&mut buf, ReduceOp::Sum).await,
            pg.barrier().await,
        ] {
            match later {
                Err(CommError::Aborted { cause, .. }) if cause.contains("collective mismatch") => {}
                other => return Err(format!("want Aborted naming the mismatch, got {other:?}")),
            }
        }
        Ok(())
    });
}

/// Twenty mixed calls in a row, with roots moving around.
pub async fn sequence_rank(pg: ProcessGroup) -> Outcome {
    let (r, n) = (pg.rank(), pg.world_size());
    for step in 0..20usize {
        let len = 3 + step % 4;
        let mut x = vec![(r + step) as i64; len];
        let want: Vec<i64> = match step % 4 {
            0 => {
                failed(pg.all_reduce(&mut x, ReduceOp::Sum).await, "all_reduce")?;
                vec![(0..n).map(|q| (q + step) as i64).sum(); len]
            }
            1 => {
                failed(pg.broadcast(&mut x, step % n).await, "broadcast")?;
                vec![(step % n + step) as i64; len]
            }
            2 => {
                x = failed(pg.all_gather_vec(&x).await, "all_gather")?;
                (0..n).flat_map(|q| vec![(q + step) as i64; len]).collect()
            }
            _ => {
                failed(pg.barrier().await, "barrier")?;
                vec![(r + step) as i64; len]
            }
        };
        if x != want {
            return Err(format!("step {step}: got {x:?}, want {want:?}"));
        }
    }
    Ok(())
}

/// Twenty mixed calls in a row.
pub fn sequence(factory: Factory) {
    everywhere(factory, 5, sequence_rank);
}

/// A per-call timeout of `Duration::MAX` ("wait for ever") is clamped, not
/// an `Instant` overflow: the call completes normally.
pub async fn endless_timeout_rank(pg: ProcessGroup) -> Outcome {
    let n = pg.world_size();
    let opts = consort_comm::CallOptions::default().with_timeout(std::time::Duration::MAX);
    let mut x = vec![1i64; 5];
    failed(
        pg.backend()
            .all_reduce(
                consort_comm::BufferMut::from(&mut x[..]),
                ReduceOp::Sum,
                &opts,
            )
            .await,
        "all_reduce with timeout Duration::MAX",
    )?;
    if x != vec![n as i64; 5] {
        return Err(format!("got {x:?}, want [{n}; 5]"));
    }
    failed(
        pg.backend().barrier(&opts).await,
        "barrier with timeout Duration::MAX",
    )
}

/// [`endless_timeout_rank`] on every rank of a world of 3.
pub fn endless_timeout(factory: Factory) {
    everywhere(factory, 3, endless_timeout_rank);
}

/// An object per rank: a name, a list whose length depends on the rank
/// (so encoded sizes differ and padding matters), and a nested value.
fn object_of(r: usize, seed: u64) -> (String, Vec<u64>, Option<(i32, bool)>) {
    (
        format!("rank-{r}-{}", "x".repeat(r * 7 % 13)),
        (0..(r as u64 * 3 + seed % 5)).collect(),
        r.is_multiple_of(2)
            .then_some((-(r as i32), r.is_multiple_of(3))),
    )
}

/// The object collectives, uneven and list `all_gather`, and a monitored
/// barrier that everyone reaches, on this rank.
pub async fn objects_rank(pg: ProcessGroup, root: usize, seed: u64) -> Outcome {
    let (r, n) = (pg.rank(), pg.world_size());
    let mine = object_of(r, seed);
    let every: Vec<_> = (0..n).map(|q| object_of(q, seed)).collect();
    let got = failed(pg.all_gather_object(&mine).await, "all_gather_object")?;
    if got != every {
        return Err(format!("all_gather_object: {got:?}, want {every:?}"));
    }
    let b = failed(
        pg.broadcast_object((r == root).then_some(&mine), root)
            .await,
        "broadcast_object",
    )?;
    if b != every[root] {
        return Err(format!("broadcast_object: {b:?}, want {:?}", every[root]));
    }
    let g = failed(pg.gather_object(&mine, root).await, "gather_object")?;
    if g != (r == root).then(|| every.clone()) {
        return Err(format!("gather_object: {g:?}"));
    }
    let s = failed(
        pg.scatter_object((r == root).then_some(&every[..]), root)
            .await,
        "scatter_object",
    )?;
    if s != mine {
        return Err(format!("scatter_object: {s:?}, want {mine:?}"));
    }
    let counts: Vec<usize> = (0..n).map(|q| (q * 5 + (seed % 7) as usize) % 7).collect();
    let part: Vec<i32> = (0..counts[r])
        .map(|i| (r as i32) * 100 + i as i32)
        .collect();
    let parts = failed(pg.all_gather_v(&part, &counts).await, "all_gather_v")?;
    for (q, p) in parts.iter().enumerate() {
        let want: Vec<i32> = (0..counts[q])
            .map(|i| (q as i32) * 100 + i as i32)
            .collect();
        if *p != want {
            return Err(format!("all_gather_v part {q}: {p:?}, want {want:?}"));
        }
    }
    let input = [r as u32; 3];
    let mut bufs = vec![[0u32; 3]; n];
    let mut views: Vec<&mut [u32]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    failed(
        pg.all_gather_into(&mut views, &input).await,
        "all_gather_into",
    )?;
    if bufs.iter().enumerate().any(|(q, b)| *b != [q as u32; 3]) {
        return Err(format!("all_gather_into: {bufs:?}"));
    }
    failed(
        pg.monitored_barrier(std::time::Duration::from_secs(20))
            .await,
        "monitored_barrier",
    )
}

/// [`objects_rank`] on every rank of a world of `n`.
pub fn objects(factory: Factory, n: usize, root: usize, seed: u64) {
    everywhere(factory, n, move |pg| objects_rank(pg, root, seed));
}

/// One rank (the last) does not come to a monitored barrier: rank 0's
/// error names it, and no rank hangs.
pub fn monitored_barrier_names_the_missing_rank(factory: Factory, n: usize) {
    let out = run_world(factory, n, move |pg| async move {
        let r = pg.rank();
        if r == n - 1 {
            // Stays alive past the others' deadline, then leaves.
            tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
            return Ok(());
        }
        match pg
            .monitored_barrier(std::time::Duration::from_millis(300))
            .await
        {
            Ok(()) => Err(format!(
                "rank {r}: monitored_barrier passed without rank {}",
                n - 1
            )),
            Err(e) => {
                let m = e.to_string();
                let named =
                    m.contains(&format!("waiting for rank {}", n - 1)) && m.contains("barrier");
                if r == 0 && !named {
                    return Err(format!("rank 0 should name rank {}: {m}", n - 1));
                }
                Ok(())
            }
        }
    });
    let errs: Vec<String> = out.into_iter().filter_map(Result::err).collect();
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}

/// A fixed battery of rank-local checks over every op and dtype, for
/// multi-process runs: returns each scenario's name and outcome. Every rank
/// of the group must call it with the same seed.
pub async fn battery(pg: ProcessGroup, seed: u64) -> Vec<(String, Outcome)> {
    let n = pg.world_size();
    let mut out = Vec::new();
    let lens = [0usize, 1, n + 1, 1000, 70_000];
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let len = lens[i % lens.len()];
        for op in 0..8 {
            let s = seed ^ (i * 8 + op) as u64;
            // Every dtype meets every length across its ops (f32's all_reduce
            // used to see only the empty buffer).
            let len = lens[(i + op) % lens.len()];
            out.push((
                format!("all_reduce {dtype} op#{op} len {len}"),
                all_reduce_rank(pg.clone(), len, dtype, op, s).await,
            ));
        }
        let root = i % n;
        out.push((
            format!("broadcast {dtype}"),
            broadcast_rank(pg.clone(), len, dtype, root, seed).await,
        ));
        out.push((
            format!("reduce {dtype}"),
            reduce_rank(pg.clone(), len, dtype, i, root, seed).await,
        ));
        out.push((
            format!("all_gather {dtype}"),
            all_gather_rank(pg.clone(), len % 300, dtype, seed).await,
        ));
        out.push((
            format!("gather/scatter {dtype}"),
            gather_scatter_rank(pg.clone(), len % 300, dtype, root, seed).await,
        ));
        out.push((
            format!("reduce_scatter {dtype}"),
            reduce_scatter_rank(pg.clone(), len % 300, dtype, i, seed).await,
        ));
        out.push((
            format!("all_to_all {dtype}"),
            all_to_all_rank(pg.clone(), dtype, i % 2 == 0, seed).await,
        ));
    }
    out.push((
        "send/recv ring".into(),
        p2p_rank(pg.clone(), 5000, seed).await,
    ));
    out.push(("sequence".into(), sequence_rank(pg.clone()).await));
    if n > 1 {
        out.push((
            "mismatch".into(),
            mismatch_rank(pg.clone(), n - 1, 1, 10).await,
        ));
    }
    out
}
