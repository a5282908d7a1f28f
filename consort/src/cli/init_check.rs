//! The hidden `init-check` helper: a self-test of bounded init on a real
//! job. Every rank joins the job's store; rank `--absent` then never makes
//! its backend (it sleeps, as a stopped or lost peer would), and every
//! other rank must get an init error within `CONSORT_TIMEOUT`, print
//! `INIT FAILED rank R after T s: ...` and exit 1, so the launcher ends
//! the job. `scripts/gpu-check` runs it on NCCL (a nonblocking
//! `ncclCommInitRankConfig` aborted at its deadline); the tests run it on
//! TCP and on the emulated device.
//!
//! `CONSORT_TIMEOUT=10 consort run --standalone --nproc-per-node 2 -- consort init-check --backend nccl`

use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error>;

/// One rank of the self-test.
pub(crate) async fn run(backend: &str, absent: usize) -> Result<(), BoxError> {
    let dist = consort::init_from_env().await?;
    let rank = dist.rank();
    if rank == absent {
        // Present in the store, absent from the backend's init: the
        // launcher stops this rank once the others have failed.
        eprintln!("rank {rank}: staying out of the {backend} init");
        tokio::time::sleep(Duration::from_secs(3600)).await;
        return Err("the absent rank was never stopped".into());
    }
    let t = Instant::now();
    let made = crate::groups::group(&dist, backend).await;
    let s = t.elapsed().as_secs_f64();
    match made {
        Ok(_) => Err(format!(
            "rank {rank}: the {backend} init finished after {s:.1} s without rank {absent}"
        )
        .into()),
        Err(e) => {
            println!("INIT FAILED rank {rank} after {s:.1} s: {e}");
            Err(format!("rank {rank}: init failed as expected").into())
        }
    }
}
