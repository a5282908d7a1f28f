//! The driver: [`MeshBackend`] runs `consort_comm::algo`'s schedules and
//! the call engine's rules over whatever links the transports hand it.
//!
//! Like quinn's connection driver it holds no rules of its own: the call
//! engine (`consort_comm::engine`) owns sequence numbers, early frames,
//! mismatches, poisoning and aborts; the schedules own who sends what. This
//! module moves frames between them and the links:
//!
//! - [`read`] runs one reader task per stream and decodes frames;
//! - [`poll`] takes frames from polled (shared-memory) links, from inside
//!   the calls that wait on them;
//! - [`inbound`] files a decoded frame: in place into a posted receive, with
//!   the engine, or as a probe or an abort;
//! - [`drive`] sends frames, starts and ends calls; [`call`] runs one;
//!   [`poll::pump`] owns the engine's clock;
//! - [`registry`] holds the receives links may fill in place, and the rule
//!   that keeps that sound when a caller leaks a call;
//! - [`stage`] sends a fan-out's segments through this rank's stage, one
//!   copy for all its same-host readers.
//!
//! The engine sits behind a mutex, locked briefly (never across an await)
//! by the readers and by the calls, as quinn keeps `proto::Connection` in
//! a `Mutex<State>` shared by its connection driver and its stream handles:
//! a call drives its own schedule in the caller's task, because its future
//! borrows the caller's buffers and a hand-off to a driver task would cost
//! every call two cross-task wake-ups (see DESIGN.md).
//!
//! # Driving order
//!
//! 1. A call begins in the engine ([`drive`]: its sequence number and
//!    fingerprint), arms its timer, and wakes the pump if it sleeps.
//! 2. It runs its schedule: sends, and takes what the readers filed (or
//!    applied in place); each step that moves on tells the engine
//!    (`progressed`).
//! 3. When nothing arrived it asks the engine for a failure, fails at its
//!    own deadline (`Engine::timed_out`), spins on the polled links, then
//!    sleeps until a frame is filed, the pump wakes it, or its deadline.
//! 4. The pump ([`poll::pump`], one task per rank) alone moves the
//!    engine's clock: `handle_timeout` at `poll_timeout` (at most every
//!    10 ms while calls are in flight), the stall probes it asks for, and
//!    a wake-up of the calls when one passed its deadline.
//! 5. The call ends in the engine (`end`, its abort sent), or is cancelled
//!    when dropped.
//!
//! This file holds the types they share, the `Backend` impl and subgroups.

