//! The call engine: the rules that turn frames into finished calls, written
//! once and sans-IO, as [`crate::algo`] does for the schedules.
//!
//! One [`Engine`] per rank holds every group this rank belongs to and every
//! call it has in flight. Drivers (the simulator, the TCP/QUIC mesh) feed it
//! what happens — a call made, a frame arrived, a peer lost, an abort — and
//! ask it what follows: which frame a posted receive gets, whether a call
//! must fail now and with which error, and what to tell the peers. The
//! engine never touches memory, sockets or clocks; payloads are an opaque
//! `P` the driver chooses.
//!
//! # The rules
//!
//! - **Sequence numbers.** Each group numbers its collectives from 0 in the
//!   order calls are *made* ([`Engine::begin`]), not the order they are
//!   polled. Every rank must make its calls on a group in one order, as in
//!   torch. Point-to-point calls are matched by (peer, tag) in order.
//! - **Early frames** wait in the mailbox until their call posts the receive.
//!   A frame for a call that has already finished on this rank is a
//!   protocol error, and so is a second frame for one (group, peer, seq,
//!   tag).
//! - **Fingerprints.** A collective frame whose fingerprint differs from the
//!   call's is a `Mismatch` naming both sides; point-to-point frames compare
//!   dtypes only.
//! - **Poisoning.** Argument errors are found before a call begins and fail
//!   only that call. Any failure after a call began poisons its group: every
//!   call in flight on it fails, later calls fail fast with the first cause,
//!   and the failure is sent to the group's peers ([`Ended::abort`]).
//!   A lost peer fails every call that waits on it, and so breaks its
//!   groups; what it sent before it left is still taken (a process that
//!   exits after its last call strands no slower peer). A frame that
//!   breaks the protocol breaks every group.
//! - **Cancellation.** Dropping a call before it finishes poisons its group
//!   with an error that says so ([`Engine::cancel`]); it never leaves the
//!   group stuck.
//! - **Flight record.** Every call made, started and ended is recorded
//!   ([`Engine::flight`]); the driver stamps the time and writes the dumps.
//! - **Deadlines and stall probes.** A call that makes no progress asks
//!   its group's other members which call they are in at its sequence
//!   number ([`Engine::handle_timeout`], answered with
//!   [`Engine::probe_answer`]); a different one is a mismatch that no frame
//!   would reveal. A call past its deadline fails with `Timeout`, unless a
//!   cause above explains the wait.
//!
//! # Driving order
//!
//! As with quinn-proto's `Connection`, the driver owns the I/O and the
//! clock, and the engine says what follows:
//!
//! 1. [`Engine::begin`] when the call is made (its sequence number and
//!    fingerprint are fixed then), [`Engine::arm`] when it starts.
//! 2. What arrives: [`Engine::file`] (data), [`Engine::probe_reply`],
//!    [`Engine::aborted`], [`Engine::peer_lost`], [`Engine::protocol_error`];
//!    a probe is answered with [`Engine::probe_answer`].
//! 3. For each posted receive, [`Engine::take`]; when the call moved on,
//!    [`Engine::progressed`]; when nothing arrived, [`Engine::failure`].
//! 4. Before sleeping, [`Engine::poll_timeout`]; on waking at or past it,
//!    [`Engine::handle_timeout`] (send its probes, wake the calls if one
//!    expired).
//! 5. [`Engine::end`] with the outcome (send its abort), or
//!    [`Engine::cancel`] if the call was dropped.

use std::collections::VecDeque;

use rustc_hash::{FxHashMap, FxHashSet};
use std::time::Duration;

use crate::flight::FlightRecorder;
use crate::frame::AbortInfo;
use crate::{CommError, ErrorContext, Fingerprint, GroupId, OpKind, Result};

#[cfg(test)]
mod tests;
mod timers;

pub use timers::Probe;

/// A call in flight, as the engine knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallId(u64);

/// What [`Engine::begin`] fixed for a call.
#[derive(Clone, Copy, Debug)]
pub struct Begun {
    /// The handle for the engine's other methods.
    pub id: CallId,
    /// The call's place in its group's sequence (0 for point-to-point).
    pub seq: u64,
    /// The call's fingerprint.
    pub fp: Fingerprint,
    /// The context every error of this call carries.
    pub ctx: ErrorContext,
}

