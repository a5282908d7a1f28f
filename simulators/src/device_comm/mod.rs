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
//! A call on host buffers is enqueued when it is made too (its input copied
//! then, as NCCL stages it), and its work waits for the answer: works may be
//! awaited in any order, and one dropped unpolled runs to its end. A call
//! made while one made just before it (on another thread) is still being
//! enqueued waits for its turn in `submit`, as on NCCL, at most its
//! timeout; one that times out fails naming that call, and its group fails
//! and its peers are told.
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
    sync::{Arc, Mutex, OnceLock, mpsc},
    thread::JoinHandle,
    time::Duration,
};

use async_trait::async_trait;
use consort_comm::{
    AbortCause, Backend, Buffer, BufferMut, CallOptions, CommError, DeviceBuffer, EventId, GroupId,
    HostSliceMut, Op, Result, Shape, Work,
    device::{Device, StreamId},
    lock,
    ordered::check::{CheckTask, Checker},
    stream::{Call, DriverOptions, reporter},
    validate,
};

use crate::device::EmulatedDevice;

mod gates;
mod job;
mod outcome;

use gates::{Driver, Gates, Tracked};
use job::{Job, Kind, Mem, comm_thread};
use outcome::Slot;

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
    /// A peer lost on the data path is not reported at all: the call stays
    /// unfinished until the communicator is aborted, as an NCCL kernel over
    /// NVLink, PCIe peer-to-peer or shared memory waits on a dead peer
    /// (only NCCL's socket transport reports `ncclRemoteError`). Off: the
    /// loss is reported as that remote error.
    pub silent_loss: bool,
    /// Fault injection: the enqueue of this rank's call with this sequence
    /// number (on its group) fails, as an NCCL enqueue that returns an
    /// error: the call fails, the communicator is aborted, and its peers,
    /// whose part of the call waits on this rank, are told over the
    /// fingerprint check's side channel, as on NCCL.
    pub fail_enqueue_at: Option<u64>,
    /// Fault injection: the enqueue of this rank's call with this sequence
    /// number (on its group; sends and receives all have 0) waits this long
    /// first, on the caller's thread: a call stuck between its make and its
    /// enqueue. A call made meanwhile on another thread waits for its
    /// turn, as on NCCL.
    pub stall_enqueue_at: Option<(u64, Duration)>,
}

