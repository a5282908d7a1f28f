//! DDP's training-loop contracts on the simulator: errors that name the
//! parameter, find_unused, join, hooks, buffers, bucket rebuilding,
//! checkpoints, a crashed rank, and overlap measured in virtual time.

mod common;

use std::{sync::Arc, time::Duration};

use common::{Counting, run_sim};
use consort_comm::Backend;
use consort_ddp::{
    CommHook, Ddp, DdpError, DdpOptions, PlainModel, buckets::assign_buckets,
    buckets::bucket_limits, load_safetensors,
};
use consort_sim::{SimConfig, SimRank};

/// `sizes[i]` f32 parameters named `p{i}`, valued `rank + i`.
fn model(sizes: &[usize], rank: usize) -> PlainModel {
    let mut m = PlainModel::new();
    for (i, &n) in sizes.iter().enumerate() {
        m.add_param(format!("p{i}"), vec![n], &vec![(rank + i) as f32; n])
            .unwrap();
    }
    m
}

fn grad(n: usize, rank: usize, i: usize) -> Vec<f32> {
    (0..n).map(|k| (rank * 100 + i * 10 + k) as f32).collect()
}

fn mean_grad(n: usize, world: usize, i: usize) -> Vec<f32> {
    (0..n)
        .map(|k| {
            (0..world)
                .map(|r| (r * 100 + i * 10 + k) as f32)
                .sum::<f32>()
                / world as f32
        })
        .collect()
}

#[test]
fn parameters_start_equal_and_every_rank_gets_the_mean() {
    let sizes = [3, 5, 1, 0, 7];
    let (out, _) = run_sim(SimConfig::new(3), move |rank| async move {
        let r = rank.rank();
        let mut m = model(&sizes, r);
        let mut ddp = Ddp::new(rank, &mut m, DdpOptions::default()).await.unwrap();
        for i in (0..sizes.len()).rev() {
            ddp.mark_ready(i, &grad(sizes[i], r, i)).unwrap();
        }
        ddp.finish().await.unwrap();
        ddp.copy_grads_to(&mut m).unwrap();
        m
    });
    for m in &out {
        for (i, &n) in sizes.iter().enumerate() {
            assert_eq!(m.param::<f32>(i).unwrap(), vec![i as f32; n].as_slice());
            assert_eq!(
                m.grad::<f32>(i).unwrap().unwrap(),
                mean_grad(n, 3, i).as_slice()
            );
        }
    }
}

#[test]
fn a_gradient_marked_twice_is_an_error_naming_it() {
    let (out, _) = run_sim(SimConfig::new(1), |rank| async move {
        let mut m = model(&[2, 2], 0);
        let mut ddp = Ddp::new(rank, &mut m, DdpOptions::default()).await.unwrap();
        ddp.mark_ready(1, &[1.0f32, 2.0]).unwrap();
        ddp.mark_ready(1, &[1.0f32, 2.0]).unwrap_err().to_string()
    });
    assert!(
        out[0].contains("p1") && out[0].contains("twice"),
        "{}",
        out[0]
    );
}

#[test]
fn a_missing_gradient_names_the_parameter_and_the_option() {
    let (out, _) = run_sim(
        SimConfig::new(2).timeout(Duration::from_secs(2)),
        |rank| async move {
            let mut m = model(&[2, 2, 2], 0);
            let mut ddp = Ddp::new(rank, &mut m, DdpOptions::default()).await.unwrap();
            ddp.mark_ready(2, &[1.0f32, 2.0]).unwrap();
            ddp.mark_ready(0, &[1.0f32, 2.0]).unwrap();
            let e = ddp.finish().await.unwrap_err();
            // Sticky: the Ddp refuses to go on.
            let again = ddp.finish().await.unwrap_err();
            (e.to_string(), again.to_string())
        },
    );
    for (e, again) in out {
        assert!(
            e.contains("p1") && e.contains("find_unused_parameters"),
            "{e}"
        );
        assert!(again.contains("failed earlier"), "{again}");
    }
}

