//! The workers as child processes: reaping their exits and naming the
//! cause, the watchdog's check, copying their output, and stopping them.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    process::ExitStatus,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::Child,
};

use super::{exit::Exit, watchdog::Watchdog};

/// The signals the agent forwards to its workers.
pub(super) struct Signals {
    pub(super) int: tokio::signal::unix::Signal,
    pub(super) term: tokio::signal::unix::Signal,
}

/// Collects the workers that have exited since the last look; returns the
/// failed ones.
pub(super) fn reap(
    children: &mut [(usize, Child, i32)],
    done: &mut [bool],
) -> std::io::Result<Vec<Exit>> {
    let mut failed = Vec::new();
    for (i, (rank, child, _)) in children.iter_mut().enumerate() {
        if done[i] {
            continue;
        }
        if let Some(status) = child.try_wait()? {
            done[i] = true;
            if !status.success() {
                failed.push(Exit {
                    rank: *rank,
                    status,
                    tail: Vec::new(),
                    note: None,
                });
            }
        }
    }
    Ok(failed)
}

/// The failure to report among workers that failed together: one killed
/// by a signal (a crash, the OOM killer, a kill) before one that exited
/// with an error (often a peer's loss that the crash caused), then the
/// lowest rank. The others are named in its summary.
pub(super) fn cause(mut failed: Vec<Exit>) -> Option<Exit> {
    use std::os::unix::process::ExitStatusExt;
    failed.sort_by_key(|f| (f.status.signal().is_none(), f.rank));
    let mut it = failed.into_iter();
    let mut first = it.next()?;
    let rest: Vec<String> = it
        .map(|f| format!("rank {} ({})", f.rank, f.describe()))
        .collect();
    if !rest.is_empty() {
        first
            .tail
            .push(format!("also failed after it: {}", rest.join(", ")));
    }
    Some(first)
}

/// Rank `rank`'s heartbeat file, beside the round's flight records.
pub(super) fn beat_file(flight_dir: &Path, rank: usize) -> PathBuf {
    flight_dir
        .parent()
        .unwrap_or(flight_dir)
        .join("heartbeat")
        .join(format!("rank-{rank}"))
}

/// The watchdog's check: a hung worker becomes this round's failure. The
/// other workers are asked for their flight records (SIGUSR1; the hung one
/// may not be able to answer) before the group is stopped.
pub(super) async fn hung(
    w: &mut Watchdog,
    children: &mut [(usize, Child, i32)],
    done: &[bool],
) -> Option<Exit> {
    let ranks: Vec<usize> = children.iter().map(|c| c.0).collect();
    let pids: Vec<i32> = children.iter().map(|c| c.2).collect();
    let alive: Vec<bool> = done.iter().map(|d| !d).collect();
    let h = w.check(&ranks, &pids, &alive)?;
    for (i, &pid) in pids.iter().enumerate() {
        // A stopped worker cannot answer (the signal would wait for it).
        if alive[i] && pid > 0 && !(i == h.local && h.stopped) {
            // SAFETY: kill(2) on our own worker with a valid signal.
            unsafe { libc::kill(pid, libc::SIGUSR1) };
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    use std::os::unix::process::ExitStatusExt;
    Some(Exit {
        rank: ranks[h.local],
        status: ExitStatus::from_raw(libc::SIGKILL),
        note: Some("a hang (the watchdog stopped it)".into()),
        tail: h.report,
    })
}

/// Copies one worker stream to ours, line by line with `[rankN]: `, keeps
/// its last lines, and tees it to a log file.
pub(super) async fn pump<R: tokio::io::AsyncRead + Unpin>(
    stream: R,
    to_stderr: bool,
    rank: usize,
    tail: Arc<Mutex<VecDeque<String>>>,
    log: Option<PathBuf>,
) {
    use std::io::Write;
    let mut file = log.and_then(|path| std::fs::File::create(path).ok());
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let text = format!("[rank{rank}]: {line}\n");
        // One write per line, under the stream's lock, so ranks' lines
        // never interleave mid-line.
        let _ = if to_stderr {
            std::io::stderr().lock().write_all(text.as_bytes())
        } else {
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes()).and_then(|()| out.flush())
        };
        if let Some(f) = file.as_mut() {
            let _ = writeln!(f, "{line}");
        }
        let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
        t.push_back(line);
        if t.len() > TAIL_LINES {
            t.pop_front();
        }
    }
}

/// Lines of a failed worker's output repeated in the summary.
const TAIL_LINES: usize = 20;

/// Stops the group: `signal` (SIGTERM, or the SIGINT the agent got) to
/// every worker's process group, then SIGKILL to whatever is left of them
/// after the grace period. Also used after a clean round, so nothing a
/// worker started outlives it (as torchrun closes its process contexts).
pub(super) async fn stop(children: &mut [(usize, Child, i32)], grace: f64, signal: libc::c_int) {
    let alive = |pgid: i32| {
        // SAFETY: signal 0 only checks that the group `pgid` (a worker we
        // started as a group leader, `process_group(0)`) has a member.
        pgid > 1 && unsafe { libc::kill(-pgid, 0) == 0 }
    };
    // A pgid of 0 would mean "our own group": never signal that.
    for (_, _, pgid) in children.iter().filter(|(_, _, g)| *g > 1) {
        // SAFETY: as above; sends `signal` to that group.
        unsafe { libc::kill(-*pgid, signal) };
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(grace.max(0.0));
    for (_, c, _) in children.iter_mut() {
        let _ = tokio::time::timeout_at(deadline, c.wait()).await;
    }
    while children.iter().any(|(_, _, g)| alive(*g)) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (_, c, pgid) in children.iter_mut() {
        if alive(*pgid) {
            // SAFETY: as above.
            unsafe { libc::kill(-*pgid, libc::SIGKILL) };
        }
        let _ = c.kill().await;
    }
}
