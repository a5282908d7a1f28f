//! consort-shm: the same-host transport. Peers on one host talk through
//! per-pair shared-memory queues that the waiting calls poll, with no
//! socket and no system call per message; headers and payloads travel
//! together, copied once in and once out.
//!
//! This crate owns moving bytes and failure signals only (the driver and
//! its rules are consort-mesh's):
//!
//! - `queue`: one direction of a pair, a lock-free byte queue;
//! - `region`: sealed memfds that hold them, and [`ShmTransport`]'s host
//!   identity;
//! - `bell`: the datagram a side rings when the other sleeps;
//! - `stage`: each rank's stage, which it alone writes and every peer
//!   maps read-only: a payload several peers need (a large broadcast's
//!   segment) is copied in once and read out by all of them at once;
//! - `cma`: single-copy large messages, read by the receiver straight
//!   from the sender's memory (`process_vm_readv`), where the kernel
//!   allows it; elsewhere they go through the queues;
//! - the failure signals: a peer that drops its mesh closes its queues;
//!   a peer process that dies is seen through a pidfd.
//!
//! Give a [`ShmTransport`] to `MeshOptions::local`, and the mesh uses it
//! for every peer with the same host identity; the rest go over the
//! network.
//!
//! # Example
//!
//! `Dist::process_group` does this by default (`CONSORT_SHM=0` turns it
//! off; the other variables are listed in `consort::env`). By hand, for
//! `consort_tcp::connect` (its `TcpOptions` is `MeshOptions`):
//!
//! ```
//! use consort_mesh::MeshOptions;
//! use consort_shm::ShmTransport;
//!
//! let shm = ShmTransport {
//!     queue_bytes: 8 << 20, // each direction of each pair; a power of two
//!     ..ShmTransport::default()
//! };
//! let opts = MeshOptions {
//!     local: Some(shm.shared()), // same host: shared memory; other hosts: TCP
//!     ..MeshOptions::default()
//! };
//! assert!(opts.local.is_some());
//! ```

mod bell;
mod cma;
mod queue;
mod region;
mod stage;

use std::{
    io,
    os::unix::net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use async_trait::async_trait;
use consort_mesh::{LocalSetup, LocalTransport, PolledLink};
use tokio::{io::unix::AsyncFd, sync::Notify, task::JoinHandle};

use crate::{
    bell::Bell,
    queue::Queue,
    region::Region,
    stage::{PeerStage, STAGED, Stage},
};

/// The same-host transport, for `MeshOptions::local`.
#[derive(Clone, Debug)]
pub struct ShmTransport {
    /// Bytes of each direction's queue (a power of two, at least 64 KiB).
    /// Default 4 MiB; `CONSORT_SHM_QUEUE_BYTES` sets it under
    /// `init_from_env`. Queues are mapped whole at set-up (a queue first
    /// used page by page made its first ~1000 small calls 2-3× slower), so
    /// a host of `n` ranks holds `n(n-1)` of them: 960 MiB at 16 ranks.
    pub queue_bytes: usize,
    /// Let peers read large payloads straight from this process's memory
    /// (CMA), where the kernel allows it: every schedule's but recursive
    /// doubling's (a reduction reduces what it reads through a bounce
    /// buffer)
    /// (`CONSORT_ALGO=broadcast=direct` then makes every reader copy from
    /// the root once). Default off: on the machines measured so
    /// far (see BENCHMARKS.md), `process_vm_readv` pins pages at about half
    /// the speed of a copy, and the two copies through a cache-sized queue
    /// win. `CONSORT_SHM_CMA=1` turns it on.
    pub cma: bool,
    /// Bytes of this rank's stage (a power of two, at least 64 KiB; 0: no
    /// stage), which every same-host peer maps read-only: a large
    /// broadcast's root copies each segment in once and all its readers
    /// copy it out at once (the `direct` broadcast, which the mesh chooses
    /// for ranks on one host when every rank has a stage).
    /// Default 4 MiB; `CONSORT_SHM_STAGE_BYTES` sets it under
    /// `init_from_env`.
    pub stage_bytes: usize,
}

impl Default for ShmTransport {
    fn default() -> Self {
        ShmTransport {
            queue_bytes: 4 << 20,
            cma: false,
            stage_bytes: 4 << 20,
        }
    }
}

impl ShmTransport {
    /// The transport as an `Arc<dyn LocalTransport>`, for `MeshOptions`.
    pub fn shared(self) -> Arc<dyn LocalTransport> {
        Arc::new(self)
    }
}

/// One peer's queues, its bell, and whether it is gone.
struct ShmLink {
    out: Queue,
    inbox: Queue,
    /// The peer's process, and whether this rank can read its memory.
    peer_pid: u32,
    /// Whether the peer can read this process's memory.
    peer_pulls: bool,
    /// Whether this rank reads the peer's memory (its pull frames).
    reads_peer: bool,
    /// This rank's stage (shared by its links), if the peer maps it.
    stage: Option<Arc<Stage>>,
    /// The peer's stage, mapped read-only, if it has one.
    peer_stage: Option<PeerStage>,
    peer_bell: SocketAddr,
    bell: Arc<Bell>,
    /// Set when the peer's process exits (its pidfd).
    dead: Arc<AtomicBool>,
    /// Set when this side closed the link: nothing more goes either way.
    closed: AtomicBool,
    watch: Option<JoinHandle<()>>,
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.out.close_writer();
        self.inbox.close_reader();
        self.bell.ring(&self.peer_bell);
        if let Some(w) = &self.watch {
            w.abort();
        }
    }
}

