//! The sharded strategies' checkpoints, on the simulator: sharded
//! checkpoints that resume at another world size and strategy as one
//! process that never stopped, full state dicts with DDP's keys, and what
//! a load refuses (another optimizer's state, a crafted index) without
//! changing anything.

mod common;

use std::{collections::BTreeMap, path::Path, sync::Arc};

use common::{
    Case, close, run_sim,
    shard::{Opt, Run, fixed, model_for, optimizer, options, read, reference, train},
};
use consort_comm::Backend;
use consort_ddp::{AdamW, Sgd, ShardOptions, Sharded, Strategy, load_safetensors};
use consort_sim::SimConfig;

/// Trains steps `0..2` at world `w1` with `s1`, saves a sharded
/// checkpoint, resumes at world `w2` with `s2`, trains steps `2..4`;
/// returns world 2's final parameters.
fn save_then_resume(
    dir: &Path,
    w1: usize,
    s1: Strategy,
    w2: usize,
    s2: Strategy,
) -> Vec<Vec<Vec<f64>>> {
    let run = |world: usize, s: Strategy, resume: bool| {
        let c = Arc::new(fixed(world));
        let dir = dir.to_path_buf();
        run_sim(SimConfig::new(world), move |rank| {
            let (c, dir) = (c.clone(), dir.clone());
            async move {
                let rank: Arc<dyn Backend> = rank;
                let run = Run {
                    strategy: s,
                    opt: Opt::AdamW,
                    // Other units when resuming: one per parameter, against
                    // a few larger ones when saving.
                    unit_cap: if resume { 8 } else { 400 },
                    regather: false,
                    hold: false,
                };
                let mut model = model_for(&c, rank.rank());
                let mut sh = Sharded::new(
                    rank.clone(),
                    &mut model,
                    optimizer(Opt::AdamW),
                    options(&run),
                )
                .await
                .unwrap();
                if resume {
                    let meta = sh.load_sharded(&dir).await.unwrap();
                    assert_eq!(meta.get("epoch").map(String::as_str), Some("2"));
                    assert_eq!(sh.steps(), 2);
                    train(rank, &c, &run, &mut sh, 2..4).await.unwrap();
                } else {
                    train(rank, &c, &run, &mut sh, 0..2).await.unwrap();
                    let meta = BTreeMap::from([("epoch".to_string(), "2".to_string())]);
                    sh.save_sharded(&dir, &meta).await.unwrap();
                }
                sh.copy_params_to(&mut model).await.unwrap();
                read(&model)
            }
        })
        .0
    };
    run(w1, s1, false);
    run(w2, s2, true)
}

