//! The TCP backend: [`TcpBackend`] drives `consort_comm::algo`'s schedules
//! over a full mesh of TCP connections, one per pair of ranks.
//!
//! This module owns the transport: rendezvous of listen addresses through
//! the store, the connection handshake, one reader task per peer that
//! decodes frames into an inbox, vectored writes straight from the caller's
//! buffer, and the failure rules (abort propagation, `PeerLost` from EOF,
//! sticky errors, stall probes). It owns no algorithm.
//!
//! [`connect`] makes the mesh, [`read`] runs the reader tasks, and
//! [`drive`] sends frames and drives one call; this file holds the types
//! they share, the `Backend` impl and subgroups.

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
    /// Where this rank writes its flight record (`rank-K.json`) when a call
    /// fails, a peer aborts, or [`dump_flight_records`] asks; `None` keeps
    /// the record in memory only. `consort run` sets `CONSORT_FLIGHT_DIR`
    /// for its workers, which `init_from_env` passes here.
    pub flight_dir: Option<std::path::PathBuf>,
    /// The heartbeat file this rank keeps for its agent's watchdog
    /// ([`crate::heartbeat`]); `consort run` sets `CONSORT_HEARTBEAT_FILE`.
    pub heartbeat_file: Option<std::path::PathBuf>,
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
            flight_dir: None,
            heartbeat_file: None,
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
    /// Where the flight record goes.
    flight: flight::FlightOut,
    /// The agent's view of this rank's progress.
    beat: Option<Arc<crate::heartbeat::Heartbeat>>,
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

mod connect;
mod drive;
mod flight;
mod read;

pub use flight::dump_flight_records;

use self::{drive::*, read::*};

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
