//! The candle adapter on the simulator: a `candle_nn::Linear` trained by
//! two ranks from different initial values and different data ends with
//! the same weights on both, and the averaged gradient in each GradStore.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder, VarMap};
use consort_candle::CandleModel;
use consort_comm::Backend;
use consort_ddp::{Ddp, DdpOptions};
use consort_sim::{SimConfig, SimWorld};

#[test]
fn candle_linear_layers_stay_in_step_and_get_the_mean_gradient() {
    let out = SimWorld::new(SimConfig::new(2))
        .expect("sim world")
        .run_each(|rank| async move {
            let rank = Arc::new(rank);
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
        })
        .expect("tokio runtime");
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

/// A two-layer candle MLP (3 → 4 → 2) on `dev`, every variable filled with
/// values that depend on `seed` (so ranks start apart unless told).
fn mlp(seed: f32) -> (VarMap, impl Fn(&Tensor) -> Tensor) {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let fc1 = candle_nn::linear(3, 4, vb.pp("fc1")).unwrap();
    let fc2 = candle_nn::linear(4, 2, vb.pp("fc2")).unwrap();
    for (name, v) in varmap.data().lock().unwrap().iter() {
        let n = v.as_tensor().elem_count();
        let vals: Vec<f32> = (0..n)
            .map(|i| ((i as f32 + name.len() as f32) * 0.37 + seed).sin() * 0.5)
            .collect();
        let t = Tensor::from_vec(vals, v.as_tensor().dims(), &dev).unwrap();
        v.set(&t).unwrap();
    }
    let forward = move |x: &Tensor| {
        let h = fc1.forward(x).unwrap().tanh().unwrap();
        fc2.forward(&h).unwrap()
    };
    (varmap, forward)
}

/// Rank `r`'s batch at step `s`: 2 rows of inputs and targets.
fn batch(r: usize, s: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..6)
        .map(|i| ((r * 31 + s * 7 + i) as f32 * 0.53).cos())
        .collect();
    let y: Vec<f32> = (0..4)
        .map(|i| ((r * 13 + s * 5 + i) as f32 * 0.29).sin())
        .collect();
    (
        Tensor::from_vec(x, (2, 3), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (2, 2), &Device::Cpu).unwrap(),
    )
}

fn mse(pred: &Tensor, y: &Tensor) -> Tensor {
    (pred - y).unwrap().sqr().unwrap().mean_all().unwrap()
}

