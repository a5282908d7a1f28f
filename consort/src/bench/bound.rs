//! How close a same-host collective comes to the machine: this node's
//! memory bandwidth ([`memory_bandwidth`], STREAM's Copy on as many cores as
//! ranks) and the single-copy bound on a collective's algbw that it implies
//! ([`single_copy_bound`]).
//!
//! On one host every byte a collective delivers crosses memory at least
//! once each way. With `B` the node's memory bandwidth in bytes read plus
//! written per second, `N` the op's bytes (nccl-tests' size) and `w` ranks,
//! the least traffic a single-copy algorithm can make is:
//!
//! | op | least bytes through memory | bound on algbw (N / time) |
//! |---|---|---|
//! | all_reduce | every rank's N read, every rank's N written: 2wN | B / (2w) |
//! | broadcast | the root's N read and written by w−1 ranks: 2(w−1)N | B / (2(w−1)) |
//! | all_gather | each N/w chunk read and written by w−1 ranks: 2(w−1)N | B / (2(w−1)) |
//! | reduce_scatter | every rank's N read, N/w written per rank: (w+1)N | B / (w+1) |
//! | all_to_all | (w−1)/w of each rank's N read and written: 2(w−1)N | B / (2(w−1)) |
//!
//! A row's fraction of the bound is its algbw over that bound; 1.0 would
//! be a collective that does nothing but its one copy at the speed of
//! memory. A world of one moves nothing, and has no bound.

use std::{
    sync::Barrier,
    time::{Duration, Instant},
};

use consort::OpKind;

/// Bytes each copying thread owns (source and destination each): far
/// beyond any last-level cache share, small enough for 16 threads.
const PER_THREAD: usize = 64 << 20;

/// Copies each thread times in one trial.
const REPS: usize = 4;

/// Trials; the best is kept (as STREAM reports its best).
const TRIALS: usize = 3;

/// This node's memory bandwidth, bytes read plus written per second, with
/// `threads` cores copying at once (STREAM's Copy, `a[i] = b[i]` with
/// memcpy, on buffers touched beforehand): the best of three trials.
pub(crate) fn memory_bandwidth(threads: usize) -> Result<f64, String> {
    let threads = threads.max(1);
    let mut bufs = Vec::with_capacity(threads);
    for _ in 0..threads {
        bufs.push((filled(PER_THREAD, 1)?, filled(PER_THREAD, 0)?));
    }
    let mut best = 0.0f64;
    for _ in 0..TRIALS {
        let t = trial(&mut bufs);
        let bytes = (2 * PER_THREAD * REPS * threads) as f64;
        best = best.max(bytes / t.as_secs_f64().max(1e-9));
    }
    Ok(best)
}

/// `n` bytes of `v`, every page touched, or why they cannot be had.
fn filled(n: usize, v: u8) -> Result<Vec<u8>, String> {
    let mut b = Vec::new();
    b.try_reserve_exact(n).map_err(|_| {
        format!("cannot allocate {n} bytes to measure the memory bandwidth: free some memory")
    })?;
    b.resize(n, v);
    Ok(b)
}

/// One trial: every thread starts at once and copies its buffer `REPS`
/// times; the trial's time is the slowest thread's.
fn trial(bufs: &mut [(Vec<u8>, Vec<u8>)]) -> Duration {
    let start = Barrier::new(bufs.len());
    let times: Vec<Duration> = std::thread::scope(|s| {
        let handles: Vec<_> = bufs
            .iter_mut()
            .map(|(src, dst)| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let t = Instant::now();
                    for _ in 0..REPS {
                        dst.copy_from_slice(src);
                        std::hint::black_box(&mut *dst);
                    }
                    t.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Duration::MAX))
            .collect()
    });
    times.into_iter().max().unwrap_or(Duration::MAX)
}

/// The bound on `op`'s algbw (bytes per second) over `world` ranks on one
/// host of memory bandwidth `bw` (see the module's table); `None` for a
/// world of one or an op without a bound here.
pub(crate) fn single_copy_bound(op: OpKind, world: usize, bw: f64) -> Option<f64> {
    let w = world as f64;
    let traffic = match op {
        _ if world < 2 => return None,
        OpKind::AllReduce => 2.0 * w,
        OpKind::Broadcast | OpKind::AllGather | OpKind::AllToAll => 2.0 * (w - 1.0),
        OpKind::ReduceScatter => w + 1.0,
        _ => return None,
    };
    Some(bw / traffic)
}

/// The cores the bound's copy runs on: one per rank, as many as there are.
pub(crate) fn threads_for(world: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    world.clamp(1, cores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_follow_the_least_traffic() {
        let b = 48e9;
        assert_eq!(single_copy_bound(OpKind::AllReduce, 2, b), Some(12e9));
        assert_eq!(single_copy_bound(OpKind::AllReduce, 4, b), Some(6e9));
        assert_eq!(single_copy_bound(OpKind::Broadcast, 2, b), Some(24e9));
        assert_eq!(single_copy_bound(OpKind::Broadcast, 4, b), Some(8e9));
        assert_eq!(single_copy_bound(OpKind::ReduceScatter, 3, b), Some(12e9));
        assert_eq!(single_copy_bound(OpKind::AllGather, 1, b), None);
        assert_eq!(single_copy_bound(OpKind::Barrier, 4, b), None);
    }

    #[test]
    fn the_machine_has_a_memory_bandwidth() {
        let bw = memory_bandwidth(1).expect("128 MiB");
        // Any machine that runs this copies faster than 100 MB/s and slower
        // than 10 TB/s; the figure itself belongs in the bench.
        assert!(bw > 1e8 && bw < 1e13, "{bw}");
    }
}
