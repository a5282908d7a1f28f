//! Functional mode: [`SimWorld`] and its rank handles, [`SimRank`], which
//! implement `Backend` with real payloads on a virtual clock.
//!
//! # How it stays deterministic
//!
//! Every rank's call registers its schedule and buffers with the world, and
//! one engine (whichever rank's thread holds the world lock) processes
//! message events in virtual-time order. It only processes an event earlier
//! than the clock of every rank that is *not* inside a call: such a rank may
//! still send, but never earlier than its clock. So the order of events,
//! and therefore the trace and every result bit, depend only on the
//! programs, the configuration and the seed; not on how the OS schedules
//! the rank threads.
//!
//! # Timeouts and faults
//!
//! Each call has a virtual deadline (its start plus its timeout). A
//! receive that can never complete (a dropped message, a partition, a rank
//! that never calls) meets its deadline as a `Timeout` naming the peers it
//! waits on, unless comparing fingerprints with the other ranks finds one
//! in a different call at the same sequence number, which is a `Mismatch`
//! (mismatched ranks can wait on each other without a frame ever crossing). Virtual time
//! makes that wait free; a rank that never returns to the world at all is caught by the
//! same timeout in real time. A failed rank tells every peer (abort
//! propagation) and its group is poisoned: later calls fail fast with the
//! first cause.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap, HashSet, VecDeque},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use async_trait::async_trait;
use consort_comm::{
    Backend, Buffer, BufferMut, CallOptions, CommError, DType, ErrorContext, Fingerprint, GroupId,
    OpKind, ReduceOp, Result,
    algo::{
        Action, AlgoConfig, Schedule, Transmit, build,
        exec::{Call as CallReq, CallBuffers, scratch, scratch_bytes},
    },
};
use tokio::sync::Notify;

use crate::{
    cost::{Link, Topology},
    fault::{Fault, Rng, Trigger},
};

/// How a simulated world is built.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Number of ranks.
    pub world_size: usize,
    /// Seed of every random choice (probabilistic faults).
    pub seed: u64,
    /// Link model; `None`: every link is loopback TCP on the reference
    /// machine.
    pub topology: Option<Topology>,
    /// Segment size, window and algorithm overrides.
    pub algo: AlgoConfig,
    /// Default deadline of every call (virtual, and in real time for a rank
    /// that never arrives).
    pub timeout: Duration,
    /// The fault plan.
    pub faults: Vec<Fault>,
    /// Record the message trace.
    pub record_trace: bool,
}

impl SimConfig {
    /// `world_size` ranks, seed 0, no faults, a 60 s timeout, trace on.
    pub fn new(world_size: usize) -> Self {
        SimConfig {
            world_size,
            seed: 0,
            topology: None,
            algo: AlgoConfig::default(),
            timeout: Duration::from_secs(60),
            faults: Vec::new(),
            record_trace: true,
        }
    }

    /// Returns the config with `seed`.
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Returns the config with one more fault.
    #[must_use]
    pub fn fault(mut self, f: Fault) -> Self {
        self.faults.push(f);
        self
    }

    /// Returns the config with a default timeout.
    #[must_use]
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
}

/// What happened to a message, for the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TraceKind {
    /// Left the sender.
    Send,
    /// Reached the receiver.
    Deliver,
    /// Lost (drop fault, partition, dead receiver).
    Drop,
    /// A rank crashed (`from == to == rank`).
    Crash,
    /// A failed rank told a peer.
    Abort,
}

/// One entry of the message trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceEvent {
    /// Virtual time, nanoseconds since the world started.
    pub time_ns: u64,
    /// What happened.
    pub kind: TraceKind,
    /// Sender.
    pub from: usize,
    /// Receiver.
    pub to: usize,
    /// The call's sequence number (0 for point-to-point).
    pub seq: u64,
    /// The schedule's tag (the user tag for point-to-point).
    pub tag: u32,
    /// Payload bytes.
    pub bytes: usize,
}

