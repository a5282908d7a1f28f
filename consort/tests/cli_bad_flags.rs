//! `consort bench` and `consort sim` on flags they cannot run (issue 49):
//! each is refused at once with an error naming the flag and what fits,
//! never a panic, an abort on allocation or a loop. Each run is a child
//! with a deadline.

use std::{path::PathBuf, process::Command, time::Duration};

fn consort() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_consort"))
}

/// Runs `consort args`; (ended by itself, success, stderr).
fn run(args: &[&str]) -> (bool, bool, String) {
    let mut cmd = Command::new(consort());
    cmd.args(args);
    let e = consort_tests::child::run_within(&mut cmd, Duration::from_secs(30));
    (e.by_itself, e.ok, e.stderr)
}

#[test]
fn flags_that_cannot_run_are_refused_with_a_reason() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["bench", "sim-all-reduce", "--size", "3"],
            "multiple of 4 bytes",
        ),
        (
            &["bench", "sim-all-reduce", "--size", "4096G"],
            "GiB of memory",
        ),
        (
            &["bench", "sim-all-reduce", "--world-size", "100000"],
            "--world-size 100000",
        ),
        (
            &["bench", "--backend", "sim", "--sizes", "4096G"],
            "GiB of memory",
        ),
        (&["bench", "reduce", "--sizes", "4096G"], "GiB of memory"),
        (&["bench", "loopback", "--size", "4096G"], "GiB of memory"),
        (
            &["bench", "sampler", "--len", "100000000000000"],
            "--mode streaming",
        ),
        (
            &["bench", "ddp", "--params", "100000000M"],
            "fewer --params",
        ),
        (&["bench", "ddp", "--params", "0"], "--params 0"),
        (&["bench", "ddp", "--layers", "0"], "--layers 0"),
        (
            &["bench", "sharded", "--layers", "100000000000"],
            "--layers 100000000000",
        ),
        (&["sim", "--segment", "0", "--sizes", "4K"], "--segment 0"),
        (&["sim", "--world-size", "100000"], "--world-size 100000"),
        (&["sim", "--segment", "1", "--sizes", "1G"], "allowed"),
        (&["sim", "--segment", "1", "--sizes", "64G"], "allowed"),
        (
            &[
                "sim",
                "--op",
                "broadcast",
                "--algo",
                "chain",
                "--world-size",
                "65536",
                "--sizes",
                "1G",
            ],
            "allowed",
        ),
        (
            &[
                "sim",
                "--op",
                "all_to_all",
                "--world-size",
                "65536",
                "--ranks-per-node",
                "32768",
                "--sizes",
                "1M",
            ],
            "allowed",
        ),
        (&["sim", "--bw-intra-gbs", "0"], "--bw-intra-gbs 0"),
        (&["sim", "--bw-inter-gbs", "NaN"], "--bw-inter-gbs NaN"),
        (&["sim", "--alpha-intra-us=-1"], "0 or more"),
        (&["sim", "--gamma-ns", "inf"], "--gamma-ns inf"),
        (&["sim", "--cores", "0"], "--cores 0"),
        (&["sim", "--ranks-per-node", "0"], "--ranks-per-node 0"),
    ];
    for (args, want) in cases {
        let (ended, ok, err) = run(args);
        assert!(ended, "consort {args:?} did not end");
        assert!(!ok, "consort {args:?} succeeded");
        assert!(err.contains(want), "consort {args:?}: {err}");
        assert!(
            !err.contains("panicked"),
            "consort {args:?} panicked: {err}"
        );
    }
}
