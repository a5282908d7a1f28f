//! One rank skips a collective, as a rank stuck in compute or in a branch
//! of its own would, and the flight recorder says which, and where.
//!
//! ```sh
//! cargo build --release -p consort --bins --examples
//! CONSORT_TIMEOUT=3 target/release/consort run --standalone --nproc-per-node 3 -- \
//!     target/release/examples/skip --rank 2 --at 3
//! ```
//!
//! Every rank all-reduces `--calls` times. Rank `--rank` stalls for
//! `--stall` seconds instead of making call `--at`. Its peers time out in
//! that call (`CONSORT_TIMEOUT`), every rank writes its flight record, and
//! `consort run`'s summary ends with the verdict:
//! `rank 2 (last entered seq 2) never entered all_reduce seq 3 (world);
//! ranks 0 and 1 waited in it for 3.0 s`.

use clap::Parser;
use consort::ReduceOp;

/// A job in which one rank skips a collective.
#[derive(Parser, Debug)]
struct Args {
    /// The rank that skips.
    #[arg(long, default_value_t = 1)]
    rank: usize,
    /// The call it skips (0-based).
    #[arg(long, default_value_t = 3)]
    at: usize,
    /// All-reduces each rank makes.
    #[arg(long, default_value_t = 6)]
    calls: usize,
    /// Seconds the skipping rank stalls instead.
    #[arg(long, default_value_t = 30.0)]
    stall: f64,
    /// The process group: `tcp` (consort's mesh), `emulated` (the
    /// stream-ordered driver NCCL runs, on the emulated device) or `gloo`
    /// (torch's Gloo wire).
    #[arg(long, default_value = "tcp")]
    backend: String,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let dist = consort::init_from_env().await?;
    let pg = match args.backend.as_str() {
        "tcp" => dist.process_group().await?,
        "emulated" => dist.emulated_process_group().await?,
        "gloo" => dist.gloo_process_group().await?,
        other => return Err(format!("--backend {other}: expected tcp, emulated or gloo").into()),
    };
    let me = pg.rank();
    eprintln!("rank {me}: pid {}", std::process::id());
    let mut x = vec![1.0f32; 1024];
    for call in 0..args.calls {
        if me == args.rank && call == args.at {
            eprintln!("rank {me}: stalling instead of all_reduce #{call}");
            tokio::time::sleep(std::time::Duration::from_secs_f64(args.stall)).await;
            continue;
        }
        pg.all_reduce(&mut x, ReduceOp::Sum).await?;
    }
    drop(pg);
    dist.shutdown().await?;
    Ok(())
}
