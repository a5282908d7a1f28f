//! Polled links (same-host shared memory): the calls that wait take the
//! frames themselves, with no reader task and no system call per message.
//!
//! A frame sits in the queue as its header, its payload and zeros up to a
//! multiple of 8 bytes. [`Decoder`] takes it apart as the bytes come (a
//! frame may arrive over several polls) and hands it to
//! [`super::inbound`]: a posted receive is filled straight from the shared
//! queue, the one copy after the sender's.
//!
//! A [`FrameKind::Pull`] frame carries the payload's address in the
//! sender's memory instead of the payload: the receiver reads it straight
//! into place (one copy in all), counts it read, and the sender, which
//! waits for that count before its call ends, may then change the bytes.
//! The address may instead name a position in the sender's stage (see
//! [`super::stage`]); the link's `read_peer` tells them apart.
//!
//! Waiting spins on every polled link for [`MeshOptions::spin`] (yielding
//! the core when this host runs more ranks than cores), then arms the links
//! and sleeps until a peer rings.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{inbound::*, *};

/// A polled link with the driver's state for it.
pub(super) struct Polled {
    pub(super) link: Box<dyn PolledLink>,
    /// One sender at a time (a frame is written whole).
    send: tokio::sync::Mutex<()>,
    /// One receiver at a time, and the frame it is in the middle of.
    recv: Mutex<Decoder>,
    /// The peer has been reported lost.
    lost: AtomicBool,
    /// Pull frames sent on this link (the last one's number).
    pub(super) pulls_sent: AtomicU64,
    /// The call (registry id) whose pull frames on this link are not all
    /// read yet, 0 for none: one at a time, so that revoking one call's
    /// pulls (numbers up to its last) never revokes another's.
    pub(super) puller: AtomicU64,
}

impl Polled {
    pub(super) fn new(link: Box<dyn PolledLink>) -> Self {
        Polled {
            link,
            send: tokio::sync::Mutex::new(()),
            recv: Mutex::new(Decoder::default()),
            lost: AtomicBool::new(false),
            pulls_sent: AtomicU64::new(0),
            puller: AtomicU64::new(0),
        }
    }
}

/// Where the payload of the frame being taken goes.
enum Sink {
    Place(Direct),
    Buffer(Vec<u8>),
    /// A pull frame: the 8 bytes of the payload's address.
    Address([u8; 8]),
}

/// Receives at least this large read their pull frames in place with
/// stores that bypass the caches (see `PolledLink::read_peer_streaming`):
/// a staged broadcast segment (1 MiB) is not read again soon.
const STREAMING_MIN_PULL: usize = 256 << 10;

/// Largest piece of a pull read under the registry lock at once.
const PULL_PIECE: usize = 1 << 20;

/// The frame being taken: its header, its sink and how far it has come.
struct Current {
    h: FrameHeader,
    sink: Sink,
    /// Bytes of what the queue holds of it (payload or address) taken.
    got: usize,
    /// Padding still to skip after them.
    pad: usize,
}

pub(super) struct Decoder {
    head: [u8; HEADER_LEN],
    have: usize,
    cur: Option<Current>,
    /// Pull frames taken on this link (the last one's number).
    pulls: u64,
    /// Where pulled bytes wait to be reduced into place, or to be kept for
    /// a call other than the one polling.
    bounce: Vec<u8>,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            head: [0; HEADER_LEN],
            have: 0,
            cur: None,
            pulls: 0,
            bounce: Vec::new(),
        }
    }
}

/// Zeros a frame is padded with to a multiple of 8 bytes.
pub(super) fn padding(payload: usize) -> usize {
    (8 - payload % 8) % 8
}

/// A peer's index and its link.
type From<'a> = (usize, &'a dyn PolledLink);

