//! The sharded strategies' CUDA side on a real GPU (feature `nccl`).
//! Ignored by default (CI has no GPU); `scripts/gpu-check` runs them:
//!
//! ```sh
//! cargo test -p consort --features nccl --test cuda_kernels -- --ignored --test-threads 1
//! ```
//!
//! - `consort::cuda::CudaKernels` steps SGD (momentum, dampening,
//!   Nesterov, weight decay) and AdamW bit for bit as the host steps do,
//!   in f32 and f64, over several steps and lengths 1, 1000 and 300001.
//! - Every sharded strategy with the model on the GPU (world 1 over NCCL,
//!   the CUDA kernels) trains as the host strategy does.
#![cfg(feature = "nccl")]

use std::{sync::Arc, time::Duration};

use consort::{
    Device, Placement,
    cuda::CudaKernels,
    ddp::{
        AdamW, DeviceModel, DeviceStep, PlainModel, Sgd, ShardOptimizer, ShardOptions, Sharded,
        Strategy,
    },
    nccl::{CudaDevice, NcclBackend, NcclOptions},
};

fn gpu() -> (Arc<CudaDevice>, Placement) {
    let dev = CudaDevice::new(0).expect("GPU 0");
    let place = Placement {
        device: dev.clone(),
        stream: dev.new_stream().expect("a stream"),
    };
    (dev, place)
}

/// Deterministic values in about [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// A host step of one element type.
type HostStep<T> = fn(&dyn ShardOptimizer, u64, &mut [T], &[T], &mut [&mut [T]]);

/// Runs `opt` for 4 steps on the host and through `kernels` on the GPU,
/// from the same values; both results, as f64.
fn both<T: consort::Element + Copy + Default>(
    opt: &dyn ShardOptimizer,
    kernels: &CudaKernels,
    place: &Placement,
    n: usize,
    of: fn(f64) -> T,
    step_host: HostStep<T>,
) -> (Vec<T>, Vec<T>) {
    let dtype = T::DTYPE;
    let mut p: Vec<T> = values(n, 1).into_iter().map(of).collect();
    let mut slots: Vec<Vec<T>> = (0..opt.slots()).map(|_| vec![T::default(); n]).collect();
    let dev = &place.device;
    let alloc = |v: &[T]| {
        let ptr = dev
            .alloc_zeroed(n * dtype.size_bytes(), place.stream)
            .unwrap();
        // SAFETY: `ptr` holds `n` elements.
        unsafe { dev.copy_from_host(ptr, consort::dtype::as_bytes(v), place.stream) }.unwrap();
        ptr
    };
    let dp = alloc(&p);
    let dg = alloc(&vec![T::default(); n]);
    let ds: Vec<u64> = slots.iter().map(|s| alloc(s)).collect();
    for step in 1..=4u64 {
        let g: Vec<T> = values(n, step + 10).into_iter().map(of).collect();
        // SAFETY: `dg` holds `n` elements.
        unsafe { dev.copy_from_host(dg, consort::dtype::as_bytes(&g), place.stream) }.unwrap();
        let mut refs: Vec<&mut [T]> = slots.iter_mut().map(Vec::as_mut_slice).collect();
        step_host(opt, step, &mut p, &g, &mut refs);
        // SAFETY: every address holds `n` live elements on this device.
        let s = unsafe { DeviceStep::new(place, dtype, n, step, (dp, dg), &ds) };
        opt.step_device(kernels, &s).unwrap();
    }
    let mut got = vec![T::default(); n];
    // SAFETY: `dp` holds `n` elements.
    unsafe { dev.copy_to_host(consort::dtype::as_bytes_mut(&mut got), dp, place.stream) }.unwrap();
    for ptr in [dp, dg].into_iter().chain(ds) {
        // SAFETY: allocated above, freed once.
        unsafe { dev.free(ptr, place.stream) }.unwrap();
    }
    (p, got)
}

#[test]
#[ignore = "needs a GPU, libcuda and NVRTC (scripts/gpu-check)"]
fn cuda_optimizer_kernels_step_bit_for_bit_as_the_host() {
    let (dev, place) = gpu();
    let kernels = CudaKernels::new(&dev).expect("NVRTC kernels");
    let mut nesterov = Sgd::new(0.05).momentum(0.9).weight_decay(0.01);
    nesterov.nesterov = true;
    let mut damped = Sgd::new(0.1).momentum(0.5);
    damped.dampening = 0.25;
    let opts: Vec<Box<dyn ShardOptimizer>> = vec![
        Box::new(Sgd::new(0.1)),
        Box::new(damped),
        Box::new(nesterov),
        Box::new(AdamW::new(0.01)),
        Box::new(AdamW {
            weight_decay: 0.0,
            ..AdamW::new(1e-3)
        }),
    ];
    for opt in &opts {
        for n in [1usize, 1000, 300_001] {
            let (want, got) = both::<f32>(
                &**opt,
                &kernels,
                &place,
                n,
                |v| v as f32,
                |o, s, p, g, st| o.step_f32(s, p, g, st),
            );
            let bad = want
                .iter()
                .zip(&got)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                bad.is_none(),
                "{opt:?} f32 n={n}: element {bad:?} differs: {:?}",
                bad.map(|i| (want[i], got[i]))
            );
            let (want, got) = both::<f64>(
                &**opt,
                &kernels,
                &place,
                n,
                |v| v,
                |o, s, p, g, st| o.step_f64(s, p, g, st),
            );
            let bad = want
                .iter()
                .zip(&got)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                bad.is_none(),
                "{opt:?} f64 n={n}: element {bad:?} differs: {:?}",
                bad.map(|i| (want[i], got[i]))
            );
        }
    }
}

