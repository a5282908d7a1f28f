//! `consort bench sharded --device cuda|emulated`: the strategies' step
//! time with the model on the device, and each rank's device memory.
//!
//! As one rank of a launched job, rank 0 prints the median step (the
//! slowest rank's, the device synchronized) of DDP and every sharded
//! strategy, with the model of the host bench (`--params` f32 in
//! `--layers` layers, one wrapping unit each), AdamW, and a synthetic
//! backward on the device (`--work` multiply-adds per element, last layer
//! first), as `scripts/torch_sharded_bench.py --device cuda` runs torch's
//! DDP and FSDP2. The bytes each rank holds after a step, and the peak of
//! its stream-ordered allocations during the timed steps (torch's
//! `max_memory_allocated`), are reported beside it: from CUDA's pool (NCCL,
//! feature `nccl`), or from the emulated device's count (no GPU), which
//! frees in stream order as CUDA's pool does. `--mixed bf16|f16` runs the sharded
//! strategies with mixed precision (DDP stays f32), as the anchor's
//! `--mixed` runs FSDP2 with a `MixedPrecisionPolicy`.

use std::{sync::Arc, time::Instant};

use consort::{
    Backend, DType, DeviceBuffer, Placement,
    ddp::{
        AdamW, Ddp, DdpOptions, DeviceModel, DeviceStep, MixedPrecision, ShardKernels,
        ShardOptimizer, ShardOptions, Sharded, StagedKernels, Strategy,
    },
};
use serde_json::json;

use super::sharded::{name, slowest, strategies};
use crate::table::Table;

type BoxError = Box<dyn std::error::Error>;

/// The synthetic backward: `grad = f(param)` elementwise on the compute
/// stream (`x = p + bias`, then `work` times `x = x * 0.999 + 0.001`).
pub(super) type Backward =
    Box<dyn Fn(&DeviceBuffer, &DeviceBuffer, usize, f32) -> Result<(), BoxError>>;

/// A memory reading: bytes now, and the peak since the last reset where
/// the device keeps one.
pub(super) type Reading = (u64, Option<u64>);

/// Where the bench runs: the backend, the model's device and stream, the
/// optimizer kernels, the synthetic backward, and the memory reading
/// (bytes now, and the peak since the last reset where the device keeps
/// one).
pub(super) struct Rig {
    pub(super) device_name: &'static str,
    pub(super) backend: Arc<dyn Backend>,
    pub(super) place: Placement,
    pub(super) kernels: Arc<dyn ShardKernels>,
    pub(super) backward: Backward,
    pub(super) memory: Box<dyn Fn() -> Result<Reading, BoxError>>,
    pub(super) reset_peak: Box<dyn Fn() -> Result<(), BoxError>>,
    /// Shuts the backend down (NCCL's communicator is finalized, not
    /// aborted as a dropped one is).
    pub(super) close: Box<dyn Fn() -> Result<(), BoxError>>,
}

impl Rig {
    /// Shuts the backend down, then lets everything go.
    pub(super) fn finish(self) -> Result<(), BoxError> {
        (self.close)()
    }
}

/// The rig of `--device cuda` or `--device emulated`.
pub(super) async fn rig(dist: &consort::Dist, device: &str) -> Result<Rig, BoxError> {
    match device {
        "cuda" => cuda(dist).await,
        "emulated" => emulated(dist).await,
        other => Err(format!("unknown --device {other:?}: expected cpu, cuda or emulated").into()),
    }
}

/// The emulated device's rig: host arithmetic on its memory.
async fn emulated(dist: &consort::Dist) -> Result<Rig, BoxError> {
    let comm = dist.emulated_comm().await?;
    let device = comm.device().clone();
    let stream = consort::Device::new_stream(&*device)?;
    let place = Placement {
        device: device.clone(),
        stream,
    };
    let p = place.clone();
    let backward: Backward = Box::new(move |param, grad, work, bias| {
        let mut x = vec![0f32; param.len()];
        let d = &p.device;
        // SAFETY: `param` and `grad` are live views of `len` f32 (the
        // model's parameter and its gradient storage) on this device.
        unsafe {
            d.copy_to_host(consort::dtype::as_bytes_mut(&mut x), param.ptr(), p.stream)?;
        }
        let mut g = vec![0f32; x.len()];
        super::ddp::backward_layer(&x, &mut g, work, bias);
        // SAFETY: as above.
        unsafe { d.copy_from_host(grad.ptr(), consort::dtype::as_bytes(&g), p.stream) }?;
        Ok(())
    });
    let (dev, dev2) = (device.clone(), device.clone());
    Ok(Rig {
        device_name: "emulated",
        backend: Arc::new(comm),
        place,
        kernels: Arc::new(StagedKernels),
        backward,
        memory: Box::new(move || {
            let peak = dev.peak_allocated_bytes() as u64;
            Ok((dev.allocated_bytes() as u64, Some(peak)))
        }),
        reset_peak: Box::new(move || {
            dev2.reset_peak();
            Ok(())
        }),
        close: Box::new(|| Ok(())),
    })
}

