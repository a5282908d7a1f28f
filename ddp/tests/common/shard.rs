//! What the sharded strategies' tests share (host and device): the
//! optimizers, the one-process reference, the cases and the comparison,
//! and a host run on the simulator.

use std::sync::Arc;

use consort_comm::Backend;
use consort_ddp::{
    AdamW, DdpError, PlainModel, Sgd, ShardOptimizer, ShardOptions, Sharded, Strategy,
};
use consort_sim::SimConfig;
use proptest::{prelude::*, strategy::Strategy as _};

use super::{Case, Shape, make_case, run_sim};

/// Which optimizer a case uses.
#[derive(Clone, Copy, Debug)]
pub enum Opt {
    /// SGD, momentum 0.5, lr 1 (exact: every value stays a short binary
    /// fraction).
    SgdExact,
    /// SGD with momentum 0.9, weight decay 0.01.
    Sgd,
    /// AdamW, lr 0.01.
    AdamW,
}

pub fn optimizer(o: Opt) -> Box<dyn ShardOptimizer> {
    match o {
        Opt::SgdExact => Box::new(Sgd::new(1.0).momentum(0.5)),
        Opt::Sgd => Box::new(Sgd::new(0.05).momentum(0.9).weight_decay(0.01)),
        Opt::AdamW => Box::new(AdamW::new(0.01)),
    }
}

/// One process, the global batch, the optimizer on each whole parameter
/// (elementwise, so the same as on any split of it). Returns parameters
/// and each parameter's optimizer slots.
pub fn reference(
    c: &Case,
    o: Opt,
    steps: std::ops::Range<usize>,
    start: Vec<Vec<f64>>,
) -> Vec<Vec<f64>> {
    let opt = optimizer(o);
    let mut params = start;
    let mut state: Vec<Vec<Vec<f64>>> = params
        .iter()
        .map(|p| vec![vec![0.0; p.len()]; opt.slots()])
        .collect();
    let scale = if c.exact {
        1.0
    } else {
        1.0 / (c.world * c.batch) as f64
    };
    for (t, step) in c.data.iter().enumerate() {
        let (xs, ys): (Vec<_>, Vec<_>) = step.iter().flatten().flatten().cloned().unzip();
        let mut grads = vec![Vec::new(); params.len()];
        c.mlp
            .backward(&params, &xs, &ys, scale, |i, g| grads[i] = g);
        if !steps.contains(&t) {
            continue;
        }
        for ((p, g), s) in params.iter_mut().zip(&grads).zip(&mut state) {
            let mut slots: Vec<&mut [f64]> = s.iter_mut().map(|v| v.as_mut_slice()).collect();
            opt.step_f64(t as u64 + 1, p, g, &mut slots);
        }
    }
    params
}

/// Cases: an MLP, a world, steps and data (one micro-batch per step).
pub fn cases(max_world: usize) -> impl proptest::strategy::Strategy<Value = Case> {
    (
        prop::collection::vec(1usize..6, 2..4),
        1usize..=max_world,
        1usize..4,
        1usize..4,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(dims, world, batch, steps, exact, seed)| {
            make_case(Shape {
                dims,
                world,
                batch,
                micro: 1,
                steps,
                cap: None,
                view: false,
                exact,
                seed,
            })
        })
}

/// A strategy for a world of `world` (HSDP's shard size divides it).
pub fn strategy_for(world: usize, pick: usize, g: usize) -> Strategy {
    match pick % 4 {
        0 => Strategy::Zero1,
        1 => Strategy::Zero2,
        2 => Strategy::Fsdp,
        _ => {
            let divisors: Vec<usize> = (1..=world).filter(|d| world.is_multiple_of(*d)).collect();
            Strategy::Hsdp {
                shard_size: divisors[g % divisors.len()],
            }
        }
    }
}

pub fn check(c: &Case, got: &[Vec<Vec<f64>>], want: &[Vec<f64>]) -> Result<(), TestCaseError> {
    for (r, params) in got.iter().enumerate() {
        for (p, (g, w)) in params.iter().zip(want).enumerate() {
            prop_assert_eq!(g.len(), w.len());
            for (k, (a, b)) in g.iter().zip(w).enumerate() {
                if c.exact {
                    prop_assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "rank {} param {} [{}]: {} vs {} (exact)",
                        r,
                        p,
                        k,
                        a,
                        b
                    );
                } else {
                    prop_assert!(
                        (a - b).abs() <= 1e-6 * (1.0 + a.abs().max(b.abs())),
                        "rank {} param {} [{}]: {} vs {}",
                        r,
                        p,
                        k,
                        a,
                        b
                    );
                }
            }
        }
    }
    Ok(())
}

/// How a distributed run goes.
#[derive(Clone, Debug)]
pub struct Run {
    pub strategy: Strategy,
    pub opt: Opt,
    pub unit_cap: usize,
    /// Gather every unit again, in reverse, before backward (FSDP's
    /// reshard after forward), instead of keeping the forward's copies.
    pub regather: bool,
    /// Keep the forward's gathers alive across `step()` (a caller that
    /// still holds them): they must keep the values they had, and the step
    /// must be the same.
    pub hold: bool,
}

