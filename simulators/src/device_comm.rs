//! [`EmulatedComm`]: collectives on [`EmulatedDevice`] buffers, stream-ordered
//! as torch's NCCL backend orders them.
//!
//! This module owns the emulated counterpart of NCCL's stream semantics, so
//! that device-resident code (DDP's device buckets) is tested without a
//! GPU. A call on device buffers:
//!
//! 1. records an event on the buffer's stream (the collective's input is
//!    whatever that stream has produced so far);
//! 2. makes the buffer's stream wait on a gate that opens when the
//!    collective is done;
//! 3. hands the call to this rank's communication thread, in issue order,
//!    and returns at once.
//!
//! The communication thread plays the GPU: it waits for the event, sleeps
//! a seeded random delay, runs the collective through the wrapped host
//! backend (a [`crate::SimRank`], usually) on a snapshot of device memory,
//! writes the result back and opens the gate. A failure there is the
//! communicator's asynchronous error, as `ncclCommGetAsyncError` reports
//! one.
//!
//! The call rules are NCCL's own, not a copy: the same
//! [`consort_comm::ordered`] module fixes each call's sequence number and
//! fingerprint when it is made, tracks work in flight, and a watchdog
//! thread per communicator drives its deadlines and completions (on the
//! gates, as NCCL's does on CUDA events) and makes failures sticky; the
//! next call and [`Backend::synchronize`] report them. The fingerprint
//! check runs over a host side channel as on NCCL
//! ([`EmulatedComm::check_fingerprints`]).
//!
//! [`EmulatedCommOptions::skip_input_wait`] and
//! [`EmulatedCommOptions::skip_output_wait`] remove one of the two waits, so
//! that tests can show their checks catch a missing wait.
//!
//! It owns no algorithm (the wrapped backend runs them) and no call rule.

use std::{
    sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, mpsc},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use consort_comm::{
    Backend, Buffer, BufferMut, CallOptions, CommError, DType, DeviceBuffer, EventId, Fingerprint,
    GroupId, HostSlice, HostSliceMut, Op, OpKind, ReduceOp, Result, Work,
    device::{Device, StreamId},
    ordered::{
        Ordered,
        check::{CheckTask, Checker, Report},
    },
    validate,
};

use consort_comm::fault::Rng;

use crate::device::EmulatedDevice;

/// How an [`EmulatedComm`] behaves.
#[derive(Clone, Debug)]
pub struct EmulatedCommOptions {
    /// Seeds the delay before each collective.
    pub seed: u64,
    /// Each collective starts after a delay drawn from `0..=max_delay`.
    pub max_delay: Duration,
    /// Fault injection: the collective does not wait for the buffer's
    /// stream (it may read gradients that are not written yet).
    pub skip_input_wait: bool,
    /// Fault injection: the buffer's stream does not wait for the
    /// collective (later work may read the buffer before the result lands).
    pub skip_output_wait: bool,
}

impl Default for EmulatedCommOptions {
    fn default() -> Self {
        EmulatedCommOptions {
            seed: 0,
            max_delay: Duration::from_micros(300),
            skip_input_wait: false,
            skip_output_wait: false,
        }
    }
}

#[derive(Clone, Debug)]
enum Kind {
    AllReduce(ReduceOp),
    Broadcast,
    Reduce(ReduceOp),
    AllGather,
    Gather,
    Scatter,
    ReduceScatter(ReduceOp),
    AllToAll {
        output_splits: Option<Vec<usize>>,
        input_splits: Option<Vec<usize>>,
    },
    Barrier,
    Send(usize),
    Recv(usize),
}

/// One buffer argument, as the communication thread holds it: aligned
/// host storage, filled from the device (device calls) or from the
/// caller's slice (host calls).
struct Mem {
    dtype: DType,
    bytes: usize,
    words: Vec<u64>,
    /// Where it lives on the device; `None` for a host argument.
    ptr: Option<u64>,
}

impl Mem {
    fn new(dtype: DType, bytes: usize, ptr: Option<u64>) -> Self {
        Mem {
            dtype,
            bytes,
            words: vec![0; bytes.div_ceil(8)],
            ptr,
        }
    }

    fn bytes(&self) -> &[u8] {
        &consort_comm::dtype::as_bytes(&self.words)[..self.bytes]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut consort_comm::dtype::as_bytes_mut(&mut self.words)[..self.bytes]
    }

