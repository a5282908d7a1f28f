//! The same MLP on a GPU (`--backend nccl --device cuda`): parameters,
//! activations and gradients live in device memory, the matrix products
//! are cuBLAS SGEMMs and the rest are small kernels compiled at run time
//! with NVRTC (everything loaded dynamically: the build needs no CUDA
//! toolkit). Backward writes each gradient straight into its DDP bucket
//! (gradient as bucket view); NCCL averages the buckets on the device, and
//! the SGD kernel runs on the compute stream after them, so no gradient
//! crosses to the host.

use std::{ffi::c_void, sync::Arc};

use consort::{
    Placement,
    ddp::{Ddp, DeviceModel, PlainModel, Sharded, shard::Gathered},
    nccl::{CudaDevice, NcclBackend},
};
use cudarc::{
    cublas::{result as blas, sys as blas_sys},
    driver::{CudaFunction, CudaModule, result as cu, sys as cusys},
};

use crate::{
    BoxError,
    data::Sample,
    mlp::{B1, B2, W1, W2},
};

const KERNELS: &str = r#"
extern "C" __global__ void add_bias(float* y, const float* b, int rows, int cols, int relu) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        float v = y[i] + b[i % cols];
        y[i] = (relu && v < 0.0f) ? 0.0f : v;
    }
}
extern "C" __global__ void softmax_xent(const float* logits, const int* y, float* d, float* loss,
                                        int rows, float inv_n) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* o = logits + r * 10;
    float m = o[0];
    for (int k = 1; k < 10; k++) m = fmaxf(m, o[k]);
    float z = 0.0f;
    for (int k = 0; k < 10; k++) z += expf(o[k] - m);
    atomicAdd(loss, logf(z) + m - o[y[r]]);
    for (int k = 0; k < 10; k++) {
        d[r * 10 + k] = (expf(o[k] - m) / z - (k == y[r] ? 1.0f : 0.0f)) * inv_n;
    }
}
extern "C" __global__ void relu_back(float* dh, const float* h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && h[i] <= 0.0f) dh[i] = 0.0f;
}
extern "C" __global__ void col_sum(const float* m, float* out, int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f;
    for (int r = 0; r < rows; r++) s += m[r * cols + c];
    out[c] = s;
}
extern "C" __global__ void sgd(float* p, const float* g, float lr, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] -= lr * g[i];
}
extern "C" __global__ void gather(const float* x, const int* y, const unsigned int* idx,
                                  float* xb, int* yb, int rows) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * 64) return;
    int r = i / 64, c = i % 64;
    xb[i] = x[idx[r] * 64 + c];
    if (c == 0) yb[r] = y[idx[r]];
}
extern "C" __global__ void count_correct(const float* o, const int* y, int rows, float* correct) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int best = 0;
    for (int k = 1; k < 10; k++) if (o[r * 10 + k] > o[r * 10 + best]) best = k;
    if (best == y[r]) atomicAdd(correct, 1.0f);
}
"#;

/// Checks that a CUDA library cudarc will open exists (cudarc panics
/// otherwise), naming what was tried and what to do.
/// Compiles [`KERNELS`] for this GPU (see `consort::cuda::compile`).
fn load_kernels(dev: &Arc<CudaDevice>) -> Result<Arc<CudaModule>, BoxError> {
    Ok(consort::cuda::compile(
        dev,
        KERNELS,
        &[],
        "the trainer's kernels",
    )?)
}

/// [`consort::cuda::probe_lib`], as the trainer's error.
fn probe_lib(name: &str, what: &str) -> Result<(), BoxError> {
    consort::cuda::probe_lib(name, what)
        .map_err(|e| format!("backend `nccl` is unavailable: {e}").into())
}

/// The kernels, the cuBLAS handle and the scratch buffers of one rank.
pub(crate) struct Gpu {
    p: Placement,
    _module: Arc<CudaModule>,
    f: Kernels,
    blas: usize,
    hidden: usize,
    /// Scratch: inputs, labels, hidden, logits and their gradients, for
    /// up to `cap` rows; index upload buffer; loss and accuracy counters.
    cap: usize,
    s: Scratch,
}

