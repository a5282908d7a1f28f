//! Building a [`MeshBackend`] from the links the transports made: the
//! writers, the reader tasks of the streams, the idle poller of the polled
//! links, and the flight recorder and heartbeat.

use consort_comm::fault::Trigger;

use super::*;

impl MeshBackend {
    /// A backend over links already connected and authenticated, one per
    /// world rank (`links[rank]` is [`PeerLink::Me`]). Streams must come in
    /// the same number for every peer that has them. `name` is the
    /// backend's name in errors ("tcp", "quic"); `bell` is what the polled
    /// links' transport notifies when a peer rings (see
    /// [`crate::LocalSetup::wake`]). Must run inside a tokio runtime (the
    /// readers are tasks).
    pub fn from_links(
        name: &'static str,
        rank: usize,
        links: Vec<PeerLink>,
        bell: Arc<Notify>,
        opts: MeshOptions,
    ) -> Result<Self> {
        let world = links.len();
        if world == 0 || rank >= world || !matches!(links[rank], PeerLink::Me) {
            return Err(CommError::invalid(format!(
                "rank {rank} of a world of {world} needs one link per rank, and none to itself"
            )));
        }
        let (out, reads, polled) = split_links(links);
        let local_ranks = polled.len() + 1;
        // The process's helper threads (one pool per process: the last
        // mesh made sets it).
        consort_comm::par::Pool::shared().set_threads(opts.threads.unwrap_or(1));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let inner = Arc::new(Inner {
            links: out,
            engine: Mutex::new(Engine::new(rank, world)),
            notify: Notify::new(),
            bell: bell.clone(),
            pump: Arc::new(Notify::new()),
            pump_parked: std::sync::atomic::AtomicBool::new(false),
            readers: Mutex::new(Vec::new()),
            pool: Mutex::new(Vec::new()),
            direct: Mutex::new(Registry::default()),
            polled,
            spin: opts.spin.unwrap_or(if local_ranks > cores {
                crate::options::SPIN_SHARED_CORES
            } else {
                crate::options::SPIN_OWN_CORE
            }),
            yield_spin: local_ranks > cores,
            limits: opts.limits,
            in_place_min: opts.in_place_min,
            late_posts: Default::default(),
            single_copy_min: opts.single_copy_min,
            stager: Default::default(),
            staged_frames: Default::default(),
            flight: super::flight::out(opts.flight_dir.as_deref(), rank, world),
            faults: super::faulty::Faulty::new(&opts.faults, opts.fault_seed),
            beat: crate::heartbeat::Heartbeat::for_rank(opts.heartbeat_file.as_deref(), rank),
        });
        super::flight::register(&inner);
        if let Some(Trigger::At(at)) =
            consort_comm::fault::FaultPlan::new(opts.faults.clone()).crash_of(rank)
        {
            // A crash at a time happens then, sending or not.
            let weak = Arc::downgrade(&inner);
            tokio::spawn(async move {
                tokio::time::sleep(at).await;
                if let Some(inner) = weak.upgrade() {
                    inner.crash().await;
                }
            });
        }
        let mut handles: Vec<JoinHandle<()>> = reads
            .into_iter()
            .map(|(peer, r)| tokio::spawn(read_loop(inner.clone(), peer, r)))
            .collect();
        let pump = inner.pump.clone();
        handles.push(tokio::spawn(poll::pump(Arc::downgrade(&inner), bell, pump)));
        *lock(&inner.readers) = handles;
        Ok(MeshBackend {
            name,
            inner,
            programs: Mutex::new(consort_comm::algo::ProgramCache::new(opts.algo.clone())),
            opts,
            group: GroupId::WORLD,
            members: (0..world).collect(),
            me: rank,
            owner: true,
            closer: None,
        })
    }
}

/// The peers' links as the driver keeps them, the streams' read halves (by
/// peer) for the reader tasks, and the indices of the polled links.
fn split_links(links: Vec<PeerLink>) -> (Vec<Link>, Vec<(usize, BoxRead)>, Vec<usize>) {
    let mut out = Vec::with_capacity(links.len());
    let mut reads = Vec::new();
    let mut polled = Vec::new();
    for (peer, link) in links.into_iter().enumerate() {
        out.push(match link {
            PeerLink::Me => Link::Me,
            PeerLink::Streams(streams) => {
                let mut ws = Vec::new();
                for (r, w) in streams {
                    reads.push((peer, r));
                    ws.push(tokio::sync::Mutex::new(Writer { w, cut: false }));
                }
                Link::Streams(ws)
            }
            PeerLink::Polled(link) => {
                polled.push(peer);
                Link::Polled(Box::new(poll::Polled::new(link)))
            }
        });
    }
    (out, reads, polled)
}