    fn view(&self) -> Result<Buffer<'_>> {
        Ok(Buffer::Host(HostSlice::from_bytes(
            self.dtype,
            self.bytes(),
        )?))
    }

    fn view_mut(&mut self) -> Result<BufferMut<'_>> {
        let dtype = self.dtype;
        Ok(BufferMut::Host(HostSliceMut::from_bytes(
            dtype,
            self.bytes_mut(),
        )?))
    }
}

/// What a host call gets back: its output bytes.
type Reply = tokio::sync::oneshot::Sender<Result<Option<Vec<u8>>>>;

struct Job {
    kind: Kind,
    opts: CallOptions,
    input: Option<Mem>,
    output: Option<Mem>,
    /// Events on the buffers' streams that the collective waits for.
    after: Vec<EventId>,
    /// Opened when the collective is done (its completion event).
    gate: EventId,
    /// What the call came to, for the watchdog.
    slot: Arc<Mutex<Slot>>,
    /// Closed when a host call's work is dropped before it finished.
    cancelled: Option<tokio::sync::oneshot::Receiver<CommError>>,
    /// The communicator the call belongs to (its rules and its errors).
    comm: Arc<Shared>,
    /// The host backend of a subgroup's call (`None`: the thread's own).
    group: Option<Arc<dyn Backend>>,
}

/// What one call came to on the communication thread: its error (the
/// emulated GPU's asynchronous error, for this call), or a host call's
/// output bytes.
#[derive(Default)]
struct Slot {
    err: Option<CommError>,
    out: Option<Vec<u8>>,
}

/// The driver's handle on one enqueued call.
struct Tracked {
    gate: EventId,
    reply: Option<Reply>,
    slot: Arc<Mutex<Slot>>,
}

/// One communicator's call rules and its asynchronous error.
struct State {
    core: Ordered<Tracked>,
    /// What the communication thread found (`ncclCommGetAsyncError`).
    async_error: Option<CommError>,
    /// Aborted: the communication thread skips its calls.
    aborted: bool,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    device: Arc<EmulatedDevice>,
    checker: OnceLock<Checker>,
    /// The launcher's heartbeat, as NCCL keeps it.
    beat: OnceLock<Arc<consort_comm::heartbeat::Heartbeat>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn finish(&self, w: Tracked, r: Result<()>) {
        self.device.release_event(w.gate);
        if let Some(reply) = w.reply {
            let out = r.map(|()| lock(&w.slot).out.take());
            let _ = reply.send(out);
        }
        self.ended();
    }

    /// The heartbeat: a call was made.
    fn made(&self, fp: &Fingerprint) {
        if let Some(b) = self.beat.get() {
            b.made(fp, consort_comm::heartbeat::now_us());
        }
    }

    /// The heartbeat: a call ended (done or failed).
    fn ended(&self) {
        if let Some(b) = self.beat.get() {
            b.ended(consort_comm::heartbeat::now_us());
        }
    }

    /// Fails the calls in flight and aborts (the emulated `ncclCommAbort`).
    fn abort(&self, finished: Vec<(Tracked, Result<()>)>) {
        self.lock().aborted = true;
        for (w, r) in finished {
            self.finish(w, r);
        }
        self.cv.notify_all();
    }