impl PolledLink for ShmLink {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn push(&self, parts: &[&[u8]], from: usize) -> usize {
        if self.closed.load(Ordering::SeqCst) {
            return 0;
        }
        // A piece at a time (see `queue::PIECE`), up to one queue's worth.
        let mut done = 0;
        loop {
            let (n, wake) = self.out.push(parts, from + done);
            if wake {
                self.bell.ring(&self.peer_bell);
            }
            done += n;
            if n < queue::PIECE || done >= self.out.cap() {
                return done;
            }
        }
    }

    fn push_whole(&self, parts: &[&[u8]]) -> bool {
        if self.closed.load(Ordering::SeqCst) {
            return false;
        }
        match self.out.push_whole(parts) {
            Some(wake) => {
                if wake {
                    self.bell.ring(&self.peer_bell);
                }
                true
            }
            None => false,
        }
    }

    fn pull(&self, take: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize, String> {
        if self.closed.load(Ordering::SeqCst) {
            return Err("this rank closed the link".into());
        }
        // Read `dead` before the queue: whatever the peer wrote before it
        // died is then taken before its loss is reported.
        let dead = self.dead.load(Ordering::SeqCst);
        // A piece at a time (see `queue::PIECE`), up to one queue's worth.
        let mut n = 0;
        let closed = loop {
            let (m, wake, shut) = self.inbox.pull(take)?;
            if wake {
                self.bell.ring(&self.peer_bell);
            }
            n += m;
            if m < queue::PIECE || n >= self.inbox.cap() {
                break shut;
            }
        };
        if n == 0 && closed {
            return Err("the peer closed its shared-memory queues (its group was dropped)".into());
        }
        if n == 0 && dead {
            return Err("its process exited or crashed (seen through its pidfd)".into());
        }
        Ok(n)
    }

    fn arm(&self) {
        self.inbox.arm_reader();
        self.out.arm_writer();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
            || self.dead.load(Ordering::SeqCst)
            || self.out.reader_closed()
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.out.close_writer();
        self.inbox.close_reader();
        self.bell.ring(&self.peer_bell);
    }

    fn peer_pulls(&self) -> bool {
        self.peer_pulls
    }

    fn stage(&self, bytes: &[u8]) -> Option<u64> {
        self.stage.as_ref()?.put(bytes)
    }

    fn free_stage(&self, upto: Option<u64>) {
        match (&self.stage, upto) {
            (Some(s), Some(upto)) => s.free(upto),
            (Some(s), None) => s.free_all(),
            (None, _) => {}
        }
    }

    fn peer_reads_stage(&self) -> bool {
        self.stage.is_some()
    }

    fn read_peer(&self, addr: u64, dst: &mut [u8]) -> io::Result<()> {
        self.read_from_peer(addr, dst, false)
    }

    fn read_peer_streaming(&self, addr: u64, dst: &mut [u8]) -> io::Result<()> {
        self.read_from_peer(addr, dst, true)
    }

    fn with_staged(&self, addr: u64, len: usize, f: &mut dyn FnMut(&[u8])) -> io::Result<bool> {
        match &self.peer_stage {
            Some(st) if addr & STAGED != 0 => st.with(addr, len, f).map(|()| true),
            _ => Ok(false),
        }
    }

    fn count_pull(&self) {
        if self.inbox.count_pull() {
            self.bell.ring(&self.peer_bell);
        }
    }

    fn pulls_read(&self) -> u64 {
        self.out.pulls_read()
    }

    fn revoke(&self, upto: u64) {
        self.out.revoke(upto);
    }

    fn revoked(&self) -> u64 {
        self.inbox.revoked()
    }
}

impl ShmLink {
    /// Reads a pull frame's payload: from the peer's stage (a staged
    /// address; `streaming`: with stores that bypass the caches, for a
    /// destination nothing reads again soon), or from its memory (CMA).
    fn read_from_peer(&self, addr: u64, dst: &mut [u8], streaming: bool) -> io::Result<()> {
        if addr & STAGED != 0 {
            return match &self.peer_stage {
                Some(st) => st.read(addr, dst, streaming),
                None => Err(bad("a staged payload from a peer that offered no stage")),
            };
        }
        if !self.reads_peer {
            return Err(bad(
                "a pull frame from a peer whose memory this rank does not read (CMA is off)",
            ));
        }
        cma::read(self.peer_pid, addr, dst)
    }
}

/// What a rank publishes for one peer: its queue toward it, its bell and
/// its pid.
struct Offer {
    region: String,
    cap: usize,
    bell: String,
    pid: u32,
    /// Where the peer may test reading this process ([`cma::Probe`]), if
    /// this rank lets it.
    probe: Option<cma::Probe>,
    /// This rank's stage and its size, if it has one (the same in every
    /// offer it makes).
    stage: Option<(String, usize)>,
}

impl Offer {
    fn encode(&self) -> String {
        let probe = self.probe.map_or("-".to_string(), |p| p.encode());
        let stage = self
            .stage
            .as_ref()
            .map_or("-".to_string(), |(name, cap)| format!("{name} {cap}"));
        format!(
            "{}\n{}\n{}\n{}\n{probe}\n{stage}",
            self.region, self.cap, self.bell, self.pid
        )
    }