/// CUDA's rig: NCCL, the NVRTC optimizer kernels, a synthetic-backward
/// kernel, and the memory pool's peak.
#[cfg(feature = "nccl")]
async fn cuda(dist: &consort::Dist) -> Result<Rig, BoxError> {
    use consort::{Device, nccl::CudaDevice};
    const SRC: &str = r#"
extern "C" __global__ void synthetic_backward(const float* p, float* g, int work, float bias,
                                              long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        float x = p[i] + bias;
        for (int k = 0; k < work; k++) x = x * 0.999f + 0.001f;
        g[i] = x;
    }
}
"#;
    let b = dist.nccl_backend(None).await?;
    let dev = CudaDevice::new(b.device())?;
    let place = Placement {
        device: dev.clone(),
        stream: dev.new_stream()?,
    };
    let module = consort::cuda::compile(&dev, SRC, &[], "the bench's synthetic backward")?;
    let f = module
        .load_function("synthetic_backward")
        .map_err(|e| format!("synthetic_backward: {e:?}"))?;
    let (d, stream) = (dev.clone(), place.stream);
    let backward: Backward = Box::new(move |param, grad, work, bias| {
        let _keep = &module;
        let (p, g, n, w) = (param.ptr(), grad.ptr(), param.len() as i64, work as i32);
        let arg = |v: *const std::ffi::c_void| v.cast_mut();
        let mut args = [
            arg((&p as *const u64).cast()),
            arg((&g as *const u64).cast()),
            arg((&w as *const i32).cast()),
            arg((&bias as *const f32).cast()),
            arg((&n as *const i64).cast()),
        ];
        // SAFETY: the arguments point at values of the kernel's parameter
        // types, alive through the launch; `p` and `g` are live device
        // views of `n` f32 on this device's compute stream.
        unsafe { consort::cuda::launch_1d(&d, &f, (stream, param.len()), &mut args) }
            .map_err(|e| format!("synthetic_backward: {e:?}"))?;
        Ok(())
    });
    let kernels = consort::cuda::CudaKernels::new(&dev)?;
    let (m, r) = (dev.clone(), dev.clone());
    let b = Arc::new(b);
    let nccl = b.clone();
    Ok(Rig {
        device_name: "cuda",
        backend: b,
        place,
        kernels,
        backward,
        memory: Box::new(move || {
            let (now, peak) = m.pool_usage()?;
            Ok((now, Some(peak)))
        }),
        reset_peak: Box::new(move || Ok(r.reset_peak()?)),
        close: Box::new(move || Ok(nccl.shutdown()?)),
    })
}

#[cfg(not(feature = "nccl"))]
async fn cuda(_: &consort::Dist) -> Result<Rig, BoxError> {
    Err("--device cuda needs consort built with the `nccl` feature".into())
}

/// A device model of `params` f32 in `layers` layers (zeros, as torch's
/// anchor starts).
pub(super) fn model(rig: &Rig, params: usize, layers: usize) -> Result<DeviceModel, BoxError> {
    let layers = layers.max(1);
    let per = params / layers;
    let mut m = DeviceModel::new(rig.place.clone());
    for l in 0..layers {
        let n = if l + 1 == layers {
            params - per * l
        } else {
            per
        };
        m.add_param(format!("layers.{l}.weight"), vec![n], &vec![0f32; n])?;
    }
    Ok(m)
}

/// One timed step's wall time: the device synchronized, the slowest
/// rank's.
async fn timed(rig: &Rig, t: Instant) -> Result<f64, BoxError> {
    consort::Device::synchronize(&*rig.place.device, rig.place.stream)?;
    slowest(&rig.backend, t.elapsed().as_secs_f64() * 1e3).await
}

