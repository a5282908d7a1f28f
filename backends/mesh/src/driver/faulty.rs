//! The faulty link: `MeshOptions::faults` applied to this rank's outgoing
//! data frames, on whatever transport carries them, by the same rules the
//! simulator applies ([`FaultPlan::on_send`]). A dropped frame is not
//! sent, a delayed or held one waits, a duplicated one goes twice, a
//! corrupted one has its header's first byte flipped (the receiver refuses
//! the frame: `Protocol`), and a crash closes every link of this rank, as a
//! dying process's would, and fails its calls.

use consort_comm::fault::{Fault, FaultPlan, Rng, Trigger, Verdict};

use super::*;

/// The plan and what it needs: the RNG, the start, this rank's count of
/// frames sent, and whether it has crashed.
pub(super) struct Faulty {
    plan: FaultPlan,
    rng: Rng,
    start: Instant,
    sent: u64,
    crashed: bool,
}

impl Faulty {
    /// The faulty link of `faults`, or `None` for none.
    pub(super) fn new(faults: &[Fault], seed: u64) -> Option<Mutex<Faulty>> {
        (!faults.is_empty()).then(|| {
            Mutex::new(Faulty {
                plan: FaultPlan::new(faults.iter().cloned()),
                rng: Rng::new(seed),
                start: Instant::now(),
                sent: 0,
                crashed: false,
            })
        })
    }
}

/// What becomes of one data frame.
pub(super) enum Fate {
    /// Sent as it is.
    Send,
    /// Sent as the verdict says.
    Faulted(Verdict, Instant),
    /// This rank has crashed: nothing goes out.
    Crashed,
}

impl Inner {
    /// The fate of this rank's next data frame to world rank `to`.
    pub(super) fn fate(&self, rank: usize, to: usize) -> Fate {
        let Some(f) = &self.faults else {
            return Fate::Send;
        };
        let mut f = lock(f);
        if f.crashed {
            return Fate::Crashed;
        }
        f.sent += 1;
        let now = f.start.elapsed();
        let sent = f.sent;
        let mut v = {
            let Faulty { plan, rng, .. } = &mut *f;
            plan.on_send(rng, (rank, to), now, sent)
        };
        if let Some(Trigger::At(at)) = f.plan.crash_of(rank)
            && now >= at
        {
            v.crash_after = true;
        }
        Fate::Faulted(v, f.start)
    }

    /// Sends data frame `h` + `payload` to `to` as verdict `v` says, then
    /// crashes this rank if it says so.
    pub(super) async fn send_faulted(
        self: &Arc<Self>,
        to: usize,
        (v, start): (Verdict, Instant),
        h: FrameHeader,
        payload: &[u8],
    ) -> std::io::Result<()> {
        let mut wait = v.delay;
        if let Some(until) = v.held_until {
            wait = wait.max(until.saturating_sub(start.elapsed()));
        }
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        if !v.dropped {
            let mut header = h.encode();
            if v.corrupted {
                header[0] ^= 0x40;
            }
            for _ in 0..1 + usize::from(v.duplicated) {
                self.send_frame(to, h.tag, &header, payload).await?;
            }
        }
        if v.crash_after {
            self.crash().await;
        }
        Ok(())
    }

    /// This rank dies: every link closes, every call fails.
    pub(super) async fn crash(self: &Arc<Self>) {
        if let Some(f) = &self.faults {
            lock(f).crashed = true;
        }
        for h in lock(&self.readers).drain(..) {
            h.abort();
        }
        for link in &self.links {
            match link {
                Link::Me => {}
                Link::Streams(ws) => {
                    for w in ws {
                        let mut w = w.lock().await;
                        // One poll: the FIN goes out, as a dying process's
                        // would, with no wait for the peer's
                        // acknowledgements (a graceful close waits).
                        let _ = before(Instant::now(), w.w.shutdown()).await;
                        w.cut = true;
                    }
                }
                Link::Polled(p) => p.link.close(),
            }
        }
        let mut engine = lock(&self.engine);
        for peer in 0..self.links.len() {
            if !matches!(self.links[peer], Link::Me) {
                engine.peer_lost(peer, "this rank crashed (the fault plan's crash)");
            }
        }
        drop(engine);
        self.notify.notify_waiters();
    }
}
