//! One direction of a pair: a single-producer, single-consumer byte queue
//! in a shared region, polled by both sides with no system call.
//!
//! Layout: a header of four cache lines, then `cap` bytes of data (a power
//! of two, at least 64 KiB). The producer owns `write`, the consumer owns
//! `read`; both only grow, and `write - read` bytes are waiting. Every
//! amount is a multiple of 8, so an element never straddles the end.
//! A small push into an empty queue may start over at the beginning of the
//! data (so that small frames reuse cache-hot bytes): the producer records
//! where it skipped from (`skip_at`, beside `write`), and the consumer,
//! on reaching that position, jumps to the next multiple of `cap`.
//!
//! Waking: a side about to sleep sets its flag (`reader_sleeping` or
//! `writer_waiting`) and polls once more; the other side, after it moves
//! its counter, swaps the flag back and, if it was set, rings the sleeper's
//! bell. Both use sequentially consistent accesses, so either the sleeper
//! sees the new counter or the other side sees the flag.
//!
//! The peer's process is trusted with nothing: counters that make no sense
//! close the queue with an error rather than reading out of bounds.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use consort_comm::par::{self, Pool};

use crate::region::Region;

/// Bytes before the data: four cache lines.
pub(crate) const HEADER: usize = 256;
/// The smallest data size.
pub(crate) const MIN_CAP: usize = 64 * 1024;
/// Most bytes one push or pull moves before it publishes its counter: the
/// other side may then work on the bytes before them (a whole 4 MiB queue
/// copied in one go left the peer idle for the copy, and a 64 MiB frame's
/// two copies took turns instead of overlapping: 11 ms instead of 7).
pub(crate) const PIECE: usize = 256 * 1024;

/// Small frames stay in the queue's first bytes, hot in the caches: a
/// push of at most this many bytes into an empty queue whose write position
/// is at least this far in starts over at the beginning (see
/// [`Queue::push`]). A 4 KiB all_reduce between 2 ranks walking the whole
/// of a 4 MiB queue took 1.71-1.80 µs, 1.50-1.54 with 8 or 16 KiB here
/// (1.55-1.59 with 32 or 64 KiB), as in a 64 KiB queue.
pub(crate) const HOT: usize = 16 * 1024;

const WRITE: usize = 0;
/// Producer-owned, beside `write`: the last position the producer skipped
/// from to the next multiple of `cap` (the start of the data).
const SKIP_AT: usize = 8;
const READ: usize = 64;
const READER_SLEEPING: usize = 128;
const WRITER_WAITING: usize = 132;
const WRITER_CLOSED: usize = 136;
const READER_CLOSED: usize = 140;
const PULLED: usize = 192;
const REVOKED: usize = 200;

/// One side's view of a queue.
pub(crate) struct Queue {
    region: Region,
    cap: usize,
}

impl Queue {
    /// A queue over `region`, whose data is `region.len() - HEADER` bytes
    /// (a power of two, at least [`MIN_CAP`]).
    pub(crate) fn new(region: Region) -> Option<Queue> {
        let cap = region.len().checked_sub(HEADER)?;
        (cap.is_power_of_two() && cap >= MIN_CAP).then_some(Queue { region, cap })
    }

    /// The region's bytes a queue of `cap` needs.
    pub(crate) fn region_len(cap: usize) -> usize {
        HEADER + cap
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is an 8-aligned offset inside the header of a
        // page-aligned mapping that lives as long as `self`.
        unsafe { &*self.region.ptr().add(off).cast::<AtomicU64>() }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as in `u64_at`, 4-aligned.
        unsafe { &*self.region.ptr().add(off).cast::<AtomicU32>() }
    }

    fn data(&self) -> *mut u8 {
        self.region.ptr().wrapping_add(HEADER)
    }

    /// Producer: appends bytes of `parts` (one concatenation) from `from`
    /// on, as many as fit, in multiples of 8 unless the end is reached.
    /// Returns how many it took and whether the reader must be woken.
    pub(crate) fn push(&self, parts: &[&[u8]], from: usize) -> (usize, bool) {
        self.push_some(parts, from, false)
    }

