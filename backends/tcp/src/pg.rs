//! The TCP backend: [`TcpBackend`] drives `consort_comm::algo`'s schedules
//! over a full mesh of TCP connections, one per pair of ranks.
//!
//! This module owns the transport: rendezvous of listen addresses through
//! the store, the connection handshake, one reader task per peer that
//! decodes frames into an inbox, vectored writes straight from the caller's
//! buffer, and the failure rules (abort propagation, `PeerLost` from EOF,
//! sticky errors, stall probes). It owns no algorithm.

use std::{
    collections::HashMap,
    io::IoSlice,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use crate::auth::{self, HANDSHAKE_TIMEOUT, Secret};
use async_trait::async_trait;
use consort_comm::{
    Backend, CallOptions, CommError, DType, ErrorContext, Fingerprint, GroupId, Op, OpKind,
    ReduceOp, Result, Work,
    algo::{
        Action, AlgoConfig, Buf, Receive, build,
        exec::{Call, CallBuffers, scratch, scratch_bytes},
    },
    engine::{Begun, CallId, Engine},
    frame::{AbortInfo, FLAG_SHM, FrameHeader, FrameKind, FrameLimits, HEADER_LEN},
    store::Store,
};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::Notify,
    task::JoinHandle,
};

/// The read side of one data stream to a peer: a TCP read half, or any
/// other ordered byte stream (a QUIC stream).
pub type BoxRead = std::pin::Pin<Box<dyn AsyncRead + Send>>;
/// The write side of one data stream to a peer.
pub type BoxWrite = std::pin::Pin<Box<dyn AsyncWrite + Send>>;

/// The first bytes of a data connection: magic, version, rank, world size.
const HELLO_MAGIC: [u8; 4] = *b"CSRH";
const HELLO_LEN: usize = 4 + 1 + 4 + 4 + 1 + 1;
/// Socket buffer size: a few segments in flight each way.
const SOCKET_BUFFER: usize = 4 << 20;

/// How a [`TcpBackend`] connects and runs.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// Default deadline of every op (torch's process-group default: 30 min).
    pub timeout: Duration,
    /// Deadline for building the mesh.
    pub connect_timeout: Duration,
    /// Address to listen on and advertise; `None`: the address this process
    /// uses to reach the store (it is routable from the store's host).
    pub bind_addr: Option<IpAddr>,
    /// Segment size, window and algorithm overrides.
    pub algo: AlgoConfig,
    /// How long a call may make no progress before it probes its peers.
    pub stall_probe: Duration,
    /// Largest frame payload accepted.
    pub limits: FrameLimits,
    /// Store key namespace of this group's addresses.
    pub namespace: String,
    /// Payloads of at least this many bytes are applied by the reader task
    /// straight into the call's buffer when the receive is already posted
    /// (no second copy); smaller ones are buffered. Default 64 KiB.
    pub in_place_min: usize,
    /// Same-host peers pass payloads through shared memory (`/dev/shm`)
    /// and only headers over TCP; falls back to TCP per pair when that is
    /// not possible. Default on.
    pub shm: bool,
    /// TCP connections per pair of ranks (1 to 8); frames spread over them
    /// by tag. On this project's loopback benches 2 streams measured no
    /// better than 1 (the sender writes every stream from one task), so
    /// the default is 1; it can help where one flow is capped.
    pub streams: usize,
    /// Shared secret: every connection starts with an HMAC challenge-response
    /// ([`crate::auth`]); `None` leaves the port open to anyone who can reach it.
    pub secret: Option<Secret>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: Duration::from_secs(30 * 60),
            connect_timeout: Duration::from_secs(300),
            bind_addr: None,
            algo: AlgoConfig {
                segment_bytes: 1 << 20,
                window: 4,
                overrides: Vec::new(),
            },
            stall_probe: Duration::from_millis(500),
            limits: FrameLimits::default(),
            namespace: "consort/tcp/world".into(),
            in_place_min: 64 * 1024,
            shm: true,
            streams: 1,
            secret: Secret::from_env(),
        }
    }
}

#[derive(Debug)]
struct Frame {
    fp: Fingerprint,
    payload: Vec<u8>,
    /// The payload is still in the peer's shared-memory slot: (slot, bytes).
    /// The call applies it from there and then returns the slot.
    slot: Option<(usize, usize)>,
}

/// Bounce-buffer chunk of in-place receives: L2-sized, so the kernel's copy
/// and the reduce that follows meet in cache.
const BOUNCE: usize = 256 * 1024;

/// A posted receive that a reader may apply in place.
struct Direct {
    /// The registering call (see `Registry`).
    call: u64,
    fp: Fingerprint,
    dst: *mut u8,
    len: usize,
    reduce: Option<(ReduceOp, DType)>,
}

// SAFETY: `dst` is only written under the registry lock while the call that
// registered it is the registry's current call (see `Registry`).
unsafe impl Send for Direct {}
// SAFETY: as above; a shared `&Direct` only reads its fields.
unsafe impl Sync for Direct {}

