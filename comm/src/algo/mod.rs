//! Collective algorithms as sans-IO schedules: the one place where ring,
//! halving-doubling, binomial trees and the rest are written.
//!
//! This module owns *what* each rank sends, to whom, and in which order. It
//! owns no memory, socket or clock: a [`Schedule`] names element ranges of
//! the call's buffers ([`Buf::Input`], [`Buf::Output`], [`Buf::Scratch`]),
//! and a driver (the simulator, the TCP backend, the QUIC backend) moves the
//! bytes and applies the [`crate::ReduceOp`] it is told to. A property test
//! that passes in the simulator has therefore run the code a cluster runs.
//!
//! # Shape of a program
//!
//! A [`Program`] is a set of *lanes*. Each lane is a sequence of
//! [`Action`]s executed in order: a [`Transmit`] or a [`LocalCopy`] completes
//! as soon as the driver takes it; a [`Receive`] blocks its lane until the
//! driver reports it with [`Schedule::handle_recv`]. Lanes are independent,
//! which is how segmented pipelines keep several segments in flight; at most
//! [`Program::window`] lanes run at once. Programs are lazy (actions are
//! computed on demand), so a schedule for 65,536 ranks costs O(window)
//! memory.

mod cache;
pub mod exec;
pub mod gloo;
mod programs;
mod select;

pub use select::{
    FAN_OUT_MIN_BYTES, FAN_OUT_SEGMENT_MAX, LATENCY_BOUND_BYTES, ONE_HOP_SEGMENT_BYTES,
    SMALL_BYTES, STORE_AND_FORWARD_BYTES,
};

use std::{fmt, ops::Range, sync::Arc};

use rustc_hash::FxHashMap;

pub use cache::ProgramCache;
pub use programs::{CallSpec, build};
pub use select::{AlgoConfig, Algorithm, ParseAlgoError};

use crate::OpKind;

/// Which buffer of the call a range refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The read-only input (all_gather, gather, scatter, reduce_scatter,
    /// all_to_all_single, send).
    Input,
    /// The output, or the single in-place buffer (all_reduce, broadcast,
    /// reduce, recv).
    Output,
    /// A driver-allocated temporary of [`Schedule::scratch_len`] elements.
    Scratch,
}

/// Send elements `range` of `buf` to rank `to`, tagged `tag`. The driver
/// must capture the bytes before its next call into the schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct Transmit {
    /// Destination rank (in the group).
    pub to: usize,
    /// Tag that the receiver's [`Receive`] carries.
    pub tag: u32,
    /// Source buffer.
    pub buf: Buf,
    /// Element range of `buf`.
    pub range: Range<usize>,
}

/// Expect a message tagged `tag` from rank `from`, of exactly
/// `range.len()` elements, and copy it into (or, if `reduce`, combine it
/// with the op into) `range` of `buf`; then call [`Schedule::handle_recv`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct Receive {
    /// Source rank.
    pub from: usize,
    /// Tag of the matching [`Transmit`].
    pub tag: u32,
    /// Destination buffer.
    pub buf: Buf,
    /// Element range of `buf`.
    pub range: Range<usize>,
    /// Combine with the call's reduce op instead of copying.
    pub reduce: bool,
}

/// Copy elements `src` of `src_buf` to `dst` of `dst_buf` (equal lengths).
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct LocalCopy {
    /// Source buffer.
    pub src_buf: Buf,
    /// Source range.
    pub src: Range<usize>,
    /// Destination buffer.
    pub dst_buf: Buf,
    /// Destination range.
    pub dst: Range<usize>,
    /// Combine into the destination with the call's reduce op instead of
    /// overwriting it (source and destination in different buffers).
    pub reduce: bool,
}

/// One thing a driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum Action {
    /// Send.
    Transmit(Transmit),
    /// Post a receive.
    Receive(Receive),
    /// Copy locally.
    Copy(LocalCopy),
}