    fn decode(b: &[u8]) -> Option<Offer> {
        let s = std::str::from_utf8(b).ok()?;
        let mut l = s.split('\n');
        let o = Offer {
            region: l.next()?.to_string(),
            cap: l.next()?.parse().ok()?,
            bell: l.next()?.to_string(),
            pid: l.next()?.parse().ok()?,
            probe: match l.next()? {
                "-" => None,
                p => Some(cma::Probe::decode(p)?),
            },
            stage: match l.next()? {
                "-" => None,
                st => {
                    let (name, cap) = st.split_once(' ')?;
                    Some((name.to_string(), cap.parse().ok()?))
                }
            },
        };
        let stage_ok = o.stage.as_ref().is_none_or(|(n, _)| region::valid_name(n));
        (l.next().is_none() && region::valid_name(&o.region) && stage_ok).then_some(o)
    }
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Waits for a peer's process to exit, then marks it dead and wakes the
/// mesh. `None` for this very process (ranks that share a process see a
/// dropped peer through its closed queues).
fn watch(pid: u32, dead: Arc<AtomicBool>, wake: Arc<Notify>) -> io::Result<Option<JoinHandle<()>>> {
    if pid == std::process::id() {
        return Ok(None);
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: the AsyncFd owns the descriptor, which is neither replaced
    // nor closed while registered.
    let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(io::Error::from)?;
    Ok(Some(tokio::spawn(async move {
        // A pidfd becomes readable once the process has exited.
        let _ = fd.readable().await;
        dead.store(true, Ordering::SeqCst);
        wake.notify_waiters();
    })))
}

#[async_trait]
impl LocalTransport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    /// The host identity and a fresh nonce: the store keys of this mesh's
    /// offers carry both ends' nonces, so an offer left in the namespace by
    /// an earlier incarnation of a rank is never taken for this one's.
    fn card(&self) -> String {
        let n = nonce().unwrap_or_else(|_| {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            format!(
                "{:x}{:x}",
                std::process::id(),
                t.map_or(0, |d| d.as_nanos())
            )
        });
        let stage = match self.stage_bytes {
            0 => String::new(),
            n => format!("{STAGE_MARK}={n}"),
        };
        format!(
            "{QUEUE_LAYOUT} {}{CARD_NONCE}{n}{stage}",
            region::host_id().replace('\n', " ")
        )
    }

    /// The stage size the card names (0: none).
    fn stage_bytes(&self, card: &str) -> usize {
        card.rsplit_once(STAGE_MARK)
            .and_then(|(_, n)| n.strip_prefix('=')?.parse().ok())
            .unwrap_or(0)
    }

    fn can_connect(&self, mine: &str, theirs: &str) -> bool {
        host_of(mine) == host_of(theirs)
    }

    async fn connect(&self, setup: LocalSetup<'_>) -> io::Result<Vec<Box<dyn PolledLink>>> {
        let cap = self.queue_bytes;
        self.check_sizes()?;
        let store = setup.store;
        let (ns, rank) = (setup.namespace, setup.rank);
        let mut nonces: std::collections::HashMap<usize, &str> =
            setup.peers.iter().map(|(p, c)| (*p, nonce_of(c))).collect();
        nonces.insert(rank, nonce_of(setup.card));
        let key = |from: usize, to: usize| {
            format!("{ns}/shm/{from}to{to}/{}.{}", nonces[&from], nonces[&to])
        };
        let bell = Arc::new(Bell::bind(setup.wake.clone())?);
        let probe = if self.cma { cma::Probe::offer() } else { None };
        let left = || {
            setup
                .deadline
                .saturating_duration_since(std::time::Instant::now())
        };
        let store_err = |e: consort_comm::store::StoreError| io::Error::other(e.to_string());
        // This rank's stage, one for all its peers.
        let stage = self.make_stage(rank)?;
        // 1. A queue toward every peer, offered under a key of its own.
        let mut outs = Vec::new();
        for &(p, _) in setup.peers {
            let fallback = format!("consort-{}-{rank}to{p}-{}", std::process::id(), nonce()?);
            let (name, region) = Region::create(&fallback, Queue::region_len(cap))?;
            let offer = Offer {
                region: name.clone(),
                cap,
                bell: bell.name().to_string(),
                pid: std::process::id(),
                probe,
                stage: stage.as_ref().map(|(n, _)| (n.clone(), self.stage_bytes)),
            };
            store
                .set(&key(rank, p), offer.encode().as_bytes())
                .await
                .map_err(store_err)?;
            outs.push((name, region));
        }
        // 2. Map every peer's queue toward this rank and its stage, and say
        // so.
        let mut ins = Vec::new();
        for &(p, _) in setup.peers {
            let k = key(p, rank);
            store.wait(&[&k], left()).await.map_err(store_err)?;
            let raw = store.get(&k).await.map_err(store_err)?;
            let (inbox, offer, peer_stage, said) = self.map_peer(p, &raw)?;
            store
                .set(&format!("{k}/mapped"), said.as_bytes())
                .await
                .map_err(store_err)?;
            let reads_peer = said.starts_with("cma");
            ins.push((inbox, offer, peer_stage, reads_peer));
        }
        // 3. Once each peer has mapped this rank's queue (and stage), their
        // names go.
        let mut acks = Vec::new();
        for &(p, _) in setup.peers {
            let mapped = format!("{}/mapped", key(rank, p));
            store.wait(&[&mapped], left()).await.map_err(store_err)?;
            acks.push(store.get(&mapped).await.map_err(store_err)?);
        }
        // Every peer has mapped the stage: its name goes.
        let stage = stage
            .map(|(name, mut region)| {
                region.unlink(&name);
                Stage::new(region)
                    .map(Arc::new)
                    .ok_or_else(|| bad("bad stage size"))
            })
            .transpose()?;
        let mut links: Vec<Box<dyn PolledLink>> = Vec::new();
        let made = outs.into_iter().zip(ins).zip(acks);
        for (((name, mut region), (inbox, offer, peer_stage, reads_peer)), ack) in made {
            region.unlink(&name);
            let dead = Arc::new(AtomicBool::new(false));
            links.push(Box::new(ShmLink {
                out: Queue::new(region).ok_or_else(|| bad("bad queue size"))?,
                inbox,
                peer_pid: offer.pid,
                peer_pulls: ack.starts_with(b"cma"),
                reads_peer,
                // Only a peer that mapped it reads it.
                stage: stage
                    .clone()
                    .filter(|_| ack.ends_with(STAGE_MARK.as_bytes())),
                peer_stage,
                peer_bell: bell::address(&offer.bell)?,
                bell: bell.clone(),
                watch: watch(offer.pid, dead.clone(), setup.wake.clone())?,
                dead,
                closed: AtomicBool::new(false),
            }));
        }
        Ok(links)
    }
}

impl ShmTransport {
    /// This rank's stage region and the name peers open it by, if it has
    /// one.
    fn make_stage(&self, rank: usize) -> io::Result<Option<(String, Region)>> {
        if self.stage_bytes == 0 {
            return Ok(None);
        }
        let fallback = format!("consort-{}-{rank}stage-{}", std::process::id(), nonce()?);
        Region::create(&fallback, self.stage_bytes).map(Some)
    }