/// The receives of the running call that readers may apply in place.
///
/// Soundness: a reader writes through `Direct::dst` only while holding this
/// lock and only if `live` still holds the call that registered the entry;
/// each call removes itself and its entries (under the lock) before its
/// buffers go out of scope, on every path including cancellation. Calls in
/// flight together have disjoint buffers (each borrows its own). While readers may write,
/// the call itself touches its buffers either under this lock or through
/// ranges disjoint from every registered receive (a schedule never uses a
/// posted receive's range until that receive completes).
#[derive(Default)]
struct Registry {
    /// Calls whose buffers readers may still write.
    live: std::collections::HashSet<u64>,
    next_call: u64,
    /// Posted receives by (group, mesh sender, seq, tag).
    posted: HashMap<DirectKey, Direct>,
}

type DirectKey = (GroupId, usize, u64, u32);

/// What a reader files for a receive: a frame, or the news that it was
/// applied in place.
#[derive(Debug)]
enum Got {
    Frame(Frame),
    Done,
}

struct Inner {
    /// Write halves by [peer][stream] (empty for this rank).
    writers: Vec<Vec<tokio::sync::Mutex<Writer>>>,
    /// The call rules: groups, calls in flight, filed frames, failures.
    engine: Mutex<Engine<Got>>,
    notify: Notify,
    readers: Mutex<Vec<JoinHandle<()>>>,
    /// Payload buffers handed back after use: large frames would otherwise
    /// cost an mmap, page faults and an munmap each.
    pool: Mutex<Vec<Vec<u8>>>,
    /// Receives the readers may apply in place.
    direct: Mutex<Registry>,
    /// Shared-memory slots this rank sends into, per same-host peer.
    shm_tx: Vec<Option<crate::shm::Tx>>,
    /// Shared-memory slots peers send into, per same-host peer.
    shm_rx: Vec<Option<crate::shm::Region>>,
}

/// Buffers kept in the pool at most.
const POOL_MAX: usize = 64;

