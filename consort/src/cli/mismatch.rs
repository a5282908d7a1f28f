//! The hidden `mismatch-check` helper: a self-test of the always-on
//! mismatch check on a real job. Every rank makes one all_reduce, rank 0
//! with one element more than the others, and prints what it got and how
//! long it took. `scripts/gpu-check` runs it on NCCL (where the check
//! travels over the host side channel); the tests run it on TCP and on
//! the emulated device.
//!
//! `consort run --standalone --nproc-per-node 2 -- consort mismatch-check --backend nccl`

use std::time::Instant;

use consort::{CommError, ReduceOp};

type BoxError = Box<dyn std::error::Error>;

/// One rank of the self-test: prints `MISMATCH rank R after T ms: ...` when
/// the call failed with `Mismatch` (the check worked), and fails otherwise.
pub(crate) async fn run(backend: &str) -> Result<(), BoxError> {
    let dist = consort::init_from_env().await?;
    let pg = super::init_check::group(&dist, backend).await?;
    let rank = pg.rank();
    // Rank 0 calls with one element more: the fingerprints differ in count.
    let mut x = vec![1.0f32; if rank == 0 { 5 } else { 4 }];
    let t = Instant::now();
    let got = pg.all_reduce(&mut x, ReduceOp::Sum).await;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let verdict = match got {
        Err(e @ CommError::Mismatch { .. }) => {
            println!("MISMATCH rank {rank} after {ms:.1} ms: {e}");
            Ok(())
        }
        Err(e) => Err(format!(
            "rank {rank}: expected Mismatch, got after {ms:.1} ms: {e}"
        )),
        Ok(()) => Err(format!(
            "rank {rank}: a mismatched all_reduce returned Ok after {ms:.1} ms: the check missed it"
        )),
    };
    drop(pg);
    if let Err(e) = dist.shutdown().await {
        eprintln!("rank {rank}: shutdown after the mismatch: {e}");
    }
    verdict.map_err(Into::into)
}
