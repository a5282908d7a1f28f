//! One launch on the communicator: the NCCL calls an op makes (a
//! collective, grouped sends and receives, a pre-multiplied sum's reduce
//! op), each settled before the next.
//!
//! consort's communicators are nonblocking (`ncclConfig_t::blocking = 0`,
//! so that init, split and finalize can be bounded and aborted): an NCCL
//! call may return `ncclInProgress` and finish enqueuing on a thread of
//! NCCL's own, and the next call on the communicator, or any stream work
//! that must follow the kernel, may only come once `ncclCommGetAsyncError`
//! says it has. [`On::settle`] waits for that, until the call's deadline or
//! until an abort asks the launch to step aside.

use std::{
    ffi::{c_int, c_void},
    time::{Duration, Instant},
};

use consort_comm::DType;

use crate::{
    map::nccl_dtype,
    sys::{self, Comm, Nccl, Stream, result},
    work::comm_state,
};

/// The communicator and stream of one launch, under the launch lock.
pub(crate) struct On<'a> {
    pub(crate) nccl: &'a Nccl,
    pub(crate) comm: Comm,
    pub(crate) stream: Stream,
    pub(crate) deadline: Instant,
    /// Whether an abort waits for the launch lock.
    pub(crate) stop: &'a dyn Fn() -> bool,
}

impl On<'_> {
    /// The final result of an NCCL call that returned `r`; see [`settle`].
    pub(crate) fn settle(&self, r: c_int) -> c_int {
        settle(self.nccl, self.comm, r, self.deadline, self.stop)
    }

    /// `f` between `ncclGroupStart` and `ncclGroupEnd`, settled.
    pub(crate) fn grouped(&self, f: impl FnOnce() -> c_int) -> c_int {
        // SAFETY: group calls only batch the enqueues inside `f`.
        let r = unsafe { (self.nccl.group_start)() };
        if r != result::SUCCESS {
            return r;
        }
        let inner = f();
        // SAFETY: paired with the start above.
        let end = self.settle(unsafe { (self.nccl.group_end)() });
        if inner != result::SUCCESS && inner != result::IN_PROGRESS {
            inner
        } else {
            end
        }
    }

    /// One `ncclSend` (`send`) or `ncclRecv` of `n` elements at `ptr`,
    /// inside a group (settled by its end).
    pub(crate) fn p2p(&self, send: bool, ptr: u64, n: usize, dt: c_int, peer: usize) -> c_int {
        let (comm, stream) = (self.comm, self.stream);
        // SAFETY: `ptr` holds `n` elements of `dt` on this rank's GPU (the
        // caller's buffer or the staging buffer), alive until the work ends.
        unsafe {
            if send {
                (self.nccl.send)(ptr as *const c_void, n, dt, peer as c_int, comm, stream)
            } else {
                (self.nccl.recv)(ptr as *mut c_void, n, dt, peer as c_int, comm, stream)
            }
        }
    }

    /// Gather (`gather`) or scatter as grouped point-to-point calls: `mine`
    /// is this rank's part, `whole` the root's buffer of `world` parts.
    pub(crate) fn rooted(
        &self,
        (mine, whole): (u64, u64),
        (n, dtype): (usize, DType),
        (root, world, is_root): (usize, usize, bool),
        gather: bool,
    ) -> c_int {
        let dt = nccl_dtype(dtype);
        let size = dtype.size_bytes() as u64;
        self.grouped(|| {
            let mut r = self.p2p(gather, mine, n, dt, root);
            if is_root {
                for p in 0..world {
                    let at = whole + p as u64 * n as u64 * size;
                    let x = self.p2p(!gather, at, n, dt, p);
                    if r == result::SUCCESS {
                        r = x;
                    }
                }
            }
            r
        })
    }

    /// `f(op)`, settled, with `op` made for this call when it is a
    /// pre-multiplied sum (made just before the enqueue and destroyed just
    /// after it has settled, which NCCL allows).
    pub(crate) fn with_op(&self, op: RedOp, dt: c_int, f: impl FnOnce(c_int) -> c_int) -> c_int {
        let mut scalar = match op {
            RedOp::Builtin(o) => return self.settle(f(o)),
            RedOp::PremulSum(s) => s,
        };
        let nccl = self.nccl;
        let (Some(create), Some(destroy)) = (nccl.red_op_create_pre_mul_sum, nccl.red_op_destroy)
        else {
            return result::INVALID_USAGE;
        };
        let mut made: c_int = 0;
        // SAFETY: `scalar` holds one element of `dt`, read during this call
        // (host-immediate); `comm` is live under the launch lock.
        let r = unsafe {
            create(
                &mut made,
                scalar.as_mut_ptr().cast(),
                dt,
                sys::SCALAR_HOST_IMMEDIATE,
                self.comm,
            )
        };
        if r != result::SUCCESS {
            return r;
        }
        let out = self.settle(f(made));
        // SAFETY: made above on `comm`; the call that used it has settled.
        let d = unsafe { destroy(made, self.comm) };
        if out != result::SUCCESS { out } else { d }
    }
}

/// The reduce op of one call: built in, or a pre-multiplied sum with its
/// scalar (in the call's dtype).
#[derive(Clone, Copy)]
pub(crate) enum RedOp {
    Builtin(c_int),
    PremulSum([u8; 8]),
}

/// The final result of an NCCL call on `comm` that returned `r`: an error
/// as it is; otherwise the communicator's state, polled with
/// `ncclCommGetAsyncError` until it is no longer in progress. A success is
/// checked too: some calls (`ncclCommSplit` on NCCL 2.28) return
/// `ncclSuccess` while their work still runs on NCCL's thread. The wait
/// yields the thread for its first 2 ms, then sleeps in short steps. Past
/// `deadline` it is `ncclTimeout`; when `stop()` says an abort is waiting,
/// `ncclInProgress` (the caller fails the call and the abort follows).
pub(crate) fn settle(
    nccl: &Nccl,
    comm: Comm,
    r: c_int,
    deadline: Instant,
    stop: impl Fn() -> bool,
) -> c_int {
    if r != result::SUCCESS && r != result::IN_PROGRESS {
        return r;
    }
    let start = Instant::now();
    loop {
        // `comm` is live: the caller holds the launch lock, which an abort
        // waits for.
        let r = comm_state(nccl, comm);
        if r != result::IN_PROGRESS {
            return r;
        }
        if stop() {
            return result::IN_PROGRESS;
        }
        let now = Instant::now();
        if now >= deadline {
            return result::TIMEOUT;
        }
        if now.duration_since(start) < SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// How long [`settle`] yields before it sleeps: NCCL's thread usually
/// enqueues a collective well within it.
const SPIN: Duration = Duration::from_millis(2);