impl Inner {
    fn buffer(&self, len: usize) -> Vec<u8> {
        let mut pool = lock(&self.pool);
        match pool.iter().position(|b| b.capacity() >= len) {
            Some(i) => pool.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    fn recycle(&self, mut b: Vec<u8>) {
        b.clear();
        let mut pool = lock(&self.pool);
        if pool.len() < POOL_MAX && b.capacity() > 0 {
            pool.push(b);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One rank's handle on a TCP process group: the world group, or a
/// subgroup that shares the world's connections.
pub struct TcpBackend {
    inner: Arc<Inner>,
    opts: TcpOptions,
    group: GroupId,
    /// Mesh rank of each group rank.
    members: Arc<[usize]>,
    /// This rank's place in the group.
    me: usize,
    /// Whether this is the world handle, whose drop closes the mesh.
    owner: bool,
}

impl std::fmt::Debug for TcpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBackend")
            .field("rank", &self.me)
            .field("world_size", &self.members.len())
            .field("group", &self.group)
            .finish()
    }
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        if !self.owner {
            return;
        }
        for h in lock(&self.inner.readers).drain(..) {
            h.abort();
        }
    }
}

fn setup_err(rank: usize, what: impl std::fmt::Display) -> CommError {
    CommError::BackendUnavailable {
        backend: "tcp".into(),
        reason: format!("rank {rank}: {what}"),
    }
}

fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let s = socket2::SockRef::from(stream);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
}

/// The accepting side of one connection: the CONSORT_SECRET challenge
/// (with a secret) and the peer's hello, all within [`HANDSHAKE_TIMEOUT`].
async fn accept_handshake(
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

fn hello(rank: usize, world: usize, stream: usize, streams: usize) -> [u8; HELLO_LEN] {
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
fn parse_hello(
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

    fn assemble(
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
        });
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

type ShmPair = (Vec<Option<crate::shm::Tx>>, Vec<Option<crate::shm::Region>>);

async fn write_blob(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    let len =
        u16::try_from(b.len()).map_err(|_| std::io::Error::other("setup message too long"))?;
    s.write_all(&len.to_le_bytes()).await?;
    s.write_all(b).await
}

async fn read_blob(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let len = s.read_u16_le().await? as usize;
    let mut b = vec![0u8; len];
    s.read_exact(&mut b).await?;
    Ok(b)
}

/// `opts` with what every rank must share agreed over the mesh (see
/// [`agree_setup`]): the smallest segment size, and shared memory only when
/// every rank has it on.
async fn agreed_options(
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
async fn agree_setup(
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
async fn shm_setup(
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

/// Runs `fut` until `deadline` on tokio's timer wheel (cheap enough for
/// every send and every wait); `None` if the deadline came first.
async fn before<F: Future>(deadline: Instant, fut: F) -> Option<F::Output> {
    tokio::time::timeout_at(deadline.into(), fut).await.ok()
}

/// Writes every slice, looping over partial vectored writes.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    parts: &[&[u8]],
) -> std::io::Result<()> {
    let mut idx = 0;
    let mut off = 0;
    while idx < parts.len() {
        if parts[idx].len() == off {
            idx += 1;
            off = 0;
            continue;
        }
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len() - idx);
        slices.push(IoSlice::new(&parts[idx][off..]));
        for p in &parts[idx + 1..] {
            slices.push(IoSlice::new(p));
        }
        let mut n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 && idx < parts.len() {
            let left = parts[idx].len() - off;
            if n >= left {
                n -= left;
                idx += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// Reads frames from one peer into the inbox until the connection ends.
async fn read_loop(
    inner: Arc<Inner>,
    peer: usize,
    mut r: BoxRead,
    limits: FrameLimits,
    in_place_min: usize,
) {
    let mut head = [0u8; HEADER_LEN];
    let mut bounce = vec![0u64; BOUNCE / 8];
    let why = loop {
        if let Err(e) = r.read_exact(&mut head).await {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "connection closed (EOF): its process exited or crashed".to_string()
            } else {
                format!("connection error: {e}")
            };
        }
        let h = match FrameHeader::decode(&head, &limits) {
            Ok(h) => h,
            Err(e) => {
                lock(&inner.engine).protocol_error(peer, e.to_string());
                inner.notify.notify_waiters();
                break format!("bad frame: {e}");
            }
        };
        let len = h.payload_len as usize;
        if h.in_shm() {
            match take_from_slot(&inner, peer, &h).await {
                Ok(()) => continue,
                Err(why) => {
                    lock(&inner.engine).protocol_error(peer, why.clone());
                    inner.notify.notify_waiters();
                    break why;
                }
            }
        }
        if h.kind == FrameKind::Data
            && len >= in_place_min
            && !matches!(h.fingerprint.op, OpKind::Send | OpKind::Recv)
        {
            let key = (h.fingerprint.group, peer, h.fingerprint.seq, h.tag);
            let taken = {
                let mut reg = lock(&inner.direct);
                match reg.posted.get(&key) {
                    Some(d) if d.fp == h.fingerprint && d.len == len => reg.posted.remove(&key),
                    _ => None,
                }
            };
            if let Some(d) = taken {
                match read_in_place(&inner, peer, &mut r, &mut bounce, &d).await {
                    Ok(()) => {
                        lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Done);
                        inner.notify.notify_waiters();
                        continue;
                    }
                    Err(e) => break format!("connection error mid-frame: {e}"),
                }
            }
        }
        // Read into spare capacity: no zeroing, and the buffer comes from
        // the pool when one is big enough.
        let mut payload = inner.buffer(len);
        let mut short = None;
        while payload.len() < len {
            let mut limited = (&mut r).take((len - payload.len()) as u64);
            match limited.read_buf(&mut payload).await {
                Ok(0) => {
                    short = Some("connection closed mid-frame".to_string());
                    break;
                }
                Ok(_) => {}
                Err(e) => {
                    short = Some(format!("connection error mid-frame: {e}"));
                    break;
                }
            }
        }
        if let Some(why) = short {
            break why;
        }
        match h.kind {
            FrameKind::Abort => match h.tag {
                // Probe request: answer with the current fingerprint.
                PROBE_TAG => {
                    let asked = h.fingerprint;
                    let cur = lock(&inner.engine).probe_answer(asked.group, asked.seq);
                    let reply = probe_frame(PROBE_REPLY_TAG, cur);
                    if let Some(w) = inner.writers[peer].first() {
                        let _ = write_frame(w, &[&reply]).await;
                    }
                }
                CREDIT_TAG => {
                    let refused = match inner.shm_tx[peer].as_ref() {
                        Some(tx) => tx.give_back(h.offset as usize).err(),
                        None => Some("a shared-memory credit, but no slots are shared".into()),
                    };
                    if let Some(why) = refused {
                        lock(&inner.engine).protocol_error(peer, why);
                        inner.notify.notify_waiters();
                    }
                }
                PROBE_REPLY_TAG => {
                    if h.fingerprint.op != OpKind::NewGroup {
                        lock(&inner.engine).probe_reply(peer, h.fingerprint);
                        inner.notify.notify_waiters();
                    }
                }
                _ => {
                    match AbortInfo::decode(&payload) {
                        Ok(a) => lock(&inner.engine).aborted(peer, h.fingerprint, a),
                        Err(e) => lock(&inner.engine)
                            .protocol_error(peer, format!("bad abort frame: {e}")),
                    }
                    inner.notify.notify_waiters();
                }
            },
            FrameKind::Data => {
                let frame = Frame {
                    fp: h.fingerprint,
                    payload,
                    slot: None,
                };
                lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Frame(frame));
                inner.notify.notify_waiters();
            }
        }
    };
    lock(&inner.engine).peer_lost(peer, why);
    inner.notify.notify_waiters();
}

/// Streams a payload into a registered receive, chunk by chunk: each chunk
/// is read into the (cache-hot) bounce buffer, then copied or reduced into
/// place under the registry lock, if the call is still live (otherwise it
/// is read and dropped, keeping the stream in step).
async fn read_in_place(
    inner: &Inner,
    peer: usize,
    r: &mut BoxRead,
    bounce: &mut [u64],
    d: &Direct,
) -> std::io::Result<()> {
    let buf: &mut [u8] = bytemuck_bytes_mut(bounce);
    let mut off = 0;
    while off < d.len {
        let n = (d.len - off).min(buf.len());
        r.read_exact(&mut buf[..n]).await?;
        let reg = lock(&inner.direct);
        if reg.live.contains(&d.call) {
            // SAFETY: the registering call is live and holds no other
            // reference to this range (see `Registry`), `off + n <= d.len`
            // bytes from `dst` lie inside its buffer, and we hold the lock.
            let dst = unsafe { std::slice::from_raw_parts_mut(d.dst.add(off), n) };
            // Chunks are whole elements: BOUNCE is a multiple of 8.
            if let Some(e) = apply(d.reduce, dst, &buf[..n]) {
                lock(&inner.engine).protocol_error(peer, e);
            }
        }
        drop(reg);
        off += n;
    }
    Ok(())
}

fn bytemuck_bytes_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no padding; every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 8) }
}

/// Reduces (or copies) `data` into `dst` on the reader path; the error, if
/// any, for the call to report (it used to be dropped).
fn apply(reduce: Option<(ReduceOp, DType)>, dst: &mut [u8], data: &[u8]) -> Option<String> {
    match reduce {
        Some((op, dtype)) => op
            .apply_bytes(dtype, dst, data)
            .err()
            .map(|e| format!("reducing a received payload failed: {e}")),
        None => {
            dst.copy_from_slice(data);
            None
        }
    }
}

/// Applies a frame whose payload sits in the peer's shared-memory slot
/// `h.offset`, then hands the slot back with a credit frame.
async fn take_from_slot(
    inner: &Inner,
    peer: usize,
    h: &FrameHeader,
) -> std::result::Result<(), String> {
    let len = h.payload_len as usize;
    let slot = h.offset as usize;
    let src = inner.shm_rx[peer]
        .as_ref()
        .filter(|r| len <= r.slot_bytes())
        .and_then(|r| r.slot(slot))
        .ok_or_else(|| format!("bad shared-memory frame (slot {slot}, {len} bytes)"))?;
    // SAFETY: the sender filled the slot and then sent this header; it does
    // not touch the slot again until our credit (see `crate::shm`).
    let data = unsafe { std::slice::from_raw_parts(src.cast_const(), len) };
    let p2p = matches!(h.fingerprint.op, OpKind::Send | OpKind::Recv);
    let key = (h.fingerprint.group, peer, h.fingerprint.seq, h.tag);
    let applied = !p2p && {
        let mut reg = lock(&inner.direct);
        let fits = reg
            .posted
            .get(&key)
            .is_some_and(|d| d.fp == h.fingerprint && d.len == len && reg.live.contains(&d.call));
        match reg.posted.remove(&key).filter(|_| fits) {
            Some(d) => {
                // SAFETY: the registering call is live, the range is its
                // own, and we hold the registry lock (see `Registry`).
                let dst = unsafe { std::slice::from_raw_parts_mut(d.dst, len) };
                if let Some(e) = apply(d.reduce, dst, data) {
                    lock(&inner.engine).protocol_error(peer, e);
                }
                true
            }
            None => false,
        }
    };
    if applied {
        lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Done);
    } else {
        // Not posted yet: leave the payload in the slot; the call applies it
        // from there when it posts the receive, then returns the slot.
        let frame = Frame {
            fp: h.fingerprint,
            payload: Vec::new(),
            slot: Some((slot, len)),
        };
        lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Frame(frame));
        inner.notify.notify_waiters();
        return Ok(());
    }
    inner.notify.notify_waiters();
    send_credit(inner, peer, h.fingerprint, slot).await;
    Ok(())
}

