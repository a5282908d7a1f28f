//! The heartbeat a launched worker shows its agent: a 64-byte file
//! (`CONSORT_HEARTBEAT_FILE`), memory-mapped, holding how many calls this
//! rank has finished and which call it made last. The mesh driver updates
//! it with plain stores on every call (so do NCCL and the emulated device),
//! so it costs no system call; the
//! agent reads it with `read(2)`, which works even when the worker is
//! stopped (SIGSTOP) or wedged, and names the call a hung rank is in.
//!
//! Layout, eight little-endian u64: magic, calls finished, last call's
//! seq, its op (index in `OpKind::ALL`), its group id, when it was made
//! (µs since the Unix epoch), when the last call ended, and the calls in
//! flight (`DETACHED` once the groups are gone: the agent stops watching).
//!
//! One heartbeat serves the whole process ([`Heartbeat::shared`]): every
//! group of every backend made in it counts.

use std::{
    os::fd::AsRawFd,
    path::Path,
    sync::atomic::{AtomicU64, Ordering},
};

use crate::{Fingerprint, GroupId, OpKind};

const MAGIC: u64 = u64::from_le_bytes(*b"consort1");
/// Slot 7 once the process has no group left.
const DETACHED: u64 = u64::MAX;
const SLOTS: usize = 8;
const BYTES: usize = SLOTS * 8;

/// The writer's side: the mapped file.
#[derive(Debug)]
pub struct Heartbeat {
    slots: *const AtomicU64,
}

// SAFETY: the mapping is shared memory accessed only through atomics, and
// it lives as long as the `Heartbeat` (unmapped in `Drop`).
unsafe impl Send for Heartbeat {}
// SAFETY: as above.
unsafe impl Sync for Heartbeat {}

impl Heartbeat {
    /// The heartbeat of rank `rank` at `path` if one is given and maps
    /// ([`Heartbeat::shared`]); a failure is logged, not returned: a rank
    /// without one only loses the watchdog's view of its progress.
    pub fn for_rank(path: Option<&Path>, rank: usize) -> Option<std::sync::Arc<Self>> {
        let p = path?;
        Self::shared(p)
            .map_err(|e| {
                tracing::warn!(
                    "rank {rank}: no heartbeat for the launcher's watchdog: cannot map {}: {e}",
                    p.display()
                )
            })
            .ok()
    }

    /// The process's heartbeat at `path`, made on first use (a second
    /// group in the same process shares it instead of truncating a file
    /// that is mapped).
    pub fn shared(path: &Path) -> std::io::Result<std::sync::Arc<Self>> {
        static ONE: std::sync::Mutex<Option<(std::path::PathBuf, std::sync::Weak<Heartbeat>)>> =
            std::sync::Mutex::new(None);
        let mut one = crate::lock(&ONE);
        if let Some((p, w)) = one.as_ref()
            && p == path
            && let Some(b) = w.upgrade()
        {
            return Ok(b);
        }
        let b = std::sync::Arc::new(Self::create(path)?);
        *one = Some((path.to_path_buf(), std::sync::Arc::downgrade(&b)));
        Ok(b)
    }

    /// Creates (or truncates) `path` and maps it.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // Never through a planted symbolic link.
        let file = crate::files::open_or_create(path)?;
        file.set_len(BYTES as u64)?;
        // SAFETY: a shared read-write mapping of a file we just sized to
        // BYTES; the fd may be closed afterwards (the mapping keeps it).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let beat = Heartbeat {
            slots: p.cast::<AtomicU64>(),
        };
        beat.slot(0).store(MAGIC, Ordering::Relaxed);
        Ok(beat)
    }

    fn slot(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < SLOTS);
        // SAFETY: `slots` points at SLOTS page-aligned, mapped u64s for as
        // long as `self` lives.
        unsafe { &*self.slots.add(i) }
    }

    /// A call was made.
    pub fn made(&self, fp: &Fingerprint, now_us: u64) {
        let op = OpKind::ALL.iter().position(|o| *o == fp.op).unwrap_or(0);
        self.slot(2).store(fp.seq, Ordering::Relaxed);
        self.slot(3).store(op as u64, Ordering::Relaxed);
        self.slot(4).store(u64::from(fp.group.0), Ordering::Relaxed);
        self.slot(5).store(now_us, Ordering::Relaxed);
        self.slot(7).fetch_add(1, Ordering::Release);
    }

    /// A call ended.
    pub fn ended(&self, now_us: u64) {
        self.slot(6).store(now_us, Ordering::Relaxed);
        let _ = self
            .slot(7)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        self.slot(1).fetch_add(1, Ordering::Release);
    }

    /// Progress outside any call (a long compute phase that should not
    /// count as a hang).
    pub fn beat(&self) {
        self.slot(1).fetch_add(1, Ordering::Release);
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        // The groups are gone (the program goes on without collectives):
        // nothing to watch any more.
        self.slot(7).store(DETACHED, Ordering::Release);
        // SAFETY: unmaps exactly the mapping `create` made.
        unsafe { libc::munmap(self.slots.cast_mut().cast(), BYTES) };
    }
}