    /// Producer: appends all of `parts` if at most a [`PIECE`] and it fits
    /// now; returns whether the reader must be woken, or `None` (nothing
    /// taken) if it does not fit.
    pub(crate) fn push_whole(&self, parts: &[&[u8]]) -> Option<bool> {
        match self.push_some(parts, 0, true) {
            (0, _) => None,
            (_, wake) => Some(wake),
        }
    }

    /// [`Self::push`]; with `whole`, nothing unless all that is left fits
    /// in one piece (decided on the same reading of the counters as the
    /// copy: the peer's `read` may change between two readings).
    fn push_some(&self, parts: &[&[u8]], from: usize, whole: bool) -> (usize, bool) {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut w = self.u64_at(WRITE).load(Ordering::Relaxed);
        // SeqCst: pairs with the consumer's store of `read` and the
        // producer's own `arm_writer`, so a wake-up is never lost.
        let r = self.u64_at(READ).load(Ordering::SeqCst);
        let pos = (w as usize) & (self.cap - 1);
        let left = total.saturating_sub(from);
        // The consumer has taken everything: start over at the beginning.
        // It jumps there when it reaches `skip_from` (stored below, before
        // the bytes and `write`); the gap counts as used until then, and
        // `pos` bytes, at least what is left, fit.
        let skip_from = (w == r && pos >= HOT && (1..=HOT).contains(&left)).then_some(w);
        if skip_from.is_some() {
            w = w.wrapping_add((self.cap - pos) as u64);
        }
        let used = w.wrapping_sub(r);
        if used > self.cap as u64 {
            // A peer that corrupted its counter: nothing more goes in.
            return (0, false);
        }
        let free = self.cap - used as usize;
        if whole && left > free.min(PIECE) {
            return (0, false);
        }
        let mut n = left.min(free).min(PIECE);
        if n < left {
            n &= !7;
        }
        if n == 0 {
            return (0, false);
        }
        if let Some(at) = skip_from {
            self.u64_at(SKIP_AT).store(at, Ordering::SeqCst);
        }
        // Copy bytes from..from+n of the parts to position w.
        let mut skip = from;
        let mut pos = (w as usize) & (self.cap - 1);
        let mut todo = n;
        for p in parts {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            let mut src = &p[skip..];
            skip = 0;
            while !src.is_empty() && todo > 0 {
                let run = src.len().min(todo).min(self.cap - pos);
                // SAFETY: `pos + run <= cap` lies in the data; the consumer
                // does not read these bytes before `write` moves past them,
                // and nothing else in this process writes them (one sender
                // per queue).
                let dst = unsafe { std::slice::from_raw_parts_mut(self.data().add(pos), run) };
                // A large run over the rank's helper threads, where it has
                // any; their stores are ordered before `write` below (the
                // split copy returns after every part, through atomics).
                par::copy(Pool::shared(), dst, &src[..run], false);
                src = &src[run..];
                todo -= run;
                pos = (pos + run) & (self.cap - 1);
            }
            if todo == 0 {
                break;
            }
        }
        self.u64_at(WRITE)
            .store(w.wrapping_add(n as u64), Ordering::SeqCst);
        let wake = self.u32_at(READER_SLEEPING).load(Ordering::SeqCst) != 0
            && self.u32_at(READER_SLEEPING).swap(0, Ordering::SeqCst) != 0;
        (n, wake)
    }

