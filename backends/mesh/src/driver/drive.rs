//! The sending side and the driver of one call: frames out (vectored,
//! never cut in half by a deadline, or into a polled link), the schedule's
//! actions against the engine, and stall probes.

use super::*;

/// One stream's write half, and whether a frame on it was cut off.
pub(crate) struct Writer {
    pub(super) w: BoxWrite,
    /// Set while a frame is being written, cleared when it is whole: still
    /// set afterwards means the writing future was dropped mid-frame (a
    /// deadline), and the peer would read the next frame's bytes as the rest
    /// of this one.
    pub(super) cut: bool,
}

/// Runs `fut` until `deadline` on tokio's timer wheel (cheap enough for
/// every send and every wait); `None` if the deadline came first.
pub(super) async fn before<F: Future>(deadline: Instant, fut: F) -> Option<F::Output> {
    tokio::time::timeout_at(deadline.into(), fut).await.ok()
}

/// Writes every slice, looping over partial vectored writes.
pub(super) async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    parts: &[&[u8]],
) -> std::io::Result<()> {
    let mut idx = 0;
    let mut off = 0;
    while idx < parts.len() {
        if parts[idx].len() == off {
            idx += 1;
            off = 0;
            continue;
        }
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len() - idx);
        slices.push(IoSlice::new(&parts[idx][off..]));
        for p in &parts[idx + 1..] {
            slices.push(IoSlice::new(p));
        }
        let mut n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 && idx < parts.len() {
            let left = parts[idx].len() - off;
            if n >= left {
                n -= left;
                idx += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// Writes one whole frame on `w`, or refuses: a stream that once carried a
/// cut-off frame carries nothing more, so a timeout never desynchronises
/// it (the peer waits for the missing bytes, then sees the connection end).
pub(super) async fn write_frame(
    w: &tokio::sync::Mutex<Writer>,
    parts: &[&[u8]],
) -> std::io::Result<()> {
    let mut g = w.lock().await;
    if g.cut {
        return Err(std::io::Error::other(
            "an earlier frame on this connection was cut off by a deadline; it carries no more \
             frames",
        ));
    }
    g.cut = true;
    write_all_vectored(&mut g.w, parts).await?;
    g.cut = false;
    Ok(())
}

/// A call's buffers as raw parts, so that reader tasks can write posted
/// receives in place while the call runs (see `Registry`).
pub(super) struct RawBufs {
    dtype: DType,
    input: (*const u8, usize),
    output: (*mut u8, usize),
    scratch: (*mut u8, usize),
}

// SAFETY: the parts point into buffers that the call's future borrows for
// its whole life; they are dereferenced only under the rules of `Registry`.
unsafe impl Send for RawBufs {}
// SAFETY: as above.
unsafe impl Sync for RawBufs {}

impl RawBufs {
    /// The start of `range` in `buf`, if it lies inside it.
    pub(super) fn ptr(&self, buf: Buf, range: &std::ops::Range<usize>) -> Option<*mut u8> {
        let e = self.dtype.size_bytes();
        let (base, len) = match buf {
            Buf::Input => (self.input.0.cast_mut(), self.input.1),
            Buf::Output => self.output,
            Buf::Scratch => self.scratch,
        };
        (range.end * e <= len).then(|| base.wrapping_add(range.start * e))
    }

    /// The bytes of `range` in `buf`.
    ///
    /// # Safety
    ///
    /// No one may write that range while the slice lives.
    unsafe fn bytes(&self, buf: Buf, range: &std::ops::Range<usize>) -> &[u8] {
        let e = self.dtype.size_bytes();
        match self.ptr(buf, range) {
            // SAFETY: in bounds (checked by `ptr`); the caller excludes writers.
            Some(p) => unsafe { std::slice::from_raw_parts(p, range.len() * e) },
            None => &[],
        }
    }

    /// Every buffer, for a copy, an apply or finalize.
    ///
    /// # Safety
    ///
    /// The registry lock must be held (no reader writes meanwhile).
    unsafe fn buffers(&self) -> CallBuffers<'_> {
        // SAFETY: the parts come from the call's live buffers, which do not
        // overlap; the caller holds the lock that keeps readers out.
        unsafe {
            CallBuffers {
                dtype: self.dtype,
                input: std::slice::from_raw_parts(self.input.0, self.input.1),
                output: std::slice::from_raw_parts_mut(self.output.0, self.output.1),
                scratch: std::slice::from_raw_parts_mut(self.scratch.0, self.scratch.1),
            }
        }
    }
}

/// Removes a call and its posted receives from the in-place registry when
/// it ends (returns, fails, or is cancelled), before its buffers can go
/// away.
pub(super) struct DirectGuard<'a>(&'a Inner, u64);

impl Drop for DirectGuard<'_> {
    fn drop(&mut self) {
        let mut reg = lock(&self.0.direct);
        reg.live.remove(&self.1);
        let call = self.1;
        reg.posted.retain(|_, d| d.call != call);
    }
}

