//! The candle adapter on a real GPU (feature `candle-cuda`): DDP over NCCL
//! reads and writes candle's device memory. Ignored by default (CI has no
//! GPU, and a candle CUDA binary needs the driver to start);
//! `scripts/gpu-check` runs them:
//!
//! ```sh
//! cargo test -p consort --features candle-cuda --test candle_cuda -- --ignored --test-threads 1
//! ```
//!
//! World 1 over NCCL, so the average of a gradient is the gradient: each
//! test checks that the values DDP writes back are the ones candle
//! computed, and that the adapter's own rules hold (a missing gradient
//! is unused, as on the host, and gets zeros in the `GradStore`; a strided
//! or shared one gets memory of its own; a variable on another device is
//! refused by name; candle's default stream works as a stream of its own
//! does).
#![cfg(feature = "candle-cuda")]

use std::{sync::Arc, time::Duration};

use consort::{
    candle::{
        CandleError, CandleModel,
        candle_core::{CudaDevice, Device, Tensor, Var, backend::BackendDevice},
    },
    ddp::{Ddp, DdpOptions},
    nccl::{NcclBackend, NcclOptions},
};

async fn nccl() -> Arc<NcclBackend> {
    let store = consort::store::MemStore::new(Duration::from_secs(30));
    Arc::new(
        NcclBackend::new(&store, 0, 1, NcclOptions::default())
            .await
            .expect("NCCL at world 1"),
    )
}

fn gpu() -> CudaDevice {
    CudaDevice::new_with_stream(0).expect("candle on GPU 0")
}

