//! One round: this node's workers started with torchrun's variables, their
//! output prefixed with the rank, and watched until they all exit or one
//! fails (here, hung under the watchdog, or on another node).

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use consort_comm::store::Store;
use tokio::{
    process::{Child, Command},
    task::JoinHandle,
};

use super::{
    LaunchError, LaunchSpec,
    exit::Exit,
    records,
    rendezvous::{Membership, waiting},
    watchdog::Watchdog,
    workers::{Signals, beat_file, cause, hung, pump, reap, stop},
};

/// How a round ended.
#[derive(Debug)]
pub(super) enum RoundEnd {
    /// Every worker exited 0.
    Done,
    /// A worker failed (here or on another node), or hung.
    Failed(Exit),
    /// A node waits to join (elastic): the group restarts with it.
    NewMember,
}

/// The last lines of one worker's output.
type Tail = Arc<Mutex<VecDeque<String>>>;

/// One round's workers on this node.
struct Round {
    /// (rank, process, pid) per local worker.
    children: Vec<(usize, Child, i32)>,
    tails: Vec<Tail>,
    pumps: Vec<JoinHandle<()>>,
    error_files: Vec<PathBuf>,
    flight_dir: PathBuf,
}

/// What one round's workers are told, beside their rank.
struct RoundEnv<'a> {
    m: &'a Membership,
    restart: u32,
    attempt: PathBuf,
    flight_dir: PathBuf,
}

/// The longest the monitor loop waits on the agent store per request: a
/// wedged store host must not hold up reaping workers or handling signals
/// (the client's own deadline is minutes). A request cut short retires its
/// connection; the next one opens a fresh one.
const MONITOR_STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// A store request of the monitor loop, bounded by
/// [`MONITOR_STORE_TIMEOUT`]; `None` when it failed or took longer.
async fn quick<T>(f: impl Future<Output = consort_comm::StoreResult<T>>) -> Option<T> {
    tokio::time::timeout(MONITOR_STORE_TIMEOUT, f)
        .await
        .ok()?
        .ok()
}

/// How long a failed round waits for the running workers' flight records.
const RECORD_GRACE: Duration = Duration::from_millis(500);

/// Starts this node's workers for one round and watches them. Returns the
/// first failure (here or, through the store, on another node), or `None`
/// when every local worker exited 0.
pub(super) async fn run_round(
    a: &LaunchSpec,
    m: &Membership,
    store: &Arc<dyn Store>,
    ns: &str,
    key: &str,
    (restart, run_dir): (u32, &Path),
    signals: &mut Signals,
) -> Result<RoundEnd, LaunchError> {
    let attempt = run_dir.join(format!("attempt_{restart}"));
    // Where the workers' flight records go when the job fails.
    let flight_dir = attempt.join("flight");
    // A reused --log-dir: no record or heartbeat of an earlier job counts.
    let _ = std::fs::remove_dir_all(&flight_dir);
    let _ = std::fs::remove_dir_all(attempt.join("heartbeat"));
    let env = RoundEnv {
        m,
        restart,
        attempt,
        flight_dir: flight_dir.clone(),
    };
    let mut r = Round {
        children: Vec::new(),
        tails: Vec::new(),
        pumps: Vec::new(),
        error_files: Vec::new(),
        flight_dir,
    };
    for local in 0..a.local_world_size {
        r.spawn(a, &env, local)?;
    }
    let newcomers =
        (a.min_nodes != a.max_nodes && m.nnodes < a.max_nodes).then_some((ns, restart + 1));
    let end = r.watch(a, store, key, newcomers, signals).await?;
    if matches!(end, RoundEnd::Failed(_)) {
        r.await_records().await;
    }
    // After a failure this stops the survivors; after a clean round it
    // only clears what the workers left running in their groups.
    stop(&mut r.children, a.grace_period, libc::SIGTERM).await;
    // The pipes close when the workers (and what they started) are gone;
    // don't wait forever on a grandchild that escaped its process group.
    for p in std::mem::take(&mut r.pumps) {
        let _ = tokio::time::timeout(Duration::from_secs(5), p).await;
    }
    Ok(match end {
        RoundEnd::Failed(f) => RoundEnd::Failed(r.report(m, f)),
        other => other,
    })
}

