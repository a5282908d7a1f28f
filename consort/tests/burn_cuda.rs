//! The burn adapter on a real GPU (feature `burn-cuda`): DDP, ZeRO-2 and
//! FSDP over NCCL read and write burn's device memory, with no host copy,
//! and train a burn module to the parameters the same training reaches on
//! the CPU (ndarray), within float tolerance. Ignored by default (CI has no
//! GPU); `scripts/gpu-check` runs them, and each says so and returns early
//! where no CUDA driver or GPU is found:
//!
//! ```sh
//! cargo test -p consort --features burn-cuda --config .cargo/burn-cuda.toml \
//!     --test burn_cuda -- --ignored --test-threads 1 --nocapture
//! ```
//!
//! World 1 over NCCL (the GPU machine has one GPU), so the average of a
//! gradient is the gradient: what the tests check is that consort reads
//! burn's gradients where burn wrote them and that burn reads the averages
//! (and, for the sharded strategies, the updated parameters) where consort
//! wrote them, in order.
#![cfg(feature = "burn-cuda")]

use std::{sync::Arc, time::Duration};

use consort::burn::burn;
use consort::{
    burn::{
        BurnModel,
        burn::{
            Tensor,
            module::Module,
            nn::{Linear, LinearConfig},
            optim::{GradientsParams, SgdConfig},
            tensor::{Device, TensorData, activation::relu},
        },
    },
    ddp::{Ddp, DdpOptions, ParamSet, Sgd, ShardKernels, ShardOptions, Sharded, Strategy},
    nccl::{NcclBackend, NcclOptions},
};

#[derive(Module, Debug)]
struct Net {
    fc1: Linear,
    fc2: Linear,
}

