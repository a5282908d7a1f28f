//! The algorithms whose lanes are listed up front: binomial trees,
//! halving-doubling, recursive doubling, the direct exchanges, pairwise
//! all_to_all and the dissemination barrier (each O(log world) or one
//! step), as actions on the ranges a call's buffers name.

use std::ops::Range;

use super::{Listed, copy, recv, send};
use crate::algo::{Action, Buf};
use crate::{CommError, Result};

/// Parent and children of virtual rank `vr` in a binomial tree of `n`
/// rooted at 0 (children largest subtree first).
fn binomial(vr: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let mut mask = 1usize;
    let mut parent = None;
    while mask < n {
        if vr & mask != 0 {
            parent = Some(vr - mask);
            break;
        }
        mask <<= 1;
    }
    let mut children = Vec::new();
    let mut m = mask >> 1;
    while m > 0 {
        if vr + m < n {
            children.push(vr + m);
        }
        m >>= 1;
    }
    (parent, children)
}

/// Binomial-tree broadcast of `seg` from `root`, data tag `tag`. With
/// `acks`, every child acknowledges to its parent (tag `u32::MAX`), so that
/// the root too receives a frame in the call (and checks its peers'
/// fingerprints). A child acknowledges as soon as it has the data, before
/// it forwards it: a parent then waits on its children only, not on their
/// subtrees (4 ranks on 2 cores, 4 KiB: 11.4-13.5 µs against 13.5-14.5).
pub(super) fn binomial_broadcast(
    r: usize,
    n: usize,
    root: usize,
    seg: &Range<usize>,
    tag: u32,
    acks: bool,
) -> Vec<Action> {
    let vr = (r + n - root) % n;
    let actual = |v: usize| (v + root) % n;
    let (parent, children) = binomial(vr, n);
    let mut v = Vec::new();
    if let Some(p) = parent {
        v.push(recv(actual(p), tag, Buf::Output, seg.clone(), false));
        if acks {
            v.push(send(actual(p), u32::MAX, Buf::Output, 0..0));
        }
    }
    for &c in &children {
        v.push(send(actual(c), tag, Buf::Output, seg.clone()));
    }
    if acks {
        for &c in &children {
            v.push(recv(actual(c), u32::MAX, Buf::Output, 0..0, false));
        }
    }
    v
}

/// Binomial-tree reduce of `seg` into `root`, data tag `tag`. With `acks`,
/// every parent acknowledges each child (tag `u32::MAX`), so that leaves too
/// receive a frame in the call.
pub(super) fn binomial_reduce(
    r: usize,
    n: usize,
    root: usize,
    seg: &Range<usize>,
    tag: u32,
    acks: bool,
) -> Vec<Action> {
    let vr = (r + n - root) % n;
    let actual = |v: usize| (v + root) % n;
    let (parent, children) = binomial(vr, n);
    let mut v = Vec::new();
    // Smallest subtrees first: they finish first.
    for &c in children.iter().rev() {
        v.push(recv(actual(c), tag, Buf::Output, seg.clone(), true));
    }
    if acks {
        for &c in children.iter().rev() {
            v.push(send(actual(c), u32::MAX, Buf::Output, 0..0));
        }
    }
    if let Some(p) = parent {
        v.push(send(actual(p), tag, Buf::Output, seg.clone()));
        if acks {
            v.push(recv(actual(p), u32::MAX, Buf::Output, 0..0, false));
        }
    }
    v
}

/// Recursive halving (reduce-scatter) then recursive doubling (all-gather)
/// among the largest power of two `p <= n`; the `n - p` extra ranks first
/// fold their data into a partner and get the result back at the end.
/// The fold of a world that is not a power of two, shared by the doubling
/// all_reduces: the even rank of each of the first `n - p` pairs gives its
/// vector to the odd one and gets the result back (tag `final_tag`) at the
/// end. Pushes the fold's actions to `v` and returns, for a rank that takes
/// part in the power-of-two core, its rank there, `p`, and the map from a
/// core rank back to its real one; `None` for a rank that folded out (its
/// actions are complete).
fn fold_in(
    r: usize,
    n: usize,
    count: usize,
    final_tag: u32,
    v: &mut Vec<Action>,
) -> Option<(usize, usize, impl Fn(usize) -> usize + use<>)> {
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - p;
    let all = 0..count;
    let new_rank = if r < 2 * extra {
        if r.is_multiple_of(2) {
            v.push(send(r + 1, 0, Buf::Output, all.clone()));
            v.push(recv(r + 1, final_tag, Buf::Output, all, false));
            return None;
        }
        v.push(recv(r - 1, 0, Buf::Output, all, true));
        r / 2
    } else {
        r - extra
    };
    let actual = move |nr: usize| if nr < extra { 2 * nr + 1 } else { nr + extra };
    Some((new_rank, p, actual))
}

/// The end of [`fold_in`]: an odd rank of a folded pair hands the result
/// back.
fn fold_out(r: usize, n: usize, count: usize, final_tag: u32, v: &mut Vec<Action>) {
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    if r < 2 * (n - p) {
        v.push(send(r - 1, final_tag, Buf::Output, 0..count));
    }
}

