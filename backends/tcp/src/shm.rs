//! Shared-memory slots for peers on the same host: the fast path that lets
//! a frame's payload skip the kernel's two TCP copies.
//!
//! For each ordered pair of same-host ranks, the sender creates a region
//! under `/dev/shm` (mode 0600, exclusive create, unlinked as soon as the
//! peer has mapped it) holding [`SLOTS`] slots. To send, it copies the
//! payload into a free slot and sends only the frame header over TCP, with
//! [`consort_comm::frame::FLAG_SHM`] and the slot number. The receiver
//! applies the payload straight from the slot (reducing or copying into
//! place) and hands the slot back with a credit frame. A slot is owned by
//! exactly one side at a time, and ownership changes hands through the TCP
//! stream (a system call on each side), which orders the memory accesses.

use std::{fs::OpenOptions, io, os::unix::fs::OpenOptionsExt, path::PathBuf, sync::Mutex};

use tokio::sync::Notify;

/// Slots per direction of a pair.
pub(crate) const SLOTS: usize = 16;

/// A mapping of a shared region of [`SLOTS`] slots. The slot size is the
/// creator's, told to the peer with the region's name in the hello, so
/// that both sides index the same offsets whatever their own segment size.
pub(crate) struct Region {
    ptr: *mut u8,
    len: usize,
    slot_bytes: usize,
}

// SAFETY: the mapping is process-wide memory; access follows the slot
// ownership protocol above.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made in `map`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn map(file: &std::fs::File, slot_bytes: usize) -> io::Result<Region> {
    let len = SLOTS * slot_bytes;
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh shared mapping of a file we hold open; checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(Region {
        ptr: ptr.cast(),
        len,
        slot_bytes,
    })
}

/// Where regions live.
fn path(name: &str) -> PathBuf {
    PathBuf::from("/dev/shm").join(name)
}

impl Region {
    /// Creates region `name` of [`SLOTS`] slots of `slot_bytes` (fails if
    /// it exists).
    pub(crate) fn create(name: &str, slot_bytes: usize) -> io::Result<Region> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path(name))?;
        f.set_len((SLOTS * slot_bytes) as u64)?;
        map(&f, slot_bytes)
    }

    /// Maps the existing region `name` of [`SLOTS`] slots of `slot_bytes`.
    pub(crate) fn open(name: &str, slot_bytes: usize) -> io::Result<Region> {
        let f = OpenOptions::new().read(true).write(true).open(path(name))?;
        if f.metadata()?.len() < (SLOTS * slot_bytes) as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "shared region too small",
            ));
        }
        map(&f, slot_bytes)
    }

    /// Bytes per slot.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Removes the name (the mappings stay valid).
    pub(crate) fn unlink(name: &str) {
        let _ = std::fs::remove_file(path(name));
    }

    /// Slot `i` as a raw pointer (`None` out of range).
    pub(crate) fn slot(&self, i: usize) -> Option<*mut u8> {
        (i < SLOTS && (i + 1) * self.slot_bytes <= self.len)
            .then(|| self.ptr.wrapping_add(i * self.slot_bytes))
    }
}

/// The sending side of a pair: the region and which slots are free.
pub(crate) struct Tx {
    pub(crate) region: Region,
    pub(crate) slot_bytes: usize,
    free: Mutex<Vec<usize>>,
    pub(crate) credit: Notify,
}

impl Tx {
    pub(crate) fn new(region: Region) -> Self {
        Tx {
            slot_bytes: region.slot_bytes,
            region,
            free: Mutex::new((0..SLOTS).rev().collect()),
            credit: Notify::new(),
        }
    }

    /// Takes a free slot, if any.
    pub(crate) fn take(&self) -> Option<usize> {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    /// Returns slot `i` (a credit from the receiver). A credit for a slot
    /// that is not lent (out of range, or already free) is the peer
    /// breaking the protocol: an error, and the slot stays as it was.
    pub(crate) fn give_back(&self, i: usize) -> Result<(), String> {
        let mut f = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if i >= SLOTS || f.contains(&i) {
            return Err(format!(
                "credit for shared-memory slot {i}, which was not lent to it (slots 0..{SLOTS})"
            ));
        }
        f.push(i);
        drop(f);
        self.credit.notify_one();
        Ok(())
    }
}

/// This host's identity: peers with the same one can share memory (boot id
/// and hostname; a container with its own /dev/shm fails the open and falls
/// back to TCP).
pub(crate) fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}/{}", boot.trim(), host.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_see_the_same_bytes() {
        let name = format!("consort-test-{}", std::process::id());
        let a = Region::create(&name, 4096).unwrap();
        let b = Region::open(&name, 4096).unwrap();
        Region::unlink(&name);
        let pa = a.slot(3).unwrap();
        // SAFETY: in-bounds writes and reads of one mapping seen through two.
        unsafe {
            pa.write(42);
            assert_eq!(b.slot(3).unwrap().read(), 42);
        }
        assert!(a.slot(SLOTS).is_none());
        assert!(Region::create(&name, 10).is_ok(), "the name was unlinked");
        Region::unlink(&name);
    }

    #[test]
    fn only_lent_slots_can_be_credited() {
        let name = format!("consort-test-credit-{}", std::process::id());
        let tx = Tx::new(Region::create(&name, 4096).unwrap());
        Region::unlink(&name);
        let e = tx.give_back(3).unwrap_err();
        assert!(e.contains("not lent"), "{e}");
        assert!(tx.give_back(SLOTS).is_err());
        let s = tx.take().unwrap();
        tx.give_back(s).unwrap();
        assert!(tx.give_back(s).is_err(), "a second credit for one loan");
    }
}
