//! The programs: every collective algorithm, written once.
//!
//! Rings are lazy (their O(world) steps are computed on demand); the
//! O(log world) algorithms are listed up front.

use std::ops::Range;

use super::{
    Action, AlgoConfig, Algorithm, Buf, LocalCopy, ONE_HOP_SEGMENT_BYTES, Program, Receive,
    STORE_AND_FORWARD_BYTES, Schedule, Transmit, part, subpart,
};
use crate::{CommError, OpKind, Result};

/// What one rank's call is, as far as choosing and building a schedule
/// needs to know.
#[derive(Clone, Debug)]
pub struct CallSpec<'a> {
    /// The op.
    pub op: OpKind,
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
    /// Elements: the buffer for all_reduce, broadcast, reduce, send and
    /// recv; each rank's part for all_gather, reduce_scatter, gather and
    /// scatter; ignored for all_to_all and barrier.
    pub count: usize,
    /// Bytes per element (segment sizes are in bytes).
    pub elem_size: usize,
    /// Root of rooted ops; the peer of send and recv.
    pub root: usize,
    /// The user tag of send and recv.
    pub tag: u32,
    /// all_to_all: elements this rank sends to each rank.
    pub input_splits: &'a [usize],
    /// all_to_all: elements this rank receives from each rank.
    pub output_splits: &'a [usize],
}

impl CallSpec<'_> {
    /// Bytes the selection policy looks at: the whole buffer an op moves.
    pub fn bytes(&self) -> usize {
        let parts = match self.op {
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::Gather | OpKind::Scatter => {
                self.world
            }
            _ => 1,
        };
        self.count
            .saturating_mul(parts)
            .saturating_mul(self.elem_size)
    }
}