impl Net {
    fn new(device: &Device, width: usize) -> Self {
        Net {
            fc1: LinearConfig::new(4, width).init(device),
            fc2: LinearConfig::new(width, 3).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(relu(self.fc1.forward(x)))
    }
}

const LR: f64 = 0.05;
const BATCH: usize = 6;
const STEPS: usize = 4;

/// The loss of step `s` on `device`: mean squared error of a fixed batch.
fn loss(net: &Net, s: usize, n: usize, device: &Device) -> Tensor<1> {
    let v = |i: usize, k: usize| (((s * 31 + i * 7 + k * 3) % 17) as f32 - 8.0) / 8.0;
    let xs: Vec<f32> = (0..n).flat_map(|i| (0..4).map(move |k| v(i, k))).collect();
    let ys: Vec<f32> = (0..n)
        .flat_map(|i| (10..13).map(move |k| v(i, k)))
        .collect();
    let x = Tensor::<2>::from_data(TensorData::new(xs, [n, 4]), device);
    let y = Tensor::<2>::from_data(TensorData::new(ys, [n, 3]), device);
    (net.forward(x) - y).powf_scalar(2.0).mean()
}

/// Every parameter's values (through a host copy), in DDP's order.
fn values(net: &Net) -> Vec<Vec<f32>> {
    let mut host = BurnModel::from_module(net).unwrap();
    (0..host.params().len())
        .map(|i| {
            let b = host.param_bytes_mut(i);
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
        .collect()
}

/// A fresh net on `device` holding `start`'s values.
fn net_from(start: &[Vec<f32>], device: &Device, width: usize) -> Net {
    let net = Net::new(device, width);
    let mut host = BurnModel::from_module(&net).unwrap();
    for (i, v) in start.iter().enumerate() {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        host.param_bytes_mut(i).copy_from_slice(&bytes);
    }
    host.push_values(net).unwrap()
}

/// The reference: burn's SGD on the CPU from `start`.
#[allow(deprecated)] // ndarray is the adapter's CPU backend
fn on_cpu(start: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let device = Device::ndarray().autodiff();
    let mut net = net_from(start, &device, 8);
    let mut optim = SgdConfig::new().init();
    for s in 0..STEPS {
        let grads = GradientsParams::from_grads(loss(&net, s, BATCH, &device).backward(), &net);
        net = optim.step(LR, net, grads);
    }
    values(&net)
}

fn close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    for (p, (x, y)) in got.iter().zip(want).enumerate() {
        for (i, (u, v)) in x.iter().zip(y).enumerate() {
            assert!(
                (u - v).abs() <= 1e-4 * (1.0 + v.abs()),
                "{what}: parameter {p}, element {i}: {u} on CUDA vs {v} on the CPU"
            );
        }
    }
}

/// NCCL at world 1 and the GPU's device, or `None` (said on stderr)
/// without a CUDA driver or GPU 0.
async fn gpu() -> Option<(Arc<NcclBackend>, Arc<consort::nccl::CudaDevice>)> {
    let cuda = match consort::nccl::CudaDevice::new(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipped: no CUDA driver or GPU 0 here ({e})");
            return None;
        }
    };
    let store = consort::store::MemStore::new(Duration::from_secs(30));
    let nccl = NcclBackend::new(&store, 0, 1, NcclOptions::default())
        .await
        .expect("NCCL at world 1");
    Some((Arc::new(nccl), cuda))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn ddp_on_cuda_equals_the_cpu_run() {
    let Some((nccl, _)) = gpu().await else { return };
    let device = Device::cuda(0).autodiff();
    let start = values(&Net::new(&device, 8));
    let net = net_from(&start, &device, 8);
    let place = consort::burn::placement(&device).unwrap();
    let mut model = BurnModel::from_module_on(&net, place).unwrap();
    assert!(model.on_device());
    let mut ddp = Ddp::new(nccl, &mut model, DdpOptions::default())
        .await
        .unwrap();
    let mut net = model.push_values(net).unwrap();
    let mut optim = SgdConfig::new().init();
    for s in 0..STEPS {
        let mut grads = GradientsParams::from_grads(loss(&net, s, BATCH, &device).backward(), &net);
        model.pull_grads(&mut grads).unwrap();
        ddp.sync_grads(&mut model).await.unwrap();
        model.push_grads(&mut grads).unwrap();
        net = optim.step(LR, net, grads);
    }
    close(&values(&net), &on_cpu(&start), "DDP");
}

/// A frozen layer (`no_grad`) on the device path: synced with a zero
/// gradient without `find_unused_parameters`, never handed to burn's
/// optimizer (whose weight decay would otherwise move it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn a_frozen_layer_on_cuda_is_synced_and_never_stepped() {
    let Some((nccl, _)) = gpu().await else { return };
    let device = Device::cuda(0).autodiff();
    let mut net = Net::new(&device, 8);
    net.fc1 = net.fc1.no_grad();
    let place = consort::burn::placement(&device).unwrap();
    let mut model = BurnModel::from_module_on(&net, place).unwrap();
    let mut ddp = Ddp::new(nccl, &mut model, DdpOptions::default())
        .await
        .unwrap();
    let mut net = model.push_values(net).unwrap();
    let start = values(&net);
    let decay = burn::optim::decay::WeightDecayConfig::new(0.5);
    let mut optim = SgdConfig::new().with_weight_decay(Some(decay)).init();
    for s in 0..STEPS {
        let mut grads = GradientsParams::from_grads(loss(&net, s, BATCH, &device).backward(), &net);
        model.pull_grads(&mut grads).unwrap();
        ddp.sync_grads(&mut model).await.unwrap();
        model.push_grads(&mut grads).unwrap();
        net = optim.step(LR, net, grads);
    }
    let end = values(&net);
    assert_eq!(start[..2], end[..2], "the frozen fc1 moved");
    assert_ne!(start[2..], end[2..], "the trained fc2 did not move");
}

/// A step whose gradients were never handed back (no `push_grads`) is
/// refused at the next `pull_grads`, by name, rather than racing burn's
/// optimizer against averages still being written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn pulling_again_without_push_grads_is_refused() {
    let Some((nccl, _)) = gpu().await else { return };
    let device = Device::cuda(0).autodiff();
    let net = Net::new(&device, 8);
    let place = consort::burn::placement(&device).unwrap();
    let mut model = BurnModel::from_module_on(&net, place).unwrap();
    let mut ddp = Ddp::new(nccl, &mut model, DdpOptions::default())
        .await
        .unwrap();
    let net = model.push_values(net).unwrap();
    let mut grads = GradientsParams::from_grads(loss(&net, 0, BATCH, &device).backward(), &net);
    model.pull_grads(&mut grads).unwrap();
    ddp.sync_grads(&mut model).await.unwrap();
    let mut again = GradientsParams::from_grads(loss(&net, 1, BATCH, &device).backward(), &net);
    let err = model.pull_grads(&mut again).unwrap_err().to_string();
    assert!(err.contains("push_grads"), "{err}");
    model.push_grads(&mut grads).unwrap();
    model.pull_grads(&mut again).unwrap();
}

