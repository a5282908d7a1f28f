//! [`SimRank`]: one rank's `Backend` handle on a [`super::SimWorld`], for the
//! world group or a subgroup, and the guard that unregisters a dropped call.

use std::{cmp::Reverse, sync::Arc, time::Duration};

use async_trait::async_trait;
use consort_comm::{
    Backend, CallOptions, CommError, ErrorContext, GroupId, Op, Result, Work,
    algo::{
        build,
        exec::{Call as CallReq, scratch},
    },
};

use super::{Call, Owned, Shared, State, Status, dur_ns, lock, wake};

/// One rank of a [`super::SimWorld`], on the world group or a subgroup.
/// Dropping the world handle is the rank's process exiting: peers that
/// still need it see `PeerLost`.
pub struct SimRank {
    pub(super) shared: Arc<Shared>,
    /// The world rank.
    pub(super) rank: usize,
    pub(super) group: GroupId,
    /// World rank of each group rank.
    pub(super) members: Arc<[usize]>,
    /// This rank's place in the group.
    pub(super) me: usize,
    /// The group's default timeout, if it has its own.
    pub(super) timeout: Option<Duration>,
    /// Whether this is the world handle (whose drop is the process exit).
    pub(super) owner: bool,
}

impl std::fmt::Debug for SimRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimRank")
            .field("rank", &self.me)
            .field("group", &self.group)
            .finish()
    }
}

impl Drop for SimRank {
    fn drop(&mut self) {
        if !self.owner {
            return;
        }
        let mut s = lock(&self.shared);
        let r = self.rank;
        if s.ranks[r].status == Status::Alive {
            s.ranks[r].status = Status::Exited;
            let t = s.ranks[r].clock;
            s.end_all(r, "this rank's handle was dropped (its process exited)", t);
            s.reset_peers(r, t);
            s.progress();
            wake(&self.shared, &mut s);
        }
    }
}

/// Unregisters a call whose work is dropped before it completes, so the
/// world never touches its buffers again, and aborts its group.
struct CallGuard<'a> {
    shared: &'a Shared,
    rank: usize,
    id: u64,
    armed: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut s = lock(self.shared);
        let t = s.ranks[self.rank].clock;
        s.cancel(self.rank, self.id, t);
        s.progress();
        wake(self.shared, &mut s);
    }
}

impl SimRank {
    /// The group ranks that hold up this rank's call `id` (running, or
    /// queued behind the call that is): the members that never made it;
    /// failing that (p2p, or every member made it), the members out of
    /// every call, since virtual time stands still while a rank stays out
    /// of every call (the ranks a schedule waits on may only be stuck
    /// behind them); failing that, the ranks the running call's schedule
    /// still waits for, when it is of the same group.
    fn holding_up(&self, s: &State, id: u64) -> Vec<usize> {
        let r = self.rank;
        let rank = &s.ranks[r];
        let call = rank
            .call
            .iter()
            .chain(rank.queue.iter())
            .find(|c| c.id == id);
        let at = call.filter(|c| !c.p2p).map(|c| (c.group, c.fp.seq));
        let pick = |f: &dyn Fn(usize) -> bool| -> Vec<usize> {
            let alive = |w: usize| w != r && s.ranks[w].status == Status::Alive;
            let m = self.members.iter().enumerate();
            m.filter(|&(_, &w)| alive(w) && f(w))
                .map(|(g, _)| g)
                .collect()
        };
        let absent = match at {
            Some((g, seq)) => pick(&|w| !s.ranks[w].engine.made(g, seq)),
            None => Vec::new(),
        };
        if !absent.is_empty() {
            return absent;
        }
        let idle = pick(&|w| !s.ranks[w].busy());
        if !idle.is_empty() {
            return idle;
        }
        let group = call.map(|c| c.group);
        (rank.call.as_ref())
            .filter(|c| Some(c.group) == group)
            .map(|c| c.schedule.waiting_on())
            .unwrap_or_default()
    }

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
                let settled = !s.ranks[self.rank].busy()
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

    fn ctx(&self, op: consort_comm::OpKind) -> ErrorContext {
        ErrorContext {
            op: Some(op),
            rank: Some(self.me),
            group: Some(self.group),
            ..Default::default()
        }
    }

