//! The example trainer (`examples/train`), run as a user runs it: on the
//! simulator in one process, and over TCP through `consort run`.
//!
//! The example binary is built by `cargo test --workspace` (cargo builds
//! examples with the tests). Running this file alone needs
//! `cargo build -p consort --example train` first.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use consort::ddp::{StateDict, load_safetensors};

mod support;

fn consort_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_consort"))
}

fn train_bin() -> PathBuf {
    support::example_bin("train")
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("consort-train-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn check(out: Output, what: &str) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what} failed:\n{text}");
    text
}

fn train(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(train_bin())
        .args(args)
        .arg("--out")
        .arg(dir)
        .env_remove("RANK")
        .output()
        .expect("run the trainer");
    check(out, &format!("train {args:?}"))
}

fn params(dir: &Path) -> StateDict {
    load_safetensors(dir.join("checkpoint.safetensors"))
        .expect("checkpoint")
        .0
}

fn accuracies(dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(dir.join("metrics.json")).expect("metrics.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v.as_array()
        .expect("array")
        .iter()
        .map(|e| e["test_accuracy"].as_f64().expect("accuracy"))
        .collect()
}

/// Largest absolute difference between two checkpoints' tensors.
fn max_diff(a: &StateDict, b: &StateDict) -> f32 {
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>()
    );
    a.tensors
        .iter()
        .map(|(k, t)| {
            let x = t.to_vec::<f32>().expect("f32");
            let y = b.tensors[k].to_vec::<f32>().expect("f32");
            x.iter()
                .zip(&y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max)
        })
        .fold(0.0, f32::max)
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).expect("the plot");
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        path.display()
    );
    assert!(bytes.len() > 10_000, "the plot is suspiciously small");
}