/// Hands slot `slot` back to `peer`.
async fn send_credit(inner: &Inner, peer: usize, fp: Fingerprint, slot: usize) {
    let credit = FrameHeader {
        kind: FrameKind::Abort,
        fingerprint: fp,
        tag: CREDIT_TAG,
        offset: slot as u64,
        payload_len: 0,
        flags: 0,
    }
    .encode();
    if let Some(w) = inner.writers[peer].first() {
        // A peer that has finished and exited needs no credit back; a
        // broken connection shows up as EOF on this reader anyway.
        let _ = write_frame(w, &[&credit]).await;
    }
}

/// One stream's write half, and whether a frame on it was cut off.
pub(crate) struct Writer {
    w: BoxWrite,
    /// Set while a frame is being written, cleared when it is whole: still
    /// set afterwards means the writing future was dropped mid-frame (a
    /// deadline), and the peer would read the next frame's bytes as the rest
    /// of this one.
    cut: bool,
}

/// Writes one whole frame on `w`, or refuses: a stream that once carried a
/// cut-off frame carries nothing more, so a timeout never desynchronises
/// it (the peer waits for the missing bytes, then sees the connection end).
async fn write_frame(w: &tokio::sync::Mutex<Writer>, parts: &[&[u8]]) -> std::io::Result<()> {
    let mut g = w.lock().await;
    if g.cut {
        return Err(std::io::Error::other(
            "an earlier frame on this connection was cut off by a deadline; it carries no more \
             frames",
        ));
    }
    g.cut = true;
    write_all_vectored(&mut g.w, parts).await?;
    g.cut = false;
    Ok(())
}