use std::{
    io::IoSlice,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use async_trait::async_trait;
use consort_comm::{
    Backend, CallOptions, CommError, DType, ErrorContext, Fingerprint, GroupId, Op, OpKind,
    ReduceOp, Result, Work,
    algo::{
        Action, Buf, Receive,
        exec::{Call, CallBuffers, scratch, scratch_bytes},
    },
    engine::{Begun, CallId, Engine},
    frame::{AbortInfo, FrameHeader, FrameKind, FrameLimits, HEADER_LEN},
};
use tokio::{
    io::{AsyncReadExt, AsyncWrite, AsyncWriteExt},
    sync::Notify,
    task::JoinHandle,
};

use crate::{
    MeshOptions,
    link::{BoxRead, BoxWrite, PeerLink, PolledLink},
};

#[derive(Debug)]
struct Frame {
    payload: Vec<u8>,
}

/// Chunk of an in-place receive read from a stream (and of a pull's reduce):
/// L2-sized, so that a chunk's copy and the reduce that follows it meet in
/// cache.
const BOUNCE: usize = 256 * 1024;

/// What a reader files for a receive: a frame, or the news that it was
/// applied in place.
#[derive(Debug)]
enum Got {
    Frame(Frame),
    Done,
}

/// How the driver reaches one peer.
enum Link {
    Me,
    /// Write halves, by stream.
    Streams(Vec<tokio::sync::Mutex<Writer>>),
    Polled(Box<poll::Polled>),
}

struct Inner {
    /// This rank's link to each peer.
    links: Vec<Link>,
    /// The call rules: groups, calls in flight, filed frames, failures.
    engine: Mutex<Engine<Got>>,
    /// Woken when a frame is filed, a peer is lost, or a polled link rings.
    notify: Notify,
    /// What the polled links ring (see [`Inner::woken`]).
    bell: Arc<Notify>,
    /// Wakes the pump ([`poll::pump`]) when a call starts while it sleeps
    /// with no timer (`pump_parked`).
    pump: Arc<Notify>,
    pump_parked: std::sync::atomic::AtomicBool,
    readers: Mutex<Vec<JoinHandle<()>>>,
    /// Payload buffers handed back after use: large frames would otherwise
    /// cost an mmap, page faults and an munmap each.
    pool: Mutex<Vec<Vec<u8>>>,
    /// Receives the readers may apply in place.
    direct: Mutex<Registry>,
    /// Indices of the polled links (empty: no call spins).
    polled: Vec<usize>,
    /// How long a waiting call spins on the polled links.
    spin: Duration,
    /// Whether spinning yields the core (more ranks here than cores).
    yield_spin: bool,
    limits: FrameLimits,
    in_place_min: usize,
    /// Data frames moved from a buffer to their receive mid-way (see
    /// `poll::promote`).
    late_posts: std::sync::atomic::AtomicU64,
    /// See [`MeshOptions::single_copy_min`].
    single_copy_min: usize,
    /// The call (registry id) that holds this rank's stage, 0 for none
    /// (see [`stage`]).
    stager: std::sync::atomic::AtomicU64,
    /// Staged pull frames sent (see [`MeshBackend::staged_frames`]).
    staged_frames: std::sync::atomic::AtomicU64,
    /// Where the flight record goes (`None`: nowhere).
    flight: Option<Arc<consort_comm::flight::FlightOut>>,
    /// The agent's view of this rank's progress.
    beat: Option<Arc<crate::heartbeat::Heartbeat>>,
    /// The faulty link (tests), if any.
    faults: Option<Mutex<faulty::Faulty>>,
}

pin_project_lite::pin_project! {
    /// See [`Inner::woken`]: both notifications, on the caller's stack.
    pub(super) struct Woken<'a> {
        #[pin]
        filed: tokio::sync::futures::Notified<'a>,
        #[pin]
        rung: tokio::sync::futures::Notified<'a>,
    }
}

impl Woken<'_> {
    /// Registers for both notifications now.
    pub(super) fn enable(self: std::pin::Pin<&mut Self>) {
        let me = self.project();
        me.filed.enable();
        me.rung.enable();
    }
}

impl std::future::Future for Woken<'_> {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let me = self.project();
        if me.filed.poll(cx).is_ready() || me.rung.poll(cx).is_ready() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    }
}

/// Buffers kept in the pool at most.
const POOL_MAX: usize = 64;