struct Kernels {
    add_bias: CudaFunction,
    softmax_xent: CudaFunction,
    relu_back: CudaFunction,
    col_sum: CudaFunction,
    sgd: CudaFunction,
    gather: CudaFunction,
    count_correct: CudaFunction,
}

#[derive(Default)]
struct Scratch {
    xb: u64,
    yb: u64,
    h: u64,
    o: u64,
    d_o: u64,
    d_h: u64,
    idx: u64,
    loss: u64,
    correct: u64,
}

/// One kernel argument: a pointer to its value.
fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

impl Gpu {
    /// Compiles the kernels, opens cuBLAS on `p`'s stream and allocates
    /// scratch for batches of up to `cap` rows.
    pub(crate) fn new(
        dev: &Arc<CudaDevice>,
        p: Placement,
        hidden: usize,
        cap: usize,
    ) -> Result<Self, BoxError> {
        probe_lib("nvrtc", "NVRTC (the CUDA run-time compiler)")?;
        probe_lib("cublas", "cuBLAS")?;
        let module = load_kernels(dev)?;
        let load = |n: &str| module.load_function(n);
        let f = Kernels {
            add_bias: load("add_bias")?,
            softmax_xent: load("softmax_xent")?,
            relu_back: load("relu_back")?,
            col_sum: load("col_sum")?,
            sgd: load("sgd")?,
            gather: load("gather")?,
            count_correct: load("count_correct")?,
        };
        dev.context().bind_to_thread()?;
        let handle = blas::create_handle().map_err(|e| format!("cuBLAS: {e:?}"))?;
        // SAFETY: a live handle and a stream of this context.
        unsafe { blas::set_stream(handle, p.stream as blas_sys::cudaStream_t) }
            .map_err(|e| format!("cuBLAS: {e:?}"))?;
        let mut gpu = Gpu {
            p,
            _module: module,
            f,
            blas: handle as usize,
            hidden,
            cap,
            s: Scratch::default(),
        };
        let a = |n: usize| gpu.p.device.alloc_zeroed(n * 4, gpu.p.stream);
        gpu.s = Scratch {
            xb: a(cap * 64)?,
            yb: a(cap)?,
            h: a(cap * hidden)?,
            o: a(cap * 10)?,
            d_o: a(cap * 10)?,
            d_h: a(cap * hidden)?,
            idx: a(cap)?,
            loss: a(1)?,
            correct: a(1)?,
        };
        Ok(gpu)
    }

    fn launch(&self, f: &CudaFunction, n: usize, args: &mut [*mut c_void]) -> Result<(), BoxError> {
        let blocks = n.div_ceil(256).max(1) as u32;
        // SAFETY: every argument points at a value of the kernel's parameter
        // type (device addresses as u64, ints as i32, floats as f32) that
        // lives until this call returns (arguments are copied at launch);
        // the device buffers are this rank's live allocations.
        unsafe {
            cu::launch_kernel(
                f.cu_function(),
                (blocks, 1, 1),
                (256, 1, 1),
                0,
                self.p.stream as cusys::CUstream,
                args,
            )
        }?;
        Ok(())
    }

