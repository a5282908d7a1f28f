//! DDP for a candle model: a two-layer MLP on a synthetic regression,
//! trained by every rank of the job, on the CPU or (feature `candle-cuda`)
//! on a GPU with NCCL and no host copies.
//!
//! ```text
//! # 2 simulated ranks in this process (CPU)
//! cargo run -p consort --features candle --example candle_ddp -- --backend sim --world-size 2
//! # one process per rank over TCP
//! consort run --standalone --nproc-per-node 2 -- target/debug/examples/candle_ddp --backend tcp
//! # FSDP instead of DDP (or zero1, zero2)
//! consort run --standalone --nproc-per-node 2 -- target/debug/examples/candle_ddp --backend tcp --strategy fsdp
//! # on GPUs over NCCL (one per rank)
//! consort run --standalone --nproc-per-node 2 -- target/release/examples/candle_ddp --device cuda
//! ```
//!
//! `--strategy zero1|zero2|fsdp` trains the same model sharded
//! (`consort::ddp::Sharded` with its SGD, each rank updating its shard)
//! instead of DDP with candle's SGD; both end at the same weights.
//!
//! Every rank starts from different values (DDP broadcasts rank 0's) and
//! trains on its own data. At the end every rank's variables are compared
//! (an all_reduce of max and min); the run prints one JSON line (final
//! loss, the ranks' largest disagreement, the sum of the weights), and
//! `--out FILE` saves rank 0's variables as safetensors. The same job on the
//! CPU and on a GPU ends at the same weights within float tolerance.

use std::sync::Arc;

use consort::{
    Backend, ProcessGroup, ReduceOp,
    candle::{
        CandleModel,
        candle_core::{self, DType, Device, Tensor, Var},
        candle_nn::{self, Optimizer},
    },
    ddp::{Ddp, DdpOptions, Sgd, ShardKernels, ShardOptions, Sharded, Strategy},
    sim::{SimConfig, SimWorld},
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const IN: usize = 8;
const HIDDEN: usize = 16;
const BATCH: usize = 32;

#[derive(Clone, Debug)]
struct Args {
    backend: String,
    device: String,
    world_size: usize,
    steps: usize,
    lr: f64,
    /// `None`: DDP.
    strategy: Option<Strategy>,
    out: Option<std::path::PathBuf>,
}

fn parse() -> Result<Args, BoxError> {
    let mut a = Args {
        backend: String::new(),
        device: "cpu".into(),
        world_size: 2,
        steps: 50,
        lr: 0.05,
        strategy: None,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => a.backend = value()?,
            "--device" => a.device = value()?,
            "--world-size" => a.world_size = value()?.parse()?,
            "--steps" => a.steps = value()?.parse()?,
            "--lr" => a.lr = value()?.parse()?,
            "--strategy" => {
                a.strategy = match value()?.as_str() {
                    "ddp" => None,
                    "zero1" => Some(Strategy::Zero1),
                    "zero2" => Some(Strategy::Zero2),
                    "fsdp" => Some(Strategy::Fsdp),
                    other => {
                        return Err(format!(
                            "unknown --strategy {other:?}: expected ddp, zero1, zero2 or fsdp"
                        )
                        .into());
                    }
                }
            }
            "--out" => a.out = Some(value()?.into()),
            "-h" | "--help" => {
                println!(
                    "candle_ddp [--backend sim|tcp|nccl] [--device cpu|cuda] [--world-size N \
                     (sim)] [--steps N] [--lr X] [--strategy ddp|zero1|zero2|fsdp] [--out \
                     FILE.safetensors]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (see --help)").into()),
        }
    }
    if a.backend.is_empty() {
        a.backend = if a.device == "cuda" { "nccl" } else { "sim" }.into();
    }
    if a.steps == 0 || a.world_size == 0 {
        return Err("--steps and --world-size must be at least 1".into());
    }
    Ok(a)
}

fn main() -> Result<(), BoxError> {
    let args = parse()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match (args.backend.as_str(), args.device.as_str()) {
            ("sim", "cpu") => {
                let world = SimWorld::new(SimConfig::new(args.world_size))?;
                for t in world.spawn_each(|r| train(Arc::new(r), Device::Cpu, None, args.clone())) {
                    t.await??;
                }
                Ok(())
            }
            ("tcp", "cpu") => {
                let dist = consort::init_from_env().await?;
                let pg = dist.process_group().await?;
                let res = train(pg.backend().clone(), Device::Cpu, None, args).await;
                drop(pg);
                dist.shutdown().await?;
                res
            }
            ("nccl", "cuda") => cuda(args).await,
            (b, d) => Err(format!(
                "--backend {b} --device {d} is not a combination this example runs (sim or tcp \
                 on cpu, nccl on cuda)"
            )
            .into()),
        }
    })
}

