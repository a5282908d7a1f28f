//! The sending side and a call's start and end: frames out (vectored,
//! never cut in half by a deadline, or into a polled link), a call begun
//! in the engine and ended there (its record, its heartbeat, its abort).
//! The call's own loop is [`super::call`]'s.

use std::sync::atomic::Ordering;

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

/// Runs `fut` until `deadline` on tokio's timer wheel; `None` if the
/// deadline came first.
pub(super) fn before<F: Future>(deadline: Instant, fut: F) -> Before<F> {
    Before {
        fut,
        deadline,
        timer: None,
    }
}

pin_project_lite::pin_project! {
    /// [`before`]'s future: `fut` is polled first, as tokio's `timeout_at`
    /// does, and the timer is made (boxed) only once `fut` has to wait. Most
    /// sends finish on their first poll, and tokio's `Sleep` is large (its
    /// timer entry is cache-line aligned): inline, and with an `async fn`'s
    /// second copy of its argument, it doubled the send's share of every
    /// call's future, which is allocated and copied on every call.
    pub(super) struct Before<F> {
        #[pin]
        fut: F,
        deadline: Instant,
        timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    }
}

impl<F: Future> Future for Before<F> {
    type Output = Option<F::Output>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = self.project();
        if let Poll::Ready(v) = this.fut.poll(cx) {
            return Poll::Ready(Some(v));
        }
        let deadline = *this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.into())));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
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
    pub(super) dtype: DType,
    pub(super) input: (*const u8, usize),
    pub(super) output: (*mut u8, usize),
    pub(super) scratch: (*mut u8, usize),
}

// SAFETY: the parts point into buffers that the call's future borrows for
// its whole life; they are dereferenced only inside that call's poll (see
// `registry`).
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
    pub(super) unsafe fn bytes(&self, buf: Buf, range: &std::ops::Range<usize>) -> &[u8] {
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
    /// Only the call itself, inside its poll, with no other slice of its
    /// buffers alive (links write into them only from inside that poll:
    /// see `registry`).
    pub(super) unsafe fn buffers(&self) -> CallBuffers<'_> {
        // SAFETY: the parts come from the call's live buffers, which do not
        // overlap; the caller holds no other slice of them, and no one else
        // writes them (see `registry`).
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
    /// that before the call ends. A fan-out's payload to a peer that reads
    /// this rank's stage goes through the stage first (see
    /// [`super::stage`]).
    pub(super) async fn send_data(
        self: &Arc<Self>,
        to: usize,
        h: FrameHeader,
        payload: &[u8],
        pulls: Option<&mut Pulls<'_>>,
    ) -> std::io::Result<()> {
        let (Some(pulls), Some(Link::Polled(l))) = (pulls, self.links.get(to)) else {
            return self.send_frame(to, h.tag, &h.encode(), payload).await;
        };
        // A fan-out's segment goes through the stage even where the peer
        // may read this rank's memory (CMA): 256 KiB reads pinned page by
        // page ran at 2.1-2.7 GB/s (64 MiB, 3 and 4 ranks) against the
        // stage's 8-13.
        if self.send_staged(to, l, h, payload, pulls).await? {
            return Ok(());
        }
        if self.pull_sized(l, payload) && pulls.claim(l) {
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

    /// Whether `payload` is large enough to go to `l`'s peer as a pull
    /// frame, if the call's sources stay until taken.
    fn pull_sized(&self, l: &super::poll::Polled, payload: &[u8]) -> bool {
        payload.len() >= self.single_copy_min && l.link.peer_pulls()
    }

    /// Sends a data frame to world rank `to` now, without waiting, where it
    /// can: a same-host peer's queue that has room and no other sender, for
    /// a payload that does not go as a pull frame (`may_pull`: the call's
    /// sources stay; `fan_out`: its schedule fans out, and a large enough
    /// payload goes through the stage). Returns whether it did; else
    /// [`Self::send_data`].
    pub(super) fn try_send_data(
        &self,
        to: usize,
        h: &FrameHeader,
        payload: &[u8],
        may_pull: bool,
        fan_out: bool,
    ) -> bool {
        match self.links.get(to) {
            Some(Link::Polled(l))
                if !(may_pull
                    && (self.pull_sized(l, payload)
                        || (fan_out && super::stage::stage_sized(l, payload)))) =>
            {
                Self::try_send_polled(l, &h.encode(), payload)
            }
            _ => false,
        }
    }

    /// Waits until the peers have read every pull frame of `pulls`.
    pub(super) async fn wait_pulls(
        self: &Arc<Self>,
        pulls: &mut Pulls<'_>,
        call: CallId,
        deadline: Instant,
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
                let read = || l.link.pulls_read() >= seq;
                if !self.wait_pull_count(&read, Some(deadline)).await {
                    return Err(lock(&self.engine).timed_out(call, &[to]));
                }
            }
        }
        pulls.release();
        Ok(())
    }

    /// Waits a while for `done`, a peer's pull count reaching a frame:
    /// spins while the links bring frames or it comes, else sleeps until
    /// woken or for 10 ms (at most until `deadline`). Returns `false` once
    /// the deadline has passed. The caller looks again, and checks that
    /// the peer is still there, before each wait.
    pub(super) async fn wait_pull_count(
        self: &Arc<Self>,
        done: &(dyn Fn() -> bool + Sync),
        deadline: Option<Instant>,
    ) -> bool {
        let woken = self.woken();
        let mut woken = std::pin::pin!(woken);
        woken.as_mut().enable();
        if self.spin_until(Instant::now(), done) {
            // Let the call's deadline (raced against its sends) fire even
            // while frames keep arriving.
            tokio::task::yield_now().await;
            return true;
        }
        let soon = Instant::now() + Duration::from_millis(10);
        let wake = deadline.map_or(soon, |d| d.min(soon));
        before(wake, woken).await.is_some() || deadline.is_none_or(|d| Instant::now() < d)
    }
}

