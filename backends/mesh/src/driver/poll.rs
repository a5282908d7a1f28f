//! Polled links (same-host shared memory): the calls that wait take the
//! frames themselves, with no reader task and no system call per message.
//!
//! A frame sits in the queue as its header, its payload and zeros up to a
//! multiple of 8 bytes. [`Decoder`] takes it apart as the bytes come (a
//! frame may arrive over several polls) and hands it to
//! [`super::inbound`]: a posted receive is filled straight from the shared
//! queue, the one copy after the sender's.
//!
//! Waiting spins on every polled link for [`MeshOptions::spin`] (yielding
//! the core when this host runs more ranks than cores), then arms the links
//! and sleeps until a peer rings.

use std::sync::atomic::{AtomicBool, Ordering};

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
}

impl Polled {
    pub(super) fn new(link: Box<dyn PolledLink>) -> Self {
        Polled {
            link,
            send: tokio::sync::Mutex::new(()),
            recv: Mutex::new(Decoder::default()),
            lost: AtomicBool::new(false),
        }
    }
}

/// Where the payload of the frame being taken goes.
enum Sink {
    Place(Direct),
    Buffer(Vec<u8>),
}

/// The frame being taken: its header, its sink and how far it has come.
struct Current {
    h: FrameHeader,
    sink: Sink,
    got: usize,
    /// Padding still to skip after the payload.
    pad: usize,
}

pub(super) struct Decoder {
    head: [u8; HEADER_LEN],
    have: usize,
    cur: Option<Current>,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            head: [0; HEADER_LEN],
            have: 0,
            cur: None,
        }
    }
}

/// Zeros a frame is padded with to a multiple of 8 bytes.
pub(super) fn padding(payload: usize) -> usize {
    (8 - payload % 8) % 8
}

impl Decoder {
    /// Takes frames out of `bytes`; returns how many bytes it used (all of
    /// them), or why the stream is broken. Replies to send go to `replies`.
    fn feed(
        &mut self,
        inner: &Inner,
        peer: usize,
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
                    self.begin(inner, peer, replies)?;
                }
                continue;
            };
            let len = cur.h.payload_len as usize;
            if cur.got < len {
                let n = (len - cur.got).min(bytes.len());
                match &mut cur.sink {
                    Sink::Place(d) => apply_chunk(inner, peer, d, cur.got, &bytes[..n]),
                    Sink::Buffer(b) => b.extend_from_slice(&bytes[..n]),
                }
                cur.got += n;
                bytes = &bytes[n..];
            }
            let skip = cur.pad.min(bytes.len());
            cur.pad -= skip;
            bytes = &bytes[skip..];
            if cur.got == len && cur.pad == 0 {
                self.finish(inner, peer, replies);
            }
        }
        Ok(total)
    }

    /// A whole header has come: decide where its payload goes.
    fn begin(
        &mut self,
        inner: &Inner,
        peer: usize,
        replies: &mut Vec<[u8; HEADER_LEN]>,
    ) -> std::result::Result<(), String> {
        let h = FrameHeader::decode(&self.head, &inner.limits).map_err(|e| e.to_string())?;
        let len = h.payload_len as usize;
        let sink = match take_posted(inner, peer, &h) {
            Some(d) => Sink::Place(d),
            None => Sink::Buffer(inner.buffer(len)),
        };
        self.cur = Some(Current {
            h,
            sink,
            got: 0,
            pad: padding(len),
        });
        if len == 0 {
            self.finish(inner, peer, replies);
        }
        Ok(())
    }

    /// The current frame is whole: file it.
    fn finish(&mut self, inner: &Inner, peer: usize, replies: &mut Vec<[u8; HEADER_LEN]>) {
        let Some(cur) = self.cur.take() else { return };
        match cur.sink {
            Sink::Place(_) => file_done(inner, peer, &cur.h),
            Sink::Buffer(b) if cur.h.kind == FrameKind::Data => file_frame(inner, peer, &cur.h, b),
            Sink::Buffer(b) => {
                replies.extend(control(inner, peer, &cur.h, &b));
                inner.recycle(b);
            }
        }
    }
}

impl Inner {
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
            let pulled = l
                .link
                .pull(&mut |bytes| match dec.feed(self, p, bytes, &mut replies) {
                    Ok(n) => n,
                    Err(e) => {
                        bad.get_or_insert(e);
                        bytes.len()
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

    /// Spins on the polled links for up to the spin time; true as soon as
    /// something came. Otherwise arms them (the peers ring when they write)
    /// and polls once more, so that the caller may sleep.
    pub(super) fn spin(self: &Arc<Self>) -> bool {
        if self.polled.is_empty() {
            return false;
        }
        let start = Instant::now();
        loop {
            if self.poll_links() > 0 {
                return true;
            }
            if start.elapsed() >= self.spin {
                break;
            }
            if self.yield_spin {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        for &p in &self.polled {
            if let Link::Polled(l) = &self.links[p] {
                l.link.arm();
            }
        }
        self.poll_links() > 0
    }

    /// Writes one whole frame into polled link `l` to world rank `to`,
    /// taking this rank's own frames while it waits for room (two ranks
    /// sending to each other through full queues would otherwise wait on
    /// each other).
    pub(super) async fn send_polled(
        self: &Arc<Self>,
        to: usize,
        l: &Polled,
        header: &[u8],
        payload: &[u8],
    ) -> std::io::Result<()> {
        let zeros = [0u8; 8];
        let parts = [header, payload, &zeros[..padding(payload.len())]];
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let _one = l.send.lock().await;
        let mut done = 0;
        let mut since = Instant::now();
        loop {
            let n = l.link.push(&parts, done);
            done += n;
            if done == total {
                return Ok(());
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
            let notified = self.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.poll_links() > 0 || since.elapsed() < self.spin {
                if self.yield_spin {
                    std::thread::yield_now();
                }
                continue;
            }
            l.link.arm();
            let m = l.link.push(&parts, done);
            done += m;
            if m > 0 || done == total {
                continue;
            }
            let _ = before(Instant::now() + Duration::from_millis(10), notified).await;
        }
    }
}
