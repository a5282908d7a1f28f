//! The sharded strategies with everything on the device, on the emulated
//! device: ZeRO-1, ZeRO-2, FSDP and HSDP keep parameters, gradients,
//! optimizer state and gathered units in device memory, average over a
//! stream-ordered backend whose copies complete late and out of order,
//! and step with the device's optimizer kernels. The defining property of
//! the host strategies must hold here too: N ranks with batch b train like
//! one process with batch N·b. And the device holds what `memory()` says,
//! with no buffer left behind after a step.

mod common;

use std::sync::Arc;

use common::{
    Case, run_sim,
    shard::{
        EmulatedRank, Opt, Run, cases, check, fixed, model_for, on_emulated_ranks, opt_for,
        optimizer, options, reference, strategy_for, train,
    },
};
use consort_comm::{DType, Device};
use consort_ddp::{DeviceModel, PlainModel, Sgd, ShardOptions, Sharded, StagedKernels, Strategy};
use consort_sim::EmulatedDevice;
use proptest::prelude::*;

/// What one rank ends with: its final parameters, and (after the first
/// step, synchronized) the device bytes beyond the model's own against
/// what `memory()` reports.
struct Outcome {
    params: Vec<Vec<f64>>,
    held: (usize, usize),
}

/// Every rank on its own thread with its own emulated device and
/// communication thread.
fn distributed(c: &Case, run: &Run) -> Vec<Outcome> {
    let (cc, run) = (c.clone(), run.clone());
    on_emulated_ranks(c.world, c.seed, move |er| {
        rank_main(cc.clone(), run.clone(), er)
    })
}

/// Reads `n` f64 at `ptr` once the stream has produced them.
fn read(device: &EmulatedDevice, ptr: u64, n: usize, stream: u64) -> Vec<f64> {
    let mut out = vec![0f64; n];
    // SAFETY: callers pass a live view of `n` f64.
    unsafe { device.copy_to_host(consort_comm::dtype::as_bytes_mut(&mut out), ptr, stream) }
        .unwrap();
    out
}

async fn rank_main(c: Case, run: Run, er: EmulatedRank) -> Outcome {
    let EmulatedRank {
        rank: r,
        device,
        place: placement,
        comm,
    } = er;
    let stream = placement.stream;
    let mut model = DeviceModel::new(placement);
    for (p, init) in c.init.iter().enumerate() {
        // Ranks other than 0 start from garbage: the broadcast fixes it.
        let v = if r == 0 {
            init.clone()
        } else {
            vec![7.0 + r as f64; init.len()]
        };
        model.add_param(format!("p{p}"), vec![v.len()], &v).unwrap();
    }
    device.synchronize(stream).unwrap();
    let model_bytes = device.allocated_bytes();
    let mut opts = ShardOptions::new(run.strategy).kernels(Arc::new(StagedKernels));
    opts.unit_cap_bytes = Some(run.unit_cap);
    let mut sh = Sharded::new(comm, &mut model, optimizer(run.opt), opts)
        .await
        .unwrap();
    let mut held = (0, 0);
    for (t, step) in c.data.iter().enumerate() {
        train_step(
            &c,
            &run,
            &mut sh,
            &mut model,
            &step[0][r],
            (&device, stream),
        )
        .await;
        if t == 0 {
            device.synchronize(stream).unwrap();
            held = (device.allocated_bytes() - model_bytes, sh.memory().total());
        }
    }
    sh.copy_params_to(&mut model).await.unwrap();
    let params = (0..model.len())
        .map(|i| model.read_param::<f64>(i).unwrap())
        .collect();
    Outcome { params, held }
}