    /// The fingerprint check found a mismatch.
    fn mismatch(&self, e: CommError) {
        let failed = self.lock().core.mismatch(e);
        self.abort(failed);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The watchdog of one communicator: [`Ordered::watch`] on the gates.
fn watchdog(shared: &Shared) {
    loop {
        let mut st = shared.lock();
        let seen = st.core.watch(
            Instant::now(),
            |w| match &lock(&w.slot).err {
                Some(e) => Err(e.clone()),
                None => Ok(shared.device.event_done(w.gate)),
            },
            |_| None,
        );
        if st.stop && st.core.in_flight() == 0 && seen.finished.is_empty() {
            return;
        }
        let idle = seen.finished.is_empty() && !seen.abort;
        if idle {
            let wait = st
                .core
                .poll_timeout()
                .map_or(Duration::from_millis(50), |d| {
                    d.saturating_duration_since(Instant::now())
                        .min(Duration::from_micros(200))
                });
            let _ = shared.cv.wait_timeout(st, wait);
            continue;
        }
        drop(st);
        if seen.abort {
            shared.abort(seen.finished);
        } else {
            for (w, r) in seen.finished {
                shared.finish(w, r);
            }
        }
    }
}

/// A [`Backend`] on [`EmulatedDevice`] buffers that returns before the
/// device has done the work, as NCCL does. See the [module docs](self).
pub struct EmulatedComm {
    inner: Arc<dyn Backend>,
    device: Arc<EmulatedDevice>,
    opts: EmulatedCommOptions,
    /// The way to the rank's communication thread: one slot, which the
    /// parent's subgroups share, so that dropping the parent closes it
    /// (its thread ends) even while a subgroup lives on (in a task that
    /// only the runtime the parent is dropped on would drop); a subgroup's
    /// later calls then fail.
    jobs: Arc<Mutex<Option<mpsc::Sender<Job>>>>,
    shared: Arc<Shared>,
    /// The communication thread (the parent's; a subgroup has none).
    worker: Mutex<Option<JoinHandle<()>>>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    /// For a subgroup: its host backend, whose calls the parent's thread
    /// makes (one stream per rank, so calls on every group keep the order
    /// they were made in).
    group: Option<Arc<dyn Backend>>,
}

impl std::fmt::Debug for EmulatedComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedComm")
            .field("rank", &self.inner.rank())
            .field("world", &self.inner.world_size())
            .field("device", &self.device)
            .finish()
    }
}

fn thread_error(what: &str, e: std::io::Error) -> CommError {
    CommError::Aborted {
        ctx: Default::default(),
        cause: format!("could not start the emulated {what} thread: {e}"),
    }
}

/// One communicator's rules and its watchdog thread.
fn communicator(
    inner: &dyn Backend,
    device: &Arc<EmulatedDevice>,
) -> Result<(Arc<Shared>, JoinHandle<()>)> {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            core: Ordered::new(inner.rank(), inner.world_size(), inner.group_id()),
            async_error: None,
            aborted: false,
            stop: false,
        }),
        cv: Condvar::new(),
        device: device.clone(),
        checker: OnceLock::new(),
        beat: OnceLock::new(),
    });
    let s = shared.clone();
    let watchdog = std::thread::Builder::new()
        .name(format!("consort-emulated-watchdog-{}", inner.rank()))
        .spawn(move || watchdog(&s))
        .map_err(|e| thread_error("watchdog", e))?;
    Ok((shared, watchdog))
}

impl EmulatedComm {
    /// Wraps `inner` (a host backend) for buffers on `device`, with its own
    /// communication thread.
    pub fn new(
        inner: Arc<dyn Backend>,
        device: Arc<EmulatedDevice>,
        opts: EmulatedCommOptions,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (shared, watchdog) = communicator(&*inner, &device)?;
        let (b, d, o) = (inner.clone(), device.clone(), opts.clone());
        let worker = std::thread::Builder::new()
            .name(format!("consort-emulated-comm-{}", inner.rank()))
            .spawn(move || comm_thread(&*b, &d, &o, rx))
            .map_err(|e| thread_error("communication", e))?;
        Ok(EmulatedComm {
            inner,
            device,
            opts,
            jobs: Arc::new(Mutex::new(Some(tx))),
            shared,
            worker: Mutex::new(Some(worker)),
            watchdog: Mutex::new(Some(watchdog)),
            group: None,
        })
    }

    /// The device whose buffers this backend takes.
    pub fn device(&self) -> &Arc<EmulatedDevice> {
        &self.device
    }

    /// The wrapped host backend.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    /// Shows this communicator's calls in the launcher's heartbeat file at
    /// `path` (`CONSORT_HEARTBEAT_FILE`), as NCCL does: each call made and
    /// ended, so a stalled or stopped rank is seen by the watchdog.
    pub fn set_heartbeat(&self, path: &std::path::Path) -> Result<()> {
        let b = consort_comm::heartbeat::Heartbeat::shared(path).map_err(|e| {
            CommError::invalid(format!(
                "cannot map the heartbeat file {}: {e}",
                path.display()
            ))
        })?;
        let _ = self.shared.beat.set(b);
        Ok(())
    }