impl Default for EmulatedCommOptions {
    fn default() -> Self {
        EmulatedCommOptions {
            seed: 0,
            max_delay: Duration::from_micros(300),
            skip_input_wait: false,
            skip_output_wait: false,
            silent_loss: false,
            fail_enqueue_at: None,
            stall_enqueue_at: None,
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
    /// The stream-ordered driver NCCL runs, on this device's gates.
    driver: Arc<Driver>,
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

fn thread_error(what: &'static str, e: std::io::Error) -> CommError {
    CommError::aborted(AbortCause::Spawn {
        what,
        error: e.to_string(),
    })
}

/// One communicator's driver and its watchdog thread.
fn communicator(
    inner: &dyn Backend,
    device: &Arc<EmulatedDevice>,
    opts: &EmulatedCommOptions,
) -> Result<(Arc<Driver>, JoinHandle<()>)> {
    let driver = Arc::new(Driver::new(
        Gates::new(device.clone()),
        (inner.rank(), inner.world_size()),
        inner.group_id(),
        DriverOptions {
            poll: WATCH_POLL,
            stall_enqueue_at: opts.stall_enqueue_at,
        },
    ));
    let watchdog = driver.spawn_watchdog(format!("consort-emulated-watchdog-{}", inner.rank()))?;
    Ok((driver, watchdog))
}

/// How often the emulated watchdog looks at work in flight.
const WATCH_POLL: Duration = Duration::from_micros(200);

impl EmulatedComm {
    /// Wraps `inner` (a host backend) for buffers on `device`, with its own
    /// communication thread.
    pub fn new(
        inner: Arc<dyn Backend>,
        device: Arc<EmulatedDevice>,
        opts: EmulatedCommOptions,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (driver, watchdog) = communicator(&*inner, &device, &opts)?;
        let (b, d, o) = (inner.clone(), device.clone(), opts.clone());
        let worker = std::thread::Builder::new()
            .name(format!("consort-emulated-comm-{}", inner.rank()))
            .spawn(move || comm_thread(&*b, &d, &o, rx))
            .map_err(|e| thread_error("the emulated communication thread", e))?;
        Ok(EmulatedComm {
            inner,
            device,
            opts,
            jobs: Arc::new(Mutex::new(Some(tx))),
            driver,
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
        self.driver.set_heartbeat(b);
        Ok(())
    }

    /// Keeps this communicator's flight record (its subgroups' too) in
    /// `dir` (`CONSORT_FLIGHT_DIR`), as NCCL does: `rank-K.json`, written
    /// when the communicator aborts and on SIGUSR1, which the launcher's
    /// watchdog sends before it stops a hung job.
    pub fn set_flight_dir(&self, dir: &std::path::Path) {
        let out = consort_comm::flight::FlightOut::new(dir, self.rank(), self.world_size());
        self.driver.set_flight(Arc::new(out));
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
        let bind = Arc::new(OnceLock::new());
        let _ = bind.set(Arc::downgrade(&self.driver));
        let (checker, task) = Checker::new(host, self.default_timeout(), reporter(bind));
        self.start_checker(checker, task)
    }

    fn start_checker(&self, checker: Checker, task: CheckTask) -> Result<()> {
        self.driver.set_checker(checker)?;
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
            .map_err(|e| thread_error("the emulated fingerprint check thread", e))
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

    /// Makes one call and enqueues it, now (so its place on the stream is
    /// fixed when it is made, and its work may be awaited in any order), or,
    /// when a call made just before it on another thread is still being
    /// enqueued, once that one is: NCCL's turns. Device calls are then
    /// done, as far as the host is concerned; host calls are answered when
    /// they are.
    fn call<'a>(
        &'a self,
        kind: Kind,
        shape: Shape,
        opts: &CallOptions,
        input: Option<Buffer<'a>>,
        output: Option<BufferMut<'a>>,
    ) -> Result<Work<'a>> {
        let args = self.args(input, output)?;
        let peer = match kind {
            Kind::Send(p) | Kind::Recv(p) => Some(p),
            _ => None,
        };
        // The arguments are sound: the call takes its place now.
        let timeout = opts.timeout_or(self.default_timeout());
        let call = self.driver.make(shape, timeout, peer)?;
        let pending = self.driver.unlaunched(&call);
        if let Err(e) = self.driver.wait_turn(&call) {
            return Err(pending.failed(e));
        }
        let answer = self.launch(&call, kind, opts, args);
        pending.settled();
        Ok(match answer? {
            Some(a) => Work::new(answer_of(a)),
            None => Work::ready(Ok(())),
        })
    }

    /// Enqueues `call` (its turn has come), under the driver's launch
    /// lock: device calls are then done, as far as the host is concerned;
    /// host calls (and calls with no buffer) return the answer to wait for
    /// and where it goes.
    fn launch<'a>(
        &self,
        call: &Call,
        kind: Kind,
        opts: &CallOptions,
        args: Args<'a>,
    ) -> Result<Option<Answer<'a>>> {
        let Args {
            input,
            output,
            host_out,
            streams,
            device_call,
        } = args;
        // A host call (or one with no buffer) is answered when it is done,
        // and may be cancelled with a cause until then.
        let answered = !device_call;
        let (reply, answer) = channel_if(answered);
        let (cancel, cancelled) = channel_if(answered);
        self.driver.launch(call, |l| {
            let gate = self.device.pending_event();
            let after = match self
                .injected_failure(call)
                .map_or_else(|| self.order_streams(&streams, gate, device_call), Err)
            {
                Ok(a) => a,
                Err(e) => {
                    self.release_gate(gate, &[]);
                    return Err(e);
                }
            };
            let slot = Arc::new(Mutex::new(Slot::default()));
            let job = Job {
                kind,
                opts: *opts,
                input,
                output,
                after,
                deadline: l.deadline,
                gate,
                slot: slot.clone(),
                cancelled,
                comm: self.driver.clone(),
                group: self.group.clone(),
            };
            self.send(job)?;
            Ok(Tracked { gate, reply, slot })
        })?;
        Ok(answer.map(|a| (a, host_out, cancel)))
    }

    /// The enqueue failure [`EmulatedCommOptions::fail_enqueue_at`] injects
    /// for `made`, if it is that call.
    fn injected_failure(&self, call: &Call) -> Option<CommError> {
        (self.opts.fail_enqueue_at == Some(call.made.fp.seq)).then(|| CommError::Backend {
            ctx: call.made.ctx,
            backend: "NCCL (emulated)",
            code: 3,
            detail: "ncclInternalError (the enqueue failed: EmulatedCommOptions::fail_enqueue_at)"
                .into(),
        })
    }

    /// Hands a job to the communication thread (its turn has come and its
    /// group has not failed: the driver checked, under the launch lock).
    fn send(&self, job: Job) -> Result<()> {
        let refused = match &*lock(&self.jobs) {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        match refused {
            None => Ok(()),
            Some(job) => {
                self.release_gate(job.gate, &job.after);
                Err(CommError::aborted(AbortCause::Stopped(
                    "the emulated communication thread",
                )))
            }
        }
    }

    /// A call that never reached the communication thread: its gate fires
    /// (no stream told to wait on it waits for ever) and goes, with the
    /// events it would have waited for.
    fn release_gate(&self, gate: EventId, after: &[EventId]) {
        for &ev in after {
            self.device.release_event(ev);
        }
        self.device.complete_event(gate);
        self.device.release_event(gate);
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
            device_call: device,
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
    /// A call on device buffers (done, as far as the host is concerned,
    /// once enqueued).
    device_call: bool,
}

/// A one-shot channel, when `wanted`: a host call's result to come, or the
/// cause its caller gives the communication thread when the call failed
/// first.
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

/// Waits for a host call's result. Dropping this future leaves the call to
/// run to its end on the communication thread, as an enqueued NCCL call
/// does; a call that fails first (the fingerprint check's verdict, an
/// abort) cancels it there with that error as the cause.
async fn answer_of((answer, host_out, cancel): Answer<'_>) -> Result<()> {
    let out = answer.await.unwrap_or_else(|_| {
        Err(CommError::aborted(AbortCause::Stopped(
            "the emulated watchdog",
        )))
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
        if let Some(c) = self.driver.checker() {
            c.wait_drained();
        }
        if let Some(w) = lock(&self.worker).take() {
            lock(&self.jobs).take();
            let _ = w.join();
        }
        let w = lock(&self.watchdog).take();
        self.driver.stop(w);
    }
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
        let shape = op.shape(o.root);
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
        self.call(kind, shape, &o, input, output)
            .unwrap_or_else(|e| Work::ready(Err(e)))
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        // A subgroup's calls run on this rank's one communication thread,
        // in the order they are made (one stream per rank); its rules and
        // its watchdog are its own, as an NCCL subgroup's communicator's.
        let check = match self.driver.checker() {
            Some(c) => {
                let bind = Arc::new(OnceLock::new());
                let made = c.new_group(ranks, reporter(bind.clone())).await?;
                made.map(|m| (m, bind))
            }
            None => None,
        };
        let Some(inner) = self.inner.new_group(ranks, opts).await? else {
            return Ok(None);
        };
        let jobs = self.jobs.clone();
        let (driver, watchdog) = communicator(&*inner, &self.device, &self.opts)?;
        let sub = EmulatedComm {
            inner: inner.clone(),
            device: self.device.clone(),
            opts: self.opts.clone(),
            jobs,
            driver,
            worker: Mutex::new(None),
            watchdog: Mutex::new(Some(watchdog)),
            group: Some(inner),
        };
        if let Some(out) = self.driver.flight() {
            sub.driver.set_flight(out.clone());
        }
        if let Some(((checker, task), bind)) = check {
            let _ = bind.set(Arc::downgrade(&sub.driver));
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

    /// The ranks the fingerprint check's side channel has seen go, as on
    /// NCCL (whose data path names none): none without a check.
    fn lost_peers(&self) -> Vec<(usize, String)> {
        self.driver.lost_peers()
    }

    async fn synchronize(&self) -> Result<()> {
        self.driver.synchronize(self.default_timeout()).await
    }
}

#[cfg(test)]
mod tests {
    use super::{EmulatedComm, gates::Gates};

    /// The emulated device has no shell of its own: its communicator is
    /// the stream-ordered driver NCCL runs (`consort_comm::stream::Driver`),
    /// over the gates' `DeviceComm`. A copy of the shell here would not
    /// compile against this.
    #[test]
    fn the_emulated_device_runs_the_driver_nccl_runs() {
        fn driver(c: &EmulatedComm) -> &consort_comm::stream::Driver<Gates> {
            &c.driver
        }
        let _ = driver;
    }
}