    /// Row-major `c[m, n] = op(a) · op(b)` (`op(a)` is `m × k`, `op(b)`
    /// is `k × n`; `ta`/`tb`: the stored matrix is the transpose).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        c: u64,
        a: u64,
        b: u64,
        m: usize,
        n: usize,
        k: usize,
        ta: bool,
        tb: bool,
    ) -> Result<(), BoxError> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let (alpha, beta) = (1f32, 0f32);
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        // Column-major cuBLAS computes cᵀ = op(b)ᵀ · op(a)ᵀ.
        // SAFETY: a, b and c hold the matrices described, on this GPU.
        unsafe {
            blas::sgemm(
                self.blas as blas_sys::cublasHandle_t,
                op(tb),
                op(ta),
                n as i32,
                m as i32,
                k as i32,
                &alpha,
                b as *const f32,
                if tb { k } else { n } as i32,
                a as *const f32,
                if ta { m } else { k } as i32,
                &beta,
                c as *mut f32,
                n as i32,
            )
        }
        .map_err(|e| format!("cuBLAS sgemm: {e:?}"))?;
        Ok(())
    }

    /// Gathers rows `idx` of the device-resident set into the batch buffers.
    fn gather(&self, set: &DeviceSet, idx: &[u32]) -> Result<usize, BoxError> {
        let rows = idx.len().min(self.cap);
        // SAFETY: the index buffer holds `cap >= rows` u32.
        unsafe {
            self.p.device.copy_from_host(
                self.s.idx,
                consort::dtype::as_bytes(&idx[..rows]),
                self.p.stream,
            )
        }?;
        let r = rows as i32;
        self.launch(
            &self.f.gather,
            rows * 64,
            &mut [
                arg(&set.x),
                arg(&set.y),
                arg(&self.s.idx),
                arg(&self.s.xb),
                arg(&self.s.yb),
                arg(&r),
            ],
        )?;
        Ok(rows)
    }

    /// Hidden activations and logits of the gathered batch, with the
    /// parameters at `w` (`[w1, b1, w2, b2]` device addresses).
    fn forward(&self, w: [u64; 4], rows: usize) -> Result<(), BoxError> {
        let [w1, b1, w2, b2] = w;
        let (r, h) = (rows as i32, self.hidden as i32);
        self.gemm(self.s.h, self.s.xb, w1, rows, self.hidden, 64, false, true)?;
        let one = 1i32;
        self.launch(
            &self.f.add_bias,
            rows * self.hidden,
            &mut [arg(&self.s.h), arg(&b1), arg(&r), arg(&h), arg(&one)],
        )?;
        self.gemm(self.s.o, self.s.h, w2, rows, 10, self.hidden, false, true)?;
        let (ten, zero) = (10i32, 0i32);
        self.launch(
            &self.f.add_bias,
            rows * 10,
            &mut [arg(&self.s.o), arg(&b2), arg(&r), arg(&ten), arg(&zero)],
        )
    }

    /// Forward and backward of one batch with the parameters at `w`: the
    /// gradients go to `g` (`[w1, b1, w2, b2]` device addresses), and
    /// `ready(i)` is called as each is written (layer 2 first, as autograd
    /// produces them). Returns the batch's rows.
    fn forward_backward(
        &self,
        w: [u64; 4],
        g: [u64; 4],
        set: &DeviceSet,
        idx: &[u32],
        mut ready: impl FnMut(usize) -> Result<(), BoxError>,
    ) -> Result<usize, BoxError> {
        let rows = self.gather(set, idx)?;
        self.forward(w, rows)?;
        let (r, hid) = (rows as i32, self.hidden as i32);
        let inv_n = 1.0f32 / rows.max(1) as f32;
        self.launch(
            &self.f.softmax_xent,
            rows,
            &mut [
                arg(&self.s.o),
                arg(&self.s.yb),
                arg(&self.s.d_o),
                arg(&self.s.loss),
                arg(&r),
                arg(&inv_n),
            ],
        )?;
        let [gw1, gb1, gw2, gb2] = g;
        // Layer 2: dW2 = dOᵀ·H, db2 = Σ rows dO.
        self.gemm(
            gw2,
            self.s.d_o,
            self.s.h,
            10,
            self.hidden,
            rows,
            true,
            false,
        )?;
        let ten = 10i32;
        self.launch(
            &self.f.col_sum,
            10,
            &mut [arg(&self.s.d_o), arg(&gb2), arg(&r), arg(&ten)],
        )?;
        ready(B2)?;
        ready(W2)?;
        // Layer 1: dH = dO·W2 masked by ReLU, dW1 = dHᵀ·X, db1 = Σ rows dH.
        self.gemm(
            self.s.d_h,
            self.s.d_o,
            w[2],
            rows,
            self.hidden,
            10,
            false,
            false,
        )?;
        let n = (rows * self.hidden) as i32;
        self.launch(
            &self.f.relu_back,
            rows * self.hidden,
            &mut [arg(&self.s.d_h), arg(&self.s.h), arg(&n)],
        )?;
        self.gemm(
            gw1,
            self.s.d_h,
            self.s.xb,
            self.hidden,
            64,
            rows,
            true,
            false,
        )?;
        self.launch(
            &self.f.col_sum,
            self.hidden,
            &mut [arg(&self.s.d_h), arg(&gb1), arg(&r), arg(&hid)],
        )?;
        ready(B1)?;
        ready(W1)?;
        Ok(rows)
    }

    /// One training step on `idx`: forward, backward into DDP's bucket
    /// views (layer 2 first, as autograd produces them), finish, SGD.
    pub(crate) async fn step(
        &self,
        ddp: &mut Ddp<NcclBackend>,
        m: &DeviceModel,
        set: &DeviceSet,
        idx: &[u32],
        lr: f32,
    ) -> Result<(), BoxError> {
        let g = |i: usize| ddp.grad_device(i).map(|b| b.ptr());
        // (These views stay valid until finish: buckets move only there.)
        let grads = [g(W1)?, g(B1)?, g(W2)?, g(B2)?];
        self.forward_backward(params_of(m)?, grads, set, idx, |i| {
            Ok(ddp.mark_ready_in_place(i)?)
        })?;
        ddp.finish().await?;
        // The compute stream already waits for every bucket's all-reduce.
        // The views are read again: the first finish rebuilds the buckets.
        for p in [W1, B1, W2, B2] {
            let gptr = ddp.grad_device(p)?.ptr();
            let pb = m.param_buffer(p)?;
            let len = pb.len() as i32;
            self.launch(
                &self.f.sgd,
                pb.len(),
                &mut [arg(&pb.ptr()), arg(&gptr), arg(&lr), arg(&len)],
            )?;
        }
        Ok(())
    }

    /// One training step under a sharded strategy: both layers gathered on
    /// the device, backward into `m`'s gradient storage, each gradient
    /// handed to the strategy as it is written, then the strategy's step
    /// (SGD with momentum, CUDA kernels) on this rank's shard.
    pub(crate) async fn step_sharded(
        &self,
        sh: &mut Sharded,
        m: &DeviceModel,
        set: &DeviceSet,
        idx: &[u32],
    ) -> Result<(), BoxError> {
        let (l1, l2) = (sh.gather(0).await?, sh.gather(1).await?);
        let w = gathered_params(&l1, &l2)?;
        let g = |i: usize| m.grad_buffer(i).map(|b| b.ptr());
        let grads = [g(W1)?, g(B1)?, g(W2)?, g(B2)?];
        self.forward_backward(w, grads, set, idx, |i| {
            Ok(sh.mark_ready_device(i, &m.grad_buffer(i)?)?)
        })?;
        // The gathered layers are freed once the stream is past backward.
        drop((l1, l2));
        sh.step().await?;
        Ok(())
    }

    /// Counts correct predictions on `idx` into the device counter.
    /// `w`: the parameters' device addresses ([`params_of`],
    /// [`gathered_params`]).
    pub(crate) fn evaluate(
        &self,
        w: [u64; 4],
        set: &DeviceSet,
        idx: &[u32],
    ) -> Result<(), BoxError> {
        for chunk in idx.chunks(self.cap) {
            let rows = self.gather(set, chunk)?;
            self.forward(w, rows)?;
            let r = rows as i32;
            self.launch(
                &self.f.count_correct,
                rows,
                &mut [
                    arg(&self.s.o),
                    arg(&self.s.yb),
                    arg(&r),
                    arg(&self.s.correct),
                ],
            )?;
        }
        Ok(())
    }

    /// Reads and zeroes the loss sum and the correct count (waits for the
    /// compute stream).
    pub(crate) fn take_counters(&self) -> Result<(f64, f64), BoxError> {
        let mut v = [0f32; 2];
        let (a, b) = v.split_at_mut(1);
        // SAFETY: both counters are one live f32.
        unsafe {
            self.p.device.copy_to_host(
                consort::dtype::as_bytes_mut(a),
                self.s.loss,
                self.p.stream,
            )?;
            self.p.device.copy_to_host(
                consort::dtype::as_bytes_mut(b),
                self.s.correct,
                self.p.stream,
            )?;
            self.p.device.fill_zero(self.s.loss, 4, self.p.stream)?;
            self.p.device.fill_zero(self.s.correct, 4, self.p.stream)?;
        }
        Ok((f64::from(v[0]), f64::from(v[1])))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let s = &self.s;
        for ptr in [s.xb, s.yb, s.h, s.o, s.d_o, s.d_h, s.idx, s.loss, s.correct] {
            if ptr != 0 {
                // SAFETY: allocated in `new`, freed once, stream-ordered.
                let _ = unsafe { self.p.device.free(ptr, self.p.stream) };
            }
        }
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { blas::destroy_handle(self.blas as blas_sys::cublasHandle_t) };
    }
}

