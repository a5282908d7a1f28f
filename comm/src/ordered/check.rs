//! The fingerprint check of a stream-ordered communicator, over a host side
//! channel: always on, and off the GPU's critical path.
//!
//! NCCL checks nothing: a rank that calls `broadcast` where its peers call
//! `all_reduce` hangs, or returns garbage. Here every collective's
//! [`Fingerprint`] goes, when the call is made, to a [`Checker`] task
//! that all-gathers it over a host backend among the same ranks (a TCP
//! group made at init; in tests, simulated ranks) while the kernel runs.
//! Every rank sees every rank's fingerprint, so every rank finds a
//! mismatch itself and reports `Mismatch` naming both sides; the driver
//! then fails its calls in flight and aborts the communicator
//! ([`super::Ordered::mismatch`]). A rank whose process is gone is found
//! the same way: the side channel reports `PeerLost` naming it, on every
//! survivor, at their next collective.
//!
//! Calls are compared in the order they were made, which is the order on
//! the stream. A rank that skipped a collective compares its next one
//! against its peers' skipped one: a mismatch too. Subgroups get checkers
//! of their own, made through the parent's ([`Checker::new_group`]), so
//! the host group's calls keep one order on every rank.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, oneshot};

use crate::{
    Backend, Buffer, BufferMut, CallOptions, CommError, ErrorContext, Fingerprint, GroupId, OpKind,
    Result,
    frame::{FrameHeader, FrameLimits, HEADER_LEN},
};

/// The future that runs a checker: spawn it on any executor.
pub type CheckTask = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Where a checker reports its verdict: the mismatch it found, or the peer
/// the side channel lost.
pub type Report = Arc<dyn Fn(CommError) + Send + Sync>;

enum Msg {
    Check(Fingerprint),
    Tell(CommError),
    NewGroup {
        ranks: Vec<usize>,
        report: Report,
        reply: oneshot::Sender<Result<Option<(Checker, CheckTask)>>>,
    },
}

/// One checker's progress: fingerprints sent and compared, and whether its
/// task has ended (or was dropped), after which nothing more is compared.
#[derive(Debug, Default)]
pub(super) struct Progress {
    sent: AtomicU64,
    done: AtomicU64,
    ended: AtomicBool,
}

impl Progress {
    fn drained(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
            || self.done.load(Ordering::SeqCst) >= self.sent.load(Ordering::SeqCst)
    }
}

/// How long [`Checker::wait_drained`] waits without any comparison ending.
pub const DRAIN_STALL: Duration = Duration::from_secs(5);

/// Sets [`Progress::ended`] when the task that owns it ends or is dropped.
struct Ended(Arc<Progress>);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.ended.store(true, Ordering::SeqCst);
    }
}

/// The progress of a checker and of every subgroup checker made through it
/// (and theirs): a rank leaves only when all of them are drained.
pub(super) type Tree = Arc<Mutex<Vec<Arc<Progress>>>>;

/// The handle to one communicator's checker task (see the module docs).
#[derive(Clone, Debug)]
pub struct Checker {
    tx: mpsc::UnboundedSender<Msg>,
    progress: Arc<Progress>,
    pub(super) tree: Tree,
    /// Each comparison's limit, and so the limit on waiting for the task.
    timeout: Duration,
    /// The side channel, asked which ranks it has lost.
    host: Arc<dyn Backend>,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Msg::Check(fp) => write!(f, "Check({fp})"),
            Msg::Tell(e) => write!(f, "Tell({e})"),
            Msg::NewGroup { ranks, .. } => write!(f, "NewGroup({ranks:?})"),
        }
    }
}

impl Checker {
    /// A checker over `host` (a host backend of the same ranks, numbered
    /// alike, used by nothing else), each comparison bounded by `timeout`,
    /// and the task that runs it. `report` gets the first mismatch.
    pub fn new(host: Arc<dyn Backend>, timeout: Duration, report: Report) -> (Checker, CheckTask) {
        Checker::in_tree(host, timeout, report, Tree::default())
    }