const CREDIT_TAG: u32 = u32::MAX - 2;

/// Bounds of a shared-memory slot (the segment size, clamped); a peer's
/// announced slot size outside them is refused.
const SLOT_MIN: usize = 64 * 1024;
const SLOT_MAX: usize = 16 << 20;
const PROBE_TAG: u32 = u32::MAX;
const PROBE_REPLY_TAG: u32 = u32::MAX - 1;

/// A probe (or probe reply) frame: an Abort-kind header whose fingerprint
/// is the sender's current call (op NewGroup when it is in none).
fn probe_frame(tag: u32, fp: Option<Fingerprint>) -> [u8; HEADER_LEN] {
    let fingerprint = fp.unwrap_or(Fingerprint {
        group: GroupId::WORLD,
        seq: 0,
        op: OpKind::NewGroup,
        dtype: DType::U8,
        count: 0,
        root: 0,
        reduce_op: None,
    });
    FrameHeader {
        kind: FrameKind::Abort,
        fingerprint,
        tag,
        offset: 0,
        payload_len: 0,
        flags: 0,
    }
    .encode()
}

/// A call's buffers as raw parts, so that reader tasks can write posted
/// receives in place while the call runs (see `Registry`).
struct RawBufs {
    dtype: DType,
    input: (*const u8, usize),
    output: (*mut u8, usize),
    scratch: (*mut u8, usize),
}

// SAFETY: the parts point into buffers that the call's future borrows for
// its whole life; they are dereferenced only under the rules of `Registry`.
unsafe impl Send for RawBufs {}
// SAFETY: as above.
unsafe impl Sync for RawBufs {}

impl RawBufs {
    /// The start of `range` in `buf`, if it lies inside it.
    fn ptr(&self, buf: Buf, range: &std::ops::Range<usize>) -> Option<*mut u8> {
        let e = self.dtype.size_bytes();
        let (base, len) = match buf {
            Buf::Input => (self.input.0.cast_mut(), self.input.1),
            Buf::Output => self.output,
            Buf::Scratch => self.scratch,
        };
        (range.end * e <= len).then(|| base.wrapping_add(range.start * e))
    }

    /// The bytes of `range` in `buf`.
    ///
    /// # Safety
    ///
    /// No one may write that range while the slice lives.
    unsafe fn bytes(&self, buf: Buf, range: &std::ops::Range<usize>) -> &[u8] {
        let e = self.dtype.size_bytes();
        match self.ptr(buf, range) {
            // SAFETY: in bounds (checked by `ptr`); the caller excludes writers.
            Some(p) => unsafe { std::slice::from_raw_parts(p, range.len() * e) },
            None => &[],
        }
    }

    /// Every buffer, for a copy, an apply or finalize.
    ///
    /// # Safety
    ///
    /// The registry lock must be held (no reader writes meanwhile).
    unsafe fn buffers(&self) -> CallBuffers<'_> {
        // SAFETY: the parts come from the call's live buffers, which do not
        // overlap; the caller holds the lock that keeps readers out.
        unsafe {
            CallBuffers {
                dtype: self.dtype,
                input: std::slice::from_raw_parts(self.input.0, self.input.1),
                output: std::slice::from_raw_parts_mut(self.output.0, self.output.1),
                scratch: std::slice::from_raw_parts_mut(self.scratch.0, self.scratch.1),
            }
        }
    }
}

/// Removes a call and its posted receives from the in-place registry when
/// it ends (returns, fails, or is cancelled), before its buffers can go
/// away.
struct DirectGuard<'a>(&'a Inner, u64);

impl Drop for DirectGuard<'_> {
    fn drop(&mut self) {
        let mut reg = lock(&self.0.direct);
        reg.live.remove(&self.1);
        let call = self.1;
        reg.posted.retain(|_, d| d.call != call);
    }
}

impl TcpBackend {
    /// Sends a frame to `to` on stream `lane % streams` (frames of one lane
    /// keep their order; lanes spread over the streams).
    async fn send_frame(
        &self,
        to: usize,
        lane: u32,
        header: &[u8],
        payload: &[u8],
    ) -> std::io::Result<()> {
        let ws = &self.inner.writers[to];
        if ws.is_empty() {
            return Err(std::io::Error::other("no connection to self"));
        }
        write_frame(&ws[lane as usize % ws.len()], &[header, payload]).await
    }