/// What a finished call returns, and what to tell the peers.
#[derive(Debug)]
pub struct Ended {
    /// The call's outcome, with its context.
    pub result: Result<()>,
    /// An abort to send to the group's other members (mesh ranks), when the
    /// failure started here.
    pub abort: Option<(AbortInfo, Fingerprint, Vec<usize>)>,
}

/// A frame waiting for its receive.
#[derive(Debug)]
struct Filed<P> {
    fp: Fingerprint,
    payload: P,
}

#[derive(Debug)]
struct GroupState {
    /// Mesh rank of each group rank.
    members: Vec<usize>,
    /// This rank's place in the group.
    me: usize,
    next_seq: u64,
    poisoned: Option<CommError>,
    /// The call whose failure poisoned the group (what a leaving rank's
    /// parting abort names).
    failed: Option<Fingerprint>,
    /// Subgroups made from this group so far (for their ids).
    children: u32,
}

impl GroupState {
    /// The mesh ranks of the group's members other than `me` (this rank's
    /// mesh rank): where its aborts go.
    fn others(&self, me: usize) -> Vec<usize> {
        self.members.iter().copied().filter(|&m| m != me).collect()
    }
}

#[derive(Debug)]
struct Running {
    group: GroupId,
    fp: Fingerprint,
    ctx: ErrorContext,
    p2p: bool,
    /// The call's clock, once the driver armed it.
    timer: Option<timers::Timer>,
}

/// One rank's call engine (see the module docs for its rules).
#[derive(Debug)]
pub struct Engine<P> {
    rank: usize,
    world: usize,
    groups: FxHashMap<GroupId, GroupState>,
    calls: FxHashMap<CallId, Running>,
    next_call: u64,
    /// Collective frames by (group, mesh sender, seq, tag).
    coll: FxHashMap<(GroupId, usize, u64, u32), Filed<P>>,
    /// Point-to-point frames by (group, mesh sender, tag), in order.
    p2p: FxHashMap<(GroupId, usize, u32), VecDeque<Filed<P>>>,
    /// Peers whose connection ended (mesh ranks), with why.
    lost: Vec<(usize, String)>,
    /// The first frame that broke the protocol: (mesh peer, why).
    protocol: Option<(usize, String)>,
    /// The first abort received per group: (mesh peer, the peer's call,
    /// what it said).
    aborts: FxHashMap<GroupId, (usize, Fingerprint, AbortInfo)>,
    /// Every peer's first abort per group (at most one per peer), with
    /// the call it aborted and what it said: what `said_aborts` reports.
    said: FxHashMap<GroupId, Vec<(usize, Fingerprint, String)>>,
    /// Answers to stall probes: (mesh peer, its call at the asked seq).
    probes: Vec<(usize, Fingerprint)>,
    /// The latest collective made on each group, answered to probes even
    /// after it ended (a peer that already failed on a mismatch still says
    /// what it called).
    latest: FxHashMap<GroupId, Fingerprint>,
    /// Collective frames taken by calls still in flight: a second one is a
    /// duplicate.
    taken: FxHashSet<(GroupId, usize, u64, u32)>,
    /// The last calls made, for the flight recorder's dumps.
    flight: FlightRecorder,
}

impl<P> Engine<P> {
    /// The engine of mesh rank `rank` of `world`, with the world group.
    pub fn new(rank: usize, world: usize) -> Self {
        Self::for_group(GroupId::WORLD, rank, world)
    }

    /// The engine of rank `rank` of a communicator of `world` ranks that is
    /// group `group` (a stream-ordered backend has one communicator, and so
    /// one engine, per group: [`crate::ordered`]).
    pub fn for_group(group: GroupId, rank: usize, world: usize) -> Self {
        let mut groups = FxHashMap::default();
        groups.insert(
            group,
            GroupState {
                members: (0..world).collect(),
                me: rank,
                next_seq: 0,
                poisoned: None,
                failed: None,
                children: 0,
            },
        );
        Engine {
            rank,
            world,
            groups,
            calls: FxHashMap::default(),
            next_call: 0,
            coll: FxHashMap::default(),
            p2p: FxHashMap::default(),
            lost: Vec::new(),
            protocol: None,
            aborts: FxHashMap::default(),
            said: FxHashMap::default(),
            probes: Vec::new(),
            latest: FxHashMap::default(),
            taken: FxHashSet::default(),
            flight: FlightRecorder::default(),
        }
    }