impl Inner {
    /// What resolves when a frame is filed, a peer is lost, or a polled
    /// link rings (pin it and [`Woken::enable`] it before looking for
    /// work, so that nothing after that is missed). A ring wakes the
    /// waiting call straight from the bell, not through the relay task:
    /// under load, each task between a ring and the call it wakes waits
    /// for a core.
    fn woken(&self) -> Woken<'_> {
        Woken {
            filed: self.notify.notified(),
            rung: self.bell.notified(),
        }
    }

    fn buffer(&self, len: usize) -> Vec<u8> {
        let mut pool = lock(&self.pool);
        match pool.iter().position(|b| b.capacity() >= len) {
            Some(i) => pool.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    fn recycle(&self, mut b: Vec<u8>) {
        b.clear();
        let mut pool = lock(&self.pool);
        if pool.len() < POOL_MAX && b.capacity() > 0 {
            pool.push(b);
        }
    }
}

pub(crate) use consort_comm::lock;

/// One rank's handle on a mesh process group (TCP, QUIC, shared memory, or
/// a mix per peer): the world group, or a subgroup that shares the world's
/// links.
pub struct MeshBackend {
    /// "tcp", "quic" (see `Backend::name`).
    name: &'static str,
    inner: Arc<Inner>,
    opts: MeshOptions,
    group: GroupId,
    /// Mesh rank of each group rank.
    members: Arc<[usize]>,
    /// This rank's place in the group.
    me: usize,
    /// Whether this is the world handle, whose drop closes the mesh.
    owner: bool,
    /// What the transport does last when the world handle closes the mesh
    /// (QUIC: wait for the peers' acknowledgements, close the endpoint).
    closer: Option<Arc<dyn MeshCloser>>,
    /// The programs of this group's recent calls, built with `opts.algo`.
    programs: Mutex<consort_comm::algo::ProgramCache>,
}

/// A transport's last step when the world handle closes the mesh, after
/// the parting aborts and every stream's shutdown (within the linger),
/// before the readers stop.
pub trait MeshCloser: Send + Sync + 'static {
    /// The step, bounded by [`MeshCloser::budget`].
    fn closed(&self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'static>>;
    /// At most how long [`MeshCloser::closed`] takes.
    fn budget(&self) -> Duration;
    /// No runtime to wait on (a drop outside one): close at once.
    fn close_now(&self);
}

impl std::fmt::Debug for MeshBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshBackend")
            .field("rank", &self.me)
            .field("world_size", &self.members.len())
            .field("group", &self.group)
            .finish()
    }
}

impl Drop for MeshBackend {
    fn drop(&mut self) {
        if !self.owner {
            return;
        }
        let inner = self.inner.clone();
        let closer = self.closer.take();
        // The parting aborts, then the linger, then the transport's last
        // step: bounded, with room to spare.
        let budget = closer.as_ref().map_or(Duration::ZERO, |c| c.budget());
        let limit = self
            .opts
            .linger
            .saturating_add(budget)
            .saturating_add(Duration::from_secs(5));
        if !finish_in_drop(close(inner, self.opts.linger, closer.clone()), limit) {
            stop_readers(&self.inner);
            if let Some(c) = closer {
                c.close_now();
            }
        }
    }
}

/// Closes the mesh: first the parting aborts (every failed group's cause,
/// to its other members: see `Engine::parting_aborts`), then every stream's
/// write side shut down after its last frame (for TCP, until the peer has
/// acknowledged all of it: see [`MeshOptions::linger`]), the readers
/// reading meanwhile, so that nothing arrives at a closed socket, which
/// would reset the connection and throw away what its send buffer still
/// held; then the readers stop.
async fn close(inner: Arc<Inner>, linger: Duration, closer: Option<Arc<dyn MeshCloser>>) {
    part(&inner).await;
    let mut shutdowns: Vec<std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>>> = inner
        .links
        .iter()
        .filter_map(|l| match l {
            Link::Streams(ws) => Some(ws),
            _ => None,
        })
        .flatten()
        .map(|w| {
            Box::pin(async move {
                let _ = w.lock().await.w.shutdown().await;
            }) as _
        })
        .collect();
    let all = std::future::poll_fn(|cx| {
        shutdowns.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if shutdowns.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    });
    let _ = before(Instant::now() + linger, all).await;
    if let Some(c) = closer {
        let _ = before(Instant::now() + c.budget(), c.closed()).await;
    }
    stop_readers(&inner);
}

/// Sends the parting aborts (`Engine::parting_aborts`).
async fn part(inner: &Arc<Inner>) {
    let parting = lock(&inner.engine).parting_aborts();
    for abort in parting {
        propagate(inner, abort).await;
    }
}

impl MeshBackend {
    /// Gives the world handle the transport's last step when it closes the
    /// mesh ([`MeshCloser`]); ignored on a subgroup's handle.
    pub fn set_closer(&mut self, closer: Arc<dyn MeshCloser>) {
        if self.owner {
            self.closer = Some(closer);
        }
    }
}

