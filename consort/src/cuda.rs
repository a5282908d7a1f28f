//! [`CudaKernels`] (feature `nccl`), the sharded strategies' optimizer
//! kernels on CUDA, and the CUDA plumbing they are built with, which lives
//! in the NCCL backend's [`consort_nccl::cuda`] beside the device:
//! [`compile`] (NVRTC for the GPU at hand), [`probe_lib`], [`launch_1d`].
//!
//! Everything is loaded at run time, as the NCCL backend is: the build
//! needs no CUDA toolkit. [`CudaKernels`] runs `torch.optim.SGD` and
//! `torch.optim.AdamW` as one elementwise kernel each, per dtype, on the
//! model's compute stream, with the host step's arithmetic (the same
//! operations in the same order; compiled with `--fmad=false`, so no
//! multiply-add is fused that the host does in two roundings).

use std::{ffi::c_void, sync::Arc};

use consort_comm::{CommError, DType, Device, Placement};
use consort_ddp::{AdamW, DeviceStep, Sgd, ShardKernels};
pub use consort_nccl::cuda::{compile, launch_1d, probe_lib};
use consort_nccl::{
    CudaDevice,
    cudarc::driver::{CudaFunction, CudaModule, DriverError},
};

/// The optimizer kernels: one grid-stride loop per optimizer and dtype,
/// with the host step's operations in its order (see `consort_ddp`'s
/// `Sgd` and `AdamW`).
const OPTIM_KERNELS: &str = r#"
template <typename T>
__device__ void sgd_body(T* p, const T* g, T* buf, int has_buf, T lr, T mu, T keep, T wd,
                         int has_wd, int first, int nesterov, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        T d = g[i];
        if (has_wd) d = d + wd * p[i];
        if (has_buf) {
            T b = first ? d : mu * buf[i] + keep * d;
            buf[i] = b;
            d = nesterov ? d + mu * b : b;
        }
        p[i] = p[i] - lr * d;
    }
}

template <typename T>
__device__ void adamw_body(T* p, const T* g, T* m, T* v, T decay, T b1, T b2, T c1, T c2,
                           T step_size, T bc2_sqrt, T eps, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        T gi = g[i];
        T pi = p[i] * decay;
        T mi = b1 * m[i] + c1 * gi;
        T vi = b2 * v[i] + (c2 * gi) * gi;
        T denom = sqrt(vi) / bc2_sqrt + eps;
        p[i] = pi - step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
}

#define SGD(name, T) extern "C" __global__ void name(T* p, const T* g, T* buf, int has_buf, \
    T lr, T mu, T keep, T wd, int has_wd, int first, int nesterov, long long n) { \
    sgd_body<T>(p, g, buf, has_buf, lr, mu, keep, wd, has_wd, first, nesterov, n); }
#define ADAMW(name, T) extern "C" __global__ void name(T* p, const T* g, T* m, T* v, T decay, \
    T b1, T b2, T c1, T c2, T step_size, T bc2_sqrt, T eps, long long n) { \
    adamw_body<T>(p, g, m, v, decay, b1, b2, c1, c2, step_size, bc2_sqrt, eps, n); }

SGD(sgd_f32, float)
SGD(sgd_f64, double)
ADAMW(adamw_f32, float)
ADAMW(adamw_f64, double)

// Mixed precision: f32 (0), bf16 (1) and f16 (2), rounded to nearest even.
__device__ float bf16_to_f(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ unsigned short f_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ float f16_to_f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ unsigned short f_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

extern "C" __global__ void cast(const void* src, int from, void* dst, int to, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        float v;
        if (from == 0) v = ((const float*)src)[i];
        else if (from == 1) v = bf16_to_f(((const unsigned short*)src)[i]);
        else v = f16_to_f(((const unsigned short*)src)[i]);
        if (to == 0) ((float*)dst)[i] = v;
        else if (to == 1) ((unsigned short*)dst)[i] = f_to_bf16(v);
        else ((unsigned short*)dst)[i] = f_to_f16(v);
    }
}

extern "C" __global__ void unscale(float* g, float inv, int* found, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = g[i];
        if (!isfinite(v)) *found = 1;
        g[i] = v * inv;
    }
}
"#;

/// The sharded strategies' optimizer kernels on one CUDA device: pass it
/// as `ShardOptions::kernels` for a model on that device.
pub struct CudaKernels {
    dev: Arc<CudaDevice>,
    _module: Arc<CudaModule>,
    sgd: [CudaFunction; 2],
    adamw: [CudaFunction; 2],
    cast: CudaFunction,
    unscale: CudaFunction,
}