impl Inner {
    /// Sends a frame to world rank `to`: on stream `lane % streams` (frames
    /// of one lane keep their order; lanes spread over the streams), or
    /// into its polled link.
    pub(super) async fn send_frame(
        self: &Arc<Self>,
        to: usize,
        lane: u32,
        header: &[u8],
        payload: &[u8],
    ) -> std::io::Result<()> {
        match self.links.get(to) {
            Some(Link::Streams(ws)) if !ws.is_empty() => {
                write_frame(&ws[lane as usize % ws.len()], &[header, payload]).await
            }
            Some(Link::Polled(l)) => self
                .send_polled(to, l, header, payload, false)
                .await
                .map(|_| ()),
            _ => Err(std::io::Error::other("no link to this rank")),
        }
    }

    /// Sends a data frame to world rank `to`. A large payload to a peer
    /// that can read this process's memory goes as a pull frame when
    /// `pulls` takes them: the peer copies it itself, and `pulls` waits for
    /// that before the call ends.
    async fn send_data(
        self: &Arc<Self>,
        to: usize,
        h: FrameHeader,
        payload: &[u8],
        pulls: Option<&mut Pulls<'_>>,
    ) -> std::io::Result<()> {
        if let (Some(pulls), Some(Link::Polled(l))) = (pulls, self.links.get(to))
            && payload.len() >= PULL_MIN
            && l.link.peer_pulls()
        {
            let header = FrameHeader {
                kind: FrameKind::Pull,
                ..h
            }
            .encode();
            let addr = (payload.as_ptr() as u64).to_le_bytes();
            let seq = self.send_polled(to, l, &header, &addr, true).await?;
            pulls.out.push((to, seq));
            return Ok(());
        }
        self.send_frame(to, h.tag, &h.encode(), payload).await
    }

    /// Waits until the peers have read every pull frame of `pulls`.
    async fn wait_pulls(
        self: &Arc<Self>,
        pulls: &mut Pulls<'_>,
        (deadline, timeout): (Instant, Duration),
    ) -> Result<()> {
        for &(to, seq) in &pulls.out {
            let Some(Link::Polled(l)) = self.links.get(to) else {
                continue;
            };
            while l.link.pulls_read() < seq {
                if l.link.is_closed() || lock(&self.engine).is_lost(to) {
                    return Err(CommError::PeerLost {
                        ctx: ErrorContext::default(),
                        peer: to,
                        reason: "it left before reading this rank's payload".into(),
                    });
                }
                let notified = self.notify.notified();
                let mut notified = std::pin::pin!(notified);
                notified.as_mut().enable();
                if self.spin() || l.link.pulls_read() >= seq {
                    continue;
                }
                let wake = deadline.min(Instant::now() + Duration::from_millis(10));
                if before(wake, notified).await.is_none() && Instant::now() >= deadline {
                    return Err(CommError::Timeout {
                        ctx: ErrorContext::default(),
                        after: timeout,
                        waiting_on: vec![to],
                    });
                }
            }
        }
        pulls.out.clear();
        Ok(())
    }
}

/// Payloads at least this large go to peers that can read this process's
/// memory as pull frames (one copy instead of two through the queue).
const PULL_MIN: usize = 64 * 1024;

/// The pull frames a call has sent and not yet seen read. If the call ends
/// before they are read (it failed or was dropped), their bytes are revoked
/// before they can go away: a peer that reads them late reports an error
/// instead of using them.
pub(super) struct Pulls<'a> {
    inner: &'a Inner,
    out: Vec<(usize, u64)>,
}

impl Drop for Pulls<'_> {
    fn drop(&mut self) {
        for &(to, seq) in &self.out {
            if let Some(Link::Polled(l)) = self.inner.links.get(to) {
                l.link.revoke(seq);
            }
        }
    }
}

impl MeshBackend {
    /// What this group's links can do: single-copy when every other member
    /// is a same-host peer that can read this rank's memory.
    fn fabric(&self) -> Fabric {
        let all = self.members.iter().all(|&m| match &self.inner.links[m] {
            Link::Me => true,
            Link::Polled(l) => l.link.peer_pulls(),
            Link::Streams(_) => false,
        });
        if all && self.members.len() > 1 {
            Fabric::SingleCopy
        } else {
            Fabric::Network
        }
    }