impl Decoder {
    /// Takes frames out of `bytes`; returns how many bytes it used (all of
    /// them), or why the stream is broken. Replies to send go to `replies`.
    fn feed(
        &mut self,
        inner: &Inner,
        from: From<'_>,
        mut bytes: &[u8],
        replies: &mut Vec<[u8; HEADER_LEN]>,
    ) -> std::result::Result<usize, String> {
        let total = bytes.len();
        while !bytes.is_empty() {
            let Some(cur) = self.cur.as_mut() else {
                let n = (HEADER_LEN - self.have).min(bytes.len());
                self.head[self.have..self.have + n].copy_from_slice(&bytes[..n]);
                self.have += n;
                bytes = &bytes[n..];
                if self.have == HEADER_LEN {
                    self.have = 0;
                    self.begin(inner, from, replies)?;
                }
                continue;
            };
            // What the queue holds of this frame: the payload, or a pull
            // frame's address.
            let len = match cur.sink {
                Sink::Address(_) => 8,
                _ => cur.h.payload_len as usize,
            };
            if cur.got < len {
                promote(inner, from.0, cur);
                let n = (len - cur.got).min(bytes.len());
                match &mut cur.sink {
                    Sink::Place(d) => deliver(inner, from.0, d, cur.got, &bytes[..n]),
                    Sink::Buffer(b) => b.extend_from_slice(&bytes[..n]),
                    Sink::Address(a) => a[cur.got..cur.got + n].copy_from_slice(&bytes[..n]),
                }
                cur.got += n;
                bytes = &bytes[n..];
            }
            let skip = cur.pad.min(bytes.len());
            cur.pad -= skip;
            bytes = &bytes[skip..];
            if cur.got == len && cur.pad == 0 {
                self.finish(inner, from, replies)?;
            }
        }
        Ok(total)
    }

    /// A whole header has come: decide where its payload goes.
    fn begin(
        &mut self,
        inner: &Inner,
        from: From<'_>,
        replies: &mut Vec<[u8; HEADER_LEN]>,
    ) -> std::result::Result<(), String> {
        let h = FrameHeader::decode(&self.head, &inner.limits).map_err(|e| e.to_string())?;
        let len = h.payload_len as usize;
        let (sink, inline) = if h.kind == FrameKind::Pull {
            (Sink::Address([0; 8]), 8)
        } else if let Some(d) = take_posted(inner, from.0, &h) {
            (Sink::Place(d), len)
        } else {
            (Sink::Buffer(inner.buffer(len)), len)
        };
        self.cur = Some(Current {
            h,
            sink,
            got: 0,
            pad: padding(inline),
        });
        if inline == 0 {
            self.finish(inner, from, replies)?;
        }
        Ok(())
    }

    /// The current frame is whole: file it (a pull frame: read it first).
    fn finish(
        &mut self,
        inner: &Inner,
        from: From<'_>,
        replies: &mut Vec<[u8; HEADER_LEN]>,
    ) -> std::result::Result<(), String> {
        let Some(cur) = self.cur.take() else {
            return Ok(());
        };
        let peer = from.0;
        match cur.sink {
            Sink::Place(_) => file_done(inner, peer, &cur.h),
            Sink::Buffer(b) if cur.h.kind == FrameKind::Data => file_frame(inner, peer, &cur.h, b),
            Sink::Buffer(b) => {
                replies.extend(control(inner, peer, &cur.h, &b));
                inner.recycle(b);
            }
            Sink::Address(a) => {
                self.pulls += 1;
                self.pull(inner, from, &cur.h, u64::from_le_bytes(a))?;
            }
        }
        Ok(())
    }