impl std::fmt::Debug for CudaKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKernels")
            .field("device", &self.dev.ordinal())
            .finish_non_exhaustive()
    }
}

/// A kernel argument: a pointer to its value.
fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

/// Runs `f` with the kernel's scalars converted to `T` (f32 or f64).
trait Scalar: Copy {
    fn of(v: f64) -> Self;
}

impl Scalar for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
}

impl Scalar for f64 {
    fn of(v: f64) -> Self {
        v
    }
}

impl CudaKernels {
    /// Compiles the kernels for `dev` (NVRTC, loaded at run time).
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Arc<Self>, String> {
        let module = compile(
            dev,
            OPTIM_KERNELS,
            &["--fmad=false"],
            "the optimizer kernels",
        )?;
        let load = |n: &str| {
            module
                .load_function(n)
                .map_err(|e| format!("the optimizer kernel {n}: {e:?}"))
        };
        Ok(Arc::new(CudaKernels {
            dev: dev.clone(),
            sgd: [load("sgd_f32")?, load("sgd_f64")?],
            adamw: [load("adamw_f32")?, load("adamw_f64")?],
            cast: load("cast")?,
            unscale: load("unscale")?,
            _module: module,
        }))
    }

    /// Which of a pair serves `s`'s dtype, after checking its device.
    fn pick<'k>(
        &self,
        pair: &'k [CudaFunction; 2],
        s: &DeviceStep<'_>,
    ) -> Result<&'k CudaFunction, CommError> {
        self.ours(s.place())?;
        match s.dtype() {
            DType::F32 => Ok(&pair[0]),
            DType::F64 => Ok(&pair[1]),
            d => Err(CommError::invalid(format!(
                "the optimizer kernels step f32 and f64 shards, not {d}"
            ))),
        }
    }

    /// Refuses a placement on another device: its addresses and stream
    /// mean nothing to this context.
    fn ours(&self, place: &Placement) -> Result<(), CommError> {
        if place.device.ordinal() != self.dev.ordinal() || place.device.kind() != "cuda" {
            return Err(CommError::invalid(format!(
                "CUDA kernels of device {} were given memory of {} device {}: make the kernels \
                 on the model's device (CudaKernels::new(&that_device))",
                self.dev.ordinal(),
                place.device.kind(),
                place.device.ordinal()
            )));
        }
        Ok(())
    }

    /// Launches `f` over `len` elements on `place`'s compute stream.
    fn launch(
        &self,
        f: &CudaFunction,
        (place, len): (&Placement, usize),
        args: &mut [*mut c_void],
    ) -> Result<(), CommError> {
        let fail =
            |e: DriverError| CommError::invalid(format!("launching an optimizer kernel: {e:?}"));
        // SAFETY: every argument points at a value of the kernel's
        // parameter type (device addresses as u64, flags as i32, scalars
        // as the shard's float type, the count as i64), alive until the
        // launch returns (arguments are copied at launch); the addresses
        // hold `len` live elements on this device (`DeviceStep`'s, checked
        // by `pick`, or the callers' of the unsafe `cast` and `unscale`),
        // and the stream is this device's compute stream.
        unsafe { launch_1d(&self.dev, f, (place.stream, len), args) }.map_err(fail)
    }

    fn sgd_typed<T: Scalar>(
        &self,
        f: &CudaFunction,
        s: &DeviceStep<'_>,
        o: &Sgd,
    ) -> Result<(), CommError> {
        let (p, g, n) = (s.params(), s.grads(), s.len() as i64);
        let buf = s.state().first().copied().unwrap_or(0);
        let has_buf = i32::from(!s.state().is_empty());
        let (lr, mu, keep, wd) = (
            T::of(o.lr),
            T::of(o.momentum),
            T::of(1.0 - o.dampening),
            T::of(o.weight_decay),
        );
        let has_wd = i32::from(o.weight_decay != 0.0);
        let first = i32::from(s.step() <= 1);
        let nesterov = i32::from(o.nesterov);
        let mut args = [
            arg(&p),
            arg(&g),
            arg(&buf),
            arg(&has_buf),
            arg(&lr),
            arg(&mu),
            arg(&keep),
            arg(&wd),
            arg(&has_wd),
            arg(&first),
            arg(&nesterov),
            arg(&n),
        ];
        self.launch(f, (s.place(), s.len()), &mut args)
    }

    fn adamw_typed<T: Scalar>(
        &self,
        f: &CudaFunction,
        s: &DeviceStep<'_>,
        o: &AdamW,
    ) -> Result<(), CommError> {
        let [m, v] = s.state() else {
            return Err(CommError::invalid("AdamW keeps two state slots"));
        };
        let (p, g, n) = (s.params(), s.grads(), s.len() as i64);
        let t = s.step().max(1) as i32;
        let bc1 = 1.0 - o.beta1.powi(t);
        let bc2 = 1.0 - o.beta2.powi(t);
        let decay = T::of(1.0 - o.lr * o.weight_decay);
        let (b1, b2) = (T::of(o.beta1), T::of(o.beta2));
        let (c1, c2) = (T::of(1.0 - o.beta1), T::of(1.0 - o.beta2));
        let step_size = T::of(o.lr / bc1);
        let bc2_sqrt = T::of(bc2.sqrt());
        let eps = T::of(o.eps);
        let mut args = [
            arg(&p),
            arg(&g),
            arg(m),
            arg(v),
            arg(&decay),
            arg(&b1),
            arg(&b2),
            arg(&c1),
            arg(&c2),
            arg(&step_size),
            arg(&bc2_sqrt),
            arg(&eps),
            arg(&n),
        ];
        self.launch(f, (s.place(), s.len()), &mut args)
    }
}

