//! What the process-level tests of `consort run`, `consort store` and the
//! examples share: the binaries, a bounded wait for a child, a free port,
//! rank 0's JSON rows, a fresh scratch directory.

#![allow(dead_code, unreachable_pub)]

use std::{
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_consort");

/// Waits for `child` with a deadline, so a hung launcher fails the test
/// instead of hanging it.
pub fn finish(mut child: Child, what: &str) -> Output {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("collect output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect output");
            panic!("{what} did not finish in 120 s: {out:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The built example `name` beside the `consort` binary; fails the test
/// with what to build when it is missing.
pub fn example_bin(name: &str) -> PathBuf {
    let p = PathBuf::from(BIN)
        .parent()
        .expect("target dir")
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        p.exists(),
        "{} is missing: build it first (`cargo build -p consort --example {name}`)",
        p.display()
    );
    p
}

/// An empty directory `consort-<tag>-<pid>-<name>` under the system's
/// temporary directory (whatever an earlier run left there is removed).
pub fn fresh_dir(tag: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("consort-{tag}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("make a scratch directory");
    d
}

pub fn consort(args: &[&str]) -> Child {
    consort_env(args, &[])
}

/// [`consort`] with `vars` set in its environment.
pub fn consort_env(args: &[&str], vars: &[(&str, &str)]) -> Child {
    Command::new(BIN)
        .args(args)
        .env("CONSORT_LOG", "warn")
        .envs(vars.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start consort")
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Rank 0's bench rows, from the launcher's `[rank0]: ` prefixed stdout.
pub fn rank0_rows(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("[rank0]: "))
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect()
}

pub fn bench_worker() -> Vec<&'static str> {
    vec![
        "--",
        BIN,
        "bench",
        "--from-env",
        "--ops",
        "all_reduce,broadcast,all_gather",
        "--sizes",
        "4K,64K",
        "--iters",
        "2",
        "--json",
    ]
}
