//! What the communication thread runs: one call's kind and buffers
//! ([`Job`]), and the thread itself, the emulated GPU ([`comm_thread`]).

use std::{
    sync::{Arc, Mutex, mpsc},
    time::Duration,
};

use consort_comm::{
    AbortCause, Backend, Buffer, BufferMut, CallOptions, CommError, DType, EventId, HostSlice,
    HostSliceMut, ReduceOp, Result, fault::Rng,
};

use consort_comm::lock;

use super::{
    EmulatedCommOptions,
    gates::Driver,
    outcome::{Slot, remote_error},
};
use crate::device::EmulatedDevice;

#[derive(Clone, Debug)]
pub(super) enum Kind {
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
pub(super) struct Mem {
    pub(super) dtype: DType,
    pub(super) bytes: usize,
    pub(super) words: Vec<u64>,
    /// Where it lives on the device; `None` for a host argument.
    pub(super) ptr: Option<u64>,
}

impl Mem {
    pub(super) fn new(dtype: DType, bytes: usize, ptr: Option<u64>) -> Self {
        Mem {
            dtype,
            bytes,
            words: vec![0; bytes.div_ceil(8)],
            ptr,
        }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &consort_comm::dtype::as_bytes(&self.words)[..self.bytes]
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut consort_comm::dtype::as_bytes_mut(&mut self.words)[..self.bytes]
    }

    pub(super) fn view(&self) -> Result<Buffer<'_>> {
        Ok(Buffer::Host(HostSlice::from_bytes(
            self.dtype,
            self.bytes(),
        )?))
    }

    pub(super) fn view_mut(&mut self) -> Result<BufferMut<'_>> {
        let dtype = self.dtype;
        Ok(BufferMut::Host(HostSliceMut::from_bytes(
            dtype,
            self.bytes_mut(),
        )?))
    }
}

pub(super) struct Job {
    pub(super) kind: Kind,
    pub(super) opts: CallOptions,
    pub(super) input: Option<Mem>,
    pub(super) output: Option<Mem>,
    /// Events on the buffers' streams that the collective waits for.
    pub(super) after: Vec<EventId>,
    /// The call's deadline, the driver's (its op timeout from its enqueue).
    pub(super) deadline: std::time::Instant,
    /// Opened when the collective is done (its completion event).
    pub(super) gate: EventId,
    /// What the call came to, for the watchdog.
    pub(super) slot: Arc<Mutex<Slot>>,
    /// A host call's cause, sent when the call failed first (a verdict, an
    /// abort): the job is cancelled with it. Closed without one (its
    /// caller merely dropped its work), the job runs on.
    pub(super) cancelled: Option<tokio::sync::oneshot::Receiver<CommError>>,
    /// The communicator the call belongs to (its rules and its errors).
    pub(super) comm: Arc<Driver>,
    /// The host backend of a subgroup's call (`None`: the thread's own).
    pub(super) group: Option<Arc<dyn Backend>>,
}

/// This rank's communication thread, the emulated GPU: one call at a time,
/// in issue order. A call that fails sets its communicator's asynchronous
/// error; an aborted communicator's calls are skipped. Every call's gate
/// opens at the end, so no stream waits for ever.
pub(super) fn comm_thread(
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
        let timeout = kernel_timeout(job.deadline);
        let skip = {
            let gates = job.comm.device();
            let failed = gates.async_error();
            (gates.aborted() || failed.is_some()).then(|| failed.or_else(|| job.comm.poisoned()))
        };
        match (skip, &rt) {
            (Some(cause), Ok(rt)) => rt.block_on(tell_peers(inner, device, &mut job, cause)),
            (Some(_), Err(_)) => {}
            (None, rt) => {
                // Only a call that runs is bound by its deadline: one made
                // to tell the peers keeps its own timeout (it is cancelled
                // at once).
                job.opts = job.opts.with_timeout(timeout);
                let waited = job.after.iter().all(|&e| device.wait_event(e, timeout));
                if max > 0 {
                    std::thread::sleep(Duration::from_nanos(rng.next_u64() % (max + 1)));
                }
                let result = match (rt, waited) {
                    (Ok(rt), true) => rt.block_on(run_or_cancel(inner, device, &mut job)),
                    (Err(e), _) => Err(CommError::aborted(AbortCause::Spawn {
                        what: "the emulated communication runtime",
                        error: e.to_string(),
                    })),
                    (_, false) => Err(CommError::Timeout {
                        ctx: Default::default(),
                        after: timeout,
                        waiting_on: Vec::new(),
                    }),
                };
                if opts.silent_loss && matches!(result, Err(CommError::PeerLost { .. })) {
                    stuck_until_aborted(&job, timeout.saturating_mul(2));
                }
                settle(&job, result);
            }
        }
        for &e in &job.after {
            device.release_event(e);
        }
        device.complete_event(job.gate);
        job.comm.wake();
    }
}