    /// Turns on the mismatch check, as
    /// `consort_nccl::NcclBackend::check_fingerprints` does on NCCL: every
    /// collective's fingerprint is compared with the peers' over `host`, a
    /// host backend of the same ranks, numbered alike, that nothing else
    /// uses, on a thread of its own. A mismatch fails the calls in flight
    /// with `Mismatch` on every rank and aborts the communicator.
    pub fn check_fingerprints(&self, host: Arc<dyn Backend>) -> Result<()> {
        if host.rank() != self.rank() || host.world_size() != self.world_size() {
            return Err(CommError::invalid(
                "the side channel of the fingerprint check must have this group's ranks",
            ));
        }
        let (checker, task) = Checker::new(host, self.default_timeout(), reporter(&self.shared));
        self.start_checker(checker, task)
    }

    fn start_checker(&self, checker: Checker, task: CheckTask) -> Result<()> {
        self.shared
            .checker
            .set(checker)
            .map_err(|_| CommError::invalid("this communicator already checks its fingerprints"))?;
        std::thread::Builder::new()
            .name(format!("consort-emulated-check-{}", self.rank()))
            .spawn(move || {
                // Timers and sockets: the side channel may be a real mesh.
                if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    rt.block_on(task);
                }
            })
            .map(drop)
            .map_err(|e| thread_error("fingerprint check", e))
    }

    fn device_arg(&self, d: &DeviceBuffer) -> Result<Mem> {
        if d.device() != self.device.ordinal() {
            return Err(CommError::invalid(format!(
                "a buffer on device {} was passed to the backend of emulated device {}; each \
                 rank's buffers must live on its own device",
                d.device(),
                self.device.ordinal()
            )));
        }
        let bytes = d.len().checked_mul(d.dtype().size_bytes()).ok_or_else(|| {
            CommError::invalid(format!("{} elements overflow a byte count", d.len()))
        })?;
        Ok(Mem::new(d.dtype(), bytes, Some(d.ptr())))
    }

    /// One buffer argument as the communication thread holds it, with its
    /// stream (device) or the host slice its result goes to.
    fn arg<'a>(&self, b: Option<Buffer<'a>>, streams: &mut Vec<StreamId>) -> Result<Option<Mem>> {
        Ok(match b {
            Some(Buffer::Device(d)) => {
                streams.push(d.stream());
                Some(self.device_arg(&d)?)
            }
            Some(Buffer::Host(h)) => {
                let mut m = Mem::new(h.dtype(), h.bytes().len(), None);
                m.bytes_mut().copy_from_slice(h.bytes());
                Some(m)
            }
            None => None,
        })
    }

    /// Enqueues one call, now (so its place in the order is fixed when it
    /// is made). Device calls are then done, as far as the host is
    /// concerned; host calls return the answer to wait for and where it
    /// goes.
    fn launch<'a>(
        &self,
        kind: Kind,
        fp: Fingerprint,
        opts: &CallOptions,
        input: Option<Buffer<'a>>,
        output: Option<BufferMut<'a>>,
    ) -> Result<Option<Answer<'a>>> {
        let device_call = matches!(input, Some(Buffer::Device(_)))
            || matches!(output, Some(BufferMut::Device(_)));
        let host_call =
            matches!(input, Some(Buffer::Host(_))) || matches!(output, Some(BufferMut::Host(_)));
        let Args {
            input,
            output,
            host_out,
            streams,
        } = self.args(input, output)?;
        // The arguments are sound: the call takes its place now.
        let made = self
            .shared
            .lock()
            .core
            .make(fp.op, |group, seq| Fingerprint { group, seq, ..fp })?;
        self.shared.made(&made.fp);
        if !matches!(fp.op, OpKind::Send | OpKind::Recv)
            && let Some(c) = self.shared.checker.get()
        {
            c.check(made.fp);
        }
        let gate = self.device.pending_event();
        let ordered = self.order_streams(&streams, gate, device_call);
        let after = match ordered {
            Ok(a) => a,
            Err(e) => return Err(self.launch_failed(gate, made.id, e)),
        };
        // A host call (or one with no buffer) is answered when it is done,
        // and may be cancelled until then.
        let answered = host_call || !device_call;
        let (reply, answer) = channel_if(answered);
        let (cancel, cancelled) = channel_if(answered);
        let slot = Arc::new(Mutex::new(Slot::default()));
        let job = Job {
            kind,
            opts: *opts,
            input,
            output,
            after,
            gate,
            slot: slot.clone(),
            cancelled,
            comm: self.shared.clone(),
            group: self.group.clone(),
        };
        self.shared.lock().core.launchable(made.id)?;
        let sent = match &*lock(&self.jobs) {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        };
        if !sent {
            let e = CommError::Aborted {
                ctx: Default::default(),
                cause: "the emulated communication thread has stopped".into(),
            };
            return Err(self.launch_failed(gate, made.id, e));
        }
        // The watchdog is the backstop here: the wrapped backend bounds the
        // call itself, from when it starts on the communication thread, and
        // its timeout names the ranks it waited for. A GPU that hangs is
        // still failed, at twice the op's timeout from when it was made.
        let timeout = opts.timeout_or(self.default_timeout()).saturating_mul(2);
        let work = Tracked { gate, reply, slot };
        self.shared
            .lock()
            .core
            .enqueued(made.id, work, Instant::now(), timeout);
        self.shared.cv.notify_all();
        Ok(answer.map(|a| (a, host_out, cancel)))
    }

    /// A call that could not be enqueued: its gate fires and goes, and the
    /// communicator fails the call (and is aborted) as NCCL's would be.
    fn launch_failed(
        &self,
        gate: EventId,
        id: consort_comm::engine::CallId,
        e: CommError,
    ) -> CommError {
        self.device.complete_event(gate);
        self.device.release_event(gate);
        let e = self.shared.lock().core.launch_failed(id, e);
        self.shared.ended();
        e
    }

    /// A call's buffers as the communication thread holds them, with the
    /// streams of its device buffers; host and device buffers mixed in one
    /// call are refused.
    fn args<'a>(
        &self,
        input: Option<Buffer<'a>>,
        output: Option<BufferMut<'a>>,
    ) -> Result<Args<'a>> {
        let device = matches!(input, Some(Buffer::Device(_)))
            || matches!(output, Some(BufferMut::Device(_)));
        let host =
            matches!(input, Some(Buffer::Host(_))) || matches!(output, Some(BufferMut::Host(_)));
        if device && host {
            return Err(CommError::unsupported(
                "one call mixed host and device buffers; pass every buffer of a call on the \
                 device, or every one on the host",
            ));
        }
        let mut streams: Vec<StreamId> = Vec::new();
        let input = self.arg(input, &mut streams)?;
        let (output, host_out) = match output {
            Some(BufferMut::Host(h)) => {
                let mut m = Mem::new(h.dtype(), h.bytes().len(), None);
                m.bytes_mut().copy_from_slice(h.bytes());
                (Some(m), Some(h))
            }
            Some(BufferMut::Device(d)) => (self.arg(Some(Buffer::Device(d)), &mut streams)?, None),
            None => (None, None),
        };
        streams.sort_unstable();
        streams.dedup();
        Ok(Args {
            input,
            output,
            host_out,
            streams,
        })
    }

    /// The events the collective waits for on the buffers' streams, and
    /// (device calls) the streams' waits on its gate.
    fn order_streams(
        &self,
        streams: &[StreamId],
        gate: EventId,
        device_call: bool,
    ) -> Result<Vec<EventId>> {
        let mut after = Vec::new();
        if !self.opts.skip_input_wait {
            for &s in streams {
                after.push(self.device.record(s)?);
            }
        }
        if device_call && !self.opts.skip_output_wait {
            for &s in streams {
                self.device.stream_wait(s, gate)?;
            }
        }
        Ok(after)
    }
}