/// A sample set uploaded once: images `[n, 64]` and labels `[n]`.
pub(crate) struct DeviceSet {
    x: u64,
    y: u64,
    p: Placement,
}

impl DeviceSet {
    pub(crate) fn upload(p: &Placement, samples: &[Sample]) -> Result<Self, BoxError> {
        let xs: Vec<f32> = samples.iter().flat_map(|s| s.x).collect();
        let ys: Vec<i32> = samples.iter().map(|s| s.y as i32).collect();
        let x = p.device.alloc_zeroed(xs.len() * 4, p.stream)?;
        let y = p.device.alloc_zeroed(ys.len() * 4, p.stream)?;
        // SAFETY: the allocations hold exactly these bytes.
        unsafe {
            p.device
                .copy_from_host(x, consort::dtype::as_bytes(&xs), p.stream)?;
            p.device
                .copy_from_host(y, consort::dtype::as_bytes(&ys), p.stream)?;
        }
        Ok(DeviceSet { x, y, p: p.clone() })
    }
}

impl Drop for DeviceSet {
    fn drop(&mut self) {
        // SAFETY: allocated in `upload`, freed once, stream-ordered.
        unsafe {
            let _ = self.p.device.free(self.x, self.p.stream);
            let _ = self.p.device.free(self.y, self.p.stream);
        }
    }
}