/// One rank's training steps `steps` of `c`; returns its final parameters.
pub async fn train(
    rank: Arc<dyn Backend>,
    c: &Case,
    run: &Run,
    sh: &mut Sharded,
    steps: std::ops::Range<usize>,
) -> Result<(), DdpError> {
    let r = rank.rank();
    let scale = if c.exact {
        c.world as f64
    } else {
        1.0 / c.batch as f64
    };
    let units = sh.layout().units.len();
    for step in &c.data[steps] {
        let mut got = Vec::new();
        for u in 0..units {
            got.push(sh.gather(u).await?);
        }
        if run.regather {
            got.clear();
            for u in (0..units).rev() {
                got.push(sh.gather(u).await?);
            }
        }
        let params: Vec<Vec<f64>> = (0..sh.params().len())
            .map(|p| {
                let g = got.iter().find(|g| g.param::<f64>(p).is_ok()).unwrap();
                g.param::<f64>(p).unwrap().to_vec()
            })
            .collect();
        let held = if run.hold { got } else { Vec::new() };
        let (xs, ys): (Vec<_>, Vec<_>) = step[0][r].iter().cloned().unzip();
        let mut err = Ok(());
        c.mlp.backward(&params, &xs, &ys, scale, |i, g| {
            if err.is_ok() {
                err = sh.mark_ready(i, &g);
            }
        });
        err?;
        sh.step().await?;
        for (p, before) in params.iter().enumerate() {
            if let Some(g) = held.iter().find(|g| g.param::<f64>(p).is_ok()) {
                assert_eq!(
                    g.param::<f64>(p).unwrap(),
                    &before[..],
                    "a held gather changed"
                );
            }
        }
    }
    Ok(())
}

/// The initial model on rank `r` (garbage off rank 0: Sharded::new's
/// broadcast fixes it).
pub fn model_for(c: &Case, r: usize) -> PlainModel {
    let init: Vec<Vec<f64>> = if r == 0 {
        c.init.clone()
    } else {
        c.init
            .iter()
            .map(|p| vec![7.0 + r as f64; p.len()])
            .collect()
    };
    c.mlp.model(&init)
}

pub fn options(run: &Run) -> ShardOptions {
    let mut o = ShardOptions::new(run.strategy);
    o.unit_cap_bytes = Some(run.unit_cap);
    o
}

pub fn read(model: &PlainModel) -> Vec<Vec<f64>> {
    (0..model.len())
        .map(|i| model.param::<f64>(i).unwrap().to_vec())
        .collect()
}

/// Every rank, every step; each rank's final parameters.
pub fn distributed(c: &Case, run: &Run) -> Vec<Vec<Vec<f64>>> {
    let (c, run) = (Arc::new(c.clone()), Arc::new(run.clone()));
    let (out, _) = run_sim(SimConfig::new(c.world), move |rank| {
        let (c, run) = (c.clone(), run.clone());
        async move {
            let rank: Arc<dyn Backend> = rank;
            let mut model = model_for(&c, rank.rank());
            let mut sh = Sharded::new(rank.clone(), &mut model, optimizer(run.opt), options(&run))
                .await
                .unwrap();
            train(rank, &c, &run, &mut sh, 0..c.data.len())
                .await
                .unwrap();
            sh.copy_params_to(&mut model).await.unwrap();
            read(&model)
        }
    });
    out
}

/// A fixed case: an MLP 5 → 7 → 3 (uneven for every world), 4 steps.
pub fn fixed(world: usize) -> Case {
    make_case(Shape {
        dims: vec![5, 7, 3],
        world,
        batch: 2,
        micro: 1,
        steps: 4,
        cap: None,
        view: false,
        exact: false,
        seed: 11,
    })
}

/// One rank of an emulated-device world: its rank, device, compute stream
/// (in `place`) and stream-ordered communicator.
pub struct EmulatedRank {
    pub rank: usize,
    pub device: Arc<consort_sim::EmulatedDevice>,
    pub place: consort_comm::Placement,
    pub comm: Arc<dyn Backend>,
}

/// Runs `f` for every rank of a world of `world`, each on a thread of its
/// own (device synchronization blocks the host, as on a GPU) with its own
/// emulated device (seeded from `seed`, copies completing up to 40 µs late
/// and out of order) and communicator over the simulator; each rank's
/// result, in rank order.
pub fn on_emulated_ranks<T, F, Fut>(world: usize, seed: u64, f: F) -> Vec<T>
where
    F: Fn(EmulatedRank) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = T>,
    T: Send + 'static,
{
    use consort_comm::Device;
    use consort_sim::{EmulatedComm, EmulatedCommOptions, EmulatedDevice, EmulatedOptions};
    let sim = consort_sim::SimWorld::new(SimConfig::new(world)).expect("sim world");
    let threads: Vec<_> = sim
        .ranks()
        .into_iter()
        .map(|rank| {
            let f = f.clone();
            std::thread::spawn(move || {
                let r = rank.rank();
                let device = EmulatedDevice::new(EmulatedOptions {
                    seed: seed ^ (r as u64 + 1),
                    max_delay: std::time::Duration::from_micros(40),
                    sync_timeout: std::time::Duration::from_secs(10),
                    ..Default::default()
                });
                let stream = device.new_stream().unwrap();
                let place = consort_comm::Placement {
                    device: device.clone(),
                    stream,
                };
                let opts = EmulatedCommOptions {
                    seed: seed ^ 0x5eed,
                    ..Default::default()
                };
                let comm = EmulatedComm::new(Arc::new(rank), device.clone(), opts).unwrap();
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(f(EmulatedRank {
                    rank: r,
                    device,
                    place,
                    comm: Arc::new(comm),
                }))
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread panicked"))
        .collect()
}

/// The optimizer of a case (integer data: SGD keeps every value a short
/// binary fraction for its steps; AdamW's square root does so only for
/// its first, so such a case keeps one step).
pub fn opt_for(c: &mut Case, adamw: bool) -> Opt {
    match (c.exact, adamw) {
        (true, true) => {
            c.data.truncate(1);
            Opt::AdamW
        }
        (true, false) => Opt::SgdExact,
        (false, true) => Opt::AdamW,
        (false, false) => Opt::Sgd,
    }
}