/// A lazily generated collective program for one rank.
pub trait Program: Send + Sync + fmt::Debug {
    /// Number of lanes.
    fn lanes(&self) -> usize;
    /// Number of actions in `lane`.
    fn lane_len(&self, lane: usize) -> usize;
    /// Action `index` of `lane`.
    fn action(&self, lane: usize, index: usize) -> Action;
    /// How many lanes may run at once.
    fn window(&self) -> usize {
        usize::MAX
    }
    /// Elements of scratch space the driver must provide.
    fn scratch_len(&self) -> usize {
        0
    }
    /// Whether the program sends each range it sends to several peers,
    /// one transmit after another in one lane (the direct broadcast): a
    /// driver that can let all of them read one copy of the bytes should.
    fn fans_out(&self) -> bool {
        false
    }
}

/// Why the driver's report did not fit the schedule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// `handle_recv` for a receive that was not posted.
    #[error("no receive from rank {from} with tag {tag} is posted")]
    NotPosted {
        /// Rank reported.
        from: usize,
        /// Tag reported.
        tag: u32,
    },
}

#[derive(Clone, Copy, Debug, Default)]
struct Lane {
    next: usize,
    blocked: bool,
}

/// The state machine a driver runs for one call on one rank.
///
/// # Driving order
///
/// 1. Call [`Schedule::poll`] until it returns `None`, doing each action:
///    capture and send a [`Transmit`]'s bytes; perform a [`LocalCopy`];
///    remember a [`Receive`] as posted (a message for it may already have
///    arrived: drivers keep early messages by `(from, tag)`).
/// 2. When a posted receive's message is in and applied (copied or
///    reduced, after checking its length), call
///    [`Schedule::handle_recv`]`(from, tag)`, then go back to 1.
/// 3. The call is complete when [`Schedule::is_done`]. Then apply the
///    reduce op's `finalize` (Avg) where the op defines a result.
///
/// Deadlines are the driver's: while waiting it may ask
/// [`Schedule::waiting_on`] which peers it is blocked on, to name them in a
/// `Timeout`.
#[derive(Debug)]
pub struct Schedule {
    op: OpKind,
    program: Arc<dyn Program>,
    lanes: Vec<Lane>,
    /// Lanes started and not finished, in start order.
    active: Vec<usize>,
    /// Next lane to start.
    next_lane: usize,
    /// Round-robin cursor into `active`.
    cursor: usize,
    posted: FxHashMap<(usize, u32), (usize, Receive)>,
    sources_stay: bool,
}

impl Schedule {
    /// Starts running `program` for a call of kind `op`.
    pub fn new(op: OpKind, program: Arc<dyn Program>) -> Self {
        let n = program.lanes();
        let mut s = Schedule {
            op,
            program,
            lanes: vec![Lane::default(); n],
            active: Vec::new(),
            next_lane: 0,
            cursor: 0,
            posted: FxHashMap::default(),
            sources_stay: true,
        };
        s.fill_window();
        s
    }

    /// A schedule over a program shared with earlier calls (see
    /// [`ProgramCache`]), with the program's `sources_stay`.
    pub(crate) fn shared(op: OpKind, program: Arc<dyn Program>, sources_stay: bool) -> Self {
        Schedule {
            sources_stay,
            ..Schedule::new(op, program)
        }
    }

    /// The program this schedule runs.
    pub(crate) fn program(&self) -> &Arc<dyn Program> {
        &self.program
    }

    /// Marks a schedule whose ranks may write a range they transmitted
    /// before its receiver has taken it (see [`Schedule::sources_stay`]).
    pub fn sources_change(mut self) -> Self {
        self.sources_stay = false;
        self
    }

    /// The op this schedule runs.
    pub fn op(&self) -> OpKind {
        self.op
    }

    /// Whether the program sends each range to several peers in a row
    /// (see [`Program::fans_out`]).
    pub fn fans_out(&self) -> bool {
        self.program.fans_out()
    }

    /// Elements of scratch space the driver must allocate.
    pub fn scratch_len(&self) -> usize {
        self.program.scratch_len()
    }