/// The host model's parameters, uploaded (same names, shapes, values).
pub(crate) fn upload_model(p: &Placement, host: &PlainModel) -> Result<DeviceModel, BoxError> {
    let mut m = DeviceModel::new(p.clone());
    let sd = host.state_dict();
    for spec in consort::ddp::ParamSet::params(host) {
        let t = sd
            .tensors
            .get(&spec.name)
            .ok_or_else(|| format!("{} missing from the host model", spec.name))?;
        let v = t.to_vec::<f32>().ok_or("the MLP's parameters are f32")?;
        m.add_param(spec.name.clone(), spec.shape.clone(), &v)?;
    }
    Ok(m)
}

/// The model's parameter addresses, `[w1, b1, w2, b2]`.
pub(crate) fn params_of(m: &DeviceModel) -> Result<[u64; 4], BoxError> {
    let p = |i: usize| m.param_buffer(i).map(|b| b.ptr());
    Ok([p(W1)?, p(B1)?, p(W2)?, p(B2)?])
}

/// The parameter addresses of the two gathered layers (valid while they
/// live).
pub(crate) fn gathered_params(l1: &Gathered, l2: &Gathered) -> Result<[u64; 4], BoxError> {
    Ok([
        l1.param_device(W1)?.ptr(),
        l1.param_device(B1)?.ptr(),
        l2.param_device(W2)?.ptr(),
        l2.param_device(B2)?.ptr(),
    ])
}