/// One rank's three steps of a small model under `strategy`: on the GPU
/// (NCCL at world 1, CUDA kernels) or on the host; final parameters.
async fn train(strategy: Strategy, on_gpu: bool) -> Vec<Vec<f32>> {
    let sizes = [7usize, 3, 1000, 13];
    let init: Vec<Vec<f32>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            values(n, i as u64 + 100)
                .into_iter()
                .map(|v| v as f32)
                .collect()
        })
        .collect();
    let units = vec![vec![0, 1], vec![2], vec![3]];
    let opt = AdamW::new(0.01);
    let grads = |step: usize, p: usize| -> Vec<f32> {
        values(sizes[p], (step * 10 + p) as u64)
            .into_iter()
            .map(|v| v as f32)
            .collect()
    };
    if !on_gpu {
        let mut m = PlainModel::new();
        for (i, v) in init.iter().enumerate() {
            m.add_param(format!("p{i}"), vec![v.len()], v).unwrap();
        }
        let b = consort::sim::SimWorld::new(consort::sim::SimConfig::new(1)).unwrap();
        let rank: Arc<dyn consort::Backend> = Arc::new(b.ranks().remove(0));
        let opts = ShardOptions::new(strategy).units(units);
        let mut sh = Sharded::new(rank, &mut m, opt, opts).await.unwrap();
        for step in 0..3 {
            for p in (0..sizes.len()).rev() {
                sh.mark_ready(p, &grads(step, p)).unwrap();
            }
            sh.step().await.unwrap();
        }
        sh.copy_params_to(&mut m).await.unwrap();
        return (0..sizes.len())
            .map(|i| m.param::<f32>(i).unwrap().to_vec())
            .collect();
    }
    let (dev, place) = gpu();
    let store = consort::store::MemStore::new(Duration::from_secs(30));
    let b = NcclBackend::new(&store, 0, 1, NcclOptions::default())
        .await
        .expect("NCCL");
    let mut m = DeviceModel::new(place);
    for (i, v) in init.iter().enumerate() {
        m.add_param(format!("p{i}"), vec![v.len()], v).unwrap();
    }
    let kernels = CudaKernels::new(&dev).expect("NVRTC kernels");
    let opts = ShardOptions::new(strategy).units(units).kernels(kernels);
    let mut sh = Sharded::new(Arc::new(b), &mut m, opt, opts).await.unwrap();
    for step in 0..3 {
        for p in (0..sizes.len()).rev() {
            m.write_grad(p, &grads(step, p)).unwrap();
            sh.mark_ready_device(p, &m.grad_buffer(p).unwrap()).unwrap();
        }
        sh.step().await.unwrap();
    }
    sh.copy_params_to(&mut m).await.unwrap();
    (0..sizes.len())
        .map(|i| m.read_param::<f32>(i).unwrap())
        .collect()
}

#[test]
#[ignore = "needs a GPU, libcuda, NCCL and NVRTC (scripts/gpu-check)"]
fn every_strategy_on_the_gpu_trains_as_on_the_host() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    for s in [
        Strategy::Zero1,
        Strategy::Zero2,
        Strategy::Fsdp,
        Strategy::Hsdp { shard_size: 1 },
    ] {
        let host = rt.block_on(train(s, false));
        let gpu = rt.block_on(train(s, true));
        for (p, (h, g)) in host.iter().zip(&gpu).enumerate() {
            let bad = h
                .iter()
                .zip(g)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                bad.is_none(),
                "{s}: parameter {p} element {bad:?}: host {:?} gpu {:?}",
                bad.map(|i| h[i]),
                bad.map(|i| g[i])
            );
        }
    }
}

/// `bytes` in a new device allocation.
fn upload(place: &Placement, bytes: &[u8]) -> u64 {
    let d = &place.device;
    let p = d.alloc_zeroed(bytes.len(), place.stream).unwrap();
    // SAFETY: `p` holds `bytes.len()` bytes.
    unsafe { d.copy_from_host(p, bytes, place.stream) }.unwrap();
    p
}

