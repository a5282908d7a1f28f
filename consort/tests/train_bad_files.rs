//! The example trainer never hangs, panics or writes through a link on
//! bad files (issue 49): a checkpoint whose history holds an absurd loss
//! or whose epoch is 2^64-1, a checkpoint that is a link to `/dev/zero` or
//! a FIFO, and links planted where it writes its metrics and its plot.
//! Each run is a child process with a deadline: one that hangs is killed
//! and fails the test.
//!
//! Needs the example binary: `cargo test --workspace` builds it (or
//! `cargo build -p consort --example train` before this file alone).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use consort::ddp::{load_safetensors, save_safetensors};

mod support;

fn train_bin() -> PathBuf {
    support::example_bin("train")
}

fn out_dir(name: &str) -> PathBuf {
    support::fresh_dir("badfiles", name)
}

/// Runs the trainer with `args` on `dir`; kills it after `within`.
/// Returns (finished by itself, success, stderr).
fn run(dir: &Path, args: &[&str], within: Duration) -> (bool, bool, String) {
    let mut cmd = Command::new(train_bin());
    cmd.args(args).arg("--out").arg(dir).env_remove("RANK");
    let e = consort_tests::child::run_within(&mut cmd, within);
    (e.by_itself, e.ok, e.stderr)
}

/// A one-epoch run's checkpoint with `edit` applied to its metadata.
fn poisoned(name: &str, edit: impl Fn(&mut BTreeMap<String, String>)) -> PathBuf {
    let d = out_dir(name);
    let (done, ok, err) = run(&d, &["--epochs", "1"], Duration::from_secs(120));
    assert!(done && ok, "the first run failed: {err}");
    let ckpt = d.join("checkpoint.safetensors");
    let (sd, mut meta) = load_safetensors(&ckpt).unwrap();
    edit(&mut meta);
    save_safetensors(&ckpt, &sd, &meta).unwrap();
    d
}

#[test]
fn an_absurd_loss_in_the_history_is_refused_not_drawn_for_ever() {
    let d = poisoned("loss", |m| {
        m.insert(
            "history".into(),
            r#"[{"epoch":1,"train_loss":1.7e308,"test_accuracy":50.0}]"#.into(),
        );
    });
    let (done, ok, err) = run(&d, &["--epochs", "2", "--resume"], Duration::from_secs(60));
    assert!(done, "the trainer hung on a loss of 1.7e308");
    assert!(!ok && err.contains("is not a loss"), "{err}");
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn an_epoch_of_two_to_the_sixty_four_is_refused_not_wrapped() {
    let d = poisoned("epoch", |m| {
        m.insert("epoch".into(), u64::MAX.to_string());
    });
    let (done, ok, err) = run(&d, &["--epochs", "2", "--resume"], Duration::from_secs(60));
    assert!(done, "the trainer hung");
    assert!(!ok && err.contains("past --epochs 2"), "{err}");
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn a_checkpoint_that_is_a_device_or_a_fifo_is_refused_at_once() {
    for (name, what) in [("zero", "a device"), ("fifo", "a FIFO")] {
        let d = out_dir(name);
        let ckpt = d.join("checkpoint.safetensors");
        if name == "zero" {
            std::os::unix::fs::symlink("/dev/zero", &ckpt).unwrap();
        } else {
            let status = Command::new("mkfifo").arg(&ckpt).status().unwrap();
            assert!(status.success());
        }
        let (done, ok, err) = run(&d, &["--epochs", "2", "--resume"], Duration::from_secs(60));
        assert!(done, "the trainer hung reading {name}");
        assert!(!ok && err.contains(what), "{name}: {err}");
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn metrics_and_plot_are_never_written_through_planted_links() {
    let d = out_dir("links");
    let victims = out_dir("victims");
    for name in ["metrics.json", "training.png"] {
        let victim = victims.join(name);
        std::fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, d.join(name)).unwrap();
    }
    let (done, ok, err) = run(&d, &["--epochs", "1"], Duration::from_secs(120));
    assert!(done && ok, "{err}");
    for name in ["metrics.json", "training.png"] {
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

#[test]
fn figures_the_trainer_cannot_use_are_refused_before_it_allocates() {
    let d = out_dir("flags");
    let cases: &[(&[&str], &str)] = &[
        (&["--hidden", "10000000000"], "--hidden 10000000000"),
        (&["--world-size", "100000"], "--world-size 100000"),
        (&["--world-size", "4096", "--hidden", "4096"], "GiB"),
        (&["--lr", "NaN"], "--lr NaN"),
        (
            &["--momentum", "inf", "--strategy", "zero1"],
            "--momentum inf",
        ),
        (&["--epochs", "0"], "--epochs 0"),
    ];
    for (args, want) in cases {
        let (done, ok, err) = run(&d, args, Duration::from_secs(60));
        assert!(done, "the trainer hung on {args:?}");
        assert!(!ok && err.contains(want), "{args:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("memory allocation"),
            "{args:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(d);
}