/// One call's buffers, classified ([`EmulatedComm::args`]).
struct Args<'a> {
    input: Option<Mem>,
    output: Option<Mem>,
    /// A host call's output slice, where its result goes.
    host_out: Option<HostSliceMut<'a>>,
    streams: Vec<StreamId>,
}

fn reporter(shared: &Arc<Shared>) -> Report {
    let weak = Arc::downgrade(shared);
    Arc::new(move |e| {
        if let Some(s) = weak.upgrade() {
            s.mismatch(e);
        }
    })
}

/// A host call's result to come, the host buffer it goes to, and the
/// sender whose drop tells the communication thread the call was dropped.
/// A one-shot channel, when `wanted`.
fn channel_if<T>(
    wanted: bool,
) -> (
    Option<tokio::sync::oneshot::Sender<T>>,
    Option<tokio::sync::oneshot::Receiver<T>>,
) {
    if wanted {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (Some(tx), Some(rx))
    } else {
        (None, None)
    }
}

type Answer<'a> = (
    tokio::sync::oneshot::Receiver<Result<Option<Vec<u8>>>>,
    Option<HostSliceMut<'a>>,
    Option<tokio::sync::oneshot::Sender<CommError>>,
);

/// Waits for a host call's result. Dropping this future before the answer
/// cancels the call on the communication thread, which aborts the group;
/// a call that fails first (the fingerprint check's verdict, an abort)
/// cancels it with that error as the cause.
async fn answer((answer, host_out, cancel): Answer<'_>) -> Result<()> {
    let out = answer.await.unwrap_or_else(|_| {
        Err(CommError::Aborted {
            ctx: Default::default(),
            cause: "the emulated watchdog stopped during the call".into(),
        })
    });
    let out = match (out, cancel) {
        (Ok(out), _) => out,
        (Err(e), cancel) => {
            if let Some(c) = cancel {
                let _ = c.send(e.clone());
            }
            return Err(e);
        }
    };
    if let (Some(h), Some(bytes)) = (host_out, out) {
        h.into_bytes_mut().copy_from_slice(&bytes);
    }
    Ok(())
}