    /// The flight recorder: the last calls this rank made, on every group.
    pub fn flight(&self) -> &FlightRecorder {
        &self.flight
    }

    /// The flight recorder, to set its clock
    /// ([`FlightRecorder::set_now_us`]) before telling the engine of an
    /// event, or to replace it (another capacity).
    pub fn flight_mut(&mut self) -> &mut FlightRecorder {
        &mut self.flight
    }

    /// This rank in the mesh.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The mesh's size.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The mesh ranks of `group`'s members, in group-rank order.
    pub fn members(&self, group: GroupId) -> Option<&[usize]> {
        self.groups.get(&group).map(|g| g.members.as_slice())
    }

    /// The id of the next subgroup made from `parent`: every rank of the
    /// parent makes the same subgroups in the same order, members or not,
    /// so they all arrive at the same id.
    pub fn next_group_id(&mut self, parent: GroupId) -> Result<GroupId> {
        let g = self
            .groups
            .get_mut(&parent)
            .ok_or_else(|| CommError::invalid(format!("group {} is not known here", parent.0)))?;
        g.children += 1;
        let mut h: u32 = 0x811c_9dc5;
        for b in parent
            .0
            .to_le_bytes()
            .iter()
            .chain(&g.children.to_le_bytes())
        {
            h = (h ^ u32::from(*b)).wrapping_mul(0x0100_0193);
        }
        // Never WORLD. Ids derive from the parent's id and count alone, so
        // every rank computes the same one without talking; a collision with
        // a group this rank is in (odds 2^-32 per pair) is refused rather
        // than renumbered, which would make ranks disagree.
        let id = GroupId(h.max(1));
        if self.groups.contains_key(&id) {
            return Err(CommError::invalid(format!(
                "subgroup id {} collides with a group this rank is already in; make the groups \
                 in another order",
                id.0
            )));
        }
        Ok(id)
    }

    /// Makes a subgroup of `parent` from parent-group ranks `ranks` (checked,
    /// in group-rank order): every rank of the parent calls it, member or
    /// not, so that the ids agree. Returns `None` on non-members, else the
    /// new group's id, its members' mesh ranks and this rank's place.
    pub fn make_group(
        &mut self,
        parent: GroupId,
        ranks: &[usize],
    ) -> Result<Option<(GroupId, Vec<usize>, usize)>> {
        let parent_members = self
            .members(parent)
            .ok_or_else(|| CommError::invalid(format!("group {} is not known here", parent.0)))?;
        let members: Vec<usize> = ranks
            .iter()
            .map(|&g| {
                parent_members.get(g).copied().ok_or_else(|| {
                    CommError::invalid(format!(
                        "rank {g} is not in this group of {}",
                        parent_members.len()
                    ))
                })
            })
            .collect::<Result<_>>()?;
        let id = self.next_group_id(parent)?;
        if !members.contains(&self.rank) {
            return Ok(None);
        }
        let me = self.add_group(id, members.clone())?;
        Ok(Some((id, members, me)))
    }

    /// Adds a group whose members are these mesh ranks (in group-rank
    /// order); this rank must be one of them.
    pub fn add_group(&mut self, id: GroupId, members: Vec<usize>) -> Result<usize> {
        let me = members
            .iter()
            .position(|&m| m == self.rank)
            .ok_or_else(|| CommError::invalid("internal: a group without this rank"))?;
        if members.iter().any(|&m| m >= self.world) {
            return Err(CommError::invalid(
                "internal: a group member outside the mesh",
            ));
        }
        self.groups.insert(
            id,
            GroupState {
                members,
                me,
                next_seq: 0,
                poisoned: None,
                failed: None,
                children: 0,
            },
        );
        Ok(me)
    }

