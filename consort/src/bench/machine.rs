//! `consort bench reduce`: throughput of [`ReduceOp::Sum`] apply per dtype,
//! beside a plain memcpy of the same bytes on the same machine.
//!
//! `dst += src` moves 3 bytes per byte of dst (read dst, read src, write
//! dst) where memcpy moves 2, so the memory-bound ceiling for Sum is 2/3 of
//! memcpy's rate in bytes of dst per second.
//!
//! With `--threads N` (N > 1) two more columns: the same Sum and copy in
//! the transports' 256 KiB pieces, each split over N threads of a
//! `consort_comm::par` pool, as a rank with cores to spare runs them.

use std::{hint::black_box, time::Instant};

use consort_comm::{
    DType, Element, ReduceOp,
    half::{bf16, f16},
    par::{self, Pool},
};
use serde_json::json;

use crate::table::Table;

/// Median seconds of `iters` runs of `f`, after one warm-up run.
fn median_secs(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..iters.max(1))
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// `n` elements made by `f`, or an error naming the bytes when memory
/// refuses them (the sizes come from the command line; the caller checked
/// them against the available memory, and this catches what that missed).
fn filled<T>(n: usize, f: impl FnMut(usize) -> T) -> Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        format!(
            "cannot allocate a benchmark buffer of {} bytes: choose smaller sizes",
            n.saturating_mul(size_of::<T>())
        )
    })?;
    v.extend((0..n).map(f));
    Ok(v)
}

/// The pieces the shared-memory transport moves at a time.
const PIECE: usize = 256 << 10;

/// GB/s of `dst op= src` and of a copy, in [`PIECE`]-byte pieces split
/// over `pool`'s threads.
fn split_rates(pool: &Pool, dtype: DType, dst: &mut [u8], src: &[u8], iters: usize) -> (f64, f64) {
    let pieces = |f: &mut dyn FnMut(&mut [u8], &[u8])| {
        for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
            f(black_box(d), black_box(s));
        }
    };
    let mut pieces = pieces;
    let sum = median_secs(iters, || {
        pieces(&mut |d, s| {
            par::apply_bytes(pool, ReduceOp::Sum, dtype, d, s).expect("equal lengths")
        })
    });
    let copy = median_secs(iters, || pieces(&mut |d, s| par::copy(pool, d, s, false)));
    let bytes = src.len() as f64;
    (bytes / sum / 1e9, bytes / copy / 1e9)
}

/// GB/s of Sum, of memcpy, and of both split in pieces (with a pool).
type Rates = (f64, f64, Option<(f64, f64)>);

/// GB/s of Sum and of memcpy over `bytes` of `T`, and with `pool` (more
/// than one thread) the same split in pieces.
fn bench_dtype<T: Element>(
    bytes: usize,
    iters: usize,
    pool: Option<&Pool>,
    from: impl Fn(f32) -> T,
) -> Result<Rates, String> {
    let n = bytes / size_of::<T>();
    let mut dst: Vec<T> = filled(n, |i| from((i % 7) as f32))?;
    let src: Vec<T> = filled(n, |i| from((i % 5) as f32 * 0.5))?;
    let sum = median_secs(iters, || {
        ReduceOp::Sum
            .apply(black_box(&mut dst[..]), black_box(&src[..]))
            .expect("equal lengths");
    });
    let copy = median_secs(iters, || {
        black_box(&mut dst[..]).copy_from_slice(black_box(&src[..]));
    });
    let split = pool.map(|pool| {
        let dtype = T::DTYPE;
        split_rates(
            pool,
            dtype,
            consort_comm::dtype::as_bytes_mut(&mut dst[..]),
            consort_comm::dtype::as_bytes(&src[..]),
            iters,
        )
    });
    Ok((bytes as f64 / sum / 1e9, bytes as f64 / copy / 1e9, split))
}

