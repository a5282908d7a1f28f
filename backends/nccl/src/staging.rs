//! The staging memory of host-buffer calls: pairs of a pinned host buffer
//! and a device buffer, pooled and reused.
//!
//! A host call takes a pair when it is made ([`Pool::take`]) and holds it
//! ([`Held`]) for as long as anyone may touch it: its tracked work until
//! the call's copies on the stream are done, its caller's work until the
//! result is copied out. A pair goes back to the pool only once the call
//! completed ([`Held::completed`]); a pair whose call failed may still be
//! read or written by the stream (a kernel an abort has not ended yet), so
//! it is kept aside and freed only once the stream has drained
//! ([`Pool::close`]). This module owns those lifetimes, so that no pinned
//! byte is reused or freed under a copy still on the stream.

use std::{
    ffi::c_void,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use consort_comm::{CommError, ErrorContext, Result};
use cudarc::driver::{CudaContext, result as cu};

use consort_comm::lock;

use crate::cuda::driver_error;

/// The smallest pair allocated (small calls share sizes, and so reuse).
const MIN_BYTES: usize = 4096;

/// One pair: pinned host memory (`cuMemHostAlloc`) and device memory of
/// `cap` bytes each, as addresses.
#[derive(Clone, Copy, Debug)]
struct Pair {
    host: usize,
    dev: u64,
    cap: usize,
}

/// Where pairs come from: CUDA ([`Cuda`]), or a test's stand-in.
trait Memory: std::fmt::Debug + Send + Sync {
    /// A new pair of `cap` bytes each.
    fn alloc(&self, cap: usize, ctx: ErrorContext) -> Result<Pair>;

    /// Frees both buffers of `pair`.
    ///
    /// # Safety
    /// Nothing on any stream uses them any more, and the pair is freed
    /// once.
    unsafe fn free(&self, pair: Pair);
}

/// Pinned host memory and device memory of one CUDA context.
#[derive(Debug)]
struct Cuda(Arc<CudaContext>);

impl Memory for Cuda {
    fn alloc(&self, cap: usize, ctx: ErrorContext) -> Result<Pair> {
        self.0
            .bind_to_thread()
            .map_err(|e| driver_error(ctx, "context binding", e))?;
        // SAFETY: fresh allocations, owned by the pair from here on.
        unsafe {
            let host = cu::malloc_host(cap, 0)
                .map_err(|e| driver_error(ctx, "pinned staging allocation", e))?;
            match cu::malloc_sync(cap) {
                Ok(dev) => Ok(Pair {
                    host: host as usize,
                    dev,
                    cap,
                }),
                Err(e) => {
                    let _ = cu::free_host(host);
                    Err(driver_error(ctx, "device staging allocation", e))
                }
            }
        }
    }

    unsafe fn free(&self, pair: Pair) {
        let _ = self.0.bind_to_thread();
        // SAFETY: per the contract.
        unsafe {
            let _ = cu::free_host(pair.host as *mut c_void);
            let _ = cu::free_sync(pair.dev);
        }
    }
}

/// The pairs of one communicator.
#[derive(Debug)]
struct Pairs {
    idle: Vec<Pair>,
    /// Pairs of calls that failed: the stream may still use them.
    failed: Vec<Pair>,
    /// Set by [`Pool::close`]: no pair is handed out any more.
    closed: bool,
    /// Set by [`Pool::close`] when the stream drained: every pair is idle.
    drained: bool,
    /// Pairs allocated and not freed (idle, failed or held).
    live: usize,
}

impl Pairs {
    /// The smallest idle pair of `bytes..=most` bytes, out of the pool.
    fn pick(&mut self, bytes: usize, most: usize) -> Option<Pair> {
        let best = (self.idle.iter().enumerate())
            .filter(|(_, q)| q.cap >= bytes && q.cap <= most)
            .min_by_key(|(_, q)| q.cap)
            .map(|(i, _)| i);
        best.map(|i| self.idle.swap_remove(i))
    }

    /// The error of a call of `bytes` that found no staging memory (`e`).
    fn exhausted(&self, bytes: usize, e: &CommError, ctx: ErrorContext) -> CommError {
        let held = self.live - self.idle.len() - self.failed.len();
        CommError::Aborted {
            ctx,
            cause: consort_comm::AbortCause::Other(format!(
                "no staging memory for a host call of {bytes} bytes ({e}); {held} staging \
                 buffers are held by host calls in flight, or whose works were neither awaited \
                 nor dropped yet. Await (or drop) host calls' works before making many more, or \
                 pass device buffers"
            )),
        }
    }
}

/// The staging pool of one communicator (see the module docs).
#[derive(Debug)]
pub(crate) struct Pool {
    memory: Box<dyn Memory>,
    pairs: Mutex<Pairs>,
}

/// One host call's pair, shared by its tracked work and its caller's work
/// (see the module docs).
#[derive(Debug)]
pub(crate) struct Held {
    pool: Arc<Pool>,
    pair: Pair,
    completed: AtomicBool,
}

impl Pool {
    /// An empty pool for buffers of the device of `ctx`.
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
        Self::on(Box::new(Cuda(ctx)))
    }

    fn on(memory: Box<dyn Memory>) -> Arc<Self> {
        Arc::new(Pool {
            memory,
            pairs: Mutex::new(Pairs {
                idle: Vec::new(),
                failed: Vec::new(),
                closed: false,
                drained: false,
                live: 0,
            }),
        })
    }

    /// A pair of at least `bytes` bytes each: the smallest idle one that
    /// is large enough and not far larger, or a new one; when no memory is
    /// left for a new one, any idle one large enough. The error says how
    /// much staging the calls in flight hold.
    pub(crate) fn take(self: &Arc<Self>, bytes: usize, ctx: ErrorContext) -> Result<Held> {
        let reused = {
            let mut p = lock(&self.pairs);
            if p.closed {
                return Err(CommError::Aborted {
                    ctx,
                    cause: consort_comm::AbortCause::Closed(
                        "the NCCL communicator was shut down or aborted".into(),
                    ),
                });
            }
            // Not a pair far larger than the call needs: a small call
            // (a barrier) would keep it from the next large one.
            p.pick(bytes, bytes.saturating_mul(4).max(MIN_BYTES))
        };
        let pair = match reused {
            Some(q) => q,
            None => match self.allocate(bytes, ctx) {
                Ok(q) => q,
                Err(e) => {
                    let mut p = lock(&self.pairs);
                    match p.pick(bytes, usize::MAX) {
                        Some(q) => q,
                        None => return Err(p.exhausted(bytes, &e, ctx)),
                    }
                }
            },
        };
        Ok(Held {
            pool: self.clone(),
            pair,
            completed: AtomicBool::new(false),
        })
    }

    /// A new pair (the pool's lock is not held: allocating pinned memory
    /// takes milliseconds).
    fn allocate(&self, bytes: usize, ctx: ErrorContext) -> Result<Pair> {
        let cap = bytes
            .max(MIN_BYTES)
            .checked_next_power_of_two()
            .unwrap_or(bytes);
        let pair = self.memory.alloc(cap, ctx)?;
        lock(&self.pairs).live += 1;
        Ok(pair)
    }

    /// The communicator ended: no pair is handed out any more. `drained`
    /// says whether the stream has finished all its work; then every pair
    /// not held is freed now, and each held one when its holders let go.
    /// Otherwise every pair is left allocated (a kernel the abort has not
    /// ended may still use the pairs of failed calls, and freeing any
    /// pinned memory may wait for it). Returns the bytes left allocated so
    /// (host and device), for the caller's warning.
    pub(crate) fn close(&self, drained: bool) -> usize {
        let (idle, failed) = {
            let mut p = lock(&self.pairs);
            p.closed = true;
            p.drained = drained;
            let (idle, failed) = (std::mem::take(&mut p.idle), std::mem::take(&mut p.failed));
            if drained {
                p.live -= idle.len() + failed.len();
            }
            (idle, failed)
        };
        if !drained {
            return idle.iter().chain(&failed).map(|q| q.cap * 2).sum();
        }
        for q in idle.into_iter().chain(failed) {
            // SAFETY: the stream drained after the communicator ended, and
            // each pair was taken out of the pool once.
            unsafe { self.memory.free(q) };
        }
        0
    }

    /// Whether no pair is allocated (nothing to wait for before closing).
    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.pairs).live == 0
    }

    /// A pair whose holders have all let go. While the communicator lives
    /// nothing is freed here: freeing pinned memory may wait for the device,
    /// and this runs on the watchdog's thread too, which must never wait
    /// on a kernel. The pool keeps as many pairs as were ever in use at
    /// once (as torch's caching allocator keeps its blocks), until
    /// [`Pool::close`].
    fn give_back(&self, pair: Pair, completed: bool) {
        let mut p = lock(&self.pairs);
        match (p.closed, completed, p.drained) {
            (false, true, _) => p.idle.push(pair),
            (false, false, _) => p.failed.push(pair),
            (true, _, true) => {
                p.live -= 1;
                drop(p);
                // SAFETY: the stream drained after the communicator ended,
                // and the pair left the pool here, once.
                unsafe { self.memory.free(pair) };
            }
            // The stream did not drain: leave it allocated (see `close`).
            (true, _, false) => {}
        }
    }
}