    /// Reads a pull frame's payload from the sender's memory: into the
    /// posted receive (reduced through the bounce buffer), or into a
    /// buffer filed with the engine; then counts it read. A pull that the
    /// sender revoked (its call failed or was dropped first) is dropped
    /// unfiled: what was read is not valid, and the sender's abort follows.
    fn pull(
        &mut self,
        inner: &Inner,
        (peer, link): From<'_>,
        h: &FrameHeader,
        addr: u64,
    ) -> std::result::Result<(), String> {
        let len = h.payload_len as usize;
        let (read, filed) = match take_posted(inner, peer, h) {
            Some(d) => (self.pull_in_place(inner, (peer, link), &d, addr), None),
            None => {
                let mut b = inner.buffer(len);
                b.resize(len, 0);
                (link.read_peer(addr, &mut b), Some(b))
            }
        };
        // Every pull frame taken is counted, read or not: the sender numbers
        // them in order.
        link.count_pull();
        // The sender revokes its bytes before it lets them go; one that
        // died is reported lost by its link (pidfd), not here.
        let dead = read
            .as_ref()
            .is_err_and(|e| link.is_closed() || e.raw_os_error() == Some(libc::ESRCH));
        if link.revoked() >= self.pulls || dead {
            if let Some(b) = filed {
                inner.recycle(b);
            }
            return Ok(());
        }
        read.map_err(|e| format!("reading a payload from rank {peer}'s memory: {e}"))?;
        match filed {
            None => file_done(inner, peer, h),
            Some(b) => file_frame(inner, peer, h, b),
        }
        Ok(())
    }

    /// Reads a pull frame's payload into posted receive `d`, a piece at a
    /// time: straight into place when this is `d`'s call's poll and the
    /// receive copies, otherwise through the bounce buffer (see
    /// [`deliver`]).
    fn pull_in_place(
        &mut self,
        inner: &Inner,
        (peer, link): From<'_>,
        d: &Direct,
        addr: u64,
    ) -> std::io::Result<()> {
        let mut off = 0;
        while off < d.len {
            let n = (d.len - off).min(PULL_PIECE);
            // A reduce takes staged bytes straight from the peer's stage.
            if in_place_now(d)
                && d.reduce.is_some()
                && link.with_staged(addr + off as u64, n, &mut |src| {
                    deliver(inner, peer, d, off, src)
                })?
            {
                off += n;
                continue;
            }
            if in_place_now(d) && d.reduce.is_none() {
                // SAFETY: this thread is inside the registering call's poll
                // (see `registry`), which holds no other reference to this
                // range, and `off + n <= d.len`.
                let dst = unsafe { std::slice::from_raw_parts_mut(d.dst.add(off), n) };
                if d.len >= STREAMING_MIN_PULL {
                    link.read_peer_streaming(addr + off as u64, dst)?;
                } else {
                    link.read_peer(addr + off as u64, dst)?;
                }
            } else {
                if self.bounce.len() < n {
                    self.bounce.resize(n, 0);
                }
                link.read_peer(addr + off as u64, &mut self.bounce[..n])?;
                deliver(inner, peer, d, off, &self.bounce[..n]);
            }
            off += n;
        }
        Ok(())
    }
}

/// Frames at least this large, taken into a buffer because their receive
/// was not posted yet, look for it again as more of them comes (on polled
/// links and streams alike).
pub(super) const PROMOTE_MIN: usize = 64 << 10;

/// Moves a data frame being taken into a buffer over to its receive, once
/// the call posts it: what came so far is applied, and the rest goes in
/// place. A frame whose header came while this rank was still in the call
/// before (a barrier's last poll takes the next call's first frame) would
/// otherwise be copied twice, and the sender, waiting for it, with it: the
/// 4-rank broadcast's first hop took 25 ms instead of 11 when it did.
fn promote(inner: &Inner, peer: usize, cur: &mut Current) {
    let Sink::Buffer(b) = &cur.sink else {
        return;
    };
    if cur.h.kind != FrameKind::Data || (cur.h.payload_len as usize) < PROMOTE_MIN {
        return;
    }
    let Some(d) = take_posted(inner, peer, &cur.h) else {
        return;
    };
    deliver(inner, peer, &d, 0, &b[..cur.got]);
    inner.late_posts.fetch_add(1, Ordering::Relaxed);
    if let Sink::Buffer(b) = std::mem::replace(&mut cur.sink, Sink::Place(d)) {
        inner.recycle(b);
    }
}

