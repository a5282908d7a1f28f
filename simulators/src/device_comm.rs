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
//! The communication thread waits for the event, sleeps a seeded random
//! delay, runs the collective through the wrapped host backend (a
//! [`crate::SimRank`], usually) on a snapshot of device memory, writes the
//! result back and opens the gate. A failure poisons the group: the next
//! call and [`Backend::synchronize`] report it.
//!
//! [`EmulatedCommOptions::skip_input_wait`] and
//! [`EmulatedCommOptions::skip_output_wait`] remove one of the two waits, so
//! that tests can show their checks catch a missing wait.
//!
//! It owns no algorithm and no call rules: the wrapped backend has both.

use std::{
    sync::{Arc, Mutex, MutexGuard, mpsc},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use consort_comm::{
    Backend, Buffer, BufferMut, CallOptions, CommError, DType, DeviceBuffer, EventId, GroupId,
    HostSlice, HostSliceMut, Op, ReduceOp, Result, Work,
    device::{Device, StreamId},
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
    /// Opened when the collective is done.
    gate: Option<EventId>,
    reply: Option<Reply>,
    /// The host backend of a subgroup's call (`None`: the thread's own).
    group: Option<Arc<dyn Backend>>,
}

#[derive(Default)]
struct State {
    poisoned: Option<CommError>,
    pending: usize,
}

struct Shared {
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A [`Backend`] on [`EmulatedDevice`] buffers that returns before the
/// device has done the work, as NCCL does. See the [module docs](self).
pub struct EmulatedComm {
    inner: Arc<dyn Backend>,
    device: Arc<EmulatedDevice>,
    opts: EmulatedCommOptions,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
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

impl EmulatedComm {
    /// Wraps `inner` (a host backend) for buffers on `device`, with its own
    /// communication thread.
    pub fn new(
        inner: Arc<dyn Backend>,
        device: Arc<EmulatedDevice>,
        opts: EmulatedCommOptions,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
        });
        let (b, d, s, o) = (inner.clone(), device.clone(), shared.clone(), opts.clone());
        let worker = std::thread::Builder::new()
            .name(format!("consort-emulated-comm-{}", inner.rank()))
            .spawn(move || comm_thread(&*b, &d, &s, &o, rx))
            .map_err(|e| CommError::Aborted {
                ctx: Default::default(),
                cause: format!("could not start the emulated communication thread: {e}"),
            })?;
        Ok(EmulatedComm {
            inner,
            device,
            opts,
            jobs: Mutex::new(Some(tx)),
            shared,
            worker: Mutex::new(Some(worker)),
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

    /// Enqueues one call, now (so its place in the order is fixed when it
    /// is made). Device calls are then done, as far as the host is
    /// concerned; host calls return the answer to wait for and where it
    /// goes.
    fn launch<'a>(
        &self,
        kind: Kind,
        opts: &CallOptions,
        input: Option<Buffer<'a>>,
        output: Option<BufferMut<'a>>,
    ) -> Result<Option<Answer<'a>>> {
        if let Some(e) = &self.shared.lock().poisoned {
            return Err(e.to_aborted());
        }
        let device_call = matches!(input, Some(Buffer::Device(_)))
            || matches!(output, Some(BufferMut::Device(_)));
        let host_call =
            matches!(input, Some(Buffer::Host(_))) || matches!(output, Some(BufferMut::Host(_)));
        if device_call && host_call {
            return Err(CommError::unsupported(
                "one call mixed host and device buffers; pass every buffer of a call on the \
                 device, or every one on the host",
            ));
        }
        let mut streams: Vec<StreamId> = Vec::new();
        let mut host_out = None;
        let input = match input {
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
        };
        let output = match output {
            Some(BufferMut::Device(d)) => {
                streams.push(d.stream());
                Some(self.device_arg(&d)?)
            }
            Some(BufferMut::Host(h)) => {
                let mut m = Mem::new(h.dtype(), h.bytes().len(), None);
                m.bytes_mut().copy_from_slice(h.bytes());
                host_out = Some(h);
                Some(m)
            }
            None => None,
        };
        streams.sort_unstable();
        streams.dedup();
        let mut after = Vec::new();
        if !self.opts.skip_input_wait {
            for &s in &streams {
                after.push(self.device.record(s)?);
            }
        }
        let gate = if device_call {
            let g = self.device.pending_event();
            if !self.opts.skip_output_wait {
                for &s in &streams {
                    self.device.wait(s, g)?;
                }
            }
            Some(g)
        } else {
            None
        };
        let (reply, answer) = if device_call {
            (None, None)
        } else {
            let (tx, rx) = tokio::sync::oneshot::channel();
            (Some(tx), Some(rx))
        };
        let job = Job {
            kind,
            opts: *opts,
            input,
            output,
            after,
            gate,
            reply,
            group: self.group.clone(),
        };
        self.shared.lock().pending += 1;
        let sent = match &*self.jobs.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        };
        if !sent {
            self.shared.lock().pending -= 1;
            if let Some(g) = gate {
                self.device.complete_event(g);
            }
            return Err(CommError::Aborted {
                ctx: Default::default(),
                cause: "the emulated communication thread has stopped".into(),
            });
        }
        Ok(answer.map(|a| (a, host_out)))
    }
}

/// A host call's result to come, and the host buffer it goes to.
type Answer<'a> = (
    tokio::sync::oneshot::Receiver<Result<Option<Vec<u8>>>>,
    Option<HostSliceMut<'a>>,
);