/// `STEPS` steps of `strategy` with consort's SGD on the GPU's shards.
async fn sharded_on_cuda(strategy: Strategy) {
    let Some((nccl, cuda)) = gpu().await else {
        return;
    };
    let device = Device::cuda(0).autodiff();
    let start = values(&Net::new(&device, 8));
    let net = net_from(&start, &device, 8);
    let place = consort::burn::placement(&device).unwrap();
    let mut model = BurnModel::from_module_on(&net, place).unwrap();
    let k: Arc<dyn ShardKernels> = consort::cuda::CudaKernels::new(&cuda).unwrap();
    let opts = ShardOptions::new(strategy).kernels(k);
    let mut sh = Sharded::new(nccl, &mut model, Sgd::new(LR), opts)
        .await
        .unwrap();
    sh.copy_params_to(&mut model).await.unwrap();
    let mut net = model.push_values(net).unwrap();
    for s in 0..STEPS {
        let mut grads = GradientsParams::from_grads(loss(&net, s, BATCH, &device).backward(), &net);
        model.pull_grads(&mut grads).unwrap();
        model.mark_ready(&mut sh).unwrap();
        sh.step().await.unwrap();
        sh.copy_params_to(&mut model).await.unwrap();
        net = model.push_values(net).unwrap();
    }
    close(&values(&net), &on_cpu(&start), &format!("{strategy:?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn zero2_on_cuda_equals_the_cpu_run() {
    sharded_on_cuda(Strategy::Zero2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn fsdp_on_cuda_equals_the_cpu_run() {
    sharded_on_cuda(Strategy::Fsdp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn a_cpu_module_is_refused_by_name() {
    let Some(_) = gpu().await else { return };
    let device = Device::cuda(0).autodiff();
    let place = consort::burn::placement(&device).unwrap();
    #[allow(deprecated)]
    let cpu = Net::new(&Device::ndarray().autodiff(), 8);
    let err = BurnModel::from_module_on(&cpu, place).unwrap_err();
    assert!(err.to_string().contains("fc1.weight"), "{err}");
}

/// Samples per second of DDP steps on a wider net, device path beside the
/// host-copy path (printed; `scripts/gpu-check` keeps the lines).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn throughput_device_path_beside_host_copies() {
    let Some((nccl, _)) = gpu().await else { return };
    let (width, batch, steps) = (4096, 256, 20);
    let device = Device::cuda(0).autodiff();
    for on_device in [true, false] {
        let net = Net::new(&device, width);
        let mut model = if on_device {
            BurnModel::from_module_on(&net, consort::burn::placement(&device).unwrap()).unwrap()
        } else {
            BurnModel::from_module(&net).unwrap()
        };
        let mut ddp = Ddp::new(nccl.clone(), &mut model, DdpOptions::default())
            .await
            .unwrap();
        let mut net = model.push_values(net).unwrap();
        let mut optim = SgdConfig::new().init();
        let mut t0 = std::time::Instant::now();
        for s in 0..steps + 2 {
            if s == 2 {
                device.sync().unwrap();
                t0 = std::time::Instant::now(); // after warm-up (kernel compiles)
            }
            let mut grads =
                GradientsParams::from_grads(loss(&net, s, batch, &device).backward(), &net);
            model.pull_grads(&mut grads).unwrap();
            ddp.sync_grads(&mut model).await.unwrap();
            model.push_grads(&mut grads).unwrap();
            net = optim.step(LR, net, grads);
        }
        device.sync().unwrap();
        let rate = (steps * batch) as f64 / t0.elapsed().as_secs_f64();
        let path = if on_device {
            "device (no host copies)"
        } else {
            "host copies"
        };
        println!("burn-cuda DDP, width {width}, batch {batch}: {rate:.0} samples/s, {path}");
    }
}