    /// The queue and stage sizes are usable.
    fn check_sizes(&self) -> io::Result<()> {
        let (cap, st) = (self.queue_bytes, self.stage_bytes);
        if !cap.is_power_of_two() || cap < queue::MIN_CAP {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the shared-memory queue size must be a power of two of at least {} bytes, \
                     not {cap} (CONSORT_SHM_QUEUE_BYTES)",
                    queue::MIN_CAP
                ),
            ));
        }
        if st != 0 && (!st.is_power_of_two() || st < stage::MIN_STAGE) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the shared-memory stage size must be 0 (none) or a power of two of at least \
                     {} bytes, not {st} (CONSORT_SHM_STAGE_BYTES)",
                    stage::MIN_STAGE
                ),
            ));
        }
        Ok(())
    }

    /// Maps peer `p`'s queue toward this rank and its stage, from its offer
    /// `raw`; returns them with what to tell the peer (whether this rank
    /// reads its memory, and its stage).
    fn map_peer(
        &self,
        p: usize,
        raw: &[u8],
    ) -> io::Result<(Queue, Offer, Option<PeerStage>, String)> {
        let offer =
            Offer::decode(raw).ok_or_else(|| bad(format!("rank {p}'s offer is malformed")))?;
        let region = Region::open(&offer.region, Queue::region_len(offer.cap))
            .map_err(|e| bad(format!("mapping rank {p}'s queue: {e}")))?;
        let inbox = Queue::new(region)
            .ok_or_else(|| bad(format!("rank {p}'s queue has a bad size ({})", offer.cap)))?;
        let peer_stage = match &offer.stage {
            Some((name, cap)) => {
                let region = Region::open_read_only(name, *cap)
                    .map_err(|e| bad(format!("mapping rank {p}'s stage: {e}")))?;
                Some(
                    PeerStage::new(region)
                        .ok_or_else(|| bad(format!("rank {p}'s stage has a bad size ({cap})")))?,
                )
            }
            None => None,
        };
        // Whether this rank can read the peer's memory: tried once, told to
        // the peer with the mapping.
        let pulls = self.cma && offer.probe.is_some_and(|pr| cma::works(p, offer.pid, pr));
        let mut said = if pulls { "cma" } else { "queue" }.to_string();
        if peer_stage.is_some() {
            said.push_str(STAGE_MARK);
        }
        Ok((inbox, offer, peer_stage, said))
    }
}