#[derive(Clone, Copy)]
struct Raw {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Raw is only dereferenced under the world lock, while the call
// that lent the memory is registered (see `CallGuard`).
unsafe impl Send for Raw {}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum MailKey {
    Coll { from: usize, seq: u64, tag: u32 },
    P2p { from: usize, tag: u32 },
}

#[derive(Clone, Debug)]
enum Payload {
    Data(Vec<u8>),
    Abort(CommError, Fingerprint),
    Reset,
}

#[derive(Clone, Debug)]
struct Msg {
    from: usize,
    key: MailKey,
    fp: Fingerprint,
    payload: Payload,
    checksum: Option<u64>,
}

struct Call {
    id: u64,
    /// Whether the call's start event has been processed (before that,
    /// arriving frames wait in the mailbox).
    started: bool,
    fp: Fingerprint,
    ctx: ErrorContext,
    schedule: Schedule,
    p2p: bool,
    reduce: Option<ReduceOp>,
    dtype: DType,
    input: Raw,
    output: Raw,
    scratch: Vec<u64>,
    consumed: HashSet<(usize, u32)>,
    finalize: bool,
}

impl Call {
    /// The call's buffers. Only under the world lock while the call is
    /// registered.
    fn buffers(&mut self) -> CallBuffers<'_> {
        // SAFETY: the call is registered, so the lender's future is blocked
        // in it and its buffers are valid; the world lock is held, so no one
        // else touches them; `input` and `output` never overlap (they come
        // from a `&[u8]` and a `&mut [u8]` of one call).
        let (input, output) = unsafe {
            (
                std::slice::from_raw_parts(self.input.ptr, self.input.len),
                std::slice::from_raw_parts_mut(self.output.ptr, self.output.len),
            )
        };
        CallBuffers {
            dtype: self.dtype,
            input,
            output,
            scratch: scratch_bytes(&mut self.scratch),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Alive,
    Crashed,
    Exited,
}

struct RankState {
    /// The communication stream's clock: when the rank's last call ended.
    clock: u64,
    /// The host's clock, advanced by [`SimRank::compute`]; a call starts at
    /// the later of the two.
    host: u64,
    seq: u64,
    call: Option<Call>,
    /// The outcome of the last call, for its future to take.
    outcome: Option<Result<()>>,
    mailbox: HashMap<MailKey, VecDeque<Msg>>,
    poisoned: Option<CommError>,
    /// Peers whose connection reset (crashed or exited).
    lost: Vec<usize>,
    /// The fingerprint of the latest collective this rank entered.
    last_fp: Option<Fingerprint>,
    status: Status,
    nic_free: u64,
    sent: u64,
    events: u64,
    calls: u64,
    timeout: Duration,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct EventKey {
    time: u64,
    src: usize,
    counter: u64,
}

enum Event {
    Arrive { to: usize, msg: Box<Msg> },
    Start { rank: usize, call: u64 },
    Deadline { rank: usize, call: u64 },
    Crash { rank: usize },
}

struct State {
    n: usize,
    topo: Topology,
    algo: AlgoConfig,
    ranks: Vec<RankState>,
    queue: BinaryHeap<Reverse<(EventKey, u64)>>,
    pending: HashMap<u64, Event>,
    next_event: u64,
    faults: Vec<(Fault, u64)>,
    checksums: bool,
    rng: Rng,
    trace: Option<Vec<TraceEvent>>,
    wake: Vec<usize>,
}

struct Shared {
    state: Mutex<State>,
    notify: Vec<Notify>,
    /// Woken (all waiters) whenever the engine may have moved: hosts in
    /// [`SimRank::compute`] wait on it.
    moved: Notify,
}

fn ns(secs: f64) -> u64 {
    (secs * 1e9).round() as u64
}

fn dur_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn fnv(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl State {
    fn push(&mut self, time: u64, src: usize, ev: Event) {
        let counter = if src < self.n {
            let r = &mut self.ranks[src];
            r.events += 1;
            r.events
        } else {
            self.next_event
        };
        let id = self.next_event;
        self.next_event += 1;
        self.queue
            .push(Reverse((EventKey { time, src, counter }, id)));
        self.pending.insert(id, ev);
    }

    fn record(&mut self, e: TraceEvent) {
        if let Some(t) = &mut self.trace {
            t.push(e);
        }
    }

    /// Earliest time an idle rank could still send at.
    fn horizon(&self) -> u64 {
        self.ranks
            .iter()
            .filter(|r| r.status == Status::Alive && r.call.is_none())
            .map(|r| r.clock.max(r.host))
            .min()
            .unwrap_or(u64::MAX)
    }

    /// Processes every event that is safe to process.
    fn progress(&mut self) {
        loop {
            let horizon = self.horizon();
            let Some(Reverse((key, _))) = self.queue.peek() else {
                return;
            };
            if key.time >= horizon {
                return;
            }
            let Reverse((key, id)) = self.queue.pop().expect("peeked");
            let ev = self.pending.remove(&id).expect("event body");
            match ev {
                Event::Arrive { to, msg } => self.arrive(to, *msg, key.time),
                Event::Start { rank, call } => self.start(rank, call, key.time),
                Event::Deadline { rank, call } => self.deadline(rank, call, key.time),
                Event::Crash { rank } => self.crash(rank, key.time),
            }
        }
    }

    fn arrive(&mut self, to: usize, msg: Msg, t: u64) {
        let (seq, tag, bytes) = match (&msg.key, &msg.payload) {
            (MailKey::Coll { seq, tag, .. }, Payload::Data(d)) => (*seq, *tag, d.len()),
            (MailKey::P2p { tag, .. }, Payload::Data(d)) => (0, *tag, d.len()),
            _ => (msg.fp.seq, 0, 0),
        };
        if self.ranks[to].status != Status::Alive {
            self.record(TraceEvent {
                time_ns: t,
                kind: TraceKind::Drop,
                from: msg.from,
                to,
                seq,
                tag,
                bytes,
            });
            return;
        }
        self.record(TraceEvent {
            time_ns: t,
            kind: TraceKind::Deliver,
            from: msg.from,
            to,
            seq,
            tag,
            bytes,
        });
        match msg.payload {
            Payload::Reset => {
                let rank = &mut self.ranks[to];
                rank.lost.push(msg.from);
                // Only a call that still needs that peer fails now; the next
                // call fails at once (the group is broken).
                let needs = rank
                    .call
                    .as_ref()
                    .is_some_and(|c| c.schedule.waiting_on().contains(&msg.from));
                if needs {
                    self.fail(to, lost(msg.from), t, true);
                }
            }
            Payload::Abort(cause, remote_fp) => self.aborted(to, msg.from, cause, remote_fp, t),
            Payload::Data(ref data) => {
                if let Some(sum) = msg.checksum
                    && fnv(data) != sum
                {
                    let e = CommError::protocol(
                        Some(msg.from),
                        "payload checksum mismatch: the message was corrupted in transit",
                    );
                    self.fail(to, e, t, true);
                    return;
                }
                self.accept(to, msg, t);
            }
        }
    }

    /// A data message: match it with the current call or keep it.
    fn accept(&mut self, to: usize, msg: Msg, t: u64) {
        let r = &mut self.ranks[to];
        match msg.key {
            MailKey::Coll { from, seq, tag } => {
                let current = r
                    .call
                    .as_ref()
                    .filter(|c| !c.p2p && c.started)
                    .map(|c| c.fp.seq);
                if current == Some(seq) {
                    let call = r.call.as_ref().expect("current call");
                    if msg.fp != call.fp {
                        let e = CommError::Mismatch {
                            ctx: ErrorContext::default(),
                            local: call.fp,
                            remote: msg.fp,
                            remote_rank: from,
                        };
                        self.fail(to, e, t, true);
                        return;
                    }
                    if call.consumed.contains(&(from, tag)) {
                        let e = CommError::protocol(
                            Some(from),
                            format!("duplicate frame (seq {seq}, tag {tag})"),
                        );
                        self.fail(to, e, t, true);
                        return;
                    }
                    if call.schedule.is_posted(from, tag) {
                        self.complete_receive(to, from, tag, msg, t);
                        return;
                    }
                } else if seq
                    < r.call
                        .as_ref()
                        .filter(|c| !c.p2p)
                        .map_or(r.seq, |c| c.fp.seq)
                {
                    let e = CommError::protocol(
                        Some(from),
                        format!("stale or duplicate frame for finished call {seq}"),
                    );
                    self.fail(to, e, t, true);
                    return;
                }
                r.mailbox.entry(msg.key).or_default().push_back(msg);
            }
            MailKey::P2p { from, tag } => {
                let expecting = r
                    .call
                    .as_ref()
                    .is_some_and(|c| c.p2p && c.started && c.schedule.is_posted(from, tag));
                if expecting {
                    self.complete_receive(to, from, tag, msg, t);
                } else {
                    r.mailbox.entry(msg.key).or_default().push_back(msg);
                }
            }
        }
    }

    /// Applies a message to its posted receive and runs the schedule on.
    fn complete_receive(&mut self, r: usize, from: usize, tag: u32, msg: Msg, t: u64) {
        if self.take(r, from, tag, msg, t) {
            self.pump(r, t);
        }
    }

    /// Applies a message to its posted receive; on failure fails the rank
    /// and returns false.
    fn take(&mut self, r: usize, from: usize, tag: u32, msg: Msg, t: u64) -> bool {
        let Payload::Data(data) = msg.payload else {
            return false;
        };
        let Some(call) = self.ranks[r].call.as_ref() else {
            return false;
        };
        // Collectives compare whole fingerprints; point-to-point messages
        // (whose fingerprints differ by op) compare dtypes.
        let differs = if call.p2p {
            msg.fp.dtype != call.dtype
        } else {
            msg.fp != call.fp
        };
        if differs {
            let local = call.fp;
            let e = CommError::Mismatch {
                ctx: ErrorContext::default(),
                local,
                remote: msg.fp,
                remote_rank: from,
            };
            self.fail(r, e, t, true);
            return false;
        }
        match self.apply(r, from, tag, &data) {
            Ok(()) => true,
            Err(e) => {
                self.fail(r, e, t, true);
                false
            }
        }
    }

    fn apply(&mut self, r: usize, from: usize, tag: u32, data: &[u8]) -> Result<()> {
        let call = self.ranks[r].call.as_mut().expect("call");
        let rv = call
            .schedule
            .posted_receive(from, tag)
            .cloned()
            .ok_or_else(|| CommError::protocol(Some(from), "internal: receive vanished"))?;
        let op = call.reduce;
        call.buffers().apply(&rv, data, op, from)?;
        call.consumed.insert((from, tag));
        call.schedule
            .handle_recv(from, tag)
            .map_err(|e| CommError::protocol(Some(from), e.to_string()))
    }

    /// Runs rank `r`'s schedule from time `t` until it blocks or finishes.
    fn pump(&mut self, r: usize, t: u64) {
        loop {
            let Some(call) = self.ranks[r].call.as_mut() else {
                return;
            };
            let Some(action) = call.schedule.poll() else {
                if call.schedule.is_done() {
                    self.finish(r, t);
                }
                return;
            };
            match action {
                Action::Transmit(tx) => {
                    if self.ranks[r].lost.contains(&tx.to) {
                        self.fail(r, lost(tx.to), t, true);
                        return;
                    }
                    self.transmit(r, tx, t);
                }
                Action::Copy(c) => {
                    if let Err(e) = call.buffers().copy(&c) {
                        self.fail(r, e, t, true);
                        return;
                    }
                }
                Action::Receive(rv) => {
                    let key = if call.p2p {
                        MailKey::P2p {
                            from: rv.from,
                            tag: rv.tag,
                        }
                    } else {
                        MailKey::Coll {
                            from: rv.from,
                            seq: call.fp.seq,
                            tag: rv.tag,
                        }
                    };
                    let early = self.ranks[r]
                        .mailbox
                        .get_mut(&key)
                        .and_then(VecDeque::pop_front);
                    if let Some(msg) = early {
                        let left = self.ranks[r].mailbox.get(&key).map_or(0, VecDeque::len);
                        if left == 0 {
                            self.ranks[r].mailbox.remove(&key);
                        } else if matches!(key, MailKey::Coll { .. }) {
                            // A collective's (from, seq, tag) is unique: a
                            // second frame for it is a duplicate.
                            let e = CommError::protocol(
                                Some(rv.from),
                                format!("duplicate frame (seq {}, tag {})", msg.fp.seq, rv.tag),
                            );
                            self.fail(r, e, t, true);
                            return;
                        }
                        if !self.take(r, rv.from, rv.tag, msg, t) {
                            return;
                        }
                    } else if self.ranks[r].lost.contains(&rv.from) {
                        self.fail(r, lost(rv.from), t, true);
                        return;
                    }
                }
            }
            if self.ranks[r].status != Status::Alive {
                return;
            }
        }
    }

    fn transmit(&mut self, r: usize, tx: Transmit, t: u64) {
        let call = self.ranks[r].call.as_mut().expect("call");
        let data = call.buffers().bytes(tx.buf, &tx.range).to_vec();
        let (key, seq) = if call.p2p {
            (
                MailKey::P2p {
                    from: r,
                    tag: tx.tag,
                },
                0,
            )
        } else {
            (
                MailKey::Coll {
                    from: r,
                    seq: call.fp.seq,
                    tag: tx.tag,
                },
                call.fp.seq,
            )
        };
        let fp = call.fp;
        let bytes = data.len();
        let link: Link = self.topo.link(r, tx.to);
        let rank = &mut self.ranks[r];
        let start = t.max(rank.nic_free);
        rank.nic_free = start + ns(link.beta * bytes as f64);
        let mut arrive = rank.nic_free + ns(link.alpha);
        rank.sent += 1;
        let sent = rank.sent;
        self.record(TraceEvent {
            time_ns: t,
            kind: TraceKind::Send,
            from: r,
            to: tx.to,
            seq,
            tag: tx.tag,
            bytes,
        });

        // The fault plan.
        let mut copies = 1;
        let mut corrupt = false;
        let mut dropped = false;
        for i in 0..self.faults.len() {
            let (fault, _) = &self.faults[i];
            let filter = match fault {
                Fault::Drop(f)
                | Fault::Duplicate(f)
                | Fault::Corrupt(f)
                | Fault::Delay { filter: f, .. } => Some(*f),
                _ => None,
            };
            if let Some(f) = filter {
                if !f.matches_link(r, tx.to) {
                    continue;
                }
                let seen = self.faults[i].1;
                self.faults[i].1 += 1;
                if f.nth.is_some_and(|n| n != seen) {
                    continue;
                }
                if let Some(p) = f.probability
                    && self.rng.unit() >= p
                {
                    continue;
                }
                match &self.faults[i].0 {
                    Fault::Drop(_) => dropped = true,
                    Fault::Duplicate(_) => copies = 2,
                    Fault::Corrupt(_) => corrupt = true,
                    Fault::Delay { by, .. } => arrive += dur_ns(*by),
                    _ => {}
                }
                continue;
            }
            match fault {
                Fault::Partition {
                    a,
                    b,
                    from,
                    heal_at,
                } => {
                    let cut = (a.contains(&r) && b.contains(&tx.to))
                        || (b.contains(&r) && a.contains(&tx.to));
                    if cut && t >= dur_ns(*from) && heal_at.is_none_or(|h| t < dur_ns(h)) {
                        dropped = true;
                    }
                }
                Fault::Hold {
                    from,
                    to,
                    at,
                    release_at,
                } if *from == r && *to == tx.to && t >= dur_ns(*at) && t < dur_ns(*release_at) => {
                    arrive = arrive.max(dur_ns(*release_at));
                }
                _ => {}
            }
        }
        if dropped {
            self.record(TraceEvent {
                time_ns: t,
                kind: TraceKind::Drop,
                from: r,
                to: tx.to,
                seq,
                tag: tx.tag,
                bytes,
            });
        } else {
            let checksum = self.checksums.then(|| fnv(&data));
            let mut data = data;
            if corrupt {
                match data.first_mut() {
                    Some(b) => *b ^= 0x40,
                    None => data.push(0), // an empty payload gains a byte: still detected
                }
            }
            let msg = Msg {
                from: r,
                key,
                fp,
                payload: Payload::Data(data),
                checksum,
            };
            for _ in 0..copies {
                self.push(
                    arrive,
                    r,
                    Event::Arrive {
                        to: tx.to,
                        msg: Box::new(msg.clone()),
                    },
                );
            }
        }
        // A crash triggered by message count happens right after the send.
        let crash_now = self.faults.iter().any(|(f, _)| matches!(f, Fault::Crash { rank, at: Trigger::AfterMessages(k) } if *rank == r && *k == sent));
        if crash_now {
            self.crash(r, t);
        }
    }

    fn finish(&mut self, r: usize, t: u64) {
        let n = self.n;
        let rank = &mut self.ranks[r];
        let mut call = rank.call.take().expect("call");
        let mut out = Ok(());
        if call.finalize
            && let Some(op) = call.reduce
        {
            let ctx = call.ctx;
            out = call
                .buffers()
                .finalize(op, n)
                .map_err(|e| e.with_context(ctx));
        }
        rank.clock = rank.clock.max(t);
        rank.outcome = Some(out);
        self.wake.push(r);
    }

    /// Fails rank `r`'s current call (if any) and poisons its group; with
    /// `propagate`, tells every live peer.
    fn fail(&mut self, r: usize, err: CommError, t: u64, propagate: bool) {
        let rank = &mut self.ranks[r];
        if rank.poisoned.is_some() && rank.call.is_none() {
            return;
        }
        let ctx = rank.call.as_ref().map(|c| c.ctx).unwrap_or_default();
        let fp = rank.call.as_ref().map(|c| c.fp);
        let err = err.with_context(ctx).with_context(ErrorContext {
            rank: Some(r),
            ..Default::default()
        });
        if rank.poisoned.is_none() {
            rank.poisoned = Some(err.clone());
        }
        if rank.call.take().is_some() {
            rank.outcome = Some(Err(err.clone()));
            rank.clock = rank.clock.max(t);
            self.wake.push(r);
        }
        if propagate {
            let fp = fp.unwrap_or(Fingerprint {
                group: GroupId::WORLD,
                seq: 0,
                op: OpKind::Barrier,
                dtype: DType::U8,
                count: 0,
                root: 0,
                reduce_op: None,
            });
            for q in 0..self.n {
                if q != r && self.ranks[q].status == Status::Alive {
                    let at = t + ns(self.topo.link(r, q).alpha);
                    self.record(TraceEvent {
                        time_ns: t,
                        kind: TraceKind::Abort,
                        from: r,
                        to: q,
                        seq: fp.seq,
                        tag: 0,
                        bytes: 0,
                    });
                    let msg = Msg {
                        from: r,
                        key: MailKey::P2p {
                            from: r,
                            tag: u32::MAX,
                        },
                        fp,
                        payload: Payload::Abort(err.clone(), fp),
                        checksum: None,
                    };
                    self.push(
                        at,
                        r,
                        Event::Arrive {
                            to: q,
                            msg: Box::new(msg),
                        },
                    );
                }
            }
        }
    }

    /// A peer failed and said so.
    fn aborted(&mut self, r: usize, from: usize, cause: CommError, remote_fp: Fingerprint, t: u64) {
        if self.ranks[r].poisoned.is_some() {
            return;
        }
        let own = self.ranks[r].call.as_ref().map(|c| c.fp);
        let err = match (&cause, own) {
            (
                CommError::Mismatch {
                    local,
                    remote,
                    remote_rank,
                    ..
                },
                Some(mine),
            ) => {
                if mine == *local {
                    CommError::Mismatch {
                        ctx: ErrorContext::default(),
                        local: mine,
                        remote: *remote,
                        remote_rank: *remote_rank,
                    }
                } else {
                    CommError::Mismatch {
                        ctx: ErrorContext::default(),
                        local: mine,
                        remote: remote_fp,
                        remote_rank: from,
                    }
                }
            }
            (CommError::PeerLost { peer, reason, .. }, _) => CommError::PeerLost {
                ctx: ErrorContext::default(),
                peer: *peer,
                reason: reason.clone(),
            },
            (CommError::Timeout { after, .. }, Some(_)) => {
                let waiting_on = self.ranks[r]
                    .call
                    .as_ref()
                    .map(|c| c.schedule.waiting_on())
                    .unwrap_or_default();
                CommError::Timeout {
                    ctx: ErrorContext::default(),
                    after: *after,
                    waiting_on,
                }
            }
            _ => CommError::Aborted {
                ctx: ErrorContext::default(),
                cause: format!("rank {from} failed: {cause}"),
            },
        };
        self.fail(r, err, t, false);
    }

    fn start(&mut self, r: usize, id: u64, t: u64) {
        match self.ranks[r].call.as_mut() {
            Some(call) if call.id == id => call.started = true,
            _ => return,
        }
        self.pump(r, t);
    }

    fn deadline(&mut self, r: usize, id: u64, t: u64) {
        let rank = &self.ranks[r];
        let Some(call) = rank.call.as_ref() else {
            return;
        };
        if call.id != id {
            return;
        }
        // A stalled call compares fingerprints with every rank's call at the
        // same sequence number (a backend does this through the store): a
        // rank inside a different call is a mismatch that no frame revealed,
        // because mismatched ranks can each wait on the other, directly or
        // down a chain. The peers it waits on are checked first.
        let waiting_on = call.schedule.waiting_on();
        let others = (0..self.n).filter(|p| *p != r && !waiting_on.contains(p));
        let probe = waiting_on.iter().copied().chain(others).find_map(|p| {
            let pfp = self.ranks[p].last_fp?;
            (!call.p2p && pfp.seq == call.fp.seq && pfp != call.fp).then_some((p, pfp))
        });
        let e = match probe {
            Some((p, remote)) => CommError::Mismatch {
                ctx: ErrorContext::default(),
                local: call.fp,
                remote,
                remote_rank: p,
            },
            None => CommError::Timeout {
                ctx: ErrorContext::default(),
                after: rank.timeout,
                waiting_on,
            },
        };
        self.fail(r, e, t, true);
    }

    fn crash(&mut self, r: usize, t: u64) {
        if self.ranks[r].status != Status::Alive {
            return;
        }
        self.record(TraceEvent {
            time_ns: t,
            kind: TraceKind::Crash,
            from: r,
            to: r,
            seq: self.ranks[r].seq,
            tag: 0,
            bytes: 0,
        });
        let e = CommError::Aborted {
            ctx: ErrorContext::default(),
            cause: format!("rank {r} was crashed by the simulator's fault plan"),
        };
        self.fail(r, e, t, false);
        self.ranks[r].status = Status::Crashed;
        self.reset_peers(r, t);
    }

    /// The process of rank `r` is gone: every survivor's connection resets.
    fn reset_peers(&mut self, r: usize, t: u64) {
        // The reset follows whatever the rank had already queued, as a FIN
        // follows the data on a TCP connection.
        let t = t.max(self.ranks[r].nic_free);
        let fp = Fingerprint {
            group: GroupId::WORLD,
            seq: 0,
            op: OpKind::Barrier,
            dtype: DType::U8,
            count: 0,
            root: 0,
            reduce_op: None,
        };
        for q in 0..self.n {
            if q != r && self.ranks[q].status == Status::Alive {
                let at = t + ns(self.topo.link(r, q).alpha);
                let msg = Msg {
                    from: r,
                    key: MailKey::P2p {
                        from: r,
                        tag: u32::MAX,
                    },
                    fp,
                    payload: Payload::Reset,
                    checksum: None,
                };
                self.push(
                    at,
                    r,
                    Event::Arrive {
                        to: q,
                        msg: Box::new(msg),
                    },
                );
            }
        }
    }
}

fn lost(peer: usize) -> CommError {
    CommError::PeerLost {
        ctx: ErrorContext::default(),
        peer,
        reason: "connection reset: its process exited or crashed".into(),
    }
}

/// A simulated world of N ranks in one process.
///
/// ```
/// # async fn demo() -> consort_comm::Result<()> {
/// use consort_comm::{ProcessGroup, ReduceOp};
/// use consort_sim::{SimConfig, SimWorld};
///
/// let world = SimWorld::new(SimConfig::new(4))?;
/// let tasks: Vec<_> = world.ranks().into_iter().map(|rank| async move {
///     let pg = ProcessGroup::new(std::sync::Arc::new(rank));
///     let mut x = vec![pg.rank() as f32; 8];
///     pg.all_reduce(&mut x, ReduceOp::Sum).await?;
///     assert_eq!(x, vec![6.0; 8]);
///     Ok::<_, consort_comm::CommError>(())
/// }).collect();
/// for t in tasks { t.await?; } // (run them concurrently in real code)
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SimWorld {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SimWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimWorld")
            .field("world_size", &self.shared.notify.len())
            .finish()
    }
}

impl SimWorld {
    /// Builds the world. Errors on an empty world or a fault naming a rank
    /// that does not exist.
    pub fn new(cfg: SimConfig) -> Result<Self> {
        let n = cfg.world_size;
        if n == 0 {
            return Err(CommError::invalid(
                "a simulated world needs at least one rank",
            ));
        }
        let topo = cfg
            .topology
            .unwrap_or_else(|| Topology::flat(n, Link::loopback_tcp()));
        if topo.world_size() != n {
            return Err(CommError::invalid(format!(
                "topology has {} ranks ({} nodes x {}) but the world has {n}",
                topo.world_size(),
                topo.nodes,
                topo.ranks_per_node
            )));
        }
        for f in &cfg.faults {
            let bad = match f {
                Fault::Crash { rank, .. } => *rank >= n,
                Fault::Hold { from, to, .. } => *from >= n || *to >= n,
                Fault::Partition { a, b, .. } => a.iter().chain(b).any(|r| *r >= n),
                _ => false,
            };
            if bad {
                return Err(CommError::invalid(format!(
                    "fault {f:?} names a rank outside a world of {n}"
                )));
            }
        }
        let ranks = (0..n)
            .map(|_| RankState {
                clock: 0,
                host: 0,
                seq: 0,
                call: None,
                outcome: None,
                mailbox: HashMap::new(),
                poisoned: None,
                lost: Vec::new(),
                last_fp: None,
                status: Status::Alive,
                nic_free: 0,
                sent: 0,
                events: 0,
                calls: 0,
                timeout: cfg.timeout,
            })
            .collect();
        let checksums = cfg.faults.iter().any(|f| matches!(f, Fault::Corrupt(_)));
        let mut state = State {
            n,
            topo,
            algo: cfg.algo.clone(),
            ranks,
            queue: BinaryHeap::new(),
            pending: HashMap::new(),
            next_event: 0,
            faults: cfg.faults.iter().cloned().map(|f| (f, 0)).collect(),
            checksums,
            rng: Rng::new(cfg.seed),
            trace: cfg.record_trace.then(Vec::new),
            wake: Vec::new(),
        };
        for f in &cfg.faults {
            if let Fault::Crash {
                rank,
                at: Trigger::At(t),
            } = f
            {
                state.push(dur_ns(*t), n, Event::Crash { rank: *rank });
            }
        }
        Ok(SimWorld {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                notify: (0..n).map(|_| Notify::new()).collect(),
                moved: Notify::new(),
            }),
        })
    }

