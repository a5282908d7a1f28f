//! `consort bench sharded`: what each strategy keeps per rank, and what a
//! step costs, against DDP.
//!
//! - Alone, it builds a model of `params` f32 parameters in `layers` layers
//!   (one wrapping unit each) on simulated worlds of 1, 2, 4 and 8 ranks,
//!   wraps it in DDP and in every sharded strategy with AdamW, and prints
//!   rank 0's bytes of parameters, gradients and optimizer state beside
//!   the ZeRO paper's formula, and the communication time of one step on
//!   the simulator's cost model (loopback TCP links, no overlap).
//! - As one rank of a launched job (`consort run --standalone
//!   --nproc-per-node 2 -- consort bench sharded`), rank 0 prints the
//!   median step time of each strategy over the real backend: a synthetic
//!   backward, layer by layer, then AdamW.

use std::{sync::Arc, time::Instant};

use consort::{
    Backend, OpKind, ProcessGroup, ReduceOp,
    algo::AlgoConfig,
    ddp::{
        AdamW, Ddp, DdpOptions, Memory, PlainModel, ShardOptimizer, ShardOptions, Sharded, Strategy,
    },
    sim::{
        SimConfig, SimWorld,
        cost::{Link, Topology, simulate},
    },
};
use serde_json::json;

use super::ddp::backward_layer;
use crate::table::Table;

type BoxError = Box<dyn std::error::Error>;

/// The strategies compared at world `world` (`None`: DDP). HSDP shards
/// within halves of the world.
pub(super) fn strategies(world: usize) -> Vec<Option<Strategy>> {
    let mut s = vec![
        None,
        Some(Strategy::Zero1),
        Some(Strategy::Zero2),
        Some(Strategy::Fsdp),
    ];
    if world >= 4 && world.is_multiple_of(2) {
        s.push(Some(Strategy::Hsdp {
            shard_size: world / 2,
        }));
    }
    s
}

/// A strategy's name in the tables (`None`: DDP).
pub(super) fn name(s: Option<Strategy>) -> String {
    s.map_or("ddp".into(), |s| s.to_string())
}

/// `params` f32 parameters in `layers` layers (the last takes the
/// remainder), each a weight: rank-dependent values.
fn model(params: usize, layers: usize, rank: usize) -> Result<PlainModel, BoxError> {
    let layers = layers.max(1);
    let per = params / layers;
    let mut m = PlainModel::new();
    for l in 0..layers {
        let n = if l + 1 == layers {
            params - per * l
        } else {
            per
        };
        m.add_param(format!("layers.{l}.weight"), vec![n], &vec![rank as f32; n])?;
    }
    Ok(m)
}

/// Rank 0's memory under `strategy` on a simulated world.
async fn measure(
    world: usize,
    strategy: Option<Strategy>,
    params: usize,
    layers: usize,
) -> Result<Memory, BoxError> {
    let sim = SimWorld::new(SimConfig::new(world))?;
    let tasks: Vec<_> = sim
        .ranks()
        .into_iter()
        .map(|r| {
            let b: Arc<dyn Backend> = Arc::new(r);
            tokio::spawn(async move {
                let mut m = model(params, layers, b.rank()).map_err(|e| e.to_string())?;
                let Some(s) = strategy else {
                    let ddp = Ddp::new(b, &mut m, DdpOptions::default())
                        .await
                        .map_err(|e| e.to_string())?;
                    let psi: usize = ddp.params().iter().map(|p| p.bytes()).sum();
                    return Ok::<_, String>(Memory {
                        params: psi,
                        grads: ddp.bucket_bytes(),
                        // An unsharded AdamW: two slots per element.
                        optimizer: 2 * psi,
                    });
                };
                let units = (0..layers.max(1)).map(|l| vec![l]).collect();
                let opts = ShardOptions::new(s).units(units);
                let sh = Sharded::new(b, &mut m, AdamW::new(1e-3), opts)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(sh.memory())
            })
        })
        .collect();
    let mut first = None;
    for t in tasks {
        let m = t.await??;
        first.get_or_insert(m);
    }
    first.ok_or_else(|| "no ranks".into())
}

/// One step's communication on the cost model: the calls each strategy
/// makes per layer of `bytes`, one after another.
fn comm_seconds(
    s: Option<Strategy>,
    world: usize,
    layers: usize,
    bytes: usize,
) -> Result<f64, BoxError> {
    let cfg = AlgoConfig::default();
    let link = Link::loopback_tcp();
    let time = |op: OpKind, bytes: usize, n: usize| -> Result<f64, BoxError> {
        if n < 2 || bytes == 0 {
            return Ok(0.0);
        }
        let topo = Topology::flat(n, link);
        Ok(simulate(op, cfg.select(op, bytes, n), bytes, &topo, &cfg)?.time)
    };
    let (ag, rs, ar) = (OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllReduce);
    let per_layer = match s {
        None => time(ar, bytes, world)?,
        Some(Strategy::Zero1) => time(ar, bytes, world)? + time(ag, bytes, world)?,
        Some(Strategy::Zero2) => time(rs, bytes, world)? + time(ag, bytes, world)?,
        // Gathered for forward and again for backward, then reduce-scattered.
        Some(Strategy::Fsdp) => 2.0 * time(ag, bytes, world)? + time(rs, bytes, world)?,
        Some(Strategy::Hsdp { shard_size: g }) => {
            2.0 * time(ag, bytes, g)? + time(rs, bytes, g)? + time(ar, bytes / g, world / g)?
        }
    };
    Ok(per_layer * layers as f64)
}