    /// The data capacity in bytes.
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// Consumer: hands the waiting bytes to `take` (at most two runs, around
    /// the end); frees what it consumed. Returns the bytes consumed, whether
    /// the writer must be woken, and whether the queue is empty and its
    /// writer closed it. `Err` for counters that make no sense.
    pub(crate) fn pull(
        &self,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<(usize, bool, bool), String> {
        let closed = self.u32_at(WRITER_CLOSED).load(Ordering::SeqCst) != 0;
        let mut r = self.u64_at(READ).load(Ordering::Relaxed);
        let w = self.u64_at(WRITE).load(Ordering::SeqCst);
        let pos = (r as usize) & (self.cap - 1);
        if w != r && pos != 0 && self.u64_at(SKIP_AT).load(Ordering::SeqCst) == r {
            // The producer started over at the beginning from here.
            r = r.wrapping_add((self.cap - pos) as u64);
            if w.wrapping_sub(r) > self.cap as u64 {
                return Err(format!(
                    "the shared-memory queue from the peer is corrupt (write {w}, skip from {})",
                    r.wrapping_sub((self.cap - pos) as u64)
                ));
            }
        }
        let avail = w.wrapping_sub(r);
        if avail > self.cap as u64 || !avail.is_multiple_of(8) {
            return Err(format!(
                "the shared-memory queue from the peer is corrupt (write {w}, read {r})"
            ));
        }
        if avail == 0 {
            return Ok((0, false, closed));
        }
        let avail = (avail as usize).min(PIECE);
        let pos = (r as usize) & (self.cap - 1);
        let first = avail.min(self.cap - pos);
        // SAFETY: the producer wrote these bytes before moving `write` past
        // them (acquired above) and leaves them until `read` moves.
        let a = unsafe { std::slice::from_raw_parts(self.data().add(pos), first) };
        let mut n = take(a).min(first);
        if n == first && avail > first {
            // SAFETY: as above; the run that wrapped to the start.
            let b = unsafe { std::slice::from_raw_parts(self.data(), avail - first) };
            n += take(b).min(avail - first);
        }
        self.u64_at(READ)
            .store(r.wrapping_add(n as u64), Ordering::SeqCst);
        let wake = n > 0
            && self.u32_at(WRITER_WAITING).load(Ordering::SeqCst) != 0
            && self.u32_at(WRITER_WAITING).swap(0, Ordering::SeqCst) != 0;
        Ok((n, wake, false))
    }

    /// Consumer: asks the producer to ring when it next writes.
    pub(crate) fn arm_reader(&self) {
        self.u32_at(READER_SLEEPING).store(1, Ordering::SeqCst);
    }

    /// Producer: asks the consumer to ring when it next frees room.
    pub(crate) fn arm_writer(&self) {
        self.u32_at(WRITER_WAITING).store(1, Ordering::SeqCst);
    }

    /// Producer: nothing more will be written.
    pub(crate) fn close_writer(&self) {
        self.u32_at(WRITER_CLOSED).store(1, Ordering::SeqCst);
    }

    /// Consumer: nothing more will be read.
    pub(crate) fn close_reader(&self) {
        self.u32_at(READER_CLOSED).store(1, Ordering::SeqCst);
    }

    /// Consumer: one more of the producer's pull frames is read.
    /// Returns whether the producer must be woken.
    pub(crate) fn count_pull(&self) -> bool {
        self.u64_at(PULLED).fetch_add(1, Ordering::SeqCst);
        self.u32_at(WRITER_WAITING).load(Ordering::SeqCst) != 0
            && self.u32_at(WRITER_WAITING).swap(0, Ordering::SeqCst) != 0
    }

    /// Producer: how many of its pull frames the consumer has read.
    pub(crate) fn pulls_read(&self) -> u64 {
        self.u64_at(PULLED).load(Ordering::SeqCst)
    }

    /// Producer: the bytes of pull frames up to number `upto` are no longer
    /// there to read.
    pub(crate) fn revoke(&self, upto: u64) {
        self.u64_at(REVOKED).fetch_max(upto, Ordering::SeqCst);
    }

    /// Consumer: the last pull frame number whose bytes are gone.
    pub(crate) fn revoked(&self) -> u64 {
        self.u64_at(REVOKED).load(Ordering::SeqCst)
    }

    /// Producer: whether the consumer has closed its end.
    pub(crate) fn reader_closed(&self) -> bool {
        self.u32_at(READER_CLOSED).load(Ordering::SeqCst) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(cap: usize) -> (Queue, Queue) {
        let (name, mut a) = Region::create("consort-unused", Queue::region_len(cap)).unwrap();
        let b = Region::open(&name, Queue::region_len(cap)).unwrap();
        a.unlink(&name);
        (Queue::new(a).unwrap(), Queue::new(b).unwrap())
    }

    fn drain(q: &Queue) -> Vec<u8> {
        let mut got = Vec::new();
        q.pull(&mut |b| {
            got.extend_from_slice(b);
            b.len()
        })
        .unwrap();
        got
    }

    #[test]
    fn bytes_come_out_in_order_across_the_end() {
        let (tx, rx) = pair(MIN_CAP);
        let mut sent = Vec::new();
        let mut got = Vec::new();
        for round in 0..40u32 {
            // Lengths are whole words, as the driver pads its frames.
            let msg: Vec<u8> = (0..(round as usize * 997 % 9000) / 8 * 8 + 8)
                .map(|i| (i as u32 ^ round) as u8)
                .collect();
            let mut done = 0;
            while done < msg.len() {
                done += tx.push(&[&msg], done).0;
                got.extend(drain(&rx));
            }
            sent.extend_from_slice(&msg);
        }
        got.extend(drain(&rx));
        assert_eq!(got, sent);
    }

    #[test]
    fn large_pushes_and_pulls_move_a_piece_at_a_time_in_order() {
        let cap = 4 * PIECE;
        let (tx, rx) = pair(cap);
        // Start mid-queue, so that pieces also straddle the end.
        tx.push(&[&vec![0u8; PIECE / 2 + 8]], 0);
        assert_eq!(drain(&rx).len(), PIECE / 2 + 8);
        let msg: Vec<u8> = (0..3 * cap).map(|i| (i % 251) as u8).collect();
        let (mut done, mut got) = (0, Vec::new());
        while done < msg.len() {
            let (n, _) = tx.push(&[&msg], done);
            assert!(n <= PIECE, "one push moves at most a piece, not {n}");
            done += n;
            let before = got.len();
            got.extend(drain(&rx));
            assert!(
                got.len() - before <= PIECE,
                "one pull moves at most a piece"
            );
        }
        while got.len() < msg.len() {
            got.extend(drain(&rx));
        }
        assert_eq!(got, msg);
    }

    #[test]
    fn a_full_queue_takes_what_fits_and_a_sleeper_is_woken_once() {
        let (tx, rx) = pair(MIN_CAP);
        let big = vec![1u8; MIN_CAP + 16];
        let (n, _) = tx.push(&[&big], 0);
        assert_eq!(n, MIN_CAP, "takes what fits, a multiple of 8");
        assert_eq!(tx.push(&[&big], n).0, 0, "full");
        rx.arm_reader();
        tx.arm_writer();
        assert_eq!(drain(&rx).len(), MIN_CAP);
        let (_, wake, _) = rx.pull(&mut |b| b.len()).unwrap();
        assert!(!wake, "nothing consumed, no ring");
        let (n2, wake) = tx.push(&[&big], n);
        assert_eq!(n2, 16);
        assert!(wake, "the reader armed");
        assert!(!tx.push(&[&big], n + 16).1);
    }

    #[test]
    fn a_closed_writer_is_seen_after_its_bytes_and_corruption_is_refused() {
        let (tx, rx) = pair(MIN_CAP);
        tx.push(&[&[7u8; 16]], 0);
        tx.close_writer();
        let (n, _, closed) = rx.pull(&mut |b| b.len()).unwrap();
        assert_eq!((n, closed), (16, false), "the bytes first");
        assert!(rx.pull(&mut |b| b.len()).unwrap().2);
        tx.u64_at(WRITE).store(1 << 40, Ordering::SeqCst);
        assert!(rx.pull(&mut |b| b.len()).is_err());
    }

    fn write_pos(q: &Queue) -> usize {
        q.u64_at(WRITE).load(Ordering::SeqCst) as usize & (q.cap - 1)
    }

    #[test]
    fn a_small_push_into_an_empty_queue_starts_over_at_the_beginning() {
        let (tx, rx) = pair(MIN_CAP);
        let big: Vec<u8> = (0..HOT + 64).map(|i| i as u8).collect();
        assert_eq!(tx.push(&[&big], 0).0, big.len());
        assert_eq!(drain(&rx), big, "a large push walks on");
        let small = [5u8; 4096];
        assert_eq!(tx.push(&[&small], 0).0, small.len());
        assert_eq!(write_pos(&tx), small.len(), "empty and far in: starts over");
        // Not empty: no skipping past bytes the consumer has not read.
        assert_eq!(tx.push(&[&[6u8; 64]], 0).0, 64);
        assert_eq!(write_pos(&tx), small.len() + 64);
        let mut want = small.to_vec();
        want.extend([6u8; 64]);
        assert_eq!(drain(&rx), want);
        // Near the beginning it walks on.
        assert_eq!(tx.push(&[&[7u8; 8]], 0).0, 8);
        assert_eq!(write_pos(&tx), small.len() + 72);
        assert_eq!(drain(&rx), [7u8; 8]);
    }

    #[test]
    fn a_whole_push_takes_all_or_nothing() {
        let (tx, rx) = pair(MIN_CAP);
        let big = vec![3u8; MIN_CAP - 64];
        assert_eq!(tx.push_whole(&[&big]), Some(false));
        assert_eq!(tx.push_whole(&[&[4u8; 128]]), None, "64 bytes left");
        assert_eq!(
            tx.push_whole(&[&[4u8; 32], &[5u8; 32]]),
            Some(false),
            "exactly what is left"
        );
        assert_eq!(drain(&rx).len(), MIN_CAP);
        // Empty and far in: it starts over at the beginning, as `push` does.
        assert_eq!(tx.push_whole(&[&vec![5u8; HOT + 64]]), Some(false));
        assert_eq!(drain(&rx).len(), HOT + 64);
        assert_eq!(tx.push_whole(&[&[6u8; 4096]]), Some(false));
        assert_eq!(write_pos(&tx), 4096);
        assert_eq!(drain(&rx), [6u8; 4096]);
        assert_eq!(
            tx.push_whole(&[&vec![0u8; PIECE + 8]]),
            None,
            "over a piece"
        );
        rx.arm_reader();
        assert_eq!(
            tx.push_whole(&[&[7u8; 8]]),
            Some(true),
            "the armed reader is rung"
        );
    }

    #[test]
    fn a_hostile_skip_position_is_refused() {
        let (tx, rx) = pair(MIN_CAP);
        tx.push(&[&[1u8; 8]], 0);
        drain(&rx);
        tx.push(&[&[2u8; 8]], 0);
        // The peer claims it skipped from where the consumer stands, yet
        // wrote just after it: the jump would pass its `write`.
        tx.u64_at(SKIP_AT).store(8, Ordering::SeqCst);
        assert!(rx.pull(&mut |b| b.len()).is_err());
    }

    proptest::proptest! {
        /// Any interleaving of pushes (frames of any whole-word length,
        /// large and small) and partial pulls delivers the bytes in order.
        #[test]
        fn bytes_arrive_in_order_whatever_the_interleaving(
            steps in proptest::collection::vec(
                (0usize..3, 1usize..(3 * HOT / 8), 0usize..=1000), 1..120),
        ) {
            let (tx, rx) = pair(MIN_CAP);
            let (mut sent, mut got) = (Vec::new(), Vec::new());
            let mut pending: Vec<u8> = Vec::new();
            let mut done = 0;
            for (i, (kind, words, frac)) in steps.into_iter().enumerate() {
                if kind == 0 || done == pending.len() {
                    if done == pending.len() {
                        pending = (0..words * 8).map(|j| (i * 31 + j) as u8).collect();
                        done = 0;
                    }
                    let (n, _) = tx.push(&[&pending], done);
                    sent.extend_from_slice(&pending[done..done + n]);
                    done += n;
                } else {
                    // Take a part of what is there, in whole words.
                    rx.pull(&mut |b| {
                        let n = (b.len() * frac / 1000) & !7;
                        got.extend_from_slice(&b[..n]);
                        n
                    })
                    .unwrap();
                }
            }
            while done < pending.len() {
                let (n, _) = tx.push(&[&pending], done);
                sent.extend_from_slice(&pending[done..done + n]);
                done += n;
                got.extend(drain(&rx));
            }
            got.extend(drain(&rx));
            proptest::prop_assert_eq!(got, sent);
        }
    }
}
