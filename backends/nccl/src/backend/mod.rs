//! [`NcclBackend`]: `Backend` on NCCL, one process per GPU, stream-ordered
//! as torch's `ProcessGroupNCCL`.
//!
//! A call on device buffers is enqueued when it is made (in
//! `Backend::submit`, before its work is polled, so its place on the stream
//! is fixed then): the communication stream waits for each buffer's stream
//! (an event), the op is enqueued, a completion event is recorded, each
//! buffer's stream waits for it, and the work goes to the watchdog
//! ([`crate::work`]): the host never waits for the GPU. A failure found
//! later (an asynchronous NCCL error, a deadline) is sticky: the next call
//! and [`Backend::synchronize`] report it.
//!
//! A call on host buffers is staged and enqueued when it is made too: its
//! input is copied into pinned staging memory from a pool
//! ([`crate::staging`]), the copies and the op go on the stream, and its
//! work waits for the result and copies it out. So works may be awaited in
//! any order, as on every backend, and a work dropped unpolled runs to its
//! end ([`host`]).
//!
//! Subgroups are communicators of their own ([`group`]).

use std::{
    ffi::{c_int, c_void},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use consort_comm::{
    Buffer, BufferMut, CallOptions, CommError, DType, ErrorContext, GroupId, ReduceOp, Result,
    Shape, Store,
    stream::{Call, DriverOptions, Launch, Unlaunched},
};
use cudarc::driver::{CudaContext, CudaStream, result as cu, sys as cusys};

mod check;
mod group;
mod host;
mod launch;
mod life;
mod ops;

use launch::{On, RedOp};
use life::init_comm;

use crate::{
    cuda::driver_error,
    keys::{UNIQUE_ID_BYTES, check_unique_id, torch_unique_id_key},
    map::{nccl_dtype, nccl_error, nccl_op, premul_scalar},
    probe::{load_nccl, probe_device},
    sys::{self, Comm, Nccl, Stream, result},
    work::{Cuda, Driver, Tracked, Waiter},
};

/// How an [`NcclBackend`] is set up.
#[derive(Clone, Debug)]
pub struct NcclOptions {
    /// The GPU; `None`: `LOCAL_RANK` (one process per GPU), else 0.
    pub device: Option<usize>,
    /// Default timeout of each op (NCCL's default in torch: 10 minutes).
    pub timeout: Duration,
    /// The group name in the store key layout (`"0"`: the default group).
    pub group: String,
    /// Which communicator of the group this is (torch's counter).
    pub counter: u64,
    /// How often the watchdog looks at work in flight.
    pub poll_interval: Duration,
    /// The launcher's heartbeat file (`CONSORT_HEARTBEAT_FILE`): each call
    /// made and ended is shown there, so the watchdog sees NCCL ranks'
    /// progress and names a stopped one.
    pub heartbeat_file: Option<std::path::PathBuf>,
    /// The job's flight record directory (`CONSORT_FLIGHT_DIR`): this
    /// rank's calls on every communicator are written to `rank-K.json`
    /// there when a communicator aborts and on SIGUSR1
    /// (`consort_comm::flight::dump_flight_records`), which the launcher's
    /// watchdog sends before it stops a hung job.
    pub flight_dir: Option<std::path::PathBuf>,
    /// A blocking communicator (`ncclConfig_t::blocking = 1`, torch's
    /// default), instead of consort's nonblocking one. Each NCCL call then
    /// enqueues on the caller's thread rather than NCCL's, which costs less
    /// host time per call, but init cannot be aborted: a rank whose peer
    /// never arrives stays in `ncclCommInitRank` (its caller still gets a
    /// timeout error). `CONSORT_NCCL_BLOCKING=1` sets it for
    /// `Dist::nccl_backend`.
    pub blocking: bool,
    /// Fault injection, for tests: the enqueue of a call with this
    /// sequence number (on its group; sends and receives all have 0;
    /// subgroups inherit the option) waits this long first, on its caller's
    /// thread, before it takes the launch lock: a call stuck between its
    /// make and its enqueue (the emulated device's `stall_enqueue_at`). A
    /// call made meanwhile on another thread waits for its turn.
    pub stall_enqueue_at: Option<(u64, Duration)>,
    /// Whose store keys and split colours to use: torch 2.15's `"nccl"`
    /// (nccl2, the default) or the classic ProcessGroupNCCL, so that this
    /// rank can sit in a torch job's group (`crate::keys`).
    /// `Dist::nccl_backend` follows torch's `TORCH_DIST_USE_NCCL2`.
    pub torch: crate::keys::TorchNccl,
    /// The torch job's default group was made eagerly
    /// (`init_process_group(device_id=...)`): the classic backend then
    /// splits `new_group`s from it instead of keying each in the store
    /// (`keys::torch_subgroup_bootstrap`). `Dist::nccl_backend` reads
    /// `CONSORT_TORCH_NCCL_EAGER=1`.
    pub torch_eager: bool,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            device: None,
            timeout: Duration::from_secs(600),
            group: "0".into(),
            counter: 0,
            poll_interval: Duration::from_micros(50),
            heartbeat_file: None,
            flight_dir: None,
            blocking: false,
            stall_enqueue_at: None,
            torch: crate::keys::TorchNccl::Nccl2,
            torch_eager: false,
        }
    }
}

