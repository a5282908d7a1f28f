//! The sharded strategies' defining property, on the simulator: ZeRO-1,
//! ZeRO-2, FSDP and HSDP on N ranks with per-rank batch b train exactly
//! like one process with batch N·b and the same optimizer, over random
//! MLPs (uneven sizes, random wrapping units), worlds 1–8, several steps,
//! SGD with momentum and AdamW. Plus memory, checkpoints that reshard, and
//! the errors.

mod common;

use std::{collections::BTreeMap, path::Path, sync::Arc};

use common::{
    Case, Shape, close, make_case, run_sim,
    shard::{Opt, cases, check, optimizer, reference, strategy_for},
};
use consort_comm::Backend;
use consort_ddp::{
    AdamW, DdpError, Memory, PlainModel, Sgd, ShardOptimizer, ShardOptions, Sharded, Strategy,
    load_safetensors,
};
use consort_sim::SimConfig;
use proptest::prelude::*;

/// How a distributed run goes.
#[derive(Clone, Debug)]
struct Run {
    strategy: Strategy,
    opt: Opt,
    unit_cap: usize,
    /// Gather every unit again, in reverse, before backward (FSDP's
    /// reshard after forward), instead of keeping the forward's copies.
    regather: bool,
}

/// One rank's training steps `steps` of `c`; returns its final parameters.
async fn train(
    rank: Arc<dyn Backend>,
    c: &Case,
    run: &Run,
    sh: &mut Sharded,
    steps: std::ops::Range<usize>,
) -> Result<(), DdpError> {
    let r = rank.rank();
    let scale = if c.exact {
        c.world as f64
    } else {
        1.0 / c.batch as f64
    };
    let units = sh.layout().units.len();
    for step in &c.data[steps] {
        let mut got = Vec::new();
        for u in 0..units {
            got.push(sh.gather(u).await?);
        }
        if run.regather {
            got.clear();
            for u in (0..units).rev() {
                got.push(sh.gather(u).await?);
            }
        }
        let params: Vec<Vec<f64>> = (0..sh.params().len())
            .map(|p| {
                let g = got.iter().find(|g| g.param::<f64>(p).is_ok()).unwrap();
                g.param::<f64>(p).unwrap().to_vec()
            })
            .collect();
        drop(got);
        let (xs, ys): (Vec<_>, Vec<_>) = step[0][r].iter().cloned().unzip();
        let mut err = Ok(());
        c.mlp.backward(&params, &xs, &ys, scale, |i, g| {
            if err.is_ok() {
                err = sh.mark_ready(i, &g);
            }
        });
        err?;
        sh.step().await?;
    }
    Ok(())
}

/// The initial model on rank `r` (garbage off rank 0: Sharded::new's
/// broadcast fixes it).
fn model_for(c: &Case, r: usize) -> PlainModel {
    let init: Vec<Vec<f64>> = if r == 0 {
        c.init.clone()
    } else {
        c.init
            .iter()
            .map(|p| vec![7.0 + r as f64; p.len()])
            .collect()
    };
    c.mlp.model(&init)
}

fn options(run: &Run) -> ShardOptions {
    let mut o = ShardOptions::new(run.strategy);
    o.unit_cap_bytes = Some(run.unit_cap);
    o
}

fn read(model: &PlainModel) -> Vec<Vec<f64>> {
    (0..model.len())
        .map(|i| model.param::<f64>(i).unwrap().to_vec())
        .collect()
}

/// Every rank, every step; each rank's final parameters.
fn distributed(c: &Case, run: &Run) -> Vec<Vec<Vec<f64>>> {
    let (c, run) = (Arc::new(c.clone()), Arc::new(run.clone()));
    let (out, _) = run_sim(SimConfig::new(c.world), move |rank| {
        let (c, run) = (c.clone(), run.clone());
        async move {
            let rank: Arc<dyn Backend> = rank;
            let mut model = model_for(&c, rank.rank());
            let mut sh = Sharded::new(rank.clone(), &mut model, optimizer(run.opt), options(&run))
                .await
                .unwrap();
            train(rank, &c, &run, &mut sh, 0..c.data.len())
                .await
                .unwrap();
            sh.copy_params_to(&mut model).await.unwrap();
            read(&model)
        }
    });
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_strategy_on_n_ranks_equals_one_process_with_the_global_batch(
        c in cases(8),
        pick in 0usize..4,
        g in 0usize..8,
        adamw in any::<bool>(),
        unit_cap in 8usize..400,
        regather in any::<bool>(),
    ) {
        let mut c = c;
        let opt = match (c.exact, adamw) {
            // Integer data: SGD keeps every value a short binary fraction
            // for its steps; AdamW's square root does so only for its
            // first (the gradients are exact integer sums there).
            (true, true) => {
                c.data.truncate(1);
                Opt::AdamW
            }
            (true, false) => Opt::SgdExact,
            (false, true) => Opt::AdamW,
            (false, false) => Opt::Sgd,
        };
        let run = Run { strategy: strategy_for(c.world, pick, g), opt, unit_cap, regather };
        let want = reference(&c, opt, 0..c.data.len(), c.init.clone());
        let got = distributed(&c, &run);
        check(&c, &got, &want)?;
    }
}