impl Round {
    /// Starts local worker `local`.
    fn spawn(
        &mut self,
        a: &LaunchSpec,
        env: &RoundEnv<'_>,
        local: usize,
    ) -> Result<(), LaunchError> {
        let m = env.m;
        let rank = m.rank_offset + local;
        // Per-rank directory: log files (with --log-dir) and the error
        // file torch's @record writes (TORCHELASTIC_ERROR_FILE).
        let dir = env.attempt.join(rank.to_string());
        std::fs::create_dir_all(&dir).map_err(|e| {
            LaunchError::Io(std::io::Error::new(
                e.kind(),
                format!("cannot create the log directory {}: {e}", dir.display()),
            ))
        })?;
        let error_file = dir.join("error.json");
        let _ = std::fs::remove_file(&error_file);
        let mut cmd = Command::new(&a.program[0]);
        cmd.args(&a.program[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("GROUP_RANK", m.node_rank.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_NAME", "default")
            .env("WORLD_SIZE", m.world.to_string())
            .env("LOCAL_WORLD_SIZE", a.local_world_size.to_string())
            .env("GROUP_WORLD_SIZE", m.nnodes.to_string())
            .env("ROLE_WORLD_SIZE", m.world.to_string())
            .env("MASTER_ADDR", &a.master_addr)
            .env("MASTER_PORT", a.master_port.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", env.restart.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", a.max_restarts.to_string())
            .env("TORCHELASTIC_RUN_ID", &a.rdzv_id)
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .envs(a.secret.as_ref().map(|s| ("CONSORT_SECRET", s)))
            .env("TORCHELASTIC_ERROR_FILE", &error_file)
            .env("CONSORT_FLIGHT_DIR", &env.flight_dir)
            .envs(
                a.watchdog_timeout
                    .map(|_| ("CONSORT_HEARTBEAT_FILE", beat_file(&env.flight_dir, rank))),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so stopping a worker stops what it
            // started too (a shell's children hold its pipes open).
            .process_group(0)
            .kill_on_drop(true);
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            cmd.env("OMP_NUM_THREADS", "1");
        }
        let core = if a.bind_to_core {
            super::cpus::cores_for(a.local_world_size).map(|c| c[local])
        } else {
            None
        };
        // SAFETY: prctl and sched_setaffinity are async-signal-safe, and
        // this runs in the child between fork and exec. A worker dies with
        // its agent (SIGKILL when the agent's thread that started it ends),
        // as a node that is lost loses its workers, instead of living on
        // orphaned.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(core) = core {
                    super::cpus::bind_self_to(core)?;
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            program: a.program[0].clone(),
            source,
        })?;
        let tail = Tail::default();
        let logs = a.log_dir.is_some().then_some(dir);
        let log = |name: &str| logs.as_ref().map(|d| d.join(name));
        if let Some(out) = child.stdout.take() {
            let p = pump(out, false, rank, tail.clone(), log("stdout.log"));
            self.pumps.push(tokio::spawn(p));
        }
        if let Some(err) = child.stderr.take() {
            let p = pump(err, true, rank, tail.clone(), log("stderr.log"));
            self.pumps.push(tokio::spawn(p));
        }
        let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        self.children.push((rank, child, pid));
        self.tails.push(tail);
        self.error_files.push(error_file);
        Ok(())
    }

    /// Watches the workers until they all exit 0 (`None`) or one fails:
    /// here, hung under the watchdog, or on another node (`failed_key` in
    /// the store). SIGINT and SIGTERM are forwarded and end the job.
    async fn watch(
        &mut self,
        a: &LaunchSpec,
        store: &Arc<dyn Store>,
        key: &str,
        newcomers: Option<(&str, u32)>,
        signals: &mut Signals,
    ) -> Result<RoundEnd, LaunchError> {
        let interval = Duration::from_secs_f64(a.monitor_interval);
        let failed_key = format!("{key}/failed");
        // Set when a node ends the round for a newcomer: the failures its
        // stopped workers cause elsewhere are not failures.
        let end_key = format!("{key}/end");
        let mut done = vec![false; self.children.len()];
        let mut watchdog = a.watchdog_timeout.map(|t| {
            let files = self
                .children
                .iter()
                .map(|(rank, _, _)| beat_file(&self.flight_dir, *rank))
                .collect();
            Watchdog::new(Duration::from_secs_f64(t), files)
        });
        loop {
            let mut failed = reap(&mut self.children, &mut done)?;
            if !failed.is_empty() {
                // The peers of a crashed worker fail within milliseconds of
                // it; let their exits land, then name the cause.
                tokio::time::sleep(Duration::from_millis(100)).await;
                failed.extend(reap(&mut self.children, &mut done)?);
            }
            let mut failure = cause(failed);
            if failure.is_none()
                && let Some(w) = &mut watchdog
            {
                failure = hung(w, &mut self.children, &done).await;
            }
            if let Some(f) = failure {
                if quick(store.check(&[&end_key])).await.unwrap_or(false) {
                    return Ok(RoundEnd::NewMember);
                }
                // The first cause stays: a later node's PeerLost does not
                // replace it.
                let cause = format!("{} {}", f.rank, f.code());
                let _ = quick(store.compare_set(&failed_key, b"", cause.as_bytes())).await;
                return Ok(RoundEnd::Failed(f));
            }
            if done.iter().all(|d| *d) {
                return Ok(RoundEnd::Done);
            }
            // Another node's failure stops this node's workers too.
            if quick(store.check(&[&end_key])).await.unwrap_or(false) {
                return Ok(RoundEnd::NewMember);
            }
            if let Some(f) = elsewhere(store, &failed_key).await {
                return Ok(RoundEnd::Failed(f));
            }
            if let Some((ns, next)) = newcomers
                && quick(async { Ok(waiting(&**store, ns, next).await) })
                    .await
                    .unwrap_or(false)
            {
                let _ = quick(store.compare_set(&end_key, b"", b"new member")).await;
                return Ok(RoundEnd::NewMember);
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = signals.int.recv() => {
                    stop(&mut self.children, a.grace_period, libc::SIGINT).await;
                    return Err(LaunchError::Interrupted(
                        "interrupted (SIGINT): forwarded it to every worker and stopped them".into(),
                    ));
                }
                _ = signals.term.recv() => {
                    stop(&mut self.children, a.grace_period, libc::SIGTERM).await;
                    return Err(LaunchError::Interrupted(
                        "terminated (SIGTERM): forwarded it to every worker and stopped them".into(),
                    ));
                }
            }
        }
    }

    /// Gives the workers still running a moment to write the flight record
    /// that a peer's abort makes them write, before they are stopped: up
    /// to [`RECORD_GRACE`], until each has a record or has exited.
    async fn await_records(&mut self) {
        let deadline = tokio::time::Instant::now() + RECORD_GRACE;
        loop {
            let flight = &self.flight_dir;
            let waiting = self.children.iter_mut().any(|(rank, c, _)| {
                matches!(c.try_wait(), Ok(None))
                    && !flight.join(format!("rank-{rank}.json")).exists()
            });
            if !waiting || tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The failure with what the agent knows of it: the worker's last
    /// output (when it ran here), its error file, and the verdict on the
    /// flight records.
    fn report(&self, m: &Membership, mut f: Exit) -> Exit {
        if let Some(local) = f
            .rank
            .checked_sub(m.rank_offset)
            .filter(|l| *l < self.children.len())
        {
            let found = std::mem::take(&mut f.tail);
            f.tail = self.tails[local]
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect();
            f.tail.extend(found);
            let file = &self.error_files[local];
            if let Ok(bytes) = consort_comm::files::read_regular(file, 1 << 20) {
                let text: String = String::from_utf8_lossy(&bytes).chars().take(4000).collect();
                f.tail
                    .push(format!("error file {}: {text}", file.display()));
            }
        }
        if let Ok(lines) = records::verdict(&self.flight_dir) {
            f.tail.push(format!(
                "flight records in {} (`consort debug flight` reads them):",
                self.flight_dir.display()
            ));
            f.tail
                .extend(lines.into_iter().skip(1).map(|l| format!("  {l}")));
        }
        f
    }
}

/// Another node's failure, as its agent left it in the store.
async fn elsewhere(store: &Arc<dyn Store>, failed_key: &str) -> Option<Exit> {
    if !quick(store.check(&[failed_key])).await.unwrap_or(false) {
        return None;
    }
    let who = quick(store.get(failed_key)).await.unwrap_or_default();
    let who = String::from_utf8_lossy(&who).into_owned();
    let mut parts = who.split(' ').map(|p| p.parse::<i64>().ok());
    let rank = parts.next().flatten().unwrap_or(-1);
    let code = parts.next().flatten().unwrap_or(1).clamp(1, 255) as i32;
    use std::os::unix::process::ExitStatusExt;
    Some(Exit {
        rank: usize::try_from(rank).unwrap_or(usize::MAX),
        status: ExitStatus::from_raw(code << 8),
        tail: vec![format!(
            "(rank {rank} failed on another node; its output is in that node's log)"
        )],
        note: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that never answers holds the monitor loop for at most
    /// MONITOR_STORE_TIMEOUT per request (on tokio's paused clock).
    #[tokio::test(start_paused = true)]
    async fn a_wedged_store_costs_the_monitor_loop_a_bounded_wait() {
        let start = tokio::time::Instant::now();
        let never = std::future::pending::<consort_comm::StoreResult<bool>>();
        assert_eq!(quick(never).await, None);
        assert_eq!(start.elapsed(), MONITOR_STORE_TIMEOUT);
        assert_eq!(quick(async { Ok(true) }).await, Some(true));
    }
}