/// What separates the host identity from the nonce in a card.
const CARD_NONCE: &str = " #";

/// The queues' layout, first in a card: ranks of builds whose queues differ
/// do not connect through them (they meet over the network instead). `q2`:
/// a small push may start over at the beginning (`queue::HOT`); `q3`: offers
/// name a stage.
const QUEUE_LAYOUT: &str = "q3";

/// A card's host identity.
fn host_of(card: &str) -> &str {
    card.rsplit_once(CARD_NONCE).map_or(card, |(h, _)| h)
}

/// A card's nonce ("" for none).
fn nonce_of(card: &str) -> &str {
    let n = card.rsplit_once(CARD_NONCE).map_or("", |(_, n)| n);
    n.split_once(STAGE_MARK).map_or(n, |(n, _)| n)
}

/// What ends the card of a rank with a stage, before `=` and its size;
/// also what ends a peer's word that it mapped this rank's stage.
const STAGE_MARK: &str = " stage";

fn nonce() -> io::Result<String> {
    let mut n = [0u8; 8];
    getrandom::fill(&mut n).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(format!("{:016x}", u64::from_le_bytes(n)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cards_name_the_host_and_a_fresh_nonce() {
        let t = ShmTransport::default();
        let (a, b) = (t.card(), t.card());
        assert_ne!(a, b, "every mesh gets a nonce of its own");
        assert!(t.can_connect(&a, &b), "one host, two incarnations");
        assert_eq!(
            host_of(&a),
            format!("{QUEUE_LAYOUT} {}", region::host_id().replace('\n', " "))
        );
        let older = format!("{}{CARD_NONCE}{}", region::host_id(), nonce_of(&a));
        assert!(!t.can_connect(&a, &older), "queues of another layout");
        assert_eq!(nonce_of(&a).len(), 16);
        assert_eq!(t.stage_bytes(&a), 4 << 20, "{a}");
        let none = ShmTransport {
            stage_bytes: 0,
            ..ShmTransport::default()
        };
        let c = none.card();
        assert_eq!((none.stage_bytes(&c), nonce_of(&c).len()), (0, 16));
        assert!(t.can_connect(&a, &c), "stages do not decide who connects");
        let elsewhere = format!("another host{CARD_NONCE}{}", nonce_of(&a));
        assert!(!t.can_connect(&a, &elsewhere));
    }
}
