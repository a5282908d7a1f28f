//! [`EmulatedDevice`]: a [`Device`] in host memory whose work completes
//! late, on a worker thread, in a seeded random order across streams.
//!
//! This module owns the emulated device's memory, streams and events. It
//! exists so that every ordering rule of stream-ordered code (DDP's device
//! buckets, the stream-ordered backends) is tested without a GPU: each
//! enqueued copy runs after a random delay, streams interleave at random,
//! and a stream that should have waited for an event but did not reads
//! stale memory, so a test that checks results fails.
//!
//! Addresses are `(allocation + 1) << 40 | offset`, so views into an
//! allocation (bucket slots) are plain address arithmetic, as on a GPU. A
//! bad address or length is an error, never a panic or a stray write.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use consort_comm::{CommError, Device, EventId, Result, StreamId};

use consort_comm::fault::Rng;

/// Bits of an address that hold the offset inside an allocation.
const OFFSET_BITS: u32 = 40;

/// How an [`EmulatedDevice`] behaves.
#[derive(Clone, Debug)]
pub struct EmulatedOptions {
    /// The device ordinal its buffers carry.
    pub ordinal: i32,
    /// Seeds the delays and the interleaving of streams.
    pub seed: u64,
    /// Each enqueued operation runs after a delay drawn from `0..=max_delay`.
    pub max_delay: Duration,
    /// How long [`Device::synchronize`] waits before it reports a stream as
    /// stuck (an event nobody completes, a lost collective).
    pub sync_timeout: Duration,
}

impl Default for EmulatedOptions {
    fn default() -> Self {
        EmulatedOptions {
            ordinal: 0,
            seed: 0,
            max_delay: Duration::from_micros(200),
            sync_timeout: Duration::from_secs(60),
        }
    }
}

enum Op {
    Copy { dst: u64, src: u64, n: usize },
    Write { dst: u64, data: Vec<u8> },
    Zero { dst: u64, n: usize },
    Free { alloc: u64 },
    Record(u64),
    Wait(u64),
}

#[derive(Default)]
struct EventState {
    done: bool,
    released: bool,
}

struct State {
    allocs: HashMap<u64, Vec<u8>>,
    next_alloc: u64,
    /// Bytes allocated and not yet freed, and their peak since the last
    /// reset (as CUDA's pool keeps them).
    held: usize,
    peak: usize,
    streams: HashMap<StreamId, VecDeque<Op>>,
    next_stream: StreamId,
    /// The stream whose operation the worker is running now.
    busy: Option<StreamId>,
    events: HashMap<u64, EventState>,
    next_event: u64,
    /// The first failed operation (a bad address): sticky.
    error: Option<String>,
    stop: bool,
    rng: Rng,
}

impl State {
    fn event_done(&self, e: u64) -> bool {
        // A forgotten event was complete when it was forgotten.
        self.events.get(&e).is_none_or(|s| s.done)
    }

    fn complete(&mut self, e: u64) {
        if let Some(s) = self.events.get_mut(&e) {
            s.done = true;
            if s.released {
                self.events.remove(&e);
            }
        }
    }

    fn range(&self, ptr: u64, n: usize) -> std::result::Result<(u64, usize), String> {
        let alloc = (ptr >> OFFSET_BITS).wrapping_sub(1);
        let off = (ptr & ((1 << OFFSET_BITS) - 1)) as usize;
        let Some(mem) = self.allocs.get(&alloc) else {
            return Err(format!(
                "address {ptr:#x} is not in a live allocation of the emulated device"
            ));
        };
        if off.checked_add(n).is_none_or(|end| end > mem.len()) {
            return Err(format!(
                "{n} bytes at {ptr:#x} run past the end of its {}-byte allocation",
                mem.len()
            ));
        }
        Ok((alloc, off))
    }

    fn read(&self, ptr: u64, n: usize) -> std::result::Result<Vec<u8>, String> {
        let (a, o) = self.range(ptr, n)?;
        Ok(self.allocs[&a][o..o + n].to_vec())
    }