fn var(gpu: &CudaDevice, values: &[f32], shape: &[usize]) -> Var {
    let t = Tensor::from_slice(values, shape, &Device::Cuda(gpu.clone())).unwrap();
    Var::from_tensor(&t).unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn gradients_come_back_in_place_and_unused_ones_as_zeros() {
    let gpu = gpu();
    let w = var(&gpu, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let unused = var(&gpu, &[7.0, 8.0], &[2]);
    let vars = vec![
        ("a.w".to_string(), w.clone()),
        ("b.unused".to_string(), unused.clone()),
    ];
    let place = consort::candle::placement(&gpu).unwrap();
    let mut model = CandleModel::from_vars_on(vars, place).unwrap();
    assert!(model.on_device());
    let opts = DdpOptions::default().find_unused_parameters(true);
    let mut ddp = Ddp::new(nccl().await, &mut model, opts).await.unwrap();
    model.push_values().unwrap();
    assert_eq!(host(w.as_tensor()), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);

    let x = Tensor::from_slice(&[1.0f32, -2.0, 0.5], (3, 1), &Device::Cuda(gpu.clone())).unwrap();
    // loss = sum(w @ x): d/dw = x^T in every row.
    let loss = w.as_tensor().matmul(&x).unwrap().sum_all().unwrap();
    let mut grads = loss.backward().unwrap();
    let before = grads.get(w.as_tensor()).map(host);
    model.pull_grads(&grads).unwrap();
    ddp.sync_grads(&mut model).await.unwrap();
    model.push_grads(&mut grads).unwrap();
    let gw = host(grads.get(w.as_tensor()).unwrap());
    assert_eq!(Some(gw.clone()), before);
    assert_eq!(gw, vec![1.0, -2.0, 0.5, 1.0, -2.0, 0.5]);
    let gu = host(
        grads
            .get(unused.as_tensor())
            .expect("a zero gradient was inserted"),
    );
    assert_eq!(gu, vec![0.0, 0.0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn an_unused_variable_is_an_error_without_find_unused_parameters() {
    // As on the host (and in torch): DDP names the parameter.
    let gpu = gpu();
    let w = var(&gpu, &[1.0, 2.0], &[2]);
    let unused = var(&gpu, &[3.0], &[1]);
    let vars = vec![("w".to_string(), w.clone()), ("unused".to_string(), unused)];
    let place = consort::candle::placement(&gpu).unwrap();
    let mut model = CandleModel::from_vars_on(vars, place).unwrap();
    let mut ddp = Ddp::new(nccl().await, &mut model, DdpOptions::default())
        .await
        .unwrap();
    let loss = w.as_tensor().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    model.pull_grads(&grads).unwrap();
    let err = ddp.sync_grads(&mut model).await.unwrap_err().to_string();
    assert!(err.contains("no gradient this step: unused"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn the_default_stream_of_device_new_cuda_works_too() {
    // Device::new_cuda (what most candle code calls) runs on the legacy
    // default stream, stream id 0 for DDP.
    let Device::Cuda(gpu) = Device::new_cuda(0).unwrap() else {
        unreachable!("new_cuda gives a CUDA device")
    };
    let w = var(&gpu, &[1.0, 2.0, 3.0], &[3]);
    let place = consort::candle::placement(&gpu).unwrap();
    assert_eq!(place.stream, 0);
    let vars = vec![("w".to_string(), w.clone())];
    let mut model = CandleModel::from_vars_on(vars, place).unwrap();
    let mut ddp = Ddp::new(nccl().await, &mut model, DdpOptions::default())
        .await
        .unwrap();
    for step in 1..=3 {
        let loss = (w.as_tensor() * step as f64).unwrap().sum_all().unwrap();
        let mut grads = loss.backward().unwrap();
        model.pull_grads(&grads).unwrap();
        ddp.sync_grads(&mut model).await.unwrap();
        model.push_grads(&mut grads).unwrap();
        assert_eq!(
            host(grads.get(w.as_tensor()).unwrap()),
            vec![step as f32; 3]
        );
    }
    // The model (and candle's memory) goes first; DDP then frees its
    // buckets on candle's stream.
    drop(model);
    drop(ddp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn shared_and_strided_gradients_get_memory_of_their_own() {
    let gpu = gpu();
    let dev = Device::Cuda(gpu.clone());
    let a = var(&gpu, &[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = var(&gpu, &[5.0, 6.0, 7.0, 8.0], &[2, 2]);
    let c = var(&gpu, &[0.0; 4], &[2, 2]);
    let vars = vec![
        ("a".to_string(), a.clone()),
        ("b".to_string(), b.clone()),
        ("c".to_string(), c.clone()),
    ];
    let place = consort::candle::placement(&gpu).unwrap();
    let mut model = CandleModel::from_vars_on(vars, place).unwrap();
    let mut ddp = Ddp::new(nccl().await, &mut model, DdpOptions::default())
        .await
        .unwrap();
    let loss = (a.as_tensor() * 3.0).unwrap().sum_all().unwrap();
    let mut grads = loss.backward().unwrap();
    // The same tensor as two variables' gradient (DDP must not write two
    // averages into one memory), and a transposed view as the third's.
    let g = grads.get(a.as_tensor()).unwrap().clone();
    grads.insert(b.as_tensor(), g);
    let m = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], (2, 2), &dev).unwrap();
    grads.insert(c.as_tensor(), m.t().unwrap());
    model.pull_grads(&grads).unwrap();
    ddp.sync_grads(&mut model).await.unwrap();
    model.push_grads(&mut grads).unwrap();
    assert_eq!(host(grads.get(a.as_tensor()).unwrap()), vec![3.0; 4]);
    assert_eq!(host(grads.get(b.as_tensor()).unwrap()), vec![3.0; 4]);
    let gc = grads.get(c.as_tensor()).unwrap();
    assert!(gc.is_contiguous());
    assert_eq!(host(gc), vec![1.0, 3.0, 2.0, 4.0]);
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
fn a_variable_in_host_memory_is_refused_by_name() {
    let gpu = gpu();
    let on_gpu = var(&gpu, &[1.0], &[1]);
    let on_cpu =
        Var::from_tensor(&Tensor::from_slice(&[1.0f32], 1, &Device::Cpu).unwrap()).unwrap();
    let place = consort::candle::placement(&gpu).unwrap();
    let vars = vec![("gpu.w".to_string(), on_gpu), ("cpu.w".to_string(), on_cpu)];
    let err = CandleModel::from_vars_on(vars, place).unwrap_err();
    assert!(matches!(err, CandleError::Device(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("cpu.w") && msg.contains("not on CUDA"),
        "{msg}"
    );
    assert_eq!(
        gpu.location(),
        consort::candle::candle_core::DeviceLocation::Cuda { gpu_id: 0 }
    );
}

/// A two-layer MLP's variables on `dev` (fixed values, so that the GPU and
/// CPU runs start alike).
fn mlp_vars(dev: &Device) -> Vec<(String, Var)> {
    let mk = |name: &str, shape: &[usize], seed: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f32) * 0.37 + seed).sin() * 0.5)
            .collect();
        let t = Tensor::from_vec(v, shape, dev).unwrap();
        (name.to_string(), Var::from_tensor(&t).unwrap())
    };
    vec![
        mk("fc1.weight", &[4, 3], 0.1),
        mk("fc1.bias", &[4], 0.2),
        mk("fc2.weight", &[2, 4], 0.3),
        mk("fc2.bias", &[2], 0.4),
    ]
}

/// Three FSDP steps (SGD, one unit per layer) of the MLP on `dev`: over
/// NCCL with the shards on the GPU when `place` is given, else on one
/// simulated rank in host memory. Returns the final variables.
async fn fsdp_steps(dev: Device, place: Option<consort::Placement>) -> Vec<(String, Vec<f32>)> {
    use consort::ddp::{Sgd, ShardKernels, ShardOptions, Sharded, Strategy};
    let vars = mlp_vars(&dev);
    let opts = ShardOptions::new(Strategy::Fsdp).units(vec![vec![0, 1], vec![2, 3]]);
    let (mut model, b, opts): (_, Arc<dyn consort::Backend>, _) = match place {
        Some(p) => {
            let cuda = consort::nccl::CudaDevice::new(0).unwrap();
            let k: Arc<dyn ShardKernels> = consort::cuda::CudaKernels::new(&cuda).unwrap();
            let m = CandleModel::from_vars_on(vars, p).unwrap();
            (m, nccl().await, opts.kernels(k))
        }
        None => {
            let world = consort::sim::SimWorld::new(consort::sim::SimConfig::new(1)).unwrap();
            let rank = world.ranks().remove(0);
            (CandleModel::from_vars(vars).unwrap(), Arc::new(rank), opts)
        }
    };
    let mut sh = Sharded::new(b, &mut model, Sgd::new(0.1), opts)
        .await
        .unwrap();
    let v = |m: &CandleModel, name: &str| {
        let (_, var) = m.vars().iter().find(|(n, _)| n == name).unwrap();
        var.as_tensor().clone()
    };
    for s in 0..=3 {
        for u in 0..sh.layout().units.len() {
            model.set_gathered(&sh.gather(u).await.unwrap()).unwrap();
        }
        if s == 3 {
            break;
        }
        let x: Vec<f32> = (0..6).map(|i| ((s * 7 + i) as f32 * 0.53).cos()).collect();
        let y: Vec<f32> = (0..4).map(|i| ((s * 5 + i) as f32 * 0.29).sin()).collect();
        let x = Tensor::from_vec(x, (2, 3), &dev).unwrap();
        let y = Tensor::from_vec(y, (2, 2), &dev).unwrap();
        let h = x.matmul(&v(&model, "fc1.weight").t().unwrap()).unwrap();
        let h = h
            .broadcast_add(&v(&model, "fc1.bias"))
            .unwrap()
            .tanh()
            .unwrap();
        let out = h.matmul(&v(&model, "fc2.weight").t().unwrap()).unwrap();
        let out = out.broadcast_add(&v(&model, "fc2.bias")).unwrap();
        let loss = (out - y).unwrap().sqr().unwrap().mean_all().unwrap();
        model
            .mark_grads(&loss.backward().unwrap(), &mut sh)
            .unwrap();
        sh.step().await.unwrap();
    }
    model
        .vars()
        .iter()
        .map(|(n, var)| (n.clone(), host(var.as_tensor())))
        .collect()
}

/// FSDP over a candle model on the GPU (gathered values copied into the
/// variables and gradients handed over in device memory, the SGD step a
/// CUDA kernel) ends where the same run on the CPU does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU; scripts/gpu-check runs it"]
async fn fsdp_on_a_candle_gpu_model_trains_as_on_the_cpu() {
    let want = fsdp_steps(Device::Cpu, None).await;
    let gpu = gpu();
    let place = consort::candle::placement(&gpu).unwrap();
    let got = fsdp_steps(Device::Cuda(gpu.clone()), Some(place)).await;
    assert_eq!(got.len(), want.len());
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        let diff = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff <= 1e-5, "{name}: the GPU run differs by {diff}");
    }
}
