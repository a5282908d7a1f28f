//! Functional mode: [`SimWorld`] and its rank handles, [`SimRank`], which
//! implement `Backend` with real payloads on a virtual clock.
//!
//! This module owns the world's state and its event queue; `rules` turns
//! events into progress through the call engine ([`consort_comm::engine`],
//! the same rules the TCP and QUIC driver follow), and `rank` is the
//! `Backend` face.
//!
//! # How it stays deterministic
//!
//! Every rank's call registers its schedule and buffers with the world, and
//! whichever rank's thread holds the world lock processes message events in
//! virtual-time order. It only processes an event earlier than the clock of
//! every rank that has *no* call in flight: such a rank may still send, but
//! never earlier than its clock. So the order of events, and therefore the
//! trace and every result bit, depend only on the programs, the
//! configuration and the seed; not on how the OS schedules the rank threads.
//!
//! # Several calls, and subgroups
//!
//! A rank may have several calls in flight (on one group or several); they
//! run one at a time on the rank's communication stream, in the order they
//! were made, as NCCL runs a communicator's work on one stream. Subgroups
//! share the world's links; their calls carry their own group id and
//! sequence numbers.
//!
//! # Timeouts and faults
//!
//! Each call has a virtual deadline (its start plus its timeout). A
//! receive that can never complete (a dropped message, a partition, a rank
//! that never calls) meets its deadline as a `Timeout` naming the peers it
//! waits on, unless comparing fingerprints with the other ranks finds one
//! in a different call at the same sequence number, which is a `Mismatch`
//! (mismatched ranks can wait on each other without a frame ever crossing).
//! Virtual time makes that wait free; a rank that never returns to the
//! world at all is caught by the same timeout in real time. A failed rank
//! tells the group's other members (abort propagation, as an encoded
//! `AbortInfo`, as on the wire) and its group is poisoned: later calls fail
//! fast with the first cause.

mod rank;
mod rules;

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap, HashSet, VecDeque},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use consort_comm::{
    CommError, DType, ErrorContext, Fingerprint, GroupId, ReduceOp, Result,
    algo::{AlgoConfig, Schedule, exec::CallBuffers, exec::scratch_bytes},
    engine::{CallId, Engine},
    frame::AbortInfo,
};
use tokio::sync::Notify;

pub use rank::SimRank;