    fn write(&mut self, ptr: u64, data: &[u8]) -> std::result::Result<(), String> {
        let (a, o) = self.range(ptr, data.len())?;
        if let Some(mem) = self.allocs.get_mut(&a) {
            mem[o..o + data.len()].copy_from_slice(data);
        }
        Ok(())
    }

    fn run(&mut self, op: Op) -> std::result::Result<(), String> {
        match op {
            Op::Copy { dst, src, n } => {
                let data = self.read(src, n)?;
                self.write(dst, &data)
            }
            Op::Write { dst, data } => self.write(dst, &data),
            Op::Zero { dst, n } => self.write(dst, &vec![0; n]),
            Op::Free { alloc } => {
                if let Some(a) = self.allocs.remove(&alloc) {
                    self.held -= a.len();
                }
                Ok(())
            }
            Op::Record(e) => {
                self.complete(e);
                Ok(())
            }
            Op::Wait(_) => Ok(()),
        }
    }

    /// Streams whose next operation may run now.
    fn runnable(&self) -> Vec<StreamId> {
        let mut v: Vec<StreamId> = self
            .streams
            .iter()
            .filter(|(_, q)| match q.front() {
                None => false,
                Some(Op::Wait(e)) => self.event_done(*e),
                Some(_) => true,
            })
            .map(|(&s, _)| s)
            .collect();
        v.sort_unstable();
        v
    }
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    opts: EmulatedOptions,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        consort_comm::lock(&self.state)
    }
}

/// A device in host memory, for tests of stream ordering. See the
/// [module docs](self).
pub struct EmulatedDevice {
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for EmulatedDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedDevice")
            .field("ordinal", &self.shared.opts.ordinal)
            .field("seed", &self.shared.opts.seed)
            .finish()
    }
}

fn invalid(reason: String) -> CommError {
    CommError::invalid(format!("emulated device: {reason}"))
}

