//! DDP, ZeRO-2 and FSDP over N simulated ranks with per-rank batch b end
//! with the same parameters as one burn process with batch N·b (SGD, mean
//! squared error), for a two-layer burn model; every rank ends in step
//! with rank 0.

use std::sync::Arc;

mod common;

use burn::{
    Tensor,
    optim::{GradientsParams, SgdConfig},
    tensor::{Device, TensorData},
};
use common::Net;
use consort_burn::BurnModel;
use consort_comm::Backend;
use consort_ddp::{Ddp, DdpOptions, ParamSet, Sgd, ShardOptions, Sharded, Strategy};
use consort_sim::{SimConfig, SimWorld};
use proptest::prelude::*;

/// Sample `i` of step `s`: an input of 4 and a target of 3.
fn sample(s: usize, i: usize) -> (Vec<f32>, Vec<f32>) {
    let v = |k: usize| (((s * 31 + i * 7 + k * 3) % 17) as f32 - 8.0) / 8.0;
    ((0..4).map(v).collect(), (10..13).map(v).collect())
}

/// One SGD step on samples `range` of step `s`, the loss their mean.
fn step_loss(net: &Net, s: usize, range: std::ops::Range<usize>, device: &Device) -> Tensor<1> {
    let n = range.len();
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for i in range {
        let (x, y) = sample(s, i);
        xs.extend(x);
        ys.extend(y);
    }
    let x = Tensor::<2>::from_data(TensorData::new(xs, [n, 4]), device);
    let y = Tensor::<2>::from_data(TensorData::new(ys, [n, 3]), device);
    (net.forward(x) - y).powf_scalar(2.0).mean()
}

const LR: f64 = 0.05;

/// Each parameter's values, by DDP's order.
fn values(host: &mut BurnModel) -> Values {
    (0..host.params().len())
        .map(|i| bytemuck_f32(host.param_bytes_mut(i)))
        .collect()
}

fn bytemuck_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Every parameter's values, in DDP's order.
type Values = Vec<Vec<f32>>;

/// Runs `f(rank)` on every rank of a simulated world of `world`, each on
/// its own task; the results in rank order.
fn on_ranks<T, F, Fut>(world: usize, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Arc<dyn Backend>) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let sim = SimWorld::new(SimConfig::new(world)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let tasks: Vec<_> = sim
            .ranks()
            .into_iter()
            .map(|rank| tokio::spawn(f(Arc::new(rank))))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
}

/// Returns every rank's initial (rank 0's) and final parameters.
fn distributed(world: usize, batch: usize, steps: usize) -> Vec<(Values, Values)> {
    on_ranks(world, move |rank| async move {
        let r = rank.rank();
        let device = Device::default().autodiff();
        let net = Net::new(&device); // different on each rank
        let mut host = BurnModel::from_module(&net).unwrap();
        let mut ddp = Ddp::new(rank, &mut host, DdpOptions::default())
            .await
            .unwrap();
        let mut net = host.push_values(net).unwrap();
        let start = values(&mut host);
        let mut optim = SgdConfig::new().init();
        for s in 0..steps {
            let loss = step_loss(&net, s, r * batch..(r + 1) * batch, &device);
            let mut grads = GradientsParams::from_grads(loss.backward(), &net);
            host.pull_grads(&mut grads).unwrap();
            ddp.sync_grads(&mut host).await.unwrap();
            host.push_grads(&mut grads).unwrap();
            net = optim.step(LR, net, grads);
        }
        let mut end = BurnModel::from_module(&net).unwrap();
        (start, values(&mut end))
    })
}

/// As [`distributed`], with a sharded strategy and consort's SGD (the
/// optimizer runs on each rank's shard).
fn sharded(world: usize, batch: usize, steps: usize, strategy: Strategy) -> Vec<(Values, Values)> {
    on_ranks(world, move |rank| async move {
        let r = rank.rank();
        let device = Device::default().autodiff();
        let net = Net::new(&device);
        let mut host = BurnModel::from_module(&net).unwrap();
        let opts = ShardOptions::new(strategy);
        let mut sh = Sharded::new(rank, &mut host, Sgd::new(LR), opts)
            .await
            .unwrap();
        sh.copy_params_to(&mut host).await.unwrap();
        let mut net = host.push_values(net).unwrap();
        let start = values(&mut host);
        for s in 0..steps {
            let loss = step_loss(&net, s, r * batch..(r + 1) * batch, &device);
            let mut grads = GradientsParams::from_grads(loss.backward(), &net);
            host.pull_grads(&mut grads).unwrap();
            host.mark_ready(&mut sh).unwrap();
            sh.step().await.unwrap();
            sh.copy_params_to(&mut host).await.unwrap();
            net = host.push_values(net).unwrap();
        }
        let mut end = BurnModel::from_module(&net).unwrap();
        (start, values(&mut end))
    })
}