    /// Sends one data frame to `to`: through a shared-memory slot when the
    /// peer is on this host and the payload fits, else on the TCP stream.
    async fn send(
        &self,
        to: usize,
        tag: u32,
        fp: Fingerprint,
        offset: usize,
        payload: &[u8],
    ) -> std::io::Result<()> {
        if let Some(tx) = self.inner.shm_tx.get(to).and_then(Option::as_ref)
            && payload.len() <= tx.slot_bytes
        {
            let slot = loop {
                let credit = tx.credit.notified();
                let mut credit = std::pin::pin!(credit);
                credit.as_mut().enable();
                if let Some(i) = tx.take() {
                    break i;
                }
                if lock(&self.inner.engine).is_lost(to) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::BrokenPipe,
                        "peer gone",
                    ));
                }
                // Credits come from the reader task; wake now and then to
                // notice a lost peer.
                let _ = tokio::time::timeout(Duration::from_millis(50), credit).await;
            };
            let dst = tx
                .region
                .slot(slot)
                .ok_or_else(|| std::io::Error::other("bad slot"))?;
            // SAFETY: this side owns `slot` until the peer's credit; the slot
            // holds `slot_bytes >= payload.len()` bytes.
            unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), dst, payload.len()) };
            let mut h = FrameHeader::data(fp, tag, slot as u64, payload.len() as u64);
            h.flags = FLAG_SHM;
            return self.send_frame(to, tag, &h.encode(), &[]).await;
        }
        let h = FrameHeader::data(fp, tag, offset as u64, payload.len() as u64).encode();
        self.send_frame(to, tag, &h, payload).await
    }

    /// Registers a call with the engine, which fixes its sequence number
    /// now, and returns the work that drives it.
    fn start<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        let ctx = ErrorContext {
            op: Some(op.kind()),
            rank: Some(self.me),
            group: Some(self.group),
            ..Default::default()
        };
        let req = match Call::from_op("tcp", self.me, self.members.len(), op, opts) {
            Ok(req) => req,
            Err(e) => return Work::ready(Err(e.with_context(ctx))),
        };
        let group = self.group;
        let begun =
            lock(&self.inner.engine).begin(group, req.op, |seq| req.fingerprint(group, seq));
        let begun = match begun {
            Ok(b) => b,
            Err(e) => return Work::ready(Err(e)),
        };
        let opts = *opts;
        let guard = CallGuard {
            inner: &self.inner,
            id: begun.id,
            armed: true,
        };
        Work::new(async move {
            // Move the whole guard in (a field use alone would capture only
            // the field): dropping this future cancels the call.
            let mut guard = guard;
            let mut req = req;
            let result = self.drive(&mut req, &opts, &begun).await;
            guard.armed = false;
            let ended = lock(&self.inner.engine).end(begun.id, result);
            if let Some(abort) = ended.abort {
                propagate(&self.inner, abort).await;
            }
            self.inner.notify.notify_waiters();
            ended.result
        })
    }

    async fn drive(&self, req: &mut Call<'_>, opts: &CallOptions, begun: &Begun) -> Result<()> {
        let inner = &self.inner;
        let (r, n) = (self.me, self.members.len());
        let (fp, seq, eid) = (begun.fp, begun.seq, begun.id);
        let p2p = req.is_p2p();
        let spec = req.spec(r, n);
        let algo = self.opts.algo.select(req.op, spec.bytes(), n);
        let mut schedule = build(&spec, algo, &self.opts.algo)?;
        let mut scratch_store = scratch(schedule.scratch_len(), req.dtype);
        let (reduce, finalize, dtype) = (req.reduce, req.finalize, req.dtype);
        let raw = RawBufs {
            dtype,
            input: (req.input_bytes().as_ptr(), req.input_bytes().len()),
            output: (req.output.as_mut_ptr(), req.output.len()),
            scratch: {
                let b = scratch_bytes(&mut scratch_store);
                (b.as_mut_ptr(), b.len())
            },
        };
        let call_id = {
            let mut reg = lock(&inner.direct);
            reg.next_call += 1;
            let id = reg.next_call;
            reg.live.insert(id);
            id
        };
        // Unregisters the call's receives when it ends, however it ends.
        let _direct = DirectGuard(inner, call_id);
        let timeout = opts.timeout_or(self.opts.timeout);
        let deadline = consort_comm::time::deadline(timeout);
        let mut posted: Vec<Receive> = Vec::new();
        let mut last_progress = Instant::now();
        let mut probed = false;
        let outcome: Result<()> = 'call: loop {
            while let Some(a) = schedule.poll() {
                match a {
                    Action::Transmit(tx) => {
                        // SAFETY: a range being sent is never a posted
                        // receive's range (see `Registry`).
                        let payload = unsafe { raw.bytes(tx.buf, &tx.range) };
                        let to = self.members[tx.to];
                        let sent =
                            before(deadline, self.send(to, tx.tag, fp, tx.range.start, payload))
                                .await;
                        match sent {
                            Some(Ok(())) => {}
                            Some(Err(e)) => {
                                // A peer that failed first usually said why
                                // before closing: report that cause.
                                let waiting = schedule.waiting_on();
                                let said = lock(&inner.engine).failure(eid, &waiting);
                                break 'call Err(said.unwrap_or_else(|| CommError::PeerLost {
                                    ctx: ErrorContext::default(),
                                    peer: tx.to,
                                    reason: format!("send failed: {e}"),
                                }));
                            }
                            None => {
                                break 'call Err(CommError::Timeout {
                                    ctx: ErrorContext::default(),
                                    after: timeout,
                                    waiting_on: vec![tx.to],
                                });
                            }
                        }
                    }
                    Action::Copy(c) => {
                        let reg = lock(&inner.direct);
                        // SAFETY: readers are excluded by the lock.
                        let copied = unsafe { raw.buffers() }.copy(&c);
                        drop(reg);
                        if let Err(e) = copied {
                            break 'call Err(e);
                        }
                    }
                    Action::Receive(rv) => {
                        let bytes = rv.range.len() * dtype.size_bytes();
                        if !p2p
                            && bytes >= self.opts.in_place_min
                            && let Some(dst) = raw.ptr(rv.buf, &rv.range)
                        {
                            let direct = Direct {
                                call: call_id,
                                fp,
                                dst,
                                len: bytes,
                                reduce: rv.reduce.then(|| (reduce.unwrap_or(ReduceOp::Sum), dtype)),
                            };
                            let key = (self.group, self.members[rv.from], seq, rv.tag);
                            lock(&inner.direct).posted.insert(key, direct);
                        }
                        posted.push(rv);
                    }
                }
            }
            if schedule.is_done() {
                break Ok(());
            }
            let notified = inner.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            // Take whatever has arrived for the posted receives.
            let mut got: Vec<(Receive, Frame)> = Vec::new();
            let mut done: Vec<Receive> = Vec::new();
            {
                let mut engine = lock(&inner.engine);
                let mut bad = None;
                posted.retain(|rv| match engine.take(eid, rv.from, rv.tag) {
                    None => true,
                    Some(Ok(Got::Done)) => {
                        done.push(rv.clone());
                        false
                    }
                    Some(Ok(Got::Frame(f))) => {
                        got.push((rv.clone(), f));
                        false
                    }
                    Some(Err(e)) => {
                        bad.get_or_insert(e);
                        false
                    }
                });
                if let Some(e) = bad {
                    break 'call Err(e);
                }
                // A peer that failed, a broken frame, or a lost peer this
                // call still waits on. (Peers that finished and exited are
                // fine: this call no longer needs them.)
                if got.is_empty()
                    && done.is_empty()
                    && let Some(e) = engine.failure(eid, &schedule.waiting_on())
                {
                    break 'call Err(e);
                }
            }
            for rv in &done {
                if let Err(e) = schedule.handle_recv(rv.from, rv.tag) {
                    break 'call Err(CommError::protocol(Some(rv.from), e.to_string()));
                }
            }
            let progressed = !done.is_empty() || !got.is_empty();
            if progressed {
                last_progress = Instant::now();
                probed = false;
            }
            for (rv, f) in got {
                let applied = {
                    let mut reg = lock(&inner.direct);
                    // The frame came the buffered way: its in-place
                    // registration must go before the range is reused.
                    reg.posted
                        .remove(&(self.group, self.members[rv.from], seq, rv.tag));
                    let data: &[u8] = match f.slot {
                        Some((slot, len)) => {
                            let from = self.members[rv.from];
                            match inner.shm_rx[from].as_ref().and_then(|r| r.slot(slot)) {
                                // SAFETY: the peer filled the slot before
                                // sending its header and waits for our
                                // credit before touching it again.
                                Some(p) => unsafe {
                                    std::slice::from_raw_parts(p.cast_const(), len)
                                },
                                None => &[],
                            }
                        }
                        None => &f.payload,
                    };
                    // SAFETY: readers are excluded by the lock.
                    unsafe { raw.buffers() }.apply(&rv, data, reduce, rv.from)
                };
                if let Some((slot, _)) = f.slot {
                    send_credit(inner, self.members[rv.from], f.fp, slot).await;
                }
                inner.recycle(f.payload);
                if let Err(e) = applied {
                    break 'call Err(e);
                }
                if let Err(e) = schedule.handle_recv(rv.from, rv.tag) {
                    break 'call Err(CommError::protocol(Some(rv.from), e.to_string()));
                }
            }
            if progressed {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(CommError::Timeout {
                    ctx: ErrorContext::default(),
                    after: timeout,
                    waiting_on: schedule.waiting_on(),
                });
            }
            // A call that makes no progress asks the peers it waits on what
            // they are doing: a peer in another call at this seq is a
            // mismatch that no frame would reveal.
            if !p2p && !probed && now.duration_since(last_progress) >= self.opts.stall_probe {
                probed = true;
                let probe = probe_frame(PROBE_TAG, Some(fp));
                for q in schedule.waiting_on() {
                    let _ = before(
                        now + Duration::from_secs(1),
                        self.send_frame(self.members[q], 0, &probe, &[]),
                    )
                    .await;
                }
            }
            let wake =
                deadline.min(last_progress + self.opts.stall_probe.max(Duration::from_millis(10)));
            let wake = if wake <= now { deadline } else { wake };
            let _ = before(wake, notified).await;
        };
        if outcome.is_ok()
            && finalize
            && let Some(op) = reduce
        {
            let _reg = lock(&inner.direct);
            // SAFETY: readers are excluded by the lock.
            unsafe { raw.buffers() }.finalize(op, n)?;
        }
        outcome
    }
}

