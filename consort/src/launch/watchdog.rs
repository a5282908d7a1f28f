//! The agent's watchdog (`consort run --watchdog-timeout SECONDS`): finds
//! a worker that has made no progress for that long and names it, with the
//! call it is in. Progress is read from each worker's heartbeat file
//! (`consort_comm::heartbeat`, kept by the comm layer on every call), which
//! the agent can read even when the worker is stopped or wedged.
//!
//! A worker is watched from its first heartbeat (its comm layer's first
//! group) until its groups are gone; every driver keeps one (the mesh,
//! NCCL and the emulated device, Gloo). Only a stall that holds someone up counts: some
//! watched worker must be waiting in a call.
//!
//! When a rank stops, its peers stop with it (they wait for it in their
//! next collective), so several ranks stall at once. The watchdog names
//! the one that holds the others up: a process the kernel reports as
//! stopped (SIGSTOP) first, then one that is behind (not in a call while
//! others are, or in an earlier call), then the one whose progress stopped
//! first.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use consort_comm::heartbeat::{self, Beat};

/// One worker's progress as last seen.
#[derive(Debug)]
struct Seen {
    progress: Option<u64>,
    since: Instant,
    beat: Option<Beat>,
}

/// The watchdog over one round's local workers.
#[derive(Debug)]
pub(crate) struct Watchdog {
    timeout: Duration,
    files: Vec<PathBuf>,
    seen: Vec<Seen>,
}

/// A hung worker: its local index, and the report.
#[derive(Debug)]
pub(crate) struct Hung {
    pub(crate) local: usize,
    /// The kernel reports it stopped (SIGSTOP).
    pub(crate) stopped: bool,
    pub(crate) report: Vec<String>,
}

/// The state letter of `/proc/PID/stat` (`R`, `S`, `D`, `T` stopped, ...).
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": the comm may hold spaces and parentheses.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Watchdog {
    /// Watches the heartbeat `files` (one per local worker, in local rank
    /// order) for `timeout`.
    pub(crate) fn new(timeout: Duration, files: Vec<PathBuf>) -> Self {
        let now = Instant::now();
        let seen = files
            .iter()
            .map(|_| Seen {
                progress: None,
                since: now,
                beat: None,
            })
            .collect();
        Watchdog {
            timeout,
            files,
            seen,
        }
    }

    /// Reads every live worker's heartbeat; returns the hung one, if a
    /// worker has gone `timeout` without progress. `ranks` and `pids` are
    /// per local worker; `alive` says which still run.
    pub(crate) fn check(&mut self, ranks: &[usize], pids: &[i32], alive: &[bool]) -> Option<Hung> {
        let now = Instant::now();
        for (i, s) in self.seen.iter_mut().enumerate() {
            let beat = heartbeat::read(&self.files[i]);
            let progress = beat.map(|b| b.progress);
            if progress != s.progress {
                s.progress = progress;
                s.since = now;
            }
            s.beat = beat;
        }
        // A worker is watched from its first heartbeat until its groups are
        // gone: one whose comm layer keeps none, or that is done with
        // collectives, is never called hung.
        let watched = |i: usize| alive[i] && self.seen[i].beat.is_some_and(|b| !b.detached);
        let stalled: Vec<usize> = (0..self.seen.len())
            .filter(|&i| watched(i) && now.duration_since(self.seen[i].since) >= self.timeout)
            .collect();
        // A hang holds someone up: with no watched worker waiting in a
        // call, they are all computing (evaluation, a checkpoint), however
        // long that takes.
        let waiting = (0..self.seen.len())
            .any(|i| watched(i) && self.seen[i].beat.is_some_and(|b| b.in_call));
        if stalled.is_empty() || !waiting {
            return None;
        }
        let live: Vec<usize> = (0..self.seen.len()).filter(|&i| alive[i]).collect();
        let stopped = |i: &usize| matches!(proc_state(pids[*i]), Some('T' | 't'));
        // Behind: not in a call, or in an earlier call of the same group,
        // than another stalled worker.
        let key = |i: usize| {
            self.seen[i]
                .beat
                .and_then(|b| b.last.map(|(g, seq, _)| (g, b.in_call, seq)))
        };
        let behind = |i: &usize| {
            key(*i).is_some_and(|(g, in_call, seq)| {
                stalled.iter().any(|&j| {
                    key(j).is_some_and(|(h, j_in, j_seq)| h == g && (j_in, j_seq) > (in_call, seq))
                })
            })
        };
        // A stopped worker holds the others up whether or not its own
        // silence has reached the timeout yet (a peer that waited on it
        // may cross the timeout first).
        let culprit = (0..self.seen.len())
            .filter(|&i| watched(i))
            .find(stopped)
            .or_else(|| stalled.iter().copied().find(behind))
            .or_else(|| stalled.iter().copied().min_by_key(|&i| self.seen[i].since))?;
        let t = now_us();
        let what = |i: usize| match self.seen[i].beat {
            Some(b) => b.describe(t),
            None => "it has not reached its first collective".into(),
        };
        let state = match proc_state(pids[culprit]) {
            Some('T' | 't') => ", stopped (SIGSTOP?)".to_string(),
            Some(c) => format!(", state {c}"),
            None => String::new(),
        };
        let mut report = vec![format!(
            "watchdog: rank {} (pid {}{state}) made no progress for {:.1} s \
             (--watchdog-timeout {}): {}",
            ranks[culprit],
            pids[culprit],
            now.duration_since(self.seen[culprit].since).as_secs_f64(),
            self.timeout.as_secs_f64(),
            what(culprit)
        )];
        for &i in live.iter().filter(|&&i| i != culprit) {
            report.push(format!("watchdog: rank {}: {}", ranks[i], what(i)));
        }
        Some(Hung {
            local: culprit,
            stopped: stopped(&culprit),
            report,
        })
    }
}