/// The variables of `varmap`, by name.
fn values(varmap: &VarMap) -> Vec<(String, Vec<f32>)> {
    let data = varmap.data().lock().unwrap();
    let mut out: Vec<_> = data
        .iter()
        .map(|(n, v)| {
            let t = v.as_tensor().flatten_all().unwrap();
            (n.clone(), t.to_vec1::<f32>().unwrap())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

const STEPS: usize = 3;
const LR: f64 = 0.1;

/// One process on every rank's batches at once, with plain SGD: what the
/// sharded ranks must end at (the mean of equal-sized ranks' mean losses
/// is the mean loss of their union).
fn one_process(world: usize) -> Vec<(String, Vec<f32>)> {
    let (varmap, forward) = mlp(0.0);
    for s in 0..STEPS {
        let (xs, ys): (Vec<_>, Vec<_>) = (0..world).map(|r| batch(r, s)).unzip();
        let x = Tensor::cat(&xs, 0).unwrap();
        let y = Tensor::cat(&ys, 0).unwrap();
        let grads = mse(&forward(&x), &y).backward().unwrap();
        for v in varmap.all_vars() {
            let g = grads.get(v.as_tensor()).unwrap();
            let next = (v.as_tensor() - (g * LR).unwrap()).unwrap();
            v.set(&next).unwrap();
        }
    }
    values(&varmap)
}

/// ZeRO-1, ZeRO-2 and FSDP over a candle MLP on 2 and 3 simulated ranks
/// (each its own data, rank 0's start) end where one process on every
/// rank's data ends, and every rank holds the same weights.
#[test]
fn sharded_strategies_train_a_candle_model_as_one_process_does() {
    use consort_ddp::{Sgd, ShardOptions, Sharded, Strategy};
    for world in [2, 3] {
        let want = one_process(world);
        for strategy in [Strategy::Zero1, Strategy::Zero2, Strategy::Fsdp] {
            let out = SimWorld::new(SimConfig::new(world))
                .expect("sim world")
                .run_each(move |rank| async move {
                    let rank = Arc::new(rank);
                    let r = rank.rank();
                    let (varmap, forward) = mlp(r as f32);
                    let mut model = CandleModel::from_varmap(&varmap).unwrap();
                    // One unit per layer: fc1.{bias,weight}, fc2.{bias,weight}.
                    let opts = ShardOptions::new(strategy).units(vec![vec![0, 1], vec![2, 3]]);
                    let mut sh = Sharded::new(rank, &mut model, Sgd::new(LR), opts)
                        .await
                        .unwrap();
                    for s in 0..STEPS {
                        for u in 0..sh.layout().units.len() {
                            model.set_gathered(&sh.gather(u).await.unwrap()).unwrap();
                        }
                        let (x, y) = batch(r, s);
                        let grads = mse(&forward(&x), &y).backward().unwrap();
                        model.mark_grads(&grads, &mut sh).unwrap();
                        sh.step().await.unwrap();
                    }
                    for u in 0..sh.layout().units.len() {
                        model.set_gathered(&sh.gather(u).await.unwrap()).unwrap();
                    }
                    values(&varmap)
                })
                .expect("tokio runtime");
            for (r, got) in out.iter().enumerate() {
                for ((name, g), (_, w)) in got.iter().zip(&want) {
                    let diff = g
                        .iter()
                        .zip(w)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        diff <= 1e-5,
                        "{strategy:?} world {world} rank {r}: {name} differs by {diff}"
                    );
                }
            }
        }
    }
}

/// A candle model of one `linear(inputs, outputs)` layer named `name`:
/// not the model a test's strategy wrapped.
fn another_model(name: &str, inputs: usize, outputs: usize) -> (VarMap, CandleModel) {
    let small = VarMap::new();
    let vb = VarBuilder::from_varmap(&small, DType::F32, &Device::Cpu);
    let _ = candle_nn::linear(inputs, outputs, vb.pp(name)).unwrap();
    let model = CandleModel::from_varmap(&small).unwrap();
    (small, model)
}

/// A model that is not the one the strategy wrapped is refused by name.
#[test]
fn marking_another_models_gradients_is_an_error_not_a_panic() {
    use consort_ddp::{Sgd, ShardOptions, Sharded, Strategy};
    let out = SimWorld::new(SimConfig::new(1))
        .expect("sim world")
        .run_each(|rank| async move {
            let rank = Arc::new(rank);
            let (varmap, forward) = mlp(0.0);
            let mut model = CandleModel::from_varmap(&varmap).unwrap();
            let opts = ShardOptions::new(Strategy::Zero2);
            let mut sh = Sharded::new(rank, &mut model, Sgd::new(LR), opts)
                .await
                .unwrap();
            let (_vars, mut other) = another_model("fc1", 3, 4);
            let (x, y) = batch(0, 0);
            let grads = mse(&forward(&x), &y).backward().unwrap();
            let g = sh.gather(0).await.unwrap();
            let wrong = other.set_gathered(&g).map(|_| ()).err();
            let marked = other.mark_grads(&grads, &mut sh).err();
            (wrong.map(|e| e.to_string()), marked.map(|e| e.to_string()))
        })
        .expect("tokio runtime");
    let (wrong, marked) = &out[0];
    let marked = marked
        .as_deref()
        .expect("another model's gradients refused");
    assert!(
        marked.contains("[\"fc1.bias\", \"fc1.weight\"]") && marked.contains("fc2.weight"),
        "{marked}"
    );
    // One unit (the default) of four parameters, for two variables.
    let wrong = wrong.as_deref().expect("another model's unit refused");
    assert!(
        wrong.contains("a parameter 2, but this CandleModel has 2 variables"),
        "{wrong}"
    );
}

/// A unit whose parameters do not fit the variables is refused by name.
#[test]
fn a_unit_that_does_not_fit_the_variables_is_an_error_not_a_panic() {
    use consort_ddp::{Sgd, ShardOptions, Sharded, Strategy};
    let out = SimWorld::new(SimConfig::new(1))
        .expect("sim world")
        .run_each(|rank| async move {
            let rank = Arc::new(rank);
            let (varmap, _) = mlp(0.0);
            let mut model = CandleModel::from_varmap(&varmap).unwrap();
            let opts = ShardOptions::new(Strategy::Fsdp).units(vec![vec![0, 1], vec![2, 3]]);
            let mut sh = Sharded::new(rank, &mut model, Sgd::new(LR), opts)
                .await
                .unwrap();
            let (_vars, mut other) = another_model("fc", 5, 2);
            let g = sh.gather(0).await.unwrap();
            other.set_gathered(&g).unwrap_err().to_string()
        })
        .expect("tokio runtime");
    assert!(
        out[0].contains("unit 0's parameter 0 has 4 elements, but variable fc.bias has 2"),
        "{}",
        out[0]
    );
}