/// Save at world 4, resume at world 2 (and under another strategy, with
/// other wrapping units):
/// training continues as one process that never stopped, and as an
/// unsharded resume would.
#[test]
fn a_sharded_checkpoint_resumes_at_another_world_size() {
    let tmp = std::env::temp_dir().join(format!("consort-reshard-{}", std::process::id()));
    // The data of the fixed case do not depend on the world for the
    // reference: the global batch of each step is the same samples.
    for (w1, s1, w2, s2) in [
        (4, Strategy::Fsdp, 2, Strategy::Fsdp),
        (4, Strategy::Zero2, 2, Strategy::Fsdp),
        (2, Strategy::Hsdp { shard_size: 1 }, 4, Strategy::Zero1),
        (4, Strategy::Hsdp { shard_size: 2 }, 3, Strategy::Zero2),
    ] {
        let dir = tmp.join(format!("{}-{w1}-{}-{w2}", s1.name(), s2.name()));
        let got = save_then_resume(&dir, w1, s1, w2, s2);
        // One process: steps 0..2 on world w1's data, then 2..4 on w2's.
        let (c1, c2) = (fixed(w1), fixed(w2));
        let mid = reference(&c1, Opt::AdamW, 0..2, c1.init.clone());
        let want = reference_from(&c2, 2..4, mid, &c1);
        for params in &got {
            for (g, w) in params.iter().zip(&want) {
                for (a, b) in g.iter().zip(w) {
                    assert!(close(*a, *b), "{s1} at {w1} → {s2} at {w2}: {a} vs {b}");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The reference for steps `steps` of `c`, from parameters `start` and the
/// optimizer state of steps `0..steps.start` of `before`.
fn reference_from(
    c: &Case,
    steps: std::ops::Range<usize>,
    _start: Vec<Vec<f64>>,
    before: &Case,
) -> Vec<Vec<f64>> {
    let opt = optimizer(Opt::AdamW);
    let mut params = before.init.clone();
    let mut state: Vec<Vec<Vec<f64>>> = params
        .iter()
        .map(|p| vec![vec![0.0; p.len()]; opt.slots()])
        .collect();
    for t in 0..steps.end {
        let (data, world) = if t < steps.start {
            (before, before.world)
        } else {
            (c, c.world)
        };
        let (xs, ys): (Vec<_>, Vec<_>) = data.data[t].iter().flatten().flatten().cloned().unzip();
        let scale = 1.0 / (world * data.batch) as f64;
        let mut grads = vec![Vec::new(); params.len()];
        c.mlp
            .backward(&params, &xs, &ys, scale, |i, g| grads[i] = g);
        for ((p, g), s) in params.iter_mut().zip(&grads).zip(&mut state) {
            let mut slots: Vec<&mut [f64]> = s.iter_mut().map(|v| v.as_mut_slice()).collect();
            opt.step_f64(t as u64 + 1, p, g, &mut slots);
        }
    }
    params
}

/// The full state dict has DDP's keys, and its safetensors file loads.
#[test]
fn full_checkpoint_has_the_model_keys_and_loads() {
    let path =
        std::env::temp_dir().join(format!("consort-full-{}.safetensors", std::process::id()));
    let c = Arc::new(fixed(4));
    let p2 = path.clone();
    let (out, _) = run_sim(SimConfig::new(4), move |rank| {
        let (c, path) = (c.clone(), p2.clone());
        async move {
            let rank: Arc<dyn Backend> = rank;
            let run = Run {
                strategy: Strategy::Fsdp,
                opt: Opt::Sgd,
                unit_cap: 64,
                regather: true,
                hold: false,
            };
            let mut model = model_for(&c, rank.rank());
            let mut sh = Sharded::new(rank.clone(), &mut model, optimizer(run.opt), options(&run))
                .await
                .unwrap();
            train(rank, &c, &run, &mut sh, 0..2).await.unwrap();
            sh.save_full_checkpoint(&path, &Default::default(), &BTreeMap::new())
                .await
                .unwrap();
            sh.copy_params_to(&mut model).await.unwrap();
            model.state_dict()
        }
    });
    let (sd, _) = load_safetensors(&path).unwrap();
    assert_eq!(sd, out[0]);
    let keys: Vec<&str> = sd.tensors.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "layers.0.bias",
            "layers.0.weight",
            "layers.1.bias",
            "layers.1.weight"
        ]
    );
    let _ = std::fs::remove_file(&path);
}

/// A checkpoint of another optimizer is refused on every rank, naming both.
#[test]
fn a_checkpoint_of_another_optimizer_is_refused() {
    let tmp = std::env::temp_dir().join(format!("consort-otheropt-{}", std::process::id()));
    let c = Arc::new(fixed(2));
    let dir = tmp.clone();
    let (out, _) = run_sim(SimConfig::new(2), move |rank| {
        let (c, dir) = (c.clone(), dir.clone());
        async move {
            let rank: Arc<dyn Backend> = rank;
            let mut model = model_for(&c, rank.rank());
            let o = ShardOptions::new(Strategy::Fsdp);
            let mut sh = Sharded::new(rank.clone(), &mut model, AdamW::new(0.1), o.clone())
                .await
                .unwrap();
            sh.save_sharded(&dir, &BTreeMap::new()).await.unwrap();
            let mut other = Sharded::new(rank, &mut model, Sgd::new(0.1).momentum(0.9), o)
                .await
                .unwrap();
            other.load_sharded(&dir).await.unwrap_err().to_string()
        }
    });
    for e in out {
        assert!(e.contains("adamw") && e.contains("sgd"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A load that fails on one rank (a shard file is missing) fails on every
/// rank and leaves every rank's parameters as they were; a gather
/// prefetched before a load that works never hands out the old values.
#[test]
fn a_failed_load_changes_nothing_and_a_good_one_drops_old_prefetches() {
    let tmp = std::env::temp_dir().join(format!("consort-badload-{}", std::process::id()));
    let c = Arc::new(fixed(2));
    let dir = tmp.clone();
    let (out, _) = run_sim(SimConfig::new(2), move |rank| {
        let (c, dir) = (c.clone(), dir.clone());
        async move {
            let rank: Arc<dyn Backend> = rank;
            let r = rank.rank();
            let run = Run {
                strategy: Strategy::Fsdp,
                opt: Opt::AdamW,
                unit_cap: 64,
                regather: false,
                hold: false,
            };
            let mut model = model_for(&c, r);
            let mut sh = Sharded::new(rank.clone(), &mut model, optimizer(run.opt), options(&run))
                .await
                .unwrap();
            sh.save_sharded(&dir, &BTreeMap::new()).await.unwrap();
            let saved = {
                sh.copy_params_to(&mut model).await.unwrap();
                read(&model)
            };
            train(rank.clone(), &c, &run, &mut sh, 0..1).await.unwrap();
            let trained = {
                sh.copy_params_to(&mut model).await.unwrap();
                read(&model)
            };
            assert_ne!(saved, trained);
            // Rank 1's shard file goes missing (after both ranks synced).
            rank.barrier(&Default::default()).await.unwrap();
            if r == 1 {
                for e in std::fs::read_dir(&dir).unwrap().flatten() {
                    if e.file_name().to_string_lossy().starts_with("shard-00001") {
                        std::fs::remove_file(e.path()).unwrap();
                    }
                }
            }
            rank.barrier(&Default::default()).await.unwrap();
            let err = sh.load_sharded(&dir).await.unwrap_err().to_string();
            let after = {
                sh.copy_params_to(&mut model).await.unwrap();
                read(&model)
            };
            assert_eq!(
                after, trained,
                "rank {r}: a failed load changed the parameters"
            );
            // A good checkpoint, and a gather of unit 1 prefetched before it.
            sh.save_sharded(&dir, &BTreeMap::new()).await.unwrap();
            train(rank.clone(), &c, &run, &mut sh, 1..2).await.unwrap();
            let _ = sh.gather(0).await.unwrap(); // prefetches unit 1
            sh.load_sharded(&dir).await.unwrap();
            let units = sh.layout().units.clone();
            let unit1 = sh.gather(1).await.unwrap();
            let p = units[1][0];
            let got = unit1.param::<f64>(p).unwrap().to_vec();
            (err, got, trained[p].clone())
        }
    });
    for (r, (err, got, want)) in out.into_iter().enumerate() {
        assert!(err.contains(&format!("rank {r}")), "{err}");
        if r == 1 {
            assert!(err.contains("shard-00001"), "{err}");
        } else {
            assert!(err.contains("another rank failed"), "{err}");
        }
        assert_eq!(got, want, "rank {r}: a prefetched gather outlived the load");
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A damaged or crafted index is refused with a message, never a panic or a
/// read outside the checkpoint: shard names with a directory, `..` or an
/// absolute path, and a flat whose sizes make the element arithmetic
/// overflow.
#[test]
fn a_crafted_index_is_refused_not_followed() {
    let tmp = std::env::temp_dir().join(format!("consort-crafted-{}", std::process::id()));
    let c = Arc::new(fixed(1));
    let dir = tmp.clone();
    type Tamper = fn(&mut serde_json::Value);
    let tampers: Vec<(&str, Tamper)> = vec![
        ("not a plain file name", |v| {
            v["files"][0] = "/etc/passwd".into()
        }),
        ("not a plain file name", |v| {
            v["files"][0] = "../shard.safetensors".into()
        }),
        ("not a plain file name", |v| {
            v["files"][0] = "sub/shard.safetensors".into()
        }),
        ("shorter than its index says", |v| {
            // A flat of ~2^62 elements in shards of as many: every check
            // of the index holds, and the byte offsets overflow usize.
            let huge = serde_json::Value::from(1u64 << 62);
            let p = v["params"][0].clone();
            let numel: u64 = p["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .product();
            let f = p["flat"].as_u64().unwrap() as usize;
            v["flats"][f]["numel"] = huge.clone();
            v["flats"][f]["shard_len"] = huge;
            for q in v["params"].as_array_mut().unwrap() {
                if q["flat"].as_u64() == Some(f as u64) {
                    let off = q["offset"].as_u64().unwrap();
                    q["offset"] = ((1u64 << 62) - 64 + off.min(63 - numel.min(63))).into();
                }
            }
        }),
    ];
    let (out, _) = run_sim(SimConfig::new(1), move |rank| {
        let (c, dir, tampers) = (c.clone(), dir.clone(), tampers.clone());
        async move {
            let rank: Arc<dyn Backend> = rank;
            let mut model = model_for(&c, 0);
            let o = ShardOptions::new(Strategy::Fsdp);
            let mut sh = Sharded::new(rank, &mut model, AdamW::new(0.1), o)
                .await
                .unwrap();
            sh.save_sharded(&dir, &BTreeMap::new()).await.unwrap();
            let good = std::fs::read(dir.join("index.json")).unwrap();
            let mut errs = Vec::new();
            for (want, tamper) in tampers {
                let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
                tamper(&mut v);
                std::fs::write(dir.join("index.json"), v.to_string()).unwrap();
                let e = sh.load_sharded(&dir).await.unwrap_err().to_string();
                errs.push((want, e));
            }
            errs
        }
    });
    for (want, e) in out.into_iter().flatten() {
        assert!(
            e.contains(want) || e.contains("does not fit"),
            "want {want:?}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Files that are not regular files (issue 49): an index that is a FIFO
/// (reading it blocked for ever), a shard or a full checkpoint that is a
/// link to `/dev/zero` (read without a bound). Each is refused at once,
/// naming what it is; a deadline turns a hang into a failure.
#[test]
fn an_index_or_shard_that_is_a_fifo_or_a_device_is_refused_at_once() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(fifo_and_device_errors()));
    let errs = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("a load hung on a FIFO or a device");
    let [fifo, zero, full] = errs.as_slice() else {
        panic!("{errs:?}");
    };
    assert!(
        fifo.contains("index.json") && fifo.contains("a FIFO"),
        "{fifo}"
    );
    assert!(zero.contains("a device"), "{zero}");
    assert!(full.contains("a device"), "{full}");
}

fn fifo_and_device_errors() -> Vec<String> {
    let tmp = std::env::temp_dir().join(format!("consort-special-{}", std::process::id()));
    let c = Arc::new(fixed(1));
    let dir = tmp.clone();
    let (out, _) = run_sim(SimConfig::new(1), move |rank| {
        let (c, dir) = (c.clone(), dir.clone());
        async move {
            let rank: Arc<dyn Backend> = rank;
            let mut model = model_for(&c, 0);
            let o = ShardOptions::new(Strategy::Fsdp);
            let mut sh = Sharded::new(rank, &mut model, AdamW::new(0.1), o)
                .await
                .unwrap();
            sh.save_sharded(&dir, &BTreeMap::new()).await.unwrap();
            let index = dir.join("index.json");
            let good = std::fs::read(&index).unwrap();
            let v: serde_json::Value = serde_json::from_slice(&good).unwrap();
            std::fs::remove_file(&index).unwrap();
            let made = std::process::Command::new("mkfifo").arg(&index).status();
            assert!(made.unwrap().success());
            let fifo = sh.load_sharded(&dir).await.unwrap_err().to_string();
            std::fs::remove_file(&index).unwrap();
            std::fs::write(&index, &good).unwrap();
            let shard = dir.join(v["files"][0].as_str().unwrap());
            std::fs::remove_file(&shard).unwrap();
            std::os::unix::fs::symlink("/dev/zero", &shard).unwrap();
            let zero = sh.load_sharded(&dir).await.unwrap_err().to_string();
            let full = load_safetensors(&shard).unwrap_err().to_string();
            vec![fifo, zero, full]
        }
    });
    let _ = std::fs::remove_dir_all(&tmp);
    out.into_iter().next().unwrap()
}