    /// One handle per rank, in rank order. Each handle implements `Backend`
    /// and can be moved to its own task or thread.
    pub fn ranks(&self) -> Vec<SimRank> {
        (0..self.shared.notify.len())
            .map(|rank| SimRank {
                shared: self.shared.clone(),
                rank,
            })
            .collect()
    }

    /// The message trace so far (empty when recording is off).
    pub fn trace(&self) -> Vec<TraceEvent> {
        lock(&self.shared).trace.clone().unwrap_or_default()
    }

    /// The latest rank clock: the simulated time the program has taken.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(
            lock(&self.shared)
                .ranks
                .iter()
                .map(|r| r.clock.max(r.host))
                .max()
                .unwrap_or(0),
        )
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // A panic under the lock leaves the world in an unknown state; the
    // panic itself is the report, so later users just proceed.
    shared.state.lock().unwrap_or_else(|p| p.into_inner())
}

/// One rank of a [`SimWorld`]. Dropping it is the rank's process exiting:
/// peers that still need it see `PeerLost`.
pub struct SimRank {
    shared: Arc<Shared>,
    rank: usize,
}

impl std::fmt::Debug for SimRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimRank").field("rank", &self.rank).finish()
    }
}

impl Drop for SimRank {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        let r = self.rank;
        if s.ranks[r].status == Status::Alive {
            s.ranks[r].status = Status::Exited;
            let t = s.ranks[r].clock;
            s.reset_peers(r, t);
            s.progress();
            wake(&self.shared, &mut s);
        }
    }
}