impl Drop for EmulatedComm {
    fn drop(&mut self) {
        // The peers' comparisons of this rank's last calls need this
        // rank's part: leave after them (bounded), as NCCL's backend does.
        if let Some(c) = self.shared.checker.get() {
            c.wait_drained();
        }
        if let Some(w) = lock(&self.worker).take() {
            lock(&self.jobs).take();
            let _ = w.join();
        }
        self.shared.lock().stop = true;
        self.shared.cv.notify_all();
        if let Some(w) = lock(&self.watchdog).take() {
            let _ = w.join();
        }
    }
}

/// This rank's communication thread, the emulated GPU: one call at a time,
/// in issue order. A call that fails sets its communicator's asynchronous
/// error; an aborted communicator's calls are skipped. Every call's gate
/// opens at the end, so no stream waits for ever.
fn comm_thread(
    inner: &dyn Backend,
    device: &EmulatedDevice,
    opts: &EmulatedCommOptions,
    jobs: mpsc::Receiver<Job>,
) {
    // Timers and sockets: the host backend may be a real mesh (TCP), whose
    // calls arm tokio timers in the task that drives them. One worker of
    // its own: what a cancelled host call spawns (its abort, to the peers)
    // goes out at once, not at this thread's next call, which may never
    // come.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(format!("consort-emulated-io-{}", inner.rank()))
        .enable_all()
        .build();
    let mut rng = Rng::new(opts.seed ^ (inner.rank() as u64).wrapping_mul(0x9E37));
    let max = opts.max_delay.as_nanos() as u64;
    while let Ok(mut job) = jobs.recv() {
        let timeout = job.opts.timeout_or(inner.default_timeout());
        let skip = {
            let st = job.comm.lock();
            (st.aborted || st.async_error.is_some()).then(|| {
                st.async_error
                    .clone()
                    .or_else(|| st.core.poisoned().cloned())
            })
        };
        match (skip, &rt) {
            (Some(cause), Ok(rt)) => rt.block_on(tell_peers(inner, device, &mut job, cause)),
            (Some(_), Err(_)) => {}
            (None, rt) => {
                let waited = job.after.iter().all(|&e| device.wait_event(e, timeout));
                if max > 0 {
                    std::thread::sleep(Duration::from_nanos(rng.next_u64() % (max + 1)));
                }
                let result = match (rt, waited) {
                    (Ok(rt), true) => rt.block_on(run_or_cancel(inner, device, &mut job)),
                    (Err(e), _) => Err(CommError::Aborted {
                        ctx: Default::default(),
                        cause: format!("could not start the emulated communication runtime: {e}"),
                    }),
                    (_, false) => Err(CommError::Timeout {
                        ctx: Default::default(),
                        after: timeout,
                        waiting_on: Vec::new(),
                    }),
                };
                settle(&job, result);
            }
        }
        for &e in &job.after {
            device.release_event(e);
        }
        device.complete_event(job.gate);
        job.comm.cv.notify_all();
    }
}