fn stop_readers(inner: &Inner) {
    for h in lock(&inner.readers).drain(..) {
        h.abort();
    }
}

/// Runs `work` to its end from a `Drop`: on a multi-thread runtime the
/// dropping thread waits for it, at most `limit`; on a current-thread
/// runtime it is spawned (and runs if the runtime goes on). `false` where
/// `work` did not run to its end: there is no runtime, the runtime is
/// shutting down (dropping its tasks, and with them whatever they held:
/// its timers and sockets no longer make progress), or `limit` passed; the
/// work is then aborted, so that it cannot start (or go on) after the
/// caller's own fallback.
///
/// The wait is on a channel the work's task holds, not on the runtime, and
/// it ends as soon as the runtime is seen to shut down, or when the work
/// has not even begun after a second: a runtime's drop waits for
/// this very thread while the work no longer progresses (waiting in
/// `block_on` there hung).
pub fn finish_in_drop<F: Future<Output = ()> + Send + 'static>(work: F, limit: Duration) -> bool {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    if shutting_down(&rt) {
        return false;
    }
    if rt.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
        rt.spawn(work);
        return true;
    }
    let (done, ended) = std::sync::mpsc::channel();
    let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let polled = started.clone();
    let task = rt.spawn(async move {
        polled.store(true, std::sync::atomic::Ordering::SeqCst);
        work.await;
        let _ = done.send(());
    });
    let t0 = Instant::now();
    let deadline = consort_comm::time::deadline(limit);
    let finished = tokio::task::block_in_place(|| {
        loop {
            match ended.recv_timeout(Duration::from_millis(10)) {
                Ok(()) => return true,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return false,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            let unrun =
                !started.load(std::sync::atomic::Ordering::SeqCst) && t0.elapsed() >= UNRUN_LIMIT;
            if unrun || shutting_down(&rt) || Instant::now() >= deadline {
                return false;
            }
        }
    });
    // Given up on: it must not start (or go on) after the caller's own
    // fallback has closed what it would use.
    if !finished {
        task.abort();
    }
    finished
}

/// How long [`finish_in_drop`] waits for a runtime to begin its work: one
/// that has begun to drop (its workers gone, its tasks not yet dropped)
/// never does. A running runtime starts it within microseconds.
const UNRUN_LIMIT: Duration = Duration::from_secs(1);

/// Whether `rt` is shutting down: a runtime that has begun to shut down
/// cancels every task spawned on it at once, before returning the handle.
fn shutting_down(rt: &tokio::runtime::Handle) -> bool {
    let probe = rt.spawn(async {});
    let mut probe = std::pin::pin!(probe);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    matches!(
        probe.as_mut().poll(&mut cx),
        std::task::Poll::Ready(Err(e)) if e.is_cancelled()
    )
}

mod assemble;
mod call;
mod drive;
mod faulty;
mod flight;
mod inbound;
mod poll;
mod read;
mod registry;
mod stage;

pub use consort_comm::flight::dump_flight_records;

use self::{drive::*, read::*, registry::*};

/// Tells world ranks `to` about a failure in call `fp` (best effort).
async fn propagate(inner: &Arc<Inner>, (info, fp, to): (AbortInfo, Fingerprint, Vec<usize>)) {
    let info = info.encode();
    let h = FrameHeader {
        kind: FrameKind::Abort,
        fingerprint: fp,
        tag: 0,
        offset: 0,
        payload_len: info.len() as u64,
        flags: 0,
    }
    .encode();
    // To every peer at once, under one deadline: one at a time, a peer whose
    // socket is full would hold up the rest (2 s each: half an hour at
    // 1,024 ranks).
    let sends = to.iter().map(|&q| inner.send_frame(q, 0, &h, &info));
    all_before(Instant::now() + ABORT_FAN_OUT, sends).await;
}

/// How long a rank spends telling its peers of a failure, all of them
/// together.
const ABORT_FAN_OUT: Duration = Duration::from_secs(2);