    /// Makes a call of `shape` on `group`: fixes its sequence number now,
    /// and so its fingerprint, and registers it as in flight. Fails fast,
    /// without registering, when the group is poisoned.
    pub fn begin(&mut self, group: GroupId, shape: crate::Shape) -> Result<Begun> {
        let op = shape.op;
        let p2p = matches!(op, OpKind::Send | OpKind::Recv);
        let g = self.groups.get_mut(&group).ok_or_else(|| {
            CommError::invalid(format!(
                "this rank is not a member of group {}; only members may call on it",
                group.0
            ))
        })?;
        let seq = if p2p { 0 } else { g.next_seq };
        let ctx = ErrorContext::new(op, g.me, seq, group);
        if let Some(e) = &g.poisoned {
            return Err(e.to_aborted().with_context(ctx));
        }
        if let Some((peer, why)) = &self.protocol {
            let e = CommError::protocol(Some(*peer), why.clone()).with_context(ctx);
            g.poisoned = Some(e.clone());
            return Err(e);
        }
        // A lost peer fails a call only once the call waits on it
        // ([`Engine::failure`]): it may have sent its part and left (a
        // process that exits after its last call), and what it sent is
        // already in the mailbox. A peer that is gone before its part
        // arrived still fails every call that needs it.
        if !p2p {
            g.next_seq += 1;
        }
        self.next_call += 1;
        let id = CallId(self.next_call);
        let fp = shape.at(group, seq);
        if !p2p {
            self.latest.insert(group, fp);
        }
        self.flight.issued(id.0, &fp);
        self.calls.insert(
            id,
            Running {
                group,
                fp,
                ctx,
                p2p,
                timer: None,
            },
        );
        Ok(Begun { id, seq, fp, ctx })
    }

    /// Files a data frame from mesh rank `from`, carrying `fp` and `tag`.
    /// A frame for a call this rank has already finished, or a second frame
    /// for one slot, breaks the protocol (recorded; every call fails).
    pub fn file(&mut self, from: usize, fp: Fingerprint, tag: u32, payload: P) {
        if matches!(fp.op, OpKind::Send | OpKind::Recv) {
            self.p2p
                .entry((fp.group, from, tag))
                .or_default()
                .push_back(Filed { fp, payload });
            return;
        }
        if let Some(g) = self.groups.get(&fp.group) {
            if g.poisoned.is_some() {
                // A failed group's late frames carry nothing anyone reads.
                return;
            }
            let running = self
                .calls
                .values()
                .any(|c| c.group == fp.group && !c.p2p && c.fp.seq == fp.seq);
            if fp.seq < g.next_seq && !running {
                self.protocol.get_or_insert((
                    from,
                    format!(
                        "a frame for call {} of group {}, which has already finished here \
                         (stale or duplicate)",
                        fp.seq, fp.group.0
                    ),
                ));
                return;
            }
        }
        let key = (fp.group, from, fp.seq, tag);
        if self.taken.contains(&key) || self.coll.insert(key, Filed { fp, payload }).is_some() {
            self.protocol.get_or_insert((
                from,
                format!(
                    "duplicate frame (group {}, seq {}, tag {tag})",
                    fp.group.0, fp.seq
                ),
            ));
        }
    }

    /// The frame for `call`'s receive from group rank `from` with `tag`, if
    /// it has arrived; `Err` when its fingerprint does not match the call.
    pub fn take(&mut self, call: CallId, from: usize, tag: u32) -> Option<Result<P>> {
        let c = self.calls.get(&call)?;
        let mesh = *self.groups.get(&c.group)?.members.get(from)?;
        let filed = if c.p2p {
            let q = self.p2p.get_mut(&(c.group, mesh, tag))?;
            let f = q.pop_front();
            if q.is_empty() {
                self.p2p.remove(&(c.group, mesh, tag));
            }
            f?
        } else {
            let key = (c.group, mesh, c.fp.seq, tag);
            let f = self.coll.remove(&key)?;
            self.taken.insert(key);
            f
        };
        let differs = if c.p2p {
            filed.fp.dtype != c.fp.dtype
        } else {
            filed.fp != c.fp
        };
        self.flight.started(call.0);
        Some(if differs {
            Err(CommError::Mismatch {
                ctx: ErrorContext::default(),
                local: c.fp,
                remote: filed.fp,
                remote_rank: from,
            })
        } else {
            Ok(filed.payload)
        })
    }

