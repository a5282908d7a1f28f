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

use super::table::Table;

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
    let world = pg.world_size();
    let layers = layers.max(1);
    let bias = pg.rank() as f32 * 1e-3;
    let per = params / layers;
    let mut model = PlainModel::new();
    for l in 0..layers {
        // Each rank starts elsewhere: Ddp::new must bring them together.
        let init: Vec<f32> = (0..per)
            .map(|k| ((k + l) % 97) as f32 * 0.01 + bias)
            .collect();
        model.add_param(format!("layers.{l}.weight"), vec![per], &init)?;
    }
    let mut grads: Vec<Vec<f32>> = (0..layers).map(|_| vec![0.0; per]).collect();

    let local = median_ms!(iters, {
        for l in (0..layers).rev() {
            backward_layer(model.param::<f32>(l)?, &mut grads[l], work, bias);
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
            backward_layer(
                model.param::<f32>(l)?,
                &mut flat[l * per..(l + 1) * per],
                work,
                bias,
            );
        }
        pg.all_reduce(&mut flat, ReduceOp::Avg).await?;
        for l in 0..layers {
            sgd(model.param_mut::<f32>(l)?, &flat[l * per..(l + 1) * per]);
        }
        Ok(())
    });

    let mut ddp = Ddp::new(backend.clone(), &mut model, DdpOptions::default()).await?;
    let mut ms = Vec::new();
    for view in [false, true] {
        let t = median_ms!(iters, {
            for l in (0..layers).rev() {
                if view {
                    let p = model.param::<f32>(l)?;
                    backward_layer(p, ddp.grad_mut::<f32>(l)?, work, bias);
                    ddp.mark_ready_in_place(l)?;
                } else {
                    backward_layer(model.param::<f32>(l)?, &mut grads[l], work, bias);
                    ddp.mark_ready(l, &grads[l])?;
                }
            }
            ddp.finish().await?;
            for l in 0..layers {
                sgd(model.param_mut::<f32>(l)?, ddp.grad::<f32>(l)?);
            }
            Ok(())
        });
        ms.push(t);
    }
    let buckets = ddp.bucket_assignment().len();
    // Every rank must now hold the same parameters, bit for bit.
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
    drop(ddp);
    let rank = pg.rank();
    drop(pg);
    drop(backend);
    dist.shutdown().await?;
    if rank != 0 {
        return Ok(None);
    }
    let mut t = Table::new(&[
        "mode",
        "world",
        "params",
        "buckets",
        "step_ms",
        "overhead_ms",
        "vs_local",
    ]);
    let rows = [
        ("local", local, 0),
        ("comm_only", comm_only, 1),
        ("allreduce_after", allreduce_after, 1),
        ("ddp", ms[0], buckets),
        ("ddp_bucket_view", ms[1], buckets),
    ];
    for (mode, step, b) in rows {
        t.push(vec![
            json!(mode),
            json!(world),
            json!(per * layers),
            json!(b),
            json!(step),
            json!(step - local),
            json!(step / local),
        ]);
    }
    Ok(Some(t))
}