#[test]
fn two_epochs_on_two_ranks_on_the_simulator_and_over_tcp_agree() {
    let sim = out_dir("sim2");
    let text = train(&sim, &["--epochs", "2", "--world-size", "2"]);
    assert!(text.contains("epoch   2/2"), "{text}");
    assert_eq!(accuracies(&sim).len(), 2);
    assert_png(&sim.join("training.png"));

    let tcp = out_dir("tcp2");
    let out = Command::new(consort_bin())
        .args(["run", "--standalone", "--nproc-per-node", "2", "--"])
        .arg(train_bin())
        .args(["--epochs", "2", "--out"])
        .arg(&tcp)
        .output()
        .expect("consort run");
    let text = check(out, "consort run -- train");
    assert!(text.contains("[rank0]: epoch   2/2"), "{text}");
    assert_png(&tcp.join("training.png"));
    // The same schedules reduce in the same order on both backends.
    let d = max_diff(&params(&sim), &params(&tcp));
    assert!(d <= 1e-6, "sim and TCP runs differ by {d}");
    let (a, b) = (accuracies(&sim), accuracies(&tcp));
    assert!((a[1] - b[1]).abs() < 1e-9, "{a:?} vs {b:?}");
    for d in [sim, tcp] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn default_training_reaches_95_percent_whatever_the_world_size() {
    let dirs: Vec<PathBuf> = [1, 2, 4]
        .iter()
        .map(|w| {
            let d = out_dir(&format!("w{w}"));
            train(&d, &["--world-size", &w.to_string()]);
            d
        })
        .collect();
    let finals: Vec<f64> = dirs
        .iter()
        .map(|d| *accuracies(d).last().expect("epochs"))
        .collect();
    assert!(finals[0] >= 95.0, "world 1: {:.2}%", finals[0]);
    assert!(finals[2] >= 95.0, "world 4: {:.2}%", finals[2]);
    for f in &finals {
        assert!((f - finals[0]).abs() <= 0.5, "final accuracies {finals:?}");
    }
    let p1 = params(&dirs[0]);
    for d in &dirs[1..] {
        let diff = max_diff(&p1, &params(d));
        assert!(
            diff <= 1e-4,
            "{}: parameters differ from world 1 by {diff}",
            d.display()
        );
    }
    for d in dirs {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn resume_continues_to_the_same_parameters_as_an_uninterrupted_run() {
    let whole = out_dir("whole");
    train(&whole, &["--epochs", "3", "--world-size", "2"]);
    let split = out_dir("split");
    train(&split, &["--epochs", "2", "--world-size", "2"]);
    let text = train(&split, &["--epochs", "3", "--world-size", "2", "--resume"]);
    assert!(text.contains("epochs 3..3"), "{text}");
    assert_eq!(params(&whole), params(&split), "resumed run differs");
    assert_eq!(accuracies(&whole), accuracies(&split));
    for d in [whole, split] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn bad_requests_fail_with_a_reason() {
    let d = out_dir("bad");
    for (args, want) in [
        (vec!["--resume"], "no checkpoint at"),
        (
            vec!["--batch-size", "30", "--world-size", "4"],
            "multiple of the world size",
        ),
        (
            vec!["--backend", "gloo"],
            "expected sim, tcp, emulated or nccl",
        ),
        (
            vec!["--strategy", "zero3"],
            "expected ddp, zero1, zero2, fsdp or hsdp",
        ),
        (
            vec!["--strategy", "hsdp", "--shard-size", "3"],
            "--shard-size 3 must divide the world size 4",
        ),
        (
            vec!["--momentum", "0.9"],
            "--momentum needs a sharded --strategy",
        ),
    ] {
        let out = Command::new(train_bin())
            .args(&args)
            .arg("--out")
            .arg(&d)
            .env_remove("RANK")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(d);
}

/// `--device cuda` without a GPU (or without the `nccl` feature) is a clear
/// error naming what is missing, never a panic; `--device` with a CPU
/// backend says to use NCCL.
#[test]
fn device_cuda_without_a_gpu_says_what_is_missing() {
    let dir = out_dir("cuda");
    let out = Command::new(train_bin())
        .args([
            "--backend",
            "nccl",
            "--device",
            "cuda",
            "--epochs",
            "1",
            "--out",
        ])
        .arg(&dir)
        .env_remove("RANK")
        .output()
        .expect("run the trainer");
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        eprintln!("this machine trained on a GPU");
        return;
    }
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("backend `nccl` is unavailable") || err.contains("built without NCCL"),
        "{err}"
    );
    let out = Command::new(train_bin())
        .args(["--device", "cuda", "--out"])
        .arg(&dir)
        .env_remove("RANK")
        .output()
        .expect("run the trainer");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("use --backend nccl"), "{err}");
}

/// `--strategy fsdp` and `--strategy zero2` (and zero1, hsdp) reach DDP's
/// accuracy with parameters within 1e-4 of the DDP run's, on the simulator
/// and over TCP under `consort run`.
#[test]
fn sharded_strategies_train_like_ddp_on_the_simulator_and_over_tcp() {
    let ddp = out_dir("s-ddp");
    train(&ddp, &[]);
    let want = params(&ddp);
    let acc = *accuracies(&ddp).last().expect("epochs");
    assert!(acc >= 95.0, "ddp: {acc:.2}%");
    for s in ["zero1", "zero2", "fsdp", "hsdp"] {
        let d = out_dir(&format!("s-{s}"));
        let text = train(&d, &["--strategy", s]);
        assert!(text.contains(&format!("strategy {s}")), "{text}");
        let got = *accuracies(&d).last().expect("epochs");
        assert!(
            got >= 95.0 && (got - acc).abs() <= 0.5,
            "{s}: {got:.2}% (ddp {acc:.2}%)"
        );
        let diff = max_diff(&want, &params(&d));
        assert!(diff <= 1e-4, "{s}: parameters differ from DDP's by {diff}");
        std::fs::remove_dir_all(d).unwrap();
    }
    for s in ["fsdp", "zero2"] {
        let d = out_dir(&format!("tcp-{s}"));
        let out = Command::new(consort_bin())
            .args(["run", "--standalone", "--nproc-per-node", "2", "--"])
            .arg(train_bin())
            .args(["--strategy", s, "--out"])
            .arg(&d)
            .output()
            .expect("consort run");
        let text = check(out, &format!("consort run -- train --strategy {s}"));
        assert!(text.contains("[rank0]: epoch  20/20"), "{text}");
        let got = *accuracies(&d).last().expect("epochs");
        assert!(got >= 95.0, "{s} over tcp: {got:.2}%");
        let diff = max_diff(&want, &params(&d));
        assert!(
            diff <= 1e-4,
            "{s} over tcp: parameters differ from DDP's by {diff}"
        );
        assert!(d.join("sharded").join("index.json").exists());
        std::fs::remove_dir_all(d).unwrap();
    }
    std::fs::remove_dir_all(ddp).unwrap();
}

/// With momentum, a sharded run saved at 4 ranks and resumed at 2 (from
/// its sharded checkpoint: parameters and momentum buffers) ends where an
/// uninterrupted run ends.
#[test]
fn a_sharded_run_resumes_at_another_world_size() {
    let whole = out_dir("m-whole");
    let m = ["--momentum", "0.9", "--lr", "0.05"];
    train(
        &whole,
        &[&["--epochs", "3", "--strategy", "fsdp"][..], &m].concat(),
    );
    let split = out_dir("m-split");
    train(
        &split,
        &[&["--epochs", "2", "--strategy", "fsdp"][..], &m].concat(),
    );
    let args = [
        "--epochs",
        "3",
        "--strategy",
        "zero2",
        "--world-size",
        "2",
        "--resume",
    ];
    let text = train(&split, &[&args[..], &m].concat());
    assert!(text.contains("epochs 3..3"), "{text}");
    let diff = max_diff(&params(&whole), &params(&split));
    assert!(
        diff <= 1e-5,
        "resumed at world 2: parameters differ by {diff}"
    );
    // Without the momentum buffers the third epoch would differ: check
    // that the test can tell.
    let lost = out_dir("m-lost");
    train(
        &lost,
        &[&["--epochs", "2", "--strategy", "fsdp"][..], &m].concat(),
    );
    std::fs::remove_dir_all(lost.join("sharded")).unwrap();
    train(&lost, &[&args[..], &m].concat());
    let diff = max_diff(&params(&whole), &params(&lost));
    assert!(
        diff > 1e-4,
        "a resume without the optimizer state matched too ({diff})"
    );
    for d in [whole, split, lost] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// `--mixed-precision bf16|f16` under a sharded strategy: layers gathered
/// and gradients reduced in the half type, f32 master weights (f16 with
/// loss scaling); the run reaches DDP's accuracy within 0.5 points, its
/// parameters move off the f32 run's (the rounding is real) but stay near
/// them, and its checkpoint holds f32. With DDP it is refused.
#[test]
fn mixed_precision_trains_within_half_a_point_of_ddp() {
    let ddp = out_dir("mp-ddp");
    train(&ddp, &[]);
    let (want, acc) = (params(&ddp), *accuracies(&ddp).last().expect("epochs"));
    for (s, mp) in [("fsdp", "bf16"), ("zero2", "f16")] {
        let d = out_dir(&format!("mp-{s}-{mp}"));
        let text = train(&d, &["--strategy", s, "--mixed-precision", mp]);
        assert!(text.contains("mixed precision"), "{text}");
        let got = *accuracies(&d).last().expect("epochs");
        assert!(
            (got - acc).abs() <= 0.5,
            "{s} {mp}: {got:.2}% (ddp {acc:.2}%)"
        );
        let diff = max_diff(&want, &params(&d));
        assert!(
            diff > 0.0 && diff < 0.1,
            "{s} {mp}: parameters {diff} from DDP's"
        );
        std::fs::remove_dir_all(d).unwrap();
    }
    let out = Command::new(train_bin())
        .args(["--mixed-precision", "bf16", "--epochs", "1", "--out"])
        .arg(&ddp)
        .env_remove("RANK")
        .output()
        .expect("run the trainer");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("needs a sharded --strategy"),
        "{err}"
    );
    std::fs::remove_dir_all(ddp).unwrap();
}