/// One step: gather every unit (on the device), compute the local
/// gradients on the host from the gathered values, write them where a
/// backward kernel would, and mark each ready from there.
async fn train_step(
    c: &Case,
    run: &Run,
    sh: &mut Sharded,
    model: &mut DeviceModel,
    batch: &[(Vec<f64>, Vec<f64>)],
    (device, stream): (&EmulatedDevice, u64),
) {
    let scale = if c.exact {
        c.world as f64
    } else {
        1.0 / c.batch as f64
    };
    let units = sh.layout().units.len();
    let mut got = Vec::new();
    for u in 0..units {
        got.push(sh.gather(u).await.unwrap());
    }
    if run.regather {
        got.clear();
        for u in (0..units).rev() {
            got.push(sh.gather(u).await.unwrap());
        }
    }
    let params: Vec<Vec<f64>> = (0..sh.params().len())
        .map(|p| {
            let g = got.iter().find(|g| g.param_device(p).is_ok()).unwrap();
            let view = g.param_device(p).unwrap();
            read(device, view.ptr(), view.len(), stream)
        })
        .collect();
    drop(got);
    let (xs, ys): (Vec<_>, Vec<_>) = batch.iter().cloned().unzip();
    let mut grads = vec![Vec::new(); params.len()];
    c.mlp
        .backward(&params, &xs, &ys, scale, |i, g| grads[i] = g);
    // Backward produces the last layer's gradients first.
    for i in (0..grads.len()).rev() {
        model.write_grad(i, &grads[i]).unwrap();
        let buf = model.grad_buffer(i).unwrap();
        sh.mark_ready_device(i, &buf).unwrap();
    }
    sh.step().await.unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn every_strategy_on_the_device_equals_one_process_with_the_global_batch(
        c in cases(4),
        pick in 0usize..4,
        g in 0usize..8,
        adamw in any::<bool>(),
        unit_cap in 8usize..400,
        regather in any::<bool>(),
    ) {
        let mut c = c;
        let opt = opt_for(&mut c, adamw);
        let run = Run { strategy: strategy_for(c.world, pick, g), opt, unit_cap, regather, hold: false };
        let want = reference(&c, opt, 0..c.data.len(), c.init.clone());
        let out = distributed(&c, &run);
        for (r, o) in out.iter().enumerate() {
            prop_assert_eq!(
                o.held.0, o.held.1,
                "rank {}: the device holds {} bytes beyond the model; memory() says {}",
                r, o.held.0, o.held.1
            );
        }
        let got: Vec<_> = out.into_iter().map(|o| o.params).collect();
        check(&c, &got, &want)?;
    }
}