/// Tells world ranks `to` about a failure in call `fp` (best effort).
async fn propagate(inner: &Inner, (info, fp, to): (AbortInfo, Fingerprint, Vec<usize>)) {
    let info = info.encode();
    let h = FrameHeader {
        kind: FrameKind::Abort,
        fingerprint: fp,
        tag: 0,
        offset: 0,
        payload_len: info.len() as u64,
        flags: 0,
    }
    .encode();
    for q in to {
        let Some(ws) = inner.writers.get(q).filter(|w| !w.is_empty()) else {
            continue;
        };
        let _ = before(
            Instant::now() + Duration::from_secs(2),
            write_frame(&ws[0], &[&h, &info]),
        )
        .await;
    }
}

/// Cancels a call whose work is dropped before it ends: the engine poisons
/// its group, and the peers are told (from a spawned task: a drop cannot
/// wait).
struct CallGuard<'a> {
    inner: &'a Arc<Inner>,
    id: CallId,
    armed: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let abort = lock(&self.inner.engine).cancel(self.id);
        self.inner.notify.notify_waiters();
        if let (Some(abort), Ok(rt)) = (abort, tokio::runtime::Handle::try_current()) {
            let inner = self.inner.clone();
            rt.spawn(async move { propagate(&inner, abort).await });
        }
    }
}