/// The pull frames a call has sent and not yet seen read. If the call ends
/// before they are read (it failed or was dropped), their bytes are revoked
/// before they can go away: a peer that reads them late reports an error
/// instead of using them.
pub(super) struct Pulls<'a> {
    pub(super) inner: &'a Inner,
    /// The call's registry id (see `Polled::puller`).
    pub(super) call: u64,
    pub(super) out: Vec<(usize, u64)>,
    /// The call's schedule fans out (see `super::stage`).
    pub(super) fan_out: bool,
    /// What the call staged, once it has the stage.
    pub(super) staging: Option<Box<super::stage::Staging>>,
    /// Whether the call ever held a link's `puller` (see [`Self::claim`]).
    pub(super) claimed: bool,
}

impl Pulls<'_> {
    /// Takes link `l` for this call's pull frames (or tells whether the
    /// call holds it already).
    pub(super) fn claim(&mut self, l: &super::poll::Polled) -> bool {
        let got = super::stage::claim(&l.puller, self.call);
        self.claimed |= got;
        got
    }

    /// Every pull was read: the links (each this call took, whether or not
    /// a frame went on it: a send cut by the deadline or an error sends
    /// none) and the stage are free for another call's.
    fn release(&mut self) {
        if let Some(staging) = self.staging.take() {
            self.inner.unstage(&staging, self.call);
        }
        self.out.clear();
        if std::mem::take(&mut self.claimed) {
            for &p in &self.inner.polled {
                if let Link::Polled(l) = &self.inner.links[p] {
                    let _ =
                        l.puller
                            .compare_exchange(self.call, 0, Ordering::SeqCst, Ordering::SeqCst);
                }
            }
        }
    }
}

impl Drop for Pulls<'_> {
    fn drop(&mut self) {
        for &(to, seq) in &self.out {
            if let Some(Link::Polled(l)) = self.inner.links.get(to) {
                l.link.revoke(seq);
            }
        }
        self.release();
    }
}

impl MeshBackend {
    /// Registers a call with the engine, which fixes its sequence number
    /// now, and returns the work that drives it.
    pub(super) fn start<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        let ctx = ErrorContext {
            op: Some(op.kind()),
            rank: Some(self.me),
            group: Some(self.group),
            ..Default::default()
        };
        let mut req = match Call::from_op(self.name, self.me, self.members.len(), op, opts) {
            Ok(req) => req,
            Err(e) => return Work::ready(Err(e.with_context(ctx))),
        };
        let group = self.group;
        let now = super::flight::now_us();
        let begun = {
            let mut engine = lock(&self.inner.engine);
            engine.flight_mut().set_now_us(now);
            engine.begin(group, req.shape)
        };
        if let (Ok(b), Some(beat)) = (&begun, &self.inner.beat) {
            beat.made(&b.fp, now);
        }
        let begun = match begun {
            Ok(b) => b,
            Err(e) => return Work::ready(Err(e)),
        };
        let mut guard = CallGuard {
            inner: &self.inner,
            id: begun.id,
            armed: true,
            // Built now, not in the future's state (see `call`).
            prepared: Some(self.prepare(&mut req, opts, &begun)),
        };
        let id = begun.id;
        Work::new(async move {
            // Take the whole guard in (a field use alone would capture only
            // the field), in place: dropping this future cancels the call.
            let guard = &mut guard;
            // The run's state goes (its pulls revoked, its receives
            // unregistered) before the engine hears the call ended.
            let result = guard.run().await;
            guard.armed = false;
            let now = super::flight::now_us();
            let ended = {
                let mut engine = lock(&self.inner.engine);
                engine.flight_mut().set_now_us(now);
                engine.end(id, result)
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
                // Boxed: a failed call's path, and this future is ~800
                // bytes that every call's allocation would otherwise hold.
                Box::pin(propagate(&self.inner, abort)).await;
            }
            self.inner.notify.notify_waiters();
            ended.result
        })
    }
}