#[cfg(feature = "candle-cuda")]
async fn cuda(args: Args) -> Result<(), BoxError> {
    let dist = consort::init_from_env().await?;
    let nccl = Arc::new(dist.nccl_backend(None).await?);
    let gpu = candle_core::CudaDevice::new_with_stream(nccl.device())?;
    let place = consort::candle::placement(&gpu)?;
    // The shards' optimizer steps on the GPU (NVRTC kernels), when sharded.
    let kernels: Option<Arc<dyn ShardKernels>> = match args.strategy {
        Some(_) => Some(consort::cuda::CudaKernels::new(
            &consort::nccl::CudaDevice::new(nccl.device())?,
        )?),
        None => None,
    };
    let b: Arc<dyn Backend> = nccl;
    let res = train(b, Device::Cuda(gpu), Some((place, kernels)), args).await;
    dist.shutdown().await?;
    res
}

#[cfg(not(feature = "candle-cuda"))]
async fn cuda(_: Args) -> Result<(), BoxError> {
    Err("--device cuda needs the example built with --features candle-cuda".into())
}

/// Rank `r`'s deterministic starting value `i` of a tensor seeded `seed`:
/// different on each rank, so that DDP's broadcast matters.
fn init(seed: f32, r: usize, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| scale * (seed + 0.37 * i as f32 + 0.9 * r as f32).sin())
        .collect()
}

/// The model: `fc2(relu(fc1(x)))`, its variables named as a VarMap would.
fn model(dev: &Device, r: usize) -> Result<Vec<(String, Var)>, BoxError> {
    let var = |name: &str, seed: f32, shape: &[usize], scale: f32| -> Result<_, BoxError> {
        let n = shape.iter().product();
        let t = Tensor::from_vec(init(seed, r, n, scale), shape, dev)?;
        Ok((name.to_string(), Var::from_tensor(&t)?))
    };
    Ok(vec![
        var("fc1.weight", 0.1, &[HIDDEN, IN], 0.4)?,
        var("fc1.bias", 0.2, &[HIDDEN], 0.1)?,
        var("fc2.weight", 0.3, &[1, HIDDEN], 0.4)?,
        var("fc2.bias", 0.4, &[1], 0.1)?,
    ])
}

/// Rank `r`'s batch at `step`: inputs and the target `sum_j cos(j) x_j`.
fn batch(dev: &Device, r: usize, step: usize) -> Result<(Tensor, Tensor), BoxError> {
    let x: Vec<f32> = (0..BATCH * IN)
        .map(|k| (1.3 * step as f32 + 7.1 * r as f32 + 0.31 * k as f32).sin())
        .collect();
    let y: Vec<f32> = x
        .chunks(IN)
        .map(|row| {
            row.iter()
                .enumerate()
                .map(|(j, v)| (j as f32).cos() * v)
                .sum()
        })
        .collect();
    Ok((
        Tensor::from_vec(x, (BATCH, IN), dev)?,
        Tensor::from_vec(y, (BATCH, 1), dev)?,
    ))
}

fn forward(vars: &[(String, Var)], x: &Tensor) -> candle_core::Result<Tensor> {
    let v = |name: &str| {
        vars.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_tensor().clone())
            .expect("the model's own variable")
    };
    let h = x
        .matmul(&v("fc1.weight").t()?)?
        .broadcast_add(&v("fc1.bias"))?
        .relu()?;
    h.matmul(&v("fc2.weight").t()?)?
        .broadcast_add(&v("fc2.bias"))
}

/// A model on the GPU: its placement, and the shards' optimizer kernels
/// when it is trained sharded.
type OnGpu = (consort::Placement, Option<Arc<dyn ShardKernels>>);