/// Runs every future concurrently until all are done or `deadline` passes;
/// returns how many finished.
async fn all_before<F: Future>(deadline: Instant, futs: impl IntoIterator<Item = F>) -> usize {
    let mut pending: Vec<std::pin::Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let total = pending.len();
    let all = std::future::poll_fn(|cx| {
        pending.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if pending.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    });
    let _ = before(deadline, all).await;
    total - pending.len()
}

/// A call's state while it runs, and its cancelling: a call whose work is
/// dropped before it ends has its run's state dropped first (pulls revoked,
/// receives unregistered), then the engine poisons its group, and the peers
/// are told (from a spawned task: a drop cannot wait).
struct CallGuard<'a> {
    inner: &'a Arc<Inner>,
    id: CallId,
    armed: bool,
    /// What [`MeshBackend::prepare`] made (or why it could not); `None` once
    /// the run has ended.
    prepared: Option<Result<call::Prepared<'a>>>,
}

impl CallGuard<'_> {
    /// Runs the prepared call to its end and drops its state.
    async fn run(&mut self) -> Result<()> {
        let result = match &mut self.prepared {
            Some(Ok(p)) => p.run().await,
            Some(Err(e)) => Err(e.clone()),
            None => Err(CommError::protocol(None, "this call has already run")),
        };
        self.prepared = None;
        result
    }
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        self.prepared = None;
        if !self.armed {
            return;
        }
        let abort = lock(&self.inner.engine).cancel(self.id, consort_comm::cancel::cause());
        self.inner.notify.notify_waiters();
        if let (Some(abort), Ok(rt)) = (abort, tokio::runtime::Handle::try_current()) {
            let inner = self.inner.clone();
            rt.spawn(async move { propagate(&inner, abort).await });
        }
    }
}

#[async_trait]
impl Backend for MeshBackend {
    fn name(&self) -> &'static str {
        self.opts_name()
    }

    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn group_id(&self) -> GroupId {
        self.group
    }

    fn default_timeout(&self) -> Duration {
        self.opts.timeout
    }

    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        self.start(op, opts)
    }

    fn lost_peers(&self) -> Vec<(usize, String)> {
        let engine = lock(&self.inner.engine);
        engine
            .lost()
            .iter()
            .filter_map(|(p, why)| {
                let r = self.members.iter().position(|m| m == p)?;
                Some((r, why.clone()))
            })
            .collect()
    }

    fn peer_aborts(&self) -> Vec<consort_comm::PeerAbort> {
        lock(&self.inner.engine).peer_aborts(self.group, &self.members)
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        Ok(self
            .subgroup(ranks, opts)?
            .map(|b| Arc::new(b) as Arc<dyn Backend>))
    }
}

