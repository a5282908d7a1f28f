//! The programs: every collective algorithm, written once.
//!
//! Rings are lazy (their O(world) steps are computed on demand); the
//! O(log world) algorithms are listed up front.

use std::{ops::Range, sync::Arc};

use super::{
    Action, AlgoConfig, Algorithm, Buf, LocalCopy, ONE_HOP_SEGMENT_BYTES, Program, Receive,
    STORE_AND_FORWARD_BYTES, Schedule, Transmit, part, subpart,
};
use crate::{CommError, OpKind, Result};

mod listed;

use listed::{
    binomial_broadcast, binomial_reduce, direct, dissemination, halving_doubling, pairwise,
    recursive_doubling,
};

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
        Algorithm::Chain => Arc::new(Chain {
            rank: spec.rank,
            n: spec.world,
            root: spec.root,
            count: spec.count,
            segs: chain_segments(spec, cfg),
            lead: cfg.oversubscribed,
            window: cfg.window,
        }),
        Algorithm::Direct if spec.op == OpKind::AllReduce => Arc::new(DirectAllReduce {
            rank: spec.rank,
            n: spec.world,
            count: spec.count,
            segs: (part(spec.count, spec.world, 0).len() * spec.elem_size)
                .div_ceil(cfg.fan_out_segment_bytes())
                .clamp(1, MAX_LANES),
            window: cfg.window.max(1),
        }),
        Algorithm::OneShot => Arc::new(OneShot {
            rank: spec.rank,
            n: spec.world,
            count: spec.count,
        }),
        Algorithm::Direct if spec.op == OpKind::Broadcast => Arc::new(FanOut {
            rank: spec.rank,
            n: spec.world,
            root: spec.root,
            count: spec.count,
            segs: (spec.count * spec.elem_size)
                .div_ceil(cfg.fan_out_segment_bytes())
                .clamp(1, MAX_LANES),
        }),
        _ => one_lane(spec, algo)?,
    };
    let schedule = Schedule::new(spec.op, program);
    Ok(match algo {
        // One shot overwrites its output with the sum while a peer may still
        // be reading what it sent from there.
        Algorithm::RecursiveDoubling | Algorithm::OneShot => schedule.sources_change(),
        _ => schedule,
    })
}