/// What a job that ran came to: its output for the caller, or the
/// communicator's asynchronous error.
fn settle(job: &Job, result: Result<()>) {
    match result {
        Ok(()) => lock(&job.slot).out = job.output.as_ref().map(|m| m.bytes().to_vec()),
        Err(e) => {
            job.comm.lock().async_error.get_or_insert(e.clone());
            lock(&job.slot).err = Some(e);
        }
    }
}

/// A job of an aborted communicator is not run, but its host call is made
/// and at once cancelled with the communicator's cause (when it has one),
/// so that peers already waiting in that call hear why, instead of seeing
/// this rank's connections close when it leaves.
async fn tell_peers(
    inner: &dyn Backend,
    device: &EmulatedDevice,
    job: &mut Job,
    cause: Option<CommError>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    if let Some(cause) = cause {
        let _ = tx.send(cause);
    }
    job.cancelled = Some(rx);
    let _ = run_or_cancel(inner, device, job).await;
}

/// Runs a job; a host job whose caller dropped its work is cancelled (the
/// host backend's call is dropped, which aborts its group), with the
/// caller's cause when it gave one: a verdict of the fingerprint check
/// then reaches the peers as that verdict, not as "cancelled", which a
/// third rank would otherwise report before its own check's verdict.
async fn run_or_cancel(inner: &dyn Backend, device: &EmulatedDevice, job: &mut Job) -> Result<()> {
    let group = job.group.clone();
    let inner = group.as_deref().unwrap_or(inner);
    let Some(mut cancelled) = job.cancelled.take() else {
        return run_job(inner, device, job).await;
    };
    let mut run = Box::pin(run_job(inner, device, job));
    // `biased`: the call is made (its first poll) before the cancellation
    // is seen, so a dropped call still reaches the host backend and aborts
    // its group there, telling the peers, instead of never being made.
    let cause = tokio::select! {
        biased;
        r = &mut run => return r,
        why = &mut cancelled => why.ok(),
    };
    let e = cause.unwrap_or_else(|| CommError::Aborted {
        ctx: Default::default(),
        cause: "a call was cancelled: its work was dropped before it finished. Peers may be \
                part-way through it, so the group cannot continue"
            .into(),
    });
    consort_comm::cancel::drop_because(run, &e);
    Err(e)
}

/// Snapshots the device arguments, runs the collective on the host
/// backend, and writes the output back to the device.
async fn run_job(inner: &dyn Backend, device: &EmulatedDevice, job: &mut Job) -> Result<()> {
    for m in job.input.iter_mut().chain(job.output.iter_mut()) {
        if let Some(p) = m.ptr {
            let data = device.read_now(p, m.bytes)?;
            m.bytes_mut().copy_from_slice(&data);
        }
    }
    let o = &job.opts;
    let input = job.input.as_ref().map(Mem::view).transpose()?;
    let output = job.output.as_mut().map(Mem::view_mut).transpose()?;
    let missing = || CommError::invalid("emulated call without its buffer");
    match job.kind.clone() {
        Kind::AllReduce(op) => inner.all_reduce(output.ok_or_else(missing)?, op, o).await,
        Kind::Broadcast => inner.broadcast(output.ok_or_else(missing)?, o).await,
        Kind::Reduce(op) => inner.reduce(output.ok_or_else(missing)?, op, o).await,
        Kind::AllGather => {
            let (out, inp) = (output.ok_or_else(missing)?, input.ok_or_else(missing)?);
            inner.all_gather(out, inp, o).await
        }
        Kind::Gather => inner.gather(output, input.ok_or_else(missing)?, o).await,
        Kind::Scatter => inner.scatter(output.ok_or_else(missing)?, input, o).await,
        Kind::ReduceScatter(op) => {
            let (out, inp) = (output.ok_or_else(missing)?, input.ok_or_else(missing)?);
            inner.reduce_scatter(out, inp, op, o).await
        }
        Kind::AllToAll {
            output_splits,
            input_splits,
        } => {
            let (out, inp) = (output.ok_or_else(missing)?, input.ok_or_else(missing)?);
            let (os, is) = (output_splits.as_deref(), input_splits.as_deref());
            inner.all_to_all_single(out, inp, os, is, o).await
        }
        Kind::Barrier => inner.barrier(o).await,
        Kind::Send(dst) => inner.send(input.ok_or_else(missing)?, dst, o).await,
        Kind::Recv(src) => inner.recv(output.ok_or_else(missing)?, src, o).await,
    }?;
    if let Some(m) = &job.output
        && let Some(p) = m.ptr
    {
        device.write_now(p, m.bytes())?;
    }
    Ok(())
}