    /// Whether a point-to-point frame from group rank `from` with `tag`
    /// waits for `call` (so a lost peer still delivered its message).
    pub fn has_p2p(&self, call: CallId, from: usize, tag: u32) -> bool {
        let Some(c) = self.calls.get(&call) else {
            return false;
        };
        let Some(&mesh) = self.groups.get(&c.group).and_then(|g| g.members.get(from)) else {
            return false;
        };
        self.p2p.contains_key(&(c.group, mesh, tag))
    }

    /// The peer at mesh rank `peer` is gone (EOF, reset, crash).
    pub fn peer_lost(&mut self, peer: usize, why: impl Into<String>) {
        if !self.lost.iter().any(|(p, _)| *p == peer) {
            self.lost.push((peer, why.into()));
        }
    }

    /// The mesh ranks that are gone, with what was seen.
    pub fn lost(&self) -> &[(usize, String)] {
        &self.lost
    }

    /// Whether mesh rank `peer` is gone.
    pub fn is_lost(&self, peer: usize) -> bool {
        self.lost.iter().any(|(p, _)| *p == peer)
    }

    /// A frame from mesh rank `peer` broke the protocol.
    pub fn protocol_error(&mut self, peer: usize, why: impl Into<String>) {
        self.protocol.get_or_insert((peer, why.into()));
    }

    /// Every peer (its mesh rank) that said it failed a call of `group`,
    /// with the call it aborted (its fingerprint) and what it said, each
    /// peer's first abort only: known without making a call
    /// ([`crate::Backend::peer_aborts`]).
    pub fn said_aborts(&self, group: GroupId) -> &[(usize, Fingerprint, String)] {
        self.said.get(&group).map_or(&[], Vec::as_slice)
    }

    /// [`Engine::said_aborts`] as a group handle reports them
    /// ([`crate::Backend::peer_aborts`]): each peer by its group rank, its
    /// place in `members` (the group's mesh ranks).
    pub fn peer_aborts(&self, group: GroupId, members: &[usize]) -> Vec<crate::PeerAbort> {
        let rank = |p: usize| members.iter().position(|m| *m == p).unwrap_or(p);
        self.said_aborts(group)
            .iter()
            .map(|(p, call, said)| crate::PeerAbort {
                rank: rank(*p),
                call: *call,
                said: said.clone(),
            })
            .collect()
    }

    /// Mesh rank `peer` failed a call of `fp.group` and said why. The
    /// group's first abort is the cause its calls fail with; each peer's
    /// first is kept too ([`Engine::said_aborts`]), bounded by the group's
    /// size.
    pub fn aborted(&mut self, peer: usize, fp: Fingerprint, info: AbortInfo) {
        let said = self.said.entry(fp.group).or_default();
        if !said.iter().any(|(p, _, _)| *p == peer) {
            said.push((peer, fp, info.message().to_string()));
        }
        self.aborts.entry(fp.group).or_insert((peer, fp, info));
    }

    /// The peer at mesh rank `peer` answered a stall probe with `fp`.
    pub fn probe_reply(&mut self, peer: usize, fp: Fingerprint) {
        self.probes.push((peer, fp));
    }

    /// Whether this rank has made collective `seq` of `group` (it may have
    /// finished or failed since): a rank that has is not the one a stalled
    /// call waits for.
    pub fn made(&self, group: GroupId, seq: u64) -> bool {
        self.groups.get(&group).is_some_and(|g| g.next_seq > seq)
    }

    /// How this rank answers a peer's stall probe for call `seq` of
    /// `group`: its own call at that place, if it made one that is still in
    /// flight or is its latest.
    pub fn probe_answer(&self, group: GroupId, seq: u64) -> Option<Fingerprint> {
        self.calls
            .values()
            .find(|c| c.group == group && !c.p2p && c.fp.seq == seq)
            .map(|c| c.fp)
            .or_else(|| self.latest.get(&group).copied().filter(|f| f.seq == seq))
    }