impl MeshBackend {
    /// The backend's name in errors and `Backend::name`: the transport of
    /// the network peers ("tcp", "quic"), or of the local ones when all are
    /// on this host.
    fn opts_name(&self) -> &'static str {
        self.name
    }

    /// The transport that reaches each world rank: "self", the stream
    /// transport's name ("tcp", "quic"), or a local transport's name
    /// ("shm").
    pub fn transports(&self) -> Vec<&'static str> {
        self.inner
            .links
            .iter()
            .map(|l| match l {
                Link::Me => "self",
                Link::Streams(_) => self.name,
                Link::Polled(p) => p.link.name(),
            })
            .collect()
    }

    /// The world ranks this rank reaches through shared memory.
    pub fn shared_memory_peers(&self) -> Vec<usize> {
        let links = &self.inner.links;
        (0..links.len())
            .filter(|&p| matches!(links[p], Link::Polled(_)))
            .collect()
    }

    /// The world ranks that read this rank's large payloads themselves,
    /// from its memory (same host, CMA allowed and on at both ends).
    pub fn single_copy_peers(&self) -> Vec<usize> {
        let links = &self.inner.links;
        (0..links.len())
            .filter(|&p| matches!(&links[p], Link::Polled(l) if l.link.peer_pulls()))
            .collect()
    }

    /// How many large data frames (64 KiB or more) began arriving before
    /// their receive was posted, on any link, and went on straight into it
    /// once it was (what came before is copied over once).
    pub fn late_receives(&self) -> u64 {
        self.inner
            .late_posts
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many pull frames this rank sent that name its stage: one per
    /// same-host peer and segment of the large broadcasts it was the root
    /// of (see `consort_comm::algo::AlgoConfig::shared_stage`).
    pub fn staged_frames(&self) -> u64 {
        self.inner
            .staged_frames
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A subgroup on this mesh (see [`Backend::new_group`]); the TCP and
    /// QUIC backends wrap the handle it returns.
    pub fn subgroup(&self, ranks: &[usize], opts: &CallOptions) -> Result<Option<MeshBackend>> {
        let made = lock(&self.inner.engine).make_group(self.group, ranks)?;
        let Some((id, members, me)) = made else {
            return Ok(None);
        };
        let mut topts = self.opts.clone();
        if let Some(t) = opts.timeout {
            topts.timeout = t;
        }
        Ok(Some(MeshBackend {
            name: self.name,
            inner: self.inner.clone(),
            programs: Mutex::new(consort_comm::algo::ProgramCache::new(topts.algo.clone())),
            opts: topts,
            group: id,
            members: members.into(),
            me,
            owner: false,
            closer: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncReadExt;

    use super::{BoxWrite, Writer, write_frame};

    /// A frame whose write a deadline cuts off leaves the stream refusing
    /// every later frame, so the peer never reads another frame's bytes as
    /// the rest of the cut one.
    #[tokio::test]
    async fn a_frame_cut_by_a_deadline_closes_the_stream_to_further_frames() {
        let (a, mut b) = tokio::io::duplex(64);
        let w = tokio::sync::Mutex::new(Writer {
            w: Box::pin(a) as BoxWrite,
            cut: false,
        });
        write_frame(&w, &[b"whole"]).await.unwrap();
        let big = vec![7u8; 4096];
        let cut = tokio::time::timeout(Duration::from_millis(50), write_frame(&w, &[&big])).await;
        assert!(cut.is_err(), "the peer reads nothing: the write must block");
        let e = write_frame(&w, &[b"abort"]).await.unwrap_err();
        assert!(e.to_string().contains("cut off"), "{e}");
        // The peer sees the whole first frame, then only the cut one's
        // prefix: never "abort".
        let mut got = vec![0u8; 64];
        b.read_exact(&mut got).await.unwrap();
        drop(w);
        let mut rest = Vec::new();
        b.read_to_end(&mut rest).await.unwrap();
        assert!(
            rest.iter().all(|&x| x == 7),
            "nothing follows the cut frame"
        );
        assert_eq!(&got[..5], b"whole");
        assert!(got[5..].iter().all(|&x| x == 7));
    }
}

#[cfg(test)]
mod fan_out_tests {
    use super::*;

    /// Fifty sends that each take a second finish together in one second of
    /// (paused, virtual) time, and a deadline cuts off the ones that take
    /// longer, without waiting for them one after another.
    #[tokio::test(start_paused = true)]
    async fn every_peer_at_once_under_one_deadline() {
        // Deadlines on tokio's (paused) clock.
        let by = || tokio::time::Instant::now().into_std() + ABORT_FAN_OUT;
        let start = tokio::time::Instant::now();
        let slow = |s: u64| tokio::time::sleep(Duration::from_secs(s));
        let done = all_before(by(), (0..50).map(|_| slow(1))).await;
        assert_eq!(done, 50);
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        let start = tokio::time::Instant::now();
        let mixed = (0..50).map(|i| slow(if i % 2 == 0 { 1 } else { 3600 }));
        let done = all_before(by(), mixed).await;
        assert_eq!(done, 25);
        assert_eq!(start.elapsed(), ABORT_FAN_OUT);
    }
}
