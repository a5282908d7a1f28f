//! The smallest consort program: join the job, say hello through the
//! store, read everyone's hello, leave.
//!
//! Alone:            cargo run -p consort --example hello
//! Under a launcher: torchrun --nproc-per-node 4 --no-python target/debug/examples/hello
//!                   (or srun, or anything that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CONSORT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let dist = consort::init_from_env().await?;
    let (rank, world) = (dist.rank(), dist.world_size());
    let store = dist.store();
    store
        .set(
            &format!("hello/{rank}"),
            format!("rank {rank} on pid {}", std::process::id()).as_bytes(),
        )
        .await?;
    let keys: Vec<String> = (0..world).map(|r| format!("hello/{r}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    for (r, v) in store.multi_get(&keys).await?.into_iter().enumerate() {
        if rank == 0 {
            println!("rank {r} says: {}", String::from_utf8_lossy(&v));
        }
    }
    println!(
        "rank {rank}/{world} (local {}/{}, launcher: {}) done",
        dist.local_rank(),
        dist.local_world_size(),
        dist.env().launcher
    );
    dist.shutdown().await?;
    Ok(())
}
