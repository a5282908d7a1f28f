//! The GPT example (feature `burn`) never hangs, panics, reads without a
//! bound or writes through a link on bad files (issue 49): a checkpoint at
//! step 2^64-1, one naming an optimizer record elsewhere, metrics with a
//! loss of 1.7e308 or that are a FIFO, an optimizer record that is a link
//! to `/dev/zero`, and links planted where it writes. Each run is a child
//! process with a deadline: one that hangs is killed and fails the test.
//!
//! Needs the example binary: `cargo build -p consort --features burn
//! --example gpt` before `cargo test -p consort --features burn --test
//! gpt_bad_files`.
#![cfg(feature = "burn")]

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use consort::ddp::{load_safetensors, save_safetensors};

mod support;

fn gpt_bin() -> PathBuf {
    support::example_bin("gpt")
}

fn out_dir(name: &str) -> PathBuf {
    support::fresh_dir("gptfiles", name)
}

/// Runs 2 simulated ranks for `steps` steps (a checkpoint every 2) on
/// `dir`; kills the run after a minute. (finished by itself, success,
/// stderr)
fn run(dir: &Path, steps: &str) -> (bool, bool, String) {
    let mut cmd = Command::new(gpt_bin());
    cmd.args([
        "--world-size",
        "2",
        "--batch-size",
        "2",
        "--checkpoint-every",
    ])
    .args(["2", "--steps", steps, "--out"])
    .arg(dir)
    .env_remove("RANK");
    let e = consort_tests::child::run_within(&mut cmd, Duration::from_secs(60));
    (e.by_itself, e.ok, e.stderr)
}

/// A 2-step run's output, then `spoil` applied to its directory.
fn spoiled(name: &str, spoil: impl Fn(&Path)) -> PathBuf {
    let d = out_dir(name);
    let (done, ok, err) = run(&d, "2");
    assert!(done && ok, "the first run failed: {err}");
    spoil(&d);
    d
}

fn set_meta(dir: &Path, key: &str, value: &str) {
    let ckpt = dir.join("checkpoint.safetensors");
    let (sd, mut meta) = load_safetensors(&ckpt).unwrap();
    meta.insert(key.into(), value.into());
    save_safetensors(&ckpt, &sd, &meta).unwrap();
}

/// Resumes on a spoiled directory: it must end by itself, failing with
/// `want` in its error.
fn refused(name: &str, spoil: impl Fn(&Path), want: &str) {
    let d = spoiled(name, spoil);
    let (done, ok, err) = run(&d, "4");
    assert!(done, "{name}: the example hung");
    assert!(!ok && err.contains(want), "{name}: {err}");
    assert!(!err.contains("panicked"), "{name}: {err}");
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn a_step_of_two_to_the_sixty_four_is_refused() {
    let max = u64::MAX.to_string();
    refused("step", |d| set_meta(d, "step", &max), "past --steps 4");
}

#[test]
fn an_optimizer_record_named_elsewhere_is_refused() {
    let spoil = |d: &Path| set_meta(d, "optimizer", "../../etc/passwd");
    refused("record", spoil, "names the optimizer record");
}

#[test]
fn an_absurd_loss_in_the_metrics_is_refused_not_drawn_for_ever() {
    let spoil = |d: &Path| std::fs::write(d.join("metrics.json"), "[[1,1.7e308],[2,1.0]]").unwrap();
    refused("loss", spoil, "is not a loss");
}

#[test]
fn metrics_that_are_a_fifo_are_refused_at_once() {
    let spoil = |d: &Path| {
        let m = d.join("metrics.json");
        std::fs::remove_file(&m).unwrap();
        assert!(Command::new("mkfifo").arg(&m).status().unwrap().success());
    };
    refused("fifo", spoil, "a FIFO");
}

#[test]
fn an_optimizer_record_that_is_a_device_is_refused() {
    let spoil = |d: &Path| {
        let r = d.join("optimizer-2.bpk");
        std::fs::remove_file(&r).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &r).unwrap();
    };
    refused("zero", spoil, "a device");
}

#[test]
fn outputs_are_never_written_through_planted_links() {
    let d = out_dir("links");
    let victims = out_dir("victims");
    let names = ["metrics.json", "loss.png", "optimizer-2.bpk"];
    for name in names {
        std::fs::write(victims.join(name), b"keep").unwrap();
        std::os::unix::fs::symlink(victims.join(name), d.join(name)).unwrap();
    }
    let (done, ok, err) = run(&d, "2");
    assert!(done && ok, "{err}");
    for name in names {
        assert_eq!(
            std::fs::read(victims.join(name)).unwrap(),
            b"keep",
            "{name}"
        );
        let meta = std::fs::symlink_metadata(d.join(name)).unwrap();
        assert!(meta.file_type().is_file(), "{name} is still a link");
    }
    let _ = std::fs::remove_dir_all(d);
    let _ = std::fs::remove_dir_all(victims);
}