#[async_trait]
impl Backend for EmulatedComm {
    fn name(&self) -> &'static str {
        "emulated-device"
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn group_id(&self) -> GroupId {
        self.inner.group_id()
    }

    fn default_timeout(&self) -> Duration {
        self.inner.default_timeout()
    }

    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        let o = *opts;
        // Every argument check before the call takes its place, as on NCCL.
        if let Err(e) = validate::op(&op, self.rank(), self.world_size(), o.root) {
            return Work::ready(Err(e));
        }
        let fp = op.fingerprint(self.group_id(), 0, o.root);
        let (kind, input, output) = match op {
            Op::AllReduce { buf, op } => (Kind::AllReduce(op), None, Some(buf)),
            Op::Broadcast { buf } => (Kind::Broadcast, None, Some(buf)),
            Op::Reduce { buf, op } => (Kind::Reduce(op), None, Some(buf)),
            Op::AllGather { output, input } => (Kind::AllGather, Some(input), Some(output)),
            Op::Gather { output, input } => (Kind::Gather, Some(input), output),
            Op::Scatter { output, input } => (Kind::Scatter, input, Some(output)),
            Op::ReduceScatter { output, input, op } => {
                (Kind::ReduceScatter(op), Some(input), Some(output))
            }
            Op::AllToAll {
                output,
                input,
                output_splits,
                input_splits,
            } => {
                let kind = Kind::AllToAll {
                    output_splits: output_splits.map(<[usize]>::to_vec),
                    input_splits: input_splits.map(<[usize]>::to_vec),
                };
                (kind, Some(input), Some(output))
            }
            Op::Barrier => (Kind::Barrier, None, None),
            Op::Send { buf, dst } => (Kind::Send(dst), Some(buf), None),
            Op::Recv { buf, src } => (Kind::Recv(src), None, Some(buf)),
        };
        match self.launch(kind, fp, &o, input, output) {
            Ok(Some(a)) => Work::new(answer(a)),
            Ok(None) => Work::ready(Ok(())),
            Err(e) => Work::ready(Err(e)),
        }
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        // A subgroup's calls run on this rank's one communication thread,
        // in the order they are made (one stream per rank); its rules and
        // its watchdog are its own, as an NCCL subgroup's communicator's.
        let check = match self.shared.checker.get() {
            Some(c) => {
                let bind: Arc<OnceLock<std::sync::Weak<Shared>>> = Arc::new(OnceLock::new());
                let b = bind.clone();
                let report: Report = Arc::new(move |e| {
                    if let Some(s) = b.get().and_then(std::sync::Weak::upgrade) {
                        s.mismatch(e);
                    }
                });
                c.new_group(ranks, report).await?.map(|m| (m, bind))
            }
            None => None,
        };
        let Some(inner) = self.inner.new_group(ranks, opts).await? else {
            return Ok(None);
        };
        let jobs = self.jobs.clone();
        let (shared, watchdog) = communicator(&*inner, &self.device)?;
        let sub = EmulatedComm {
            inner: inner.clone(),
            device: self.device.clone(),
            opts: self.opts.clone(),
            jobs,
            shared,
            worker: Mutex::new(None),
            watchdog: Mutex::new(Some(watchdog)),
            group: Some(inner),
        };
        if let Some(((checker, task), bind)) = check {
            let _ = bind.set(Arc::downgrade(&sub.shared));
            sub.start_checker(checker, task)?;
        }
        Ok(Some(Arc::new(sub)))
    }

    /// The wrapped backend's: a simulated rank's clock must move while it
    /// waits outside its calls (DDP's shrink waits on the store so), or it
    /// holds its peers' calls, and the aborts they need, at its time.
    async fn idle(&self, d: Duration) {
        self.inner.idle(d).await;
    }

    async fn synchronize(&self) -> Result<()> {
        let timeout = self.default_timeout();
        let start = Instant::now();
        loop {
            if let Some(r) = self.shared.lock().core.synchronized() {
                return r;
            }
            if start.elapsed() >= timeout {
                return Err(consort_comm::ordered::wait_timeout(self.rank(), timeout));
            }
            futures_timer::Delay::new(Duration::from_micros(200)).await;
        }
    }
}
