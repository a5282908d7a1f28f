//! `consort bench ddp`: the cost of DDP on a training step.
//!
//! One rank of a launched job (`consort run --standalone --nproc-per-node 2
//! -- consort bench ddp`). The model is `params` f32 parameters in `layers`
//! equal layers; the synthetic backward computes each layer's gradient in
//! turn (`work` multiply-adds per element), last layer first, and SGD
//! updates the parameters. Rank 0 prints, per mode, the median step time:
//!
//! - `local`: backward and SGD, no communication (the step without DDP);
//! - `allreduce_after`: backward, then one all_reduce of every gradient
//!   (no buckets, no overlap);
//! - `ddp`: gradients copied into DDP's buckets as backward produces them;
//! - `ddp_bucket_view`: backward writes straight into the buckets;
//! - `comm_only`: the all_reduce of all gradients alone (the floor).

use std::{hint::black_box, sync::Arc, time::Instant};

use consort::{
    Backend, ReduceOp,
    ddp::{Ddp, DdpOptions, PlainModel},
};
use serde_json::json;

use crate::table::Table;

/// One layer's backward: `g = f(p)` with `work` multiply-adds per element
/// (`bias` makes each rank's gradient its own).
pub(crate) fn backward_layer(p: &[f32], g: &mut [f32], work: usize, bias: f32) {
    for (g, &p) in g.iter_mut().zip(p) {
        let mut x = p + bias;
        for _ in 0..work {
            x = x * 0.999 + 0.001;
        }
        *g = x;
    }
}

fn sgd(p: &mut [f32], g: &[f32]) {
    for (p, g) in p.iter_mut().zip(g) {
        *p -= 1e-3 * g;
    }
}

type BoxError = Box<dyn std::error::Error>;

/// The median milliseconds of `$iters` runs of the step `$body` (an async
/// block's contents returning `Result<(), BoxError>`), after two warm-up
/// steps (the second runs on rebuilt buckets).
macro_rules! median_ms {
    ($iters:expr, $body:block) => {{
        let mut t = Vec::new();
        for it in 0..$iters.max(1) + 2 {
            let s = Instant::now();
            let r: Result<(), BoxError> = async { $body }.await;
            r?;
            if it >= 2 {
                t.push(s.elapsed().as_secs_f64() * 1e3);
            }
        }
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    }};
}

/// The synthetic model's shape and this rank's offset.
#[derive(Clone, Copy)]
struct Shape {
    layers: usize,
    /// Parameters per layer.
    per: usize,
    /// Multiply-adds per gradient element.
    work: usize,
    /// This rank's offset, so that its gradients are its own.
    bias: f32,
}

/// Runs every mode on this rank; rank 0 returns the table.
pub(crate) async fn run(
    params: usize,
    layers: usize,
    work: usize,
    iters: usize,
) -> Result<Option<Table>, BoxError> {
    let dist = consort::init_from_env().await?;
    let pg = dist.process_group().await?;
    let backend: Arc<dyn Backend> = pg.backend().clone();
    let layers = layers.max(1);
    let shape = Shape {
        layers,
        per: params / layers,
        work,
        bias: pg.rank() as f32 * 1e-3,
    };
    let mut model = start_model(shape)?;
    let [local, comm_only, allreduce_after] = baselines(&pg, &mut model, shape, iters).await?;
    let (ms, buckets) = ddp_modes(backend.clone(), &mut model, shape, iters).await?;
    check_in_step(&pg, &model, layers).await?;
    let (rank, world) = (pg.rank(), pg.world_size());
    drop(pg);
    drop(backend);
    dist.shutdown().await?;
    if rank != 0 {
        return Ok(None);
    }
    let rows = [
        ("local", local, 0),
        ("comm_only", comm_only, 1),
        ("allreduce_after", allreduce_after, 1),
        ("ddp", ms[0], buckets),
        ("ddp_bucket_view", ms[1], buckets),
    ];
    Ok(Some(table(world, shape.per * layers, local, &rows)))
}

/// The model, each rank starting elsewhere (`Ddp::new` must bring them
/// together).
fn start_model(s: Shape) -> Result<PlainModel, BoxError> {
    let mut model = PlainModel::new();
    for l in 0..s.layers {
        let init: Vec<f32> = (0..s.per)
            .map(|k| ((k + l) % 97) as f32 * 0.01 + s.bias)
            .collect();
        model.add_param(format!("layers.{l}.weight"), vec![s.per], &init)?;
    }
    Ok(model)
}