/// A fixed case: an MLP 5 → 7 → 3 (uneven for every world), 4 steps.
fn fixed(world: usize) -> Case {
    make_case(Shape {
        dims: vec![5, 7, 3],
        world,
        batch: 2,
        micro: 1,
        steps: 4,
        cap: None,
        view: false,
        exact: false,
        seed: 11,
    })
}

/// Each rank's `memory()` under every strategy is the ZeRO formula, up to
/// the padding (under one element per shard per flat).
#[test]
fn memory_matches_the_formulas() {
    for world in [1usize, 2, 4, 8] {
        let c = Arc::new(fixed(world));
        let psi: usize = c.mlp.sizes().iter().sum::<usize>() * 8;
        let mut strategies = vec![Strategy::Zero1, Strategy::Zero2, Strategy::Fsdp];
        if world >= 2 {
            strategies.push(Strategy::Hsdp {
                shard_size: world / 2,
            });
        }
        for s in strategies {
            let c2 = c.clone();
            let (mem, _) = run_sim(SimConfig::new(world), move |rank| {
                let c = c2.clone();
                async move {
                    let rank: Arc<dyn Backend> = rank;
                    let mut model = model_for(&c, rank.rank());
                    let mut o = ShardOptions::new(s);
                    o.units = Some(vec![(0..4).collect()]);
                    let sh = Sharded::new(rank, &mut model, AdamW::new(0.01), o)
                        .await
                        .unwrap();
                    sh.memory()
                }
            });
            let n = match s {
                Strategy::Hsdp { shard_size } => shard_size,
                _ => world,
            };
            let want = Memory::expected(Some(s), psi, n, 2);
            let pad = 8 * (n - 1);
            for m in mem {
                for (got, want, what) in [
                    (m.params, want.params, "params"),
                    (m.grads, want.grads, "grads"),
                    (m.optimizer, want.optimizer, "optimizer"),
                ] {
                    let slack = if what == "optimizer" { 2 * pad } else { pad };
                    assert!(
                        got >= want && got <= want + slack,
                        "{s} world {world} {what}: {got} bytes, formula {want}"
                    );
                }
            }
        }
    }
}

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

