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
    for (i, (rank, child, pgid)) in children.iter_mut().enumerate() {
        if done[i] {
            continue;
        }
        if let Some(status) = child.try_wait()? {
            done[i] = true;
            // What the worker left running in its group goes with it, now:
            // while any of it lives the group's id cannot be reused, and
            // once the group is empty it is never signalled again.
            if *pgid > 1 {
                // SAFETY: kill(2) on the group of a worker we started as a
                // group leader, which still has members if this succeeds.
                unsafe { libc::kill(-*pgid, libc::SIGKILL) };
            }
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
    // Created new, never through a link planted where the log goes.
    let mut file = log.and_then(|path| match consort_comm::files::create_new(&path) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!("rank {rank}: cannot write the log {}: {e}", path.display());
            None
        }
    });
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
        let mut t = consort_comm::lock(&tail);
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
///
/// Only the groups of workers not yet reaped are signalled: an unreaped
/// leader (running, or a zombie) holds its pid, so its group's id cannot
/// belong to anyone else; the id of a worker reaped earlier may have been
/// reused by an unrelated process since.
pub(super) async fn stop(children: &mut [(usize, Child, i32)], grace: f64, signal: libc::c_int) {
    // tokio's Child has an id until it is reaped.
    let live: Vec<i32> = children
        .iter()
        .filter(|(_, c, g)| *g > 1 && c.id().is_some())
        .map(|(_, _, g)| *g)
        .collect();
    let alive = |pgid: i32| {
        // SAFETY: signal 0 only checks that the group `pgid` (a worker we
        // started as a group leader, `process_group(0)`) has a member.
        unsafe { libc::kill(-pgid, 0) == 0 }
    };
    for &pgid in &live {
        // SAFETY: as above; sends `signal` to that group.
        unsafe { libc::kill(-pgid, signal) };
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(grace.max(0.0));
    for (_, c, _) in children.iter_mut() {
        let _ = tokio::time::timeout_at(deadline, c.wait()).await;
    }
    while live.iter().any(|&g| alive(g)) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for &pgid in &live {
        if alive(pgid) {
            // SAFETY: as above.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
    }
    for (_, c, _) in children.iter_mut() {
        let _ = c.kill().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group_leader(script: &str) -> (Child, i32) {
        let c = tokio::process::Command::new("sh")
            .args(["-c", script])
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = c.id().unwrap() as i32;
        (c, pid)
    }

    /// A live worker's group is stopped; the group of a worker reaped
    /// earlier (not through `reap`) is never signalled (its id may be
    /// someone else's by now), shown by a process left in that group,
    /// which stop() leaves alone.
    #[tokio::test]
    async fn only_the_groups_of_unreaped_workers_are_signalled() {
        let (mut gone, gone_pgid) = group_leader("sleep 30 & exit 0");
        gone.wait().await.unwrap(); // reaped: its group now holds only the sleep
        // SAFETY: signal 0 only checks for members.
        let in_group = unsafe { libc::kill(-gone_pgid, 0) } == 0;
        assert!(in_group, "the sleep is in the group");
        let (live, live_pgid) = group_leader("sleep 30");
        let mut children = vec![(0, gone, gone_pgid), (1, live, live_pgid)];
        stop(&mut children, 2.0, libc::SIGTERM).await;
        // SAFETY: signal 0 only checks for members.
        let live_left = unsafe { libc::kill(-live_pgid, 0) } == 0;
        // SAFETY: as above.
        let reaped_left = unsafe { libc::kill(-gone_pgid, 0) } == 0;
        // Clean up the sleep that was (rightly) not ours to signal any more.
        // SAFETY: our own test's group, which still has the sleep in it.
        unsafe { libc::kill(-gone_pgid, libc::SIGKILL) };
        assert!(!live_left, "a live worker's group was not stopped");
        assert!(
            reaped_left,
            "the group of a worker reaped earlier was signalled"
        );
    }

    /// `reap` takes what an exited worker left running in its group with
    /// it, at once (the group's id cannot have been reused while it lives).
    #[tokio::test]
    async fn reaping_a_worker_stops_what_it_left_in_its_group() {
        let (child, pgid) = group_leader("sleep 30 & exit 0");
        let mut children = vec![(0, child, pgid)];
        let mut done = vec![false];
        for _ in 0..200 {
            reap(&mut children, &mut done).unwrap();
            if done[0] {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(done[0], "the worker never exited");
        let mut left = true;
        for _ in 0..200 {
            // SAFETY: signal 0 only checks for members.
            left = unsafe { libc::kill(-pgid, 0) } == 0;
            if !left {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!left, "the sleep the worker left behind survived");
    }
}
