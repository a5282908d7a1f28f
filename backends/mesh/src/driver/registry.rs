//! The in-place registry: the receives of the calls in flight that links
//! may fill straight from the wire or the shared queue, and the one rule
//! that keeps that sound even when a caller leaks a call's future.
//!
//! # The rule
//!
//! A call's buffers are borrowed by its future. Safe code can end that
//! borrow without running the future's destructor (`mem::forget`,
//! `Box::leak` of a polled [`consort_comm::Work`]) and then free or reuse
//! the memory. So nothing may write into a call's buffer on the strength of
//! a registration alone. Bytes go into a registered receive only from
//! *inside that call's own poll*: [`Polling`] marks the running thread
//! with the call's id for exactly as long as the call's future is being
//! polled, and [`deliver`] writes in place only when the mark is the
//! receive's call (a polled link read by the call itself, the one copy
//! after the sender's). Anywhere else (a stream's reader task, a polled
//! link drained by another call or by the idle task) the bytes go into an
//! owned chunk that waits in [`Registry::pending`] until the call applies
//! it from its own poll ([`take_pending`]). A leaked call's chunks are
//! memory, not writes into someone else's.
//!
//! A stream reader reads each chunk straight into the owned buffer (L2
//! sized), so the bytes are still copied twice in all, the kernel's copy
//! and the apply, as before; the apply runs on the call's thread.

use std::cell::Cell;

use super::*;

/// A posted receive that a link may fill in place.
#[derive(Clone)]
pub(super) struct Direct {
    /// The registering call (see [`Registry`]).
    pub(super) call: u64,
    /// Its key in [`Registry::posted`].
    pub(super) key: DirectKey,
    pub(super) fp: Fingerprint,
    pub(super) dst: *mut u8,
    pub(super) len: usize,
    pub(super) reduce: Option<(ReduceOp, DType)>,
}

// SAFETY: `dst` is written only from the poll of the call that registered
// it (see the module's rule); elsewhere it is only carried.
unsafe impl Send for Direct {}
// SAFETY: as above; a shared `&Direct` only reads its fields.
unsafe impl Sync for Direct {}

/// Bytes for bytes `off..` of a posted receive, waiting for its call.
pub(super) struct Pending {
    d: Direct,
    peer: usize,
    off: usize,
    bytes: Vec<u8>,
}

/// The receives of the calls in flight that links may fill in place.
#[derive(Default)]
pub(super) struct Registry {
    /// Calls whose receives may still be filled.
    pub(super) live: rustc_hash::FxHashSet<u64>,
    /// Posted receives by (group, mesh sender, seq, tag).
    pub(super) posted: rustc_hash::FxHashMap<DirectKey, Direct>,
    /// Chunks that came outside their call's poll, by call.
    pending: rustc_hash::FxHashMap<u64, Vec<Pending>>,
    /// Receives their call has handed back to its schedule: bytes for them
    /// (a duplicated frame that took the registration) are dropped, never
    /// written into a range the schedule may be using again.
    retired: rustc_hash::FxHashSet<(u64, DirectKey)>,
}

impl Registry {
    fn accepts(&self, d: &Direct) -> bool {
        self.live.contains(&d.call) && !self.retired.contains(&(d.call, d.key))
    }
}

/// A new call's registry id: unique in the process, since [`POLLING`]
/// marks threads process-wide and one process may hold several meshes.
/// Only a call that `registers` receives enters the registry.
pub(super) fn new_call(inner: &Inner, registers: bool) -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if registers {
        lock(&inner.direct).live.insert(id);
    }
    id
}

/// Marks the receives of `call` keyed `keys` handed back to its schedule
/// (see [`Registry::retired`]); their registrations go too.
pub(super) fn retire(inner: &Inner, call: u64, keys: impl IntoIterator<Item = DirectKey>) {
    let mut reg = lock(&inner.direct);
    for key in keys {
        reg.posted.remove(&key);
        reg.retired.insert((call, key));
    }
}

pub(super) type DirectKey = (GroupId, usize, u64, u32);

thread_local! {
    /// The call (registry id) whose future this thread is polling; 0 for
    /// none.
    static POLLING: Cell<u64> = const { Cell::new(0) };
}

/// Whether this thread is inside call `call`'s poll right now.
fn polling(call: u64) -> bool {
    call != 0 && POLLING.get() == call
}

pin_project_lite::pin_project! {
    /// Call `call`'s future, marking the thread as inside that call while
    /// it is polled (see the module's rule).
    pub(super) struct Polling<F> {
        pub(super) call: u64,
        #[pin]
        pub(super) fut: F,
    }
}

