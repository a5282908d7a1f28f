//! The flight recorder, in real processes under `consort run`: a rank
//! that skips a collective is named with the call it never entered, in
//! the launcher's summary and by `consort debug flight`; SIGUSR1 makes a
//! worker write its record while the job runs.
//!
//! Needs the `skip` example, which `cargo test --workspace` builds.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use consort::flight::{Dump, State};

mod support;

fn consort_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_consort"))
}

fn skip_bin() -> PathBuf {
    support::example_bin("skip")
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("consort-flight-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn the_rank_that_skipped_a_collective_is_named_with_its_seq() {
    let logs = scratch("skip");
    let out = Command::new(consort_bin())
        .args(["run", "--standalone", "--nproc-per-node", "3", "--log-dir"])
        .arg(&logs)
        .arg("--")
        .arg(skip_bin())
        .args(["--rank", "2", "--at", "3", "--stall", "60"])
        .env("CONSORT_TIMEOUT", "2")
        .output()
        .expect("consort run");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the job should fail: {text}");
    let verdict = "rank 2 (last entered seq 2) never entered all_reduce seq 3 (world); ranks 0 \
                   and 1 waited in it for";
    assert!(text.contains(verdict), "{text}");
    let dir = logs.join("attempt_0").join("flight");
    let debug = Command::new(consort_bin())
        .args(["debug", "flight"])
        .arg(&dir)
        .output()
        .expect("consort debug flight");
    let said = String::from_utf8_lossy(&debug.stdout);
    assert!(
        debug.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&debug.stderr)
    );
    assert!(
        said.contains("3 flight record(s) from rank(s) [0, 1, 2] of 3"),
        "{said}"
    );
    assert!(said.contains(verdict), "{said}");
    assert!(said.contains("first failure: rank"), "{said}");
    // Every rank's record: rank 2 stopped after seq 2; the others were in
    // seq 3 (a rank whose peer's abort came first may be stopped by the
    // launcher before its own call fails), and one of them timed out.
    let mut timed_out = 0;
    for r in 0..3 {
        let d =
            Dump::from_json(&std::fs::read(dir.join(format!("rank-{r}.json"))).unwrap()).unwrap();
        let last = d.entries.last().expect("entries");
        if r == 2 {
            assert_eq!((last.seq, last.state), (2, State::Done), "{d:?}");
        } else {
            assert_eq!(last.seq, 3, "{d:?}");
            assert_ne!(last.state, State::Done, "{d:?}");
            timed_out += usize::from(last.error.as_deref().unwrap_or("").contains("timed out"));
        }
        assert!(
            d.entries
                .iter()
                .all(|e| e.op == "all_reduce" && e.count == 1024)
        );
    }
    assert!(timed_out >= 1, "no rank recorded its timeout");
    std::fs::remove_dir_all(logs).unwrap();
}

#[test]
fn sigusr1_makes_a_running_worker_write_its_record() {
    let logs = scratch("usr1");
    let mut job = Command::new(consort_bin())
        .args(["run", "--standalone", "--nproc-per-node", "2", "--log-dir"])
        .arg(&logs)
        .arg("--")
        .arg(skip_bin())
        .args(["--rank", "1", "--at", "2", "--stall", "60"])
        .env("CONSORT_TIMEOUT", "120")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("consort run");
    // "[rank0]: rank 0: pid N"
    let mut pid = None;
    let lines = BufReader::new(job.stderr.take().unwrap()).lines();
    for line in lines.map_while(Result::ok) {
        if let Some(p) = line.strip_prefix("[rank0]: rank 0: pid ") {
            pid = p.trim().parse::<i32>().ok();
            break;
        }
    }
    let pid = pid.expect("rank 0 printed its pid");
    let file = logs.join("attempt_0").join("flight").join("rank-0.json");
    let start = Instant::now();
    let mut record = None;
    while start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: kill(2) with a pid we were told and a valid signal.
        unsafe { libc::kill(pid, libc::SIGUSR1) };
        let Ok(bytes) = std::fs::read(&file) else {
            continue;
        };
        let d = Dump::from_json(&bytes).unwrap();
        // Rank 0 waits in seq 2 (rank 1 stalls instead of making it).
        if d.entries.last().is_some_and(|e| e.seq == 2) {
            record = Some(d);
            break;
        }
    }
    // SIGTERM: the launcher forwards it and stops every worker.
    // SAFETY: kill(2) on our own child with a valid signal.
    unsafe { libc::kill(job.id() as i32, libc::SIGTERM) };
    let _ = job.wait();
    let d = record.expect("rank 0 wrote its record on SIGUSR1, waiting in seq 2");
    assert_eq!(d.reason, "SIGUSR1");
    let last = d.entries.last().unwrap();
    assert!(
        matches!(last.state, State::Issued | State::Started),
        "{last:?}"
    );
    assert_eq!(d.entries.len(), 3, "{d:?}");
    let _ = std::fs::remove_dir_all(logs);
}

/// A hung job on the stream-ordered driver (the emulated device, which
/// runs NCCL's driver) and on a Gloo group: `consort run --watchdog-timeout`
/// stops it, every rank leaves its record (SIGUSR1, or the hung rank's
/// own), and the summary names the rank that is behind with the call it
/// never entered.
#[test]
fn a_hung_job_on_every_driver_leaves_records_naming_the_rank_behind() {
    for backend in ["emulated", "gloo"] {
        let logs = scratch(&format!("hung-{backend}"));
        let out = Command::new(consort_bin())
            .args(["run", "--standalone", "--nproc-per-node", "3"])
            .args(["--watchdog-timeout", "3", "--log-dir"])
            .arg(&logs)
            .arg("--")
            .arg(skip_bin())
            .args([
                "--rank",
                "2",
                "--at",
                "3",
                "--stall",
                "60",
                "--backend",
                backend,
            ])
            .env("CONSORT_TIMEOUT", "120")
            .output()
            .expect("consort run");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{backend}: the job should fail: {text}"
        );
        assert!(
            text.contains("a hang (the watchdog stopped it)"),
            "{backend}: {text}"
        );
        let verdict = "rank 2 (last entered seq 2) never entered all_reduce seq 3 (world); \
                       ranks 0 and 1 waited in it for";
        assert!(text.contains(verdict), "{backend}: {text}");
        let dir = logs.join("attempt_0").join("flight");
        for r in 0..3 {
            let d = Dump::from_json(&std::fs::read(dir.join(format!("rank-{r}.json"))).unwrap())
                .unwrap();
            let last = d.entries.last().expect("entries");
            if r == 2 {
                assert_eq!((last.seq, last.state), (2, State::Done), "{backend}: {d:?}");
            } else {
                assert_eq!(
                    (last.seq, last.state),
                    (3, State::Issued),
                    "{backend}: {d:?}"
                );
            }
            assert!(d.entries.iter().all(|e| e.op == "all_reduce"), "{d:?}");
        }
        let _ = std::fs::remove_dir_all(logs);
    }
}