/// Closes a polled link whose frame was cut short (see `send_polled`).
struct CutGuard<'a> {
    link: &'a dyn PolledLink,
    done: usize,
    total: usize,
}

impl Drop for CutGuard<'_> {
    fn drop(&mut self) {
        if self.done > 0 && self.done < self.total {
            self.link.close();
        }
    }
}

/// How often the polled links are looked at while no call waits on them
/// (a ring comes sooner).
const IDLE_POLL: Duration = Duration::from_millis(10);

/// The rank's pump, one task per mesh: the one owner of the engine's
/// clock.
///
/// - **Time.** It alone calls `Engine::handle_timeout`, at the engine's
///   `poll_timeout` or every [`IDLE_POLL`] while calls are in flight: it
///   sends the stall probes the engine asks for (on a task of their own,
///   bounded) and wakes the calls when one stalled or passed its deadline
///   (a stalled call polls its links again: a same-host peer that is gone
///   rings no bell). Calls lock
///   the engine, change its state (begin, arm, file, end) and, when
///   nothing arrived, fail on the engine's verdict or on their own
///   deadline (`Engine::timed_out`); they never move the clock.
/// - **The polled links' bell.** When a peer rings (this rank armed its
///   links and sleeps), it wakes the sleeping calls (which also wake on
///   the bell themselves). It takes nothing while a call is in flight: the
///   calls poll, and a relay copying a large frame while the call it
///   belongs to waits for the link made them take turns (the 4-rank
///   broadcast's first hop: 8 ms, or 16 when they did).
/// - **Outside calls**, it looks at the polled links every [`IDLE_POLL`]
///   and arms them, so that a peer's abort still reaches this rank at once
///   (and its flight record is written), a probe is answered, and a lost
///   peer is reported, though no call is waiting. A mesh with no polled
///   link and no call in flight sleeps until a call starts
///   ([`Inner::wake_pump`]).
pub(super) async fn pump(inner: std::sync::Weak<Inner>, bell: Arc<Notify>, pump: Arc<Notify>) {
    let mut rung = false;
    loop {
        let ring = bell.notified();
        let mut ring = std::pin::pin!(ring);
        ring.as_mut().enable();
        let started = pump.notified();
        let mut started = std::pin::pin!(started);
        started.as_mut().enable();
        let wait = {
            let Some(inner) = inner.upgrade() else {
                return;
            };
            if rung {
                inner.notify.notify_waiters();
            }
            // Parked until a call starts, unless the engine has a timer:
            // set before the engine is looked at, so a call armed after
            // that look sees it and wakes the pump.
            inner.pump_parked.store(true, Ordering::SeqCst);
            let (probes, next, idle) = {
                let mut engine = lock(&inner.engine);
                let (probes, expired) = engine.handle_timeout(Instant::now());
                if expired || !probes.is_empty() {
                    // A call's deadline passed (its waiter fails), or a
                    // call stalled: the waiting calls look again, and
                    // poll their links (a same-host peer that is gone is
                    // found there; it rings no bell).
                    inner.notify.notify_waiters();
                }
                (probes, engine.poll_timeout(), engine.in_flight() == 0)
            };
            if !probes.is_empty() {
                tokio::spawn(send_probes(inner.clone(), probes));
            }
            if idle {
                for &p in &inner.polled {
                    if let Link::Polled(l) = &inner.links[p] {
                        l.link.arm();
                    }
                }
                inner.poll_links();
            }
            let wait = match next {
                Some(at) => Some(at.saturating_duration_since(Instant::now()).min(IDLE_POLL)),
                None if !inner.polled.is_empty() => Some(IDLE_POLL),
                None => None,
            };
            if wait.is_some() {
                inner.pump_parked.store(false, Ordering::SeqCst);
            }
            wait
        };
        rung = match wait {
            Some(w) => tokio::select! {
                _ = &mut ring => true,
                _ = &mut started => false,
                _ = tokio::time::sleep(w) => false,
            },
            None => tokio::select! {
                _ = &mut ring => true,
                _ = &mut started => false,
            },
        };
    }
}