/// At most this many segments for the direct programs: two tags per
/// segment stay well inside a `u32`.
const MAX_LANES: usize = 1 << 24;

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
fn ring(spec: &CallSpec<'_>, cfg: &AlgoConfig) -> Arc<dyn Program> {
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
    Arc::new(Ring {
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
fn tree(spec: &CallSpec<'_>, cfg: &AlgoConfig) -> Arc<dyn Program> {
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
    Arc::new(Listed {
        lanes,
        window: cfg.window,
        scratch: 0,
    })
}

/// The unsegmented programs: direct, pairwise, dissemination, send, recv.
fn one_lane(spec: &CallSpec<'_>, algo: Algorithm) -> Result<Arc<dyn Program>> {
    let (r, n) = (spec.rank, spec.world);
    let all_at_once = |lanes| -> Arc<dyn Program> {
        Arc::new(Listed {
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
        (OpKind::Gather, Algorithm::Direct) => {
            all_at_once(direct(r, n, spec.root, spec.count, true))
        }
        (OpKind::Scatter, Algorithm::Direct) => {
            all_at_once(direct(r, n, spec.root, spec.count, false))
        }
        (OpKind::AllToAll, Algorithm::Pairwise) => {
            Arc::new(pairwise(r, n, spec.input_splits, spec.output_splits)?)
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

pub(super) fn send(to: usize, tag: u32, buf: Buf, range: Range<usize>) -> Action {
    Action::Transmit(Transmit {
        to,
        tag,
        buf,
        range,
    })
}

pub(super) fn recv(from: usize, tag: u32, buf: Buf, range: Range<usize>, reduce: bool) -> Action {
    Action::Receive(Receive {
        from,
        tag,
        buf,
        range,
        reduce,
    })
}

pub(super) fn copy(src_buf: Buf, src: Range<usize>, dst_buf: Buf, dst: Range<usize>) -> Action {
    Action::Copy(LocalCopy {
        src_buf,
        src,
        dst_buf,
        dst,
        reduce: false,
    })
}

/// Combines `src` of `src_buf` into `dst` of another buffer with the call's
/// reduce op.
pub(super) fn reduce_local(
    src_buf: Buf,
    src: Range<usize>,
    dst_buf: Buf,
    dst: Range<usize>,
) -> Action {
    Action::Copy(LocalCopy {
        src_buf,
        src,
        dst_buf,
        dst,
        reduce: true,
    })
}

/// A program whose lanes are listed up front.
#[derive(Debug)]
pub(super) struct Listed {
    lanes: Vec<Vec<Action>>,
    window: usize,
    scratch: usize,
}

impl Listed {
    fn one(actions: Vec<Action>) -> Arc<dyn Program> {
        Arc::new(Listed {
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

/// One-shot all_reduce: every rank sends its whole vector to every peer
/// (tag 0), then sums all n in rank order, its own among them, into the
/// scratch (rank 0 into its output, which already holds its own), and
/// copies the sum out. One lane: the sends go first, and each receive is
/// reduced only after the ranks before it, so every rank adds
/// `((x0 + x1) + x2) + ...` and ends with the same bits.
#[derive(Debug)]
struct OneShot {
    rank: usize,
    n: usize,
    count: usize,
}

impl OneShot {
    /// Action `index` of the one lane, made alone (no list per action):
    /// `n - 1` sends, then rank 0 reduces the `n - 1` receives into its
    /// output, and every other rank takes rank 0's into the scratch, adds
    /// ranks 1.. (itself by a local reduce) and copies the sum out.
    fn nth(&self, index: usize) -> Action {
        let (me, n, all) = (self.rank, self.n, 0..self.count);
        if index < n - 1 {
            return send((me + 1 + index) % n, 0, Buf::Output, all);
        }
        let k = index - (n - 1);
        match (me, k) {
            (0, k) => recv(k + 1, 0, Buf::Output, all, true),
            (_, 0) => recv(0, 0, Buf::Scratch, all, false),
            (_, k) if k == n => copy(Buf::Scratch, all.clone(), Buf::Output, all),
            (_, q) if q == me => reduce_local(Buf::Output, all.clone(), Buf::Scratch, all),
            (_, q) => recv(q, 0, Buf::Scratch, all, true),
        }
    }
}

impl Program for OneShot {
    fn lanes(&self) -> usize {
        1
    }
    fn lane_len(&self, _lane: usize) -> usize {
        match (self.n, self.rank) {
            (1, _) => 0,
            (n, 0) => 2 * (n - 1),
            (n, _) => 2 * (n - 1) + 2,
        }
    }
    fn action(&self, _lane: usize, index: usize) -> Action {
        self.nth(index)
    }
    fn scratch_len(&self) -> usize {
        if self.rank == 0 { 0 } else { self.count }
    }
}

/// Direct broadcast: the root sends every segment to every rank, one
/// transmit after another ([`Program::fans_out`]), and each rank
/// acknowledges once (so that every rank takes a frame of the call, and a
/// mismatch is seen on all of them). Where the transport has a stage its
/// peers read (same-host shared memory), the root copies each segment in
/// once and every reader copies it out at once: `1 + readers` copies
/// against two per hop down a chain. Where it lets receivers read the
/// root's memory (`CONSORT_SHM_CMA=1`), every reader copies from the root
/// once. Lanes: one per segment, then the acknowledgements; all run at
/// once, so a reader has every segment's receive posted when it comes.
#[derive(Debug)]
struct FanOut {
    rank: usize,
    n: usize,
    root: usize,
    count: usize,
    segs: usize,
}

impl FanOut {
    /// The `i`th rank after the root.
    fn peer(&self, i: usize) -> usize {
        (self.root + 1 + i) % self.n
    }
}

impl Program for FanOut {
    fn lanes(&self) -> usize {
        if self.n == 1 { 0 } else { self.segs + 1 }
    }
    fn lane_len(&self, _lane: usize) -> usize {
        if self.rank == self.root {
            self.n - 1
        } else {
            1
        }
    }
    fn action(&self, lane: usize, index: usize) -> Action {
        let ack = self.segs as u32;
        match (self.rank == self.root, lane < self.segs) {
            (true, true) => send(
                self.peer(index),
                lane as u32,
                Buf::Output,
                subpart(&(0..self.count), self.segs, lane),
            ),
            (true, false) => recv(self.peer(index), ack, Buf::Output, 0..0, false),
            (false, true) => recv(
                self.root,
                lane as u32,
                Buf::Output,
                subpart(&(0..self.count), self.segs, lane),
                false,
            ),
            (false, false) => send(self.root, ack, Buf::Output, 0..0),
        }
    }
    fn fans_out(&self) -> bool {
        true
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

/// Direct all_reduce in segments: in each, a reduce-scatter in which rank
/// `r` reduces its part's segment from every peer's (tag `2k`), then an
/// all-gather in which it sends the reduced segment to every peer (tag
/// `2k + 1`). Two steps whatever the world size, with traffic between every
/// pair: for shared memory, where every rank's stage is a slot its peers
/// read (the all-gather's segment is copied in once for all of them), or a
/// single-copy read takes a peer's part straight from its memory.
///
/// Rank `r` sends to `r+1, r+2, ...` and takes from `r-1, r-2, ...`, the
/// order in which its peers send to it; the owner reduces each segment
/// alone and in that fixed order, so every rank ends with the same bits.
/// Sources stay until taken: a peer sends back a segment only after it has
/// taken this rank's part of it.
#[derive(Debug)]
struct DirectAllReduce {
    rank: usize,
    n: usize,
    count: usize,
    /// Segments per part (every rank splits every part alike).
    segs: usize,
    window: usize,
}

impl DirectAllReduce {
    /// Segment `k` of rank `p`'s part.
    fn seg(&self, p: usize, k: usize) -> Range<usize> {
        subpart(&part(self.count, self.n, p), self.segs, k)
    }
}

impl Program for DirectAllReduce {
    fn lanes(&self) -> usize {
        if self.n == 1 { 0 } else { self.segs }
    }
    fn lane_len(&self, _lane: usize) -> usize {
        4 * (self.n - 1)
    }
    fn action(&self, lane: usize, index: usize) -> Action {
        let (n, r, peers) = (self.n, self.rank, self.n - 1);
        let k = index % peers + 1;
        let (to, from) = ((r + k) % n, (r + n - k) % n);
        let (scatter, gather) = (2 * lane as u32, 2 * lane as u32 + 1);
        match index / peers {
            0 => send(to, scatter, Buf::Output, self.seg(to, lane)),
            1 => recv(from, scatter, Buf::Output, self.seg(r, lane), true),
            2 => send(to, gather, Buf::Output, self.seg(r, lane)),
            _ => recv(from, gather, Buf::Output, self.seg(from, lane), false),
        }
    }
    fn window(&self) -> usize {
        self.window
    }
    fn fans_out(&self) -> bool {
        true
    }
}