/// What a user gets wrong is named: a missing gradient, a gradient marked
/// twice, a shard size that does not divide the world, another optimizer's
/// checkpoint.
#[test]
fn mistakes_are_named() {
    let c = Arc::new(fixed(2));
    let (out, _) = run_sim(SimConfig::new(2), move |rank| {
        let c = c.clone();
        async move {
            let rank: Arc<dyn Backend> = rank;
            let mut model = model_for(&c, rank.rank());
            let bad = Sharded::new(
                rank.clone(),
                &mut model,
                Sgd::new(0.1),
                ShardOptions::new(Strategy::Hsdp { shard_size: 3 }),
            )
            .await
            .unwrap_err()
            .to_string();
            let mut sh = Sharded::new(
                rank.clone(),
                &mut model,
                Sgd::new(0.1),
                ShardOptions::new(Strategy::Zero2),
            )
            .await
            .unwrap();
            sh.mark_ready(0, &vec![0.0f64; 35]).unwrap();
            let twice = sh.mark_ready(0, &vec![0.0f64; 35]).unwrap_err().to_string();
            let wrong = sh.mark_ready(1, &[0.0f32; 7]).unwrap_err().to_string();
            let missing = sh.step().await.unwrap_err().to_string();
            let sticky = sh.gather(0).await.unwrap_err().to_string();
            (bad, twice, wrong, missing, sticky)
        }
    });
    for (r, (bad, twice, wrong, missing, sticky)) in out.into_iter().enumerate() {
        assert!(
            bad.contains("shard size 3") && bad.contains("divide the world size 2"),
            "{bad}"
        );
        assert!(
            twice.contains("layers.0.weight") && twice.contains("twice"),
            "{twice}"
        );
        assert!(
            wrong.contains("float32") && wrong.contains("layers.0.bias"),
            "{wrong}"
        );
        assert!(
            missing.contains(&format!("rank {r}")) && missing.contains("layers.1.weight"),
            "{missing}"
        );
        assert!(sticky.contains("failed earlier"), "{sticky}");
    }
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

/// FSDP gathers the next unit while this one is used: `unit + 1` in the
/// forward pass, `unit - 1` once gradients flow; without prefetch, one
/// gather per use.
#[test]
fn fsdp_prefetches_one_unit_ahead_in_each_direction() {
    let c = Arc::new(fixed(2));
    let (out, _) = run_sim(SimConfig::new(2), move |rank| {
        let c = c.clone();
        async move {
            let mut calls = Vec::new();
            for prefetch in [true, false] {
                let counting = common::Counting::new(rank.clone());
                let backend: Arc<dyn Backend> = counting.clone();
                let mut model = model_for(&c, rank.rank());
                let mut o =
                    ShardOptions::new(Strategy::Fsdp).units((0..4).map(|p| vec![p]).collect());
                o.prefetch = prefetch;
                let mut sh = Sharded::new(backend, &mut model, Sgd::new(0.1), o)
                    .await
                    .unwrap();
                let made = || counting.made.load(std::sync::atomic::Ordering::SeqCst);
                let base = made();
                let mut seen = Vec::new();
                for u in 0..4 {
                    let g = sh.gather(u).await.unwrap();
                    seen.push(made() - base);
                    drop(g);
                }
                // Backward: the last unit's gradients, then gathers going down.
                sh.mark_ready(3, &[0.5f64; 3]).unwrap();
                sh.mark_ready(2, &[0.5f64; 21]).unwrap();
                let before = made();
                sh.gather(1).await.unwrap();
                seen.push(made() - before);
                calls.push(seen);
            }
            calls
        }
    });
    for calls in out {
        // gather(0) + prefetch(1); then each gather takes the prefetched one
        // and prefetches the next; gather(3) has none after it. In backward,
        // gather(1) makes its own call and prefetches unit 0.
        assert_eq!(calls[0], [2, 3, 4, 4, 2], "with prefetch");
        assert_eq!(calls[1], [1, 2, 3, 4, 1], "without prefetch");
    }
}

/// A rank that dies in the middle of FSDP training is reported on every
/// survivor as a lost peer, from the call that waited on it, never a hang;
/// afterwards the wrapper refuses to go on (sticky).
#[test]
fn a_crashed_rank_fails_every_survivor_clearly() {
    use consort_sim::fault::{Fault, Trigger};
    for s in [
        Strategy::Zero2,
        Strategy::Fsdp,
        Strategy::Hsdp { shard_size: 2 },
    ] {
        let c = Arc::new(fixed(4));
        let cfg = SimConfig::new(4).fault(Fault::Crash {
            rank: 2,
            at: Trigger::AfterMessages(40),
        });
        let (out, _) = run_sim(cfg, move |rank| {
            let c = c.clone();
            async move {
                let rank: Arc<dyn Backend> = rank;
                let r = rank.rank();
                let run = Run {
                    strategy: s,
                    opt: Opt::AdamW,
                    unit_cap: 64,
                    regather: true,
                };
                let mut model = model_for(&c, r);
                let res = async {
                    let mut sh =
                        Sharded::new(rank.clone(), &mut model, optimizer(run.opt), options(&run))
                            .await?;
                    let res = train(rank.clone(), &c, &run, &mut sh, 0..4).await;
                    let after = sh.step().await.err().map(|e| e.to_string());
                    res.map(|()| after)
                }
                .await;
                (r, res.map_err(|e| e.to_string()))
            }
        });
        for (r, res) in out {
            if r == 2 {
                continue;
            }
            let e = res.expect_err("a survivor finished training without rank 2");
            assert!(e.contains(&format!("rank {r}")), "{s}, rank {r}: {e}");
            assert!(
                e.contains("lost") || e.contains("Lost") || e.contains("aborted"),
                "{s}, rank {r}: {e}"
            );
        }
    }
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

/// Ranks that wrap the model differently (other units, another optimizer)
/// all fail at construction, naming the ranks; a step dropped half-way
/// makes the next call fail instead of pairing the wrong collectives; a
/// gathered parameter read as another dtype is an error, not garbage.
#[test]
fn misuse_across_ranks_and_cancelled_steps_are_refused() {
    use std::{future::Future, task::Poll};
    let c = Arc::new(fixed(3));
    let (out, _) = run_sim(SimConfig::new(3), move |rank| {
        let c = c.clone();
        async move {
            let rank: Arc<dyn Backend> = rank;
            let r = rank.rank();
            let mut model = model_for(&c, r);
            let mut o = ShardOptions::new(Strategy::Fsdp);
            if r == 2 {
                o = o.units(vec![vec![0, 1], vec![2, 3]]);
            }
            let differ = Sharded::new(rank.clone(), &mut model, Sgd::new(0.1), o)
                .await
                .unwrap_err()
                .to_string();
            let nesterov = Sgd {
                nesterov: true,
                ..Sgd::new(0.1)
            };
            let bad_opt = Sharded::new(
                rank.clone(),
                &mut model,
                nesterov,
                ShardOptions::new(Strategy::Fsdp),
            )
            .await
            .unwrap_err()
            .to_string();
            let o = ShardOptions::new(Strategy::Fsdp).units(vec![vec![0, 1], vec![2, 3]]);
            let mut sh = Sharded::new(rank.clone(), &mut model, Sgd::new(0.1), o)
                .await
                .unwrap();
            let g = sh.gather(1).await.unwrap();
            let dtype = g.param::<f32>(2).unwrap_err().to_string();
            drop(g);
            for (p, n) in [(3, 3), (2, 21), (1, 7), (0, 35)] {
                sh.mark_ready(p, &vec![1.0f64; n]).unwrap();
            }
            // Polled once and dropped: left half-way where a reduction was
            // still running (the last rank to launch may finish at once).
            let pending = {
                let mut step = Box::pin(sh.step());
                std::future::poll_fn(|cx| Poll::Ready(step.as_mut().poll(cx).is_pending())).await
            };
            let after = pending.then(|| sh.mark_ready(0, &[0.0f64; 35]).unwrap_err().to_string());
            (differ, bad_opt, dtype, after)
        }
    });
    let mut cancelled = 0;
    for (differ, bad_opt, dtype, after) in out {
        assert!(
            differ.contains("wrap the model differently") && differ.contains("[2]"),
            "{differ}"
        );
        assert!(bad_opt.contains("Nesterov"), "{bad_opt}");
        assert!(dtype.contains("float64, not float32"), "{dtype}");
        if let Some(after) = after {
            assert!(
                after.contains("step() was dropped before it finished"),
                "{after}"
            );
            cancelled += 1;
        }
    }
    assert!(
        cancelled > 0,
        "no rank's step was left half-way: the test tests nothing"
    );
}

/// Without explicit units, ZeRO-1/2 reduce DDP's gradient buckets (c10d's
/// assignment: 1 MiB first, from the last parameter back), and FSDP wraps
/// consecutive parameters up to 25 MiB.
#[test]
fn default_units_are_ddps_buckets_for_zero_and_consecutive_for_fsdp() {
    let (out, _) = run_sim(SimConfig::new(2), move |rank| async move {
        let rank: Arc<dyn Backend> = rank;
        let mut units = Vec::new();
        for s in [Strategy::Zero2, Strategy::Fsdp] {
            let mut m = PlainModel::new();
            for i in 0..6 {
                m.add_param(format!("p{i}"), vec![131_072], &vec![0f32; 131_072])
                    .unwrap();
            }
            let sh = Sharded::new(rank.clone(), &mut m, Sgd::new(0.1), ShardOptions::new(s))
                .await
                .unwrap();
            units.push(sh.layout().units.clone());
        }
        units
    });
    for units in out {
        assert_eq!(units[0], [vec![0, 1, 2, 3], vec![4, 5]], "zero2");
        assert_eq!(units[1], [vec![0, 1, 2, 3, 4, 5]], "fsdp");
    }
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