fn wake(shared: &Shared, s: &mut State) {
    for r in s.wake.drain(..) {
        shared.notify[r].notify_one();
    }
    shared.moved.notify_waiters();
}

/// Unregisters a call whose future is dropped before it completes, so the
/// world never touches its buffers again.
struct CallGuard<'a> {
    shared: &'a Shared,
    rank: usize,
    armed: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut s = lock(self.shared);
        if s.ranks[self.rank].call.is_some() {
            let t = s.ranks[self.rank].clock;
            let e = CommError::Aborted {
                ctx: ErrorContext::default(),
                cause: "a call was cancelled (its future dropped) before it finished".into(),
            };
            s.fail(self.rank, e, t, true);
            s.ranks[self.rank].outcome = None;
            s.progress();
            wake(self.shared, &mut s);
        }
    }
}

impl SimRank {
    /// Models `d` of host computation (a layer's backward, say) on this
    /// rank's virtual clock, concurrently with whatever call its
    /// communication stream has in flight: calls issued later start no
    /// earlier than the new host time.
    ///
    /// It first yields to the runtime, so that a communication task on the
    /// same current-thread runtime (DDP's bucket worker) issues work handed
    /// to it at the current host time; then it advances the host clock and
    /// returns once every event before the new host time has been
    /// processed, yielding once more so that the task sees calls that ended
    /// in the meantime and issues its next one at the time it would have. Real-time limit: the
    /// rank's default timeout, in case no other rank ever moves.
    pub async fn compute(&self, d: Duration) {
        // Work issued before this computation (a bucket handed to a
        // communication task) starts at the current host time.
        tokio::task::yield_now().await;
        let deadline = {
            let mut s = lock(&self.shared);
            let rank = &mut s.ranks[self.rank];
            rank.host = rank.host.saturating_add(dur_ns(d));
            let timeout = rank.timeout;
            s.progress();
            wake(&self.shared, &mut s);
            consort_comm::time::deadline(timeout)
        };
        loop {
            let moved = self.shared.moved.notified();
            {
                let s = lock(&self.shared);
                let host = s.ranks[self.rank].host;
                let settled = s.ranks[self.rank].call.is_none()
                    || s.queue.peek().is_none_or(|Reverse((k, _))| k.time >= host);
                if settled {
                    break;
                }
            }
            if consort_comm::time::before(deadline, moved).await.is_none() {
                break;
            }
        }
        tokio::task::yield_now().await;
    }