#[test]
fn find_unused_parameters_counts_missing_gradients_as_zero() {
    let sizes = [4, 3, 2];
    let (out, _) = run_sim(SimConfig::new(2), move |rank| async move {
        let r = rank.rank();
        let mut m = model(&sizes, r);
        let opts = DdpOptions::default().find_unused_parameters(true);
        let mut ddp = Ddp::new(rank, &mut m, opts).await.unwrap();
        let mut got = Vec::new();
        for _step in 0..2 {
            // Rank 1 never uses p1.
            for i in (0..3).rev() {
                if !(r == 1 && i == 1) {
                    ddp.mark_ready(i, &grad(sizes[i], r, i)).unwrap();
                }
            }
            ddp.finish().await.unwrap();
            got.push(ddp.grad::<f32>(1).unwrap().to_vec());
        }
        (got, ddp.buckets_rebuilt())
    });
    let want: Vec<f32> = grad(3, 0, 1).iter().map(|v| v / 2.0).collect();
    for (got, rebuilt) in out {
        assert_eq!(got, vec![want.clone(), want.clone()]);
        assert!(
            !rebuilt,
            "c10d does not rebuild buckets with find_unused_parameters"
        );
    }
}

#[test]
fn buckets_are_rebuilt_in_rank_0s_ready_order() {
    // 8 parameters of 100 f32 (400 bytes); a 1000-byte cap.
    let sizes = [100usize; 8];
    let (out, _) = run_sim(SimConfig::new(3), move |rank| async move {
        let r = rank.rank();
        let mut m = model(&sizes, r);
        let opts = DdpOptions::default().bucket_cap_mb(1000.0 / (1024.0 * 1024.0));
        let mut ddp = Ddp::new(rank, &mut m, opts).await.unwrap();
        let first = ddp.bucket_assignment();
        // Rank 0 marks in a shuffled order, the others in another one.
        let order: Vec<usize> = if r == 0 {
            vec![3, 7, 0, 5, 1, 6, 2, 4]
        } else {
            (0..8).rev().collect()
        };
        for &i in &order {
            ddp.mark_ready(i, &grad(100, r, i)).unwrap();
        }
        ddp.finish().await.unwrap();
        let g: Vec<Vec<f32>> = (0..8)
            .map(|i| ddp.grad::<f32>(i).unwrap().to_vec())
            .collect();
        (first, ddp.bucket_assignment(), g)
    });
    let infos: Vec<_> = (0..8)
        .map(|_| consort_ddp::buckets::ParamInfo {
            dtype: consort_comm::DType::F32,
            device: -1,
            numel: 100,
        })
        .collect();
    let want = assign_buckets(
        &infos,
        &bucket_limits(Some(1000)),
        Some(&[3, 7, 0, 5, 1, 6, 2, 4]),
    )
    .unwrap();
    for (first, rebuilt, g) in out {
        assert_eq!(
            first,
            vec![(0..8).collect::<Vec<_>>()],
            "iteration 1: one bucket"
        );
        let sorted: Vec<Vec<usize>> = want
            .iter()
            .map(|b| {
                let mut b = b.clone();
                b.sort();
                b
            })
            .collect();
        assert_eq!(rebuilt, sorted);
        // Gradients survive the rebuild.
        for (i, g) in g.iter().enumerate() {
            assert_eq!(g, &mean_grad(100, 3, i));
        }
    }
}

#[test]
fn models_that_differ_are_refused_naming_the_parameter_and_ranks() {
    let (out, _) = run_sim(SimConfig::new(4), |rank| async move {
        let r = rank.rank();
        let sizes: Vec<usize> = if r == 2 { vec![3, 4, 6] } else { vec![3, 4, 5] };
        let mut m = model(&sizes, r);
        Ddp::new(rank, &mut m, DdpOptions::default())
            .await
            .unwrap_err()
    });
    for (r, e) in out.iter().enumerate() {
        let DdpError::ParamMismatch { ranks, .. } = e else {
            panic!("{e}")
        };
        assert_eq!(ranks, &[2], "rank {r}: {e}");
        assert!(e.to_string().contains("p2"), "{e}");
    }
    assert!(out[2].to_string().contains("[6]"), "{}", out[2]);
}