/// Runs the sweep and returns the table.
pub(crate) fn reduce(
    sizes: &[usize],
    dtypes: &[DType],
    iters: usize,
    threads: usize,
) -> Result<Table, String> {
    let pool = (threads > 1).then(|| Pool::new(threads));
    let pool = pool.as_ref();
    let mut head = vec!["dtype", "bytes", "sum_gbs", "memcpy_gbs", "ratio"];
    if pool.is_some() {
        head.extend(["split_sum_gbs", "split_copy_gbs"]);
    }
    let mut t = Table::new(&head);
    for &bytes in sizes {
        for &dtype in dtypes {
            let (sum, copy, split) = match dtype {
                DType::F32 => bench_dtype::<f32>(bytes, iters, pool, |x| x)?,
                DType::F16 => bench_dtype::<f16>(bytes, iters, pool, f16::from_f32)?,
                DType::BF16 => bench_dtype::<bf16>(bytes, iters, pool, bf16::from_f32)?,
                DType::F64 => bench_dtype::<f64>(bytes, iters, pool, f64::from)?,
                DType::I32 => bench_dtype::<i32>(bytes, iters, pool, |x| x as i32)?,
                DType::I64 => bench_dtype::<i64>(bytes, iters, pool, |x| x as i64)?,
                DType::U32 => bench_dtype::<u32>(bytes, iters, pool, |x| x as u32)?,
                DType::U64 => bench_dtype::<u64>(bytes, iters, pool, |x| x as u64)?,
                DType::I8 => bench_dtype::<i8>(bytes, iters, pool, |x| x as i8)?,
                DType::U8 => bench_dtype::<u8>(bytes, iters, pool, |x| x as u8)?,
            };
            let mut row = vec![
                json!(dtype.name()),
                json!(bytes),
                json!(sum),
                json!(copy),
                json!(sum / copy),
            ];
            if let Some((s, c)) = split {
                row.extend([json!(s), json!(c)]);
            }
            t.push(row);
        }
    }
    Ok(t)
}

/// Functional-mode all_reduce of `bytes` of f32 per rank across `world`
/// simulated ranks in this process: median wall time, busbw (nccl-tests:
/// algbw × 2(n−1)/n) and memcpy of the same bytes beside it.
pub(crate) async fn sim_all_reduce(
    sizes: &[usize],
    world: usize,
    iters: usize,
) -> Result<Table, Box<dyn std::error::Error>> {
    use std::sync::Arc;

    use consort_comm::ProcessGroup;
    use consort_sim::{SimConfig, SimWorld};

    let mut t = Table::new(&[
        "world",
        "bytes",
        "time_ms",
        "algbw_gbs",
        "busbw_gbs",
        "memcpy_gbs",
    ]);
    for &bytes in sizes {
        let n = bytes / 4;
        let mut times = Vec::with_capacity(iters.max(1));
        for _ in 0..iters.max(1) + 1 {
            let mut cfg = SimConfig::new(world);
            cfg.record_trace = false;
            let sim = SimWorld::new(cfg)?;
            let bufs: Vec<Vec<f32>> = (0..world)
                .map(|r| filled(n, |_| r as f32))
                .collect::<Result<_, _>>()?;
            let start = Instant::now();
            let tasks: Vec<_> = sim
                .ranks()
                .into_iter()
                .zip(bufs)
                .map(|(rank, mut buf)| {
                    tokio::spawn(async move {
                        let pg = ProcessGroup::new(Arc::new(rank));
                        pg.all_reduce(&mut buf, ReduceOp::Sum)
                            .await
                            .map(|()| buf[0])
                    })
                })
                .collect();
            for task in tasks {
                let first = task.await??;
                let want = (0..world).sum::<usize>() as f32;
                if first != want {
                    return Err(format!("all_reduce gave {first}, want {want}").into());
                }
            }
            times.push(start.elapsed().as_secs_f64());
        }
        times.remove(0); // warm-up
        times.sort_by(f64::total_cmp);
        let secs = times[times.len() / 2];
        let algbw = bytes as f64 / secs / 1e9;
        let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
        let src = filled(bytes, |_| 1u8)?;
        let mut dst = filled(bytes, |_| 0u8)?;
        let copy = median_secs(iters.max(3), || dst.copy_from_slice(black_box(&src)));
        t.push(vec![
            json!(world),
            json!(bytes),
            json!(secs * 1e3),
            json!(algbw),
            json!(busbw),
            json!(bytes as f64 / copy / 1e9),
        ]);
    }
    Ok(t)
}

