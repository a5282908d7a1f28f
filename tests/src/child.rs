//! Running a tool as a child process with a deadline: a tool that hangs
//! on bad input is killed and reported, not waited on for ever.

use std::{
    io::Read,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

/// How a child run ended.
#[derive(Debug)]
pub struct Ended {
    /// It exited by itself within the deadline.
    pub by_itself: bool,
    /// Its exit status was success.
    pub ok: bool,
    /// What it wrote to stderr.
    pub stderr: String,
}

/// Runs `cmd` (stdout discarded, stderr captured); kills it after `within`.
pub fn run_within(cmd: &mut Command, within: Duration) -> Ended {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the child");
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("poll the child") {
            let mut stderr = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut stderr);
            }
            return Ended {
                by_itself: true,
                ok: status.success(),
                stderr,
            };
        }
        if start.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            return Ended {
                by_itself: false,
                ok: false,
                stderr: String::new(),
            };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