#[test]
fn compression_hooks_average_within_their_precision() {
    for hook in [CommHook::Fp16Compress, CommHook::Bf16Compress] {
        let (out, _) = run_sim(SimConfig::new(4), move |rank| async move {
            let r = rank.rank();
            let mut m = model(&[50, 30], r);
            let opts = DdpOptions::default().comm_hook(hook);
            let mut ddp = Ddp::new(rank, &mut m, opts).await.unwrap();
            for i in [1, 0] {
                let g: Vec<f32> = (0..[50, 30][i])
                    .map(|k| ((r * 7 + k * 3 + i) % 11) as f32 * 0.37 - 1.5)
                    .collect();
                ddp.mark_ready(i, &g).unwrap();
            }
            ddp.finish().await.unwrap();
            (0..2)
                .map(|i| ddp.grad::<f32>(i).unwrap().to_vec())
                .collect::<Vec<_>>()
        });
        let tol = if hook == CommHook::Fp16Compress {
            2e-3
        } else {
            2e-2
        };
        for i in 0..2 {
            for k in 0..[50, 30][i] {
                let want: f32 = (0..4)
                    .map(|r| ((r * 7 + k * 3 + i) % 11) as f32 * 0.37 - 1.5)
                    .sum::<f32>()
                    / 4.0;
                for got in &out {
                    let g = got[i][k];
                    assert!(
                        (g - want).abs() <= tol * (1.0 + want.abs()),
                        "{hook:?}: {g} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn buffers_follow_rank_0() {
    let (out, _) = run_sim(SimConfig::new(3), |rank| async move {
        let r = rank.rank();
        let mut m = model(&[2], r);
        m.add_buffer("bn.running_mean", vec![3], &[r as f32; 3])
            .unwrap();
        let mut ddp = Ddp::new(rank, &mut m, DdpOptions::default()).await.unwrap();
        let after_new = m.buffer_mut::<f32>(0).unwrap().to_vec();
        m.buffer_mut::<f32>(0).unwrap()[1] = 10.0 + r as f32;
        ddp.broadcast_buffers(&mut m).await.unwrap();
        (after_new, m.buffer_mut::<f32>(0).unwrap().to_vec())
    });
    for (after_new, after_step) in out {
        assert_eq!(after_new, vec![0.0; 3]);
        assert_eq!(after_step, vec![0.0, 10.0, 0.0]);
    }
}

#[test]
fn join_lets_ranks_with_fewer_batches_finish() {
    // Rank r has r + 1 batches.
    let (out, _) = run_sim(SimConfig::new(3), |rank| async move {
        let r = rank.rank();
        let mut m = model(&[4, 4], r);
        let mut ddp = Ddp::new(rank, &mut m, DdpOptions::default()).await.unwrap();
        ddp.enable_join();
        let mut seen = Vec::new();
        for _batch in 0..=r {
            for i in [1, 0] {
                ddp.mark_ready(i, &[1.0f32; 4]).unwrap();
            }
            ddp.finish().await.unwrap();
            seen.push(ddp.grad::<f32>(0).unwrap()[0]);
        }
        ddp.join().await.unwrap();
        seen
    });
    // Step k has 3 - k active ranks, each contributing 1; divided by 3.
    assert_eq!(out[2], vec![1.0, 2.0 / 3.0, 1.0 / 3.0]);
    assert_eq!(out[1], vec![1.0, 2.0 / 3.0]);
    assert_eq!(out[0], vec![1.0]);
}

#[test]
fn rank_0_writes_a_checkpoint_every_rank_hears_about() {
    let dir = std::env::temp_dir().join(format!("consort-ddp-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = Arc::new(dir.join("model.safetensors"));
    let p = path.clone();
    let (out, _) = run_sim(SimConfig::new(2), move |rank| {
        let p = p.clone();
        async move {
            let r = rank.rank();
            let mut m = model(&[3, 2], r);
            let mut ddp = Ddp::new(rank, &mut m, DdpOptions::default()).await.unwrap();
            let ok = ddp
                .save_checkpoint(&p, &m.state_dict(), &Default::default())
                .await;
            let bad = ddp
                .save_checkpoint(
                    &p.with_file_name("missing-dir").join("x.safetensors"),
                    &m.state_dict(),
                    &Default::default(),
                )
                .await;
            (ok.is_ok(), bad.map_err(|e| e.to_string()))
        }
    });
    for (ok, bad) in out {
        assert!(ok);
        assert!(bad.unwrap_err().contains("missing-dir"));
    }
    let (sd, _) = load_safetensors(&*path).unwrap();
    let mut fresh = model(&[3, 2], 9);
    fresh.load_state_dict(&sd).unwrap();
    assert_eq!(fresh.param::<f32>(1).unwrap(), &[1.0, 1.0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rank_that_crashes_mid_backward_fails_every_other_rank_without_a_hang() {
    let sizes = [1000usize; 6];
    let started = std::time::Instant::now();
    let (out, _) = run_sim(
        SimConfig::new(4).timeout(Duration::from_secs(20)),
        move |rank| async move {
            let r = rank.rank();
            let mut m = model(&sizes, r);
            let opts = DdpOptions::default().bucket_cap_mb(4000.0 / (1024.0 * 1024.0));
            let mut ddp = Ddp::new(rank, &mut m, opts).await.unwrap();
            for step in 0..3 {
                for i in (0..6).rev() {
                    if r == 2 && step == 2 && i == 2 {
                        // The process dies: its handles are dropped.
                        return Ok(());
                    }
                    ddp.mark_ready(i, &grad(1000, r, i))?;
                }
                ddp.finish().await?;
            }
            Ok::<(), DdpError>(())
        },
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    for (r, res) in out.iter().enumerate() {
        if r == 2 {
            continue;
        }
        let e = res
            .as_ref()
            .expect_err("a survivor finished a step a peer never joined");
        let msg = e.to_string();
        assert!(msg.contains("bucket"), "rank {r}: {msg}");
        assert!(msg.contains(&format!("rank {r}")), "rank {r}: {msg}");
    }
}

/// One step of a synthetic backward: parameter gradients appear every
/// `dt` of host time (last parameter first), each marked as it appears.
async fn synthetic_step(
    rank: &SimRank,
    ddp: &mut Ddp<SimRank>,
    n: usize,
    params: usize,
    dt: Duration,
) {
    let g = vec![1.0f32; n];
    for i in (0..params).rev() {
        rank.compute(dt).await;
        ddp.mark_ready(i, &g).unwrap();
    }
    ddp.finish().await.unwrap();
    rank.synchronize();
}

/// The virtual time of one step after the rebuild, on the slowest rank.
fn step_time(world: usize, n: usize, params: usize, cap: f64, dt: Duration) -> Duration {
    let (out, _) = run_sim(SimConfig::new(world), move |rank| async move {
        let mut m = model(&vec![n; params], rank.rank());
        let opts = DdpOptions::default().bucket_cap_mb(cap);
        let mut ddp = Ddp::new(rank.clone(), &mut m, opts).await.unwrap();
        synthetic_step(&rank, &mut ddp, n, params, dt).await;
        let t0 = rank.now();
        synthetic_step(&rank, &mut ddp, n, params, dt).await;
        rank.now() - t0
    });
    out.into_iter().max().unwrap()
}

#[test]
fn backward_and_bucket_all_reduces_overlap_in_virtual_time() {
    let (world, params, n) = (4, 16, 256 * 1024); // 16 × 1 MiB of f32
    let cap = 4.0; // MiB: 4 buckets of 4 parameters
    // C: every bucket back to back (backward takes no time).
    let c = step_time(world, n, params, cap, Duration::ZERO);
    // One bucket's cost alone.
    let bucket = step_time(world, n, 4, cap, Duration::ZERO);
    println!(
        "world {world}, 16 MiB of f32 gradients in 4 buckets; C = {c:?}, one bucket = {bucket:?}"
    );
    println!("| T/C | T | step | max(T,C)+bucket | step / bound |");
    println!("|---|---|---|---|---|");
    for ratio in [0.25, 0.5, 1.0, 2.0, 4.0] {
        let t = c.mul_f64(ratio);
        let step = step_time(world, n, params, cap, t / params as u32);
        let bound = t.max(c) + bucket;
        println!(
            "| {ratio} | {t:.2?} | {step:.2?} | {bound:.2?} | {:.3} |",
            step.as_secs_f64() / bound.as_secs_f64()
        );
        assert!(
            step.as_secs_f64() <= bound.as_secs_f64() * 1.05,
            "T = {t:?}: step {step:?} exceeds max(T, C) + one bucket ({bound:?}) by more than 5%"
        );
        // And it really overlaps: far better than running them in sequence.
        assert!(
            step < t + c,
            "T = {t:?}: step {step:?} is no better than T + C"
        );
    }
}

/// `grad(rank, step, rows, cols)`: a rank's (weight, bias) gradients.
type GradFn = fn(usize, usize, usize, usize) -> (Vec<f32>, Vec<f32>);

/// Runs `steps` synced steps of a model with one `rows × cols` weight and a
/// bias under `hook`; rank `r`'s gradients come from `grad(r, step)`.
/// Returns every rank's averaged gradients of every step.
fn powersgd_run(
    world: usize,
    rows: usize,
    cols: usize,
    steps: usize,
    hook: CommHook,
    grad: GradFn,
) -> Vec<Vec<(Vec<f32>, Vec<f32>)>> {
    let (out, _) = run_sim(SimConfig::new(world), move |rank| async move {
        let r = rank.rank();
        let mut m = PlainModel::new();
        m.add_param("fc.weight", vec![rows, cols], &vec![0f32; rows * cols])
            .unwrap();
        m.add_param("fc.bias", vec![rows], &vec![0f32; rows])
            .unwrap();
        let mut ddp = Ddp::new(rank, &mut m, DdpOptions::default().comm_hook(hook))
            .await
            .unwrap();
        let mut seen = Vec::new();
        for step in 0..steps {
            let (w, b) = grad(r, step, rows, cols);
            ddp.mark_ready(1, &b).unwrap();
            ddp.mark_ready(0, &w).unwrap();
            ddp.finish().await.unwrap();
            seen.push((
                ddp.grad::<f32>(0).unwrap().to_vec(),
                ddp.grad::<f32>(1).unwrap().to_vec(),
            ));
        }
        seen
    });
    out
}

/// Rank r's weight gradient is (r + 1)·u·vᵀ (rank one); its bias gradient
/// is r + i.
fn rank_one(r: usize, _step: usize, rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let w = (0..rows * cols)
        .map(|k| (r + 1) as f32 * (1.0 + (k / cols) as f32) * (0.5 - (k % cols) as f32 * 0.1))
        .collect();
    (w, (0..rows).map(|i| (r + i) as f32).collect())
}

/// A fixed full-rank gradient per rank.
fn full_rank(r: usize, _step: usize, rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let w = (0..rows * cols)
        .map(|k| (((k * 7 + r * 13) % 17) as f32 - 8.0) / 8.0)
        .collect();
    (w, vec![r as f32; rows])
}

#[test]
fn powersgd_is_exact_on_rank_one_gradients_and_plain_before_start_iter() {
    let (world, rows, cols) = (4, 8, 6);
    let hook = CommHook::PowerSgd {
        rank: 1,
        start_iter: 1,
    };
    let out = powersgd_run(world, rows, cols, 3, hook, rank_one);
    let mean_w: Vec<f32> = (0..rows * cols)
        .map(|k| {
            (0..world)
                .map(|r| rank_one(r, 0, rows, cols).0[k])
                .sum::<f32>()
                / world as f32
        })
        .collect();
    let mean_b: Vec<f32> = (0..rows).map(|i| i as f32 + 1.5).collect();
    for (r, steps) in out.iter().enumerate() {
        // Every rank holds the same result.
        assert_eq!(steps, &out[0], "rank {r} differs from rank 0");
        for (s, (w, b)) in steps.iter().enumerate() {
            assert_eq!(b, &mean_b, "step {s}: vectors are averaged exactly");
            for (got, want) in w.iter().zip(&mean_w) {
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "step {s}: {got} vs {want} (a rank-one mean is exact at rank 1)"
                );
            }
        }
    }
}

#[test]
fn powersgd_error_feedback_keeps_the_sum_of_updates_on_course() {
    let (world, rows, cols, steps) = (2, 16, 12, 60);
    let hook = CommHook::PowerSgd {
        rank: 2,
        start_iter: 0,
    };
    let out = powersgd_run(world, rows, cols, steps, hook, full_rank);
    let mean: Vec<f32> = (0..rows * cols)
        .map(|k| {
            (0..world)
                .map(|r| full_rank(r, 0, rows, cols).0[k])
                .sum::<f32>()
                / world as f32
        })
        .collect();
    let applied: Vec<f32> = (0..rows * cols)
        .map(|k| out[0].iter().map(|(w, _)| w[k]).sum::<f32>())
        .collect();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let diff: Vec<f32> = applied
        .iter()
        .zip(&mean)
        .map(|(a, m)| a - steps as f32 * m)
        .collect();
    let rel = norm(&diff) / (steps as f32 * norm(&mean));
    // One step alone is far off (rank 2 of a 12-wide matrix)...
    let first: Vec<f32> = out[0][0].0.iter().zip(&mean).map(|(a, m)| a - m).collect();
    let rel_first = norm(&first) / norm(&mean);
    // ...but the error feedback makes the running sum converge.
    assert!(
        rel < 0.1,
        "after {steps} steps the summed update is off by {rel:.3}"
    );
    assert!(
        rel_first > 0.1,
        "a single step was already exact ({rel_first:.3})?"
    );
    eprintln!("PowerSGD rank 2: one step off by {rel_first:.3}, {steps} steps off by {rel:.4}");
}

#[test]
fn bucket_k_plus_1_is_launched_while_bucket_k_is_in_flight() {
    // Four buckets whose gradients are all ready at once: the worker makes
    // each bucket's all_reduce as it arrives instead of waiting for the one
    // before, so some rank has several in flight; results stay exact.
    let (world, params, n) = (3, 8, 1000);
    let (out, _) = run_sim(SimConfig::new(world), move |rank| async move {
        let backend = Counting::new(rank.clone());
        let max = backend.max.clone();
        let mut m = model(&vec![n; params], rank.rank());
        let opts = DdpOptions::default().bucket_cap_mb(2.0 * 4.0 * n as f64 / (1 << 20) as f64);
        let mut ddp = Ddp::new(backend, &mut m, opts).await.unwrap();
        // The first step runs as one bucket; the rebuilt layout has four.
        for step in 0..2 {
            max.store(0, std::sync::atomic::Ordering::SeqCst);
            for i in (0..params).rev() {
                let g: Vec<f32> = grad(n, rank.rank(), i)
                    .iter()
                    .map(|x| x + step as f32)
                    .collect();
                ddp.mark_ready(i, &g).unwrap();
            }
            ddp.finish().await.unwrap();
        }
        let exact = (0..params).all(|i| {
            let want = mean_grad(n, world, i);
            let got = ddp.grad::<f32>(i).unwrap();
            got.iter()
                .zip(&want)
                .all(|(g, w)| (g - (w + 1.0)).abs() <= 1e-5 * (w + 1.0).abs())
        });
        (max.load(std::sync::atomic::Ordering::SeqCst), exact)
    });
    assert!(
        out.iter().all(|&(_, exact)| exact),
        "the averages are wrong"
    );
    let most = out.iter().map(|&(m, _)| m).max().unwrap();
    assert!(
        most >= 2,
        "no rank ever had two bucket all_reduces in flight (most: {most})"
    );
}

#[test]
fn half_precision_buckets_hold_the_mean_not_the_sum() {
    // f16 and bf16 parameters: DDP divides before it sums, on every dtype.
    use consort_comm::half::{bf16, f16};
    let world = 4;
    let (out, _) = run_sim(SimConfig::new(world), move |rank| async move {
        let r = rank.rank();
        let mut m = PlainModel::new();
        m.add_param("h", vec![3], &[f16::from_f32(0.0); 3]).unwrap();
        m.add_param("b", vec![2], &[bf16::from_f32(0.0); 2])
            .unwrap();
        let mut ddp = Ddp::new(rank.clone(), &mut m, DdpOptions::default())
            .await
            .unwrap();
        let g = (4 * r + 4) as f32; // 4, 8, 12, 16: mean 10
        ddp.mark_ready(1, &[bf16::from_f32(g); 2]).unwrap();
        ddp.mark_ready(0, &[f16::from_f32(g); 3]).unwrap();
        ddp.finish().await.unwrap();
        let h: Vec<f32> = ddp
            .grad::<f16>(0)
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let b: Vec<f32> = ddp
            .grad::<bf16>(1)
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        (h, b)
    });
    for (h, b) in out {
        assert_eq!(h, vec![10.0; 3]);
        assert_eq!(b, vec![10.0; 2]);
    }
}