/// The modes without DDP: `local`, `comm_only` and `allreduce_after`.
async fn baselines(
    pg: &consort::ProcessGroup,
    model: &mut PlainModel,
    s: Shape,
    iters: usize,
) -> Result<[f64; 3], BoxError> {
    let (layers, per) = (s.layers, s.per);
    let mut grads: Vec<Vec<f32>> = (0..layers).map(|_| vec![0.0; per]).collect();
    let local = median_ms!(iters, {
        for l in (0..layers).rev() {
            backward_layer(model.param::<f32>(l)?, &mut grads[l], s.work, s.bias);
        }
        for (l, g) in grads.iter().enumerate() {
            sgd(model.param_mut::<f32>(l)?, g);
        }
        black_box(&grads);
        Ok(())
    });
    let mut flat = vec![0.0f32; per * layers];
    let comm_only = median_ms!(iters, {
        pg.all_reduce(&mut flat, ReduceOp::Avg).await?;
        Ok(())
    });
    let allreduce_after = median_ms!(iters, {
        for l in (0..layers).rev() {
            let g = &mut flat[l * per..(l + 1) * per];
            backward_layer(model.param::<f32>(l)?, g, s.work, s.bias);
        }
        pg.all_reduce(&mut flat, ReduceOp::Avg).await?;
        for l in 0..layers {
            sgd(model.param_mut::<f32>(l)?, &flat[l * per..(l + 1) * per]);
        }
        Ok(())
    });
    Ok([local, comm_only, allreduce_after])
}

/// `ddp` (gradients copied into the buckets) and `ddp_bucket_view`
/// (written there by backward), and the bucket count.
async fn ddp_modes(
    backend: Arc<dyn Backend>,
    model: &mut PlainModel,
    s: Shape,
    iters: usize,
) -> Result<([f64; 2], usize), BoxError> {
    let mut grads: Vec<Vec<f32>> = (0..s.layers).map(|_| vec![0.0; s.per]).collect();
    let mut ddp = Ddp::new(backend, model, DdpOptions::default()).await?;
    let mut ms = [0.0; 2];
    for (view, t) in [false, true].into_iter().zip(&mut ms) {
        *t = median_ms!(iters, {
            for l in (0..s.layers).rev() {
                if view {
                    let p = model.param::<f32>(l)?;
                    backward_layer(p, ddp.grad_mut::<f32>(l)?, s.work, s.bias);
                    ddp.mark_ready_in_place(l)?;
                } else {
                    backward_layer(model.param::<f32>(l)?, &mut grads[l], s.work, s.bias);
                    ddp.mark_ready(l, &grads[l])?;
                }
            }
            ddp.finish().await?;
            for l in 0..s.layers {
                sgd(model.param_mut::<f32>(l)?, ddp.grad::<f32>(l)?);
            }
            Ok(())
        });
    }
    Ok((ms, ddp.bucket_assignment().len()))
}

/// Every rank holds the same parameters after the DDP steps, bit for bit.
async fn check_in_step(
    pg: &consort::ProcessGroup,
    model: &PlainModel,
    layers: usize,
) -> Result<(), BoxError> {
    let mut digest = 0xcbf2_9ce4_8422_2325u64;
    for l in 0..layers {
        for &v in model.param::<f32>(l)? {
            digest = (digest ^ u64::from(v.to_bits())).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    let digests = pg.all_gather_vec(&[digest]).await?;
    if digests.iter().any(|&d| d != digests[0]) {
        return Err(format!(
            "rank {}: after the DDP steps the ranks' parameters differ (digests {digests:x?}); \
             DDP did not keep the replicas in step",
            pg.rank()
        )
        .into());
    }
    Ok(())
}

/// Rank 0's table: per mode, its step and its cost over `local`.
fn table(world: usize, params: usize, local: f64, rows: &[(&str, f64, usize)]) -> Table {
    let mut t = Table::new(&[
        "mode",
        "world",
        "params",
        "buckets",
        "step_ms",
        "overhead_ms",
        "vs_local",
    ]);
    for &(mode, step, b) in rows {
        t.push(vec![
            json!(mode),
            json!(world),
            json!(params),
            json!(b),
            json!(step),
            json!(step - local),
            json!(step / local),
        ]);
    }
    t
}