    /// Registers a call with the engine, which fixes its sequence number
    /// now, and returns the work that drives it.
    pub(super) fn start<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        let ctx = ErrorContext {
            op: Some(op.kind()),
            rank: Some(self.me),
            group: Some(self.group),
            ..Default::default()
        };
        let req = match Call::from_op("tcp", self.me, self.members.len(), op, opts) {
            Ok(req) => req,
            Err(e) => return Work::ready(Err(e.with_context(ctx))),
        };
        let group = self.group;
        let now = super::flight::now_us();
        let begun = {
            let mut engine = lock(&self.inner.engine);
            engine.flight_mut().set_now_us(now);
            engine.begin(group, req.op, |seq| req.fingerprint(group, seq))
        };
        if let (Ok(b), Some(beat)) = (&begun, &self.inner.beat) {
            beat.made(&b.fp, now);
        }
        let begun = match begun {
            Ok(b) => b,
            Err(e) => return Work::ready(Err(e)),
        };
        let opts = *opts;
        let guard = CallGuard {
            inner: &self.inner,
            id: begun.id,
            armed: true,
        };
        Work::new(async move {
            // Move the whole guard in (a field use alone would capture only
            // the field): dropping this future cancels the call.
            let mut guard = guard;
            let mut req = req;
            let result = self.drive(&mut req, &opts, &begun).await;
            guard.armed = false;
            let now = super::flight::now_us();
            let ended = {
                let mut engine = lock(&self.inner.engine);
                engine.flight_mut().set_now_us(now);
                engine.end(begun.id, result)
            };
            if let Some(beat) = &self.inner.beat {
                beat.ended(now);
            }
            if let Err(e) = &ended.result {
                // Before the peers hear of it: the first failing rank's
                // record is written before anything is torn down.
                super::flight::dump(&self.inner, &e.to_string(), true);
            }
            if let Some(abort) = ended.abort {
                propagate(&self.inner, abort).await;
            }
            self.inner.notify.notify_waiters();
            ended.result
        })
    }

    pub(super) async fn drive(
        &self,
        req: &mut Call<'_>,
        opts: &CallOptions,
        begun: &Begun,
    ) -> Result<()> {
        let inner = &self.inner;
        let (r, n) = (self.me, self.members.len());
        let (fp, seq, eid) = (begun.fp, begun.seq, begun.id);
        let p2p = req.is_p2p();
        let spec = req.spec(r, n);
        let algo = self
            .opts
            .algo
            .select_on(req.op, spec.bytes(), n, self.fabric());
        let mut schedule = build(&spec, algo, &self.opts.algo)?;
        let mut scratch_store = scratch(schedule.scratch_len(), req.dtype);
        let (reduce, finalize, dtype) = (req.reduce, req.finalize, req.dtype);
        let raw = RawBufs {
            dtype,
            input: (req.input_bytes().as_ptr(), req.input_bytes().len()),
            output: (req.output.as_mut_ptr(), req.output.len()),
            scratch: {
                let b = scratch_bytes(&mut scratch_store);
                (b.as_mut_ptr(), b.len())
            },
        };
        let call_id = {
            let mut reg = lock(&inner.direct);
            reg.next_call += 1;
            let id = reg.next_call;
            reg.live.insert(id);
            id
        };
        // Unregisters the call's receives when it ends, however it ends.
        let _direct = DirectGuard(inner, call_id);
        let timeout = opts.timeout_or(self.opts.timeout);
        let deadline = consort_comm::time::deadline(timeout);
        let mut posted: Vec<Receive> = Vec::new();
        // Declared after the buffers' raw parts and before nothing that
        // outlives them: dropped (revoking what was not read) before the
        // call's buffers can go.
        let mut pulls = Pulls {
            inner,
            out: Vec::new(),
        };
        let may_pull = schedule.sources_stay();
        let mut last_progress = Instant::now();
        let mut probed = false;
        let outcome: Result<()> = 'call: loop {
            while let Some(a) = schedule.poll() {
                match a {
                    Action::Transmit(tx) => {
                        // SAFETY: a range being sent is never a posted
                        // receive's range (see `Registry`).
                        let payload = unsafe { raw.bytes(tx.buf, &tx.range) };
                        let to = self.members[tx.to];
                        // A peer known to be gone gets nothing: a write to
                        // its closed socket may still succeed locally.
                        let gone = lock(&inner.engine).is_lost(to);
                        let sent = if gone {
                            Some(Err(std::io::Error::new(
                                std::io::ErrorKind::BrokenPipe,
                                "the peer is gone",
                            )))
                        } else {
                            let h = FrameHeader::data(
                                fp,
                                tx.tag,
                                tx.range.start as u64,
                                payload.len() as u64,
                            );
                            let pulls = may_pull.then_some(&mut pulls);
                            before(deadline, inner.send_data(to, h, payload, pulls)).await
                        };
                        match sent {
                            Some(Ok(())) => {}
                            Some(Err(e)) => {
                                // A peer that failed first usually said why
                                // before closing: report that cause.
                                let waiting = schedule.waiting_on();
                                let said = lock(&inner.engine).failure(eid, &waiting);
                                break 'call Err(said.unwrap_or_else(|| CommError::PeerLost {
                                    ctx: ErrorContext::default(),
                                    peer: tx.to,
                                    reason: format!("send failed: {e}"),
                                }));
                            }
                            None => {
                                break 'call Err(CommError::Timeout {
                                    ctx: ErrorContext::default(),
                                    after: timeout,
                                    waiting_on: vec![tx.to],
                                });
                            }
                        }
                    }
                    Action::Copy(c) => {
                        let reg = lock(&inner.direct);
                        // SAFETY: readers are excluded by the lock.
                        let copied = unsafe { raw.buffers() }.copy(&c);
                        drop(reg);
                        if let Err(e) = copied {
                            break 'call Err(e);
                        }
                    }
                    Action::Receive(rv) => {
                        let bytes = rv.range.len() * dtype.size_bytes();
                        if !p2p
                            && bytes >= self.opts.in_place_min
                            && let Some(dst) = raw.ptr(rv.buf, &rv.range)
                        {
                            let direct = Direct {
                                call: call_id,
                                fp,
                                dst,
                                len: bytes,
                                reduce: rv.reduce.then(|| (reduce.unwrap_or(ReduceOp::Sum), dtype)),
                            };
                            let key = (self.group, self.members[rv.from], seq, rv.tag);
                            lock(&inner.direct).posted.insert(key, direct);
                        }
                        posted.push(rv);
                    }
                }
            }
            if schedule.is_done() {
                // The peers read this rank's pull frames before its buffers
                // may change.
                break inner.wait_pulls(&mut pulls, (deadline, timeout)).await;
            }
            let notified = inner.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            // Take whatever has arrived for the posted receives.
            let mut got: Vec<(Receive, Frame)> = Vec::new();
            let mut done: Vec<Receive> = Vec::new();
            {
                let mut engine = lock(&inner.engine);
                engine.flight_mut().set_now_us(super::flight::now_us());
                let mut bad = None;
                posted.retain(|rv| match engine.take(eid, rv.from, rv.tag) {
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
                    break 'call Err(e);
                }
                // A peer that failed, a broken frame, or a lost peer this
                // call still waits on. (Peers that finished and exited are
                // fine: this call no longer needs them.)
                if got.is_empty()
                    && done.is_empty()
                    && let Some(e) = engine.failure(eid, &schedule.waiting_on())
                {
                    break 'call Err(e);
                }
            }
            for rv in &done {
                if let Err(e) = schedule.handle_recv(rv.from, rv.tag) {
                    break 'call Err(CommError::protocol(Some(rv.from), e.to_string()));
                }
            }
            let progressed = !done.is_empty() || !got.is_empty();
            if progressed {
                last_progress = Instant::now();
                probed = false;
            }
            for (rv, f) in got {
                let applied = {
                    let mut reg = lock(&inner.direct);
                    // The frame came the buffered way: its in-place
                    // registration must go before the range is reused.
                    reg.posted
                        .remove(&(self.group, self.members[rv.from], seq, rv.tag));
                    // SAFETY: readers are excluded by the lock.
                    unsafe { raw.buffers() }.apply(&rv, &f.payload, reduce, rv.from)
                };
                inner.recycle(f.payload);
                if let Err(e) = applied {
                    break 'call Err(e);
                }
                if let Err(e) = schedule.handle_recv(rv.from, rv.tag) {
                    break 'call Err(CommError::protocol(Some(rv.from), e.to_string()));
                }
            }
            if progressed {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(CommError::Timeout {
                    ctx: ErrorContext::default(),
                    after: timeout,
                    waiting_on: schedule.waiting_on(),
                });
            }
            // A call that makes no progress asks the peers it waits on what
            // they are doing: a peer in another call at this seq is a
            // mismatch that no frame would reveal.
            if !p2p && !probed && now.duration_since(last_progress) >= self.opts.stall_probe {
                probed = true;
                let probe = inbound::probe_frame(FrameKind::Probe, Some(fp));
                for q in schedule.waiting_on() {
                    let _ = before(
                        now + Duration::from_secs(1),
                        inner.send_frame(self.members[q], 0, &probe, &[]),
                    )
                    .await;
                }
            }
            // Same-host peers write into shared queues: take what they
            // wrote, spinning a little before sleeping.
            if inner.spin() {
                continue;
            }
            let wake =
                deadline.min(last_progress + self.opts.stall_probe.max(Duration::from_millis(10)));
            let wake = if wake <= now { deadline } else { wake };
            let _ = before(wake, notified).await;
        };
        if outcome.is_ok()
            && finalize
            && let Some(op) = reduce
        {
            let _reg = lock(&inner.direct);
            // SAFETY: readers are excluded by the lock.
            unsafe { raw.buffers() }.finalize(op, n)?;
        }
        outcome
    }
}
