//! How the world's events move calls on: arrivals, starts, deadlines and
//! crashes, turned into schedule progress through each rank's call engine.
//! The rules themselves (matching, mismatch, poisoning, what to tell the
//! peers) are the engine's; this module owns the virtual-time plumbing.

use consort_comm::{
    CommError, DType, ErrorContext, Fingerprint, GroupId, OpKind,
    algo::{Action, Transmit},
    frame::AbortInfo,
};

use super::{
    Duration, Event, Link, Msg, Owned, Payload, State, Status, TraceEvent, TraceKind, dur_ns, fnv,
    lost, ns,
};

impl State {
    pub(super) fn arrive(&mut self, to: usize, msg: Msg, t: u64) {
        let (seq, bytes) = match &msg.payload {
            Payload::Data(d) => (msg.fp.seq, d.len()),
            _ => (msg.fp.seq, 0),
        };
        let kind = if self.ranks[to].status == Status::Alive {
            TraceKind::Deliver
        } else {
            TraceKind::Drop
        };
        self.record(TraceEvent {
            time_ns: t,
            kind,
            from: msg.from,
            to,
            seq,
            tag: msg.tag,
            bytes,
        });
        if kind == TraceKind::Drop {
            return;
        }
        let from = msg.from;
        match msg.payload {
            Payload::Reset => {
                self.ranks[to]
                    .engine
                    .peer_lost(from, "connection reset: its process exited or crashed");
            }
            Payload::Abort(info) => self.ranks[to].engine.aborted(from, msg.fp, info),
            Payload::Data(data) => {
                if let Some(sum) = msg.checksum
                    && fnv(&data) != sum
                {
                    self.ranks[to].engine.protocol_error(
                        from,
                        "payload checksum mismatch: the message was corrupted in transit",
                    );
                } else {
                    self.ranks[to].engine.file(from, msg.fp, msg.tag, data);
                    if self.deliver(to, from, msg.fp.group, msg.tag, t) {
                        return;
                    }
                }
            }
        }
        self.check(to, t);
    }

    /// Fails rank `r`'s running call if the engine says it must fail now.
    fn check(&mut self, r: usize, t: u64) {
        let rank = &mut self.ranks[r];
        let Some(call) = rank.call.as_ref().filter(|c| c.started) else {
            return;
        };
        let waiting = call.schedule.waiting_on();
        if let Some(e) = rank.engine.failure(call.eid, &waiting) {
            self.fail(r, e, t);
        }
    }

    /// A frame from world rank `from` was filed: hands it to the running
    /// call if it waits for it. True when it did (and the call moved on).
    fn deliver(&mut self, r: usize, from: usize, group: GroupId, tag: u32, t: u64) -> bool {
        let rank = &self.ranks[r];
        let Some(call) = rank.call.as_ref().filter(|c| c.started && c.group == group) else {
            return false;
        };
        let Some(gr) = call.group_rank(from) else {
            return false;
        };
        if !call.schedule.is_posted(gr, tag) {
            return false;
        }
        match self.take(r, gr, tag, t) {
            Some(true) => {
                self.pump(r, t);
                true
            }
            Some(false) => true,
            None => false,
        }
    }

    /// Takes the frame for the running call's receive from group rank `gr`
    /// and applies it: `None` if it has not arrived, `Some(false)` if the
    /// call failed.
    fn take(&mut self, r: usize, gr: usize, tag: u32, t: u64) -> Option<bool> {
        let rank = &mut self.ranks[r];
        let call = rank.call.as_mut()?;
        let got = rank.engine.take(call.eid, gr, tag)?;
        let applied = got.and_then(|data| {
            let rv = call
                .schedule
                .posted_receive(gr, tag)
                .cloned()
                .ok_or_else(|| CommError::protocol(Some(gr), "internal: receive vanished"))?;
            let op = call.reduce;
            call.buffers().apply(&rv, &data, op, gr)?;
            call.schedule
                .handle_recv(gr, tag)
                .map_err(|e| CommError::protocol(Some(gr), e.to_string()))
        });
        match applied {
            Ok(()) => Some(true),
            Err(e) => {
                self.fail(r, e, t);
                Some(false)
            }
        }
    }

