//! Threads within a rank: a large copy or reduction split over helper
//! threads, where the host has cores no rank uses.
//!
//! A same-host collective is memory-bound, and one core copies at a
//! fraction of what the memory can move (about 21 GB/s of 45 on the build
//! machine; DeepSpeed's and vLLM's CPU all_reduce kernels use several
//! threads per rank for that reason). A rank that has cores to spare (the
//! mesh gives it `cores / ranks on the host`, at most [`MAX_THREADS`];
//! `CONSORT_SHM_THREADS` sets it) splits each copy or reduction of at
//! least `2 * PART_MIN` bytes into parts, runs one itself and hands the
//! others to helper threads, and returns once every part is done. With one
//! thread (the default where ranks have a core each, or share them)
//! nothing changes: the caller does it all, and no thread is started.
//!
//! One [`Pool`] per process ([`Pool::shared`]): its helpers spin a short
//! while after each job (the next piece of a collective follows within
//! microseconds) and then sleep on a condition variable. One job runs at a
//! time; a caller that finds the pool busy (another rank of the same
//! process, a test) does its work alone. A part that panics is re-raised
//! in the caller once every part has finished, so no helper ever touches a
//! caller's memory after the call returned.

use std::{
    any::Any,
    panic::{AssertUnwindSafe, catch_unwind, resume_unwind},
    sync::{
        Arc, Condvar, Mutex, OnceLock, TryLockError,
        atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

use crate::{DType, ReduceOp, Result, reduce::copy};

/// The smallest part worth a helper: about 3 µs of copying, against a
/// hand-over of well under 1 µs to a helper that is spinning.
pub const PART_MIN: usize = 64 << 10;

/// The most threads a rank uses (itself included), whatever the host has.
pub const MAX_THREADS: usize = 8;

/// How long an idle helper looks for the next job before it sleeps.
const HELPER_SPIN: Duration = Duration::from_micros(100);

/// A job: `parts` calls of `f`, taken by index by the caller and the
/// helpers. It lives on the caller's stack; see [`Pool::run`] for why no
/// helper reaches it after the caller returns.
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    parts: usize,
    next: AtomicUsize,
    left: AtomicUsize,
    /// The first part's panic, re-raised in the caller once every part is
    /// done.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job {
    /// Takes and runs parts until none is left. Never unwinds: a part's
    /// panic is kept (the first) or forgotten (the rest), never dropped
    /// here, since dropping a payload may itself panic.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.parts {
                return;
            }
            // SAFETY: `f` outlives the job's publication (see `Pool::run`).
            let f = unsafe { &*self.f };
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                if first.is_none() {
                    *first = Some(payload);
                } else {
                    std::mem::forget(payload);
                }
            }
            self.left.fetch_sub(1, SeqCst);
        }
    }
}

/// Takes the job back from the helpers when [`Pool::run`] leaves, however
/// it leaves: waits for the parts being run, unpublishes the job, and
/// waits for every helper that may still hold it.
struct Retire<'a> {
    shared: &'a Shared,
    job: &'a Job,
}

impl Drop for Retire<'_> {
    fn drop(&mut self) {
        // Parts nobody took yet (none, unless the caller left early): ours.
        self.job.work();
        let mut spins = 0u32;
        while self.job.left.load(SeqCst) > 0 {
            spins = spins.wrapping_add(1);
            if spins < 1024 {
                std::hint::spin_loop();
            } else {
                // A helper holding a part lost its core: give it ours.
                std::thread::yield_now();
            }
        }
        self.shared.job.store(std::ptr::null_mut(), SeqCst);
        while self.shared.active.load(SeqCst) > 0 {
            std::thread::yield_now();
        }
    }
}

/// What the caller and the helpers share.
struct Shared {
    /// The job being run, or null.
    job: AtomicPtr<Job>,
    /// Bumped for every job, so a helper sees a new one.
    epoch: AtomicU64,
    /// Helpers between announcing themselves and leaving the job: the
    /// caller waits for none before its job's memory goes.
    active: AtomicUsize,
    /// Helpers asleep, so that the caller knows to wake them.
    sleeping: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    /// Threads a job uses, the caller included (1: no helpers). A helper
    /// whose index is past it sits the job out.
    threads: AtomicUsize,
    /// The pool was dropped: helpers leave.
    stop: AtomicBool,
}