    /// The host waits for its communication stream (like
    /// `cudaStreamSynchronize`): the host clock catches up with the end of
    /// the last call. Call it after awaiting work that another task issued.
    pub fn synchronize(&self) {
        let mut s = lock(&self.shared);
        let rank = &mut s.ranks[self.rank];
        rank.host = rank.host.max(rank.clock);
    }

    /// This rank's virtual time: the later of its host and communication
    /// clocks.
    pub fn now(&self) -> Duration {
        let s = lock(&self.shared);
        let rank = &s.ranks[self.rank];
        Duration::from_nanos(rank.clock.max(rank.host))
    }

    fn ctx(&self, op: OpKind, seq: u64) -> ErrorContext {
        ErrorContext::new(op, self.rank, seq, GroupId::WORLD)
    }

    async fn run(&self, req: CallReq<'_>, opts: &CallOptions) -> Result<()> {
        let r = self.rank;
        let p2p = req.is_p2p();
        let deadline_real;
        {
            let mut s = lock(&self.shared);
            let n = s.n;
            let seq = if p2p { 0 } else { s.ranks[r].seq };
            let ctx = self.ctx(req.op, seq);
            if let Some(e) = &s.ranks[r].poisoned {
                return Err(e.to_aborted().with_context(ctx));
            }
            if s.ranks[r].status != Status::Alive {
                return Err(CommError::Aborted {
                    ctx,
                    cause: "this rank has crashed".into(),
                });
            }
            if let Some(&peer) = s.ranks[r].lost.first() {
                let e = lost(peer).with_context(ctx);
                s.ranks[r].poisoned = Some(e.clone());
                return Err(e);
            }
            if s.ranks[r].call.is_some() {
                return Err(CommError::invalid(
                    "this rank already has a call in flight; await each op before starting the next \
                     (every rank must issue its collectives in one order)",
                )
                .with_context(ctx));
            }
            let spec = req.spec(r, n);
            let algo = s.algo.select(req.op, spec.bytes(), n);
            let schedule = build(&spec, algo, &s.algo).map_err(|e| e.with_context(ctx))?;
            let scratch = scratch(schedule.scratch_len(), req.dtype);
            let fp = req.fingerprint(GroupId::WORLD, seq);
            let timeout = opts.timeout_or(s.ranks[r].timeout);
            if !p2p {
                s.ranks[r].seq += 1;
                s.ranks[r].last_fp = Some(fp);
            }
            let t = s.ranks[r].clock.max(s.ranks[r].host);
            s.ranks[r].outcome = None;
            s.ranks[r].calls += 1;
            let id = s.ranks[r].calls;
            s.ranks[r].call = Some(Call {
                id,
                started: false,
                fp,
                ctx,
                schedule,
                p2p,
                reduce: req.reduce,
                dtype: req.dtype,
                input: raw_in(req.input),
                output: raw_out(req.output),
                scratch,
                consumed: HashSet::new(),
                finalize: req.finalize,
            });
            s.push(
                t.saturating_add(dur_ns(timeout)),
                r,
                Event::Deadline { rank: r, call: id },
            );
            // The call starts at this rank's clock, in virtual-time order
            // with everything else (not now, in real time).
            s.push(t, r, Event::Start { rank: r, call: id });
            s.progress();
            wake(&self.shared, &mut s);
            deadline_real = consort_comm::time::deadline(timeout);
        }
        let mut guard = CallGuard {
            shared: &self.shared,
            rank: r,
            armed: true,
        };
        loop {
            let notified = self.shared.notify[r].notified();
            {
                let mut s = lock(&self.shared);
                if s.ranks[r].call.is_none() {
                    guard.armed = false;
                    return s.ranks[r].outcome.take().unwrap_or(Ok(()));
                }
            }
            if consort_comm::time::before(deadline_real, notified)
                .await
                .is_none()
            {
                let mut s = lock(&self.shared);
                if let Some(call) = s.ranks[r].call.as_ref() {
                    // Virtual time stands still while a rank stays out of
                    // every call, so the schedule may not even have
                    // started: then the ranks holding it up are those.
                    let mut waiting_on = call.schedule.waiting_on();
                    if waiting_on.is_empty() {
                        waiting_on = (0..s.n)
                            .filter(|&p| {
                                p != r
                                    && s.ranks[p].status == Status::Alive
                                    && s.ranks[p].call.is_none()
                            })
                            .collect();
                    }
                    let e = CommError::Timeout {
                        ctx: ErrorContext::default(),
                        after: opts.timeout_or(s.ranks[r].timeout),
                        waiting_on,
                    };
                    let t = s.ranks[r].clock;
                    s.fail(r, e, t, true);
                    s.progress();
                    wake(&self.shared, &mut s);
                }
            }
        }
    }
}