/// The NCCL backend. Construct with [`NcclBackend::new`]; end with
/// [`NcclBackend::shutdown`] (or [`NcclBackend::abort`]).
pub struct NcclBackend {
    rank: usize,
    world: usize,
    device: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The stream-ordered driver (shared with the emulated device) on this
    /// communicator's CUDA half.
    shared: Arc<Driver>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    /// The staging memory of host calls.
    staging: Arc<crate::staging::Pool>,
    /// Made by `new_group`: dropping it is how a subgroup ends.
    subgroup: bool,
    /// The job's store, where the survivors of a failed communicator meet
    /// (see [`NcclBackend::set_store`]).
    store: std::sync::OnceLock<Arc<dyn Store>>,
    /// The next group's number in torch's count (`group_count`: the
    /// default group is 0), shared by a world and all its subgroups.
    torch_groups: Arc<std::sync::atomic::AtomicU64>,
    closed: AtomicBool,
    opts: NcclOptions,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .field("nccl", &self.shared.device().nccl)
            .finish()
    }
}

/// The device from options or `LOCAL_RANK`.
fn pick_device(opts: &NcclOptions) -> Result<usize> {
    if let Some(d) = opts.device {
        return Ok(d);
    }
    match std::env::var("LOCAL_RANK") {
        Ok(v) => v.trim().parse().map_err(|_| {
            CommError::invalid(format!(
                "LOCAL_RANK={v:?} is not a number; it picks this process's GPU (or set \
                 NcclOptions::device)"
            ))
        }),
        Err(_) => Ok(0),
    }
}

/// A device buffer argument.
#[derive(Clone, Copy)]
struct Dev {
    ptr: u64,
    stream: u64,
}

/// The arguments of one call, classified.
enum Args<'a> {
    /// Every buffer on the device: input and output addresses, and the
    /// buffers' streams.
    Device {
        input: u64,
        output: u64,
        streams: Vec<u64>,
    },
    /// Every buffer on the host: input bytes, and output bytes with whether
    /// they are also an input (in-place ops).
    Host {
        input: Option<&'a [u8]>,
        output: Option<(&'a mut [u8], bool)>,
    },
}

/// `enqueue(on, input address, output address)`: the op's NCCL calls,
/// each settled ([`On::settle`]) before the next.
type Enqueue<'a> = Box<dyn FnOnce(&On<'_>, u64, u64) -> c_int + Send + 'a>;