/// Helper threads for [`Pool::run`]; see the module docs.
pub struct Pool {
    shared: Arc<Shared>,
    /// Helpers started so far.
    started: Mutex<usize>,
    /// One job at a time.
    busy: Mutex<()>,
    /// Jobs split over more than one thread.
    split: AtomicU64,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads())
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool whose jobs use `threads` threads (clamped to
    /// 1..=[`MAX_THREADS`]); helpers start on the first job that needs them.
    pub fn new(threads: usize) -> Pool {
        Pool {
            shared: Arc::new(Shared {
                job: AtomicPtr::new(std::ptr::null_mut()),
                epoch: AtomicU64::new(0),
                active: AtomicUsize::new(0),
                sleeping: AtomicUsize::new(0),
                sleep: Mutex::new(()),
                wake: Condvar::new(),
                threads: AtomicUsize::new(threads.clamp(1, MAX_THREADS)),
                stop: AtomicBool::new(false),
            }),
            started: Mutex::new(0),
            busy: Mutex::new(()),
            split: AtomicU64::new(0),
        }
    }

    /// The process's pool (one thread until [`Pool::set_threads`]).
    pub fn shared() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| Pool::new(1))
    }

    /// Threads a job uses from now on, the caller included (clamped to
    /// 1..=[`MAX_THREADS`]). Helpers started before and now past the count
    /// sit out every job (they sleep after their spin).
    pub fn set_threads(&self, threads: usize) {
        self.shared
            .threads
            .store(threads.clamp(1, MAX_THREADS), SeqCst);
    }

    /// Threads a job uses, the caller included.
    pub fn threads(&self) -> usize {
        self.shared.threads.load(SeqCst)
    }

    /// Jobs run so far in more than one part with the helpers (not those
    /// a caller ran alone because the pool was busy).
    pub fn split_jobs(&self) -> u64 {
        self.split.load(SeqCst)
    }

    /// How many parts `len` bytes make: one per thread, each at least
    /// [`PART_MIN`].
    pub fn parts_for(&self, len: usize) -> usize {
        (len / PART_MIN).clamp(1, self.threads())
    }

    /// Runs `f(0)`, ..., `f(parts - 1)`, the caller and the helpers taking
    /// them in turn, and returns once all have returned. A part that
    /// panicked panics here, after the others finished.
    pub fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) {
        // A caller whose part panicked re-raises it after the guard is
        // dropped, so the lock is never poisoned; take it back if it is.
        let busy = match self.busy.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        let (Some(one), true) = (busy, parts > 1) else {
            (0..parts).for_each(f);
            return;
        };
        self.start_helpers(parts.min(self.threads()) - 1);
        self.split.fetch_add(1, SeqCst);
        // SAFETY (lifetime): the job, and `f` through it, are reachable by
        // helpers only through `shared.job` while they count themselves in
        // `active`. A helper announces itself (`active`) before it reads
        // `job`, all SeqCst; `Retire` (dropped on every way out of this
        // function) clears `job`, then waits for `active` to reach 0. In
        // the single order of SeqCst operations a helper either announced
        // itself before that wait read `active` (the caller waits for it
        // to leave) or reads `job` after it was cleared (null). So nothing
        // reaches the job once this function returns or unwinds.
        let f: *const (dyn Fn(usize) + Sync + '_) = f;
        // SAFETY: only the lifetime is erased (same layout); see above.
        let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
        let job = Job {
            f,
            parts,
            next: AtomicUsize::new(0),
            left: AtomicUsize::new(parts),
            panic: Mutex::new(None),
        };
        let sh = &*self.shared;
        let retire = Retire {
            shared: sh,
            job: &job,
        };
        sh.job.store(&job as *const Job as *mut Job, SeqCst);
        sh.epoch.fetch_add(1, SeqCst);
        if sh.sleeping.load(SeqCst) > 0 {
            let _g = sh.sleep.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        job.work();
        drop(retire);
        drop(one);
        let panic = job.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }

    /// Starts helpers until `want` run (at most `MAX_THREADS - 1`); one
    /// that cannot be started leaves the caller more parts to do.
    fn start_helpers(&self, want: usize) {
        let mut started = self.started.lock().unwrap_or_else(|e| e.into_inner());
        while *started < want.min(MAX_THREADS - 1) {
            let sh = self.shared.clone();
            let index = *started;
            let spawned = std::thread::Builder::new()
                .name(format!("consort-par-{index}"))
                .spawn(move || helper(&sh, index));
            if spawned.is_err() {
                return;
            }
            *started += 1;
        }
    }
}

/// A helper's life: look for a new job, spin a while, sleep until woken;
/// leave when the pool is dropped. Helper `index` (from 0) joins a job only
/// while the pool's thread count has room for it.
fn helper(sh: &Shared, index: usize) {
    let mut seen = sh.epoch.load(SeqCst);
    loop {
        let since = Instant::now();
        let mut spins = 0u32;
        while sh.epoch.load(SeqCst) == seen {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && since.elapsed() >= HELPER_SPIN {
                let g = sh.sleep.lock().unwrap_or_else(|e| e.into_inner());
                sh.sleeping.fetch_add(1, SeqCst);
                // Checked again after announcing the sleep: a caller that
                // bumped the epoch before that saw no sleeper, so look.
                let g = if sh.epoch.load(SeqCst) == seen {
                    sh.wake
                        .wait_timeout(g, Duration::from_secs(1))
                        .map(|(g, _)| g)
                        .unwrap_or_else(|e| e.into_inner().0)
                } else {
                    g
                };
                sh.sleeping.fetch_sub(1, SeqCst);
                drop(g);
                break;
            }
            std::hint::spin_loop();
        }
        if sh.stop.load(SeqCst) {
            return;
        }
        let now = sh.epoch.load(SeqCst);
        if now == seen {
            continue;
        }
        seen = now;
        if index + 1 >= sh.threads.load(SeqCst) {
            continue;
        }
        sh.active.fetch_add(1, SeqCst);
        let job = sh.job.load(SeqCst);
        if !job.is_null() {
            // SAFETY: announced in `active` before reading `job`: the
            // caller keeps the job alive until `active` is 0 (`Pool::run`).
            unsafe { &*job }.work();
        }
        sh.active.fetch_sub(1, SeqCst);
    }
}

impl Drop for Pool {
    /// Tells the helpers to leave (each does at its next look).
    fn drop(&mut self) {
        let sh = &self.shared;
        sh.stop.store(true, SeqCst);
        sh.epoch.fetch_add(1, SeqCst);
        let _g = sh.sleep.lock().unwrap_or_else(|e| e.into_inner());
        sh.wake.notify_all();
    }
}

/// A byte range of a slice that several threads write, in disjoint parts.
struct Parts {
    ptr: *mut u8,
    len: usize,
    parts: usize,
}

// SAFETY: each thread writes only its own part (`Parts::get`), and the
// slice outlives the job (`Pool::run` returns after every part).
unsafe impl Send for Parts {}
// SAFETY: as for `Send`: shared only to hand each thread its own part.
unsafe impl Sync for Parts {}

impl Parts {
    /// Part `i`'s range: equal cuts on 64-byte boundaries (whole elements
    /// of every dtype, whole cache lines), the last taking the rest.
    fn range(&self, i: usize) -> std::ops::Range<usize> {
        let step = (self.len / self.parts) & !63;
        let start = i * step;
        let end = if i + 1 == self.parts {
            self.len
        } else {
            start + step
        };
        start..end
    }

    /// Part `i` of the slice.
    ///
    /// # Safety
    ///
    /// Each part is taken by one thread at a time.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self, i: usize) -> &mut [u8] {
        let r = self.range(i);
        // SAFETY: the range lies in the slice; parts do not overlap.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
}

/// Copies `src` into `dst` (equal lengths) over `pool`'s threads, with
/// streaming stores ([`copy::streaming`]) when `streaming`.
///
/// # Panics
///
/// If the lengths differ.
pub fn copy(pool: &Pool, dst: &mut [u8], src: &[u8], streaming: bool) {
    assert_eq!(dst.len(), src.len(), "a split copy needs equal lengths");
    let one = |d: &mut [u8], s: &[u8]| {
        if streaming {
            copy::streaming(d, s)
        } else {
            d.copy_from_slice(s)
        }
    };
    let parts = pool.parts_for(dst.len());
    if parts == 1 {
        return one(dst, src);
    }
    let out = Parts {
        ptr: dst.as_mut_ptr(),
        len: dst.len(),
        parts,
    };
    pool.run(parts, &|i| {
        // SAFETY: part `i` is run once.
        let d = unsafe { out.get(i) };
        one(d, &src[out.range(i)]);
    });
}

/// [`ReduceOp::apply_bytes`] over `pool`'s threads: `dst = dst op src`.
pub fn apply_bytes(
    pool: &Pool,
    op: ReduceOp,
    dtype: DType,
    dst: &mut [u8],
    src: &[u8],
) -> Result<()> {
    let parts = pool.parts_for(dst.len());
    if parts == 1 || dst.len() != src.len() {
        return op.apply_bytes(dtype, dst, src);
    }
    // The errors are the arguments' (dtype, op, lengths): the same for
    // every part, so one check up front.
    op.apply_bytes(dtype, &mut [], &[])?;
    if !dst.len().is_multiple_of(dtype.size_bytes()) {
        return op.apply_bytes(dtype, dst, src);
    }
    let out = Parts {
        ptr: dst.as_mut_ptr(),
        len: dst.len(),
        parts,
    };
    let failed = Mutex::new(None);
    pool.run(parts, &|i| {
        // SAFETY: part `i` is run once.
        let d = unsafe { out.get(i) };
        if let Err(e) = op.apply_bytes(dtype, d, &src[out.range(i)]) {
            failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(e);
        }
    });
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
