//! `consort run`, the torchrun-style launcher, driven as a user would: real
//! agent processes, real worker processes, real sockets on loopback. Its
//! meetings with torch and `consort store`'s secrets are in
//! `torch_interop.rs`.

mod support;

use std::{
    io::{BufRead, BufReader},
    process::{Command, Output, Stdio},
    time::Duration,
};

use support::{BIN, bench_worker, consort, consort_env, finish, free_port, rank0_rows};

/// The launcher's GPU counting, so the `--nproc-per-node gpu|auto` tests
/// know what this machine has.
#[allow(dead_code)]
#[path = "../src/cli/gpus.rs"]
mod gpus;

#[test]
fn four_workers_all_reduce_and_exit_zero() {
    let mut args = vec!["run", "--standalone", "--nproc-per-node", "4"];
    args.extend(bench_worker());
    let out = finish(consort(&args), "consort run");
    assert!(out.status.success(), "{out:?}");
    let rows = rank0_rows(&out);
    assert_eq!(rows.len(), 6, "{out:?}");
    for r in rows {
        assert_eq!(r["world"], 4);
        assert_eq!(r["wrong"], 0, "rank 0 saw wrong results: {r}");
    }
}

/// `--bind-to core`: each worker runs on a core of its own, in local-rank
/// order; with more workers than cores they stay unbound.
#[test]
fn bind_to_core_gives_each_worker_its_own_core() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Each worker's allowed cores, as the kernel lists them.
    let allowed = |workers: usize| -> Vec<String> {
        let show = "echo \"bound $(grep Cpus_allowed_list /proc/self/status)\"";
        let n = workers.to_string();
        let args = [
            "run",
            "--standalone",
            "--bind-to",
            "core",
            "--nproc-per-node",
            &n,
        ];
        let mut args = args.to_vec();
        args.extend(["--", "sh", "-c", show]);
        let out = finish(consort(&args), "consort run --bind-to core");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split("Cpus_allowed_list:").nth(1))
            .map(|c| c.trim().to_string())
            .collect()
    };
    let mut seen = allowed(cores.min(4));
    assert_eq!(seen.len(), cores.min(4), "{seen:?}");
    assert!(
        seen.iter().all(|c| c.parse::<usize>().is_ok()),
        "one core each: {seen:?}"
    );
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), cores.min(4), "distinct cores: {seen:?}");
    // More workers than cores: nobody is bound to one core.
    let many = allowed(cores + 1);
    assert_eq!(many.len(), cores + 1, "{many:?}");
    if cores > 1 {
        assert!(
            many.iter().all(|c| c.parse::<usize>().is_err()),
            "unbound when there are more workers than cores: {many:?}"
        );
    }
}

/// A worker that prints its torchrun variables, and fails (exit 3) as
/// rank 1 on the first attempt.
const FLAKY: &str = r#"echo "env rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE local_world=$LOCAL_WORLD_SIZE group=$GROUP_RANK attempt=$TORCHELASTIC_RESTART_COUNT max=$TORCHELASTIC_MAX_RESTARTS master=$MASTER_ADDR:$MASTER_PORT"
if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then echo "rank 1 crashing"; echo '{"message": "boom from rank 1"}' > "$TORCHELASTIC_ERROR_FILE"; exit 3; fi
sleep 0.2"#;

#[test]
fn a_crash_restarts_the_group_when_restarts_remain() {
    let out = finish(
        consort(&[
            "run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "1",
            "--",
            "sh",
            "-c",
            FLAKY,
        ]),
        "consort run",
    );
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for rank in 0..3 {
        assert!(
            stdout.contains(&format!(
                "[rank{rank}]: env rank={rank} local={rank} world=3 local_world=3 group=0 attempt=1 max=1 master=127.0.0.1:"
            )),
            "rank {rank} did not run a second attempt: {stdout}"
        );
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 1 failed (exit code 3); restarting the group (attempt 1 of 1)"),
        "{stderr}"
    );
}