/// Builds the schedule of `spec` with `algo` (which must suit the op; see
/// [`Algorithm::supports`]).
pub fn build(spec: &CallSpec<'_>, algo: Algorithm, cfg: &AlgoConfig) -> Result<Schedule> {
    if !algo.supports(spec.op) {
        return Err(CommError::invalid(format!(
            "algorithm `{algo}` does not implement {}; it implements {}",
            spec.op,
            algo.ops()
                .iter()
                .map(|o| o.name())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let program = match algo {
        Algorithm::Ring => ring(spec, cfg),
        Algorithm::BinomialTree => tree(spec, cfg),
        Algorithm::Chain => Box::new(Chain {
            rank: spec.rank,
            n: spec.world,
            root: spec.root,
            count: spec.count,
            segs: chain_segments(spec, cfg),
            lead: cfg.oversubscribed,
            window: cfg.window,
        }),
        _ => one_lane(spec, algo)?,
    };
    let schedule = Schedule::new(spec.op, program);
    Ok(match algo {
        Algorithm::RecursiveDoubling => schedule.sources_change(),
        _ => schedule,
    })
}

/// Segments of `bytes` at `cfg.segment_bytes` each (at least one).
fn segments(bytes: usize, cfg: &AlgoConfig) -> usize {
    bytes.div_ceil(cfg.segment_bytes.max(1)).max(1)
}

/// The chain broadcast's segments: pipelined, whole messages (up to
/// [`STORE_AND_FORWARD_BYTES`]) on an oversubscribed host, and at least
/// [`ONE_HOP_SEGMENT_BYTES`] each between two ranks.
fn chain_segments(spec: &CallSpec<'_>, cfg: &AlgoConfig) -> usize {
    let bytes = spec.count * spec.elem_size;
    let at_least = if cfg.oversubscribed {
        STORE_AND_FORWARD_BYTES
    } else if spec.world == 2 {
        ONE_HOP_SEGMENT_BYTES
    } else {
        0
    };
    bytes
        .div_ceil(cfg.segment_bytes.max(at_least).max(1))
        .max(1)
}

/// The segmented rings: all_reduce, all_gather, reduce_scatter.
fn ring(spec: &CallSpec<'_>, cfg: &AlgoConfig) -> Box<dyn Program> {
    let n = spec.world;
    let (kind, part_len, count, chunk_bytes) = match spec.op {
        OpKind::AllReduce => (
            RingKind::AllReduce,
            0,
            spec.count,
            spec.count.div_ceil(n.max(1)) * spec.elem_size,
        ),
        OpKind::AllGather => (
            RingKind::AllGather,
            spec.count,
            spec.count * n,
            spec.count * spec.elem_size,
        ),
        _ => (
            RingKind::ReduceScatter,
            spec.count,
            spec.count * n,
            spec.count * spec.elem_size,
        ),
    };
    Box::new(Ring {
        kind,
        rank: spec.rank,
        n,
        part_len,
        count,
        segs: segments(chunk_bytes, cfg),
        window: cfg.window,
    })
}

/// The binomial trees, one lane per segment: broadcast, reduce, and
/// all_reduce as reduce then broadcast.
fn tree(spec: &CallSpec<'_>, cfg: &AlgoConfig) -> Box<dyn Program> {
    let (r, n, root) = (spec.rank, spec.world, spec.root);
    let s = segments(spec.count * spec.elem_size, cfg);
    let lanes = (0..s)
        .map(|k| {
            let seg = subpart(&(0..spec.count), s, k);
            let tag = k as u32;
            match spec.op {
                OpKind::Broadcast => binomial_broadcast(r, n, root, &seg, tag, k == 0),
                OpKind::Reduce => binomial_reduce(r, n, root, &seg, tag, k == 0),
                _ => {
                    let mut v = binomial_reduce(r, n, 0, &seg, tag, false);
                    v.extend(binomial_broadcast(r, n, 0, &seg, (s + k) as u32, false));
                    v
                }
            }
        })
        .collect();
    Box::new(Listed {
        lanes,
        window: cfg.window,
        scratch: 0,
    })
}

/// The unsegmented programs: direct, pairwise, dissemination, send, recv.
fn one_lane(spec: &CallSpec<'_>, algo: Algorithm) -> Result<Box<dyn Program>> {
    let (r, n) = (spec.rank, spec.world);
    let all_at_once = |lanes| -> Box<dyn Program> {
        Box::new(Listed {
            lanes,
            window: usize::MAX,
            scratch: 0,
        })
    };
    Ok(match (spec.op, algo) {
        (OpKind::AllReduce, Algorithm::HalvingDoubling) => {
            Listed::one(halving_doubling(r, n, spec.count))
        }
        (OpKind::AllReduce, Algorithm::RecursiveDoubling) => {
            Listed::one(recursive_doubling(r, n, spec.count))
        }
        (OpKind::AllReduce, Algorithm::Direct) => Listed::one(direct_all_reduce(r, n, spec.count)),
        (OpKind::Gather, Algorithm::Direct) => {
            all_at_once(direct(r, n, spec.root, spec.count, true))
        }
        (OpKind::Broadcast, Algorithm::Direct) => {
            all_at_once(direct_broadcast(r, n, spec.root, spec.count))
        }
        (OpKind::Scatter, Algorithm::Direct) => {
            all_at_once(direct(r, n, spec.root, spec.count, false))
        }
        (OpKind::AllToAll, Algorithm::Pairwise) => {
            Box::new(pairwise(r, n, spec.input_splits, spec.output_splits)?)
        }
        (OpKind::Barrier, Algorithm::Dissemination) => Listed::one(dissemination(r, n)),
        (OpKind::Send, Algorithm::Direct) => {
            Listed::one(vec![send(spec.root, spec.tag, Buf::Input, 0..spec.count)])
        }
        (OpKind::Recv, Algorithm::Direct) => Listed::one(vec![recv(
            spec.root,
            spec.tag,
            Buf::Output,
            0..spec.count,
            false,
        )]),
        (op, algo) => {
            return Err(CommError::invalid(format!("no `{algo}` program for {op}")));
        }
    })
}

fn send(to: usize, tag: u32, buf: Buf, range: Range<usize>) -> Action {
    Action::Transmit(Transmit {
        to,
        tag,
        buf,
        range,
    })
}

fn recv(from: usize, tag: u32, buf: Buf, range: Range<usize>, reduce: bool) -> Action {
    Action::Receive(Receive {
        from,
        tag,
        buf,
        range,
        reduce,
    })
}

fn copy(src_buf: Buf, src: Range<usize>, dst_buf: Buf, dst: Range<usize>) -> Action {
    Action::Copy(LocalCopy {
        src_buf,
        src,
        dst_buf,
        dst,
    })
}

/// A program whose lanes are listed up front.
#[derive(Debug)]
struct Listed {
    lanes: Vec<Vec<Action>>,
    window: usize,
    scratch: usize,
}

impl Listed {
    fn one(actions: Vec<Action>) -> Box<dyn Program> {
        Box::new(Listed {
            lanes: vec![actions],
            window: 1,
            scratch: 0,
        })
    }
}

impl Program for Listed {
    fn lanes(&self) -> usize {
        self.lanes.len()
    }
    fn lane_len(&self, lane: usize) -> usize {
        self.lanes[lane].len()
    }
    fn action(&self, lane: usize, index: usize) -> Action {
        self.lanes[lane][index].clone()
    }
    fn window(&self) -> usize {
        self.window
    }
    fn scratch_len(&self) -> usize {
        self.scratch
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RingKind {
    AllReduce,
    AllGather,
    ReduceScatter,
}

/// Segmented, pipelined rings. Every chunk is cut into `segs` segments;
/// each segment is one lane, so `window` segments are in flight at once.
///
/// - all_reduce: reduce-scatter (step `s`: send chunk `r-s`, reduce chunk
///   `r-s-1` from the left) then all-gather (send `r+1-s`, copy `r-s`).
/// - all_gather: copy the own part, then the all-gather phase.
/// - reduce_scatter: copy the input to scratch, reduce-scatter shifted by
///   one so that rank `r` ends with chunk `r`, copy it out.
#[derive(Debug)]
struct Ring {
    kind: RingKind,
    rank: usize,
    n: usize,
    /// all_gather / reduce_scatter: each rank's part.
    part_len: usize,
    /// Elements of the buffer the ring runs on.
    count: usize,
    segs: usize,
    window: usize,
}

impl Ring {
    fn chunk(&self, c: usize) -> Range<usize> {
        match self.kind {
            RingKind::AllReduce => part(self.count, self.n, c),
            _ => c * self.part_len..(c + 1) * self.part_len,
        }
    }

    fn seg(&self, c: usize, k: usize) -> Range<usize> {
        subpart(&self.chunk(c % self.n), self.segs, k)
    }

    fn prefix(&self) -> usize {
        match self.kind {
            RingKind::AllReduce => 0,
            RingKind::AllGather => 1,
            RingKind::ReduceScatter => self.n,
        }
    }

    fn steps(&self) -> usize {
        match self.kind {
            RingKind::AllReduce => 2 * (self.n - 1),
            _ => self.n - 1,
        }
    }
}

impl Program for Ring {
    fn lanes(&self) -> usize {
        self.segs
    }

    fn lane_len(&self, _lane: usize) -> usize {
        let suffix = usize::from(self.kind == RingKind::ReduceScatter);
        self.prefix() + 2 * self.steps() + suffix
    }

    fn action(&self, k: usize, i: usize) -> Action {
        let (r, n) = (self.rank, self.n);
        let next = (r + 1) % n;
        let prev = (r + n - 1) % n;
        let pre = self.prefix();
        if i < pre {
            return match self.kind {
                RingKind::AllGather => copy(
                    Buf::Input,
                    subpart(&(0..self.part_len), self.segs, k),
                    Buf::Output,
                    self.seg(r, k),
                ),
                _ => copy(Buf::Input, self.seg(i, k), Buf::Scratch, self.seg(i, k)),
            };
        }
        let j = i - pre;
        if j == 2 * self.steps() {
            // reduce_scatter's last action: the finished chunk out.
            return copy(
                Buf::Scratch,
                self.seg(r, k),
                Buf::Output,
                subpart(&(0..self.part_len), self.segs, k),
            );
        }
        let step = j / 2;
        let is_recv = j % 2 == 1;
        let tag = (step as u32)
            .wrapping_mul(self.segs as u32)
            .wrapping_add(k as u32);
        // (chunk to send, chunk to receive, reduce?) for this step.
        let (tx, rx, reduce, buf) = match self.kind {
            RingKind::AllReduce if step < n - 1 => {
                (r + n - step, r + 2 * n - step - 1, true, Buf::Output)
            }
            RingKind::AllReduce => {
                let s = step - (n - 1);
                (r + n + 1 - s, r + n - s, false, Buf::Output)
            }
            RingKind::AllGather => (r + n - step, r + 2 * n - step - 1, false, Buf::Output),
            RingKind::ReduceScatter => (
                r + 2 * n - step - 1,
                r + 2 * n - step - 2,
                true,
                Buf::Scratch,
            ),
        };
        if is_recv {
            recv(prev, tag, buf, self.seg(rx, k), reduce)
        } else {
            send(next, tag, buf, self.seg(tx, k))
        }
    }

    fn window(&self) -> usize {
        self.window
    }

    fn scratch_len(&self) -> usize {
        if self.kind == RingKind::ReduceScatter {
            self.count
        } else {
            0
        }
    }
}

/// Pipelined chain broadcast: root → root+1 → ... with one lane per
/// segment; rank root+1 acknowledges to the root so that every rank
/// receives a frame (and checks its fingerprint) in every call.
///
/// With `lead` (whole-message segments, on an oversubscribed host), lane 0
/// is an empty frame from the root to rank root+1 ahead of the data, and
/// rank root+1 acknowledges that: the root's call ends when its last byte
/// is on its way, not when rank root+1 has taken it all and the
/// acknowledgement has woken the root (4-rank 64 MiB broadcast: about
/// 0.5-1 ms of 8).
#[derive(Debug)]
struct Chain {
    rank: usize,
    n: usize,
    root: usize,
    count: usize,
    segs: usize,
    lead: bool,
    window: usize,
}

impl Chain {
    fn lane(&self, k: usize) -> Vec<Action> {
        let n = self.n;
        let vr = (self.rank + n - self.root) % n;
        let actual = |v: usize| (v + self.root) % n;
        let lead = usize::from(self.lead);
        let seg = match k.checked_sub(lead) {
            Some(d) => subpart(&(0..self.count), self.segs, d),
            None => 0..0,
        };
        let ack = (self.segs + lead) as u32;
        let mut v = Vec::with_capacity(3);
        if n == 1 {
            return v;
        }
        // The lead goes to rank root+1 only: the ranks further down wait
        // for their data asleep, and each still receives a frame.
        let in_lead = k < lead;
        if in_lead && vr > 1 {
            return v;
        }
        if vr > 0 {
            v.push(recv(
                actual(vr - 1),
                k as u32,
                Buf::Output,
                seg.clone(),
                false,
            ));
        }
        // Rank root+1 acknowledges as soon as it holds lane 0 (the lead, or
        // segment 0), before it forwards: the root's call need not wait for
        // the next hop.
        if k == 0 && vr == 1 {
            v.push(send(actual(0), ack, Buf::Output, 0..0));
        }
        if vr + 1 < n && !(in_lead && vr == 1) {
            v.push(send(actual(vr + 1), k as u32, Buf::Output, seg));
        }
        if k == 0 && vr == 0 {
            v.push(recv(actual(1), ack, Buf::Output, 0..0, false));
        }
        v
    }
}

impl Program for Chain {
    fn lanes(&self) -> usize {
        self.segs + usize::from(self.lead)
    }
    fn lane_len(&self, lane: usize) -> usize {
        self.lane(lane).len()
    }
    fn action(&self, lane: usize, index: usize) -> Action {
        self.lane(lane).swap_remove(index)
    }
    fn window(&self) -> usize {
        self.window
    }
}

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
/// the root too receives a frame in the call.
fn binomial_broadcast(
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
    }
    for &c in &children {
        v.push(send(actual(c), tag, Buf::Output, seg.clone()));
    }
    if acks {
        if let Some(p) = parent {
            v.push(send(actual(p), u32::MAX, Buf::Output, 0..0));
        }
        for &c in &children {
            v.push(recv(actual(c), u32::MAX, Buf::Output, 0..0, false));
        }
    }
    v
}

/// Binomial-tree reduce of `seg` into `root`, data tag `tag`. With `acks`,
/// every parent acknowledges each child (tag `u32::MAX`), so that leaves too
/// receive a frame in the call.
fn binomial_reduce(
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
        if r % 2 == 0 {
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

fn halving_doubling(r: usize, n: usize, count: usize) -> Vec<Action> {
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
fn recursive_doubling(r: usize, n: usize, count: usize) -> Vec<Action> {
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

/// Direct all_reduce: a reduce-scatter in which rank `r` reduces its part
/// from every peer's (tag 0), then an all-gather in which it sends its
/// reduced part to every peer (tag 1). Two steps whatever the world size,
/// each with traffic between every pair: for shared memory, where a
/// single-copy read takes a peer's part straight from its memory.
///
/// Rank `r` sends to `r+1, r+2, ...` and takes from `r-1, r-2, ...`, the
/// order in which its peers send to it; the owner reduces each part alone
/// and in that fixed order, so every rank ends with the same bits.
fn direct_all_reduce(r: usize, n: usize, count: usize) -> Vec<Action> {
    let mut v = Vec::with_capacity(4 * n);
    let to = |k: usize| (r + k) % n;
    let from = |k: usize| (r + n - k) % n;
    let mine = part(count, n, r);
    for k in 1..n {
        v.push(send(to(k), 0, Buf::Output, part(count, n, to(k))));
    }
    for k in 1..n {
        v.push(recv(from(k), 0, Buf::Output, mine.clone(), true));
    }
    for k in 1..n {
        v.push(send(to(k), 1, Buf::Output, mine.clone()));
    }
    for k in 1..n {
        v.push(recv(
            from(k),
            1,
            Buf::Output,
            part(count, n, from(k)),
            false,
        ));
    }
    v
}

/// Direct gather (`gather == true`) or scatter of `m` elements per rank,
/// with an acknowledgement back so that every rank receives a frame.
fn direct(r: usize, n: usize, root: usize, m: usize, gather: bool) -> Vec<Vec<Action>> {
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

/// Direct broadcast: the root sends the whole buffer to every rank at once,
/// each acknowledging it. Where the transport lets the receivers read the
/// root's memory (same host, `CONSORT_SHM_CMA=1`), every reader copies from
/// the root once, all in parallel: the shared-memory schedule, chosen with
/// `CONSORT_ALGO=broadcast=direct` (the policy cannot know that every pair
/// of the group can read each other).
fn direct_broadcast(r: usize, n: usize, root: usize, count: usize) -> Vec<Vec<Action>> {
    if r == root {
        return (0..n)
            .filter(|&p| p != root)
            .map(|p| {
                vec![
                    send(p, 0, Buf::Output, 0..count),
                    recv(p, 1, Buf::Output, 0..0, false),
                ]
            })
            .collect();
    }
    vec![vec![
        recv(root, 0, Buf::Output, 0..count, false),
        send(root, 1, Buf::Output, 0..0),
    ]]
}

/// Pairwise exchange: at step `s`, send to `r+s` and receive from `r-s`.
fn pairwise(r: usize, n: usize, input: &[usize], output: &[usize]) -> Result<Listed> {
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
fn dissemination(r: usize, n: usize) -> Vec<Action> {
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
