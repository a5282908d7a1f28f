//! Shared-memory slots for peers on the same host: the fast path that lets
//! a frame's payload skip the kernel's two TCP copies.
//!
//! For each ordered pair of same-host ranks, the sender creates a region
//! holding [`SLOTS`] slots: a sealed memfd (its size can no longer change,
//! so no process can truncate it under a mapping and turn a peer's access
//! into SIGBUS), which the peer opens through `/proc/<pid>/fd/<fd>` and
//! checks for the seals; the creator closes it once the peer has mapped
//! it. Where memfds are unavailable, a file under `/dev/shm` (mode 0600,
//! exclusive create, unlinked as soon as the peer has mapped it) serves
//! instead, with a short window before the unlink. To send, it copies the
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
    /// The creator's memfd, open until the peer has mapped it.
    memfd: Option<std::fs::File>,
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
        memfd: None,
    })
}

/// Where `/dev/shm` regions live.
fn path(name: &str) -> PathBuf {
    PathBuf::from("/dev/shm").join(name)
}

/// The seals a memfd region must carry: its size is fixed for good.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// `consort-memfd-<pid>-<fd>`: a memfd region's name in the hello.
fn memfd_name(fd: i32) -> String {
    format!("consort-memfd-{}-{fd}", std::process::id())
}

/// The `/proc` path of a memfd region's name, if it is one.
fn memfd_path(name: &str) -> Option<PathBuf> {
    let rest = name.strip_prefix("consort-memfd-")?;
    let (pid, fd) = rest.split_once('-')?;
    let (pid, fd): (u32, u32) = (pid.parse().ok()?, fd.parse().ok()?);
    Some(PathBuf::from(format!("/proc/{pid}/fd/{fd}")))
}

/// A sealed memfd of `len` bytes.
fn sealed_memfd(len: usize) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: a NUL-terminated name; the fd returned is ours alone.
    let fd = unsafe { libc::memfd_create(c"consort-shm".as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(len as u64)?;
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on our own descriptor.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(f)
}

impl Region {
    /// Creates a region of [`SLOTS`] slots of `slot_bytes` and returns it
    /// with the name the peer opens it by: a sealed memfd, or, where that
    /// fails, `/dev/shm/<fallback>` (which must not exist).
    pub(crate) fn create(fallback: &str, slot_bytes: usize) -> io::Result<(String, Region)> {
        let len = SLOTS * slot_bytes;
        match sealed_memfd(len) {
            Ok(f) => {
                use std::os::fd::AsRawFd;
                let mut r = map(&f, slot_bytes)?;
                let name = memfd_name(f.as_raw_fd());
                r.memfd = Some(f);
                return Ok((name, r));
            }
            Err(e) => tracing::debug!("no sealed memfd ({e}); using /dev/shm"),
        }
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path(fallback))?;
        f.set_len(len as u64)?;
        Ok((fallback.to_string(), map(&f, slot_bytes)?))
    }

    /// Maps the peer's region `name` of [`SLOTS`] slots of `slot_bytes`. A
    /// memfd must carry the seals that fix its size.
    pub(crate) fn open(name: &str, slot_bytes: usize) -> io::Result<Region> {
        let memfd = memfd_path(name);
        let at = memfd.clone().unwrap_or_else(|| path(name));
        let f = OpenOptions::new().read(true).write(true).open(at)?;
        if memfd.is_some() {
            use std::os::fd::AsRawFd;
            // SAFETY: fcntl on a descriptor we own.
            let seals = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) };
            if seals < 0 || seals & SEALS != SEALS {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the peer's shared region is not sealed against resizing",
                ));
            }
        }
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

    /// Once the peer has mapped (or given up on) region `name`: closes the
    /// memfd, or removes the `/dev/shm` name. The mappings stay valid.
    pub(crate) fn unlink(&mut self, name: &str) {
        if self.memfd.take().is_none() && memfd_path(name).is_none() {
            let _ = std::fs::remove_file(path(name));
        }
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

/// This host's identity: peers with the same one can share memory. The
/// boot id and hostname, which `/dev/shm` this process sees and its PID
/// namespace: ranks in separate containers (or in the emulated hosts of
/// the cross-host bench, each with its own `/dev/shm`) do not share
/// memory, and a memfd's `/proc/<pid>/fd/<fd>` name is never read in
/// another PID namespace, where it would name another file.
pub(crate) fn host_id() -> String {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let shm = std::fs::metadata("/dev/shm")
        .map(|m| format!("{}:{}", m.dev(), m.ino()))
        .unwrap_or_default();
    // A memfd is opened by `/proc/<pid>/fd/<fd>`, which names the right
    // file only inside the creator's PID namespace.
    let pids = std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino().to_string())
        .unwrap_or_default();
    format!("{}/{}/{shm}/{pids}", boot.trim(), host.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_see_the_same_bytes() {
        let fallback = format!("consort-test-{}", std::process::id());
        let (name, mut a) = Region::create(&fallback, 4096).unwrap();
        assert!(
            name.starts_with("consort-memfd-"),
            "{name}: memfds work here"
        );
        let b = Region::open(&name, 4096).unwrap();
        a.unlink(&name);
        let pa = a.slot(3).unwrap();
        // SAFETY: in-bounds writes and reads of one mapping seen through two.
        unsafe {
            pa.write(42);
            assert_eq!(b.slot(3).unwrap().read(), 42);
        }
        assert!(a.slot(SLOTS).is_none());
        assert!(Region::open(&name, 4096).is_err(), "the memfd was closed");
    }

    #[test]
    fn a_region_cannot_be_truncated_under_its_mappings() {
        let (name, _a) = Region::create("unused", 4096).unwrap();
        let path = memfd_path(&name).unwrap();
        let f = OpenOptions::new().write(true).open(path).unwrap();
        assert!(f.set_len(10).is_err(), "a sealed memfd refuses to shrink");
        assert!(f.set_len(1 << 30).is_err(), "and to grow");
    }

    #[test]
    fn unsealed_or_malformed_regions_are_refused() {
        // A plain /dev/shm file is opened by name (the fallback)...
        let fallback = format!("consort-test-plain-{}", std::process::id());
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path(&fallback))
            .unwrap();
        f.set_len((SLOTS * 4096) as u64).unwrap();
        assert!(Region::open(&fallback, 4096).is_ok());
        let _ = std::fs::remove_file(path(&fallback));
        // ...but a memfd name must point at a sealed memfd.
        use std::os::fd::AsRawFd;
        let unsealed = memfd_name(f.as_raw_fd());
        let e = Region::open(&unsealed, 4096).err().expect("unsealed");
        assert!(e.to_string().contains("not sealed"), "{e}");
        assert!(memfd_path("consort-memfd-x-1").is_none());
        assert!(memfd_path("consort-memfd-1").is_none());
    }

    #[test]
    fn only_lent_slots_can_be_credited() {
        let fallback = format!("consort-test-credit-{}", std::process::id());
        let (name, mut region) = Region::create(&fallback, 4096).unwrap();
        region.unlink(&name);
        let tx = Tx::new(region);
        let e = tx.give_back(3).unwrap_err();
        assert!(e.contains("not lent"), "{e}");
        assert!(tx.give_back(SLOTS).is_err());
        let s = tx.take().unwrap();
        tx.give_back(s).unwrap();
        assert!(tx.give_back(s).is_err(), "a second credit for one loan");
    }
}