/// One rank's training; the summary line from rank 0.
async fn train(
    b: Arc<dyn Backend>,
    dev: Device,
    gpu: Option<OnGpu>,
    args: Args,
) -> Result<(), BoxError> {
    let r = b.rank();
    let pg = ProcessGroup::new(b.clone());
    let vars = model(&dev, r)?;
    let (mut m, kernels) = match gpu {
        #[cfg(feature = "candle-cuda")]
        Some((p, k)) => (CandleModel::from_vars_on(vars, p)?, k),
        _ => (CandleModel::from_vars(vars)?, None),
    };
    let loss_now = match args.strategy {
        None => ddp_steps(&b, &pg, &dev, &mut m, &args).await?,
        Some(s) => {
            let opts = ShardOptions::new(s);
            let opts = match kernels {
                Some(k) => opts.kernels(k),
                None => opts,
            };
            sharded_steps(&b, &pg, &dev, &mut m, opts, &args).await?
        }
    };
    // Every rank's variables, compared: the largest max - min over ranks.
    let mut spread = 0.0f32;
    let mut sum = 0.0f64;
    for (_, v) in m.vars() {
        let w = v.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        sum += w.iter().map(|&x| f64::from(x)).sum::<f64>();
        let (mut hi, mut lo) = (w.clone(), w);
        pg.all_reduce(&mut hi, ReduceOp::Max).await?;
        pg.all_reduce(&mut lo, ReduceOp::Min).await?;
        spread = hi.iter().zip(&lo).fold(spread, |s, (h, l)| s.max(h - l));
    }
    if r == 0 {
        if let Some(out) = &args.out {
            let named: std::collections::HashMap<String, Tensor> = m
                .vars()
                .iter()
                .map(|(n, v)| Ok((n.clone(), v.as_tensor().to_device(&Device::Cpu)?)))
                .collect::<candle_core::Result<_>>()?;
            candle_core::safetensors::save(&named, out)?;
        }
        println!(
            "{}",
            serde_json::json!({
                "device": args.device, "world": b.world_size(), "steps": args.steps,
                "strategy": args.strategy.map_or("ddp", |s| s.name()),
                "final_loss": loss_now, "rank_spread": spread, "weights_sum": sum,
            })
        );
    }
    Ok(())
}

/// DDP with candle's SGD; returns the last step's loss, averaged over the
/// ranks.
async fn ddp_steps(
    b: &Arc<dyn Backend>,
    pg: &ProcessGroup,
    dev: &Device,
    m: &mut CandleModel,
    args: &Args,
) -> Result<f32, BoxError> {
    let r = b.rank();
    let mut ddp = Ddp::new(b.clone(), m, DdpOptions::default()).await?;
    m.push_values()?;
    let all: Vec<Var> = m.vars().iter().map(|(_, v)| v.clone()).collect();
    let mut opt = candle_nn::SGD::new(all, args.lr)?;
    let mut loss_now = 0.0f32;
    for step in 0..args.steps {
        let (x, y) = batch(dev, r, step)?;
        let loss = candle_nn::loss::mse(&forward(m.vars(), &x)?, &y)?;
        let mut grads = loss.backward()?;
        m.pull_grads(&grads)?;
        ddp.sync_grads(m).await?;
        m.push_grads(&mut grads)?;
        opt.step(&grads)?;
        loss_now = mean_loss(pg, &loss).await?;
    }
    Ok(loss_now)
}

/// The same under a sharded strategy: every unit (one per layer) gathered
/// into the variables before the forward pass, the gradients handed to the
/// shards, each rank's SGD step on its shard.
async fn sharded_steps(
    b: &Arc<dyn Backend>,
    pg: &ProcessGroup,
    dev: &Device,
    m: &mut CandleModel,
    opts: ShardOptions,
    args: &Args,
) -> Result<f32, BoxError> {
    let r = b.rank();
    // Variables are ordered by name: fc1.bias, fc1.weight, fc2.bias, ...
    let opts = opts.units(vec![vec![0, 1], vec![2, 3]]);
    let mut sh = Sharded::new(b.clone(), m, Sgd::new(args.lr), opts).await?;
    let mut loss_now = 0.0f32;
    for step in 0..=args.steps {
        for u in 0..sh.layout().units.len() {
            m.set_gathered(&sh.gather(u).await?)?;
        }
        if step == args.steps {
            break; // the variables now hold the final weights
        }
        let (x, y) = batch(dev, r, step)?;
        let loss = candle_nn::loss::mse(&forward(m.vars(), &x)?, &y)?;
        m.mark_grads(&loss.backward()?, &mut sh)?;
        sh.step().await?;
        loss_now = mean_loss(pg, &loss).await?;
    }
    Ok(loss_now)
}

/// `loss` averaged over the ranks.
async fn mean_loss(pg: &ProcessGroup, loss: &Tensor) -> Result<f32, BoxError> {
    let mut l = [loss.to_dtype(DType::F32)?.to_scalar::<f32>()?];
    pg.all_reduce(&mut l, ReduceOp::Avg).await?;
    Ok(l[0])
}
