//! A rank's stage: one region that this rank alone writes and every
//! same-host peer maps read-only, so that a payload several peers need
//! (a broadcast's segment) is copied in once and read out by all of them
//! at once: `1 + readers` copies instead of two per reader.
//!
//! The stage holds no counters of its own. A staged payload travels as a
//! pull frame whose address is [`STAGED`] plus the payload's position in
//! the stage; the pair queues count pull frames read, and the driver frees
//! a position once every peer it went to has read it. Positions only grow;
//! a payload never wraps around the end (it starts over at the beginning
//! instead), so every read is one contiguous run.
//!
//! A peer is trusted with nothing: a position past the end of its stage is
//! an error, not a wild read, and a peer that rewrites bytes being read can
//! only spoil its own payload, as it could by sending other bytes. Peers
//! map a stage read-only, so a fault in one cannot write another's (a
//! hostile process of the same user could still open the memfd for writing
//! while it is being set up, as it could a queue's: see SECURITY.md).

use std::{io, sync::Mutex};

use consort_comm::par::{self, Pool};

use crate::region::Region;

/// The bit that marks a pull frame's address as a stage position.
/// User-space addresses never have it (x86-64 and AArch64 Linux keep them
/// below 2^48).
pub(crate) const STAGED: u64 = 1 << 63;

/// The smallest stage.
pub(crate) const MIN_STAGE: usize = 64 * 1024;

/// Staged payloads start on a cache line.
const ALIGN: u64 = 64;

/// This rank's stage, which it writes.
pub(crate) struct Stage {
    region: Region,
    ring: Mutex<Ring>,
}

/// Positions taken and freed; both only grow.
#[derive(Debug, Default)]
struct Ring {
    head: u64,
    freed: u64,
}

impl Stage {
    /// A stage over `region` (a power of two, at least [`MIN_STAGE`]).
    pub(crate) fn new(region: Region) -> Option<Stage> {
        let cap = region.len();
        (cap.is_power_of_two() && cap >= MIN_STAGE).then(|| Stage {
            region,
            ring: Mutex::new(Ring::default()),
        })
    }

    fn cap(&self) -> u64 {
        self.region.len() as u64
    }

    /// Copies `bytes` in if the stage has room for them now, and returns
    /// the address peers read them by: [`STAGED`] plus their position.
    /// `None`: no room until positions are freed, or more than half the
    /// stage (which could never pipeline).
    pub(crate) fn put(&self, bytes: &[u8]) -> Option<u64> {
        let (cap, len) = (self.cap(), bytes.len() as u64);
        if len > cap / 2 {
            return None;
        }
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let mut pos = ring.head;
        if pos % cap + len > cap {
            // Never across the end: start over at the beginning.
            pos = pos.next_multiple_of(cap);
        }
        if pos + len - ring.freed > cap {
            return None;
        }
        let off = (pos % cap) as usize;
        // SAFETY: `off + len <= cap` bytes of this process's writable
        // mapping, which no reader has been told about yet, or whose last
        // reader is done (`free`).
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.region.ptr().add(off), bytes.len()) };
        // Ordinary stores: the readers copy the segment out at once, from
        // the caches where it fits.
        par::copy(Pool::shared(), dst, bytes, false);
        ring.head = (pos + len).next_multiple_of(ALIGN);
        Some(STAGED | pos)
    }

    /// Every position before `upto` (a staged address plus its length) is
    /// read: the stage may reuse it.
    pub(crate) fn free(&self, upto: u64) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let upto = (upto & !STAGED).next_multiple_of(ALIGN).min(ring.head);
        ring.freed = ring.freed.max(upto);
    }

    /// Nothing staged is read any more.
    pub(crate) fn free_all(&self) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.freed = ring.head;
    }
}

/// A peer's stage, mapped read-only.
pub(crate) struct PeerStage {
    region: Region,
}

impl PeerStage {
    /// A peer's stage over `region` (checked as [`Stage::new`] does).
    pub(crate) fn new(region: Region) -> Option<PeerStage> {
        let cap = region.len();
        (cap.is_power_of_two() && cap >= MIN_STAGE).then_some(PeerStage { region })
    }