/// The loopback TCP ceiling: two OS processes copy `bytes` over one socket,
/// one way, then both ways at once (as a ring step does). Returns GB/s.
pub(crate) fn loopback(bytes: usize) -> Result<Table, Box<dyn std::error::Error>> {
    use std::{
        io::{Read, Write},
        net::TcpListener,
        process::Command,
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let mut t = Table::new(&["mode", "bytes", "time_ms", "gbs"]);
    for duplex in [false, true] {
        let mut child = Command::new(std::env::current_exe()?)
            .args([
                "bench-loopback-peer",
                &port.to_string(),
                &bytes.to_string(),
                if duplex { "duplex" } else { "oneway" },
            ])
            .spawn()?;
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let chunk = vec![7u8; 1 << 20];
        let start = Instant::now();
        let reader = duplex.then(|| {
            let mut r = s.try_clone().expect("clone socket");
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 20];
                let mut got = 0usize;
                while got < bytes {
                    match r.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got += n,
                    }
                }
                got
            })
        });
        let mut sent = 0usize;
        while sent < bytes {
            let n = chunk.len().min(bytes - sent);
            s.write_all(&chunk[..n])?;
            sent += n;
        }
        if let Some(r) = reader {
            r.join().map_err(|_| "reader thread panicked")?;
        }
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)?;
        let secs = start.elapsed().as_secs_f64();
        child.wait()?;
        t.push(vec![
            json!(if duplex {
                "full duplex (each way)"
            } else {
                "one way"
            }),
            json!(bytes),
            json!(secs * 1e3),
            json!(bytes as f64 / secs / 1e9),
        ]);
    }
    Ok(t)
}

/// The child side of [`loopback`]: receives (and in duplex mode also
/// sends) `bytes`, then acknowledges.
pub(crate) fn loopback_peer(
    port: u16,
    bytes: usize,
    duplex: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    let writer = duplex.then(|| {
        let mut w = s.try_clone().expect("clone socket");
        std::thread::spawn(move || {
            let chunk = vec![9u8; 1 << 20];
            let mut sent = 0usize;
            while sent < bytes {
                let n = chunk.len().min(bytes - sent);
                if w.write_all(&chunk[..n]).is_err() {
                    break;
                }
                sent += n;
            }
        })
    });
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0usize;
    while got < bytes {
        match s.read(&mut buf)? {
            0 => break,
            n => got += n,
        }
    }
    if let Some(w) = writer {
        w.join().map_err(|_| "writer thread panicked")?;
    }
    s.write_all(&[1])?;
    Ok(())
}

/// Peak resident set size of this process, bytes (`VmHWM`).
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Time to produce rank 0's indices (summed, so nothing is optimised away),
/// indices per second, and this process's peak RSS.
pub(crate) fn sampler(
    len: u64,
    num_replicas: usize,
    mode: consort::sampler::Mode,
) -> Result<Table, Box<dyn std::error::Error>> {
    use consort::sampler::DistributedSampler;
    let mut s = DistributedSampler::new(len, num_replicas, 0, true, 0, false)?.with_mode(mode);
    s.set_epoch(1);
    let start = Instant::now();
    let count = s.len();
    let mut checksum = 0u64;
    for x in s.iter_from(0) {
        checksum = checksum.wrapping_add(x);
    }
    black_box(checksum);
    let secs = start.elapsed().as_secs_f64();
    let mut t = Table::new(&[
        "mode",
        "len",
        "num_replicas",
        "indices",
        "time_ms",
        "indices_per_s",
        "peak_rss_mib",
    ]);
    t.push(vec![
        json!(format!("{mode:?}").to_lowercase()),
        json!(len),
        json!(num_replicas),
        json!(count),
        json!(secs * 1e3),
        json!(count as f64 / secs),
        json!(peak_rss() as f64 / (1 << 20) as f64),
    ]);
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_memory_refuses_is_an_error_not_an_abort() {
        let e = filled::<u64>(usize::MAX / 4, |_| 0).unwrap_err();
        assert!(
            e.contains("cannot allocate") && e.contains("smaller sizes"),
            "{e}"
        );
        assert_eq!(filled(3, |i| i as u8).unwrap(), vec![0, 1, 2]);
    }
}