/// What a device user gets wrong is named: a gradient of another dtype, a
/// device gradient for host shards; and a gradient whose memory is gone
/// fails the step on this rank, naming the parameter, and every later
/// call (the ranks no longer agree on their collectives).
#[test]
fn device_mistakes_are_named_and_a_dead_gradient_is_sticky() {
    let out = on_emulated_ranks(1, 7, |er| async move {
        let mut m = DeviceModel::new(er.place.clone());
        m.add_param("w", vec![4], &[1.0f32; 4]).unwrap();
        let opts = ShardOptions::new(Strategy::Fsdp);
        let mut sh = Sharded::new(er.comm.clone(), &mut m, Sgd::new(0.1), opts)
            .await
            .unwrap();
        let d = &er.place.device;
        let wide = d.alloc_zeroed(32, er.place.stream).unwrap();
        // SAFETY: `wide` holds 4 f64.
        let f64_view = unsafe { er.place.buffer(wide, 4, DType::F64) };
        let e1 = sh.mark_ready_device(0, &f64_view).unwrap_err().to_string();
        let dead = d.alloc_zeroed(16, er.place.stream).unwrap();
        // SAFETY: `dead` is freed here and never used again by this test
        // except through the view below, which the device must refuse.
        unsafe { d.free(dead, er.place.stream) }.unwrap();
        // SAFETY: the view is of freed memory on purpose: the emulated device
        // checks every address.
        let dead_view = unsafe { er.place.buffer(dead, 4, DType::F32) };
        let staged = sh.mark_ready_device(0, &dead_view);
        let stepped = match staged {
            Ok(()) => sh.step().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let later = sh.gather(0).await.unwrap_err().to_string();
        let mut host = PlainModel::new();
        host.add_param("w", vec![4], &[1.0f32; 4]).unwrap();
        let world = consort_sim::SimWorld::new(consort_sim::SimConfig::new(1)).unwrap();
        let rank: Arc<dyn consort_comm::Backend> = Arc::new(world.ranks().remove(0));
        let mut hs = Sharded::new(
            rank,
            &mut host,
            Sgd::new(0.1),
            ShardOptions::new(Strategy::Fsdp),
        )
        .await
        .unwrap();
        let g = m.grad_buffer(0).unwrap();
        let e4 = hs.mark_ready_device(0, &g).unwrap_err().to_string();
        // The device's error is sticky, as a CUDA context's: the free fails.
        // SAFETY: allocated above, freed once.
        let sticky = unsafe { d.free(wide, er.place.stream) }.is_err();
        (e1, stepped, later, e4, sticky)
    });
    let (e1, stepped, later, e4, sticky) = &out[0];
    assert!(sticky, "the device keeps its error");
    assert!(e1.contains("got 4 float64 values for w"), "{e1}");
    let e2 = stepped
        .as_ref()
        .expect_err("a freed gradient must fail the step");
    assert!(e2.contains("rank 0") && e2.contains("fsdp"), "{e2}");
    assert!(
        later.contains("failed earlier") || later.contains("cannot continue"),
        "{later}"
    );
    assert!(e4.contains("shards are in host memory"), "{e4}");
}

/// A device's checkpoints are the host's: after the same steps, FSDP on
/// the emulated device and on the simulator give the same full state dict,
/// bit for bit (the device runs the host's arithmetic); the sharded
/// checkpoint written from the device (its shards read back from device
/// memory) loads into a device ZeRO-2 at world 1 (written into device
/// memory), with those parameters and the step count.
#[test]
fn device_checkpoints_equal_the_hosts_and_load_on_the_device() {
    let c = fixed(2);
    let run = Run {
        strategy: Strategy::Fsdp,
        opt: Opt::AdamW,
        unit_cap: 64,
        regather: false,
        hold: false,
    };
    let dir = std::env::temp_dir().join(format!("consort-device-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (cc, rr, d) = (c.clone(), run.clone(), dir.clone());
    let on_device = on_emulated_ranks(2, c.seed, move |er| {
        let (c, run, dir) = (cc.clone(), rr.clone(), d.clone());
        async move {
            let mut m = device_twin(&model_for(&c, er.rank), &er.place);
            let opts = options(&run).kernels(Arc::new(StagedKernels));
            let mut sh = Sharded::new(er.comm, &mut m, optimizer(run.opt), opts)
                .await
                .unwrap();
            let stream = er.place.stream;
            for step in &c.data[0..2] {
                let batch = &step[0][er.rank];
                train_step(&c, &run, &mut sh, &mut m, batch, (&er.device, stream)).await;
            }
            let meta = std::collections::BTreeMap::new();
            sh.save_sharded(&dir, &meta).await.unwrap();
            sh.full_state_dict().await.unwrap()
        }
    });
    let (cc, rr) = (Arc::new(c.clone()), run.clone());
    let (on_host, _) = run_sim(consort_sim::SimConfig::new(2), move |rank| {
        let (c, run) = (cc.clone(), rr.clone());
        async move {
            let rank: Arc<dyn consort_comm::Backend> = rank;
            let mut m = model_for(&c, rank.rank());
            let mut sh = Sharded::new(rank.clone(), &mut m, optimizer(run.opt), options(&run))
                .await
                .unwrap();
            train(rank, &c, &run, &mut sh, 0..2).await.unwrap();
            sh.full_state_dict().await.unwrap()
        }
    });
    let want = on_host[0].clone().expect("rank 0's state dict");
    assert_eq!(
        on_device[0].as_ref(),
        Some(&want),
        "device vs host, bit for bit"
    );
    let (steps, params) = load_on_device(&c, &dir);
    assert_eq!(steps, 2);
    let names: Vec<String> = want.tensors.keys().cloned().collect();
    let specs = consort_ddp::ParamSet::params(&c.mlp.model(&c.init));
    assert_eq!(specs.len(), names.len());
    for (got, spec) in params.iter().zip(&specs) {
        let t = &want.tensors[&spec.name];
        let bytes: &[u8] = bytemuck::cast_slice(got);
        assert_eq!(
            bytes,
            t.data.as_slice(),
            "{} loaded on the device",
            spec.name
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A device model with `host`'s parameters: names, shapes and values.
fn device_twin(host: &PlainModel, place: &consort_comm::Placement) -> DeviceModel {
    let mut m = DeviceModel::new(place.clone());
    for (p, spec) in consort_ddp::ParamSet::params(host).iter().enumerate() {
        let v = host.param::<f64>(p).unwrap();
        m.add_param(spec.name.clone(), spec.shape.clone(), v)
            .unwrap();
    }
    m
}

/// Loads the sharded checkpoint in `dir` into a device ZeRO-2 at world 1;
/// its step count and whole parameters.
fn load_on_device(c: &Case, dir: &std::path::Path) -> (u64, Vec<Vec<f64>>) {
    let (cc, d) = (c.clone(), dir.to_path_buf());
    on_emulated_ranks(1, 3, move |er| {
        let (c, dir) = (cc.clone(), d.clone());
        async move {
            let mut m = device_twin(&c.mlp.model(&c.init), &er.place);
            for p in 0..m.len() {
                let n = m.param_buffer(p).unwrap().len();
                m.write_param(p, &vec![0.0f64; n]).unwrap();
            }
            let opts = ShardOptions::new(Strategy::Zero2).kernels(Arc::new(StagedKernels));
            let mut sh = Sharded::new(er.comm, &mut m, optimizer(Opt::AdamW), opts)
                .await
                .unwrap();
            sh.load_sharded(&dir).await.unwrap();
            sh.copy_params_to(&mut m).await.unwrap();
            let params: Vec<Vec<f64>> = (0..m.len())
                .map(|i| m.read_param::<f64>(i).unwrap())
                .collect();
            (sh.steps(), params)
        }
    })
    .remove(0)
}
