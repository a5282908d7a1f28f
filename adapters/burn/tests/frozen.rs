//! A frozen parameter (`no_grad`, as torch's `requires_grad=False`) under
//! DDP: synced with the others without `find_unused_parameters`, never
//! stepped by burn's optimizer (weight decay would move it if it were
//! handed a zero gradient); the sharded strategies refuse it by name.

use std::sync::Arc;

mod common;

use burn::{
    Tensor,
    module::Module,
    optim::{GradientsParams, SgdConfig, decay::WeightDecayConfig},
    tensor::{Device, TensorData},
};
use common::Net;
use consort_burn::BurnModel;
use consort_comm::Backend;
use consort_ddp::{Ddp, DdpOptions, ParamSet, Sgd, ShardOptions, Sharded, Strategy};
use consort_sim::{SimConfig, SimWorld};

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Every parameter's values, by module path.
fn values(net: &Net) -> Vec<(String, Vec<f32>)> {
    let mut m = BurnModel::from_module(net).unwrap();
    let names: Vec<String> = m.names().iter().map(|s| s.to_string()).collect();
    names
        .into_iter()
        .enumerate()
        .map(|(i, n)| (n, f32s(m.param_bytes_mut(i))))
        .collect()
}

fn loss(net: &Net, rank: usize, device: &Device) -> Tensor<1> {
    let x: Vec<f32> = (0..8)
        .map(|k| ((k * 5 + rank * 3) % 7) as f32 - 3.0)
        .collect();
    let x = Tensor::<2>::from_data(TensorData::new(x, [2, 4]), device);
    net.forward(x).powf_scalar(2.0).mean()
}

fn with_frozen_fc1(device: &Device) -> Net {
    let mut net = Net::new(device);
    net.fc1 = net.fc1.no_grad();
    net
}

fn on_ranks<T: Send + 'static, Fut: Future<Output = T> + Send + 'static>(
    world: usize,
    f: impl Fn(Arc<dyn Backend>) -> Fut,
) -> Vec<T> {
    let sim = SimWorld::new(SimConfig::new(world)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let tasks: Vec<_> = sim
            .ranks()
            .into_iter()
            .map(|r| tokio::spawn(f(Arc::new(r))))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
}

/// Three DDP steps of burn's SGD (with weight decay `decay`) on `net`
/// through `model`: every parameter's values before and after.
async fn ddp_steps(
    rank: Arc<dyn Backend>,
    mut model: BurnModel,
    net: Net,
    device: &Device,
    decay: Option<f64>,
) -> (Vec<(String, Vec<f32>)>, Vec<(String, Vec<f32>)>) {
    let mut ddp = Ddp::new(rank.clone(), &mut model, DdpOptions::default())
        .await
        .unwrap();
    let mut net = model.push_values(net).unwrap();
    let start = values(&net);
    let decay = decay.map(|d| WeightDecayConfig::new(d as f32));
    let mut optim = SgdConfig::new().with_weight_decay(decay).init();
    for _ in 0..3 {
        let mut grads =
            GradientsParams::from_grads(loss(&net, rank.rank(), device).backward(), &net);
        model.pull_grads(&mut grads).unwrap();
        ddp.sync_grads(&mut model).await.unwrap();
        model.push_grads(&mut grads).unwrap();
        net = optim.step(0.1, net, grads);
    }
    (start, values(&net))
}

#[test]
fn ddp_syncs_a_frozen_parameter_and_the_optimizer_never_steps_it() {
    let out = on_ranks(2, |rank| async move {
        let device = Device::default().autodiff();
        let net = with_frozen_fc1(&device);
        let model = BurnModel::from_module(&net).unwrap();
        ddp_steps(rank, model, net, &device, Some(0.5)).await
    });
    let (start0, end0) = &out[0];
    for (r, (start, end)) in out.iter().enumerate() {
        assert_eq!(start, start0, "rank {r} did not start from rank 0's values");
        assert_eq!(end, end0, "rank {r} ended out of step with rank 0");
        for ((name, a), (_, b)) in start.iter().zip(end) {
            if name.starts_with("fc1.") {
                assert_eq!(a, b, "rank {r}: the frozen {name} moved");
            } else {
                assert_ne!(a, b, "rank {r}: the trained {name} did not move");
            }
        }
    }
}

#[test]
fn the_sharded_strategies_refuse_a_frozen_parameter_by_name() {
    let out = on_ranks(2, |rank| async move {
        let device = Device::default().autodiff();
        let net = with_frozen_fc1(&device);
        let mut model = BurnModel::from_module(&net).unwrap();
        let opts = ShardOptions::new(Strategy::Zero2);
        let mut sh = Sharded::new(rank.clone(), &mut model, Sgd::new(0.1), opts)
            .await
            .unwrap();
        let mut grads =
            GradientsParams::from_grads(loss(&net, rank.rank(), &device).backward(), &net);
        model.pull_grads(&mut grads).unwrap();
        model.mark_ready(&mut sh).unwrap_err().to_string()
    });
    for err in out {
        assert!(err.contains("fc1.weight takes no gradient"), "{err}");
    }
}

/// A parameter frozen when the model was made and trained since (its
/// gradient is there) is synced and stepped like any other: the frozen
/// mark is what the module was, the gradient what it is.
#[test]
fn a_parameter_unfrozen_after_the_model_was_made_is_trained_in_step() {
    let out = on_ranks(2, |rank| async move {
        let device = Device::default().autodiff();
        let model = BurnModel::from_module(&with_frozen_fc1(&device)).unwrap();
        // A trainable module with the frozen one's ids (a clone would share
        // burn's lazy parameter state, and no_grad on it would freeze both).
        let net = Net::new(&device);
        let mut other = BurnModel::from_module(&net).unwrap();
        let net = other.adopt_ids(net, &model.param_ids()).unwrap();
        ddp_steps(rank, model, net, &device, None).await
    });
    let (start0, end0) = &out[0];
    for (r, (start, end)) in out.iter().enumerate() {
        assert_eq!(start, start0, "rank {r}'s start");
        assert_eq!(end, end0, "rank {r} ended out of step with rank 0");
        for ((name, a), (_, b)) in start.iter().zip(end) {
            assert_ne!(a, b, "rank {r}: {name} did not move");
        }
    }
}
