//! A rank whose MASTER_ADDR does not resolve (issue 49): it says so at
//! once, at warn level, naming the host and the lookup error, and fails
//! after a short grace with an error naming MASTER_ADDR, instead of
//! retrying silently for the 300 s store timeout.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::mpsc,
    time::Duration,
};

const HOST: &str = "no-such-host.invalid";

#[test]
fn an_unresolvable_master_addr_is_said_at_once_and_fails_soon() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_consort"))
        .args(["bench", "--from-env", "--world-size", "2"])
        .envs([
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", HOST),
            ("MASTER_PORT", "29555"),
            ("CONSORT_LOG", "warn"),
        ])
        .env_remove("CONSORT_STORE_TIMEOUT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // Hang detection only: the store timeout is 300 s, the grace 10 s.
    let mut lines = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(90)) {
        lines.push(line);
    }
    // Its stderr closed: it is ending (or silent for 90 s).
    let mut ended = None;
    for _ in 0..100 {
        ended = child.try_wait().unwrap();
        if ended.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if ended.is_none() {
        let _ = child.kill();
    }
    let status = child.wait().unwrap();
    assert!(ended.is_some(), "the rank was still retrying: {lines:?}");
    assert!(!status.success(), "{lines:?}");
    // Said first, at warn level, while the rank still retries; then the
    // error that ends it.
    let warn = lines
        .iter()
        .position(|l| l.contains("WARN") && l.contains(HOST));
    let error = lines.iter().position(|l| l.starts_with("error:"));
    let (Some(warn), Some(error)) = (warn, error) else {
        panic!("no warning and error naming {HOST}: {lines:?}");
    };
    assert!(warn < error, "{lines:?}");
    assert!(lines[warn].contains("does not resolve"), "{lines:?}");
    for want in [HOST, "MASTER_ADDR", "does not resolve"] {
        assert!(lines[error].contains(want), "{want}: {lines:?}");
    }
}