    /// [`Checker::new`], its progress counted in `tree` (its parent's).
    pub(super) fn in_tree(
        host: Arc<dyn Backend>,
        timeout: Duration,
        report: Report,
        tree: Tree,
    ) -> (Checker, CheckTask) {
        let (tx, rx) = mpsc::unbounded_channel();
        let progress = Arc::new(Progress::default());
        {
            let mut t = crate::lock(&tree);
            // Checkers whose task has ended compare nothing more.
            t.retain(|p| !p.ended.load(Ordering::SeqCst));
            t.push(progress.clone());
        }
        let task = Box::pin(run(
            (host.clone(), timeout, tree.clone()),
            rx,
            report,
            Ended(progress.clone()),
        ));
        (
            Checker {
                tx,
                progress,
                tree,
                timeout,
                host,
            },
            task,
        )
    }

    /// The first rank the side channel has seen go, and what it saw
    /// ([`Backend::lost_peers`]).
    pub fn lost_peer(&self) -> Option<(usize, String)> {
        self.lost_peers().into_iter().next()
    }

    /// Every rank the side channel has seen go, and what it saw: what a
    /// checked communicator reports as its own [`Backend::lost_peers`].
    pub fn lost_peers(&self) -> Vec<(usize, String)> {
        self.host.lost_peers()
    }

    /// [`Checker::lost_peers`] of a communicator's checker, if it has one
    /// (none known without a check): a stream-ordered communicator's
    /// `Backend::lost_peers`.
    pub fn lost_peers_of(checker: Option<&Checker>) -> Vec<(usize, String)> {
        checker.map(Checker::lost_peers).unwrap_or_default()
    }

    /// The ranks whose communicator failed on their own and said so
    /// ([`Checker::tell`]), with what they said: the side channel's
    /// [`Backend::peer_aborts`] of its told calls only. Any other abort
    /// there (a comparison that timed out on a peer, say) is the side
    /// channel's failure, not the peer's communicator's.
    pub fn peer_aborts(&self) -> Vec<(usize, String)> {
        told(&*self.host)
    }

    /// Tells the peers that this rank's communicator failed with `e` (a
    /// call cancelled, or one it could not enqueue): NCCL tells them
    /// nothing, and their kernels would wait on this rank's part until
    /// their deadline. It goes over the side channel as an abort (after
    /// the comparisons already sent); each peer's stall rule then fails
    /// its calls naming this rank and its cause ([`LostPeer::stalled`]).
    /// Not for failures every rank finds on its own (a mismatch, a lost
    /// rank) nor for one a peer said first: those are left out here. The
    /// side channel is done for afterwards (its group failed), as the
    /// communicator is. Never blocks.
    ///
    /// The driver passes its group's first cause. Nothing is told once the
    /// side channel knows a rank lost or a peer's told failure (looked at
    /// when the task gets to it, behind the comparisons sent before), nor
    /// twice: the told call fails the side channel's group.
    pub fn tell(&self, e: CommError) {
        if !matches!(e, CommError::Mismatch { .. } | CommError::PeerLost { .. }) {
            let _ = self.tx.send(Msg::Tell(e));
        }
    }