/// Sends stall probes to every peer at once, under one deadline (one at a
/// time, a full socket per peer would hold the others up a second each).
async fn send_probes(inner: Arc<Inner>, probes: Vec<consort_comm::engine::Probe>) {
    let frames: Vec<_> = probes
        .iter()
        .map(|p| {
            let f = super::inbound::probe_frame(consort_comm::frame::FrameKind::Probe, Some(p.fp));
            (p.to, f)
        })
        .collect();
    let sends = frames
        .iter()
        .map(|(to, f)| inner.send_frame(*to, 0, f, &[]));
    super::all_before(Instant::now() + Duration::from_secs(1), sends).await;
}

impl Inner {
    /// A call armed its timer: wakes the pump if it sleeps with none.
    pub(super) fn wake_pump(&self) {
        if self.pump_parked.swap(false, Ordering::SeqCst) {
            self.pump.notify_one();
        }
    }

    /// Takes what the polled links hold; returns the bytes taken. A link
    /// whose peer is gone, once drained, reports the peer lost.
    pub(super) fn poll_links(self: &Arc<Self>) -> usize {
        let mut total = 0;
        for &p in &self.polled {
            let Link::Polled(l) = &self.links[p] else {
                continue;
            };
            if l.lost.load(Ordering::Relaxed) {
                continue;
            }
            // Another call is taking this link's frames: they reach the
            // engine either way.
            let Ok(mut dec) = l.recv.try_lock() else {
                continue;
            };
            let mut replies = Vec::new();
            let mut bad = None;
            let link = &*l.link;
            let pulled = l.link.pull(&mut |bytes| {
                // After a broken frame nothing more is decoded.
                if bad.is_some() {
                    return bytes.len();
                }
                match dec.feed(self, (p, link), bytes, &mut replies) {
                    Ok(n) => n,
                    Err(e) => {
                        bad.get_or_insert(e);
                        bytes.len()
                    }
                }
            });
            drop(dec);
            for reply in replies {
                let inner = self.clone();
                tokio::spawn(async move { inner.send_frame(p, 0, &reply, &[]).await });
            }
            let gone = match (bad, pulled) {
                (Some(e), _) => {
                    broken(self, p, format!("bad frame: {e}"));
                    // The peer must not wait on a link nobody reads.
                    l.link.close();
                    Some(format!("bad frame: {e}"))
                }
                (None, Err(why)) => Some(why),
                (None, Ok(n)) => {
                    total += n;
                    None
                }
            };
            if let Some(why) = gone
                && !l.lost.swap(true, Ordering::Relaxed)
            {
                lock(&self.engine).peer_lost(p, why);
                self.notify.notify_waiters();
                total += 1;
            }
        }
        total
    }

    /// Spins on the polled links for up to the spin time from `start` (the
    /// caller's clock reading: a read costs ~20 ns, a tenth of a small
    /// call's own work); true as soon as something came. It does not arm
    /// them: a caller that would sleep registers for wakes first, then
    /// [`Self::arm_and_poll`]s, so that a ring after the arm reaches it.
    pub(super) fn spin(self: &Arc<Self>, start: Instant) -> bool {
        self.spin_only(start, &|| false)
    }

    /// [`Self::spin`], also ending (true) as soon as `done` holds (a wait
    /// for a peer's counter, its pull frames read, which moves without a
    /// frame); then, if nothing came, [`Self::arm_and_poll`]. For callers
    /// that registered for wakes before it.
    pub(super) fn spin_until(self: &Arc<Self>, start: Instant, done: &dyn Fn() -> bool) -> bool {
        self.spin_only(start, done) || self.arm_and_poll(done)
    }

