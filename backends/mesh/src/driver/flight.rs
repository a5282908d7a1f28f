//! Flight records of this process's mesh groups (TCP and QUIC): the time
//! stamps the engine's recorder gets, and `rank-K.json`, written when a
//! call of this rank fails, when a peer's abort arrives (so that every
//! rank of a failed job leaves its record, as torch's
//! `TORCH_NCCL_DUMP_ON_TIMEOUT` does), and on request
//! ([`dump_flight_records`], which the facade calls on SIGUSR1). The
//! first failing rank writes before it tells its peers.

use std::{
    path::PathBuf,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, Ordering},
    },
};

use super::{Inner, lock};

/// Where and whether this process writes its record.
#[derive(Debug)]
pub(super) struct FlightOut {
    dir: Option<PathBuf>,
    rank: usize,
    world: usize,
    written: AtomicBool,
}

impl FlightOut {
    pub(super) fn new(dir: Option<PathBuf>, rank: usize, world: usize) -> Self {
        FlightOut {
            dir,
            rank,
            world,
            written: AtomicBool::new(false),
        }
    }
}

/// Wall time since the Unix epoch, µs: every rank's records share it.
pub(super) fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Every mesh backend alive in this process, for [`dump_flight_records`].
static LIVE: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

pub(super) fn register(inner: &Arc<Inner>) {
    let mut live = lock(&LIVE);
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(inner));
}

/// Writes this rank's record: always with `force` (a call of this rank
/// failed, or a request), otherwise only if none is written yet (a peer's
/// abort: this rank's own failure follows and writes again). Returns the
/// file written.
pub(super) fn dump(inner: &Inner, reason: &str, force: bool) -> Option<PathBuf> {
    let out = &inner.flight;
    let dir = out.dir.as_ref()?;
    if out.written.swap(true, Ordering::SeqCst) && !force {
        return None;
    }
    let record = {
        let mut engine = lock(&inner.engine);
        engine.flight_mut().set_now_us(now_us());
        engine.flight().dump(out.rank, out.world, reason)
    };
    let path = dir.join(format!("rank-{}.json", out.rank));
    // A name of its own per write: two dumps at once (a failure and a
    // SIGUSR1, or two groups) never share a temporary file.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".rank-{}.json.tmp-{}-{n}",
        out.rank,
        std::process::id()
    ));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| consort_comm::files::create_new(&tmp))
        .and_then(|mut f| std::io::Write::write_all(&mut f, &record.to_json()))
        .and_then(|()| std::fs::rename(&tmp, &path));
    match written {
        Ok(()) => Some(path),
        Err(e) => {
            tracing::warn!(
                "rank {}: could not write the flight record {}: {e}",
                out.rank,
                path.display()
            );
            None
        }
    }
}

/// Writes the flight record of every TCP or QUIC group alive in this
/// process to its directory (`TcpOptions::flight_dir`), with `reason`;
/// returns the files written. `consort::init_from_env` calls it on
/// SIGUSR1.
pub fn dump_flight_records(reason: &str) -> Vec<PathBuf> {
    let live: Vec<Arc<Inner>> = lock(&LIVE).iter().filter_map(Weak::upgrade).collect();
    live.iter()
        .filter_map(|inner| dump(inner, reason, true))
        .collect()
}