/// The cast kernel's code for a dtype, if it has one.
fn cast_code(d: DType) -> Option<i32> {
    match d {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

impl ShardKernels for CudaKernels {
    fn name(&self) -> &str {
        "cuda (NVRTC)"
    }

    fn check_place(&self, place: &Placement) -> Result<(), CommError> {
        self.ours(place)
    }

    unsafe fn cast(
        &self,
        place: &Placement,
        (src, from): (u64, DType),
        (dst, to): (u64, DType),
        len: usize,
    ) -> Result<(), CommError> {
        self.ours(place)?;
        let (Some(f), Some(t)) = (cast_code(from), cast_code(to)) else {
            // f64 and the rest: through the host, correct and slow.
            // SAFETY: forwarded to the caller.
            return unsafe { consort_ddp::shard::staged_cast(place, (src, from), (dst, to), len) };
        };
        if len == 0 {
            return Ok(());
        }
        let n = len as i64;
        let mut args = [arg(&src), arg(&f), arg(&dst), arg(&t), arg(&n)];
        self.launch(&self.cast, (place, len), &mut args)
    }

    unsafe fn unscale(
        &self,
        place: &Placement,
        ptr: u64,
        len: usize,
        factor: f64,
    ) -> Result<bool, CommError> {
        self.ours(place)?;
        if len == 0 {
            return Ok(false);
        }
        let (dev, stream) = (&place.device, place.stream);
        let flag = dev.alloc_zeroed(4, stream)?;
        let (inv, n) = (factor as f32, len as i64);
        let mut args = [arg(&ptr), arg(&inv), arg(&flag), arg(&n)];
        let launched = self.launch(&self.unscale, (place, len), &mut args);
        let mut found = [0i32];
        // SAFETY: `flag` holds one i32 on this device; the copy waits for
        // the kernel on the same stream.
        let read = launched.and_then(|()| unsafe {
            dev.copy_to_host(consort_comm::dtype::as_bytes_mut(&mut found), flag, stream)
        });
        // SAFETY: allocated above, freed once after its last use.
        unsafe { dev.free(flag, stream) }?;
        read.map(|()| found[0] != 0)
    }

    fn sgd(&self, s: &DeviceStep<'_>, opt: &Sgd) -> Result<(), CommError> {
        if s.is_empty() {
            return Ok(());
        }
        let f = self.pick(&self.sgd, s)?;
        match s.dtype() {
            DType::F32 => self.sgd_typed::<f32>(f, s, opt),
            _ => self.sgd_typed::<f64>(f, s, opt),
        }
    }

    fn adamw(&self, s: &DeviceStep<'_>, opt: &AdamW) -> Result<(), CommError> {
        if s.is_empty() {
            return Ok(());
        }
        let f = self.pick(&self.adamw, s)?;
        match s.dtype() {
            DType::F32 => self.adamw_typed::<f32>(f, s, opt),
            _ => self.adamw_typed::<f64>(f, s, opt),
        }
    }
}