impl Held {
    /// The pinned host buffer's address.
    pub(crate) fn host(&self) -> usize {
        self.pair.host
    }

    /// The device buffer's address.
    pub(crate) fn dev(&self) -> u64 {
        self.pair.dev
    }

    /// The bytes each buffer holds.
    pub(crate) fn cap(&self) -> usize {
        self.pair.cap
    }

    /// The call's work completed: its copies are done, and the pair may be
    /// reused once its holders let go.
    pub(crate) fn completed(&self) {
        self.completed.store(true, Ordering::Release);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let completed = self.completed.load(Ordering::Acquire);
        self.pool.give_back(self.pair, completed);
    }
}

#[cfg(test)]
mod tests {
    //! The pool's bookkeeping, on stand-in memory: which pairs are reused,
    //! kept aside or freed, and when.

    use super::*;

    /// Hands out fresh addresses (until `full`) and records what is freed.
    #[derive(Debug, Default)]
    struct Fake {
        next: Mutex<usize>,
        freed: Arc<Mutex<Vec<usize>>>,
        full: Arc<AtomicBool>,
    }

    impl Memory for Fake {
        fn alloc(&self, cap: usize, _: ErrorContext) -> Result<Pair> {
            if self.full.load(Ordering::SeqCst) {
                return Err(CommError::Aborted {
                    ctx: ErrorContext::default(),
                    cause: "out of memory".into(),
                });
            }
            let mut n = lock(&self.next);
            *n += 1;
            Ok(Pair {
                host: *n,
                dev: *n as u64,
                cap,
            })
        }

