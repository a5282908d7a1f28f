//! Conformance bodies for subgroups and several calls in flight: the
//! rank-local checks of [`crate::checks`], run on subgroups made with
//! torch's rules, next to their parent and to each other, and calls made
//! together and awaited in any order.

use consort_comm::{DType, GroupOptions, ProcessGroup, ReduceOp};

use crate::{
    Factory,
    checks::{
        Outcome, all_gather_rank, all_reduce_rank, broadcast_rank, everywhere, reduce_scatter_rank,
    },
    input, reference,
};

fn failed<T>(r: consort_comm::Result<T>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// The ranks of a world of `n` that `mask` picks (at least one).
pub fn members(n: usize, mask: u64) -> Vec<usize> {
    let m: Vec<usize> = (0..n).filter(|r| mask >> r & 1 == 1).collect();
    if m.is_empty() { vec![n - 1] } else { m }
}

/// One subgroup, picked by `mask` and listed in reverse (so sorting
/// matters), runs the collective checks; then the parent still works.
pub async fn subgroup_rank(
    pg: ProcessGroup,
    mask: u64,
    sort: bool,
    len: usize,
    dtype: DType,
    op: usize,
    seed: u64,
) -> Outcome {
    let n = pg.world_size();
    let mut list = members(n, mask);
    list.reverse();
    let opts = GroupOptions {
        sort_ranks: sort,
        ..Default::default()
    };
    let sub = failed(pg.new_group_with(&list, &opts).await, "new_group")?;
    let want_rank = if sort {
        let mut s = list.clone();
        s.sort_unstable();
        s.iter().position(|&r| r == pg.rank())
    } else {
        list.iter().position(|&r| r == pg.rank())
    };
    match (sub, want_rank) {
        (None, None) => {}
        (Some(sub), Some(want)) => {
            if sub.rank() != want || sub.world_size() != list.len() {
                return Err(format!(
                    "group {list:?} (sort {sort}): rank {} of {}, want {want} of {}",
                    sub.rank(),
                    sub.world_size(),
                    list.len()
                ));
            }
            all_reduce_rank(sub.clone(), len, dtype, op, seed).await?;
            broadcast_rank(sub.clone(), len, dtype, seed as usize % list.len(), seed).await?;
            all_gather_rank(sub.clone(), len % 20, dtype, seed).await?;
            reduce_scatter_rank(sub, len % 20, dtype, op, seed).await?;
        }
        (got, want) => {
            return Err(format!(
                "group {list:?}: member {} but got a group: {}",
                want.is_some(),
                got.is_some()
            ));
        }
    }
    all_reduce_rank(pg, len, dtype, op, seed ^ 1).await
}

/// [`subgroup_rank`] on every rank of a world of `n`.
#[allow(clippy::too_many_arguments)] // one per proptest dimension
pub fn subgroup(
    factory: Factory,
    n: usize,
    mask: u64,
    sort: bool,
    len: usize,
    dtype: DType,
    op: usize,
    seed: u64,
) {
    everywhere(factory, n, move |pg| {
        subgroup_rank(pg, mask, sort, len, dtype, op, seed)
    });
}

/// Two disjoint halves (`split_group`) all-reduce at the same time as a
/// world all-reduce made right after, all in flight together; every result
/// is the reference over its own group.
pub async fn halves_rank(pg: ProcessGroup, len: usize, seed: u64) -> Outcome {
    let n = pg.world_size();
    let r = pg.rank();
    let evens: Vec<usize> = (0..n).step_by(2).collect();
    let odds: Vec<usize> = (1..n).step_by(2).collect();
    let lists: Vec<Vec<usize>> = [evens, odds]
        .into_iter()
        .filter(|l| !l.is_empty())
        .collect();
    let half = failed(pg.split_group(&lists).await, "split_group")?
        .ok_or_else(|| format!("rank {r} is in no half"))?;
    let op = ReduceOp::Sum;
    let mut a: Vec<i64> = (0..len).map(|i| input(seed, half.rank(), i, op)).collect();
    let mut b: Vec<i64> = (0..len).map(|i| input(seed ^ 7, r, i, op)).collect();
    let wa = half.all_reduce(&mut a, op);
    let wb = pg.all_reduce(&mut b, op);
    // Awaited in the other order than made: the order is fixed when made.
    let (rb, ra) = tokio::join!(wb, wa);
    failed(ra, "half all_reduce")?;
    failed(rb, "world all_reduce")?;
    crate::assert_same_result(
        &a,
        &reference::<i64>(seed, half.world_size(), len, op),
        "half",
    )?;
    crate::assert_same_result(&b, &reference::<i64>(seed ^ 7, n, len, op), "world")
}

/// [`halves_rank`] on every rank of a world of `n`.
pub fn halves(factory: Factory, n: usize, len: usize, seed: u64) {
    everywhere(factory, n, move |pg| halves_rank(pg, len, seed));
}

/// `new_subgroups(size)` and `split(color, key)` give torch's groups.
pub async fn splits_rank(pg: ProcessGroup, size: usize) -> Outcome {
    let n = pg.world_size();
    let r = pg.rank();
    let (mine, all) = failed(pg.new_subgroups(size).await, "new_subgroups")?;
    if all.len() != n / size || mine.rank() != r % size || mine.world_size() != size {
        return Err(format!(
            "new_subgroups({size}): {all:?}, rank {}",
            mine.rank()
        ));
    }
    let mut x = [1u32];
    failed(
        mine.all_reduce(&mut x, ReduceOp::Sum).await,
        "block all_reduce",
    )?;
    if x[0] as usize != size {
        return Err(format!("block all_reduce gave {}", x[0]));
    }
    // Colour by parity, keyed backwards: group rank order is reversed.
    let color = (r % 3 != 2).then_some((r % 2) as u32);
    let g = failed(pg.split(color, -(r as i64)).await, "split")?;
    match (color, g) {
        (None, None) => Ok(()),
        (Some(c), Some(g)) => {
            let same: Vec<usize> = (0..n)
                .filter(|&q| q % 3 != 2 && q % 2 == c as usize)
                .collect();
            let want = same.iter().rev().position(|&q| q == r);
            if Some(g.rank()) != want || g.world_size() != same.len() {
                return Err(format!(
                    "split: rank {} of {}, want {want:?}",
                    g.rank(),
                    g.world_size()
                ));
            }
            let mut y = [r as u64];
            failed(
                g.all_reduce(&mut y, ReduceOp::Sum).await,
                "split all_reduce",
            )?;
            let sum: usize = same.iter().sum();
            (y[0] as usize == sum)
                .then_some(())
                .ok_or_else(|| format!("split sum {}", y[0]))
        }
        (c, g) => Err(format!("split: colour {c:?} but group {}", g.is_some())),
    }
}

/// [`splits_rank`] on every rank of a world of `n` (a multiple of `size`).
pub fn splits(factory: Factory, n: usize, size: usize) {
    everywhere(factory, n, move |pg| splits_rank(pg, size));
}

/// Bad rank lists are `InvalidArgument` on every rank, and ranks that pass
/// different lists all fail instead of hanging.
pub async fn bad_groups_rank(pg: ProcessGroup) -> Outcome {
    let n = pg.world_size();
    for bad in [vec![0, 0], vec![n], (0..=n).collect()] {
        match pg.new_group(&bad).await {
            Err(consort_comm::CommError::InvalidArgument { .. }) => {}
            other => return Err(format!("new_group({bad:?}): {other:?}")),
        }
    }
    let list = if pg.rank() == 0 { vec![0] } else { vec![0, 1] };
    match pg.new_group(&list).await {
        Err(e) if e.to_string().contains("other rank lists") => Ok(()),
        other => Err(format!("different lists: {other:?}")),
    }
}

/// [`bad_groups_rank`] on every rank of a world of 3.
pub fn bad_groups(factory: Factory) {
    everywhere(factory, 3, bad_groups_rank);
}

/// Several calls made before any is awaited, awaited in reverse: each
/// gets its own result.
pub async fn in_flight_rank(pg: ProcessGroup, len: usize, seed: u64) -> Outcome {
    let (n, r) = (pg.world_size(), pg.rank());
    let op = ReduceOp::Sum;
    let mut a: Vec<f64> = (0..len).map(|i| input(seed, r, i, op)).collect();
    let mut b: Vec<i32> = (0..len).map(|i| input(seed ^ 3, r, i, op)).collect();
    let mut c: Vec<u8> = vec![r as u8; len];
    let wa = pg.all_reduce(&mut a, op);
    let wb = pg.all_reduce(&mut b, op);
    let wc = pg.broadcast(&mut c, n - 1);
    failed(wc.await, "third call")?;
    failed(wb.await, "second call")?;
    failed(wa.await, "first call")?;
    crate::assert_same_result(&a, &reference::<f64>(seed, n, len, op), "first")?;
    crate::assert_same_result(&b, &reference::<i32>(seed ^ 3, n, len, op), "second")?;
    if c.iter().any(|&x| x as usize != n - 1) {
        return Err("third call: broadcast wrong".into());
    }
    // Each rank leaves at once, as a process that exits after its last
    // call: a slower peer still takes what this rank sent before it left.
    Ok(())
}

/// [`in_flight_rank`] on every rank of a world of `n`.
pub fn in_flight(factory: Factory, n: usize, len: usize, seed: u64) {
    everywhere(factory, n, move |pg| in_flight_rank(pg, len, seed));
}

/// Rank 0 makes a call and drops it unawaited: its group is aborted with
/// an error that says a call was cancelled, on rank 0 at once and on every
/// other rank in its call or its next one, instead of leaving anyone stuck.
/// A backend that launches a call when it is made (a device stream) may
/// instead have run it to the end, and then nothing is aborted. Returns
/// whether this rank saw the group aborted.
pub async fn cancelled_rank(pg: ProcessGroup) -> Result<bool, String> {
    let mut x = vec![1.0f32; 64];
    let opts =
        consort_comm::CallOptions::default().with_timeout(std::time::Duration::from_secs(20));
    let refused = |e: &consort_comm::CommError| {
        // Rank 0 may leave before its abort arrives.
        e.to_string().contains("cancelled")
            || matches!(e, consort_comm::CommError::PeerLost { peer: 0, .. })
    };
    let mut aborted = false;
    if pg.rank() == 0 {
        drop(pg.all_reduce_with(&mut x, ReduceOp::Sum, &opts));
    } else {
        match pg.all_reduce_with(&mut x, ReduceOp::Sum, &opts).await {
            Ok(()) => {}
            Err(e) if refused(&e) => aborted = true,
            Err(e) => return Err(format!("peer of a cancelled call: {e}")),
        }
    }
    match pg.barrier().await {
        Ok(()) => Ok(aborted),
        Err(e) if refused(&e) || aborted => Ok(true),
        Err(e) => Err(format!("the call after a cancelled one: {e}")),
    }
}

/// [`cancelled_rank`] on every rank of a world of `n`: either every rank
/// saw the group aborted, or (a call launched when made and run to the
/// end) none did; never a mix, a hang or a timeout.
pub fn cancelled(factory: Factory, n: usize) {
    let out = crate::run_world(factory, n, cancelled_rank);
    let errs: Vec<String> = out.iter().filter_map(|o| o.clone().err()).collect();
    assert!(errs.is_empty(), "{}", errs.join("\n"));
    let seen: Vec<bool> = out.into_iter().map(|o| o.unwrap_or(false)).collect();
    assert!(
        seen.iter().all(|&d| d) || seen.iter().all(|&d| !d),
        "a dropped call aborted the group on some ranks only: {seen:?}"
    );
}

/// f32s in the buffer a leaked call borrows: large enough to go in place
/// on every transport.
const LEAKED_LEN: usize = 1 << 18;

/// What the leaked call's buffer holds, and must still hold at the end.
const CANARY: f32 = -7.0;

/// Rank 0 polls an `all_reduce` until it is under way, then forgets it
/// (`mem::forget`, as safe code may) and gets its buffer back; the other
/// ranks then make the call and send their frames, and rank 0 makes
/// another call, which takes what its links hold. No background task and
/// no other call may write into the forgotten call's buffer: every byte is
/// still the canary. (After a leak the group may fail; that is allowed, a
/// hang or a write is not.)
pub async fn leaked_rank(pg: ProcessGroup, gate: std::sync::Arc<tokio::sync::Barrier>) -> Outcome {
    let opts = consort_comm::CallOptions::default().with_timeout(std::time::Duration::from_secs(2));
    if pg.rank() != 0 {
        gate.wait().await;
        let mut x = vec![1.0f32; LEAKED_LEN];
        // Fails: rank 0 never goes on with this call.
        let _ = pg.all_reduce_with(&mut x, ReduceOp::Sum, &opts).await;
        gate.wait().await;
        return Ok(());
    }
    let mut canary = vec![CANARY; LEAKED_LEN];
    let mut call = Box::pin(pg.all_reduce_with(&mut canary, ReduceOp::Sum, &opts));
    for _ in 0..5 {
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(call.as_mut().poll(cx)));
        if let std::task::Poll::Ready(out) = polled.await {
            return Err(format!("the call ended before its peers made it: {out:?}"));
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    std::mem::forget(call);
    gate.wait().await;
    let mut other = vec![0.0f32; 16];
    let _ = pg.all_reduce_with(&mut other, ReduceOp::Sum, &opts).await;
    gate.wait().await;
    let touched = canary.iter().filter(|&&x| x != CANARY).count();
    if touched > 0 {
        return Err(format!(
            "{touched} of {LEAKED_LEN} elements of a forgotten call's buffer were written after \
             the call was forgotten"
        ));
    }
    Ok(())
}

/// [`leaked_rank`] on a world of `n`.
pub fn leaked(factory: Factory, n: usize) {
    let gate = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let out = crate::run_world(factory, n, move |pg| leaked_rank(pg, gate.clone()));
    let errs: Vec<String> = out.into_iter().filter_map(|o| o.err()).collect();
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}
