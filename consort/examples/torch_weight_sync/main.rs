//! A consort worker in a PyTorch job: rank 0 runs `trainer.py` (torch),
//! the other ranks run this. All of them are one process group: torch's
//! `gloo` (the default), or with `BACKEND=nccl` torch's `nccl` (build with
//! `--features nccl`; a GPU per rank, or every rank on GPU 0 with
//! `CONSORT_SHARE_GPU=1` and, below NCCL 2.30, one `NCCL_HOSTID` per rank).
//! On NCCL the consort rank takes the unique id from the key torch's
//! backend keeps it under (`TORCH_DIST_USE_NCCL2=0` for torch's classic
//! backend, which is what torch before 2.15 calls `"nccl"`).
//!
//! Each step the trainer broadcasts its weights; this worker scores them on
//! its own held-out data and sends the score back with an all_gather, as a
//! torch rank would. Run it through `launch.sh` (see the guide,
//! `consort::manual::torch_jobs`).

use consort::{DistEnv, InitOptions};

/// Features of the linear model (trainer.py's `FEATURES`).
const FEATURES: usize = 16;
/// Held-out rows per worker.
const ROWS: usize = 256;

/// xorshift64*, then Box-Muller: this worker's own data, from its rank.
struct Normal(u64);

impl Normal {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn sample(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

/// Held-out rows `x` and targets `y = x·w + 0.5` with trainer.py's `w`.
fn held_out(rank: usize) -> (Vec<[f32; FEATURES]>, Vec<f32>) {
    let mut rng = Normal(0x9e37_79b9_7f4a_7c15 ^ (rank as u64 + 1));
    let w: Vec<f32> = (0..FEATURES).map(|i| (i % 5) as f32 - 2.0).collect();
    let xs: Vec<[f32; FEATURES]> = (0..ROWS)
        .map(|_| std::array::from_fn(|_| rng.sample()))
        .collect();
    let ys = xs
        .iter()
        .map(|x| x.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() + 0.5)
        .collect();
    (xs, ys)
}

/// Mean squared error of torch's `Linear(16, 1)` with flattened
/// parameters `p` (the weight's 16 numbers, then the bias).
fn eval_loss(p: &[f32], xs: &[[f32; FEATURES]], ys: &[f32]) -> f32 {
    let (w, b) = (&p[..FEATURES], p[FEATURES]);
    let se: f32 = xs
        .iter()
        .zip(ys)
        .map(|(x, y)| {
            let pred = x.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() + b;
            (pred - y) * (pred - y)
        })
        .sum();
    se / xs.len() as f32
}

/// torch's `nccl` group, as torch keys it (feature `nccl`).
#[cfg(feature = "nccl")]
async fn nccl_group(dist: &consort::Dist) -> Result<consort::ProcessGroup, consort::CommError> {
    dist.nccl_process_group().await
}

#[cfg(not(feature = "nccl"))]
async fn nccl_group(_: &consort::Dist) -> Result<consort::ProcessGroup, consort::CommError> {
    Err(consort::CommError::BackendUnavailable {
        backend: "nccl".into(),
        reason: "this example was built without the `nccl` feature: cargo build --release -p \
                 consort --features nccl --example torch_weight_sync"
            .into(),
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let opts = InitOptions {
        torch_peers: true,
        ..InitOptions::from_env()?
    };
    let dist = consort::init(DistEnv::from_env()?, opts).await?;
    let pg = match std::env::var("BACKEND").as_deref() {
        Ok("gloo") | Ok("") | Err(_) => dist.gloo_process_group().await?,
        Ok("nccl") => nccl_group(&dist).await?,
        Ok(other) => return Err(format!("BACKEND={other:?}: expected gloo or nccl").into()),
    };
    let (rank, world) = (pg.rank(), pg.world_size());

    let mut header = [0i64; 2];
    pg.broadcast(&mut header, 0).await?;
    let (n, steps) = (header[0] as usize, header[1] as usize);
    if n != FEATURES + 1 {
        return Err(format!(
            "the trainer sends {n} weights; this worker scores {}",
            FEATURES + 1
        )
        .into());
    }
    let (xs, ys) = held_out(rank);
    let mut weights = vec![0f32; n];
    let mut scores = vec![0f32; world];
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..steps {
        pg.broadcast(&mut weights, 0).await?;
        last = eval_loss(&weights, &xs, &ys);
        first.get_or_insert(last);
        pg.all_gather(&mut scores, &[last]).await?;
    }
    // Subgroups across the two libraries (trainer.py makes the same, in
    // the same order): the trainer and the last worker sum their final
    // losses, then the workers count themselves in a group of their own.
    if let Some(pair) = pg.new_group(&[0, world - 1]).await? {
        let mut both = [last];
        pair.all_reduce(&mut both, consort::ReduceOp::Sum).await?;
        println!(
            "worker rank {rank}: subgroup [0, {}]: sum of final losses {:.4}",
            world - 1,
            both[0]
        );
    }
    if world > 2 {
        let workers: Vec<usize> = (1..world).collect();
        if let Some(w) = pg.new_group(&workers).await? {
            let mut count = [1i64];
            w.all_reduce(&mut count, consort::ReduceOp::Sum).await?;
            if count[0] != (world - 1) as i64 {
                return Err(
                    format!("the workers' group counted {} of {}", count[0], world - 1).into(),
                );
            }
        }
    }
    pg.barrier().await?;
    println!(
        "worker rank {rank}: {steps} weight updates from the torch trainer; held-out loss {:.4} -> {last:.4}",
        first.unwrap_or(last)
    );
    // torch's destroy_process_group: on NCCL the communicator is finalized
    // and destroyed here, not left to the process's exit.
    drop(pg);
    dist.shutdown().await?;
    Ok(())
}
