//! The bucket worker: the task that runs DDP's collectives, in the order
//! the buckets became ready, with several in flight at once.
//!
//! Each job's collective is *made* as soon as the job arrives (its future is
//! polled once right away, which submits the call and so fixes its place
//! in the group's sequence, the same on every rank), and the worker then
//! takes the next job without waiting for it: bucket k+1 is launched while
//! bucket k is still in flight, as torch's reducer does. Results go back in
//! job order, so the first error reported is the first call's. PowerSGD
//! keeps state across buckets and runs one bucket at a time.

use std::{collections::VecDeque, future::Future, pin::Pin, sync::Arc, task::Poll};

use consort_comm::{Backend, BufferMut, CallOptions, CommError, DType, ReduceOp};
use tokio::sync::mpsc;

use crate::{
    device::Storage,
    hook::{CommHook, run_hook},
    powersgd::{self, Piece},
};

/// Work for the bucket worker.
pub(crate) enum Job {
    /// Average one bucket.
    Reduce {
        index: usize,
        dtype: DType,
        data: Storage,
        /// The bucket's parameters as matrices (PowerSGD only).
        pieces: Arc<Vec<Piece>>,
        /// Synced steps finished before this one.
        step: u64,
    },
    /// The join count: how many ranks still have data.
    Count { active: bool },
}

/// What the bucket worker hands back.
pub(crate) enum Done {
    /// A bucket, averaged (or the error).
    Reduced {
        index: usize,
        data: Storage,
        result: Result<(), CommError>,
    },
    /// The join count.
    Count(Result<i64, CommError>),
}

type Running<'a> = Pin<Box<dyn Future<Output = Done> + Send + 'a>>;

/// One job in flight, and its result once it has one.
struct Slot<'a> {
    fut: Running<'a>,
    out: Option<Done>,
}

/// The bucket worker. Ends when `jobs` closes (after finishing what is in
/// flight) or when nobody reads `done`.
pub(crate) async fn worker<B: Backend + ?Sized + 'static>(
    backend: Arc<B>,
    hook: CommHook,
    opts: CallOptions,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    done: mpsc::UnboundedSender<Done>,
) {
    let backend = &*backend;
    let mut psgd = powersgd::State::default();
    let mut running: VecDeque<Slot<'_>> = VecDeque::new();
    let mut open = true;
    while open || !running.is_empty() {
        tokio::select! {
            biased;
            job = jobs.recv(), if open => match job {
                Some(job) => match power_step(job, hook) {
                    Ok(step) => {
                        // PowerSGD: after everything before it, one at a time.
                        if !flush(&mut running, &done).await {
                            return;
                        }
                        let out = step.run(backend, &opts, &mut psgd).await;
                        if done.send(out).is_err() {
                            return;
                        }
                    }
                    Err(job) => {
                        let mut fut = start(backend, hook, opts, job);
                        // The first poll makes the call: its place is fixed now.
                        let out = crate::launch::make_now(fut.as_mut());
                        running.push_back(Slot { fut, out });
                    }
                },
                None => open = false,
            },
            () = progress(&mut running), if !running.is_empty() => {}
        }
        if !send_ready(&mut running, &done) {
            return;
        }
    }
}

/// A PowerSGD step of one bucket: its state is shared across buckets.
struct PowerStep {
    index: usize,
    data: crate::hook::Words,
    pieces: Arc<Vec<Piece>>,
    rank: usize,
}

/// `job` as a PowerSGD step, or back as it was.
fn power_step(job: Job, hook: CommHook) -> Result<PowerStep, Job> {
    match (job, hook) {
        (
            Job::Reduce {
                index,
                dtype: DType::F32,
                data: Storage::Host(data),
                pieces,
                step,
            },
            CommHook::PowerSgd { rank, start_iter },
        ) if step >= start_iter => Ok(PowerStep {
            index,
            data,
            pieces,
            rank,
        }),
        (job, _) => Err(job),
    }
}

impl PowerStep {
    async fn run<B: Backend + ?Sized>(
        mut self,
        backend: &B,
        opts: &CallOptions,
        psgd: &mut powersgd::State,
    ) -> Done {
        let d = self.data.typed_mut::<f32>();
        let result = powersgd::reduce(backend, opts, self.rank, psgd, &self.pieces, d).await;
        Done::Reduced {
            index: self.index,
            data: Storage::Host(self.data),
            result,
        }
    }
}

/// One job other than a PowerSGD step, as a future that owns its bucket.
fn start<'a, B: Backend + ?Sized>(
    backend: &'a B,
    hook: CommHook,
    opts: CallOptions,
    job: Job,
) -> Running<'a> {
    if let Job::Reduce {
        index,
        data: Storage::Device(d),
        ..
    } = job
    {
        // Stream-ordered: the call is made here, so its place in the
        // order is fixed now, not when this future is first polled; it
        // returns once enqueued, with Avg on the device.
        let work = backend.all_reduce(BufferMut::Device(d), ReduceOp::Avg, &opts);
        return Box::pin(async move {
            Done::Reduced {
                index,
                data: Storage::Device(d),
                result: work.await,
            }
        });
    }
    Box::pin(async move {
        match job {
            Job::Reduce {
                index,
                data: Storage::Device(d),
                ..
            } => {
                // Not reached (device buckets return above); kept whole so
                // that the match stays exhaustive without a panic.
                let result = backend
                    .all_reduce(BufferMut::Device(d), ReduceOp::Avg, &opts)
                    .await;
                Done::Reduced {
                    index,
                    data: Storage::Device(d),
                    result,
                }
            }
            Job::Reduce {
                index,
                dtype,
                data: Storage::Host(mut data),
                ..
            } => {
                // PowerSGD before its start step averages plainly.
                let hook = match hook {
                    CommHook::PowerSgd { .. } => CommHook::AllReduce,
                    h => h,
                };
                let result = run_hook(backend, hook, dtype, &mut data, &opts).await;
                Done::Reduced {
                    index,
                    data: Storage::Host(data),
                    result,
                }
            }
            Job::Count { active } => {
                let mut n = [i64::from(active)];
                let r = backend
                    .all_reduce(BufferMut::from(&mut n[..]), ReduceOp::Sum, &opts)
                    .await;
                Done::Count(r.map(|()| n[0]))
            }
        }
    })
}

/// Polls every job in flight once; resolves when at least one finished.
async fn progress(running: &mut VecDeque<Slot<'_>>) {
    std::future::poll_fn(|cx| {
        let mut any = false;
        for s in running.iter_mut().filter(|s| s.out.is_none()) {
            if let Poll::Ready(d) = s.fut.as_mut().poll(cx) {
                s.out = Some(d);
                any = true;
            }
        }
        if any { Poll::Ready(()) } else { Poll::Pending }
    })
    .await
}

/// Finishes every job in flight and sends their results, in order; `false`
/// when nobody reads them any more.
async fn flush(running: &mut VecDeque<Slot<'_>>, done: &mpsc::UnboundedSender<Done>) -> bool {
    while !running.is_empty() {
        if running.iter().any(|s| s.out.is_none()) {
            progress(running).await;
        }
        if !send_ready(running, done) {
            return false;
        }
    }
    true
}

/// Sends the finished results at the front, in job order; `false` when
/// nobody reads them any more.
fn send_ready(running: &mut VecDeque<Slot<'_>>, done: &mpsc::UnboundedSender<Done>) -> bool {
    while running.front().is_some_and(|s| s.out.is_some()) {
        let Some(out) = running.pop_front().and_then(|s| s.out) else {
            break;
        };
        if done.send(out).is_err() {
            return false;
        }
    }
    true
}