/// How long the emulated kernel (the host call) may run: what is left of
/// its deadline, which is the driver's, less a margin (a twentieth of it,
/// at most 20 ms), so that its own failure, which names the ranks it
/// waited on, reaches the watchdog before the deadline does (as NCCL's
/// asynchronous error is looked at before a call times out).
fn kernel_timeout(deadline: std::time::Instant) -> Duration {
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    left.saturating_sub((left / 20).min(Duration::from_millis(20)))
}

/// A call whose peer was lost, under [`EmulatedCommOptions::silent_loss`]:
/// like an NCCL kernel waiting on a dead peer, it neither ends nor fails
/// until its communicator is aborted (then its gate opens, as an aborted
/// kernel's stream goes on), at most `limit`.
fn stuck_until_aborted(job: &Job, limit: Duration) {
    let deadline = consort_comm::time::deadline(limit);
    while !job.comm.device().aborted() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What a job that ran came to: its output for the caller, or the
/// communicator's asynchronous error. A peer lost on the data path is
/// reported as NCCL reports it, without the rank ([`remote_error`]).
pub(super) fn settle(job: &Job, result: Result<()>) {
    match result.map_err(remote_error) {
        Ok(()) => lock(&job.slot).out = job.output.as_ref().map(|m| m.bytes().to_vec()),
        Err(e) => {
            job.comm.device().failed(e.clone());
            lock(&job.slot).err = Some(e);
        }
    }
}

/// A job of an aborted communicator is not run, but its host call is made
/// and at once cancelled with the communicator's cause (or, with none, that
/// it was aborted), so that peers already waiting in that call hear why,
/// instead of seeing this rank's connections close when it leaves.
async fn tell_peers(
    inner: &dyn Backend,
    device: &EmulatedDevice,
    job: &mut Job,
    cause: Option<CommError>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let _ = tx.send(cause.unwrap_or_else(|| {
        CommError::aborted(AbortCause::Closed(
            "this rank's emulated communicator was aborted before the call ran".into(),
        ))
    }));
    job.cancelled = Some(rx);
    // The call is made on the host copies alone: device memory is neither
    // read (its stream may not have produced it) nor written.
    for m in job.input.iter_mut().chain(job.output.iter_mut()) {
        m.ptr = None;
    }
    let _ = run_or_cancel(inner, device, job).await;
}

/// Runs a job. A host job whose call failed first (the fingerprint check's
/// verdict, the watchdog's abort) is cancelled with that cause: the host
/// backend's call is dropped, which aborts its group, as NCCL's abort ends
/// its kernel, and the verdict reaches the peers as that verdict, not as
/// "cancelled", which a third rank would otherwise report before its own
/// check's verdict. A host job whose caller merely dropped its work runs
/// to its end, as an enqueued NCCL kernel does.
///
/// Any job, a device one included, is also cancelled once its communicator
/// is aborted (a verdict, the watchdog, a failed launch), with the
/// communicator's cause: NCCL's abort ends the kernels in flight.
async fn run_or_cancel(inner: &dyn Backend, device: &EmulatedDevice, job: &mut Job) -> Result<()> {
    let group = job.group.clone();
    let inner = group.as_deref().unwrap_or(inner);
    let comm = job.comm.clone();
    let cancelled = job.cancelled.take();
    let mut run = Box::pin(run_job(inner, device, job));
    // `biased`: the call is made (its first poll) before a cancellation is
    // seen, so a cancelled call still reaches the host backend and aborts
    // its group there, telling the peers why, instead of never being made.
    let e = tokio::select! {
        biased;
        r = &mut run => return r,
        e = given_cause(cancelled) => e,
        e = aborted(&comm) => e,
    };
    consort_comm::cancel::drop_because(run, &e);
    Err(e)
}

/// The cause a host call's caller gives when its call failed first; never
/// ready without one (a caller that merely dropped its work gives none).
async fn given_cause(cancelled: Option<tokio::sync::oneshot::Receiver<CommError>>) -> CommError {
    match cancelled {
        Some(rx) => match rx.await {
            Ok(e) => e,
            Err(_) => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// Ready with the communicator's cause once it has been aborted (looked at
/// every millisecond).
async fn aborted(comm: &Driver) -> CommError {
    loop {
        if comm.device().aborted() {
            return comm
                .poisoned()
                .or_else(|| comm.device().async_error())
                .unwrap_or_else(|| {
                    CommError::aborted(AbortCause::Closed(
                        "this rank's emulated communicator was aborted".into(),
                    ))
                });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
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