/// Waits for a host call's result. Dropping this future before the answer
/// cancels the call on the communication thread, which aborts the group.
async fn answer((answer, host_out): Answer<'_>) -> Result<()> {
    let out = answer.await.map_err(|_| CommError::Aborted {
        ctx: Default::default(),
        cause: "the emulated communication thread stopped during the call".into(),
    })??;
    if let (Some(h), Some(bytes)) = (host_out, out) {
        h.into_bytes_mut().copy_from_slice(&bytes);
    }
    Ok(())
}

impl Drop for EmulatedComm {
    fn drop(&mut self) {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        let worker = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = worker {
            let _ = w.join();
        }
    }
}

/// This rank's communication thread: one call at a time, in issue order.
fn comm_thread(
    inner: &dyn Backend,
    device: &EmulatedDevice,
    shared: &Shared,
    opts: &EmulatedCommOptions,
    jobs: mpsc::Receiver<Job>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread().build() {
        Ok(rt) => rt,
        Err(e) => {
            shared.lock().poisoned = Some(CommError::Aborted {
                ctx: Default::default(),
                cause: format!("could not start the emulated communication runtime: {e}"),
            });
            return;
        }
    };
    let mut rng = Rng::new(opts.seed ^ (inner.rank() as u64).wrapping_mul(0x9E37));
    let max = opts.max_delay.as_nanos() as u64;
    while let Ok(mut job) = jobs.recv() {
        let timeout = job.opts.timeout_or(inner.default_timeout());
        let poisoned = shared.lock().poisoned.clone();
        let result = match poisoned {
            Some(e) => Err(e.to_aborted()),
            None => {
                let waited = job.after.iter().all(|&e| device.wait_event(e, timeout));
                if max > 0 {
                    std::thread::sleep(Duration::from_nanos(rng.next_u64() % (max + 1)));
                }
                if waited {
                    rt.block_on(run_or_cancel(inner, device, &mut job))
                } else {
                    Err(CommError::Timeout {
                        ctx: Default::default(),
                        after: timeout,
                        waiting_on: Vec::new(),
                    })
                }
            }
        };
        // An argument error fails this call only (it is the caller's to
        // fix and retry), as on every backend; anything else poisons.
        if let Err(e) = &result
            && !matches!(
                e,
                CommError::InvalidArgument { .. } | CommError::Unsupported { .. }
            )
        {
            let mut st = shared.lock();
            st.poisoned.get_or_insert_with(|| e.clone());
        }
        for &e in &job.after {
            let _ = device.release(e);
        }
        if let Some(g) = job.gate {
            device.complete_event(g);
            let _ = device.release(g);
        }
        if let Some(reply) = job.reply.take() {
            let out = result.map(|()| job.output.as_ref().map(|m| m.bytes().to_vec()));
            let _ = reply.send(out);
        }
        shared.lock().pending -= 1;
    }
}

/// Runs a job; a host job whose caller dropped its work is cancelled (the
/// host backend's call is dropped, which aborts its group).
async fn run_or_cancel(inner: &dyn Backend, device: &EmulatedDevice, job: &mut Job) -> Result<()> {
    let group = job.group.clone();
    let inner = group.as_deref().unwrap_or(inner);
    let Some(mut reply) = job.reply.take() else {
        return run_job(inner, device, job).await;
    };
    // `biased`: the call is made (its first poll) before the cancellation
    // is seen, so a dropped call still reaches the host backend and aborts
    // its group there, telling the peers, instead of never being made.
    let out = tokio::select! {
        biased;
        r = run_job(inner, device, job) => r,
        () = reply.closed() => Err(CommError::Aborted {
            ctx: Default::default(),
            cause: "a call was cancelled: its work was dropped before it finished. Peers may \
                    be part-way through it, so the group cannot continue"
                .into(),
        }),
    };
    job.reply = Some(reply);
    out
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
        if matches!(kind, Kind::Broadcast | Kind::Reduce(_))
            && let Err(e) = consort_comm::validate::root(o.root, self.world_size())
        {
            return Work::ready(Err(e));
        }
        match self.launch(kind, &o, input, output) {
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
        // in the order they are made (one stream per rank).
        let Some(inner) = self.inner.new_group(ranks, opts).await? else {
            return Ok(None);
        };
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Ok(Some(Arc::new(EmulatedComm {
            inner: inner.clone(),
            device: self.device.clone(),
            opts: self.opts.clone(),
            jobs: Mutex::new(jobs),
            shared: self.shared.clone(),
            worker: Mutex::new(None),
            group: Some(inner),
        })))
    }

    async fn synchronize(&self) -> Result<()> {
        let timeout = self.default_timeout();
        let start = Instant::now();
        loop {
            {
                let st = self.shared.lock();
                if let Some(e) = &st.poisoned {
                    return Err(e.to_aborted());
                }
                if st.pending == 0 {
                    return Ok(());
                }
            }
            if start.elapsed() >= timeout {
                return Err(CommError::Timeout {
                    ctx: Default::default(),
                    after: timeout,
                    waiting_on: Vec::new(),
                });
            }
            futures_timer::Delay::new(Duration::from_micros(200)).await;
        }
    }
}