/// Microseconds since the Unix epoch: the heartbeat's clock, which the
/// agent compares with its own.
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// What the agent reads from a heartbeat file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// Calls finished (plus explicit beats): progress is this changing.
    pub progress: u64,
    /// The last call made: group, seq and op.
    pub last: Option<(GroupId, u64, OpKind)>,
    /// When it was made, µs since the Unix epoch.
    pub made_us: u64,
    /// Whether a call is in flight.
    pub in_call: bool,
    /// The process has no group left (it is not watched).
    pub detached: bool,
}

impl Beat {
    /// "all_reduce seq 183 (world), made 5.2 s ago and not finished".
    pub fn describe(&self, now_us: u64) -> String {
        match self.last {
            None => "it has made no collective yet".into(),
            Some((g, seq, op)) => format!(
                "its last call is {op} seq {seq} ({g}), made {:.1} s ago{}",
                now_us.saturating_sub(self.made_us) as f64 / 1e6,
                if self.in_call {
                    " and not finished"
                } else {
                    ", finished (stuck outside any call since)"
                }
            ),
        }
    }
}

/// Reads `path` (`None` if it is missing or not a heartbeat file yet).
pub fn read(path: &Path) -> Option<Beat> {
    let bytes = crate::files::read_regular(path, 1 << 20).ok()?;
    let slot = |i: usize| {
        let b: [u8; 8] = bytes.get(i * 8..i * 8 + 8)?.try_into().ok()?;
        Some(u64::from_le_bytes(b))
    };
    if slot(0)? != MAGIC {
        return None;
    }
    let made_us = slot(5)?;
    let last = (made_us != 0).then(|| {
        let op = OpKind::ALL
            .get(usize::try_from(slot(3).unwrap_or(0)).unwrap_or(0))
            .copied()
            .unwrap_or(OpKind::AllReduce);
        (
            GroupId(slot(4).unwrap_or(0) as u32),
            slot(2).unwrap_or(0),
            op,
        )
    });
    let flight = slot(7)?;
    Some(Beat {
        progress: slot(1)?,
        last,
        made_us,
        in_call: flight > 0 && flight != DETACHED,
        detached: flight == DETACHED,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn the_reader_sees_every_store_of_the_writer() {
        let path = std::env::temp_dir().join(format!("consort-beat-{}", std::process::id()));
        let beat = Heartbeat::create(&path).unwrap();
        assert_eq!(read(&path).unwrap().last, None);
        let fp = Fingerprint {
            group: GroupId::WORLD,
            seq: 183,
            op: OpKind::AllReduce,
            dtype: DType::F32,
            count: 4,
            root: 0,
            reduce_op: None,
        };
        beat.made(&fp, 1_000_000);
        let b = read(&path).unwrap();
        assert_eq!(b.last, Some((GroupId::WORLD, 183, OpKind::AllReduce)));
        assert!(b.in_call && b.progress == 0);
        assert_eq!(
            b.describe(6_200_000),
            "its last call is all_reduce seq 183 (world), made 5.2 s ago and not finished"
        );
        beat.ended(2_000_000);
        let b = read(&path).unwrap();
        assert!(!b.in_call && b.progress == 1);
        drop(beat);
        let _ = std::fs::remove_file(path);
    }
}
