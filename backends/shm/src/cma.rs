//! Cross-memory attach: the receiver of a large payload reads it straight
//! from the sender's memory with `process_vm_readv`, one copy in all.
//!
//! The kernel allows it only where the reader may ptrace the sender (same
//! user; with Yama's `ptrace_scope` 1, only if the sender names it, or an
//! ancestor of it; containers may forbid it altogether). Yama keeps one
//! named tracer per process, so a rank cannot name each of several
//! same-host peers: [`Probe::offer`] names its parent, the launcher
//! (`consort run`, torchrun, mpirun) whose children the peers are, and
//! never "any process" (Open MPI's choice). So each side
//! tries once, at set-up, to read a known word of the other's, and falls
//! back to the queues (two copies) toward a peer it cannot read, with one
//! line in the log.

use std::{
    io,
    sync::{
        OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

/// A word of this process that peers read to test CMA, and what it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Probe {
    addr: u64,
    value: u64,
}

/// The word peers test reading.
static WORD: AtomicU64 = AtomicU64::new(0);

impl Probe {
    /// Lets the launcher's children read this process (Yama) and returns
    /// the probe to offer; `None` if no random value could be had. Called
    /// only when single-copy reads are on.
    pub(crate) fn offer() -> Option<Probe> {
        static VALUE: OnceLock<Option<u64>> = OnceLock::new();
        let value = (*VALUE.get_or_init(|| {
            let mut n = [0u8; 8];
            getrandom::fill(&mut n).ok()?;
            let v = u64::from_le_bytes(n) | 1;
            WORD.store(v, Ordering::SeqCst);
            // Under Yama's ptrace_scope 1 a sibling may read this process
            // only if it, or an ancestor of it, is named: the launcher, the
            // peers' common parent. Not init, nor a parent in another PID
            // namespace (0): that would be every process. Fails harmlessly
            // where Yama is absent.
            // SAFETY: getppid has no preconditions.
            let parent = unsafe { libc::getppid() };
            if parent > 1 {
                // SAFETY: prctl with integer arguments only.
                unsafe { libc::prctl(libc::PR_SET_PTRACER, parent as libc::c_ulong, 0, 0, 0) };
            }
            Some(v)
        }))?;
        Some(Probe {
            addr: WORD.as_ptr() as u64,
            value,
        })
    }

    pub(crate) fn encode(&self) -> String {
        format!("{:x}:{:x}", self.addr, self.value)
    }

    pub(crate) fn decode(s: &str) -> Option<Probe> {
        let (a, v) = s.split_once(':')?;
        Some(Probe {
            addr: u64::from_str_radix(a, 16).ok()?,
            value: u64::from_str_radix(v, 16).ok()?,
        })
    }
}

/// Whether this process can read peer `rank` (process `pid`) through its
/// offered probe. Logs one line, once per process, when it cannot.
pub(crate) fn works(rank: usize, pid: u32, probe: Probe) -> bool {
    let mut got = [0u8; 8];
    match read(pid, probe.addr, &mut got) {
        Ok(()) if u64::from_le_bytes(got) == probe.value => true,
        outcome => {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                let why = match outcome {
                    Err(e) => e.to_string(),
                    Ok(()) => "it read a different value".into(),
                };
                tracing::warn!(
                    "shared memory without single-copy reads from rank {rank} \
                     (process_vm_readv: {why}; ptrace policy or a container forbids it): \
                     large messages take two copies through the queues"
                );
            }
            false
        }
    }
}

/// Reads `dst.len()` bytes at `addr` of process `pid`.
pub(crate) fn read(pid: u32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr().cast(),
            iov_len: dst.len() - done,
        };
        let at = addr.checked_add(done as u64).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "a payload address past the end")
        })?;
        let remote = libc::iovec {
            iov_base: at as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: `local` covers the rest of `dst`, which we own mutably;
        // the kernel checks the remote range against the peer's mappings.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer's memory ended mid-payload",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_reads_its_own_probe_and_refuses_bad_ones() {
        let p = Probe::offer().unwrap();
        assert_eq!(Probe::decode(&p.encode()), Some(p));
        assert!(works(0, std::process::id(), p));
        let wrong = Probe {
            value: p.value ^ 2,
            ..p
        };
        assert!(!works(0, std::process::id(), wrong));
        let mut b = [0u8; 8];
        assert!(read(std::process::id(), 8, &mut b).is_err(), "unmapped");
        assert!(Probe::decode("zz").is_none());
    }
}
