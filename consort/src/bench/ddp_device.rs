//! `consort bench ddp --device cuda|emulated`: the cost of DDP on a training
//! step with the model on the device.
//!
//! One rank of a launched job, as the host bench: `params` f32 parameters
//! in `layers` equal layers, the synthetic backward on the device (a kernel
//! on CUDA), last layer first, and SGD through the device's kernels. Rank 0
//! prints, per mode, the median step (the slowest rank's, the device
//! synchronized) and its device memory (bytes held after the steps; on
//! CUDA the pool's peak, torch's `max_memory_allocated`):
//!
//! - `local`: backward and SGD, no communication;
//! - `ddp_bucket_view`: backward writes straight into DDP's device buckets,
//!   each averaged on the device as soon as it is full, then SGD;
//! - `comm_only`: one all_reduce of every gradient alone (the floor).

use consort::{
    BufferMut, CallOptions, DType, ReduceOp,
    ddp::{Ddp, DdpOptions, DeviceModel, DeviceStep, Sgd, ShardOptimizer},
};
use serde_json::json;

use super::sharded_device::{Reading, Rig, mem_cells, model, rig, time_steps};
use crate::table::Table;

type BoxError = Box<dyn std::error::Error>;

/// SGD (lr 1e-3) on parameter `p` of `m` with the gradient at `grad`,
/// through the rig's kernels.
fn sgd(rig: &Rig, m: &DeviceModel, p: usize, grad: u64) -> Result<(), BoxError> {
    let w = m.param_buffer(p)?;
    // SAFETY: the parameter and its gradient hold `len` live f32 on this
    // device, ready on the compute stream; SGD keeps no state.
    let s = unsafe { DeviceStep::new(&rig.place, DType::F32, w.len(), 1, (w.ptr(), grad), &[]) };
    Sgd::new(1e-3).step_device(&*rig.kernels, &s)?;
    Ok(())
}

/// Every mode's median step and memory.
async fn modes(
    rig: &Rig,
    (params, layers, work, iters): (usize, usize, usize, usize),
) -> Result<Vec<(&'static str, f64, Reading)>, BoxError> {
    let bias = rig.backend.rank() as f32 * 1e-3;
    let m = model(rig, params, layers)?;
    let n = m.len();
    let (local, local_mem) = time_steps(rig, iters, async || {
        for l in (0..n).rev() {
            let g = m.grad_buffer(l)?;
            (rig.backward)(&m.param_buffer(l)?, &g, work, bias)?;
        }
        for l in 0..n {
            sgd(rig, &m, l, m.grad_buffer(l)?.ptr())?;
        }
        Ok(())
    })
    .await?;
    // All gradients in one flat device buffer, all-reduced at once.
    let total: usize = (0..n)
        .map(|l| m.param_buffer(l).map(|b| b.len()))
        .sum::<Result<_, _>>()?;
    let flat = rig.place.device.alloc_zeroed(total * 4, rig.place.stream)?;
    let comm = time_steps(rig, iters, async || {
        // SAFETY: `flat` holds `total` f32 until it is freed below.
        let buf = unsafe { rig.place.buffer(flat, total, DType::F32) };
        let call = CallOptions::default();
        rig.backend
            .all_reduce(BufferMut::Device(buf), ReduceOp::Avg, &call)
            .await?;
        Ok(())
    })
    .await;
    // SAFETY: allocated above, freed once, after the all_reduces the stream
    // waits for.
    unsafe { rig.place.device.free(flat, rig.place.stream) }?;
    let (comm_only, comm_mem) = comm?;
    drop(m);
    let mut m = model(rig, params, layers)?;
    let mut ddp = Ddp::new(rig.backend.clone(), &mut m, DdpOptions::default()).await?;
    let (view, view_mem) = time_steps(rig, iters, async || {
        for l in (0..n).rev() {
            let g = ddp.grad_device(l)?;
            (rig.backward)(&m.param_buffer(l)?, &g, work, bias)?;
            ddp.mark_ready_in_place(l)?;
        }
        ddp.finish().await?;
        for l in 0..n {
            sgd(rig, &m, l, ddp.grad_device(l)?.ptr())?;
        }
        Ok(())
    })
    .await?;
    Ok(vec![
        ("local", local, local_mem),
        ("comm_only", comm_only, comm_mem),
        ("ddp_bucket_view", view, view_mem),
    ])
}

/// As one rank of a launched job on `device`: rank 0 returns the table.
pub(crate) async fn run(
    device: &str,
    shape: (usize, usize, usize, usize),
) -> Result<Option<Table>, BoxError> {
    let dist = consort::init_from_env().await?;
    let rig = rig(&dist, device).await?;
    let rows = modes(&rig, shape).await?;
    let world = rig.backend.world_size();
    let mut t = Table::new(&[
        "mode", "device", "world", "params", "step_ms", "vs_local", "mem_mib", "peak_mib",
    ]);
    let local = rows[0].1;
    for (mode, ms, reading) in rows {
        let [mem, peak] = mem_cells(reading);
        t.push(vec![
            json!(mode),
            json!(rig.device_name),
            json!(world),
            json!(shape.0),
            json!(format!("{ms:.2}")),
            json!(format!("{:.2}", ms / local)),
            mem,
            peak,
        ]);
    }
    let rank = rig.backend.rank();
    rig.finish()?;
    dist.shutdown().await?;
    Ok((rank == 0).then_some(t))
}