        unsafe fn free(&self, pair: Pair) {
            lock(&self.freed).push(pair.host);
        }
    }

    fn pool() -> (Arc<Pool>, Arc<Mutex<Vec<usize>>>) {
        let (p, freed, _) = pool_that_fills();
        (p, freed)
    }

    fn pool_that_fills() -> (Arc<Pool>, Arc<Mutex<Vec<usize>>>, Arc<AtomicBool>) {
        let fake = Fake::default();
        let (freed, full) = (fake.freed.clone(), fake.full.clone());
        (Pool::on(Box::new(fake)), freed, full)
    }

    fn take(p: &Arc<Pool>, bytes: usize) -> Arc<Held> {
        Arc::new(p.take(bytes, ErrorContext::default()).unwrap())
    }

    #[test]
    fn a_pair_is_reused_only_once_its_call_completed_and_every_holder_let_go() {
        let (p, freed) = pool();
        let a = take(&p, 100);
        assert_eq!(a.cap(), MIN_BYTES);
        let (host, work) = (a.host(), a.clone());
        a.completed();
        drop(a);
        // The tracked work still holds it.
        assert_ne!(take(&p, 100).host(), host);
        drop(work);
        // Now it is back (the second pair, dropped unfinished, is not).
        assert_eq!(take(&p, 100).host(), host);
        assert!(lock(&freed).is_empty());
    }

    #[test]
    fn a_failed_calls_pair_is_never_reused_and_is_freed_once_the_stream_drained() {
        let (p, freed) = pool();
        let a = take(&p, 10);
        let host = a.host();
        drop(a); // never completed: the stream may still use it
        assert_ne!(take(&p, 10).host(), host);
        assert_eq!(p.close(true), 0);
        let freed = lock(&freed).clone();
        assert!(freed.contains(&host), "{freed:?}");
        assert!(p.take(10, ErrorContext::default()).is_err());
    }

    #[test]
    fn a_stream_that_did_not_drain_keeps_every_pair() {
        let (p, freed) = pool();
        let a = take(&p, 10);
        let b = take(&p, 5000);
        b.completed();
        drop(b);
        let left = p.close(false);
        // The idle pair's bytes, host and device (a held one is not counted).
        assert_eq!(left, 2 * 8192);
        a.completed();
        drop(a);
        assert!(lock(&freed).is_empty(), "freed while the stream may run");
    }

    #[test]
    fn a_pair_held_past_a_drained_close_is_freed_when_let_go() {
        let (p, freed) = pool();
        let a = take(&p, 10);
        let host = a.host();
        p.close(true);
        assert!(lock(&freed).is_empty());
        drop(a);
        assert_eq!(*lock(&freed), vec![host]);
        assert!(p.is_empty());
    }

    #[test]
    fn a_small_call_does_not_take_a_large_idle_pair() {
        let (p, _) = pool();
        let big = take(&p, 1 << 20);
        let big_host = big.host();
        big.completed();
        drop(big);
        let small = take(&p, 1);
        assert_ne!(small.host(), big_host);
        assert_eq!(take(&p, 1 << 19).host(), big_host);
    }

    #[test]
    fn out_of_memory_a_call_takes_any_idle_pair_or_says_what_holds_staging() {
        let (p, _, full) = pool_that_fills();
        let big = take(&p, 1 << 20);
        let big_host = big.host();
        big.completed();
        drop(big);
        let held = take(&p, 10);
        full.store(true, Ordering::SeqCst);
        let small = take(&p, 10);
        assert_eq!(
            small.host(),
            big_host,
            "the idle pair, when nothing else is left"
        );
        let e = p.take(10, ErrorContext::default()).unwrap_err().to_string();
        assert!(
            e.contains("out of memory") && e.contains("2 staging buffers are held"),
            "{e}"
        );
        drop((held, small));
    }
}