/// `len` bytes at `p`, once the stream has produced them.
fn download(place: &Placement, p: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: callers pass a live allocation of at least `len` bytes.
    unsafe { place.device.copy_to_host(&mut out, p, place.stream) }.unwrap();
    out
}

#[test]
#[ignore = "needs a GPU, libcuda and NVRTC (scripts/gpu-check)"]
fn cuda_casts_round_as_the_host() {
    use consort::{
        DType,
        ddp::ShardKernels,
        half::{bf16, f16},
    };
    let (dev, place) = gpu();
    let kernels = CudaKernels::new(&dev).expect("NVRTC kernels");
    let n = 100_003usize;
    // Values across f16's and bf16's ranges, ties, infinities and a NaN.
    let mut src: Vec<f32> = values(n, 7)
        .into_iter()
        .enumerate()
        .map(|(i, v)| (v * 2f64.powi((i % 40) as i32 - 20)) as f32)
        .collect();
    src[0] = f32::INFINITY;
    src[1] = f32::NAN;
    src[2] = 1.0 + 2f32.powi(-8); // a bf16 tie
    src[3] = 65520.0; // rounds to f16 infinity
    let d = &place.device;
    let down = |p: u64, len: usize| download(&place, p, len);
    let s = upload(&place, consort::dtype::as_bytes(&src));
    for (to, want) in [
        (
            DType::BF16,
            src.iter()
                .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
        (
            DType::F16,
            src.iter()
                .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
        ),
    ] {
        let dst = d.alloc_zeroed(n * 2, place.stream).unwrap();
        // SAFETY: both hold `n` elements of their dtypes.
        unsafe { kernels.cast(&place, (s, DType::F32), (dst, to), n) }.unwrap();
        let got = down(dst, n * 2);
        let bad = (0..n).find(|&i| {
            let (g, w) = (&got[2 * i..2 * i + 2], &want[2 * i..2 * i + 2]);
            // NaN payloads may differ; both must be NaN.
            g != w && i != 1
        });
        assert!(
            bad.is_none(),
            "f32 -> {to}: element {bad:?} ({:?})",
            bad.map(|i| src[i])
        );
        // And back to f32, exactly.
        let back = d.alloc_zeroed(n * 4, place.stream).unwrap();
        // SAFETY: as above.
        unsafe { kernels.cast(&place, (dst, to), (back, DType::F32), n) }.unwrap();
        let got = down(back, n * 4);
        let host: Vec<u8> = want
            .chunks_exact(2)
            .flat_map(|b| {
                let h = u16::from_le_bytes([b[0], b[1]]);
                let v = if to == DType::BF16 {
                    bf16::from_bits(h).to_f32()
                } else {
                    f16::from_bits(h).to_f32()
                };
                v.to_le_bytes()
            })
            .collect();
        let bad = (2..n).find(|&i| got[4 * i..4 * i + 4] != host[4 * i..4 * i + 4]);
        assert!(bad.is_none(), "{to} -> f32: element {bad:?}");
        for p in [dst, back] {
            // SAFETY: allocated above, freed once.
            unsafe { d.free(p, place.stream) }.unwrap();
        }
    }
    // SAFETY: allocated above, freed once.
    unsafe { d.free(s, place.stream) }.unwrap();
}

#[test]
#[ignore = "needs a GPU, libcuda and NVRTC (scripts/gpu-check)"]
fn cuda_unscale_finds_an_inf_and_scales_as_the_host() {
    use consort::ddp::ShardKernels;
    let (dev, place) = gpu();
    let kernels = CudaKernels::new(&dev).expect("NVRTC kernels");
    let n = 100_003usize;
    let mut src: Vec<f32> = values(n, 9).into_iter().map(|v| v as f32).collect();
    src[0] = f32::INFINITY;
    let d = &place.device;
    let up = |v: &[f32]| upload(&place, consort::dtype::as_bytes(v));
    let s = up(&src);
    // Unscale: an inf is found, every element is multiplied.
    // SAFETY: `s` holds `n` f32.
    let found = unsafe { kernels.unscale(&place, s, n, 0.5) }.unwrap();
    assert!(found, "the inf at element 0 is found");
    let mut got = vec![0f32; n];
    // SAFETY: `s` holds `n` f32.
    unsafe { d.copy_to_host(consort::dtype::as_bytes_mut(&mut got), s, place.stream) }.unwrap();
    let bad = (1..n).find(|&i| got[i].to_bits() != (src[i] * 0.5).to_bits());
    assert!(bad.is_none(), "unscale: element {bad:?}");
    let clean = up(&vec![1.0f32; 1000]);
    // SAFETY: `clean` holds 1000 f32.
    assert!(!unsafe { kernels.unscale(&place, clean, 1000, 0.25) }.unwrap());
    for p in [s, clean] {
        // SAFETY: allocated above, freed once.
        unsafe { d.free(p, place.stream) }.unwrap();
    }
}
