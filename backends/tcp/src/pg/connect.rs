//! Making the mesh: the listen addresses through the store, dialling
//! lower ranks, the hello and the CONSORT_SECRET challenge, the options
//! every rank must agree on, and the shared-memory regions between peers
//! on one host.

use super::*;

pub(super) fn setup_err(rank: usize, what: impl std::fmt::Display) -> CommError {
    CommError::BackendUnavailable {
        backend: "tcp".into(),
        reason: format!("rank {rank}: {what}"),
    }
}

pub(super) fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let s = socket2::SockRef::from(stream);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
}

/// The accepting side of one connection: the CONSORT_SECRET challenge
/// (with a secret) and the peer's hello, all within [`HANDSHAKE_TIMEOUT`].
pub(super) async fn accept_handshake(
    mut s: TcpStream,
    from: std::net::SocketAddr,
    secret: Option<auth::Secret>,
) -> std::result::Result<
    (TcpStream, std::net::SocketAddr, [u8; HELLO_LEN]),
    (std::net::SocketAddr, String),
> {
    let work = async {
        if let Some(secret) = &secret {
            auth::accept(&mut s, secret)
                .await
                .map_err(|e| e.to_string())?;
        }
        let mut h = [0u8; HELLO_LEN];
        s.read_exact(&mut h)
            .await
            .map_err(|e| format!("no hello: {e}"))?;
        Ok::<_, String>(h)
    };
    match before(Instant::now() + HANDSHAKE_TIMEOUT, work).await {
        Some(Ok(h)) => Ok((s, from, h)),
        Some(Err(e)) => Err((from, e)),
        None => Err((
            from,
            format!("no hello (or CONSORT_SECRET answer) within {HANDSHAKE_TIMEOUT:?}"),
        )),
    }
}

pub(super) fn hello(rank: usize, world: usize, stream: usize, streams: usize) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..4].copy_from_slice(&HELLO_MAGIC);
    h[4] = consort_comm::frame::VERSION;
    h[5..9].copy_from_slice(&(rank as u32).to_le_bytes());
    h[9..13].copy_from_slice(&(world as u32).to_le_bytes());
    h[13] = stream as u8;
    h[14] = streams as u8;
    h
}

/// Checks a hello; returns the peer's rank and the stream index.
pub(super) fn parse_hello(
    h: &[u8; HELLO_LEN],
    world: usize,
    streams: usize,
) -> std::result::Result<(usize, usize), String> {
    if h[..4] != HELLO_MAGIC {
        return Err("not a consort peer (bad hello)".into());
    }
    if h[4] != consort_comm::frame::VERSION {
        return Err(format!(
            "peer speaks frame version {}, this build {}",
            h[4],
            consort_comm::frame::VERSION
        ));
    }
    let rank = u32::from_le_bytes([h[5], h[6], h[7], h[8]]) as usize;
    let their_world = u32::from_le_bytes([h[9], h[10], h[11], h[12]]) as usize;
    if their_world != world {
        return Err(format!(
            "peer rank {rank} thinks the world has {their_world} ranks, this rank {world}"
        ));
    }
    if rank >= world {
        return Err(format!("peer claims rank {rank} in a world of {world}"));
    }
    if usize::from(h[14]) != streams || usize::from(h[13]) >= streams {
        return Err(format!(
            "peer rank {rank} opens {} streams per peer, this rank {streams}; every rank needs the \
             same TcpOptions::streams",
            h[14]
        ));
    }
    Ok((rank, usize::from(h[13])))
}