use crate::{
    cost::{Link, Topology},
    fault::{Fault, FaultPlan, Rng, Trigger},
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

#[derive(Clone, Debug)]
enum Payload {
    Data(Vec<u8>),
    Abort(AbortInfo),
    Reset,
}

#[derive(Clone, Debug)]
struct Msg {
    from: usize,
    fp: Fingerprint,
    tag: u32,
    payload: Payload,
    checksum: Option<u64>,
}

/// A copy of a caller's bytes in 8-aligned storage, so that every dtype's
/// elements can be read in place (as from the caller's own buffer).
#[derive(Default)]
struct Owned {
    words: Vec<u64>,
    len: usize,
}

impl Owned {
    fn copy_of(bytes: &[u8]) -> Owned {
        let mut o = Owned {
            words: vec![0; bytes.len().div_ceil(8)],
            len: bytes.len(),
        };
        o.bytes_mut().copy_from_slice(bytes);
        o
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut scratch_bytes(&mut self.words)[..self.len]
    }
}

/// A call made on a rank, active or waiting its turn on the stream.
struct Call {
    /// The world's id of the call (for its start and deadline events).
    id: u64,
    /// The engine's handle.
    eid: CallId,
    /// Whether the call's start event has been processed (before that,
    /// arriving frames wait in the engine's mailbox).
    started: bool,
    /// The host time it was made at: it starts no earlier (nor before the
    /// call ahead of it on the stream ends).
    issued: u64,
    group: GroupId,
    /// World rank of each group rank.
    members: Arc<[usize]>,
    fp: Fingerprint,
    schedule: Schedule,
    p2p: bool,
    reduce: Option<ReduceOp>,
    dtype: DType,
    /// A copy of the caller's input (scaled, for a pre-multiplied
    /// reduce_scatter). The call owns its buffers: other ranks' tasks move
    /// the world on, and they must never write into memory that a caller
    /// may have taken back by leaking the call's future.
    input: Owned,
    /// The output, copied from the caller's and copied back by the
    /// caller's future when the call succeeds.
    output: Owned,
    scratch: Vec<u64>,
    finalize: bool,
    timeout: Duration,
}

impl Call {
    /// The call's buffers.
    fn buffers(&mut self) -> CallBuffers<'_> {
        CallBuffers {
            dtype: self.dtype,
            input: self.input.bytes(),
            output: self.output.bytes_mut(),
            scratch: scratch_bytes(&mut self.scratch),
        }
    }

    /// The group rank of world rank `w`.
    fn group_rank(&self, w: usize) -> Option<usize> {
        self.members.iter().position(|&m| m == w)
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
    /// The call running on the stream.
    call: Option<Call>,
    /// Calls made after it, in order.
    queue: VecDeque<Call>,
    /// Outcomes of finished calls, by id, for their futures to take.
    /// Ended calls' results: a success carries the output bytes, which
    /// the caller's future copies into the caller's buffer.
    outcomes: HashMap<u64, Result<Owned>>,
    /// The call rules: groups, sequence numbers, mailbox, poisoning.
    engine: Engine<Vec<u8>>,
    status: Status,
    nic_free: u64,
    /// When this rank's last message to each rank arrives (a reset follows
    /// it, as a FIN follows the data).
    last_arrive: Vec<u64>,
    sent: u64,
    events: u64,
    calls: u64,
    timeout: Duration,
}

impl RankState {
    fn busy(&self) -> bool {
        self.call.is_some() || !self.queue.is_empty()
    }
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
    faults: FaultPlan,
    checksums: bool,
    rng: Rng,
    trace: Option<Vec<TraceEvent>>,
    wake: HashSet<usize>,
    /// Virtual time 0 as an `Instant`: the engine takes time as one.
    epoch: std::time::Instant,
}

impl State {
    /// Virtual time `t` (ns) as the engine's clock reads it.
    fn instant(&self, t: u64) -> std::time::Instant {
        self.epoch + Duration::from_nanos(t)
    }

    /// An engine instant as virtual time (ns).
    fn virtual_ns(&self, at: std::time::Instant) -> u64 {
        dur_ns(at.saturating_duration_since(self.epoch))
    }
}

struct Shared {
    state: Mutex<State>,
    notify: Vec<Notify>,
    /// Woken (all waiters) whenever the world may have moved: hosts in
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
            .filter(|r| r.status == Status::Alive && !r.busy())
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
            let Some(Reverse((key, id))) = self.queue.pop() else {
                return;
            };
            let Some(ev) = self.pending.remove(&id) else {
                continue;
            };
            match ev {
                Event::Arrive { to, msg } => self.arrive(to, *msg, key.time),
                Event::Start { rank, call } => self.start(rank, call, key.time),
                Event::Deadline { rank, call } => self.deadline(rank, call, key.time),
                Event::Crash { rank } => self.crash(rank, key.time),
            }
        }
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

/// The world's topology, after checking the configuration: at least one
/// rank, a topology of the world's size, faults naming ranks inside it.
fn checked_topology(cfg: &SimConfig) -> Result<Topology> {
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
    Ok(topo)
}

impl SimWorld {
    /// Builds the world. Errors on an empty world or a fault naming a rank
    /// that does not exist.
    pub fn new(cfg: SimConfig) -> Result<Self> {
        let n = cfg.world_size;
        let topo = checked_topology(&cfg)?;
        let ranks = (0..n)
            .map(|r| RankState {
                clock: 0,
                host: 0,
                call: None,
                queue: VecDeque::new(),
                outcomes: HashMap::new(),
                engine: Engine::new(r, n),
                status: Status::Alive,
                nic_free: 0,
                last_arrive: vec![0; n],
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
            faults: FaultPlan::new(cfg.faults.iter().cloned()),
            checksums,
            rng: Rng::new(cfg.seed),
            trace: cfg.record_trace.then(Vec::new),
            wake: HashSet::new(),
            epoch: std::time::Instant::now(),
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
        let n = self.shared.notify.len();
        let members: Arc<[usize]> = (0..n).collect();
        (0..n)
            .map(|rank| SimRank {
                shared: self.shared.clone(),
                rank,
                group: GroupId::WORLD,
                members: members.clone(),
                me: rank,
                timeout: None,
                owner: true,
            })
            .collect()
    }

    /// Spawns `f(rank)` for every rank as a tokio task (on the current
    /// runtime), in rank order: a program's SPMD body on each simulated
    /// rank. Await the handles for each rank's output.
    pub fn spawn_each<F, Fut>(&self, mut f: F) -> Vec<tokio::task::JoinHandle<Fut::Output>>
    where
        F: FnMut(SimRank) -> Fut,
        Fut: std::future::Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        self.ranks()
            .into_iter()
            .map(|r| tokio::spawn(f(r)))
            .collect()
    }

    /// Runs `f(rank)` for every rank to its end on a runtime of its own
    /// (one thread, as the simulator's virtual time wants) and returns each
    /// rank's output in rank order: the SPMD body of a test or an example,
    /// without a runtime to set up. A rank whose task panicked panics here
    /// with its payload. Call it outside any runtime.
    pub fn run_each<F, Fut>(&self, f: F) -> std::io::Result<Vec<Fut::Output>>
    where
        F: FnMut(SimRank) -> Fut,
        Fut: std::future::Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(rt.block_on(async {
            let mut out = Vec::new();
            for t in self.spawn_each(f) {
                match t.await {
                    Ok(v) => out.push(v),
                    Err(e) => match e.try_into_panic() {
                        Ok(p) => std::panic::resume_unwind(p),
                        Err(e) => panic!("a simulated rank's task was cancelled: {e}"),
                    },
                }
            }
            out
        }))
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
    consort_comm::lock(&shared.state)
}

fn wake(shared: &Shared, s: &mut State) {
    for r in s.wake.drain() {
        shared.notify[r].notify_waiters();
    }
    shared.moved.notify_waiters();
}

fn lost(peer: usize) -> CommError {
    CommError::PeerLost {
        ctx: ErrorContext::default(),
        peer,
        reason: "connection reset: its process exited or crashed".into(),
    }
}