    /// Arms the polled links (their peers ring when they next write) and
    /// polls them once more: true if something came or `done` holds. The
    /// caller has registered for wakes already; an arm is used up by the
    /// ring it causes, so a caller that found something and waits again
    /// arms again.
    pub(super) fn arm_and_poll(self: &Arc<Self>, done: &dyn Fn() -> bool) -> bool {
        for &p in &self.polled {
            if let Link::Polled(l) = &self.links[p] {
                l.link.arm();
            }
        }
        self.poll_links() > 0 || done()
    }

    /// The spinning part of [`Self::spin_until`].
    fn spin_only(self: &Arc<Self>, start: Instant, done: &dyn Fn() -> bool) -> bool {
        if self.polled.is_empty() {
            return false;
        }
        for round in 1u32.. {
            if self.poll_links() > 0 || done() {
                return true;
            }
            // The clock costs more than a poll: look at it now and then,
            // but after every yield, which may hand the core away for a
            // whole time slice (a waiting rank of an oversubscribed host
            // that looked only every 16 yields stayed runnable for ms, and
            // took its fair share of a core from the ranks copying).
            if (self.yield_spin || round % 16 == 0) && start.elapsed() >= self.spin {
                break;
            }
            // Yield the core now and then even with a core per rank: two
            // ranks the scheduler put on one core would otherwise take
            // turns only at the end of a time slice.
            if self.yield_spin || round % 512 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        false
    }

    /// Writes one whole frame into polled link `l` now, if no other sender
    /// is writing to it and the frame fits; returns whether it did. Most
    /// small frames go this way, with no future to make (see
    /// [`Self::send_polled`] for the rest).
    pub(super) fn try_send_polled(l: &Polled, header: &[u8], payload: &[u8]) -> bool {
        let Ok(_one) = l.send.try_lock() else {
            return false;
        };
        let zeros = [0u8; 8];
        l.link
            .push_whole(&[header, payload, &zeros[..padding(payload.len())]])
    }

    /// Writes one whole frame into polled link `l` to world rank `to`,
    /// taking this rank's own frames while it waits for room (two ranks
    /// sending to each other through full queues would otherwise wait on
    /// each other). With `pull`, `payload` is a pull frame's address, and
    /// the frame's number comes back.
    pub(super) async fn send_polled(
        self: &Arc<Self>,
        to: usize,
        l: &Polled,
        header: &[u8],
        payload: &[u8],
        pull: bool,
    ) -> std::io::Result<u64> {
        let zeros = [0u8; 8];
        let parts = [header, payload, &zeros[..padding(payload.len())]];
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let _one = l.send.lock().await;
        // A frame cut short (this future dropped by a deadline or a
        // cancelled call) would make the peer read the next frame's bytes
        // as the rest of this one: the link closes instead, and the peer
        // sees it closed.
        let mut cut = CutGuard {
            link: &*l.link,
            done: 0,
            total,
        };
        let mut since = Instant::now();
        loop {
            let n = l.link.push(&parts, cut.done);
            cut.done += n;
            let done = cut.done;
            if done == total {
                return Ok(if pull {
                    l.pulls_sent.fetch_add(1, Ordering::SeqCst) + 1
                } else {
                    0
                });
            }
            if l.link.is_closed() || lock(&self.engine).is_lost(to) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    "the peer is gone",
                ));
            }
            if n > 0 {
                since = Instant::now();
            }
            let woken = self.woken();
            let mut woken = std::pin::pin!(woken);
            woken.as_mut().enable();
            if self.poll_links() > 0 || since.elapsed() < self.spin {
                if self.yield_spin {
                    std::thread::yield_now();
                }
                continue;
            }
            l.link.arm();
            let m = l.link.push(&parts, done);
            cut.done += m;
            if m > 0 || cut.done == total {
                continue;
            }
            let _ = before(Instant::now() + Duration::from_millis(10), woken).await;
        }
    }
}
