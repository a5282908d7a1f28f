//! `consort bench reduce`: throughput of [`ReduceOp::Sum`] apply per dtype,
//! beside a plain memcpy of the same bytes on the same machine.
//!
//! `dst += src` moves 3 bytes per byte of dst (read dst, read src, write
//! dst) where memcpy moves 2, so the memory-bound ceiling for Sum is 2/3 of
//! memcpy's rate in bytes of dst per second.

use std::{hint::black_box, time::Instant};

use consort_comm::{
    DType, Element, ReduceOp,
    half::{bf16, f16},
};
use serde_json::json;

use super::table::Table;

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

fn bench_dtype<T: Element>(bytes: usize, iters: usize, from: impl Fn(f32) -> T) -> (f64, f64) {
    let n = bytes / size_of::<T>();
    let mut dst: Vec<T> = (0..n).map(|i| from((i % 7) as f32)).collect();
    let src: Vec<T> = (0..n).map(|i| from((i % 5) as f32 * 0.5)).collect();
    let sum = median_secs(iters, || {
        ReduceOp::Sum
            .apply(black_box(&mut dst[..]), black_box(&src[..]))
            .expect("equal lengths");
    });
    let copy = median_secs(iters, || {
        black_box(&mut dst[..]).copy_from_slice(black_box(&src[..]));
    });
    (bytes as f64 / sum / 1e9, bytes as f64 / copy / 1e9)
}

/// Runs the sweep and returns the table.
pub(crate) fn reduce(sizes: &[usize], dtypes: &[DType], iters: usize) -> Table {
    let mut t = Table::new(&["dtype", "bytes", "sum_gbs", "memcpy_gbs", "ratio"]);
    for &bytes in sizes {
        for &dtype in dtypes {
            let (sum, copy) = match dtype {
                DType::F32 => bench_dtype::<f32>(bytes, iters, |x| x),
                DType::F16 => bench_dtype::<f16>(bytes, iters, f16::from_f32),
                DType::BF16 => bench_dtype::<bf16>(bytes, iters, bf16::from_f32),
                DType::F64 => bench_dtype::<f64>(bytes, iters, f64::from),
                DType::I32 => bench_dtype::<i32>(bytes, iters, |x| x as i32),
                DType::I64 => bench_dtype::<i64>(bytes, iters, |x| x as i64),
                DType::U32 => bench_dtype::<u32>(bytes, iters, |x| x as u32),
                DType::U64 => bench_dtype::<u64>(bytes, iters, |x| x as u64),
                DType::I8 => bench_dtype::<i8>(bytes, iters, |x| x as i8),
                DType::U8 => bench_dtype::<u8>(bytes, iters, |x| x as u8),
            };
            t.push(vec![
                json!(dtype.name()),
                json!(bytes),
                json!(sum),
                json!(copy),
                json!(sum / copy),
            ]);
        }
    }
    t
}
