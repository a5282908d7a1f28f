//! Where flight records go: `rank-K.json` in the job's flight directory
//! (`CONSORT_FLIGHT_DIR`, which `consort run` sets), written by every
//! driver alike (the mesh, the stream-ordered driver of NCCL and the
//! emulated device, the Gloo driver) when a call of this rank fails, when a
//! peer's failure reaches it, and on request: [`dump_flight_records`],
//! which SIGUSR1 calls ([`dump_on_sigusr1`]) and which the launcher's
//! watchdog sends before it stops a hung job.
//!
//! Every source of this process registers here. One process may hold
//! several (a communicator per NCCL subgroup, the world's and a subgroup's
//! engines): a dump merges every live source with the same directory and
//! rank into the one file, oldest call first.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use super::{Dump, Entry};

/// Wall time since the Unix epoch, µs: every rank's records share it.
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Something that keeps a flight record (a driver's engine or engines).
pub trait FlightSource: Send + Sync {
    /// Its calls, oldest first, stamped now.
    fn flight_entries(&self) -> Vec<Entry>;
}

/// Where and whether one source writes its record.
#[derive(Debug)]
pub struct FlightOut {
    dir: PathBuf,
    /// This process's rank in the world (the file's name).
    rank: usize,
    world: usize,
    written: AtomicBool,
}

impl FlightOut {
    /// Records of world rank `rank` of `world` go to `dir`.
    pub fn new(dir: impl Into<PathBuf>, rank: usize, world: usize) -> Self {
        FlightOut {
            dir: dir.into(),
            rank,
            world,
            written: AtomicBool::new(false),
        }
    }

    /// The directory records go to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// One registered source and where it writes.
struct Registered {
    source: Weak<dyn FlightSource>,
    out: Weak<FlightOut>,
}

/// Every source alive in this process.
static LIVE: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

/// Registers `source`, whose records go to `out`, until either is dropped.
pub fn register(source: Weak<dyn FlightSource>, out: &Arc<FlightOut>) {
    let mut live = crate::lock(&LIVE);
    live.retain(|r| r.source.strong_count() > 0 && r.out.strong_count() > 0);
    live.push(Registered {
        source,
        out: Arc::downgrade(out),
    });
}

/// Writes this process's record to `out`'s directory with `reason`,
/// merging every live source that writes there as the same rank: always
/// with `force` (a call of this rank failed, or a request), otherwise only
/// if `out` has written none yet (a peer's failure reached it: this rank's
/// own follows and writes again). Returns the file written.
pub fn dump(out: &FlightOut, reason: &str, force: bool) -> Option<PathBuf> {
    if out.written.swap(true, Ordering::SeqCst) && !force {
        return None;
    }
    let sources: Vec<Arc<dyn FlightSource>> = crate::lock(&LIVE)
        .iter()
        .filter(|r| {
            r.out
                .upgrade()
                .is_some_and(|o| o.dir == out.dir && o.rank == out.rank)
        })
        .filter_map(|r| r.source.upgrade())
        .collect();
    let mut entries: Vec<Entry> = Vec::new();
    for s in sources {
        entries.extend(s.flight_entries());
        release(s);
    }
    entries.sort_by_key(|e| (e.issued_us, e.id));
    let record = Dump {
        rank: out.rank,
        world: out.world,
        pid: std::process::id(),
        reason: reason.to_string(),
        dumped_us: now_us(),
        entries,
    };
    write(out, &record)
}

/// Lets go of a source the dump held: if it was the last handle (its
/// backend went meanwhile), its drop, which may wait for a device, runs on
/// a thread of its own, not on the dumping one (a watchdog, a signal task).
fn release(s: Arc<dyn FlightSource>) {
    if Arc::strong_count(&s) == 1 {
        let _ = std::thread::Builder::new()
            .name("consort-flight-release".into())
            .spawn(move || drop(s));
    }
}

/// Writes `record` as `rank-K.json`, through a temporary file of its own.
fn write(out: &FlightOut, record: &Dump) -> Option<PathBuf> {
    let path = out.dir.join(format!("rank-{}.json", out.rank));
    // A name of its own per write: two dumps at once (a failure and a
    // SIGUSR1, or two groups) never share a temporary file.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = out.dir.join(format!(
        ".rank-{}.json.tmp-{}-{n}",
        out.rank,
        std::process::id()
    ));
    let written = std::fs::create_dir_all(&out.dir)
        .and_then(|()| crate::files::create_new(&tmp))
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

/// Writes the record of every source alive in this process (one file per
/// directory and rank), with `reason`; returns the files written.
pub fn dump_flight_records(reason: &str) -> Vec<PathBuf> {
    let outs: Vec<Arc<FlightOut>> = {
        let live = crate::lock(&LIVE);
        let mut outs: Vec<Arc<FlightOut>> = Vec::new();
        for o in live.iter().filter_map(|r| r.out.upgrade()) {
            if !outs.iter().any(|x| x.dir == o.dir && x.rank == o.rank) {
                outs.push(o);
            }
        }
        outs
    };
    outs.iter().filter_map(|o| dump(o, reason, true)).collect()
}

/// On SIGUSR1, every source's record is written
/// ([`dump_flight_records`]). Installed once per process, on the current
/// tokio runtime (nothing happens outside one).
pub fn dump_on_sigusr1() {
    // (tokio has no signals in its loom build.)
    #[cfg(all(unix, not(loom)))]
    if tokio::runtime::Handle::try_current().is_ok() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            if let Ok(mut sig) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())
            {
                tokio::spawn(async move {
                    while sig.recv().await.is_some() {
                        for path in dump_flight_records("SIGUSR1") {
                            eprintln!("flight record written to {}", path.display());
                        }
                    }
                });
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex, Weak};

    use super::{FlightOut, FlightSource, dump, dump_flight_records, register};
    use crate::{GroupId, OpKind, engine::Engine, fingerprint::test_shape, flight::Dump};

    /// An engine with one call made, as a driver keeps its record.
    struct Source(Mutex<Engine<()>>);

    impl Source {
        fn new(group: GroupId, (rank, world): (usize, usize), op: OpKind) -> Arc<Self> {
            let mut e = Engine::for_group(group, rank, world);
            e.begin(group, test_shape(op)).unwrap();
            Arc::new(Source(Mutex::new(e)))
        }
    }

    impl FlightSource for Source {
        fn flight_entries(&self) -> Vec<super::Entry> {
            crate::lock(&self.0).flight().entries().collect()
        }
    }

    fn read(path: &std::path::Path) -> Dump {
        Dump::from_json(&std::fs::read(path).unwrap()).unwrap()
    }

    /// One file per rank: a rank's communicators (a world's and a
    /// subgroup's, sharing one `FlightOut`) are merged into its
    /// `rank-K.json`, and another rank in the same directory keeps its own.
    #[test]
    fn a_ranks_communicators_share_one_file_and_ranks_keep_theirs() {
        let dir = std::env::temp_dir().join(format!("consort-flight-out-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mine = Arc::new(FlightOut::new(&dir, 0, 2));
        let world = Source::new(GroupId::WORLD, (0, 2), OpKind::AllReduce);
        let sub = Source::new(GroupId(0x77), (0, 1), OpKind::Broadcast);
        let peer_out = Arc::new(FlightOut::new(&dir, 1, 2));
        let peer = Source::new(GroupId::WORLD, (1, 2), OpKind::Barrier);
        for (s, out) in [(&world, &mine), (&sub, &mine), (&peer, &peer_out)] {
            let weak: Weak<dyn FlightSource> = Arc::downgrade(s) as Weak<dyn FlightSource>;
            register(weak, out);
        }
        let path = dump(&mine, "a test", true).expect("written");
        let d = read(&path);
        assert_eq!((d.rank, d.world, d.reason.as_str()), (0, 2, "a test"));
        let mut ops: Vec<&str> = d.entries.iter().map(|e| e.op.as_str()).collect();
        ops.sort_unstable();
        assert_eq!(ops, ["all_reduce", "broadcast"], "{d:?}");
        // Not forced, after a write: left as it is.
        assert!(dump(&mine, "later", false).is_none());
        // On request, every rank's file (the peer's has only its call).
        let written = dump_flight_records("SIGUSR1");
        assert!(written.contains(&dir.join("rank-1.json")), "{written:?}");
        let p = read(&dir.join("rank-1.json"));
        assert_eq!(p.entries.len(), 1);
        assert_eq!(p.entries[0].op, "barrier");
        assert_eq!(read(&path).entries.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