/// The median step under a sharded strategy, and the memory reading.
async fn sharded_steps(
    rig: &Rig,
    s: Strategy,
    (params, layers, work, iters): (usize, usize, usize, usize),
    mixed: Option<MixedPrecision>,
) -> Result<(f64, Reading), BoxError> {
    let bias = rig.backend.rank() as f32 * 1e-3;
    let mut m = model(rig, params, layers)?;
    let units = (0..m.len()).map(|l| vec![l]).collect();
    let mut opts = ShardOptions::new(s)
        .units(units)
        .kernels(rig.kernels.clone());
    if let Some(mp) = mixed {
        opts = opts.mixed_precision(mp);
    }
    let mut sh = Sharded::new(rig.backend.clone(), &mut m, AdamW::new(1e-3), opts).await?;
    // The shards are the parameters now (torch's FSDP2 replaces them with
    // its DTensors): the model's own storage goes.
    let sizes: Vec<usize> = sh.params().iter().map(|p| p.numel()).collect();
    drop(m);
    time_steps(rig, iters, async || {
        // The forward: each unit's whole parameters while it runs. FSDP
        // and HSDP free them after it (FSDP2's reshard_after_forward) and
        // gather them again for the backward; ZeRO's are views of the
        // parameters it keeps.
        let mut gathered = Vec::new();
        for l in 0..sizes.len() {
            let p = sh.gather(l).await?;
            if !s.shards_params() {
                gathered.push(p);
            }
        }
        for l in (0..sizes.len()).rev() {
            let p = if s.shards_params() {
                sh.gather(l).await?
            } else {
                gathered[l].clone()
            };
            backward_into(rig, &mut sh, (&p, l, sizes[l]), (work, bias))?;
        }
        drop(gathered);
        Ok(sh.step().await?)
    })
    .await
}

/// Layer `l`'s synthetic backward from its gathered parameters `p`, into a
/// gradient that lives from its backward to its mark_ready (as autograd's
/// does under FSDP2), in the compute dtype.
fn backward_into(
    rig: &Rig,
    sh: &mut Sharded,
    (p, l, n): (&consort::ddp::shard::Gathered, usize, usize),
    work: (usize, f32),
) -> Result<(), BoxError> {
    let (dev, stream) = (&rig.place.device, rig.place.stream);
    let d = sh.compute_dtype().unwrap_or(DType::F32);
    let ptr = dev.alloc_zeroed(n * d.size_bytes(), stream)?;
    // SAFETY: `ptr` was just allocated with `n` elements of `d`.
    let grad = unsafe { rig.place.buffer(ptr, n, d) };
    let made = backward_in(rig, &p.param_device(l)?, &grad, work);
    let marked = made.and_then(|()| Ok(sh.mark_ready_device(l, &grad)?));
    // SAFETY: freed once, on the compute stream, after the backward and
    // the copy into the staging buffer enqueued there.
    unsafe { dev.free(ptr, stream) }?;
    marked
}

/// Times `step` `iters` times after one warm-up (the device synchronized,
/// the slowest rank's), the peak reset after the warm-up; the median and
/// the memory reading.
pub(super) async fn time_steps<F>(
    rig: &Rig,
    iters: usize,
    mut step: F,
) -> Result<(f64, Reading), BoxError>
where
    F: AsyncFnMut() -> Result<(), BoxError>,
{
    let mut times = Vec::new();
    for it in 0..=iters {
        if it == 1 {
            (rig.reset_peak)()?;
        }
        let t = Instant::now();
        step().await?;
        let ms = timed(rig, t).await?;
        if it > 0 {
            times.push(ms);
        }
    }
    Ok((median(times), (rig.memory)()?))
}

/// The synthetic backward in the parameter's dtype: as it is for f32; for
/// mixed precision's half types the parameter is widened into f32 scratch,
/// the f32 backward runs there, and the gradient is rounded back (the
/// device's cast kernels).
fn backward_in(
    rig: &Rig,
    param: &DeviceBuffer,
    grad: &DeviceBuffer,
    (work, bias): (usize, f32),
) -> Result<(), BoxError> {
    let d = param.dtype();
    if d == DType::F32 {
        return (rig.backward)(param, grad, work, bias);
    }
    let (dev, stream, n) = (&rig.place.device, rig.place.stream, param.len());
    let (tp, tg) = (
        dev.alloc_zeroed(n * 4, stream)?,
        dev.alloc_zeroed(n * 4, stream)?,
    );
    // `tp` and `tg` were just allocated with `n` f32; `param` and `grad` are
    // live views of `n` elements of `d` on this device.
    let run = || -> Result<(), BoxError> {
        let k = &rig.kernels;
        // SAFETY: as above: `param` holds `n` of `d`, `tp` `n` f32.
        unsafe { k.cast(&rig.place, (param.ptr(), d), (tp, DType::F32), n) }?;
        // SAFETY: as above: both scratch buffers hold `n` f32.
        let (p32, g32) = unsafe {
            (
                rig.place.buffer(tp, n, DType::F32),
                rig.place.buffer(tg, n, DType::F32),
            )
        };
        (rig.backward)(&p32, &g32, work, bias)?;
        // SAFETY: as above: `tg` holds `n` f32, `grad` `n` of `d`.
        unsafe { k.cast(&rig.place, (tg, DType::F32), (grad.ptr(), d), n) }?;
        Ok(())
    };
    let out = run();
    for t in [tp, tg] {
        // SAFETY: allocated above, freed once after the casts enqueued on
        // the same stream.
        unsafe { dev.free(t, stream) }?;
    }
    out
}