impl EmulatedDevice {
    /// A device with its own worker thread.
    pub fn new(opts: EmulatedOptions) -> Arc<Self> {
        let mut streams = HashMap::new();
        streams.insert(0, VecDeque::new());
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                allocs: HashMap::new(),
                next_alloc: 0,
                held: 0,
                peak: 0,
                streams,
                next_stream: 1,
                busy: None,
                events: HashMap::new(),
                next_event: 1,
                error: None,
                stop: false,
                rng: Rng::new(opts.seed),
            }),
            cv: Condvar::new(),
            opts,
        });
        let s = shared.clone();
        let worker = std::thread::Builder::new()
            .name("consort-emulated-device".into())
            .spawn(move || work(&s))
            .ok();
        Arc::new(EmulatedDevice {
            shared,
            worker: Mutex::new(worker),
        })
    }

    fn enqueue(&self, stream: StreamId, op: Op) -> Result<()> {
        let mut st = self.shared.lock();
        if let Some(e) = &st.error {
            return Err(invalid(format!("an earlier operation failed: {e}")));
        }
        let Some(q) = st.streams.get_mut(&stream) else {
            return Err(invalid(format!(
                "stream {stream} was not created by this device"
            )));
        };
        q.push_back(op);
        drop(st);
        self.shared.cv.notify_all();
        Ok(())
    }

    /// Makes `stream` wait for `event` (safe here: an emulated event is an
    /// index, and a stale one is ignored).
    pub fn stream_wait(&self, stream: StreamId, event: EventId) -> Result<()> {
        self.enqueue(stream, Op::Wait(event.0))
    }

    /// Forgets `event` (safe here, as for [`EmulatedDevice::stream_wait`]).
    pub fn release_event(&self, event: EventId) {
        let mut st = self.shared.lock();
        match st.events.get_mut(&event.0) {
            Some(s) if s.done => {
                st.events.remove(&event.0);
            }
            Some(s) => s.released = true,
            None => {}
        }
    }

    /// An event that completes only when [`EmulatedDevice::complete_event`]
    /// is called: how an emulated collective gates a stream on work done
    /// outside the device.
    pub fn pending_event(&self) -> EventId {
        let mut st = self.shared.lock();
        let e = st.next_event;
        st.next_event += 1;
        st.events.insert(e, EventState::default());
        EventId(e)
    }

    /// Completes an event from [`EmulatedDevice::pending_event`].
    pub fn complete_event(&self, event: EventId) {
        self.shared.lock().complete(event.0);
        self.shared.cv.notify_all();
    }

    /// Whether `event` has completed (a query, as `cuEventQuery`).
    pub fn event_done(&self, event: EventId) -> bool {
        self.shared.lock().event_done(event.0)
    }

    /// Blocks until `event` completes, or `timeout` passes (then `false`).
    pub fn wait_event(&self, event: EventId, timeout: Duration) -> bool {
        let deadline = consort_comm::time::deadline(timeout);
        let mut st = self.shared.lock();
        while !st.event_done(event.0) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = match self.shared.cv.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// Reads device memory now, in no stream's order (the caller has made
    /// sure, through an event, that the writers are done).
    pub fn read_now(&self, ptr: u64, n: usize) -> Result<Vec<u8>> {
        self.shared.lock().read(ptr, n).map_err(invalid)
    }

    /// Writes device memory now, in no stream's order.
    pub fn write_now(&self, ptr: u64, data: &[u8]) -> Result<()> {
        self.shared.lock().write(ptr, data).map_err(invalid)
    }

    /// Bytes allocated and not yet freed (what a memory test compares).
    pub fn allocated_bytes(&self) -> usize {
        self.shared.lock().held
    }

    /// The most bytes held at once since the device was made or
    /// [`EmulatedDevice::reset_peak`] (torch's `max_memory_allocated`). A
    /// free counts when it runs in its stream's order, as on CUDA's
    /// stream-ordered pool.
    pub fn peak_allocated_bytes(&self) -> usize {
        self.shared.lock().peak
    }

    /// Starts the peak again from the bytes held once every stream's work
    /// queued so far has run (frees included; waiting at most the
    /// device's sync timeout), as a peak read across a synchronized device.
    pub fn reset_peak(&self) {
        let deadline = Instant::now() + self.shared.opts.sync_timeout;
        loop {
            let mut st = self.shared.lock();
            let idle = st.busy.is_none() && st.streams.values().all(VecDeque::is_empty);
            if idle || Instant::now() >= deadline {
                st.peak = st.held;
                return;
            }
            drop(st);
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for EmulatedDevice {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.cv.notify_all();
        let worker = consort_comm::lock(&self.worker).take();
        if let Some(w) = worker {
            let _ = w.join();
        }
    }
}

/// The worker: runs one runnable operation at a time, from a stream picked
/// at random, after a random delay. Leaves when told to stop and nothing
/// runnable is left.
fn work(shared: &Shared) {
    let max = shared.opts.max_delay.as_nanos() as u64;
    let mut st = shared.lock();
    loop {
        let ready = st.runnable();
        if ready.is_empty() {
            if st.stop {
                return;
            }
            st = match shared.cv.wait(st) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            continue;
        }
        let pick = ready[(st.rng.next_u64() % ready.len() as u64) as usize];
        let Some(op) = st.streams.get_mut(&pick).and_then(VecDeque::pop_front) else {
            continue;
        };
        if matches!(op, Op::Wait(_)) {
            // The stream may now be empty: tell `synchronize`.
            shared.cv.notify_all();
            continue;
        }
        st.busy = Some(pick);
        let delay = if max == 0 {
            0
        } else {
            st.rng.next_u64() % (max + 1)
        };
        drop(st);
        if delay > 0 {
            std::thread::sleep(Duration::from_nanos(delay));
        }
        st = shared.lock();
        if let Err(e) = st.run(op) {
            st.error.get_or_insert(e);
        }
        st.busy = None;
        shared.cv.notify_all();
    }
}

impl Device for EmulatedDevice {
    fn kind(&self) -> &'static str {
        "emulated"
    }

    fn ordinal(&self) -> i32 {
        self.shared.opts.ordinal
    }

    fn new_stream(&self) -> Result<StreamId> {
        let mut st = self.shared.lock();
        let s = st.next_stream;
        st.next_stream += 1;
        st.streams.insert(s, VecDeque::new());
        Ok(s)
    }

    fn alloc_zeroed(&self, bytes: usize, stream: StreamId) -> Result<u64> {
        if bytes >= 1 << OFFSET_BITS {
            return Err(invalid(format!(
                "{bytes} bytes is more than one emulated allocation holds (1 TiB)"
            )));
        }
        let mut st = self.shared.lock();
        if !st.streams.contains_key(&stream) {
            return Err(invalid(format!(
                "stream {stream} was not created by this device"
            )));
        }
        let a = st.next_alloc;
        st.next_alloc += 1;
        // Allocation is immediate here; the memory is zero either way.
        st.allocs.insert(a, vec![0; bytes]);
        st.held += bytes;
        st.peak = st.peak.max(st.held);
        Ok((a + 1) << OFFSET_BITS)
    }

    unsafe fn free(&self, ptr: u64, stream: StreamId) -> Result<()> {
        let alloc = {
            let st = self.shared.lock();
            let (a, off) = st.range(ptr, 0).map_err(invalid)?;
            if off != 0 {
                return Err(invalid(format!(
                    "free of {ptr:#x}, which is inside an allocation, not its start"
                )));
            }
            a
        };
        self.enqueue(stream, Op::Free { alloc })
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, stream: StreamId) -> Result<()> {
        self.enqueue(stream, Op::Copy { dst, src, n: bytes })
    }

    unsafe fn fill_zero(&self, dst: u64, bytes: usize, stream: StreamId) -> Result<()> {
        self.enqueue(stream, Op::Zero { dst, n: bytes })
    }

    unsafe fn copy_from_host(&self, dst: u64, src: &[u8], stream: StreamId) -> Result<()> {
        self.enqueue(
            stream,
            Op::Write {
                dst,
                data: src.to_vec(),
            },
        )
    }

    unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64, stream: StreamId) -> Result<()> {
        self.synchronize(stream)?;
        let data = self.read_now(src, dst.len())?;
        dst.copy_from_slice(&data);
        Ok(())
    }

    fn record(&self, stream: StreamId) -> Result<EventId> {
        let e = self.pending_event();
        if let Err(err) = self.enqueue(stream, Op::Record(e.0)) {
            self.complete_event(e);
            return Err(err);
        }
        Ok(e)
    }

    // The emulated device's events are indices: a stale one is harmless
    // here, but callers keep the contract that a CUDA device needs.
    unsafe fn wait(&self, stream: StreamId, event: EventId) -> Result<()> {
        self.stream_wait(stream, event)
    }

    unsafe fn query(&self, event: EventId) -> Result<bool> {
        Ok(self.shared.lock().event_done(event.0))
    }

    unsafe fn release(&self, event: EventId) -> Result<()> {
        self.release_event(event);
        Ok(())
    }

    fn synchronize(&self, stream: StreamId) -> Result<()> {
        let timeout = self.shared.opts.sync_timeout;
        let deadline = consort_comm::time::deadline(timeout);
        let mut st = self.shared.lock();
        loop {
            if let Some(e) = &st.error {
                return Err(invalid(format!("an operation failed: {e}")));
            }
            let Some(q) = st.streams.get(&stream) else {
                return Err(invalid(format!(
                    "stream {stream} was not created by this device"
                )));
            };
            if q.is_empty() && st.busy != Some(stream) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let head = match q.front() {
                    Some(Op::Wait(e)) => format!("waits for event {e}, which never completed"),
                    Some(_) => "has runnable work the device worker never ran".to_string(),
                    None => "is running its last operation".to_string(),
                };
                return Err(CommError::aborted(format!(
                    "emulated device: stream {stream} did not drain within {timeout:?}: it \
                         {head} ({} operations queued; a collective that never finished?)",
                    q.len()
                )));
            }
            st = match self.shared.cv.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(seed: u64) -> Arc<EmulatedDevice> {
        EmulatedDevice::new(EmulatedOptions {
            seed,
            max_delay: Duration::from_micros(300),
            ..Default::default()
        })
    }

    /// Stream A writes, stream B copies what A wrote elsewhere. With the
    /// event wait B always sees A's bytes; without it, some seed shows the
    /// stale bytes: the emulator catches a missing wait.
    fn cross_stream(seed: u64, wait: bool) -> Vec<u8> {
        let d = dev(seed);
        let (a, b) = (d.new_stream().unwrap(), d.new_stream().unwrap());
        let x = d.alloc_zeroed(4, a).unwrap();
        let y = d.alloc_zeroed(4, b).unwrap();
        // SAFETY: x and y are live 4-byte allocations of `d`.
        unsafe {
            d.copy_from_host(x + 2, &[9], a).unwrap();
            d.copy_from_host(x, &[1, 2], a).unwrap();
            // The owned event: released when it goes.
            let e = consort_comm::Event::record(&*d, a).unwrap();
            if wait {
                e.wait_on(b).unwrap();
            }
            d.copy(y, x, 4, b).unwrap();
            let mut out = [0u8; 4];
            d.copy_to_host(&mut out, y, b).unwrap();
            assert!(!wait || e.query().unwrap(), "b waited for a, so a has run");
            out.to_vec()
        }
    }

    #[test]
    fn a_waited_event_orders_streams_and_a_missing_wait_shows() {
        for seed in 0..20 {
            assert_eq!(cross_stream(seed, true), vec![1, 2, 9, 0], "seed {seed}");
        }
        let stale = (0..40).filter(|&s| cross_stream(s, false) != vec![1, 2, 9, 0]);
        assert!(
            stale.count() > 0,
            "no seed exposed the missing wait: the emulator does not reorder streams"
        );
    }

    #[test]
    fn bad_addresses_are_errors_and_sticky() {
        let d = dev(1);
        let x = d.alloc_zeroed(8, 0).unwrap();
        assert!(d.read_now(x + 4, 8).is_err());
        assert!(d.read_now(12345, 1).is_err());
        // SAFETY: deliberately out of range: the device must refuse it.
        unsafe { d.copy(x, x + 6, 4, 0).unwrap() };
        let e = d.synchronize(0).unwrap_err().to_string();
        assert!(e.contains("run past the end"), "{e}");
        // SAFETY: x is a live 8-byte allocation; the device refuses the
        // call anyway, because an earlier operation failed.
        let sticky = unsafe { d.fill_zero(x, 1, 0) };
        assert!(sticky.is_err(), "errors are sticky");
        assert!(d.new_stream().is_ok());
        assert!(d.stream_wait(999, EventId(1)).is_err(), "unknown stream");
    }

    #[test]
    fn free_is_stream_ordered_and_memory_is_counted() {
        let d = dev(2);
        let s = d.new_stream().unwrap();
        let x = d.alloc_zeroed(100, s).unwrap();
        assert_eq!(d.allocated_bytes(), 100);
        // SAFETY: x is live and freed once.
        unsafe {
            assert!(d.free(x + 1, s).is_err(), "interior pointer");
            d.free(x, s).unwrap();
        }
        d.synchronize(s).unwrap();
        assert_eq!(d.allocated_bytes(), 0);
    }

    #[test]
    fn a_pending_event_blocks_a_stream_until_completed_and_synchronize_has_a_deadline() {
        let d = EmulatedDevice::new(EmulatedOptions {
            sync_timeout: Duration::from_millis(50),
            ..Default::default()
        });
        let gate = d.pending_event();
        d.stream_wait(0, gate).unwrap();
        let e = d.synchronize(0).unwrap_err().to_string();
        assert!(e.contains("did not drain"), "{e}");
        d.complete_event(gate);
        d.synchronize(0).unwrap();
        assert!(d.wait_event(gate, Duration::from_millis(1)));
    }
}