    /// Copies the staged bytes at `addr` into `dst`, with `streaming`
    /// stores that bypass the caches (for a large receive in place, which
    /// nothing reads again soon: see `consort_comm::reduce::copy`); an
    /// error if they would run past the end of the stage (the peer's
    /// address is not trusted).
    pub(crate) fn read(&self, addr: u64, dst: &mut [u8], streaming: bool) -> io::Result<()> {
        self.with(addr, dst.len(), &mut |src| {
            par::copy(Pool::shared(), dst, src, streaming)
        })
    }

    /// Hands `f` the `len` staged bytes at `addr` as mapped here; an error
    /// if they would run past the end of the stage (the peer's address is
    /// not trusted).
    pub(crate) fn with(&self, addr: u64, len: usize, f: &mut dyn FnMut(&[u8])) -> io::Result<()> {
        let cap = self.region.len();
        let off = ((addr & !STAGED) % cap as u64) as usize;
        if off + len > cap {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "a staged payload of {len} bytes at {off} runs past the end of the peer's \
                     {cap}-byte stage"
                ),
            ));
        }
        // SAFETY: `off + len <= cap` bytes of a live mapping. The peer may
        // write them meanwhile (it is another process); it then spoils only
        // its own payload, which `f` takes as plain bytes.
        f(unsafe { std::slice::from_raw_parts(self.region.ptr().add(off), len) });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(cap: usize) -> (Stage, PeerStage) {
        let fallback = format!("consort-test-stage-{}", std::process::id());
        let (name, mut mine) = Region::create(&fallback, cap).unwrap();
        let theirs = Region::open_read_only(&name, cap).unwrap();
        mine.unlink(&name);
        (Stage::new(mine).unwrap(), PeerStage::new(theirs).unwrap())
    }

    #[test]
    fn staged_bytes_read_back_and_never_wrap() {
        let cap = MIN_STAGE;
        let (stage, peer) = pair(cap);
        let a = vec![1u8; 20_000];
        let b = vec![2u8; 20_000];
        let at_a = stage.put(&a).unwrap();
        let at_b = stage.put(&b).unwrap();
        assert_eq!(at_a, STAGED);
        assert_eq!(at_b & !STAGED, 20_032, "the next cache line");
        // A third does not fit before the end (40,064 + 30,000 > 65,536),
        // and the beginning is still in use.
        let c = vec![3u8; 30_000];
        assert_eq!(stage.put(&c), None);
        stage.free(at_a + a.len() as u64);
        assert_eq!(stage.put(&c), None, "b still holds the middle");
        stage.free(at_b + b.len() as u64);
        let at_c = stage.put(&c).unwrap();
        assert_eq!(at_c & !STAGED, cap as u64, "started over at the beginning");
        let mut got = vec![0u8; c.len()];
        peer.read(at_c, &mut got, true).unwrap();
        assert_eq!(got, c);
        // More than half the stage is never staged.
        stage.free_all();
        assert_eq!(stage.put(&vec![0u8; cap / 2 + 8]), None);
    }

    #[test]
    fn a_hostile_position_is_an_error_not_a_wild_read() {
        let (_stage, peer) = pair(MIN_STAGE);
        let mut dst = vec![0u8; 4096];
        let e = peer
            .read(STAGED | (MIN_STAGE as u64 - 100), &mut dst, false)
            .unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
        // Any address is taken modulo the stage: never outside it.
        peer.read(u64::MAX, &mut dst[..8], false).unwrap_err();
        peer.read(!4095, &mut dst, false).unwrap();
    }

    #[test]
    fn a_read_only_mapping_refuses_writes() {
        // The peer's mapping is PROT_READ: a write would fault, so it is
        // checked through the kernel instead of by writing.
        let (_stage, peer) = pair(MIN_STAGE);
        let ptr = peer.region.ptr();
        let mut vec = [0u8; 1];
        // SAFETY: mincore only inspects the page; it proves the mapping is
        // live. The protection is read from /proc/self/maps.
        let live = unsafe { libc::mincore(ptr.cast(), 1, vec.as_mut_ptr().cast()) };
        assert_eq!(live, 0);
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let start = format!("{:x}-", ptr as usize);
        let line = maps.lines().find(|l| l.starts_with(&start)).unwrap();
        assert!(
            line.split_whitespace().nth(1).unwrap().starts_with("r--s"),
            "{line}"
        );
    }
}