pub(super) fn halving_doubling(r: usize, n: usize, count: usize) -> Vec<Action> {
    let mut v = Vec::new();
    if n == 1 {
        return v;
    }
    let steps = (usize::BITS - 1 - n.leading_zeros()) as usize;
    let final_tag = 2 * steps as u32 + 1;
    let all = 0..count;
    let Some((new_rank, p, actual)) = fold_in(r, n, count, final_tag, &mut v) else {
        return v;
    };
    let mut range = all.clone();
    let mut stack = Vec::with_capacity(steps);
    for k in 0..steps {
        let d = p >> (k + 1);
        let partner = actual(new_rank ^ d);
        let mid = range.start + range.len() / 2;
        let (keep, give) = if new_rank & d == 0 {
            (range.start..mid, mid..range.end)
        } else {
            (mid..range.end, range.start..mid)
        };
        let tag = 1 + k as u32;
        v.push(send(partner, tag, Buf::Output, give));
        v.push(recv(partner, tag, Buf::Output, keep.clone(), true));
        stack.push(range);
        range = keep;
    }
    for k in (0..steps).rev() {
        let d = p >> (k + 1);
        let partner = actual(new_rank ^ d);
        let parent = stack.pop().expect("one range per halving step");
        let sibling = if range.start == parent.start {
            range.end..parent.end
        } else {
            parent.start..range.start
        };
        let tag = 1 + (2 * steps - 1 - k) as u32;
        v.push(send(partner, tag, Buf::Output, range.clone()));
        v.push(recv(partner, tag, Buf::Output, sibling, false));
        range = parent;
    }
    fold_out(r, n, count, final_tag, &mut v);
    v
}

/// Recursive doubling: at step `k`, exchange the whole vector with the
/// partner `2^k` away and reduce it in. Ranks past the largest power of two
/// fold in first (the even rank of each extra pair gives its vector to the
/// odd one and gets the result back at the end), as in halving-doubling.
/// Every rank combines the same two partial sums at each step, so with
/// commutative ops all ranks end bit for bit equal.
pub(super) fn recursive_doubling(r: usize, n: usize, count: usize) -> Vec<Action> {
    let mut v = Vec::new();
    if n == 1 {
        return v;
    }
    let steps = (usize::BITS - 1 - n.leading_zeros()) as usize;
    let final_tag = steps as u32 + 1;
    let all = 0..count;
    let Some((new_rank, _, actual)) = fold_in(r, n, count, final_tag, &mut v) else {
        return v;
    };
    for k in 0..steps {
        let partner = actual(new_rank ^ (1 << k));
        let tag = 1 + k as u32;
        v.push(send(partner, tag, Buf::Output, all.clone()));
        v.push(recv(partner, tag, Buf::Output, all.clone(), true));
    }
    fold_out(r, n, count, final_tag, &mut v);
    v
}

/// Direct gather (`gather == true`) or scatter of `m` elements per rank,
/// with an acknowledgement back so that every rank receives a frame.
pub(super) fn direct(r: usize, n: usize, root: usize, m: usize, gather: bool) -> Vec<Vec<Action>> {
    let chunk = |p: usize| p * m..(p + 1) * m;
    if r == root {
        return (0..n)
            .map(|p| match (p == root, gather) {
                (true, true) => vec![copy(Buf::Input, 0..m, Buf::Output, chunk(root))],
                (true, false) => vec![copy(Buf::Input, chunk(root), Buf::Output, 0..m)],
                (false, true) => vec![
                    recv(p, 0, Buf::Output, chunk(p), false),
                    send(p, 1, Buf::Output, 0..0),
                ],
                (false, false) => vec![
                    send(p, 0, Buf::Input, chunk(p)),
                    recv(p, 1, Buf::Output, 0..0, false),
                ],
            })
            .collect();
    }
    if gather {
        vec![vec![
            send(root, 0, Buf::Input, 0..m),
            recv(root, 1, Buf::Output, 0..0, false),
        ]]
    } else {
        vec![vec![
            recv(root, 0, Buf::Output, 0..m, false),
            send(root, 1, Buf::Output, 0..0),
        ]]
    }
}

/// Pairwise exchange: at step `s`, send to `r+s` and receive from `r-s`.
pub(super) fn pairwise(r: usize, n: usize, input: &[usize], output: &[usize]) -> Result<Listed> {
    if input.len() != n || output.len() != n {
        return Err(CommError::invalid(format!(
            "all_to_all_single needs {n} split sizes per side, got {} and {}",
            input.len(),
            output.len()
        )));
    }
    let offsets = |s: &[usize]| {
        let mut o = Vec::with_capacity(n + 1);
        let mut acc = 0usize;
        o.push(0);
        for x in s {
            acc += x;
            o.push(acc);
        }
        o
    };
    let (inp, out) = (offsets(input), offsets(output));
    let mut lanes = vec![vec![copy(
        Buf::Input,
        inp[r]..inp[r + 1],
        Buf::Output,
        out[r]..out[r + 1],
    )]];
    for s in 1..n {
        let to = (r + s) % n;
        let from = (r + n - s) % n;
        lanes.push(vec![
            send(to, s as u32, Buf::Input, inp[to]..inp[to + 1]),
            recv(from, s as u32, Buf::Output, out[from]..out[from + 1], false),
        ]);
    }
    Ok(Listed {
        lanes,
        window: usize::MAX,
        scratch: 0,
    })
}

/// Dissemination barrier: ⌈log2 n⌉ rounds of send to `r + 2^k`, receive
/// from `r - 2^k`.
pub(super) fn dissemination(r: usize, n: usize) -> Vec<Action> {
    let mut v = Vec::new();
    let mut d = 1usize;
    let mut k = 0u32;
    while d < n {
        v.push(send((r + d) % n, k, Buf::Output, 0..0));
        v.push(recv((r + n - d) % n, k, Buf::Output, 0..0, false));
        d <<= 1;
        k += 1;
    }
    v
}