    /// The error `call` must fail with now, if any. `waiting_on` are the
    /// group ranks its schedule still waits for.
    pub fn failure(&mut self, call: CallId, waiting_on: &[usize]) -> Option<CommError> {
        let c = self.calls.get(&call)?;
        let g = self.groups.get(&c.group)?;
        if let Some(e) = &g.poisoned {
            return Some(e.to_aborted());
        }
        if let Some((peer, why)) = &self.protocol {
            return Some(CommError::protocol(Some(*peer), why.clone()));
        }
        let group_rank = |mesh: usize| g.members.iter().position(|&m| m == mesh);
        if let Some((peer, theirs, info)) = self.aborts.get(&c.group) {
            let peer = (group_rank(*peer).unwrap_or(*peer), *theirs);
            return Some(from_abort(peer, info.clone(), c.fp, waiting_on.to_vec()));
        }
        if let Some((peer, reason)) = self.lost.iter().find_map(|(p, why)| {
            group_rank(*p)
                .filter(|gr| waiting_on.contains(gr))
                .map(|gr| (gr, why.clone()))
        }) {
            return Some(CommError::PeerLost {
                ctx: ErrorContext::default(),
                peer,
                reason,
            });
        }
        if !c.p2p {
            let fp = c.fp;
            let found = self
                .probes
                .iter()
                .find(|(_, f)| f.group == fp.group && f.seq == fp.seq && *f != fp)
                .and_then(|(p, f)| group_rank(*p).map(|gr| (gr, *f)));
            if let Some((remote_rank, remote)) = found {
                return Some(CommError::Mismatch {
                    ctx: ErrorContext::default(),
                    local: fp,
                    remote,
                    remote_rank,
                });
            }
        }
        self.expired(call, waiting_on)
    }

    /// Ends `call` with `result`. A failure poisons the call's group (the
    /// first cause sticks) and, unless a peer's abort caused it, names the
    /// abort to send to the group's other members.
    pub fn end(&mut self, call: CallId, result: Result<()>) -> Ended {
        let Some(c) = self.remove(call) else {
            return Ended {
                result,
                abort: None,
            };
        };
        let result = result.map_err(|e| e.with_context(c.ctx));
        self.flight
            .ended(call.0, result.as_ref().err().map(ToString::to_string));
        let mut abort = None;
        if let (Err(e), Some(g)) = (&result, self.groups.get_mut(&c.group)) {
            let first = g.poisoned.is_none();
            g.poisoned.get_or_insert_with(|| e.clone());
            g.failed.get_or_insert(c.fp);
            let from_peer = self.aborts.contains_key(&c.group);
            if first && !from_peer {
                abort = Some((abort_info(e, Some(c.fp)), c.fp, g.others(self.rank)));
            }
        }
        if self.calls.is_empty() {
            self.probes.clear();
        }
        Ended { result, abort }
    }

    /// Takes `call` out of the calls in flight, and a collective's frames
    /// taken out of the record of taken ones.
    fn remove(&mut self, call: CallId) -> Option<Running> {
        let c = self.calls.remove(&call)?;
        if !c.p2p {
            self.taken
                .retain(|(g, _, seq, _)| !(*g == c.group && *seq == c.fp.seq));
        }
        Some(c)
    }

    /// `call` was refused by its driver before anything of it reached a
    /// peer (an argument that driver's transport cannot take, found after
    /// the call was made): it ends with `e` (recorded, with context) and,
    /// unlike [`Engine::end`], its group goes on, as after any argument
    /// error.
    pub fn refuse(&mut self, call: CallId, e: CommError) -> CommError {
        let Some(c) = self.remove(call) else {
            return e;
        };
        let e = e.with_context(c.ctx);
        self.flight.ended(call.0, Some(e.to_string()));
        e
    }

    /// `call`'s future was dropped before it finished: the group is
    /// poisoned with `cause` (what the dropper knew, [`crate::cancel`]) or
    /// with an error that says the call was cancelled, and the abort to
    /// send is returned. Nothing happens for a call that already ended.
    pub fn cancel(
        &mut self,
        call: CallId,
        cause: Option<CommError>,
    ) -> Option<(AbortInfo, Fingerprint, Vec<usize>)> {
        let c = self.calls.get(&call)?;
        let e = cause.unwrap_or_else(|| {
            CommError::aborted(crate::AbortCause::Cancelled {
                op: c.fp.op,
                seq: c.fp.seq,
            })
        });
        self.end(call, Err(e)).abort
    }

