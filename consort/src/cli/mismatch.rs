//! The hidden `mismatch-check` helper: a self-test of the always-on
//! mismatch check on a real job. Every rank makes one all_reduce, rank 0
//! with one element more than the others, and prints what it got and how
//! long it took. `scripts/gpu-check` runs it on NCCL (where the check
//! travels over the host side channel); the tests run it on TCP and on
//! the emulated device.
//!
//! `consort run --standalone --nproc-per-node 2 -- consort mismatch-check --backend nccl`
//!
//! `--case cancelled` tests a failure only one rank sees: rank 0 drops its
//! all_reduce before it runs, and every peer, waiting in that call, must
//! fail naming rank 0 and why (on NCCL, told over the side channel: NCCL
//! itself tells the peers nothing), not hang to its deadline.

use std::time::{Duration, Instant};

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

/// One rank of `--case cancelled`: rank 0 makes an all_reduce and drops it
/// unpolled, then prints `CANCELLED rank 0: ...` with the error of its next
/// call; every other rank prints `TOLD rank R after T ms: ...` when its
/// all_reduce failed naming rank 0's cancelled call, and fails otherwise.
/// Rank 0 keeps its group (and so its side channel) until every peer has
/// its verdict: a rank that left would be named as lost instead.
pub(crate) async fn cancelled(backend: &str) -> Result<(), BoxError> {
    if backend == "emulated" {
        return Err(
            "--case cancelled: the emulated device enqueues a host call when it is made, \
                    so there is no call to cancel before it runs (a dropped one runs to its end, \
                    as on NCCL); use --backend tcp, quic or nccl"
                .into(),
        );
    }
    let dist = consort::init_from_env().await?;
    let pg = super::init_check::group(&dist, backend).await?;
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

/// Whether `e` names rank 0 and its cancelled call.
fn told(e: &CommError) -> bool {
    let s = e.to_string();
    s.contains("rank 0") && s.contains("cancelled") && !matches!(e, CommError::PeerLost { .. })
}
