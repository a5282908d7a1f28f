//! [`NcclBackend`]: `Backend` on NCCL, one process per GPU.
//!
//! Each op is enqueued on the backend's own communication stream, after
//! that stream waits for the caller's stream (device buffers) or for the
//! staging copies (host buffers). Completion is a CUDA event, polled on a
//! blocking thread (never on the async runtime's workers) together with
//! `ncclCommGetAsyncError`; a deadline that passes aborts the communicator
//! with `ncclCommAbort`. Any failure poisons the backend: later calls
//! return the first error.
//!
//! Host buffers cost a device allocation, a host-to-device copy before and
//! a device-to-host copy after each op (so about two PCIe transfers of the
//! buffer on top of NCCL's own time); they exist so that backend-generic
//! code (DDP's host buckets, the conformance suite) runs unchanged. Pass
//! `DeviceBuffer`s for speed.

use std::{
    ffi::CStr,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use async_trait::async_trait;
use consort_comm::{
    Backend, Buffer, BufferMut, CallOptions, CommError, DType, ErrorContext, GroupId, OpKind,
    ReduceOp, Result, Store, validate,
};
use cudarc::{
    driver::{CudaContext, CudaStream, result as cu, sys as cusys},
    nccl::sys::{self as nc, ncclResult_t},
};

use crate::{
    keys::{UNIQUE_ID_BYTES, check_unique_id, unique_id_key},
    map::{nccl_dtype, nccl_error, nccl_op},
    probe::probe_device,
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
    /// How often the completion poller looks at the CUDA event.
    pub poll_interval: Duration,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            device: None,
            timeout: Duration::from_secs(600),
            group: "0".into(),
            counter: 0,
            poll_interval: Duration::from_micros(20),
        }
    }
}

/// A raw handle moved to the poller thread.
#[derive(Clone, Copy)]
struct Raw(usize);

#[derive(Default)]
struct State {
    seq: u64,
    in_call: bool,
    poisoned: Option<CommError>,
    closed: bool,
}