impl NcclBackend {
    /// Joins the NCCL communicator of `world` ranks: rank 0 creates the
    /// unique id and sets it in `store` under torch's key layout, the
    /// others read it. Returns `BackendUnavailable` (never a panic) when
    /// libcuda, libnccl or the GPU is missing.
    pub async fn new(
        store: &dyn Store,
        rank: usize,
        world: usize,
        opts: NcclOptions,
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(CommError::invalid(format!(
                "rank {rank} of a world of {world}: the rank must be below the world size"
            )));
        }
        let device = pick_device(&opts)?;
        let nccl = load_nccl()?;
        probe_device(device)?;
        let ctx0 = ErrorContext {
            rank: Some(rank),
            ..Default::default()
        };
        let ctx =
            CudaContext::new(device).map_err(|e| driver_error(ctx0, "context creation", e))?;
        let key = torch_unique_id_key(opts.torch, &opts.group, opts.counter);
        let store_err = |source| CommError::Store { ctx: ctx0, source };
        let id: [u8; UNIQUE_ID_BYTES] = if rank == 0 {
            let id = nccl
                .unique_id()
                .map_err(|r| nccl_error(ctx0, r, "ncclGetUniqueId"))?;
            let bytes: [u8; UNIQUE_ID_BYTES] = id.internal.map(|c| c as u8);
            store.set(&key, &bytes).await.map_err(store_err)?;
            bytes
        } else {
            let v = store.get(&key).await.map_err(store_err)?;
            check_unique_id(&key, &v).map_err(CommError::invalid)?
        };
        let comm = init_comm(&nccl, &ctx, ctx0, id, (rank, world), &opts).await?;
        let flight = opts.flight_dir.clone();
        let b = Self::assemble(nccl, ctx, (rank, world, device), comm, GroupId::WORLD, opts)?;
        if let Some(dir) = flight {
            let out = consort_comm::flight::FlightOut::new(dir, rank, world);
            b.shared.set_flight(Arc::new(out));
        }
        Ok(b)
    }

    /// A backend around a communicator that is already made (by
    /// `ncclCommInitRank` or `ncclCommSplit`): its own stream, watchdog and
    /// staging. Destroys `comm` if the rest cannot be set up.
    fn assemble(
        nccl: Arc<Nccl>,
        ctx: Arc<CudaContext>,
        (rank, world, device): (usize, usize, usize),
        comm: usize,
        group: GroupId,
        opts: NcclOptions,
    ) -> Result<Self> {
        let ctx0 = ErrorContext {
            rank: Some(rank),
            ..Default::default()
        };
        let stream = match ctx.new_stream() {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: ours, made just before, never used.
                let _ = unsafe { (nccl.comm_destroy)(comm as Comm) };
                return Err(driver_error(ctx0, "stream creation", e));
            }
        };
        let cuda = Cuda::new(nccl, rank, ctx.clone(), comm);
        let shared = Arc::new(Driver::new(
            cuda,
            (rank, world),
            group,
            DriverOptions {
                poll: opts.poll_interval,
                stall_enqueue_at: opts.stall_enqueue_at,
            },
        ));
        if let Some(b) =
            consort_comm::heartbeat::Heartbeat::for_rank(opts.heartbeat_file.as_deref(), rank)
        {
            shared.set_heartbeat(b);
        }
        let watchdog = match shared.spawn_watchdog(format!("consort-nccl-watchdog-{rank}")) {
            Ok(w) => w,
            Err(e) => {
                shared.abort(e.clone());
                return Err(e);
            }
        };
        Ok(NcclBackend {
            rank,
            world,
            device,
            stream,
            shared,
            watchdog: Mutex::new(Some(watchdog)),
            staging: crate::staging::Pool::new(ctx.clone()),
            ctx,
            subgroup: false,
            store: std::sync::OnceLock::new(),
            torch_groups: Arc::new(std::sync::atomic::AtomicU64::new(1)),
            closed: AtomicBool::new(false),
            opts,
        })
    }

    /// The job's store (a restarted round's prefix included), where the
    /// survivors of a failed communicator make theirs: `new_group` of the
    /// ranks still alive on a failed group (DDP's `OnPeerLost::Shrink`,
    /// `Dist::shutdown_without`) meets there, since nothing can be called
    /// on the failed communicator. Set once; subgroups inherit it.
    /// `Dist::nccl_backend` sets it.
    pub fn set_store(&self, store: Arc<dyn Store>) {
        let _ = self.store.set(store);
    }

    /// The GPU this rank uses.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The loaded NCCL's version (`2.28.3`) and where it came from.
    pub fn nccl_version(&self) -> (String, String) {
        (
            self.shared.device().nccl.version_string(),
            self.shared.device().nccl.path.clone(),
        )
    }

    /// The loaded NCCL library (its raw entry points, for measurements
    /// and interop).
    pub fn nccl(&self) -> &Arc<Nccl> {
        &self.shared.device().nccl
    }

    /// The raw `ncclComm_t`, or null once shut down or aborted.
    ///
    /// # Safety
    /// A call made through it bypasses consort's ordering, tracking and
    /// watchdog: every rank must make the same raw calls in the same order,
    /// on [`NcclBackend::comm_stream`] or a stream ordered with it, while
    /// no consort call is being made from another thread, and never after
    /// shutdown or abort.
    pub unsafe fn raw_comm(&self) -> *mut c_void {
        self.shared
            .device()
            .comm()
            .map_or(std::ptr::null_mut(), |c| c as *mut c_void)
    }

    /// The final result of a raw NCCL call on [`NcclBackend::raw_comm`]
    /// that returned `r`. consort's communicators are nonblocking (unless
    /// [`NcclOptions::blocking`]): a call may return `ncclInProgress` and
    /// finish enqueuing on NCCL's thread, and the next call on the
    /// communicator may only come once it has. This polls
    /// `ncclCommGetAsyncError` until then, at most the default timeout
    /// (then `ncclTimeout`, 8 here). Settle every raw call before the next.
    ///
    /// # Safety
    /// As [`NcclBackend::raw_comm`]: the communicator is live, and no
    /// consort call runs on it from another thread.
    pub unsafe fn settle_raw(&self, r: c_int) -> c_int {
        let cuda = self.shared.device();
        let Some(comm) = cuda.comm() else {
            return r;
        };
        let deadline = consort_comm::time::deadline(self.opts.timeout);
        launch::settle(&cuda.nccl, comm as Comm, r, deadline, || false)
    }

    /// The communication stream's handle (the stream NCCL runs on).
    pub fn comm_stream(&self) -> u64 {
        self.stream.cu_stream() as u64
    }

    fn cu_stream(&self) -> cusys::CUstream {
        self.stream.cu_stream()
    }

    /// Enqueues one call on the communication stream under the driver's
    /// launch lock; see the module docs for the ordering. Every failure
    /// fails the call, poisons the group and aborts the communicator: peers
    /// may have enqueued their part.
    fn launch(
        &self,
        call: &Call,
        streams: &[u64],
        io: (u64, u64),
        host: Option<(Arc<crate::staging::Held>, Waiter)>,
        enqueue: Enqueue<'_>,
    ) -> Result<()> {
        self.shared.launch(call, |l| {
            let done = self.enqueue_ordered(l, streams, io, enqueue)?;
            let (staging, waiter) = match host {
                Some((g, w)) => (Some(g), Some(w)),
                None => (None, None),
            };
            Ok(Tracked {
                done,
                waiter,
                staging,
            })
        })
    }

    /// The launch itself (the launch lock held): the communication stream
    /// waits for the buffers' streams, the op is enqueued, the completion
    /// event is recorded, and the buffers' streams wait for it.
    fn enqueue_ordered(
        &self,
        l: &Launch<'_>,
        streams: &[u64],
        io: (u64, u64),
        enqueue: Enqueue<'_>,
    ) -> Result<crate::work::Event> {
        let cuda = self.shared.device();
        let ctx = l.call.made.ctx;
        let Some(comm) = cuda.comm() else {
            return Err(CommError::Aborted {
                ctx,
                cause: consort_comm::AbortCause::Closed(
                    "the NCCL communicator is gone (aborted)".into(),
                ),
            });
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error(ctx, "context binding", e))?;
        let own = self.cu_stream() as u64;
        let cu_err = |what: &'static str| move |e| driver_error(ctx, what, e);
        for &s in streams.iter().filter(|&&s| s != own) {
            let ev = cuda.event(ctx)?;
            // SAFETY: `ev` is ours; `s` is the caller's stream handle.
            unsafe {
                cu::event::record(ev.raw(), s as cusys::CUstream)
                    .and_then(|()| cu::stream::wait_event(self.cu_stream(), ev.raw(), WAIT))
            }
            .map_err(cu_err("stream ordering (input)"))?;
            cuda.recycle(ev);
        }
        let on = On {
            nccl: &cuda.nccl,
            comm: comm as Comm,
            stream: own as Stream,
            deadline: l.deadline,
            stop: &|| l.stop(),
        };
        let r = enqueue(&on, io.0, io.1);
        if r == result::IN_PROGRESS {
            return Err(CommError::Aborted {
                ctx,
                cause: consort_comm::AbortCause::Closed(
                    "the communicator was aborted while this call was being enqueued".into(),
                ),
            });
        }
        if r != result::SUCCESS {
            return Err(nccl_error(ctx, r, &cuda.last_error(comm)));
        }
        let done = cuda.event(ctx)?;
        // SAFETY: `done` is ours; the streams are ours and the caller's.
        unsafe {
            cu::event::record(done.raw(), self.cu_stream()).map_err(cu_err("completion event"))?;
            for &s in streams.iter().filter(|&&s| s != own) {
                cu::stream::wait_event(s as cusys::CUstream, done.raw(), WAIT)
                    .map_err(cu_err("stream ordering (output)"))?;
            }
        }
        Ok(done)
    }

    /// Makes one call and enqueues it, once its turn has come (at once,
    /// unless another thread is enqueuing a call made just before it):
    /// device arguments, and the work is then done from the host's side;
    /// host arguments are staged first, and the returned work waits for the
    /// result and copies it back.
    fn call<'a>(
        &'a self,
        fp: Shape,
        opts: &CallOptions,
        args: Args<'a>,
        enqueue: Enqueue<'a>,
    ) -> consort_comm::Work<'a> {
        self.call_with(fp, opts, args, (enqueue, None))
    }

    /// [`NcclBackend::call`] of a send or receive with `peer`, which the
    /// watchdog names if that rank is lost while the call waits.
    fn call_with<'a>(
        &'a self,
        fp: Shape,
        opts: &CallOptions,
        args: Args<'a>,
        (enqueue, peer): (Enqueue<'a>, Option<usize>),
    ) -> consort_comm::Work<'a> {
        let timeout = opts.timeout_or(self.opts.timeout);
        let call = match self.shared.make(fp, timeout, peer) {
            Ok(c) => c,
            Err(e) => return consort_comm::Work::ready(Err(e)),
        };
        let pending = self.shared.unlaunched(&call);
        if let Err(e) = self.shared.wait_turn(&call) {
            return consort_comm::Work::ready(Err(pending.failed(e)));
        }
        match args {
            Args::Device {
                input,
                output,
                streams,
            } => {
                let r = self.launch(&call, &streams, (input, output), None, enqueue);
                pending.settled();
                consort_comm::Work::ready(r)
            }
            Args::Host { input, output } => self.host_work(pending, call, input, output, enqueue),
        }
    }

    /// A host call's work, its turn come: staged and enqueued now; the work
    /// waits for the result and copies it out.
    fn host_work<'a>(
        &'a self,
        pending: Unlaunched<'a, Cuda>,
        call: Call,
        input: Option<&'a [u8]>,
        output: Option<(&'a mut [u8], bool)>,
        enqueue: Enqueue<'a>,
    ) -> consort_comm::Work<'a> {
        let view = output.as_ref().map(|(o, copy)| (&o[..], *copy));
        match self.stage(pending, call, input, view, enqueue) {
            Ok(staged) => consort_comm::Work::new(staged.finish(output.map(|(o, _)| o))),
            Err(e) => consort_comm::Work::ready(Err(e)),
        }
    }

    /// Classifies the buffers of one call.
    fn args<'a>(
        &self,
        input: Option<Buffer<'a>>,
        output: Option<(BufferMut<'a>, bool)>,
    ) -> Result<Args<'a>> {
        let dev_in = matches!(input, Some(Buffer::Device(_)));
        let dev_out = matches!(output, Some((BufferMut::Device(_), _)));
        let host_in = matches!(input, Some(Buffer::Host(_)));
        let host_out = matches!(output, Some((BufferMut::Host(_), _)));
        if (dev_in || dev_out) && (host_in || host_out) {
            return Err(CommError::unsupported(
                "one call mixed host and device buffers; pass every buffer of a call on the GPU, \
                 or every one on the host",
            ));
        }
        if dev_in || dev_out {
            let mut streams = Vec::new();
            let mut pick = |d: Dev| {
                streams.push(d.stream);
                d.ptr
            };
            let input = match input {
                Some(Buffer::Device(d)) => pick(self.dev(d.device(), d.ptr(), d.stream())?),
                _ => 0,
            };
            let output = match output {
                Some((BufferMut::Device(d), _)) => {
                    pick(self.dev(d.device(), d.ptr(), d.stream())?)
                }
                _ => 0,
            };
            streams.sort_unstable();
            streams.dedup();
            return Ok(Args::Device {
                input,
                output,
                streams,
            });
        }
        Ok(Args::Host {
            input: match input {
                Some(Buffer::Host(h)) => Some(h.bytes()),
                _ => None,
            },
            output: match output {
                Some((BufferMut::Host(h), copy)) => Some((h.into_bytes_mut(), copy)),
                _ => None,
            },
        })
    }

    /// The NCCL op of `op` on `dtype`, checked against the loaded library
    /// (`ncclAvg` arrived in NCCL 2.10, pre-multiplied sums in 2.11).
    fn op(&self, op: ReduceOp, dtype: DType) -> Result<RedOp> {
        let nccl = &self.shared.device().nccl;
        let too_old = |what: &str, since: &str| {
            CommError::unsupported(format!(
                "{what} needs NCCL {since} or newer; the loaded library ({}) is NCCL {}. Point \
                 CONSORT_NCCL_LIBRARY at a newer libnccl.so.2",
                nccl.path,
                nccl.version_string()
            ))
        };
        if let ReduceOp::PremulSum(f) = op {
            op.check(dtype)?;
            if nccl.red_op_create_pre_mul_sum.is_none() || nccl.red_op_destroy.is_none() {
                return Err(too_old("ReduceOp::PremulSum", "2.11"));
            }
            let scalar = premul_scalar(f, dtype)
                .ok_or_else(|| CommError::unsupported(format!("ReduceOp::PremulSum on {dtype}")))?;
            return Ok(RedOp::PremulSum(scalar));
        }
        let nop = nccl_op(op)?;
        if op == ReduceOp::Avg && nccl.version < sys::version_code(2, 10, 0) {
            return Err(too_old("ReduceOp::Avg", "2.10"));
        }
        Ok(RedOp::Builtin(nop))
    }

    fn dev(&self, device: i32, ptr: u64, stream: u64) -> Result<Dev> {
        if device < 0 || device as usize != self.device {
            return Err(CommError::invalid(format!(
                "a device buffer on GPU {device} was passed to the NCCL backend of GPU {}; \
                 each rank's buffers must live on its own GPU",
                self.device
            )));
        }
        Ok(Dev { ptr, stream })
    }

    /// An op on one buffer in place: `f(nccl, comm, stream, address, count,
    /// dtype)` enqueues it.
    fn in_place<'a>(
        &'a self,
        fp: Shape,
        buf: BufferMut<'a>,
        opts: &CallOptions,
        f: impl FnOnce(&On<'_>, u64, usize, c_int) -> c_int + Send + 'a,
    ) -> Result<consort_comm::Work<'a>> {
        let (n, dt) = (buf.len(), nccl_dtype(buf.dtype()));
        let args = self.args(None, Some((buf, true)))?;
        let enqueue: Enqueue<'a> = Box::new(move |on, _, o| f(on, o, n, dt));
        Ok(self.call(fp, opts, args, enqueue))
    }
}

const WAIT: cusys::CUevent_wait_flags = cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;

impl Drop for NcclBackend {
    fn drop(&mut self) {
        if !self.closed.load(Ordering::SeqCst) {
            if self.subgroup {
                // A subgroup ends when its last handle goes, as in torch:
                // its work in flight finishes first (within its timeout).
                if let Err(e) = self.shutdown() {
                    tracing::warn!(rank = self.rank, "NCCL subgroup ended with an error: {e}");
                }
                return;
            }
            tracing::warn!(
                rank = self.rank,
                "NcclBackend dropped without shutdown(); aborting its communicator"
            );
            let _ = self.abort();
        }
    }
}
