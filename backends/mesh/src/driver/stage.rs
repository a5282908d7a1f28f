//! Staged sends: a fan-out's payload (`Program::fans_out`, the direct
//! broadcast) copied once into this rank's stage ([`PolledLink::stage`])
//! and read from there by every same-host peer it goes to, as pull frames
//! whose address is a stage position.
//!
//! The first transmit of a range stages it; the next ones of the same call
//! and range send only a frame. The stage is a ring this rank alone writes:
//! a position is freed, oldest first, once every peer it went to has read
//! its frame (the pull counts of their links), and it is all freed when the
//! call ends. A frame not read by then was revoked first (`Pulls`'s drop),
//! so a peer that reads freed bytes late drops them, as it drops any
//! revoked pull. One call at a time stages (`Inner::stager`); another that
//! finds the stage taken, or no room in it for its payload, sends through
//! the queues.

use std::{
    collections::VecDeque,
    sync::atomic::{AtomicU64, Ordering},
};

use super::{drive::Pulls, poll::Polled, *};

/// A payload of the call in the stage: its source, its stage address and
/// length, and the pull frames (peer, number) that name it.
struct Slot {
    src: (usize, usize),
    addr: u64,
    len: u64,
    holders: Vec<(usize, u64)>,
}

/// A call's staged payloads, oldest first (boxed in [`Pulls`]: most calls
/// never stage).
#[derive(Default)]
pub(super) struct Staging {
    slots: VecDeque<Slot>,
    /// A peer whose link reaches the stage (every link of the rank does).
    via: usize,
}

/// Payloads smaller than this go through the queues: a frame per peer
/// costs less than a slot.
const STAGE_MIN: usize = 64 << 10;

impl Inner {
    /// Sends `payload` to world rank `to` as a staged pull frame where it
    /// can: the call fans out, the peer reads this rank's stage, this call
    /// may stage (no other call does) and pull on the link, and the stage
    /// has (or frees) room. Returns whether it did; if not, the caller
    /// sends the payload through the queue.
    pub(super) async fn send_staged(
        self: &Arc<Self>,
        to: usize,
        l: &Polled,
        h: FrameHeader,
        payload: &[u8],
        pulls: &mut Pulls<'_>,
    ) -> std::io::Result<bool> {
        if !pulls.fan_out || !stage_sized(l, payload) || !claim(&self.stager, pulls.call) {
            return Ok(false);
        }
        // Held from here until the call ends (`Pulls::release`).
        if pulls.staging.is_none() {
            pulls.staging = Some(Box::new(Staging {
                via: to,
                ..Staging::default()
            }));
        }
        if !pulls.claim(l) {
            return Ok(false);
        }
        let Some(staging) = pulls.staging.as_mut() else {
            return Ok(false);
        };
        let src = (payload.as_ptr() as usize, payload.len());
        let addr = match staging.slots.iter().rev().find(|s| s.src == src) {
            Some(s) => s.addr,
            // The link stays the call's until it ends (`Pulls::release`).
            None => match self.stage_in(to, l, staging, payload).await? {
                Some(addr) => addr,
                None => return Ok(false),
            },
        };
        let header = FrameHeader {
            kind: FrameKind::Pull,
            ..h
        }
        .encode();
        let seq = self
            .send_polled(to, l, &header, &addr.to_le_bytes(), true)
            .await?;
        pulls.out.push((to, seq));
        self.staged_frames.fetch_add(1, Ordering::Relaxed);
        if let Some(s) = staging.slots.iter_mut().rev().find(|s| s.addr == addr) {
            s.holders.push((to, seq));
        }
        Ok(true)
    }

    /// Copies `payload` into the stage, waiting (polling the links) while
    /// the oldest slots are still being read; `None` if it can never fit.
    async fn stage_in(
        self: &Arc<Self>,
        to: usize,
        l: &Polled,
        staging: &mut Staging,
        payload: &[u8],
    ) -> std::io::Result<Option<u64>> {
        loop {
            self.free_read(staging);
            if let Some(addr) = l.link.stage(payload) {
                staging.slots.push_back(Slot {
                    src: (payload.as_ptr() as usize, payload.len()),
                    addr,
                    len: payload.len() as u64,
                    holders: Vec::new(),
                });
                return Ok(Some(addr));
            }
            // Nothing left to wait for: it does not fit at all.
            let Some(front) = staging.slots.front() else {
                return Ok(None);
            };
            let unread = front.holders.iter().find(|&&(p, seq)| {
                matches!(&self.links[p], Link::Polled(pl) if pl.link.pulls_read() < seq)
            });
            if let Some(&(p, _)) = unread
                && let Link::Polled(pl) = &self.links[p]
                && (pl.link.is_closed() || lock(&self.engine).is_lost(p))
            {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    format!("rank {p} left before reading this rank's staged payload"),
                ));
            }
            if l.link.is_closed() || lock(&self.engine).is_lost(to) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    "the peer is gone",
                ));
            }
            // The call's deadline bounds this wait (its transmit is raced
            // against it).
            let holders = &front.holders;
            self.wait_pull_count(&|| self.all_read(holders), None).await;
        }
    }

    /// Whether every peer has read its frame of a slot.
    fn all_read(&self, holders: &[(usize, u64)]) -> bool {
        holders.iter().all(
            |&(p, seq)| matches!(&self.links[p], Link::Polled(pl) if pl.link.pulls_read() >= seq),
        )
    }

    /// Frees the oldest slots whose frames every peer has read.
    fn free_read(&self, staging: &mut Staging) {
        let mut upto = None;
        while let Some(s) = staging.slots.front() {
            // A slot no frame went out for (its send failed) is free too.
            if !self.all_read(&s.holders) {
                break;
            }
            upto = Some(s.addr + s.len);
            staging.slots.pop_front();
        }
        if let (Some(upto), Link::Polled(l)) = (upto, &self.links[staging.via]) {
            l.link.free_stage(Some(upto));
        }
    }

    /// The call that staged `staging` is done with the stage: every slot is
    /// read or revoked. Frees it all for the next call.
    pub(super) fn unstage(&self, staging: &Staging, call: u64) {
        if let Link::Polled(l) = &self.links[staging.via] {
            l.link.free_stage(None);
        }
        let _ = self
            .stager
            .compare_exchange(call, 0, Ordering::SeqCst, Ordering::SeqCst);
    }
}

/// Whether `payload` is large enough to go to `l`'s peer through the stage,
/// and the peer reads it (in a call that fans out).
pub(super) fn stage_sized(l: &Polled, payload: &[u8]) -> bool {
    payload.len() >= STAGE_MIN && l.link.peer_reads_stage()
}

/// Takes `owner` for `call` if it is free (0), or tells whether `call`
/// holds it already.
pub(super) fn claim(owner: &AtomicU64, call: u64) -> bool {
    owner
        .compare_exchange(0, call, Ordering::SeqCst, Ordering::SeqCst)
        .map_or_else(|held| held == call, |_| true)
}
