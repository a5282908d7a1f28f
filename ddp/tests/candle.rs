//! The candle adapter on the simulator: a `candle_nn::Linear` trained by
//! two ranks from different initial values and different data ends with
//! the same weights on both, and the averaged gradient in each GradStore.

#![cfg(feature = "candle")]

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder, VarMap};
use common::run_sim;
use consort_comm::Backend;
use consort_ddp::{Ddp, DdpOptions, candle::CandleModel};
use consort_sim::SimConfig;

#[test]
fn candle_linear_layers_stay_in_step_and_get_the_mean_gradient() {
    let (out, _) = run_sim(SimConfig::new(2), |rank| async move {
        let r = rank.rank();
        let dev = Device::Cpu;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
        let lin = candle_nn::linear(3, 2, vb.pp("fc")).unwrap();
        // Different initial values on each rank.
        for (_, v) in varmap.data().lock().unwrap().iter() {
            let t = (v.as_tensor().ones_like().unwrap() * (r as f64 + 1.0)).unwrap();
            v.set(&t).unwrap();
        }
        let mut model = CandleModel::from_varmap(&varmap).unwrap();
        let names: Vec<String> = model.vars().iter().map(|(n, _)| n.clone()).collect();
        let mut ddp = Ddp::new(rank, &mut model, DdpOptions::default())
            .await
            .unwrap();
        model.push_values().unwrap();

        let x = Tensor::new(&[[r as f32 + 1.0, 2.0, -1.0]], &dev).unwrap();
        let loss = lin.forward(&x).unwrap().sum_all().unwrap();
        let mut grads = loss.backward().unwrap();
        model.pull_grads(&grads).unwrap();
        ddp.sync_grads(&mut model).await.unwrap();
        model.push_grads(&mut grads).unwrap();
        let w = model.vars()[1].1.as_tensor();
        let gw = grads.get(w).unwrap().to_vec2::<f32>().unwrap();
        let values = w.to_vec2::<f32>().unwrap();
        (names, values, gw)
    });
    assert_eq!(
        out[0].0,
        vec!["fc.bias".to_string(), "fc.weight".to_string()]
    );
    for (_, values, gw) in &out {
        // Rank 0's initial values everywhere.
        assert_eq!(values, &vec![vec![1.0f32; 3]; 2]);
        // d(sum(Wx+b))/dW = x per row; the mean of x over the ranks.
        assert_eq!(gw, &vec![vec![1.5f32, 2.0, -1.0]; 2]);
    }
}
