//! Device-resident DDP on the emulated device: buckets in device memory,
//! averaged by a stream-ordered backend, with copies that complete late and
//! out of order. The defining property (N ranks with batch b train like one
//! rank with batch N·b) must hold exactly as on the host, and removing
//! either of the backend's two stream waits must break it.

mod common;

use std::{sync::Arc, time::Duration};

use common::{Case, Shape, case, close, lr, make_case, reference};
use consort_comm::{Backend, Device, Placement};
use consort_ddp::{CommHook, Ddp, DdpOptions, DeviceModel};
use consort_sim::{
    EmulatedComm, EmulatedCommOptions, EmulatedDevice, EmulatedOptions, SimConfig, SimWorld,
};
use proptest::prelude::*;

/// Every rank on its own thread (device synchronization blocks the host,
/// as on a GPU), with its own emulated device and communication thread.
fn distributed(c: &Case, comm_opts: EmulatedCommOptions) -> Vec<Vec<Vec<f64>>> {
    let world = SimWorld::new(SimConfig::new(c.world)).expect("sim world");
    let threads: Vec<_> = world
        .ranks()
        .into_iter()
        .map(|rank| {
            let c = c.clone();
            let comm_opts = comm_opts.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(rank_main(c, rank, comm_opts))
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread panicked"))
        .collect()
}

async fn rank_main(
    c: Case,
    rank: consort_sim::SimRank,
    comm_opts: EmulatedCommOptions,
) -> Vec<Vec<f64>> {
    let r = rank.rank();
    let device = EmulatedDevice::new(EmulatedOptions {
        seed: c.seed ^ (r as u64 + 1),
        max_delay: Duration::from_micros(40),
        sync_timeout: Duration::from_secs(5),
        ..Default::default()
    });
    let stream = device.new_stream().unwrap();
    let placement = Placement {
        device: device.clone(),
        stream,
    };
    let comm_opts = EmulatedCommOptions {
        seed: c.seed ^ 0x5eed,
        ..comm_opts
    };
    let comm = Arc::new(EmulatedComm::new(Arc::new(rank), device.clone(), comm_opts).unwrap());
    let mut model = DeviceModel::new(placement.clone());
    for (p, init) in c.init.iter().enumerate() {
        // Ranks other than 0 start from garbage: the broadcast fixes it.
        let v = if r == 0 {
            init.clone()
        } else {
            vec![7.0 + r as f64; init.len()]
        };
        model.add_param(format!("p{p}"), vec![v.len()], &v).unwrap();
    }
    let opts = DdpOptions {
        bucket_cap_bytes: c.cap,
        ..Default::default()
    };
    let mut ddp = Ddp::new(comm.clone(), &mut model, opts).await.unwrap();
    let scale = if c.exact {
        c.world as f64
    } else {
        1.0 / (c.batch * c.micro) as f64
    };
    let n = model.len();
    for step in &c.data {
        let params: Vec<Vec<f64>> = (0..n).map(|i| model.read_param(i).unwrap()).collect();
        let mut acc: Vec<Vec<f64>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        if c.view {
            ddp.zero_grad();
        } else {
            model.zero_grad().unwrap();
        }
        for (m, micro) in step.iter().enumerate() {
            let (xs, ys): (Vec<_>, Vec<_>) = micro[r].iter().cloned().unzip();
            let s = Step {
                c: &c,
                params: &params,
                xs: &xs,
                ys: &ys,
                scale,
                device: &device,
                stream,
            };
            if m + 1 == c.micro {
                micro_step(&mut ddp, &mut model, &s, &mut acc).await;
            } else {
                let mut g = ddp.no_sync();
                micro_step(&mut g, &mut model, &s, &mut acc).await;
            }
        }
        let grads = averaged(&mut ddp, &mut model, c.view, &device, stream);
        for (i, g) in grads.iter().enumerate() {
            let p: Vec<f64> = params[i]
                .iter()
                .zip(g)
                .map(|(v, d)| v - lr(&c) * d)
                .collect();
            model.write_param(i, &p).unwrap();
        }
    }
    comm.synchronize().await.unwrap();
    let out = (0..n).map(|i| model.read_param(i).unwrap()).collect();
    drop(ddp);
    out
}

/// The step's averaged gradients: read from DDP's bucket views (`view`),
/// or copied into the model's gradients and read there.
fn averaged(
    ddp: &mut Ddp<EmulatedComm>,
    model: &mut DeviceModel,
    view: bool,
    device: &Arc<EmulatedDevice>,
    stream: u64,
) -> Vec<Vec<f64>> {
    let n = model.len();
    if !view {
        ddp.copy_grads_to(model).unwrap();
        return (0..n).map(|i| model.read_grad(i).unwrap()).collect();
    }
    (0..n)
        .map(|i| {
            let slot = ddp.grad_device(i).unwrap();
            let mut out = vec![0f64; slot.len()];
            // SAFETY: the slot holds `out`'s bytes.
            unsafe {
                device.copy_to_host(
                    consort_comm::dtype::as_bytes_mut(&mut out),
                    slot.ptr(),
                    stream,
                )
            }
            .unwrap();
            out
        })
        .collect()
}

/// What one micro-batch's backward needs.
struct Step<'a> {
    c: &'a Case,
    params: &'a [Vec<f64>],
    xs: &'a [Vec<f64>],
    ys: &'a [Vec<f64>],
    scale: f64,
    device: &'a Arc<EmulatedDevice>,
    stream: u64,
}

/// One micro-batch: "backward" writes each accumulated gradient on the
/// compute stream (into the bucket view, or the model's gradient) and
/// hands it to DDP as it comes; then finish.
async fn micro_step(
    d: &mut Ddp<EmulatedComm>,
    model: &mut DeviceModel,
    s: &Step<'_>,
    acc: &mut [Vec<f64>],
) {
    let mut ready = Vec::new();
    s.c.mlp.backward(s.params, s.xs, s.ys, s.scale, |i, grad| {
        ready.push((i, grad))
    });
    for (i, grad) in ready {
        for (a, v) in acc[i].iter_mut().zip(&grad) {
            *a += v;
        }
        if s.c.view {
            let slot = d.grad_device(i).unwrap();
            // SAFETY: the slot holds exactly acc[i]'s bytes.
            unsafe {
                s.device.copy_from_host(
                    slot.ptr(),
                    consort_comm::dtype::as_bytes(&acc[i]),
                    s.stream,
                )
            }
            .unwrap();
            d.mark_ready_in_place(i).unwrap();
        } else {
            model.write_grad(i, &acc[i]).unwrap();
            d.mark_ready_device(i, model.grad_buffer(i).unwrap())
                .unwrap();
        }
    }
    d.finish().await.unwrap();
}

/// Whether every rank's parameters match the reference (bit for bit in
/// exact mode).
fn matches(c: &Case, got: &[Vec<Vec<f64>>], want: &[Vec<f64>]) -> Result<(), String> {
    for (r, params) in got.iter().enumerate() {
        for (p, (g, w)) in params.iter().zip(want).enumerate() {
            for (k, (a, b)) in g.iter().zip(w).enumerate() {
                let ok = if c.exact {
                    a.to_bits() == b.to_bits()
                } else {
                    close(*a, *b)
                };
                if !ok {
                    return Err(format!("rank {r} param {p} [{k}]: {a} vs {b}"));
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn device_ddp_on_n_ranks_equals_one_rank_with_the_global_batch(c in case(4)) {
        let want = reference(&c);
        let got = distributed(&c, EmulatedCommOptions::default());
        if let Err(e) = matches(&c, &got, &want) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// A fixed case with several buckets, two ranks and one micro-batch.
fn fixed(seed: u64, view: bool) -> Case {
    make_case(Shape {
        dims: vec![3, 4, 2],
        world: 2,
        batch: 2,
        micro: 1,
        steps: 2,
        cap: Some(16),
        view,
        exact: true,
        seed,
    })
}

/// Whether seed `s`'s run disagrees with the reference under `opts`.
fn wrong(opts: &EmulatedCommOptions, view: bool, s: u64) -> bool {
    let c = fixed(s, view);
    matches(&c, &distributed(&c, opts.clone()), &reference(&c)).is_err()
}

/// How many of `seeds` runs disagree with the reference under `opts`.
fn wrong_runs(opts: &EmulatedCommOptions, view: bool, seeds: u64) -> usize {
    (0..seeds).filter(|&s| wrong(opts, view, s)).count()
}

/// Whether some seed (up to 40; usually the first) shows a wrong result.
fn some_seed_is_wrong(opts: &EmulatedCommOptions, view: bool) -> bool {
    (0..40).any(|s| wrong(opts, view, s))
}

#[test]
fn the_property_catches_a_collective_that_does_not_wait_for_its_input() {
    let opts = EmulatedCommOptions {
        skip_input_wait: true,
        max_delay: Duration::ZERO,
        ..Default::default()
    };
    assert!(
        some_seed_is_wrong(&opts, false),
        "with no input wait the all-reduce can read a bucket before its gradients land; some \
         seed must show it"
    );
}

#[test]
fn the_property_catches_a_stream_that_does_not_wait_for_the_collective() {
    let opts = EmulatedCommOptions {
        skip_output_wait: true,
        ..Default::default()
    };
    assert!(
        some_seed_is_wrong(&opts, true),
        "with no output wait the gradients are read before the average lands; some seed must \
         show it"
    );
}

/// `f` on the one rank of a world of 1, on a runtime of its own.
fn alone<Fut: std::future::Future>(f: impl FnOnce(consort_sim::SimRank) -> Fut) -> Fut::Output {
    let world = SimWorld::new(SimConfig::new(1)).unwrap();
    let rank = world.ranks().pop().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(f(rank))
}

#[test]
fn the_fixed_cases_pass_with_both_waits() {
    assert_eq!(wrong_runs(&EmulatedCommOptions::default(), false, 3), 0);
    assert_eq!(wrong_runs(&EmulatedCommOptions::default(), true, 3), 0);
}

#[test]
fn device_models_refuse_host_only_hooks_and_host_views() {
    alone(|rank| async move {
        let device = EmulatedDevice::new(EmulatedOptions::default());
        let placement = Placement {
            device: device.clone(),
            stream: 0,
        };
        let comm = Arc::new(
            EmulatedComm::new(Arc::new(rank), device, EmulatedCommOptions::default()).unwrap(),
        );
        let mut model = DeviceModel::new(placement);
        model.add_param("w", vec![2], &[1f32, 2.0]).unwrap();
        let opts = DdpOptions::default().comm_hook(CommHook::Fp16Compress);
        let e = Ddp::new(comm.clone(), &mut model, opts).await.unwrap_err();
        assert!(e.to_string().contains("runs on host buckets"), "{e}");
        let mut ddp = Ddp::new(comm, &mut model, DdpOptions::default())
            .await
            .unwrap();
        let e = ddp.grad::<f32>(0).unwrap_err();
        assert!(e.to_string().contains("grad_device(0)"), "{e}");
        let e = ddp
            .mark_ready_device(0, model.param_buffer(0).unwrap())
            .map(|_| ())
            .and_then(|_| ddp.mark_ready_device(0, model.grad_buffer(0).unwrap()))
            .unwrap_err();
        assert!(e.to_string().contains("marked ready twice"), "{e}");
    });
}

/// A device model whose parameter `unused` has no gradient this step (on
/// the ranks that say so): what `ParamSet::has_grad_device` reports for
/// candle's variables that backward did not reach.
struct Unused {
    inner: DeviceModel,
    unused: Option<usize>,
}

impl consort_ddp::ParamSet for Unused {
    fn params(&self) -> Vec<consort_ddp::ParamSpec> {
        self.inner.params()
    }
    fn placement(&self) -> Option<Placement> {
        self.inner.placement().clone().into()
    }
    fn param_device(&mut self, i: usize) -> Option<consort_comm::DeviceBuffer> {
        self.inner.param_buffer(i).ok()
    }
    fn grad_device(&mut self, i: usize) -> Option<consort_comm::DeviceBuffer> {
        self.inner.grad_buffer(i).ok()
    }
    fn has_grad_device(&self, i: usize) -> bool {
        self.unused != Some(i)
    }
}

/// Rank `r` of `world` with parameters `p0` and `p1` (both `[r+1, r+1]`
/// as gradients), `p1` unused on the last rank; the averaged gradients,
/// or the step's error.
async fn unused_rank(
    rank: consort_sim::SimRank,
    world: usize,
    find_unused: bool,
) -> Result<Vec<Vec<f32>>, String> {
    let r = rank.rank();
    let device = EmulatedDevice::new(EmulatedOptions::default());
    let stream = device.new_stream().unwrap();
    let placement = Placement {
        device: device.clone(),
        stream,
    };
    let comm = Arc::new(
        EmulatedComm::new(Arc::new(rank), device, EmulatedCommOptions::default()).unwrap(),
    );
    let mut inner = DeviceModel::new(placement);
    inner.add_param("p0", vec![2], &[0f32; 2]).unwrap();
    inner.add_param("p1", vec![2], &[0f32; 2]).unwrap();
    let unused = (r + 1 == world).then_some(1);
    let mut model = Unused { inner, unused };
    let opts = DdpOptions::default().find_unused_parameters(find_unused);
    let mut ddp = Ddp::new(comm, &mut model, opts).await.unwrap();
    let g = [r as f32 + 1.0; 2];
    model.inner.write_grad(0, &g).unwrap();
    // The unused parameter's storage holds garbage: DDP must not read it.
    model
        .inner
        .write_grad(1, &[if unused.is_some() { 99.0 } else { g[0] }; 2])
        .unwrap();
    ddp.sync_grads(&mut model)
        .await
        .map_err(|e| e.to_string())?;
    Ok((0..2).map(|i| model.inner.read_grad(i).unwrap()).collect())
}

#[test]
fn a_device_parameter_without_a_gradient_is_unused_as_on_the_host() {
    // Two ranks, p1 unused on rank 1: with find_unused_parameters its slot
    // is rank 0's gradient and rank 1's zero, averaged, on both ranks.
    let world = SimWorld::new(SimConfig::new(2)).unwrap();
    let threads: Vec<_> = world
        .ranks()
        .into_iter()
        .map(|rank| {
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(unused_rank(rank, 2, true))
            })
        })
        .collect();
    for t in threads {
        let grads = t.join().unwrap().unwrap();
        assert_eq!(grads, vec![vec![1.5f32; 2], vec![0.5f32; 2]]);
    }
    // Without it, the step fails and names the parameter (torch's error).
    let e = alone(|rank| unused_rank(rank, 1, false)).unwrap_err();
    assert!(e.contains("no gradient this step: p1"), "{e}");
    assert!(e.contains("find_unused_parameters(true)"), "{e}");
}