    /// Whether every range this rank transmits stays as it was sent until
    /// its receiver has taken the message: no receive or copy of this call
    /// writes it before then, in any delivery order (a proptest checks
    /// every schedule that says so). A driver may then let the receiver
    /// read a transmitted range from the sender's memory when it takes the
    /// message (single-copy transfers) instead of capturing the bytes at
    /// once. Every schedule but recursive doubling's, whose partners
    /// exchange and reduce into the same whole vector at once.
    pub fn sources_stay(&self) -> bool {
        self.sources_stay
    }

    fn fill_window(&mut self) {
        let window = self.program.window().max(1);
        while self.active.len() < window && self.next_lane < self.lanes.len() {
            let l = self.next_lane;
            self.next_lane += 1;
            if self.program.lane_len(l) > 0 {
                self.active.push(l);
            }
        }
    }

    /// The next action, or `None` when every running lane waits on a
    /// receive (or the schedule is done).
    pub fn poll(&mut self) -> Option<Action> {
        for _ in 0..self.active.len() {
            if self.cursor >= self.active.len() {
                self.cursor = 0;
            }
            let l = self.active[self.cursor];
            let lane = self.lanes[l];
            if lane.blocked {
                self.cursor += 1;
                continue;
            }
            let a = self.program.action(l, lane.next);
            match &a {
                Action::Receive(r) => {
                    self.lanes[l].blocked = true;
                    let prev = self.posted.insert((r.from, r.tag), (l, r.clone()));
                    debug_assert!(prev.is_none(), "two receives posted with one (from, tag)");
                    self.cursor += 1;
                }
                Action::Transmit(_) | Action::Copy(_) => self.advance(l),
            }
            return Some(a);
        }
        None
    }

    fn advance(&mut self, l: usize) {
        self.lanes[l].next += 1;
        if self.lanes[l].next == self.program.lane_len(l) {
            let pos = self
                .active
                .iter()
                .position(|x| *x == l)
                .expect("active lane");
            self.active.remove(pos);
            if self.cursor > pos {
                self.cursor -= 1;
            }
            self.fill_window();
        }
    }

    /// Reports that the posted receive `(from, tag)` has been applied.
    pub fn handle_recv(&mut self, from: usize, tag: u32) -> Result<(), ScheduleError> {
        let (l, _) = self
            .posted
            .remove(&(from, tag))
            .ok_or(ScheduleError::NotPosted { from, tag })?;
        self.lanes[l].blocked = false;
        self.advance(l);
        Ok(())
    }

    /// The posted receive for `(from, tag)`, if there is one (a driver uses
    /// it to check that an early message is expected at all).
    pub fn is_posted(&self, from: usize, tag: u32) -> bool {
        self.posted.contains_key(&(from, tag))
    }

    /// The posted receive for `(from, tag)`, to apply an arriving message.
    pub fn posted_receive(&self, from: usize, tag: u32) -> Option<&Receive> {
        self.posted.get(&(from, tag)).map(|(_, r)| r)
    }

    /// Actions over every lane, done or not (saturating): the work the
    /// schedule is, for a driver that bounds what it will run.
    pub fn actions(&self) -> usize {
        (0..self.lanes.len())
            .map(|l| self.program.lane_len(l))
            .fold(0, usize::saturating_add)
    }

    /// Whether every action of every lane has completed.
    pub fn is_done(&self) -> bool {
        self.active.is_empty() && self.next_lane >= self.lanes.len()
    }

    /// The peers this rank is blocked on, sorted and without duplicates.
    pub fn waiting_on(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.posted.keys().map(|(f, _)| *f).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// The `i`-th of `parts` balanced parts of `0..len` (lengths differ by at
/// most one). Every rank computes the same split.
pub fn part(len: usize, parts: usize, i: usize) -> Range<usize> {
    let (len, parts, i) = (len as u128, parts.max(1) as u128, i as u128);
    let start = len * i / parts;
    let end = len * (i + 1) / parts;
    start as usize..end as usize
}

/// The `i`-th of `parts` balanced parts of `r`.
pub fn subpart(r: &Range<usize>, parts: usize, i: usize) -> Range<usize> {
    let p = part(r.len(), parts, i);
    r.start + p.start..r.start + p.end
}

#[cfg(test)]
mod tests;