/// The median step under DDP (gradients as bucket views, then AdamW with
/// the device's kernels on every parameter), and the memory reading.
async fn ddp_steps(
    rig: &Rig,
    (params, layers, work, iters): (usize, usize, usize, usize),
) -> Result<(f64, Reading), BoxError> {
    let bias = rig.backend.rank() as f32 * 1e-3;
    let mut m = model(rig, params, layers)?;
    let n = m.len();
    let mut ddp = Ddp::new(rig.backend.clone(), &mut m, DdpOptions::default()).await?;
    let opt = AdamW::new(1e-3);
    // AdamW's two slots per parameter, on the device.
    let mut slots = DeviceModel::new(rig.place.clone());
    for l in 0..n {
        let len = m.param_buffer(l)?.len();
        slots.add_param(format!("m{l}"), vec![len], &vec![0f32; len])?;
    }
    let mut step = 0u64;
    time_steps(rig, iters, async || {
        step += 1;
        for l in (0..n).rev() {
            let grad = ddp.grad_device(l)?;
            (rig.backward)(&m.param_buffer(l)?, &grad, work, bias)?;
            ddp.mark_ready_in_place(l)?;
        }
        ddp.finish().await?;
        for l in 0..n {
            let (p, g) = (m.param_buffer(l)?, ddp.grad_device(l)?);
            // The slot model's parameter and gradient storage: m and v.
            let state = [slots.param_buffer(l)?.ptr(), slots.grad_buffer(l)?.ptr()];
            // SAFETY: the parameter, its averaged gradient (a bucket view,
            // valid until the next finish) and both slots hold `len` live
            // f32 on this device, ready on the compute stream.
            let s = unsafe {
                DeviceStep::new(
                    &rig.place,
                    DType::F32,
                    p.len(),
                    step,
                    (p.ptr(), g.ptr()),
                    &state,
                )
            };
            opt.step_device(&*rig.kernels, &s)?;
        }
        Ok(())
    })
    .await
}

/// A memory reading's two table cells, in MiB: bytes held, and the peak
/// (`-` where the device keeps none).
pub(super) fn mem_cells((now, peak): Reading) -> [serde_json::Value; 2] {
    let mib = |b: u64| format!("{:.1}", b as f64 / (1u64 << 20) as f64);
    [json!(mib(now)), json!(peak.map_or("-".into(), mib))]
}

/// `bf16` or `f16`, as `--mixed` and torch's anchor name them.
pub(super) fn half_name(d: DType) -> &'static str {
    if d == DType::F16 { "f16" } else { "bf16" }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// As one rank of a launched job, on `device` (`cuda` or `emulated`):
/// every strategy's step time and memory; rank 0 returns the table.
pub(crate) async fn steps(
    device: &str,
    (params, layers, work, iters): (usize, usize, usize, usize),
    mixed: Option<MixedPrecision>,
) -> Result<Option<Table>, BoxError> {
    let dist = consort::init_from_env().await?;
    let rig = rig(&dist, device).await?;
    let world = rig.backend.world_size();
    let mut t = Table::new(&[
        "backend", "device", "world", "params", "strategy", "step_ms", "vs_ddp", "mem_mib",
        "peak_mib",
    ]);
    let mut base = None;
    let shape = (params, layers, work, iters);
    for s in strategies(world) {
        let (ms, (now, peak)) = match s {
            None => ddp_steps(&rig, shape).await?,
            Some(s) => sharded_steps(&rig, s, shape, mixed).await?,
        };
        let b = *base.get_or_insert(ms);
        let [mem, peak] = mem_cells((now, peak));
        t.push(vec![
            json!(rig.backend.name()),
            json!(rig.device_name),
            json!(world),
            json!(params),
            json!(match (s, mixed) {
                (Some(_), Some(mp)) => format!("{}+{}", name(s), half_name(mp.param_dtype)),
                _ => name(s),
            }),
            json!(format!("{ms:.2}")),
            json!(format!("{:.2}", ms / b)),
            mem,
            peak,
        ]);
    }
    let rank = rig.backend.rank();
    rig.finish()?;
    dist.shutdown().await?;
    Ok((rank == 0).then_some(t))
}