#[async_trait]
impl Backend for TcpBackend {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn group_id(&self) -> GroupId {
        self.group
    }

    fn default_timeout(&self) -> Duration {
        self.opts.timeout
    }

    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        self.start(op, opts)
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        Ok(self
            .subgroup(ranks, opts)?
            .map(|b| Arc::new(b) as Arc<dyn Backend>))
    }
}

impl TcpBackend {
    /// The mesh ranks this rank sends to through shared memory (peers on
    /// this host, when `TcpOptions::shm` is on and the regions mapped).
    pub fn shared_memory_peers(&self) -> Vec<usize> {
        let tx = &self.inner.shm_tx;
        (0..tx.len()).filter(|&p| tx[p].is_some()).collect()
    }

    /// A subgroup on this mesh (see [`Backend::new_group`]); the QUIC
    /// backend wraps the handle it returns.
    pub fn subgroup(&self, ranks: &[usize], opts: &CallOptions) -> Result<Option<TcpBackend>> {
        let made = lock(&self.inner.engine).make_group(self.group, ranks)?;
        let Some((id, members, me)) = made else {
            return Ok(None);
        };
        let mut topts = self.opts.clone();
        if let Some(t) = opts.timeout {
            topts.timeout = t;
        }
        Ok(Some(TcpBackend {
            inner: self.inner.clone(),
            opts: topts,
            group: id,
            members: members.into(),
            me,
            owner: false,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncReadExt;

    use super::{BoxWrite, Writer, write_frame};

    /// A frame whose write a deadline cuts off leaves the stream refusing
    /// every later frame, so the peer never reads another frame's bytes as
    /// the rest of the cut one.
    #[tokio::test]
    async fn a_frame_cut_by_a_deadline_closes_the_stream_to_further_frames() {
        let (a, mut b) = tokio::io::duplex(64);
        let w = tokio::sync::Mutex::new(Writer {
            w: Box::pin(a) as BoxWrite,
            cut: false,
        });
        write_frame(&w, &[b"whole"]).await.unwrap();
        let big = vec![7u8; 4096];
        let cut = tokio::time::timeout(Duration::from_millis(50), write_frame(&w, &[&big])).await;
        assert!(cut.is_err(), "the peer reads nothing: the write must block");
        let e = write_frame(&w, &[b"abort"]).await.unwrap_err();
        assert!(e.to_string().contains("cut off"), "{e}");
        // The peer sees the whole first frame, then only the cut one's
        // prefix: never "abort".
        let mut got = vec![0u8; 64];
        b.read_exact(&mut got).await.unwrap();
        drop(w);
        let mut rest = Vec::new();
        b.read_to_end(&mut rest).await.unwrap();
        assert!(
            rest.iter().all(|&x| x == 7),
            "nothing follows the cut frame"
        );
        assert_eq!(&got[..5], b"whole");
        assert!(got[5..].iter().all(|&x| x == 7));
    }
}