/// The NCCL backend. Construct with [`NcclBackend::new`]; end with
/// [`NcclBackend::shutdown`] (or [`NcclBackend::abort`]).
pub struct NcclBackend {
    rank: usize,
    world: usize,
    device: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: Raw,
    opts: NcclOptions,
    state: Mutex<State>,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .finish()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn driver(ctx: ErrorContext, what: &str) -> impl FnOnce(cu::DriverError) -> CommError + '_ {
    move |e| CommError::Aborted {
        ctx,
        cause: format!("CUDA {what} failed: {e:?}"),
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

/// One buffer argument as the device sees it.
struct Arg<'a> {
    dev: u64,
    /// Host memory to copy back into after the op (staged outputs).
    back: Option<&'a mut [u8]>,
    /// Whether `dev` was allocated here (and must be freed).
    owned: bool,
    dtype: DType,
    len: usize,
}

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
        probe_device(device)?;
        let ctx0 = ErrorContext {
            rank: Some(rank),
            ..Default::default()
        };
        let ctx = CudaContext::new(device).map_err(driver(ctx0, "context creation"))?;
        let stream = ctx.new_stream().map_err(driver(ctx0, "stream creation"))?;
        let key = unique_id_key(&opts.group, opts.counter);
        let store_err = |source| CommError::Store { ctx: ctx0, source };
        let id: [u8; UNIQUE_ID_BYTES] = if rank == 0 {
            let id = cudarc::nccl::result::get_uniqueid()
                .map_err(|e| nccl_error(ctx0, e.0, "ncclGetUniqueId"))?;
            let bytes: [u8; UNIQUE_ID_BYTES] = id.internal.map(|c| c as u8);
            store.set(&key, &bytes).await.map_err(store_err)?;
            bytes
        } else {
            let v = store.get(&key).await.map_err(store_err)?;
            check_unique_id(&key, &v).map_err(CommError::invalid)?
        };
        let id = nc::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let init_ctx = ctx.clone();
        let (n, r) = (world as i32, rank as i32);
        let init = tokio::task::spawn_blocking(move || -> Result<Raw> {
            init_ctx
                .bind_to_thread()
                .map_err(driver(ctx0, "context binding"))?;
            let mut comm: nc::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm` is a valid out-pointer; the id came from rank 0.
            let res = unsafe { nc::ncclCommInitRank(&mut comm, n, id, r) };
            if res != ncclResult_t::ncclSuccess {
                return Err(nccl_error(ctx0, res, "ncclCommInitRank"));
            }
            Ok(Raw(comm as usize))
        });
        let comm = tokio::time::timeout(opts.timeout, init)
            .await
            .map_err(|_| CommError::Timeout {
                ctx: ctx0,
                after: opts.timeout,
                waiting_on: Vec::new(),
            })?
            .map_err(|e| CommError::Aborted {
                ctx: ctx0,
                cause: format!("the NCCL init thread failed: {e}"),
            })??;
        Ok(NcclBackend {
            rank,
            world,
            device,
            ctx,
            stream,
            comm,
            opts,
            state: Mutex::new(State::default()),
        })
    }

    /// The GPU this rank uses.
    pub fn device(&self) -> usize {
        self.device
    }

    fn comm(&self) -> nc::ncclComm_t {
        self.comm.0 as nc::ncclComm_t
    }

    fn cu_stream(&self) -> cusys::CUstream {
        self.stream.cu_stream()
    }

    fn nc_stream(&self) -> nc::cudaStream_t {
        self.stream.cu_stream() as nc::cudaStream_t
    }

    /// NCCL's last error text for this communicator.
    fn last_error(&self) -> String {
        // SAFETY: the communicator is live (not destroyed before `closed`).
        let p = unsafe { nc::ncclGetLastError(self.comm()) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: NCCL returns a NUL-terminated string it owns.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn check_nccl(&self, ctx: ErrorContext, r: ncclResult_t) -> Result<()> {
        if r == ncclResult_t::ncclSuccess || r == ncclResult_t::ncclInProgress {
            Ok(())
        } else {
            Err(nccl_error(ctx, r, &self.last_error()))
        }
    }

    /// Finishes and destroys the communicator. Every rank should call it at
    /// the end; afterwards every op fails.
    pub fn shutdown(&self) -> Result<()> {
        let mut st = lock(&self.state);
        if st.closed {
            return Ok(());
        }
        st.closed = true;
        let ctx = ErrorContext {
            rank: Some(self.rank),
            ..Default::default()
        };
        self.ctx
            .bind_to_thread()
            .map_err(driver(ctx, "context binding"))?;
        // SAFETY: the communicator is live and no op is in flight (`&self`
        // ops hold `in_call`; a caller racing shutdown gets `closed`).
        let r = unsafe { nc::ncclCommFinalize(self.comm()) };
        let fin = self.check_nccl(ctx, r);
        // SAFETY: as above; destroy after finalize, once.
        let r = unsafe { nc::ncclCommDestroy(self.comm()) };
        fin.and(
            (r == ncclResult_t::ncclSuccess)
                .then_some(())
                .ok_or_else(|| nccl_error(ctx, r, "ncclCommDestroy")),
        )
    }

    /// Aborts the communicator (ncclCommAbort): in-flight ops on every rank
    /// fail. Use it when a peer is known dead.
    pub fn abort(&self) -> Result<()> {
        let mut st = lock(&self.state);
        if st.closed {
            return Ok(());
        }
        st.closed = true;
        st.poisoned.get_or_insert(CommError::Aborted {
            ctx: ErrorContext::default(),
            cause: "the communicator was aborted".into(),
        });
        // SAFETY: the communicator is live; abort is safe with ops in flight.
        let r = unsafe { nc::ncclCommAbort(self.comm()) };
        if r == ncclResult_t::ncclSuccess {
            Ok(())
        } else {
            Err(nccl_error(ErrorContext::default(), r, "ncclCommAbort"))
        }
    }

    fn begin(&self, op: OpKind, p2p: bool) -> Result<ErrorContext> {
        let mut st = lock(&self.state);
        let ctx = ErrorContext::new(op, self.rank, if p2p { 0 } else { st.seq }, GroupId::WORLD);
        if st.closed {
            return Err(CommError::Aborted {
                ctx,
                cause: "the NCCL backend was shut down".into(),
            });
        }
        if let Some(e) = &st.poisoned {
            return Err(e.to_aborted().with_context(ctx));
        }
        if st.in_call {
            return Err(CommError::invalid(
                "this rank already has a call in flight; await each op before starting the next",
            )
            .with_context(ctx));
        }
        st.in_call = true;
        if !p2p {
            st.seq += 1;
        }
        Ok(ctx)
    }

    fn end(&self, res: Result<()>) -> Result<()> {
        let mut st = lock(&self.state);
        st.in_call = false;
        if let Err(e) = &res
            && !matches!(
                e,
                CommError::InvalidArgument { .. } | CommError::Unsupported { .. }
            )
        {
            st.poisoned.get_or_insert(e.clone());
        }
        res
    }

    /// Device memory for a host buffer (at least one byte).
    fn alloc(&self, ctx: ErrorContext, bytes: usize) -> Result<u64> {
        // SAFETY: allocation on our stream; freed in `release`.
        unsafe { cu::malloc_async(self.cu_stream(), bytes.max(1)) }
            .map_err(driver(ctx, "allocation of a staging buffer"))
    }

    fn arg_in<'a>(&self, ctx: ErrorContext, b: Buffer<'a>) -> Result<Arg<'a>> {
        match b {
            Buffer::Device(d) => {
                self.device_arg(ctx, d.ptr(), d.device(), d.stream(), d.dtype(), d.len())
            }
            Buffer::Host(h) => {
                let bytes = h.bytes();
                let dev = self.alloc(ctx, bytes.len())?;
                if !bytes.is_empty() {
                    // SAFETY: `dev` holds `bytes.len()` bytes; pageable
                    // host memory is staged by the driver before return.
                    unsafe { cu::memcpy_htod_async(dev, bytes, self.cu_stream()) }
                        .map_err(driver(ctx, "host-to-device copy"))?;
                }
                Ok(Arg {
                    dev,
                    back: None,
                    owned: true,
                    dtype: h.dtype(),
                    len: h.len(),
                })
            }
        }
    }

    fn arg_out<'a>(&self, ctx: ErrorContext, b: BufferMut<'a>, copy_in: bool) -> Result<Arg<'a>> {
        match b {
            BufferMut::Device(d) => {
                self.device_arg(ctx, d.ptr(), d.device(), d.stream(), d.dtype(), d.len())
            }
            BufferMut::Host(h) => {
                let (dtype, len) = (h.dtype(), h.len());
                let bytes = h.into_bytes_mut();
                let dev = self.alloc(ctx, bytes.len())?;
                if copy_in && !bytes.is_empty() {
                    // SAFETY: as in `arg_in`.
                    unsafe { cu::memcpy_htod_async(dev, &*bytes, self.cu_stream()) }
                        .map_err(driver(ctx, "host-to-device copy"))?;
                }
                Ok(Arg {
                    dev,
                    back: Some(bytes),
                    owned: true,
                    dtype,
                    len,
                })
            }
        }
    }

    fn device_arg<'a>(
        &self,
        ctx: ErrorContext,
        ptr: u64,
        device: i32,
        stream: u64,
        dtype: DType,
        len: usize,
    ) -> Result<Arg<'a>> {
        if device < 0 || device as usize != self.device {
            return Err(CommError::invalid(format!(
                "a device buffer on GPU {device} was passed to the NCCL backend of GPU {}; \
                 each rank's buffers must live on its own GPU",
                self.device
            ))
            .with_context(ctx));
        }
        // The communication stream waits for the caller's stream.
        let ev = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(driver(ctx, "event creation"))?;
        // SAFETY: `ev` is ours; `stream` is the caller's stream handle (0 is
        // the legacy default stream).
        unsafe {
            cu::event::record(ev, stream as cusys::CUstream)
                .and_then(|()| {
                    cu::stream::wait_event(
                        self.cu_stream(),
                        ev,
                        cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                })
                .map_err(driver(ctx, "stream ordering"))?;
            let _ = cu::event::destroy(ev);
        }
        Ok(Arg {
            dev: ptr,
            back: None,
            owned: false,
            dtype,
            len,
        })
    }

    /// Copies staged outputs back and frees staging memory.
    fn release(&self, ctx: ErrorContext, args: &mut [Arg<'_>], ok: bool) -> Result<()> {
        let mut out = Ok(());
        for a in args.iter_mut() {
            if ok
                && let Some(back) = a.back.as_deref_mut()
                && !back.is_empty()
            {
                // SAFETY: `a.dev` holds `a.bytes` bytes; the op has completed.
                let r = unsafe { cu::memcpy_dtoh_async(back, a.dev, self.cu_stream()) };
                if let Err(e) = r {
                    out = Err(driver(ctx, "device-to-host copy")(e));
                }
            }
        }
        // SAFETY: our stream; waits for the copies above.
        if let Err(e) = unsafe { cu::stream::synchronize(self.cu_stream()) } {
            out = out.and(Err(driver(ctx, "stream synchronisation")(e)));
        }
        for a in args.iter().filter(|a| a.owned) {
            // SAFETY: allocated in `alloc` on this stream, freed once.
            let _ = unsafe { cu::free_async(a.dev, self.cu_stream()) };
        }
        out
    }

    /// Waits for everything enqueued so far, off the runtime's threads.
    async fn complete(&self, ctx: ErrorContext, timeout: Duration) -> Result<()> {
        let ev = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(driver(ctx, "event creation"))?;
        // SAFETY: `ev` is ours, the stream is ours.
        unsafe { cu::event::record(ev, self.cu_stream()) }.map_err(driver(ctx, "event record"))?;
        let (ev, comm, poll) = (Raw(ev as usize), self.comm, self.opts.poll_interval);
        let cctx = self.ctx.clone();
        let deadline = Instant::now() + timeout;
        let waited = tokio::task::spawn_blocking(
            move || -> std::result::Result<(), Option<ncclResult_t>> {
                let _ = cctx.bind_to_thread();
                let event = ev.0 as cusys::CUevent;
                let comm = comm.0 as nc::ncclComm_t;
                let out = loop {
                    // SAFETY: the event lives until destroyed below.
                    match unsafe { cu::event::query(event) } {
                        Ok(()) => break Ok(()),
                        Err(e) if e.0 == cusys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                        Err(_) => break Err(Some(ncclResult_t::ncclUnhandledCudaError)),
                    }
                    let mut async_err = ncclResult_t::ncclSuccess;
                    // SAFETY: the communicator is live while a call is in flight.
                    unsafe { nc::ncclCommGetAsyncError(comm, &mut async_err) };
                    if async_err != ncclResult_t::ncclSuccess
                        && async_err != ncclResult_t::ncclInProgress
                    {
                        break Err(Some(async_err));
                    }
                    if Instant::now() >= deadline {
                        // SAFETY: abort is allowed with ops in flight.
                        unsafe { nc::ncclCommAbort(comm) };
                        break Err(None);
                    }
                    std::thread::sleep(poll);
                };
                // SAFETY: created above, destroyed once.
                let _ = unsafe { cu::event::destroy(event) };
                out
            },
        )
        .await
        .map_err(|e| CommError::Aborted {
            ctx,
            cause: format!("the NCCL completion thread failed: {e}"),
        })?;
        match waited {
            Ok(()) => Ok(()),
            Err(None) => {
                // The communicator is gone: mark closed so Drop leaves it.
                lock(&self.state).closed = true;
                Err(CommError::Timeout {
                    ctx,
                    after: timeout,
                    waiting_on: Vec::new(),
                })
            }
            Err(Some(r)) => Err(nccl_error(ctx, r, &self.last_error())),
        }
    }

    /// Runs one call: stages buffers, enqueues with `enqueue(device
    /// pointers)`, waits, copies back.
    async fn run<'a>(
        &self,
        op: OpKind,
        p2p: bool,
        opts: &CallOptions,
        args: impl FnOnce(ErrorContext) -> Result<Vec<Arg<'a>>>,
        enqueue: impl FnOnce(&Self, &[Arg<'a>]) -> ncclResult_t,
    ) -> Result<()> {
        let ctx = self.begin(op, p2p)?;
        let res = self.run_inner(ctx, opts, args, enqueue).await;
        self.end(res)
    }

    async fn run_inner<'a>(
        &self,
        ctx: ErrorContext,
        opts: &CallOptions,
        args: impl FnOnce(ErrorContext) -> Result<Vec<Arg<'a>>>,
        enqueue: impl FnOnce(&Self, &[Arg<'a>]) -> ncclResult_t,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver(ctx, "context binding"))?;
        let mut args = args(ctx)?;
        let r = enqueue(self, &args);
        let mut res = self.check_nccl(ctx, r);
        if res.is_ok() {
            res = self.complete(ctx, opts.timeout_or(self.opts.timeout)).await;
        }
        let ok = res.is_ok();
        let released = self.release(ctx, &mut args, ok);
        res.and(released)
    }

    fn group(&self, f: impl FnOnce() -> ncclResult_t) -> ncclResult_t {
        // SAFETY: group calls only batch the enqueues inside `f`.
        let r = unsafe { nc::ncclGroupStart() };
        if r != ncclResult_t::ncclSuccess {
            return r;
        }
        let inner = f();
        // SAFETY: paired with the start above.
        let end = unsafe { nc::ncclGroupEnd() };
        if inner != ncclResult_t::ncclSuccess {
            inner
        } else {
            end
        }
    }

    /// An op on one buffer, in place: `f(backend, device pointer, count,
    /// NCCL dtype)` enqueues it.
    async fn in_place(
        &self,
        op: OpKind,
        buf: BufferMut<'_>,
        opts: &CallOptions,
        f: impl FnOnce(&Self, *mut std::ffi::c_void, usize, nc::ncclDataType_t) -> ncclResult_t,
    ) -> Result<()> {
        self.run(
            op,
            false,
            opts,
            |ctx| Ok(vec![self.arg_out(ctx, buf, true)?]),
            |s, a| f(s, a[0].dev as *mut _, a[0].len, nccl_dtype(a[0].dtype)),
        )
        .await
    }

    /// An op from `input` to `output`: `f(backend, source, destination,
    /// input count, output count, NCCL dtype)` enqueues it.
    async fn in_out(
        &self,
        op: OpKind,
        input: Buffer<'_>,
        output: BufferMut<'_>,
        opts: &CallOptions,
        f: impl FnOnce(
            &Self,
            *const std::ffi::c_void,
            *mut std::ffi::c_void,
            usize,
            usize,
            nc::ncclDataType_t,
        ) -> ncclResult_t,
    ) -> Result<()> {
        self.run(
            op,
            false,
            opts,
            |ctx| {
                Ok(vec![
                    self.arg_in(ctx, input)?,
                    self.arg_out(ctx, output, false)?,
                ])
            },
            |s, a| {
                let (i, o) = (&a[0], &a[1]);
                f(
                    s,
                    i.dev as *const _,
                    o.dev as *mut _,
                    i.len,
                    o.len,
                    nccl_dtype(i.dtype),
                )
            },
        )
        .await
    }

    /// Gather (`gather`) or scatter as grouped point-to-point: `a[0]` is
    /// this rank's part, exchanged with the root; on the root, `a[1]` is
    /// the whole buffer, part `p` exchanged with rank `p`.
    fn rooted(&self, a: &[Arg<'_>], root: usize, gather: bool) -> ncclResult_t {
        let (n, dt) = (a[0].len, a[0].dtype);
        self.group(|| {
            let mut r = if gather {
                self.send_raw(a[0].dev, n, dt, root)
            } else {
                self.recv_raw(a[0].dev, n, dt, root)
            };
            if let Some(whole) = a.get(1) {
                for p in 0..self.world {
                    let at = whole.dev + (p * n * dt.size_bytes()) as u64;
                    let x = if gather {
                        self.recv_raw(at, n, dt, p)
                    } else {
                        self.send_raw(at, n, dt, p)
                    };
                    if r == ncclResult_t::ncclSuccess {
                        r = x;
                    }
                }
            }
            r
        })
    }

    fn send_raw(&self, ptr: u64, len: usize, dtype: DType, peer: usize) -> ncclResult_t {
        // SAFETY: `ptr` holds `len` elements of `dtype` on our device.
        unsafe {
            nc::ncclSend(
                ptr as *const _,
                len,
                nccl_dtype(dtype),
                peer as i32,
                self.comm(),
                self.nc_stream(),
            )
        }
    }

    fn recv_raw(&self, ptr: u64, len: usize, dtype: DType, peer: usize) -> ncclResult_t {
        // SAFETY: as in `send_raw`, writable.
        unsafe {
            nc::ncclRecv(
                ptr as *mut _,
                len,
                nccl_dtype(dtype),
                peer as i32,
                self.comm(),
                self.nc_stream(),
            )
        }
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        let closed = lock(&self.state).closed;
        if !closed {
            tracing::warn!(
                rank = self.rank,
                "NcclBackend dropped without shutdown(); aborting its communicator"
            );
            if let Err(e) = self.abort() {
                tracing::warn!(rank = self.rank, "ncclCommAbort in Drop failed: {e}");
            }
        }
    }
}

#[async_trait]
impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn default_timeout(&self) -> Duration {
        self.opts.timeout
    }

    async fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp, opts: &CallOptions) -> Result<()> {
        let nop = nccl_op(op)?;
        self.in_place(OpKind::AllReduce, buf, opts, |s, p, n, dt| {
            // SAFETY: in place on `n` elements of our device.
            unsafe { nc::ncclAllReduce(p, p, n, dt, nop, s.comm(), s.nc_stream()) }
        })
        .await
    }

    async fn broadcast(&self, buf: BufferMut<'_>, opts: &CallOptions) -> Result<()> {
        validate::root(opts.root, self.world)?;
        let root = opts.root as i32;
        self.in_place(OpKind::Broadcast, buf, opts, |s, p, n, dt| {
            // SAFETY: in place on `n` elements of our device.
            unsafe { nc::ncclBroadcast(p, p, n, dt, root, s.comm(), s.nc_stream()) }
        })
        .await
    }

    async fn reduce(&self, buf: BufferMut<'_>, op: ReduceOp, opts: &CallOptions) -> Result<()> {
        validate::root(opts.root, self.world)?;
        let (nop, root) = (nccl_op(op)?, opts.root as i32);
        self.in_place(OpKind::Reduce, buf, opts, |s, p, n, dt| {
            // SAFETY: in place on `n` elements of our device.
            unsafe { nc::ncclReduce(p, p, n, dt, nop, root, s.comm(), s.nc_stream()) }
        })
        .await
    }

    async fn all_gather(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::same_dtype(output.dtype(), input.dtype())?;
        validate::whole_times_world(output.len(), input.len(), self.world, "all_gather output")?;
        self.in_out(
            OpKind::AllGather,
            input,
            output,
            opts,
            |s, src, dst, n, _, dt| {
                // SAFETY: `dst` holds world × `n` elements of our device.
                unsafe { nc::ncclAllGather(src, dst, n, dt, s.comm(), s.nc_stream()) }
            },
        )
        .await
    }

    async fn gather(
        &self,
        output: Option<BufferMut<'_>>,
        input: Buffer<'_>,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::root(opts.root, self.world)?;
        validate::root_only(
            "gather",
            "an output",
            output.is_some(),
            self.rank,
            opts.root,
        )?;
        if let Some(o) = &output {
            validate::same_dtype(o.dtype(), input.dtype())?;
            validate::whole_times_world(o.len(), input.len(), self.world, "gather output")?;
        }
        let root = opts.root;
        self.run(
            OpKind::Gather,
            false,
            opts,
            |ctx| {
                let mut v = vec![self.arg_in(ctx, input)?];
                if let Some(o) = output {
                    v.push(self.arg_out(ctx, o, false)?);
                }
                Ok(v)
            },
            |s, a| s.rooted(a, root, true),
        )
        .await
    }

    async fn scatter(
        &self,
        output: BufferMut<'_>,
        input: Option<Buffer<'_>>,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::root(opts.root, self.world)?;
        validate::root_only("scatter", "an input", input.is_some(), self.rank, opts.root)?;
        if let Some(i) = &input {
            validate::same_dtype(output.dtype(), i.dtype())?;
            validate::whole_times_world(i.len(), output.len(), self.world, "scatter input")?;
        }
        let root = opts.root;
        self.run(
            OpKind::Scatter,
            false,
            opts,
            |ctx| {
                let mut v = vec![self.arg_out(ctx, output, false)?];
                if let Some(i) = input {
                    v.push(self.arg_in(ctx, i)?);
                }
                Ok(v)
            },
            |s, a| s.rooted(a, root, false),
        )
        .await
    }

    async fn reduce_scatter(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::same_dtype(output.dtype(), input.dtype())?;
        validate::whole_times_world(
            input.len(),
            output.len(),
            self.world,
            "reduce_scatter input",
        )?;
        let nop = nccl_op(op)?;
        self.in_out(
            OpKind::ReduceScatter,
            input,
            output,
            opts,
            |s, src, dst, _, n, dt| {
                // SAFETY: `src` holds world × `n` elements of our device.
                unsafe { nc::ncclReduceScatter(src, dst, n, dt, nop, s.comm(), s.nc_stream()) }
            },
        )
        .await
    }

    async fn all_to_all_single(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::same_dtype(output.dtype(), input.dtype())?;
        let outs = validate::splits(output_split_sizes, output.len(), self.world, "output")?;
        let ins = validate::splits(input_split_sizes, input.len(), self.world, "input")?;
        self.run(
            OpKind::AllToAll,
            false,
            opts,
            |ctx| {
                Ok(vec![
                    self.arg_in(ctx, input)?,
                    self.arg_out(ctx, output, false)?,
                ])
            },
            |s, a| {
                let dt = a[0].dtype;
                let size = dt.size_bytes() as u64;
                s.group(|| {
                    let (mut io, mut oo) = (0u64, 0u64);
                    let mut r = ncclResult_t::ncclSuccess;
                    for p in 0..s.world {
                        let x = s.send_raw(a[0].dev + io * size, ins[p], dt, p);
                        let y = s.recv_raw(a[1].dev + oo * size, outs[p], dt, p);
                        io += ins[p] as u64;
                        oo += outs[p] as u64;
                        for z in [x, y] {
                            if r == ncclResult_t::ncclSuccess {
                                r = z;
                            }
                        }
                    }
                    r
                })
            },
        )
        .await
    }

    async fn barrier(&self, opts: &CallOptions) -> Result<()> {
        let mut one = [1u8];
        let sum = nc::ncclRedOp_t::ncclSum;
        self.in_place(
            OpKind::Barrier,
            BufferMut::from(&mut one[..]),
            opts,
            |s, p, n, dt| {
                // SAFETY: one byte, in place, on our device.
                unsafe { nc::ncclAllReduce(p, p, n, dt, sum, s.comm(), s.nc_stream()) }
            },
        )
        .await
    }

    async fn send(&self, buf: Buffer<'_>, dst: usize, opts: &CallOptions) -> Result<()> {
        validate::peer(dst, self.rank, self.world)?;
        self.run(
            OpKind::Send,
            true,
            opts,
            |ctx| Ok(vec![self.arg_in(ctx, buf)?]),
            |s, a| s.send_raw(a[0].dev, a[0].len, a[0].dtype, dst),
        )
        .await
    }

    async fn recv(&self, buf: BufferMut<'_>, src: usize, opts: &CallOptions) -> Result<()> {
        validate::peer(src, self.rank, self.world)?;
        self.run(
            OpKind::Recv,
            true,
            opts,
            |ctx| Ok(vec![self.arg_out(ctx, buf, false)?]),
            |s, a| s.recv_raw(a[0].dev, a[0].len, a[0].dtype, src),
        )
        .await
    }
}