#[test]
fn a_crash_without_restarts_passes_the_exit_code_through() {
    let dir = std::env::temp_dir().join(format!("consort-launcher-logs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = finish(
        consort(&[
            "run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "--log-dir",
            dir.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            FLAKY,
        ]),
        "consort run",
    );
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 1 failed with exit code 3 after 0 restart(s)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rank 1 crashing"),
        "the summary should quote the last output: {stderr}"
    );
    assert!(
        stderr.contains(r#"error.json: {"message": "boom from rank 1"}"#),
        "the summary should quote TORCHELASTIC_ERROR_FILE: {stderr}"
    );
    let log = std::fs::read_to_string(dir.join("attempt_0/1/stdout.log")).unwrap();
    assert!(log.contains("rank 1 crashing"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A reused `--log-dir` where a worker's log is now a link (a worker of
/// the last job, or anyone who could write there, planted it): the new
/// log replaces the link, and its target keeps what it held.
#[test]
fn a_worker_log_is_never_written_through_a_planted_link() {
    let base = std::env::temp_dir().join(format!("consort-launcher-link-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (dir, victim) = (base.join("logs"), base.join("victim"));
    std::fs::create_dir_all(dir.join("attempt_0/0")).unwrap();
    std::fs::write(&victim, "keep").unwrap();
    let log = dir.join("attempt_0/0/stdout.log");
    std::os::unix::fs::symlink(&victim, &log).unwrap();
    let d = dir.to_str().unwrap();
    let out = finish(
        consort(&[
            "run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "--log-dir",
            d,
            "--",
            "sh",
            "-c",
            "echo logged",
        ]),
        "consort run",
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    let meta = std::fs::symlink_metadata(&log).unwrap();
    assert!(meta.file_type().is_file(), "the log is still a link");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "logged\n");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn two_agents_form_one_world() {
    let port = free_port().to_string();
    let node = |rank: &'static str| {
        let mut args = vec![
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
        ];
        args.extend(bench_worker());
        consort(&args)
    };
    let n1 = node("1");
    let n0 = node("0");
    let out0 = finish(n0, "node 0");
    let out1 = finish(n1, "node 1");
    assert!(out0.status.success(), "{out0:?}");
    assert!(out1.status.success(), "{out1:?}");
    let rows = rank0_rows(&out0);
    assert_eq!(rows.len(), 6, "{out0:?}");
    for r in rows {
        assert_eq!(r["world"], 4);
        assert_eq!(r["wrong"], 0, "{r}");
    }
    // Across nodes without a secret, each agent says so, once.
    if std::env::var_os("CONSORT_SECRET").is_none() {
        for out in [&out0, &out1] {
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(err.matches("without CONSORT_SECRET").count(), 1, "{err}");
        }
    }
}

#[test]
fn a_failure_on_one_node_stops_the_other() {
    let port = free_port().to_string();
    let worker = r#"if [ "$RANK" = 3 ]; then sleep 0.3; exit 7; fi; sleep 60"#;
    let node = |rank: &'static str| {
        consort(&[
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--grace-period",
            "1",
            "--",
            "sh",
            "-c",
            worker,
        ])
    };
    let n0 = node("0");
    let n1 = node("1");
    let out0 = finish(n0, "node 0");
    let out1 = finish(n1, "node 1");
    assert_eq!(out1.status.code(), Some(7), "{out1:?}");
    assert_eq!(out0.status.code(), Some(7), "{out0:?}");
    let stderr0 = String::from_utf8_lossy(&out0.stderr);
    assert!(
        stderr0.contains("rank 3 failed on another node"),
        "{stderr0}"
    );
}

#[test]
fn bad_flags_are_refused_with_a_reason() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["run", "--nnodes", "2", "--node-rank", "2", "--", "true"],
            "--node-rank 2 is out of range for --nnodes 2",
        ),
        (
            &["run", "--standalone", "--nnodes", "2", "--", "true"],
            "--standalone means a single node",
        ),
        (
            &["run", "--nproc-per-node", "0", "--", "true"],
            "--nproc-per-node 0: expected 1 to 4096",
        ),
        (
            &[
                "run",
                "--standalone",
                "--",
                "/nonexistent/consort-test-program",
            ],
            "cannot start \"/nonexistent/consort-test-program\"",
        ),
        (&["run", "--standalone"], "required"),
    ];
    for (args, want) in cases {
        let out = finish(consort(args), "consort run");
        assert!(!out.status.success(), "{args:?} should fail");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{args:?}: want {want:?} in {stderr}");
    }
}

/// Runs `consort run --nproc-per-node <spec>` with a worker that prints
/// its LOCAL_RANK and LOCAL_WORLD_SIZE; returns the output and, when it
/// succeeded, the number of workers it started (checked consistent).
fn workers_started(spec: &str, cuda_visible_devices: Option<&str>) -> (Output, Option<usize>) {
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "--standalone", "--nproc-per-node", spec, "--"])
        .args([
            "sh",
            "-c",
            r#"echo "local=$LOCAL_RANK of=$LOCAL_WORLD_SIZE""#,
        ])
        .env("CONSORT_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(v) = cuda_visible_devices {
        cmd.env("CUDA_VISIBLE_DEVICES", v);
    }
    let out = finish(cmd.spawn().expect("start consort"), "consort run");
    if !out.status.success() {
        return (out, None);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut seen: Vec<(usize, usize)> = stdout
        .lines()
        .filter_map(|l| l.split_once("]: local=")?.1.split_once(" of="))
        .map(|(l, n)| (l.parse().unwrap(), n.parse().unwrap()))
        .collect();
    seen.sort_unstable();
    let n = seen.len();
    let want: Vec<(usize, usize)> = (0..n).map(|l| (l, n)).collect();
    assert_eq!(seen, want, "LOCAL_RANK 0..n, LOCAL_WORLD_SIZE n: {stdout}");
    (out, Some(n))
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// The error `--nproc-per-node gpu` gives without a GPU.
fn assert_no_gpu_error(out: &Output) {
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for want in [
        "no CUDA GPU was found",
        "libcuda.so.1",
        "cuDeviceGetCount",
        "CUDA_VISIBLE_DEVICES is",
        "--nproc-per-node cpu",
        "install the NVIDIA driver",
    ] {
        assert!(stderr.contains(want), "want {want:?} in {stderr}");
    }
}

#[test]
fn nproc_per_node_cpu_starts_one_worker_per_cpu() {
    let (out, n) = workers_started("cpu", None);
    assert_eq!(n, Some(cpus()), "{out:?}");
}

#[test]
fn nproc_per_node_auto_starts_one_per_gpu_else_one_per_cpu() {
    let want = gpus::cuda_device_count().unwrap_or_else(|why| {
        eprintln!("no GPU here ({why}): auto means one worker per CPU");
        cpus()
    });
    let (out, n) = workers_started("auto", None);
    assert_eq!(n, Some(want), "{out:?}");
}

#[test]
fn nproc_per_node_gpu_starts_one_per_gpu_or_says_there_is_none() {
    let (out, n) = workers_started("gpu", None);
    match gpus::cuda_device_count() {
        Ok(gpus) => assert_eq!(n, Some(gpus), "{out:?}"),
        Err(why) => {
            eprintln!("no GPU here ({why}): checking the error instead");
            assert_no_gpu_error(&out);
        }
    }
    // An empty CUDA_VISIBLE_DEVICES hides every GPU, on any machine.
    let (out, _) = workers_started("gpu", Some(""));
    assert_no_gpu_error(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("CUDA_VISIBLE_DEVICES is \"\""), "{stderr}");
}

#[test]
fn nproc_per_node_bogus_names_the_accepted_forms() {
    let (out, _) = workers_started("bogus", None);
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for want in ["'bogus'", "a number of workers", "gpu", "auto", "cpu"] {
        assert!(stderr.contains(want), "want {want:?} in {stderr}");
    }
}

#[test]
fn a_port_in_use_is_named() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    for args in [
        vec!["run", "--master-port", &port, "--", "true"],
        vec!["store", "--port", &port],
    ] {
        let out = finish(consort(&args), "consort");
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&port) && stderr.contains("in use"),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn an_unreachable_master_fails_after_the_rendezvous_timeout() {
    let port = free_port().to_string();
    let out = finish(
        consort(&[
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            &port,
            "--rdzv-timeout",
            "1",
            "--",
            "true",
        ]),
        "consort run",
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot reach the agent store") && stderr.contains(&port),
        "{stderr}"
    );
}

/// Sends `signal` (TERM or INT) to the agent once both workers have
/// trapped it, and checks that each worker got that same signal.
fn signal_reaches_every_worker(signal: &str, agent_says: &str) {
    let worker = format!(
        r#"trap 'echo "rank $RANK got SIG{signal}"; exit 0' {signal}; echo ready; sleep 60 & wait"#
    );
    let mut child = consort(&[
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        &worker,
    ]);
    // Read the agent's stdout as it comes, and signal only once both
    // workers have installed their traps.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    while seen
        .iter()
        .filter(|l: &&String| l.ends_with(": ready"))
        .count()
        < 2
    {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => seen.push(line),
            Err(e) => {
                let _ = child.kill();
                panic!("workers never became ready ({e}): {seen:?}");
            }
        }
    }
    let pid = child.id().to_string();
    let killed = Command::new("kill")
        .args([format!("-{signal}"), pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = finish(child, "consort run");
    reader.join().unwrap();
    seen.extend(rx.try_iter());
    assert!(!out.status.success(), "{out:?}");
    for rank in 0..2 {
        let want = format!("[rank{rank}]: rank {rank} got SIG{signal}");
        assert!(seen.contains(&want), "{seen:?}");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(agent_says), "{stderr}");
}

#[test]
fn sigterm_reaches_every_worker() {
    signal_reaches_every_worker("TERM", "terminated (SIGTERM)");
}

/// Ctrl-C: the agent forwards SIGINT itself (a Python worker sees
/// KeyboardInterrupt), not SIGTERM.
#[test]
fn sigint_reaches_every_worker_as_sigint() {
    signal_reaches_every_worker("INT", "interrupted (SIGINT)");
}

/// The mismatch self-test that `scripts/gpu-check` runs on NCCL, here on
/// TCP and on the emulated device: every rank reports `Mismatch`, and each
/// message names both calls (rank 0's five elements against the others'
/// four). On the emulated device a third rank may hear a peer's abort
/// before its own check's verdict: the abort carries the verdict.
#[test]
fn mismatch_check_reports_mismatch_on_every_rank_naming_both_calls() {
    for backend in ["tcp", "emulated"] {
        let text = mismatch_check(backend, &[]);
        for r in 0..3 {
            let line = text
                .lines()
                .find(|l| l.contains(&format!("MISMATCH rank {r} after")))
                .unwrap_or_else(|| panic!("{backend}: no verdict from rank {r}: {text}"));
            assert!(
                line.contains("5 x float32") && line.contains("4 x float32"),
                "{backend}: rank {r} does not name both calls: {line}"
            );
        }
    }
}

/// `mismatch-check --case cancelled`, which `scripts/gpu-check` runs on
/// NCCL: rank 0 drops its all_reduce before awaiting it.
/// - TCP runs a call when its work is polled, so rank 0's never runs: its
///   next call says so, and every peer waiting in that all_reduce fails
///   naming rank 0's cancelled call instead of waiting out CONSORT_TIMEOUT
///   (60 s here).
/// - The emulated device, as NCCL, enqueues every call when it is made:
///   the dropped call runs to its end, every peer gets the full sum, and
///   the group goes on.
#[test]
fn a_call_dropped_on_one_rank_is_named_on_every_peer_or_runs_everywhere() {
    let text = mismatch_check("tcp", &["--case", "cancelled"]);
    assert!(text.contains("CANCELLED rank 0:"), "{text}");
    for r in 1..3 {
        assert!(
            text.contains(&format!("TOLD rank {r} after")),
            "rank {r} did not hear why: {text}"
        );
    }
    let text = mismatch_check("emulated", &["--case", "cancelled"]);
    assert!(text.contains("RAN rank 0:"), "{text}");
    for r in 1..3 {
        assert!(
            text.contains(&format!("RAN rank {r} after")) && text.contains("sum 3"),
            "rank {r}: {text}"
        );
    }
}

/// `consort mismatch-check --backend B EXTRA` on 3 ranks under `consort
/// run` (CONSORT_TIMEOUT 60 s): its output, once it has succeeded.
fn mismatch_check(backend: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--",
        BIN,
        "mismatch-check",
        "--backend",
        backend,
    ];
    args.extend_from_slice(extra);
    let child = consort_env(&args, &[("CONSORT_TIMEOUT", "60")]);
    let out = finish(
        child,
        &format!("consort run -- consort mismatch-check {extra:?}"),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{backend} {extra:?}: {text}");
    text
}

/// The bounded-init self-test that `scripts/gpu-check` runs on NCCL, here
/// on TCP: rank 1 joins the store but never builds its backend, and rank 0
/// gets an init error naming the missing rank within CONSORT_TIMEOUT
/// (before, the mesh waited its own 5 minutes whatever the timeout), so
/// the launcher ends the job.
#[test]
fn an_init_with_an_absent_peer_fails_within_consort_timeout() {
    // And on the emulated device, whose communicator is made over a mesh
    // that waits for the absent rank as NCCL's init does.
    for backend in ["tcp", "emulated"] {
        let mut cmd = std::process::Command::new(BIN);
        cmd.args([
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--",
            BIN,
            "init-check",
            "--backend",
            backend,
            "--absent",
            "1",
        ])
        .env("CONSORT_TIMEOUT", "3")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        let out = finish(cmd.spawn().unwrap(), "consort run -- consort init-check");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{backend}: {text}");
        let line = text
            .lines()
            .find(|l| l.contains("INIT FAILED rank 0 after"))
            .unwrap_or_else(|| panic!("{backend}: rank 0 gave no verdict: {text}"));
        // The job ends by itself (finish allows 120 s; the mesh used to
        // wait its own 300 s whatever CONSORT_TIMEOUT said).
        assert!(line.contains("missing ranks [1]"), "{backend}: {line}");
    }
}