    /// Registers a call: the engine fixes its sequence number now; it runs
    /// on the rank's stream after the calls made before it.
    /// Returns the call's id, its timeout and the caller's output buffer,
    /// which the call's future fills once the call succeeds.
    fn begin<'a>(
        &self,
        mut req: CallReq<'a>,
        opts: &CallOptions,
    ) -> Result<(u64, Duration, &'a mut [u8])> {
        let r = self.rank;
        let n = self.members.len();
        let mut s = lock(&self.shared);
        if s.ranks[r].status != Status::Alive {
            return Err(CommError::Aborted {
                ctx: self.ctx(req.op),
                cause: consort_comm::AbortCause::Closed("this rank has stopped".into()),
            });
        }
        let spec = req.spec(self.me, n);
        let algo = s.algo.select(req.op, spec.bytes(), n);
        let schedule = build(&spec, algo, &s.algo).map_err(|e| e.with_context(self.ctx(req.op)))?;
        let timeout = opts.timeout_or(self.timeout.unwrap_or(s.ranks[r].timeout));
        let rank = &mut s.ranks[r];
        let now_us = rank.clock.max(rank.host) / 1000;
        rank.engine.flight_mut().set_now_us(now_us);
        let begun = rank.engine.begin(self.group, req.shape)?;
        rank.calls += 1;
        let id = rank.calls;
        let issued = rank.host;
        rank.queue.push_back(Call {
            id,
            eid: begun.id,
            started: false,
            issued,
            group: self.group,
            members: self.members.clone(),
            fp: begun.fp,
            scratch: scratch(schedule.scratch_len(), req.dtype),
            schedule,
            p2p: req.is_p2p(),
            reduce: req.reduce,
            dtype: req.dtype,
            input: Owned::copy_of(req.input_bytes()),
            output: Owned::copy_of(req.output),
            finalize: req.finalize,
            timeout,
        });
        let t = rank.clock.max(rank.host);
        s.activate(r, t);
        s.progress();
        wake(&self.shared, &mut s);
        Ok((id, timeout, std::mem::take(&mut req.output)))
    }

    /// Waits for call `id`'s outcome. Virtual time is free; a rank that
    /// never returns to the world is caught by the timeout in real time.
    async fn wait(
        &self,
        mut guard: CallGuard<'_>,
        timeout: Duration,
        output: &mut [u8],
    ) -> Result<()> {
        let r = self.rank;
        let deadline_real = consort_comm::time::deadline(timeout);
        loop {
            let notified = self.shared.notify[r].notified();
            {
                let mut s = lock(&self.shared);
                if let Some(out) = s.ranks[r].outcomes.remove(&guard.id) {
                    guard.armed = false;
                    drop(s);
                    // Written here, in the caller's own future: nothing
                    // else ever holds the caller's buffer.
                    return out.map(|o| output.copy_from_slice(o.bytes()));
                }
            }
            if consort_comm::time::before(deadline_real, notified)
                .await
                .is_none()
            {
                let mut s = lock(&self.shared);
                let running = s.ranks[r].call.as_ref().filter(|c| c.id == guard.id);
                if let Some(eid) = running.map(|c| c.eid) {
                    let waiting_on = self.holding_up(&s, guard.id);
                    let e = s.ranks[r].engine.timed_out(eid, &waiting_on);
                    let t = s.ranks[r].clock;
                    s.fail(r, e, t);
                    s.progress();
                    wake(&self.shared, &mut s);
                } else {
                    let waiting_on = self.holding_up(&s, guard.id);
                    let t = s.ranks[r].clock;
                    s.time_out_queued(r, guard.id, (timeout, waiting_on), t);
                    s.progress();
                    wake(&self.shared, &mut s);
                }
            }
        }
    }
}

#[async_trait]
impl Backend for SimRank {
    fn name(&self) -> &'static str {
        "sim"
    }

    #[allow(clippy::misnamed_getters)] // the group rank, not the world rank
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
        self.timeout
            .unwrap_or_else(|| lock(&self.shared).ranks[self.rank].timeout)
    }

    /// Members whose process exited or crashed: the world knows at once
    /// (a real transport learns it from a closed connection as quickly).
    fn lost_peers(&self) -> Vec<(usize, String)> {
        let s = lock(&self.shared);
        self.members
            .iter()
            .enumerate()
            .filter_map(|(r, &w)| match s.ranks[w].status {
                Status::Alive => None,
                Status::Crashed => Some((r, "its process crashed (the fault plan)".to_string())),
                Status::Exited => Some((r, "its process exited".to_string())),
            })
            .collect()
    }

    fn peer_aborts(&self) -> Vec<consort_comm::PeerAbort> {
        let s = lock(&self.shared);
        s.ranks[self.rank]
            .engine
            .peer_aborts(self.group, &self.members)
    }

    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        let kind = op.kind();
        let req = match CallReq::from_op("sim", self.me, self.members.len(), op, opts) {
            Ok(req) => req,
            Err(e) => return Work::ready(Err(e.with_context(self.ctx(kind)))),
        };
        let (id, timeout, output) = match self.begin(req, opts) {
            Ok(x) => x,
            Err(e) => return Work::ready(Err(e)),
        };
        let guard = CallGuard {
            shared: &self.shared,
            rank: self.rank,
            id,
            armed: true,
        };
        Work::new(self.wait(guard, timeout, output))
    }

    async fn idle(&self, d: Duration) {
        self.compute(d).await;
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        // A lost member shows at the group's first collective, as on TCP.
        let made = lock(&self.shared).ranks[self.rank]
            .engine
            .make_group(self.group, ranks)?;
        let Some((id, members, me)) = made else {
            return Ok(None);
        };
        Ok(Some(Arc::new(SimRank {
            shared: self.shared.clone(),
            rank: self.rank,
            group: id,
            members: members.into(),
            me,
            timeout: opts.timeout.or(self.timeout),
            owner: false,
        })))
    }
}