fn raw_in(b: &[u8]) -> Raw {
    Raw {
        ptr: b.as_ptr().cast_mut(),
        len: b.len(),
    }
}

fn raw_out(b: &mut [u8]) -> Raw {
    Raw {
        ptr: b.as_mut_ptr(),
        len: b.len(),
    }
}

#[async_trait]
impl Backend for SimRank {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.notify.len()
    }

    fn default_timeout(&self) -> Duration {
        lock(&self.shared).ranks[self.rank].timeout
    }

    async fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp, opts: &CallOptions) -> Result<()> {
        self.run(CallReq::all_reduce("sim", self.rank, buf, op)?, opts)
            .await
    }

    async fn broadcast(&self, buf: BufferMut<'_>, opts: &CallOptions) -> Result<()> {
        let n = self.world_size();
        self.run(CallReq::broadcast("sim", self.rank, n, buf, opts)?, opts)
            .await
    }

    async fn reduce(&self, buf: BufferMut<'_>, op: ReduceOp, opts: &CallOptions) -> Result<()> {
        let n = self.world_size();
        self.run(CallReq::reduce("sim", self.rank, n, buf, op, opts)?, opts)
            .await
    }

    async fn all_gather(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        opts: &CallOptions,
    ) -> Result<()> {
        let n = self.world_size();
        self.run(
            CallReq::all_gather("sim", self.rank, n, output, input)?,
            opts,
        )
        .await
    }

    async fn gather(
        &self,
        output: Option<BufferMut<'_>>,
        input: Buffer<'_>,
        opts: &CallOptions,
    ) -> Result<()> {
        let n = self.world_size();
        self.run(
            CallReq::gather("sim", self.rank, n, output, input, opts)?,
            opts,
        )
        .await
    }

    async fn scatter(
        &self,
        output: BufferMut<'_>,
        input: Option<Buffer<'_>>,
        opts: &CallOptions,
    ) -> Result<()> {
        let n = self.world_size();
        self.run(
            CallReq::scatter("sim", self.rank, n, output, input, opts)?,
            opts,
        )
        .await
    }

    async fn reduce_scatter(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<()> {
        let n = self.world_size();
        self.run(
            CallReq::reduce_scatter("sim", self.rank, n, output, input, op)?,
            opts,
        )
        .await
    }

    async fn all_to_all_single(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
        opts: &CallOptions,
    ) -> Result<()> {
        let n = self.world_size();
        let call = CallReq::all_to_all(
            "sim",
            self.rank,
            n,
            output,
            input,
            output_split_sizes,
            input_split_sizes,
        )?;
        self.run(call, opts).await
    }

    async fn barrier(&self, opts: &CallOptions) -> Result<()> {
        self.run(CallReq::barrier(), opts).await
    }

    async fn send(&self, buf: Buffer<'_>, dst: usize, opts: &CallOptions) -> Result<()> {
        let n = self.world_size();
        self.run(CallReq::send("sim", self.rank, n, buf, dst, opts)?, opts)
            .await
    }

    async fn recv(&self, buf: BufferMut<'_>, src: usize, opts: &CallOptions) -> Result<()> {
        let n = self.world_size();
        self.run(CallReq::recv("sim", self.rank, n, buf, src, opts)?, opts)
            .await
    }
}