/// The memory table (and the cost model's step communication).
pub(crate) async fn memory(params: usize, layers: usize) -> Result<Table, BoxError> {
    let mut t = Table::new(&[
        "world",
        "strategy",
        "params_bytes",
        "params_formula",
        "grads_bytes",
        "grads_formula",
        "optim_bytes",
        "optim_formula",
        "total_vs_ddp",
        "sim_comm_ms",
        "sim_comm_vs_ddp",
    ]);
    let psi = params * 4;
    let layer_bytes = psi / layers.max(1);
    for world in [1usize, 2, 4, 8] {
        let mut ddp = None;
        for s in strategies(world) {
            let m = measure(world, s, params, layers).await?;
            let n = match s {
                Some(Strategy::Hsdp { shard_size }) => shard_size,
                _ => world,
            };
            let f = Memory::expected(s, psi, n, 2);
            let comm = comm_seconds(s, world, layers, layer_bytes)?;
            let (base_mem, base_comm) = *ddp.get_or_insert((m.total(), comm));
            t.push(vec![
                json!(world),
                json!(name(s)),
                json!(m.params),
                json!(f.params),
                json!(m.grads),
                json!(f.grads),
                json!(m.optimizer),
                json!(f.optimizer),
                json!(format!("{:.3}", m.total() as f64 / base_mem as f64)),
                json!(format!("{:.3}", comm * 1e3)),
                json!(if base_comm > 0.0 {
                    format!("{:.2}", comm / base_comm)
                } else {
                    "-".into()
                }),
            ]);
        }
    }
    Ok(t)
}

/// One step's time as the slowest rank's (the anchors' and nccl-tests'
/// way): every rank's milliseconds, all-reduced with Max outside the timed
/// region.
pub(super) async fn slowest(backend: &Arc<dyn Backend>, ms: f64) -> Result<f64, BoxError> {
    let mut v = [ms];
    ProcessGroup::new(backend.clone())
        .all_reduce(&mut v, ReduceOp::Max)
        .await?;
    Ok(v[0])
}

/// The step under `s` (`None`: DDP, then AdamW on every parameter), timed
/// as the slowest rank's; the median of `iters` after one warm-up step.
async fn time_steps(
    backend: Arc<dyn Backend>,
    s: Option<Strategy>,
    params: usize,
    layers: usize,
    work: usize,
    iters: usize,
) -> Result<f64, BoxError> {
    let rank = backend.rank();
    let bias = rank as f32 * 1e-3;
    // The timing's own all_reduce, on the same ranks.
    let timer = backend.clone();
    let mut m = model(params, layers, 0)?;
    let opt = AdamW::new(1e-3);
    let mut times = Vec::new();
    let sizes = (0..m.len())
        .map(|i| m.param::<f32>(i).map(<[f32]>::len))
        .collect::<Result<Vec<usize>, _>>()?;
    let mut grad: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
    if let Some(s) = s {
        let units = (0..layers.max(1)).map(|l| vec![l]).collect();
        let mut sh = Sharded::new(backend, &mut m, opt, ShardOptions::new(s).units(units)).await?;
        for it in 0..=iters {
            let t = Instant::now();
            let mut gathered = Vec::new();
            for l in 0..sizes.len() {
                gathered.push(sh.gather(l).await?);
            }
            for l in (0..sizes.len()).rev() {
                let p = if s.shards_params() {
                    sh.gather(l).await?
                } else {
                    gathered[l].clone()
                };
                backward_layer(p.param::<f32>(l)?, &mut grad[l], work, bias);
                drop(p);
                sh.mark_ready(l, &grad[l])?;
            }
            drop(gathered);
            sh.step().await?;
            let ms = slowest(&timer, t.elapsed().as_secs_f64() * 1e3).await?;
            if it > 0 {
                times.push(ms);
            }
        }
    } else {
        let mut ddp = Ddp::new(backend, &mut m, DdpOptions::default()).await?;
        let mut state: Vec<[Vec<f32>; 2]> = sizes
            .iter()
            .map(|&n| [vec![0.0; n], vec![0.0; n]])
            .collect();
        for it in 0..=iters {
            let t = Instant::now();
            for l in (0..sizes.len()).rev() {
                backward_layer(m.param::<f32>(l)?, &mut grad[l], work, bias);
                ddp.mark_ready(l, &grad[l])?;
            }
            ddp.finish().await?;
            for (l, [a, b]) in state.iter_mut().enumerate() {
                let g = ddp.grad::<f32>(l)?.to_vec();
                opt.step_f32(it as u64 + 1, m.param_mut::<f32>(l)?, &g, &mut [a, b]);
            }
            let ms = slowest(&timer, t.elapsed().as_secs_f64() * 1e3).await?;
            if it > 0 {
                times.push(ms);
            }
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// As one rank of a launched job: every strategy's step time; rank 0
/// returns the table.
pub(crate) async fn steps(
    params: usize,
    layers: usize,
    work: usize,
    iters: usize,
) -> Result<Option<Table>, BoxError> {
    let dist = consort::init_from_env().await?;
    let pg = dist.process_group().await?;
    let backend: Arc<dyn Backend> = pg.backend().clone();
    let world = pg.world_size();
    let mut t = Table::new(&[
        "backend", "world", "params", "strategy", "step_ms", "vs_ddp",
    ]);
    let mut base = None;
    for s in strategies(world) {
        let ms = time_steps(backend.clone(), s, params, layers, work, iters).await?;
        let b = *base.get_or_insert(ms);
        t.push(vec![
            json!(backend.name()),
            json!(world),
            json!(params),
            json!(name(s)),
            json!(format!("{ms:.2}")),
            json!(format!("{:.2}", ms / b)),
        ]);
    }
    let rank = backend.rank();
    drop(backend);
    drop(pg);
    dist.shutdown().await?;
    Ok((rank == 0).then_some(t))
}
