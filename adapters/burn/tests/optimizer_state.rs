//! burn keys its optimizer state by parameter id, and a module made again
//! (a resumed run) gets new ids. With the ids saved by module path and
//! adopted by the new module, Adam's saved state applies: a resumed run
//! steps exactly as the run that never stopped.

mod common;

use burn::{
    Tensor,
    optim::{AdamConfig, GradientsParams, ModuleOptimizer, OptimizerRecord},
    tensor::{Device, TensorData},
};
use common::Net;
use consort_burn::BurnModel;

/// The loss of step `s` (two samples).
fn loss(net: &Net, s: usize, device: &Device) -> Tensor<1> {
    let v = |k: usize| (((s * 31 + k * 3) % 17) as f32 - 8.0) / 8.0;
    let x = Tensor::<2>::from_data(TensorData::new((0..8).map(v).collect(), [2, 4]), device);
    let y = Tensor::<2>::from_data(TensorData::new((8..14).map(v).collect(), [2, 3]), device);
    (net.forward(x) - y).powf_scalar(2.0).mean()
}

fn values(net: &Net) -> Vec<u8> {
    let host = BurnModel::from_module(net).unwrap();
    let sd = host.state_dict();
    sd.tensors.values().flat_map(|t| t.data.clone()).collect()
}

#[test]
fn adam_state_saved_by_module_path_resumes_exactly() {
    let device = Device::default().autodiff();
    let mut net = Net::new(&device);
    let mut optim = AdamConfig::new().init();
    let step = |net: Net, optim: &mut ModuleOptimizer, s: usize| {
        let grads = GradientsParams::from_grads(loss(&net, s, &device).backward(), &net);
        optim.step(0.01, net, grads)
    };
    for s in 0..3 {
        net = step(net, &mut optim, s);
    }
    // The checkpoint: values, ids by module path, and the optimizer record.
    let mut saved = BurnModel::from_module(&net).unwrap();
    saved.pull_values(&net).unwrap();
    let (sd, ids) = (saved.state_dict(), saved.param_ids());
    let record = optim.to_record().into_bytes().unwrap();
    // The run that goes on.
    let mut going = net;
    for s in 3..6 {
        going = step(going, &mut optim, s);
    }

    // The resumed run: a new module (new ids), the saved values and state.
    let fresh = Net::new(&device);
    let mut host = BurnModel::from_module(&fresh).unwrap();
    host.load_state_dict(&sd).unwrap();
    let fresh = host.push_values(fresh).unwrap();
    let mut resumed = host.adopt_ids(fresh, &ids).unwrap();
    assert_eq!(host.param_ids(), ids);
    let mut optim2 = AdamConfig::new()
        .init()
        .load_record(OptimizerRecord::from_bytes(record.clone()).unwrap());
    for s in 3..6 {
        resumed = step(resumed, &mut optim2, s);
    }
    assert_eq!(
        values(&resumed),
        values(&going),
        "the resumed run stepped differently"
    );

    // Without the ids, the record does not apply (burn starts Adam again):
    // the check above can fail.
    let fresh = Net::new(&device);
    let mut host = BurnModel::from_module(&fresh).unwrap();
    host.load_state_dict(&sd).unwrap();
    let mut lost = host.push_values(fresh).unwrap();
    let mut optim3 = AdamConfig::new()
        .init()
        .load_record(OptimizerRecord::from_bytes(record).unwrap());
    for s in 3..6 {
        lost = step(lost, &mut optim3, s);
    }
    assert_ne!(values(&lost), values(&going));
}
