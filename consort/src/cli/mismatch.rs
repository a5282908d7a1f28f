//! The hidden `mismatch-check` helper: a self-test of the always-on
//! mismatch check on a real job. Every rank makes one all_reduce, rank 0
//! with one element more than the others, and prints what it got and how
//! long it took. `scripts/gpu-check` runs it on NCCL (where the check
//! travels over the host side channel); the tests run it on TCP and on
//! the emulated device.
//!
//! `consort run --standalone --nproc-per-node 2 -- consort mismatch-check --backend nccl`
//!
//! `--case cancelled`: rank 0 drops its all_reduce before awaiting it.
//! - On TCP and QUIC a call runs when its work is polled, so rank 0's never
//!   runs: every peer, waiting in that call, must fail naming rank 0 and
//!   why, not hang to its deadline.
//! - On NCCL and the emulated device a call is enqueued when it is made
//!   (host calls included), as in torch: rank 0's runs to its end, every
//!   peer's all_reduce returns the full sum, and the group goes on.

use std::time::{Duration, Instant};

use consort::{CommError, ReduceOp};

type BoxError = Box<dyn std::error::Error>;

/// One rank of the self-test: prints `MISMATCH rank R after T ms: ...` when
/// the call failed with `Mismatch` (the check worked), and fails otherwise.
pub(crate) async fn run(backend: &str) -> Result<(), BoxError> {
    let dist = consort::init_from_env().await?;
    let pg = crate::groups::group(&dist, backend).await?;
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

/// One rank of `--case cancelled`: rank 0 makes an all_reduce and drops it
/// unpolled. On a backend that runs calls when polled (TCP, QUIC), rank 0
/// then prints `CANCELLED rank 0: ...` with the error of its next call, and
/// every other rank prints `TOLD rank R after T ms: ...` when its all_reduce
/// failed naming rank 0's cancelled call. On a stream-ordered one (NCCL,
/// the emulated device), every rank prints `RAN rank R ...` when the call
/// ran to its end everywhere (see [`ran`]). Anything else fails. Rank 0
/// keeps its group (and so its side channel) until every peer has its
/// verdict: a rank that left would be named as lost instead.
pub(crate) async fn cancelled(backend: &str) -> Result<(), BoxError> {
    if matches!(backend, "nccl" | "emulated") {
        return ran(backend).await;
    }
    let dist = consort::init_from_env().await?;
    let pg = crate::groups::group(&dist, backend).await?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let heard = |r: usize| format!("mismatch-check/cancelled/heard/{r}");
    let mut x = vec![1.0f32; 4];
    let t = Instant::now();
    let verdict = if rank == 0 {
        drop(pg.all_reduce(&mut x, ReduceOp::Sum));
        let next = match pg.barrier().await {
            Err(e) if e.to_string().contains("cancelled") => {
                println!("CANCELLED rank 0: {e}");
                Ok(())
            }
            Err(e) => Err(format!("rank 0: the call after the cancelled one: {e}")),
            Ok(()) => Err("rank 0: the call after a cancelled one returned Ok".to_string()),
        };
        let keys: Vec<String> = (1..world).map(heard).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let waited = dist.store().wait(&keys, Duration::from_secs(120)).await;
        next.and(waited.map_err(|e| format!("rank 0: waiting for the peers' verdicts: {e}")))
    } else {
        let got = pg.all_reduce(&mut x, ReduceOp::Sum).await;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let got = match got {
            Err(e) if told(&e) => {
                println!("TOLD rank {rank} after {ms:.1} ms: {e}");
                Ok(())
            }
            Err(e) => Err(format!(
                "rank {rank}: expected to hear rank 0's cancelled call, got after {ms:.1} ms: {e}"
            )),
            Ok(()) => Err(format!(
                "rank {rank}: an all_reduce rank 0 never ran returned Ok after {ms:.1} ms"
            )),
        };
        let _ = dist.store().set(&heard(rank), b"1").await;
        got
    };
    drop(pg);
    if let Err(e) = dist.shutdown().await {
        eprintln!("rank {rank}: shutdown after the cancelled call: {e}");
    }
    verdict.map_err(Into::into)
}

/// `--case cancelled` on a stream-ordered backend: rank 0's dropped
/// all_reduce was enqueued when it was made and runs to its end, so every
/// peer's all_reduce returns the sum of every rank's ones (`RAN rank R after
/// T ms: sum S`), and rank 0's next call succeeds (`RAN rank 0: ...`).
async fn ran(backend: &str) -> Result<(), BoxError> {
    let dist = consort::init_from_env().await?;
    let pg = crate::groups::group(&dist, backend).await?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let mut x = vec![1.0f32; 4];
    let t = Instant::now();
    let verdict = if rank == 0 {
        drop(pg.all_reduce(&mut x, ReduceOp::Sum));
        match pg.barrier().await {
            Ok(()) => {
                println!("RAN rank 0: the call after the dropped one succeeded");
                Ok(())
            }
            Err(e) => Err(format!("rank 0: the call after a dropped one: {e}")),
        }
    } else {
        let got = pg.all_reduce(&mut x, ReduceOp::Sum).await;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let want = world as f32;
        match got {
            Ok(()) if x.iter().all(|&v| v == want) => {
                println!("RAN rank {rank} after {ms:.1} ms: sum {want}");
                pg.barrier()
                    .await
                    .map_err(|e| format!("rank {rank}: barrier: {e}"))
            }
            Ok(()) => Err(format!("rank {rank}: expected the sum {want}, got {x:?}")),
            Err(e) => Err(format!(
                "rank {rank}: the all_reduce rank 0 dropped (it runs to its end on {backend}) \
                 failed after {ms:.1} ms: {e}"
            )),
        }
    };
    drop(pg);
    if let Err(e) = dist.shutdown().await {
        eprintln!("rank {rank}: shutdown after the dropped call: {e}");
    }
    verdict.map_err(Into::into)
}

/// Whether `e` names rank 0 and its cancelled call.
fn told(e: &CommError) -> bool {
    let s = e.to_string();
    s.contains("rank 0") && s.contains("cancelled") && !matches!(e, CommError::PeerLost { .. })
}