impl TcpBackend {
    /// Joins a group of `world` ranks as `rank`: listens, publishes the
    /// address in `store`, and connects to every other rank (lower ranks are
    /// dialed, higher ranks dial in).
    pub async fn connect(
        store: Arc<dyn Store>,
        rank: usize,
        world: usize,
        opts: TcpOptions,
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(CommError::invalid(format!(
                "rank {rank} does not fit a world of {world}"
            )));
        }
        let ip = opts.bind_addr.unwrap_or(IpAddr::from([127, 0, 0, 1]));
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .await
            .map_err(|e| setup_err(rank, format_args!("cannot listen on {ip}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| setup_err(rank, e))?;
        let key = |r: usize| format!("{}/addr/{r}", opts.namespace);
        store
            .set(&key(rank), addr.to_string().as_bytes())
            .await
            .map_err(|e| setup_err(rank, format_args!("publishing the listen address: {e}")))?;

        if !(1..=8).contains(&opts.streams) {
            return Err(CommError::invalid(format!(
                "TcpOptions::streams must be 1 to 8, not {}",
                opts.streams
            )));
        }
        let k = opts.streams;
        let deadline = consort_comm::time::deadline(opts.connect_timeout);
        let mut conns: Vec<Vec<Option<TcpStream>>> =
            (0..world).map(|_| (0..k).map(|_| None).collect()).collect();
        let dial = async {
            let conns = &mut conns;
            for (peer, slots) in conns.iter_mut().enumerate().take(rank) {
                let raw = store
                    .get(&key(peer))
                    .await
                    .map_err(|e| setup_err(rank, format_args!("finding rank {peer}: {e}")))?;
                let peer_addr = String::from_utf8_lossy(&raw).into_owned();
                for (stream, slot) in slots.iter_mut().enumerate() {
                    let mut s = TcpStream::connect(peer_addr.as_str()).await.map_err(|e| {
                        setup_err(
                            rank,
                            format_args!("connecting to rank {peer} at {peer_addr}: {e}"),
                        )
                    })?;
                    tune(&s);
                    if let Some(secret) = &opts.secret {
                        match before(
                            Instant::now() + HANDSHAKE_TIMEOUT,
                            auth::connect(&mut s, secret),
                        )
                        .await
                        {
                            Some(Ok(())) => {}
                            Some(Err(e)) => {
                                return Err(setup_err(
                                    rank,
                                    format_args!("authenticating with rank {peer}: {e}"),
                                ));
                            }
                            None => {
                                return Err(setup_err(
                                    rank,
                                    format_args!(
                                        "rank {peer} did not answer the CONSORT_SECRET handshake"
                                    ),
                                ));
                            }
                        }
                    }
                    s.write_all(&hello(rank, world, stream, k))
                        .await
                        .map_err(|e| setup_err(rank, e))?;
                    *slot = Some(s);
                }
            }
            // Handshakes run concurrently, each under its own deadline, so
            // a stray connection (a port scanner, a stale client of an
            // earlier job on a reused port) that sends nothing cannot hold
            // up the peers behind it.
            let need = (world - rank - 1) * k;
            let mut accepted = 0;
            let mut handshakes = tokio::task::JoinSet::new();
            while accepted < need {
                tokio::select! {
                    conn = listener.accept() => {
                        let (s, from) = conn.map_err(|e| setup_err(rank, e))?;
                        tune(&s);
                        handshakes.spawn(accept_handshake(s, from, opts.secret.clone()));
                    }
                    Some(done) = handshakes.join_next(), if !handshakes.is_empty() => {
                        let (s, from, h) = match done {
                            Ok(Ok(conn)) => conn,
                            Ok(Err((from, e))) => {
                                tracing::warn!(%from, "refused a connection: {e}");
                                continue;
                            }
                            Err(e) => {
                                tracing::warn!("a connection handshake task failed: {e}");
                                continue;
                            }
                        };
                        match parse_hello(&h, world, k) {
                            Ok((p, j)) if p > rank && conns[p][j].is_none() => {
                                conns[p][j] = Some(s);
                                accepted += 1;
                            }
                            Ok((p, j)) => {
                                tracing::warn!(%from, "unexpected connection claiming rank {p} stream {j}; dropped")
                            }
                            Err(e) => tracing::warn!(%from, "refused a connection: {e}"),
                        }
                    }
                }
            }
            Ok::<_, CommError>(())
        };
        match before(deadline, dial).await {
            Some(r) => r?,
            None => {
                let missing: Vec<usize> = (0..world)
                    .filter(|&p| p != rank && conns[p].iter().any(Option::is_none))
                    .collect();
                return Err(setup_err(
                    rank,
                    format_args!(
                        "timed out after {:?} building the connection mesh, still missing \
                         ranks {missing:?}; check that every rank started with the same \
                         WORLD_SIZE and can reach the others",
                        opts.connect_timeout
                    ),
                ));
            }
        }

        let opts = if world > 1 {
            agreed_options(rank, &mut conns, opts, deadline).await?
        } else {
            opts
        };
        let slot_bytes = opts.algo.segment_bytes.clamp(SLOT_MIN, SLOT_MAX);
        let (shm_tx, shm_rx) = if opts.shm && world > 1 {
            before(deadline, shm_setup(rank, &mut conns, slot_bytes))
                .await
                .ok_or_else(|| {
                    setup_err(
                        rank,
                        "timed out setting up shared memory with same-host peers",
                    )
                })?
                .map_err(|e| setup_err(rank, format_args!("setting up shared memory: {e}")))?
        } else {
            (
                (0..world).map(|_| None).collect(),
                (0..world).map(|_| None).collect(),
            )
        };
        let streams = conns
            .into_iter()
            .map(|streams| {
                streams
                    .into_iter()
                    .flatten()
                    .map(|s| {
                        let (r, w) = s.into_split();
                        (Box::pin(r) as BoxRead, Box::pin(w) as BoxWrite)
                    })
                    .collect()
            })
            .collect();
        Ok(Self::assemble(rank, world, streams, (shm_tx, shm_rx), opts))
    }

    /// A backend over already-connected, already-authenticated byte streams
    /// (`streams[peer]`: that peer's streams, the same count for every peer
    /// and empty for this rank), driving the same schedules and frames as
    /// TCP. The QUIC backend builds its mesh of QUIC streams and hands it
    /// here. No shared memory: every payload goes through the streams.
    /// Must run inside a tokio runtime (the readers are tasks).
    pub fn from_streams(
        rank: usize,
        world: usize,
        streams: Vec<Vec<(BoxRead, BoxWrite)>>,
        opts: TcpOptions,
    ) -> Result<Self> {
        if world == 0 || rank >= world || streams.len() != world {
            return Err(CommError::invalid(format!(
                "rank {rank} of a world of {world} needs one stream list per rank; got {}",
                streams.len()
            )));
        }
        let none = (
            (0..world).map(|_| None).collect(),
            (0..world).map(|_| None).collect(),
        );
        Ok(Self::assemble(rank, world, streams, none, opts))
    }

    pub(super) fn assemble(
        rank: usize,
        world: usize,
        streams: Vec<Vec<(BoxRead, BoxWrite)>>,
        (shm_tx, shm_rx): ShmPair,
        opts: TcpOptions,
    ) -> Self {
        let mut writers = Vec::with_capacity(world);
        let mut reads = Vec::new();
        for (peer, streams) in streams.into_iter().enumerate() {
            let mut ws = Vec::new();
            for (r, w) in streams {
                reads.push((peer, r));
                ws.push(tokio::sync::Mutex::new(Writer { w, cut: false }));
            }
            writers.push(ws);
        }
        let inner = Arc::new(Inner {
            writers,
            engine: Mutex::new(Engine::new(rank, world)),
            notify: Notify::new(),
            readers: Mutex::new(Vec::new()),
            pool: Mutex::new(Vec::new()),
            direct: Mutex::new(Registry::default()),
            shm_tx,
            shm_rx,
            flight: super::flight::FlightOut::new(opts.flight_dir.clone(), rank, world),
            beat: opts.heartbeat_file.as_deref().and_then(|p| {
                crate::heartbeat::Heartbeat::shared(p)
                    .map_err(|e| {
                        tracing::warn!(
                            "rank {rank}: no heartbeat for the launcher's watchdog: cannot map \
                             {}: {e}",
                            p.display()
                        )
                    })
                    .ok()
            }),
        });
        super::flight::register(&inner);
        let handles: Vec<JoinHandle<()>> = reads
            .into_iter()
            .map(|(peer, r)| {
                tokio::spawn(read_loop(
                    inner.clone(),
                    peer,
                    r,
                    opts.limits,
                    opts.in_place_min,
                ))
            })
            .collect();
        *lock(&inner.readers) = handles;
        TcpBackend {
            inner,
            opts,
            group: GroupId::WORLD,
            members: (0..world).collect(),
            me: rank,
            owner: true,
        }
    }
}

pub(super) type ShmPair = (Vec<Option<crate::shm::Tx>>, Vec<Option<crate::shm::Region>>);

pub(super) async fn write_blob(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    let len =
        u16::try_from(b.len()).map_err(|_| std::io::Error::other("setup message too long"))?;
    s.write_all(&len.to_le_bytes()).await?;
    s.write_all(b).await
}

pub(super) async fn read_blob(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let len = s.read_u16_le().await? as usize;
    let mut b = vec![0u8; len];
    s.read_exact(&mut b).await?;
    Ok(b)
}

/// `opts` with what every rank must share agreed over the mesh (see
/// [`agree_setup`]): the smallest segment size, and shared memory only when
/// every rank has it on.
pub(super) async fn agreed_options(
    rank: usize,
    conns: &mut [Vec<Option<TcpStream>>],
    mut opts: TcpOptions,
    deadline: Instant,
) -> Result<TcpOptions> {
    let mine = opts.algo.segment_bytes;
    let (agreed, shm) = before(deadline, agree_setup(rank, conns, mine, opts.shm))
        .await
        .ok_or_else(|| setup_err(rank, "timed out agreeing on the segment size"))?
        .map_err(|e| setup_err(rank, format_args!("agreeing on the segment size: {e}")))?;
    if agreed != mine {
        tracing::warn!(
            rank,
            "the ranks run with different segment sizes (CONSORT_SEGMENT_BYTES); this \
                 rank's {mine} becomes the smallest, {agreed}, as on every rank"
        );
        opts.algo.segment_bytes = agreed;
    }
    if opts.shm && !shm {
        tracing::warn!(
            rank,
            "shared memory is off on some rank (CONSORT_SHM=0): every pair uses TCP"
        );
    }
    opts.shm = shm;
    Ok(opts)
}

/// Agrees with every peer, over stream 0, on what every rank must share:
/// one segment size (the smallest any rank was given: schedules split
/// messages by it, so ranks started with different `CONSORT_SEGMENT_BYTES`
/// would send frames their peers do not expect), and whether shared memory
/// is on (only if it is on everywhere: a rank with it off would read the
/// shared-memory setup as frames). Writes to all before reading any.
pub(super) async fn agree_setup(
    rank: usize,
    conns: &mut [Vec<Option<TcpStream>>],
    mine: usize,
    shm: bool,
) -> std::io::Result<(usize, bool)> {
    let peers: Vec<usize> = (0..conns.len()).filter(|p| *p != rank).collect();
    let mut msg = (mine as u64).to_le_bytes().to_vec();
    msg.push(u8::from(shm));
    for &p in &peers {
        write_blob(conns[p][0].as_mut().expect("stream 0"), &msg).await?;
    }
    let (mut agreed, mut all_shm) = (mine, shm);
    for &p in &peers {
        let b = read_blob(conns[p][0].as_mut().expect("stream 0")).await?;
        let malformed =
            || std::io::Error::other(format!("rank {p} sent a malformed setup message"));
        let (size, flag) = b.split_first_chunk::<8>().ok_or_else(malformed)?;
        let theirs = u64::from_le_bytes(*size);
        if theirs == 0 || flag.len() != 1 {
            return Err(malformed());
        }
        agreed = agreed.min(usize::try_from(theirs).unwrap_or(usize::MAX));
        all_shm &= flag[0] == 1;
    }
    Ok((agreed, all_shm))
}

/// Agrees with every peer, over stream 0, on shared-memory slots: host ids
/// first, then region names for same-host peers, then whether each side
/// could map the other's region. Every phase writes to all peers before
/// reading from any, so no phase waits on another rank's later phase.
pub(super) async fn shm_setup(
    rank: usize,
    conns: &mut [Vec<Option<TcpStream>>],
    slot_bytes: usize,
) -> std::io::Result<ShmPair> {
    use crate::shm::{Region, Tx, host_id};
    let world = conns.len();
    let me = host_id();
    let peers: Vec<usize> = (0..world).filter(|p| *p != rank).collect();
    for &p in &peers {
        write_blob(conns[p][0].as_mut().expect("stream 0"), me.as_bytes()).await?;
    }
    let mut same = vec![false; world];
    for &p in &peers {
        same[p] = read_blob(conns[p][0].as_mut().expect("stream 0")).await? == me.as_bytes();
    }
    let mut mine: Vec<Option<(String, Region)>> = (0..world).map(|_| None).collect();
    for &p in &peers {
        let mut name = String::new();
        if same[p] {
            let mut nonce = [0u8; 8];
            getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(e.to_string()))?;
            let n = format!(
                "consort-{}-{rank}to{p}-{:016x}",
                std::process::id(),
                u64::from_le_bytes(nonce)
            );
            match Region::create(&n, slot_bytes) {
                Ok((n, r)) => {
                    name = n.clone();
                    mine[p] = Some((n, r));
                }
                Err(e) => tracing::debug!("no shared memory toward rank {p}: {e}"),
            }
        }
        // The region's slot size goes with its name: ranks may run with
        // different segment sizes, and both sides must index one layout.
        let mut blob = (slot_bytes as u64).to_le_bytes().to_vec();
        blob.extend_from_slice(name.as_bytes());
        write_blob(conns[p][0].as_mut().expect("stream 0"), &blob).await?;
    }
    let mut rx: Vec<Option<Region>> = (0..world).map(|_| None).collect();
    for &p in &peers {
        let blob = read_blob(conns[p][0].as_mut().expect("stream 0")).await?;
        let (size, name) = blob.split_at(blob.len().min(8));
        let their_slot = u64::from_le_bytes(size.try_into().unwrap_or([0; 8])) as usize;
        let name = String::from_utf8_lossy(name).into_owned();
        let valid = !name.is_empty()
            && name.starts_with("consort-")
            && !name.contains('/')
            && (SLOT_MIN..=SLOT_MAX).contains(&their_slot);
        if same[p] && valid {
            match Region::open(&name, their_slot) {
                Ok(r) => rx[p] = Some(r),
                Err(e) => tracing::debug!("cannot map rank {p}'s shared memory: {e}"),
            }
        }
    }
    for &p in &peers {
        let ok = u8::from(rx[p].is_some());
        conns[p][0]
            .as_mut()
            .expect("stream 0")
            .write_all(&[ok])
            .await?;
    }
    let mut tx: Vec<Option<Tx>> = (0..world).map(|_| None).collect();
    for &p in &peers {
        let ok = conns[p][0].as_mut().expect("stream 0").read_u8().await? == 1;
        if let Some((name, mut region)) = mine[p].take() {
            region.unlink(&name);
            if ok {
                tx[p] = Some(Tx::new(region));
            }
        }
    }
    Ok((tx, rx))
}
