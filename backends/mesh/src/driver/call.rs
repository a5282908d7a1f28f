//! One call, run: the schedule's actions against the links and the
//! engine. [`MeshBackend::prepare`] builds a call's state when the call is
//! made ([`Prepared`]: its schedule, buffers, registry entry, armed
//! timer), outside the future, so that each call's allocation holds only
//! what lives across its awaits. [`CallRun`]'s methods are the steps of
//! [`Prepared::run`]'s loop: act on what the schedule asks, take
//! what has arrived, and wait (failing on the engine's verdict or at the
//! call's deadline, spinning on polled links, then sleeping until a frame
//! is filed, the pump wakes it, or its deadline).

use super::*;

/// A call in progress.
struct CallRun<'c> {
    b: &'c MeshBackend,
    schedule: consort_comm::algo::Schedule,
    raw: RawBufs,
    /// The engine's handle of the call, its place in its group's
    /// sequence and its fingerprint (from [`Begun`]).
    id: CallId,
    seq: u64,
    fp: Fingerprint,
    /// The call's key in the in-place registry.
    call_id: u64,
    /// Whether a receive of the call may go in the registry: not a
    /// point-to-point call, and a buffer it receives into is large enough
    /// (otherwise the registry is never touched: a small call's fast path).
    registers: bool,
    reduce: Option<ReduceOp>,
    /// The engine's deadline for the call, which bounds its sends.
    deadline: Instant,
    /// Receives posted and not yet taken.
    posted: Vec<Receive>,
    /// Scratch lists of [`CallRun::collect`], kept to avoid allocating.
    got: Vec<(Receive, Frame)>,
    done: Vec<Receive>,
    /// Whether large payloads may go as pull frames (the sources stay
    /// until taken).
    may_pull: bool,
    /// A clock reading taken just before the links were last spun on (the
    /// spin that found what `collect` then takes): the progress time, at
    /// most the spin time early, instead of reading the clock again.
    spun_at: Option<Instant>,
}

/// A call made and not yet run: dropped, field by field, as its run ends
/// or when it is dropped unrun (the pulls revoking what was not read, then
/// the registry entry, then the scratch and the scaled input the run's
/// buffers point into; the caller's own buffers stay borrowed for as long
/// as the call's `Work`).
pub(super) struct Prepared<'c> {
    run: CallRun<'c>,
    pulls: Pulls<'c>,
    _direct: DirectGuard<'c>,
    _scratch: Vec<u64>,
    /// A reduce_scatter's pre-scaled input (`Call::scaled_input`), which
    /// the run's input points into.
    _scaled_input: Option<Vec<u8>>,
    /// The reduce op to finish with (an average's division), if any.
    finalize: Option<ReduceOp>,
}

impl Prepared<'_> {
    /// Runs the call to its end.
    pub(super) async fn run(&mut self) -> Result<()> {
        let n = self.run.b.members.len();
        let (run, pulls, finalize) = (&mut self.run, &mut self.pulls, self.finalize);
        // Links write into this call's receives only while it is polled
        // (see `registry`).
        Polling {
            call: run.call_id,
            fut: async {
                run.run(pulls).await?;
                if let Some(op) = finalize {
                    // SAFETY: the call itself, inside its poll.
                    unsafe { run.raw.buffers() }.finalize(op, n)?;
                }
                Ok(())
            },
        }
        .await
    }
}

impl MeshBackend {
    /// Everything a call needs before it runs: its schedule, buffers,
    /// registry entry (unregistered when the guard drops), armed timer and
    /// pull list. The scratch store backs the run's scratch buffer.
    pub(super) fn prepare<'c>(
        &'c self,
        req: &mut Call<'_>,
        opts: &CallOptions,
        begun: &Begun,
    ) -> Result<Prepared<'c>> {
        let inner = &self.inner;
        let n = self.members.len();
        let schedule = {
            let spec = req.spec(self.me, n);
            let algo = self.opts.algo.select(req.op, spec.bytes(), n);
            lock(&self.programs).schedule(&spec, algo)?
        };
        let mut scratch_store = scratch(schedule.scratch_len(), req.dtype);
        let raw = RawBufs {
            dtype: req.dtype,
            input: (req.input_bytes().as_ptr(), req.input_bytes().len()),
            output: (req.output.as_mut_ptr(), req.output.len()),
            scratch: {
                let b = scratch_bytes(&mut scratch_store);
                (b.as_mut_ptr(), b.len())
            },
        };
        let largest = raw.input.1.max(raw.output.1).max(raw.scratch.1);
        let registers = !req.is_p2p() && largest >= self.opts.in_place_min;
        let call_id = registry::new_call(inner, registers);
        // Unregisters the call's receives when it ends, however it ends.
        let direct = DirectGuard(inner, call_id, registers);
        let timeout = opts.timeout_or(self.opts.timeout);
        let deadline = {
            let mut engine = lock(&inner.engine);
            let stall = Some(self.opts.stall_probe);
            engine.arm(begun.id, Instant::now(), timeout, stall);
            engine.deadline(begun.id)
        };
        inner.wake_pump();
        // Dropped (revoking what was not read) before the call's buffers
        // can go, however the call ends.
        let pulls = Pulls {
            inner,
            call: call_id,
            out: Vec::new(),
            fan_out: schedule.fans_out(),
            staging: None,
            claimed: false,
        };
        let run = CallRun {
            b: self,
            may_pull: schedule.sources_stay(),
            schedule,
            raw,
            id: begun.id,
            seq: begun.seq,
            fp: begun.fp,
            call_id,
            registers,
            reduce: req.reduce,
            deadline: deadline.unwrap_or_else(|| consort_comm::time::deadline(timeout)),
            posted: Vec::new(),
            got: Vec::new(),
            done: Vec::new(),
            spun_at: None,
        };
        Ok(Prepared {
            run,
            pulls,
            _direct: direct,
            _scratch: scratch_store,
            // Moved, not copied: the bytes stay where `raw` points.
            _scaled_input: req.scaled_input.take(),
            finalize: req.reduce.filter(|_| req.finalize),
        })
    }
}