impl<F: Future> Future for Polling<F> {
    type Output = F::Output;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        /// Puts the previous mark back, also when the poll unwinds.
        struct Restore(u64);
        impl Drop for Restore {
            fn drop(&mut self) {
                POLLING.set(self.0);
            }
        }
        let me = self.project();
        let _restore = Restore(POLLING.replace(*me.call));
        me.fut.poll(cx)
    }
}

use std::task::Poll;

/// Copies or reduces `bytes` into bytes `off..` of posted receive `d` if
/// this thread is inside `d`'s call; otherwise keeps a copy for the call
/// to apply (see [`deliver_owned`]). `bytes` holds whole elements.
pub(super) fn deliver(inner: &Inner, peer: usize, d: &Direct, off: usize, bytes: &[u8]) {
    if bytes.is_empty() || off + bytes.len() > d.len || !lock(&inner.direct).accepts(d) {
        return;
    }
    if polling(d.call) {
        // SAFETY: this thread is inside the registering call's poll, so its
        // future, and the buffer it borrows, are alive (its registration
        // goes only after that future ends); the call holds no other
        // reference to this range (a schedule never uses a posted
        // receive's range before it completes), and `off + len <= d.len`
        // bytes from `dst` lie inside its buffer.
        let dst = unsafe { std::slice::from_raw_parts_mut(d.dst.add(off), bytes.len()) };
        if let Some(e) = inbound::apply(d, dst, bytes) {
            lock(&inner.engine).protocol_error(peer, e);
        }
        return;
    }
    let mut owned = inner.buffer(bytes.len());
    owned.extend_from_slice(bytes);
    deliver_owned(inner, peer, d, off, owned);
}

/// Leaves `bytes` for bytes `off..` of posted receive `d` with its call,
/// and wakes it (the bytes are dropped if the call has ended).
pub(super) fn deliver_owned(inner: &Inner, peer: usize, d: &Direct, off: usize, bytes: Vec<u8>) {
    {
        let mut reg = lock(&inner.direct);
        if !reg.accepts(d) || off + bytes.len() > d.len {
            drop(reg);
            inner.recycle(bytes);
            return;
        }
        reg.pending.entry(d.call).or_default().push(Pending {
            d: d.clone(),
            peer,
            off,
            bytes,
        });
    }
    inner.notify.notify_waiters();
}

/// Whether bytes for `d` may be written in place now (this thread is
/// inside its call's poll): for a link that reads straight into place.
pub(super) fn in_place_now(d: &Direct) -> bool {
    polling(d.call)
}

/// Applies the chunks that came for `call` outside its poll; returns how
/// many. Called by the call itself (see the module's rule).
pub(super) fn take_pending(inner: &Inner, call: u64) -> usize {
    let chunks = {
        let mut reg = lock(&inner.direct);
        let Some(mut chunks) = reg.pending.remove(&call) else {
            return 0;
        };
        chunks.retain(|c| !reg.retired.contains(&(call, c.d.key)));
        chunks
    };
    debug_assert!(polling(call), "only a call applies its own chunks");
    let n = chunks.len();
    for c in chunks {
        // SAFETY: as in `deliver`: we are inside the call's poll (the call
        // is the caller), and the chunk's range lies inside its receive.
        let dst = unsafe { std::slice::from_raw_parts_mut(c.d.dst.add(c.off), c.bytes.len()) };
        if let Some(e) = inbound::apply(&c.d, dst, &c.bytes) {
            lock(&inner.engine).protocol_error(c.peer, e);
        }
        inner.recycle(c.bytes);
    }
    n
}

/// Removes a call, its posted receives and its waiting chunks from the
/// registry when it ends (returns, fails, or is cancelled). A call whose
/// future is leaked never gets here: its registration stays, and only
/// costs memory (see the module's rule). A call that never entered the
/// registry (`registers` false) has nothing there.
pub(super) struct DirectGuard<'a>(pub(super) &'a Inner, pub(super) u64, pub(super) bool);

impl Drop for DirectGuard<'_> {
    fn drop(&mut self) {
        if !self.2 {
            return;
        }
        let call = self.1;
        let chunks = {
            let mut reg = lock(&self.0.direct);
            reg.live.remove(&call);
            reg.posted.retain(|_, d| d.call != call);
            reg.retired.retain(|(c, _)| *c != call);
            reg.pending.remove(&call)
        };
        for c in chunks.into_iter().flatten() {
            self.0.recycle(c.bytes);
        }
    }
}