    /// What this rank tells its peers as it leaves: for each group whose
    /// calls failed, the first cause (a peer's abort as that peer said it,
    /// or this rank's own failure) against the group's latest call, for
    /// every other member. A peer still waiting on this rank then learns
    /// why before it sees the connection close: a third rank's abort may
    /// reach it after that close, which it would otherwise report as the
    /// cause.
    ///
    /// A mismatch is said as this rank's own error: a peer's abort names
    /// "the other side" against the peer's call, so relayed under this
    /// rank's fingerprint it could name this rank's own call as the odd one.
    pub fn parting_aborts(&self) -> Vec<(AbortInfo, Fingerprint, Vec<usize>)> {
        self.groups
            .iter()
            .filter_map(|(id, g)| {
                let e = g.poisoned.as_ref()?;
                // The call that failed, not a later one in flight beside it.
                let fp = g.failed.or_else(|| self.latest.get(id).copied())?;
                let info = match self.aborts.get(id) {
                    Some((_, _, said)) if !matches!(said, AbortInfo::Mismatch { .. }) => {
                        said.clone()
                    }
                    _ => abort_info(e, Some(fp)),
                };
                Some((info, fp, g.others(self.rank)))
            })
            .collect()
    }

    /// The context of call `call`'s errors, while it is in flight.
    pub fn context(&self, call: CallId) -> Option<ErrorContext> {
        self.calls.get(&call).map(|c| c.ctx)
    }

    /// Poisons `group` with `e` (the first cause sticks) when no call in
    /// flight carries the failure: a fingerprint check that found a
    /// mismatch after the call itself had ended.
    pub fn poison(&mut self, group: GroupId, e: CommError) {
        if let Some(g) = self.groups.get_mut(&group) {
            g.poisoned.get_or_insert(e);
        }
    }

    /// The sticky failure of `group`, if it is poisoned.
    pub fn poisoned(&self, group: GroupId) -> Option<&CommError> {
        self.groups.get(&group).and_then(|g| g.poisoned.as_ref())
    }

    /// Calls in flight on this rank.
    pub fn in_flight(&self) -> usize {
        self.calls.len()
    }
}

/// A peer's abort, as this rank's error for its call `own` (which waits on
/// group ranks `waiting_on`). `peer` is the aborting peer's group rank and
/// the call it aborted (the abort frame's fingerprint).
pub fn from_abort(
    (peer, theirs): (usize, Fingerprint),
    a: AbortInfo,
    own: Fingerprint,
    waiting_on: Vec<usize>,
) -> CommError {
    let ctx = ErrorContext::default();
    match a {
        AbortInfo::Mismatch {
            remote,
            remote_rank,
            ..
        } => {
            if remote == own {
                // The peer found this rank's call to be the odd one: the
                // other side is the peer's own call.
                CommError::Mismatch {
                    ctx,
                    local: own,
                    remote: theirs,
                    remote_rank: peer,
                }
            } else {
                CommError::Mismatch {
                    ctx,
                    local: own,
                    remote,
                    remote_rank: remote_rank as usize,
                }
            }
        }
        AbortInfo::PeerLost {
            peer: lost,
            message,
        } => CommError::PeerLost {
            ctx,
            peer: lost as usize,
            reason: message,
        },
        AbortInfo::Timeout { .. } => CommError::Timeout {
            ctx,
            after: Duration::ZERO,
            waiting_on,
        },
        AbortInfo::Other { message } => CommError::Aborted {
            ctx,
            cause: crate::AbortCause::Peer {
                rank: peer,
                message: message.clone(),
            },
        },
    }
}

/// What a rank tells its peers about its failure `e` in call `own`.
pub fn abort_info(e: &CommError, own: Option<Fingerprint>) -> AbortInfo {
    let message = e.to_string();
    match e {
        CommError::Mismatch {
            remote,
            remote_rank,
            local,
            ..
        } => AbortInfo::Mismatch {
            // Peers compare with their own call: send the side that is not
            // the common one (ours, if the peer called what we called).
            remote: if Some(*local) == own { *remote } else { *local },
            remote_rank: *remote_rank as u32,
            message,
        },
        CommError::PeerLost { peer, reason, .. } => AbortInfo::PeerLost {
            peer: *peer as u32,
            message: reason.clone(),
        },
        CommError::Timeout { .. } => AbortInfo::Timeout { message },
        _ => AbortInfo::Other { message },
    }
}