    /// Sends a collective's fingerprint to be compared; never blocks.
    pub fn check(&self, fp: Fingerprint) {
        // Counted first: the task may compare it before `send` returns.
        self.progress.sent.fetch_add(1, Ordering::SeqCst);
        if self.tx.send(Msg::Check(fp)).is_err() {
            self.progress.sent.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Whether every fingerprint sent so far has been compared (or the
    /// checker has stopped), here and in every subgroup checker made
    /// through this one's family. A rank that leaves waits for this first,
    /// so that its peers' last comparisons (a subgroup's included) find it
    /// still there.
    pub fn is_drained(&self) -> bool {
        let tree = crate::lock(&self.tree);
        tree.iter().all(|p| p.drained())
    }

    /// Blocks (polling every 100 µs) until [`Checker::is_drained`], at most
    /// the checker's timeout (one comparison's limit), and no longer than
    /// [`DRAIN_STALL`] without a comparison ending. A communicator calls it
    /// as it goes: a rank that leaves with a comparison still running
    /// would otherwise take its part of that comparison away from its
    /// peers, which then report it lost instead of their own verdict. The
    /// stall bound is for a checker task that will never run again: a
    /// communicator dropped while its runtime shuts down (its tasks are
    /// dropped one after another on this thread) used to wait here for the
    /// whole timeout.
    pub fn wait_drained(&self) {
        let deadline = crate::time::deadline(self.timeout);
        let done = || -> u64 {
            let tree = crate::lock(&self.tree);
            tree.iter().map(|p| p.done.load(Ordering::SeqCst)).sum()
        };
        let (mut seen, mut since) = (done(), Instant::now());
        while !self.is_drained() && Instant::now() < deadline {
            let now = done();
            if now != seen {
                (seen, since) = (now, Instant::now());
            } else if since.elapsed() >= DRAIN_STALL {
                tracing::debug!(
                    "leaving with fingerprint comparisons unfinished: none ended for {DRAIN_STALL:?}"
                );
                return;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// The checker of the subgroup of these ranks (checked, in group-rank
    /// order), made on the host side channel in this checker's order. Every
    /// rank of this group calls it; non-members get `None`.
    pub async fn new_group(
        &self,
        ranks: &[usize],
        report: Report,
    ) -> Result<Option<(Checker, CheckTask)>> {
        let (reply, answer) = oneshot::channel();
        let gone = || {
            CommError::aborted(
                "the fingerprint checker has stopped (its host side channel failed); make the \
                 subgroup on a new communicator",
            )
        };
        self.tx
            .send(Msg::NewGroup {
                ranks: ranks.to_vec(),
                report,
                reply,
            })
            .map_err(|_| gone())?;
        // The task may be in the middle of a comparison (bounded by the
        // timeout); it answers after it, or never if it is stuck.
        let limit = self.timeout.saturating_mul(2);
        match unless(answer, futures_timer::Delay::new(limit)).await {
            Some(r) => r.map_err(|_| gone())?,
            None => Err(CommError::Timeout {
                ctx: ErrorContext::default(),
                after: limit,
                waiting_on: Vec::new(),
            }),
        }
    }
}

/// How long a data-path failure that names no rank waits for the side
/// channel to name one: both see the same process go, within
/// milliseconds of each other; a failure with no rank lost is held back
/// this long.
pub const LOST_PEER_GRACE: Duration = Duration::from_secs(1);

/// NCCL's `ncclSystemError`: among other things, a socket reset by a peer
/// whose process went.
pub const NCCL_SYSTEM_ERROR: i32 = 2;

/// NCCL's `ncclRemoteError`: "connection closed by remote peer".
pub const NCCL_REMOTE_ERROR: i32 = 6;

/// Whether NCCL result `code` may be a peer's death, which NCCL reports
/// without naming the rank ([`NCCL_REMOTE_ERROR`], [`NCCL_SYSTEM_ERROR`]):
/// the failures [`LostPeer`] holds. NCCL's driver and the emulated device
/// both ask this.
pub fn may_be_lost_peer(code: i32) -> bool {
    matches!(code, NCCL_REMOTE_ERROR | NCCL_SYSTEM_ERROR)
}

/// How long a collective waits, with no failure from its communicator,
/// once the side channel knows a rank of its group gone, before it fails
/// naming that rank ([`LostPeer::stalled`]): far below an op's timeout
/// (NCCL's default is 10 minutes), and far above a healthy kernel's wait.
pub const STALL_GRACE: Duration = Duration::from_secs(10);

/// The rule that names the rank behind a data-path failure that names none.
///
/// NCCL reports a peer's death as `ncclRemoteError` ("connection closed by
/// remote peer"), with an address but no rank, and the emulated device
/// reports its data path's losses the same way. Callers such as DDP's
/// `OnPeerLost::Shrink` need `PeerLost` naming the rank. The fingerprint
/// check's side channel connects the same ranks and sees the same process
/// go: the failure is held back (the calls stay in flight) until the side
/// channel names the rank, at most [`LOST_PEER_GRACE`], and then fails
/// them with `PeerLost` naming it. Without a side channel, or when no rank
/// is lost within the grace, the failure stands as it came. Each
/// communicator's driver keeps one and asks it on every poll.
#[derive(Debug, Default)]
pub struct LostPeer {
    /// When the anonymous failure was first seen.
    since: Option<Instant>,
    /// The oldest call in flight (its group and sequence number) and
    /// since when it has waited, with no failure at all, while the side
    /// channel knew a lost rank ([`LostPeer::stalled`]).
    stall: Option<(Option<GroupId>, Option<u64>, Instant)>,
    /// The side channel's lost ranks, and the ranks that said their
    /// communicator failed, as last asked, and when: the driver polls every
    /// few microseconds while calls are in flight, and asking takes the
    /// side channel's lock and allocates, so [`LostPeer::stalled`] asks at
    /// most every [`STALL_LOOK`].
    looked: Option<(Instant, Gone)>,
}

/// What the side channel knows of ranks that will not run their part: those
/// it lost, and those that said their communicator failed.
#[derive(Debug, Default)]
struct Gone {
    lost: Vec<(usize, String)>,
    said: Vec<(usize, String)>,
}

/// How often [`LostPeer::stalled`] asks the side channel for lost ranks
/// (far below [`STALL_GRACE`]).
const STALL_LOOK: Duration = Duration::from_millis(100);

impl LostPeer {
    /// What the calls fail with for `e`, an anonymous data-path failure
    /// seen at `now` while the oldest call in flight has until `deadline`:
    /// `PeerLost` naming the rank `checker`'s side channel lost; `e` itself
    /// once the grace has passed, once the call's deadline has (the held
    /// failure is its real cause, not a `Timeout`), or without a checker;
    /// or `None` while the side channel may still name one (poll again).
    pub fn name(
        &mut self,
        checker: Option<&Checker>,
        e: CommError,
        (now, deadline): (Instant, Instant),
    ) -> Option<CommError> {
        let Some(checker) = checker else {
            return Some(e);
        };
        if let Some(named) = named(checker, &e) {
            return Some(named);
        }
        let since = *self.since.get_or_insert(now);
        (now.duration_since(since) >= LOST_PEER_GRACE || now >= deadline).then_some(e)
    }

    /// What the oldest call in flight (context `ctx`; `peer`, the rank a
    /// send or receive is with), still running with no failure from the
    /// communicator at `now`, fails with: `PeerLost` naming a rank it waits
    /// on that `checker`'s side channel lost, once this call has waited
    /// [`STALL_GRACE`] with that rank known gone; or `Aborted` naming a
    /// rank that said its communicator failed ([`Checker::tell`]) and what
    /// it said, after the same wait. NCCL's kernels over
    /// NVLink, PCIe peer-to-peer or shared memory wait on a dead peer
    /// without an error (only its socket transport reports one), and a
    /// checker that already compared every call in flight has nothing left
    /// to compare. A collective waits on every rank of its group; a send or
    /// receive only on its peer. The grace is long because a call can
    /// legitimately wait behind other GPU work after a peer that finished
    /// its part left.
    pub fn stalled(
        &mut self,
        checker: Option<&Checker>,
        (ctx, peer): (ErrorContext, Option<usize>),
        now: Instant,
    ) -> Option<CommError> {
        let p2p = matches!(ctx.op, Some(OpKind::Send | OpKind::Recv));
        if ctx.op.is_none() || (p2p && peer.is_none()) {
            return None;
        }
        let fresh = matches!(&self.looked, Some((at, _)) if now.duration_since(*at) < STALL_LOOK);
        if !fresh {
            let gone = checker.map_or_else(Gone::default, |c| Gone {
                lost: c.lost_peers(),
                said: c.peer_aborts(),
            });
            self.looked = Some((now, gone));
        }
        let waits_on = |(r, _): &&(usize, String)| !p2p || Some(*r) == peer;
        let (lost, said) = match &self.looked {
            Some((_, g)) => (g.lost.iter().find(waits_on), g.said.iter().find(waits_on)),
            None => (None, None),
        };
        let Some(((rank, why), was_lost)) = lost.map(|l| (l, true)).or(said.map(|s| (s, false)))
        else {
            self.stall = None;
            return None;
        };
        let (rank, why) = (*rank, why.clone());
        let since = match self.stall {
            Some((g, seq, t)) if (g, seq) == (ctx.group, ctx.seq) => t,
            _ => {
                self.stall = Some((ctx.group, ctx.seq, now));
                now
            }
        };
        if now.duration_since(since) < STALL_GRACE {
            return None;
        }
        Some(if was_lost {
            CommError::PeerLost {
                ctx,
                peer: rank,
                reason: format!(
                    "{why} (seen by the fingerprint check's side channel; this call waited on \
                     it {STALL_GRACE:?} with no error from the communicator)"
                ),
            }
        } else {
            let waited = format!(
                " after this call waited {STALL_GRACE:?} with no error from the communicator"
            );
            peer_failed(ctx, rank, &why, &waited)
        })
    }

    /// `e`, a failure that is not one NCCL reports a lost peer with (an
    /// internal error, say), as `PeerLost` when the side channel already
    /// knows a rank gone (looked at once, never waited for): a socket or
    /// proxy failing under a dead peer can surface so.
    pub fn named_now(checker: Option<&Checker>, e: CommError) -> CommError {
        match checker.and_then(|c| named(c, &e)) {
            Some(named) => named,
            None => e,
        }
    }

    /// [`LostPeer::name`] for a failure a call itself returned (an
    /// enqueue that failed): polls the side channel every millisecond
    /// until it names the rank, blocking the calling thread for at most
    /// `limit` and at most the grace (`Duration::ZERO`: look once). The
    /// caller picks `limit`: the call's time left, and zero where a wait
    /// would starve the side channel's readers (a current-thread runtime).
    pub fn name_blocking(checker: Option<&Checker>, e: CommError, limit: Duration) -> CommError {
        let Some(c) = checker else {
            return e;
        };
        let deadline = crate::time::deadline(limit.min(LOST_PEER_GRACE));
        loop {
            if let Some(named) = named(c, &e) {
                return named;
            }
            if Instant::now() >= deadline {
                return e;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// `e` as `PeerLost` naming the first rank `checker`'s side channel has
/// lost, if it has lost one.
fn named(checker: &Checker, e: &CommError) -> Option<CommError> {
    let (peer, why) = checker.lost_peer()?;
    Some(CommError::PeerLost {
        ctx: e.context().copied().unwrap_or_default(),
        peer,
        reason: format!(
            "{why} (seen by the fingerprint check's side channel; the communicator itself \
             reported: {e})"
        ),
    })
}

/// The checker task: one message at a time, in the order sent. After its
/// verdict (a mismatch, a lost peer, a peer's told failure), a failed side
/// channel, or its own [`Checker::tell`], it stops comparing, but still
/// makes subgroups' checkers: the survivors of a lost peer make their group
/// through it (never told on: a lost rank is not told).
async fn run(
    (host, timeout, tree): (Arc<dyn Backend>, Duration, Tree),
    mut rx: mpsc::UnboundedReceiver<Msg>,
    report: Report,
    // An argument, so that it is dropped with the task even if the task
    // was never polled.
    ended: Ended,
) {
    let done = &ended.0.done;
    let opts = CallOptions::default().with_timeout(timeout);
    let mut checking = true;
    while let Some(msg) = next(&mut rx, &*host).await {
        match msg {
            Msg::Check(_) if !checking => {
                done.fetch_add(1, Ordering::SeqCst);
            }
            Msg::Check(fp) => {
                let verdict = compare(&*host, fp, &opts).await;
                done.fetch_add(1, Ordering::SeqCst);
                checking = settle(&*host, verdict, &report);
            }
            Msg::Tell(e) => {
                // The peers know already of a loss or a peer's own tell.
                if host.lost_peers().is_empty() && told(&*host).is_empty() {
                    tell(&*host, &e);
                }
                checking = false;
            }
            Msg::NewGroup {
                ranks,
                report,
                reply,
            } => {
                let made = host
                    .new_group(&ranks, &opts)
                    .await
                    .map(|sub| sub.map(|h| Checker::in_tree(h, timeout, report, tree.clone())));
                let _ = reply.send(made);
            }
        }
    }
}

/// Acts on one comparison's outcome: reports a verdict (a mismatch, a lost
/// rank, a peer's told failure) or warns of a failed side channel. Whether
/// the checker goes on comparing.
fn settle(host: &dyn Backend, verdict: Result<Option<CommError>>, report: &Report) -> bool {
    match verdict {
        Ok(None) => true,
        Ok(Some(e)) => {
            report(e);
            false
        }
        // The side channel saw a rank's process go (its sockets closed):
        // the communicator's calls need that rank too, and NCCL may take
        // long to notice, or never (a kernel waiting on it). Every survivor
        // reports it, naming it.
        Err(e @ CommError::PeerLost { .. }) => {
            report(e);
            false
        }
        // So does a rank that said its communicator failed
        // (`Checker::tell`): it will not run its part. What it said is the
        // verdict, not what the comparison made of its telling (its told
        // call can meet this one).
        Err(e) => match told(host).into_iter().next() {
            Some((rank, said)) => {
                // Each call it fails fills in its own op and seq.
                let ctx = ErrorContext {
                    rank: Some(host.rank()),
                    ..ErrorContext::default()
                };
                report(peer_failed(ctx, rank, &said, ""));
                false
            }
            None => side_channel_failed(host, &e),
        },
    }
}

/// A comparison failed on the side channel itself, not on the
/// communicator: its own watchdog still bounds every call. The checker
/// stops rather than poison a healthy group, and says so.
fn side_channel_failed(host: &dyn Backend, e: &CommError) -> bool {
    tracing::warn!(
        rank = host.rank(),
        "the NCCL fingerprint check stopped: its host side channel failed ({e}); mismatched \
         collectives on this communicator are no longer caught"
    );
    false
}

/// The error of a call (context `ctx`) whose group's rank `rank` said its
/// communicator failed, with what it said (`said`), heard on the side
/// channel (`when`: how it was heard, if more is to be said).
fn peer_failed(ctx: ErrorContext, rank: usize, said: &str, when: &str) -> CommError {
    CommError::Aborted {
        ctx,
        cause: crate::AbortCause::Other(format!(
            "rank {rank}'s communicator failed, so it will not run its part of this call; it \
             said: {said} (heard on the fingerprint check's side channel{when}). Fix rank \
             {rank}'s failure, then make a new group or restart the job"
        )),
    }
}

/// The op of the call [`Checker::tell`] makes and drops on the side
/// channel, which otherwise carries only comparisons (all-gathers): an
/// abort of a call of this op is a told one.
const TOLD_OP: OpKind = OpKind::Barrier;

/// The ranks of `host` that told their failure ([`TOLD_OP`]), and what
/// they said.
fn told(host: &dyn Backend) -> Vec<(usize, String)> {
    host.peer_aborts()
        .into_iter()
        .filter(|a| a.call.op == TOLD_OP)
        .map(|a| (a.rank, a.said))
        .collect()
}

/// Tells the peers on `host` that this rank failed with `e`: a call made
/// there (polled once, so that it is made) and dropped with `e` as its
/// cause aborts the host group, which sends `e` to every member.
fn tell(host: &dyn Backend, e: &CommError) {
    let opts = CallOptions::default();
    let mut call = host.barrier(&opts);
    let waker = std::task::Waker::noop();
    match Pin::new(&mut call).poll(&mut std::task::Context::from_waker(waker)) {
        std::task::Poll::Pending => crate::cancel::drop_because(call, e),
        // The side channel's group has already failed (a comparison timed
        // out there): the peers cannot be told.
        std::task::Poll::Ready(Err(why)) => tracing::warn!(
            rank = host.rank(),
            "could not tell the peers over the fingerprint check's side channel that this \
             rank's communicator failed ({e}): the side channel failed first ({why}); they \
             will wait on this rank until their own deadline"
        ),
        std::task::Poll::Ready(Ok(())) => {}
    }
}

/// The next message. The checker waits as an idle rank of `host` does: a
/// simulated side channel's clock must move (its peers' calls, and the
/// aborts they send, [`Checker::tell`]'s among them, wait on it otherwise);
/// real ones idle at once, and the wait polls every 50 ms.
async fn next(rx: &mut mpsc::UnboundedReceiver<Msg>, host: &dyn Backend) -> Option<Msg> {
    loop {
        let idle = async {
            host.idle(Duration::from_millis(50)).await;
            futures_timer::Delay::new(Duration::from_millis(50)).await;
        };
        if let Some(m) = unless(rx.recv(), idle).await {
            return m;
        }
    }
}

/// `f`'s output, or `None` if `other` finishes first.
async fn unless<T>(f: impl Future<Output = T>, other: impl Future<Output = ()>) -> Option<T> {
    let (mut f, mut other) = (std::pin::pin!(f), std::pin::pin!(other));
    std::future::poll_fn(|cx| match f.as_mut().poll(cx) {
        std::task::Poll::Ready(v) => std::task::Poll::Ready(Some(v)),
        std::task::Poll::Pending => other.as_mut().poll(cx).map(|()| None),
    })
    .await
}

/// All-gathers `mine` over `host` and compares: `Some(Mismatch)` naming
/// the first rank whose call differs.
async fn compare(
    host: &dyn Backend,
    mine: Fingerprint,
    opts: &CallOptions,
) -> Result<Option<CommError>> {
    let header = FrameHeader::data(mine, 0, 0, 0).encode();
    let world = host.world_size();
    let mut all = vec![0u8; HEADER_LEN * world];
    host.all_gather(
        BufferMut::from(&mut all[..]),
        Buffer::from(&header[..]),
        opts,
    )
    .await?;
    Ok(first_difference(mine, host.rank(), &all))
}

/// The first rank whose encoded fingerprint in `all` differs from `mine`,
/// as the `Mismatch` this rank reports (an undecodable one is a protocol
/// error of that rank).
pub fn first_difference(mine: Fingerprint, rank: usize, all: &[u8]) -> Option<CommError> {
    let limits = FrameLimits::default();
    all.chunks_exact(HEADER_LEN).enumerate().find_map(|(r, b)| {
        match FrameHeader::decode(b, &limits) {
            Ok(h) if h.fingerprint == mine => None,
            Ok(h) => Some(CommError::Mismatch {
                ctx: ErrorContext::new(mine.op, rank, mine.seq, mine.group),
                local: mine,
                remote: h.fingerprint,
                remote_rank: r,
            }),
            Err(e) => Some(CommError::protocol(
                Some(r),
                format!("an undecodable fingerprint on the side channel: {e}"),
            )),
        }
    })
}