    /// Runs rank `r`'s schedule from time `t` until it blocks or finishes.
    pub(super) fn pump(&mut self, r: usize, t: u64) {
        loop {
            let rank = &mut self.ranks[r];
            let Some(call) = rank.call.as_mut() else {
                return;
            };
            let Some(action) = call.schedule.poll() else {
                if call.schedule.is_done() {
                    self.finish(r, t);
                } else {
                    self.check(r, t);
                }
                return;
            };
            match action {
                Action::Transmit(tx) => {
                    let to = call.members.get(tx.to).copied().unwrap_or(usize::MAX);
                    if rank.engine.is_lost(to) {
                        self.fail(r, lost(tx.to), t);
                        return;
                    }
                    self.transmit(r, tx, t);
                }
                Action::Copy(c) => {
                    let op = call.reduce;
                    if let Err(e) = call.buffers().copy(&c, op) {
                        self.fail(r, e, t);
                        return;
                    }
                }
                Action::Receive(rv) => match self.take(r, rv.from, rv.tag, t) {
                    Some(true) => {}
                    Some(false) => return,
                    None => {
                        let rank = &self.ranks[r];
                        let gone = rank.call.as_ref().is_some_and(|c| {
                            c.members
                                .get(rv.from)
                                .is_some_and(|&w| rank.engine.is_lost(w))
                        });
                        if gone {
                            self.fail(r, lost(rv.from), t);
                            return;
                        }
                    }
                },
            }
            if self.ranks[r].status != Status::Alive {
                return;
            }
        }
    }

