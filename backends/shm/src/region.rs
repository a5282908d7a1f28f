//! Shared regions between processes on one host: sealed memfds (their size
//! can no longer change, so no process can truncate one under a mapping
//! and turn a peer's access into SIGBUS), which the peer opens through
//! `/proc/<pid>/fd/<fd>` and checks for the seals; the creator closes its
//! descriptor once the peer has mapped it. Where memfds are unavailable, a
//! file under `/dev/shm` (mode 0600, exclusive create, unlinked as soon as
//! the peer has mapped it) serves instead, with a short window before the
//! unlink. Also [`host_id`]: which peers can share memory at all.

use std::{fs::OpenOptions, io, os::unix::fs::OpenOptionsExt, path::PathBuf};

/// A mapping of a shared region.
pub(crate) struct Region {
    ptr: *mut u8,
    len: usize,
    /// The creator's memfd, open until the peer has mapped it.
    memfd: Option<std::fs::File>,
}

// SAFETY: the mapping is process-wide memory; its users (`crate::queue`)
// order their accesses with atomics.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made in `map`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Maps `len` bytes of `file`, writable or read-only.
fn map(file: &std::fs::File, len: usize, writable: bool) -> io::Result<Region> {
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh shared mapping of a file we hold open; checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            if writable {
                libc::PROT_READ | libc::PROT_WRITE
            } else {
                libc::PROT_READ
            },
            // Every page now: a queue first used page by page would take a
            // fault (and a zeroing) per 4 KiB for its first lap.
            libc::MAP_SHARED | libc::MAP_POPULATE,
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
    /// Creates a zeroed region of `len` bytes and returns it with the name
    /// the peer opens it by: a sealed memfd, or, where that fails,
    /// `/dev/shm/<fallback>` (which must not exist).
    pub(crate) fn create(fallback: &str, len: usize) -> io::Result<(String, Region)> {
        match sealed_memfd(len) {
            Ok(f) => {
                use std::os::fd::AsRawFd;
                let mut r = map(&f, len, true)?;
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
        Ok((fallback.to_string(), map(&f, len, true)?))
    }

    /// Maps the peer's region `name` of `len` bytes. A memfd must carry
    /// the seals that fix its size.
    pub(crate) fn open(name: &str, len: usize) -> io::Result<Region> {
        Self::open_as(name, len, true)
    }

    /// [`Self::open`], mapped read-only: this process can then never write
    /// the peer's region (a peer's stage, which only its owner writes).
    pub(crate) fn open_read_only(name: &str, len: usize) -> io::Result<Region> {
        Self::open_as(name, len, false)
    }

    fn open_as(name: &str, len: usize, writable: bool) -> io::Result<Region> {
        let memfd = memfd_path(name);
        let at = memfd.clone().unwrap_or_else(|| path(name));
        let f = OpenOptions::new().read(true).write(writable).open(at)?;
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
        if f.metadata()?.len() < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "shared region too small",
            ));
        }
        map(&f, len, writable)
    }

    /// The mapping's first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The mapping's length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Once the peer has mapped (or given up on) region `name`: closes the
    /// memfd, or removes the `/dev/shm` name. The mappings stay valid.
    pub(crate) fn unlink(&mut self, name: &str) {
        if self.memfd.take().is_none() && memfd_path(name).is_none() {
            let _ = std::fs::remove_file(path(name));
        }
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
    // The bells are abstract sockets, which live per network namespace.
    let net = std::fs::metadata("/proc/self/ns/net")
        .map(|m| m.ino().to_string())
        .unwrap_or_default();
    format!("{}/{}/{shm}/{pids}/{net}", boot.trim(), host.trim())
}

/// Whether a region name from a peer is one this crate makes.
pub(crate) fn valid_name(name: &str) -> bool {
    memfd_path(name).is_some() || (name.starts_with("consort-") && !name.contains('/'))
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
        // SAFETY: in-bounds writes and reads of one mapping seen through two.
        unsafe {
            a.ptr().add(100).write(42);
            assert_eq!(b.ptr().add(100).read(), 42);
        }
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
    fn unsealed_short_or_malformed_regions_are_refused() {
        // A plain /dev/shm file is opened by name (the fallback)...
        let fallback = format!("consort-test-plain-{}", std::process::id());
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path(&fallback))
            .unwrap();
        f.set_len(4096).unwrap();
        assert!(Region::open(&fallback, 4096).is_ok());
        assert!(Region::open(&fallback, 8192).is_err(), "too small");
        let _ = std::fs::remove_file(path(&fallback));
        // ...but a memfd name must point at a sealed memfd.
        use std::os::fd::AsRawFd;
        let unsealed = memfd_name(f.as_raw_fd());
        let e = Region::open(&unsealed, 4096).err().expect("unsealed");
        assert!(e.to_string().contains("not sealed"), "{e}");
        assert!(memfd_path("consort-memfd-x-1").is_none());
        assert!(memfd_path("consort-memfd-1").is_none());
        assert!(!valid_name("../etc/passwd") && !valid_name("other"));
    }
}
