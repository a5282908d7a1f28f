//! The sharded strategies' defining property, on the simulator: ZeRO-1,
//! ZeRO-2, FSDP and HSDP on N ranks with per-rank batch b train exactly
//! like one process with batch N·b and the same optimizer, over random
//! MLPs (uneven sizes, random wrapping units), worlds 1–8, several steps,
//! SGD with momentum and AdamW. Plus memory, prefetch, failures and the
//! errors; checkpoints are in `sharded_checkpoint.rs`.

mod common;

use std::sync::Arc;

use common::{
    run_sim,
    shard::{
        Opt, Run, cases, check, distributed, fixed, model_for, opt_for, optimizer, options,
        reference, strategy_for, train,
    },
};
use consort_comm::Backend;
use consort_ddp::{AdamW, Memory, PlainModel, Sgd, ShardOptions, Sharded, Strategy};
use consort_sim::SimConfig;
use proptest::prelude::*;

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
        hold in any::<bool>(),
    ) {
        let mut c = c;
        let opt = opt_for(&mut c, adamw);
        let run = Run { strategy: strategy_for(c.world, pick, g), opt, unit_cap, regather, hold };
        let want = reference(&c, opt, 0..c.data.len(), c.init.clone());
        let got = distributed(&c, &run);
        check(&c, &got, &want)?;
    }
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
                    hold: false,
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