    fn transmit(&mut self, r: usize, tx: Transmit, t: u64) {
        let Some(call) = self.ranks[r].call.as_mut() else {
            return;
        };
        let Some(&to) = call.members.get(tx.to) else {
            return;
        };
        let data = call.buffers().bytes(tx.buf, &tx.range).to_vec();
        let (fp, seq) = (call.fp, if call.p2p { 0 } else { call.fp.seq });
        let bytes = data.len();
        let link: Link = self.topo.link(r, to);
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
            to,
            seq,
            tag: tx.tag,
            bytes,
        });

        // The fault plan.
        let v = self
            .faults
            .on_send(&mut self.rng, (r, to), Duration::from_nanos(t), sent);
        let (copies, corrupt, dropped) = (1 + usize::from(v.duplicated), v.corrupted, v.dropped);
        arrive += dur_ns(v.delay);
        if let Some(h) = v.held_until {
            arrive = arrive.max(dur_ns(h));
        }
        if dropped {
            self.record(TraceEvent {
                time_ns: t,
                kind: TraceKind::Drop,
                from: r,
                to,
                seq,
                tag: tx.tag,
                bytes,
            });
        } else {
            let last = &mut self.ranks[r].last_arrive[to];
            *last = (*last).max(arrive);
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
                fp,
                tag: tx.tag,
                payload: Payload::Data(data),
                checksum,
            };
            for _ in 0..copies {
                self.push(
                    arrive,
                    r,
                    Event::Arrive {
                        to,
                        msg: Box::new(msg.clone()),
                    },
                );
            }
        }
        // A crash triggered by message count happens right after the send.
        if v.crash_after {
            self.crash(r, t);
        }
    }

    /// Rank `r`'s running call finished its schedule.
    fn finish(&mut self, r: usize, t: u64) {
        let rank = &mut self.ranks[r];
        let Some(mut call) = rank.call.take() else {
            return;
        };
        let n_group = call.members.len();
        let mut out = Ok(());
        if call.finalize
            && let Some(op) = call.reduce
        {
            out = call.buffers().finalize(op, n_group);
        }
        rank.engine.flight_mut().set_now_us(t / 1000);
        let ended = rank.engine.end(call.eid, out);
        rank.clock = rank.clock.max(t);
        rank.outcomes
            .insert(call.id, ended.result.map(|()| call.output));
        self.wake.insert(r);
        if let Some(abort) = ended.abort {
            self.send_abort(r, abort, t);
        }
        self.activate(r, t);
    }

    /// Rank `r`'s call `id` passed its deadline (`after`) still queued:
    /// the call ahead of it on the rank's stream never ended (its caller
    /// stopped polling it, or leaked it). It times out like a running call
    /// (the group is poisoned and the peers told), instead of waiting for
    /// a stream that never frees.
    pub(super) fn time_out_queued(
        &mut self,
        r: usize,
        id: u64,
        (after, waiting_on): (Duration, Vec<usize>),
        t: u64,
    ) {
        let rank = &mut self.ranks[r];
        let Some(call) = rank
            .queue
            .iter()
            .position(|c| c.id == id)
            .and_then(|i| rank.queue.remove(i))
        else {
            return;
        };
        let e = CommError::Timeout {
            ctx: ErrorContext {
                rank: Some(call.group_rank(r).unwrap_or(r)),
                ..Default::default()
            },
            after,
            waiting_on,
        };
        let ended = rank.engine.end(call.eid, Err(e));
        rank.outcomes
            .insert(call.id, ended.result.map(|()| Owned::default()));
        self.wake.insert(r);
        if let Some(abort) = ended.abort {
            self.send_abort(r, abort, t);
        }
    }

    /// Fails rank `r`'s running call with `err`: the engine poisons the
    /// group and names the abort to send, and the next call takes the
    /// stream.
    pub(super) fn fail(&mut self, r: usize, err: CommError, t: u64) {
        let rank = &mut self.ranks[r];
        let Some(call) = rank.call.take() else {
            return;
        };
        let err = err.with_context(ErrorContext {
            rank: Some(call.group_rank(r).unwrap_or(r)),
            ..Default::default()
        });
        let ended = rank.engine.end(call.eid, Err(err));
        rank.outcomes
            .insert(call.id, ended.result.map(|()| Owned::default()));
        rank.clock = rank.clock.max(t);
        self.wake.insert(r);
        if let Some(abort) = ended.abort {
            self.send_abort(r, abort, t);
        }
        self.activate(r, t);
    }

    /// Sends `info` about call `fp` to world ranks `to` (the alive ones).
    pub(super) fn send_abort(
        &mut self,
        r: usize,
        (info, fp, to): (AbortInfo, Fingerprint, Vec<usize>),
        t: u64,
    ) {
        for q in to {
            if q == r || self.ranks[q].status != Status::Alive {
                continue;
            }
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
                fp,
                tag: u32::MAX,
                payload: Payload::Abort(info.clone()),
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

    /// Puts rank `r`'s next waiting call on the stream, starting no earlier
    /// than `t`.
    pub(super) fn activate(&mut self, r: usize, t: u64) {
        let rank = &mut self.ranks[r];
        if rank.call.is_some() || rank.status != Status::Alive {
            return;
        }
        let Some(call) = rank.queue.pop_front() else {
            return;
        };
        // A call made before the host computed on (a send queued behind
        // another) starts when it was made, not after that computation.
        let start = t.max(rank.clock).max(call.issued);
        let (id, eid, timeout) = (call.id, call.eid, call.timeout);
        rank.call = Some(call);
        // The engine's clock, on virtual time: the call probes its group
        // at its deadline, then times out unless a probe explains the wait.
        let at = self.instant(start);
        let rank = &mut self.ranks[r];
        rank.engine.arm(eid, at, timeout, None);
        let wake = rank
            .engine
            .poll_timeout()
            .map_or(u64::MAX, |w| self.virtual_ns(w));
        self.push(wake, r, Event::Deadline { rank: r, call: id });
        // The call starts in virtual-time order with everything else.
        self.push(start, r, Event::Start { rank: r, call: id });
    }

    pub(super) fn start(&mut self, r: usize, id: u64, t: u64) {
        let rank = &mut self.ranks[r];
        let Some(call) = rank.call.as_mut().filter(|c| c.id == id) else {
            return;
        };
        call.started = true;
        // A call made while its group was healthy may find it poisoned by
        // the call before it: it fails at once, as the engine says.
        if let Some(e) = rank.engine.poisoned(call.group) {
            let e = e.to_aborted();
            self.fail(r, e, t);
            return;
        }
        self.pump(r, t);
    }

    pub(super) fn deadline(&mut self, r: usize, id: u64, t: u64) {
        let now = self.instant(t);
        let rank = &mut self.ranks[r];
        if rank.call.as_ref().is_none_or(|c| c.id != id) {
            return;
        }
        // The engine asks every other member which call it is in at this
        // call's place (what the mesh's stall probe frames ask): a rank in
        // a different call is a mismatch that no frame revealed, because
        // mismatched ranks can each wait on the other, directly or down a
        // chain. The simulator answers from the peers' engines at once.
        let (probes, _) = rank.engine.handle_timeout(now);
        for p in probes {
            let answer = self.ranks[p.to].engine.probe_answer(p.fp.group, p.fp.seq);
            if let Some(fp) = answer {
                self.ranks[r].engine.probe_reply(p.to, fp);
            }
        }
        // Started or not (a zero timeout meets its deadline first).
        let rank = &mut self.ranks[r];
        let Some(call) = rank.call.as_ref() else {
            return;
        };
        if let Some(e) = rank.engine.failure(call.eid, &call.schedule.waiting_on()) {
            self.fail(r, e, t);
        }
    }

    pub(super) fn crash(&mut self, r: usize, t: u64) {
        if self.ranks[r].status != Status::Alive {
            return;
        }
        self.record(TraceEvent {
            time_ns: t,
            kind: TraceKind::Crash,
            from: r,
            to: r,
            seq: 0,
            tag: 0,
            bytes: 0,
        });
        self.ranks[r].status = Status::Crashed;
        self.end_all(r, "this rank was crashed by the simulator's fault plan", t);
        self.reset_peers(r, t);
    }

    /// Ends every call of a rank that stopped (crashed or exited), without
    /// telling peers: they see the connection reset instead.
    pub(super) fn end_all(&mut self, r: usize, why: &str, t: u64) {
        let rank = &mut self.ranks[r];
        let calls: Vec<_> = rank
            .call
            .take()
            .into_iter()
            .chain(rank.queue.drain(..))
            .collect();
        for call in calls {
            let e = CommError::aborted(why.to_string());
            let ended = rank.engine.end(call.eid, Err(e));
            rank.outcomes
                .insert(call.id, ended.result.map(|()| Owned::default()));
        }
        rank.clock = rank.clock.max(t);
        self.wake.insert(r);
    }

    /// The process of rank `r` is gone: every survivor's connection resets.
    pub(super) fn reset_peers(&mut self, r: usize, t: u64) {
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
                // After the last message to q, however it was delayed.
                let at = (t + ns(self.topo.link(r, q).alpha)).max(self.ranks[r].last_arrive[q] + 1);
                let msg = Msg {
                    from: r,
                    fp,
                    tag: u32::MAX,
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

    /// Call `id` of rank `r` was dropped before it finished: the engine
    /// poisons its group and names the abort; the world forgets the call
    /// (never touching its buffers again) and runs the next one.
    pub(super) fn cancel(&mut self, r: usize, id: u64, t: u64) {
        let rank = &mut self.ranks[r];
        let call = if rank.call.as_ref().is_some_and(|c| c.id == id) {
            rank.call.take()
        } else {
            rank.queue
                .iter()
                .position(|c| c.id == id)
                .and_then(|i| rank.queue.remove(i))
        };
        rank.outcomes.remove(&id);
        let Some(call) = call else {
            return;
        };
        if let Some(abort) = rank.engine.cancel(call.eid, consort_comm::cancel::cause()) {
            self.send_abort(r, abort, t);
        }
        self.activate(r, t);
    }
}