/// One process from `start`, batch `world · batch`.
fn single(start: &[Vec<f32>], world: usize, batch: usize, steps: usize) -> Vec<Vec<f32>> {
    let device = Device::default().autodiff();
    let net = Net::new(&device);
    let mut host = BurnModel::from_module(&net).unwrap();
    for (i, v) in start.iter().enumerate() {
        let dst = host.param_bytes_mut(i);
        for (d, x) in dst.chunks_exact_mut(4).zip(v) {
            d.copy_from_slice(&x.to_le_bytes());
        }
    }
    let mut net = host.push_values(net).unwrap();
    let mut optim = SgdConfig::new().init();
    for s in 0..steps {
        let loss = step_loss(&net, s, 0..world * batch, &device);
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        net = optim.step(LR, net, grads);
    }
    values(&mut BurnModel::from_module(&net).unwrap())
}

fn close(a: &[Vec<f32>], b: &[Vec<f32>]) -> Result<(), String> {
    for (p, (x, y)) in a.iter().zip(b).enumerate() {
        for (i, (u, v)) in x.iter().zip(y).enumerate() {
            if (u - v).abs() > 1e-5 * (1.0 + v.abs()) {
                return Err(format!("parameter {p}, element {i}: {u} vs {v}"));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    #[test]
    fn ddp_on_n_ranks_equals_one_process_with_n_times_the_batch(
        world in 1usize..=4,
        batch in 1usize..=3,
    ) {
        let steps = 3;
        let out = distributed(world, batch, steps);
        let want = single(&out[0].0, world, batch, steps);
        for (r, (start, end)) in out.iter().enumerate() {
            prop_assert_eq!(start, &out[0].0, "rank {} did not start from rank 0's values", r);
            if let Err(e) = close(end, &want) {
                return Err(TestCaseError::fail(format!("rank {r}: {e}")));
            }
        }
    }
}

#[test]
fn zero2_and_fsdp_on_burn_modules_equal_one_process() {
    let (world, batch, steps) = (3, 2, 3);
    for strategy in [Strategy::Zero2, Strategy::Fsdp] {
        let out = sharded(world, batch, steps, strategy);
        let want = single(&out[0].0, world, batch, steps);
        for (r, (start, end)) in out.iter().enumerate() {
            assert_eq!(start, &out[0].0, "{strategy:?}: rank {r}'s start");
            close(end, &want).unwrap_or_else(|e| panic!("{strategy:?}: rank {r}: {e}"));
        }
    }
}

#[test]
fn parameters_are_named_by_module_path() {
    let device = Device::default();
    let host = BurnModel::from_module(&Net::new(&device)).unwrap();
    assert_eq!(
        host.names(),
        vec!["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    );
}

/// After burn's optimizer steps the module, `pull_values` brings its values
/// into the host copy (what a checkpoint saves), and `load_state_dict` +
/// `push_values` put a checkpoint back into a fresh module.
#[test]
fn a_checkpoint_holds_the_stepped_values_and_loads_into_a_fresh_module() {
    let device = Device::default().autodiff();
    let net = Net::new(&device);
    let mut host = BurnModel::from_module(&net).unwrap();
    let before = host.state_dict();
    let loss = step_loss(&net, 0, 0..4, &device);
    let grads = GradientsParams::from_grads(loss.backward(), &net);
    let net = SgdConfig::new().init().step(LR, net, grads);
    assert_eq!(host.state_dict(), before, "the host copy is not the module");
    host.pull_values(&net).unwrap();
    let saved = host.state_dict();
    assert_ne!(
        saved, before,
        "pull_values did not bring the stepped values"
    );
    let fresh = Net::new(&device);
    let mut other = BurnModel::from_module(&fresh).unwrap();
    other.load_state_dict(&saved).unwrap();
    let fresh = other.push_values(fresh).unwrap();
    assert_eq!(BurnModel::from_module(&fresh).unwrap().state_dict(), saved);
    // The wrong module is refused, not half-read.
    let mut wrong = BurnModel::from_module(&Net::new(&device)).unwrap();
    assert!(wrong.pull_values(&net).is_err());
}