impl CallRun<'_> {
    async fn run(&mut self, pulls: &mut Pulls<'_>) -> Result<()> {
        loop {
            while let Some(a) = self.schedule.poll() {
                match a {
                    Action::Transmit(tx) => self.transmit(tx, pulls).await?,
                    Action::Copy(c) => {
                        // SAFETY: the call itself, inside its poll.
                        unsafe { self.raw.buffers() }.copy(&c, self.reduce)?;
                    }
                    Action::Receive(rv) => self.post(rv),
                }
            }
            if self.schedule.is_done() {
                // The peers read this rank's pull frames before its buffers
                // may change.
                let inner = &self.b.inner;
                return inner.wait_pulls(pulls, self.id, self.deadline).await;
            }
            if self.collect()? {
                self.progressed();
                continue;
            }
            self.wait().await?;
        }
    }

    /// Tells the engine the call took a frame (its stall clock restarts).
    fn progressed(&mut self) {
        let waiting = self.schedule.waiting_on();
        let mut engine = lock(&self.b.inner.engine);
        let at = self.spun_at.take().unwrap_or_else(Instant::now);
        engine.progressed(self.id, at, &waiting);
    }

    /// Sends a transmit's range.
    async fn transmit(
        &mut self,
        tx: consort_comm::algo::Transmit,
        pulls: &mut Pulls<'_>,
    ) -> Result<()> {
        let inner = &self.b.inner;
        // SAFETY: a range being sent is never a posted receive's range
        // (see `Registry`).
        let payload = unsafe { self.raw.bytes(tx.buf, &tx.range) };
        let to = self.b.members[tx.to];
        // A peer known to be gone gets nothing: a write to its closed
        // socket may still succeed locally.
        let sent = if lock(&inner.engine).is_lost(to) {
            Some(Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the peer is gone",
            )))
        } else {
            let h = FrameHeader::data(self.fp, tx.tag, tx.range.start as u64, payload.len() as u64);
            match inner.fate(self.b.members[self.b.me], to) {
                faulty::Fate::Send
                    if inner.try_send_data(
                        to,
                        &h,
                        payload,
                        self.may_pull,
                        self.may_pull && self.schedule.fans_out(),
                    ) =>
                {
                    Some(Ok(()))
                }
                faulty::Fate::Send => {
                    let pulls = self.may_pull.then_some(pulls);
                    // Boxed: most small frames went above, and this state
                    // would make every call's future ~500 bytes larger.
                    let send = Box::pin(inner.send_data(to, h, payload, pulls));
                    before(self.deadline, send).await
                }
                faulty::Fate::Faulted(v, start) => {
                    // Boxed: only fault plans take this path, and its state
                    // would otherwise make every call's future larger.
                    let send = Box::pin(inner.send_faulted(to, (v, start), h, payload));
                    before(self.deadline, send).await
                }
                faulty::Fate::Crashed => Some(Err(std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    "this rank crashed (the fault plan's crash)",
                ))),
            }
        };
        match sent {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => {
                // A peer that failed first usually said why before
                // closing: report that cause.
                let waiting = self.schedule.waiting_on();
                let said = lock(&inner.engine).failure(self.id, &waiting);
                Err(said.unwrap_or_else(|| CommError::PeerLost {
                    ctx: ErrorContext::default(),
                    peer: tx.to,
                    reason: format!("send failed: {e}"),
                }))
            }
            None => Err(lock(&inner.engine).timed_out(self.id, &[tx.to])),
        }
    }

    /// Posts a receive; a large one goes in the in-place registry, for the
    /// links to fill straight from the wire or the queue.
    fn post(&mut self, rv: Receive) {
        let dtype = self.raw.dtype;
        let bytes = rv.range.len() * dtype.size_bytes();
        if self.registers
            && bytes >= self.b.opts.in_place_min
            && let Some(dst) = self.raw.ptr(rv.buf, &rv.range)
        {
            let key = key(self.b, self.seq, &rv);
            let direct = Direct {
                call: self.call_id,
                key,
                fp: self.fp,
                dst,
                len: bytes,
                reduce: rv
                    .reduce
                    .then(|| (self.reduce.unwrap_or(ReduceOp::Sum), dtype)),
            };
            lock(&self.b.inner.direct).posted.insert(key, direct);
        }
        self.posted.push(rv);
    }

    /// Takes what has arrived for the posted receives and applies it;
    /// returns whether anything did.
    fn collect(&mut self) -> Result<bool> {
        let inner = &self.b.inner;
        let (got, done) = (&mut self.got, &mut self.done);
        {
            let mut engine = lock(&inner.engine);
            // The first frame taken stamps the record's start.
            engine.flight_mut().set_now_lazy();
            let mut bad = None;
            let eid = self.id;
            self.posted
                .retain(|rv| match engine.take(eid, rv.from, rv.tag) {
                    None => true,
                    Some(Ok(Got::Done)) => {
                        done.push(rv.clone());
                        false
                    }
                    Some(Ok(Got::Frame(f))) => {
                        got.push((rv.clone(), f));
                        false
                    }
                    Some(Err(e)) => {
                        bad.get_or_insert(e);
                        false
                    }
                });
            if let Some(e) = bad {
                return Err(e);
            }
            // A peer that failed, a broken frame, or a lost peer this call
            // still waits on. (Peers that finished and exited are fine:
            // this call no longer needs them.)
            if got.is_empty()
                && done.is_empty()
                && let Some(e) = engine.failure(eid, &self.schedule.waiting_on())
            {
                return Err(e);
            }
        }
        // After the engine's news: a receive filed done has every chunk
        // that came outside this poll waiting here by now.
        let mut progressed = !done.is_empty() || !got.is_empty();
        if self.registers {
            progressed |= registry::take_pending(inner, self.call_id) > 0;
            // Handed back to the schedule from here on: a duplicated frame
            // that took a registration writes nothing more into these
            // ranges (and a frame that came the buffered way loses its
            // registration).
            let keys = done.iter().chain(got.iter().map(|(rv, _)| rv));
            let (b, seq) = (self.b, self.seq);
            registry::retire(inner, self.call_id, keys.map(|rv| key(b, seq, rv)));
        }
        for rv in done.drain(..) {
            self.schedule
                .handle_recv(rv.from, rv.tag)
                .map_err(|e| CommError::protocol(Some(rv.from), e.to_string()))?;
        }
        for (rv, f) in got.drain(..) {
            // SAFETY: the call itself, inside its poll.
            let applied =
                unsafe { self.raw.buffers() }.apply(&rv, &f.payload, self.reduce, rv.from);
            inner.recycle(f.payload);
            applied?;
            self.schedule
                .handle_recv(rv.from, rv.tag)
                .map_err(|e| CommError::protocol(Some(rv.from), e.to_string()))?;
        }
        Ok(progressed)
    }

    /// Nothing arrived: the call fails if the engine says so (a cause, a
    /// mismatch a stall probe found) or its own deadline has passed; else
    /// it spins on the polled links, then sleeps until a frame is filed,
    /// the pump wakes it, or its deadline. The engine's clock, and the
    /// stall probes, are the pump's alone ([`super::poll::pump`]).
    ///
    /// A call that finds work while it spins never registers for wakes: it
    /// does so only before it sleeps, then arms its links and looks once
    /// more (the links, the frames filed, the engine), so that nothing that
    /// came before is missed and a ring after the arm wakes it.
    async fn wait(&mut self) -> Result<()> {
        let inner = &self.b.inner;
        let now = Instant::now();
        self.fail_if_due(now)?;
        // Same-host peers write into shared queues: take what they wrote,
        // spinning a little before sleeping.
        if inner.spin(now) {
            self.spun_at = Some(now);
            return Ok(());
        }
        self.spun_at = None;
        // Registered before the links are armed: a ring after the arm
        // (which it uses up) wakes this call.
        let woken = inner.woken();
        let mut woken = std::pin::pin!(woken);
        woken.as_mut().enable();
        if inner.arm_and_poll(&|| false) {
            return Ok(());
        }
        if self.collect()? {
            self.progressed();
            return Ok(());
        }
        self.fail_if_due(now)?;
        let _ = before(self.deadline, woken).await;
        Ok(())
    }

    /// The call's error, if the engine has one for it (a cause, a mismatch
    /// a stall probe found) or its deadline has passed at `now`.
    fn fail_if_due(&self, now: Instant) -> Result<()> {
        let waiting = self.schedule.waiting_on();
        let mut engine = lock(&self.b.inner.engine);
        if let Some(e) = engine.failure(self.id, &waiting) {
            return Err(e);
        }
        if now >= self.deadline {
            return Err(engine.timed_out(self.id, &waiting));
        }
        Ok(())
    }
}

/// The in-place registry's key of receive `rv` of call `seq` on `b`.
fn key(b: &MeshBackend, seq: u64, rv: &Receive) -> DirectKey {
    (b.group, b.members[rv.from], seq, rv.tag)
}
