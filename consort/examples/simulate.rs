//! The main job on the embedded default: eight ranks in one process on the
//! deterministic simulator, running the collectives a data-parallel step
//! uses (parameter broadcast from rank 0, gradient all_reduce with Avg,
//! metric all_gather, barrier), then a fault scenario.
//!
//!     cargo run --release -p consort --example simulate

use std::{sync::Arc, time::Duration};

use consort::{
    CommError, ProcessGroup, ReduceOp,
    sim::{
        SimConfig, SimWorld, TraceKind,
        fault::{Fault, Trigger},
    },
};

/// One "training step" on one rank: returns (params[0], mean grad, metrics).
async fn step(pg: ProcessGroup) -> Result<(f32, f32, Vec<f32>), CommError> {
    let r = pg.rank();
    // Every rank starts with different parameters; rank 0's win.
    let mut params = vec![r as f32 + 0.5; 1 << 16];
    pg.broadcast(&mut params, 0).await?;
    // Each rank computes a different gradient; DDP averages them.
    let mut grads: Vec<f32> = (0..1 << 16).map(|i| (r + i % 3) as f32).collect();
    pg.all_reduce(&mut grads, ReduceOp::Avg).await?;
    let loss = [10.0 / (r + 1) as f32];
    let losses = pg.all_gather_vec(&loss).await?;
    pg.barrier().await?;
    Ok((params[0], grads[0], losses))
}

async fn run(world: SimWorld) -> Vec<Result<(f32, f32, Vec<f32>), CommError>> {
    let tasks = world.spawn_each(|rank| step(ProcessGroup::new(Arc::new(rank))));
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("rank task"));
    }
    out
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n = 8;
    let world = SimWorld::new(SimConfig::new(n).seed(1))?;
    let results = run(world.clone()).await;
    for (r, res) in results.iter().enumerate() {
        let (p0, g0, losses) = res.as_ref().map_err(|e| e.to_string())?;
        if r == 0 {
            println!("params[0] after broadcast: {p0}   mean grad[0]: {g0}");
            println!("losses gathered: {losses:?}");
        }
    }
    let trace = world.trace();
    let sends = trace.iter().filter(|e| e.kind == TraceKind::Send).count();
    let bytes: usize = trace
        .iter()
        .filter(|e| e.kind == TraceKind::Send)
        .map(|e| e.bytes)
        .sum();
    println!(
        "{n} ranks, {sends} messages, {:.1} MiB moved, simulated time {:?} (loopback-TCP link model)",
        bytes as f64 / (1 << 20) as f64,
        world.elapsed()
    );

    // The same step with rank 5 crashing after its third message: every
    // survivor sees PeerLost, nobody hangs, nobody reports a wrong result.
    let faulty = SimWorld::new(
        SimConfig::new(n)
            .seed(1)
            .timeout(Duration::from_secs(30))
            .fault(Fault::Crash {
                rank: 5,
                at: Trigger::AfterMessages(3),
            }),
    )?;
    println!("\nwith rank 5 crashing:");
    for (r, res) in run(faulty).await.into_iter().enumerate() {
        match res {
            Ok(_) => println!("  rank {r}: ok"),
            Err(e) => println!("  rank {r}: {e}"),
        }
    }
    Ok(())
}
