//! The transport seam: what a transport hands the driver for each peer.
//!
//! A transport owns only moving bytes and failure signals. It gives the
//! driver one [`PeerLink`] per peer:
//!
//! - [`PeerLink::Streams`]: ordered byte streams (TCP connections, QUIC
//!   streams). The driver runs one reader task per stream and writes whole
//!   frames to them; the end of a stream is the peer's loss.
//! - [`PeerLink::Polled`]: a link the waiting calls poll themselves, with no
//!   task and no system call per message (shared-memory queues). The driver
//!   spins on it for [`crate::MeshOptions::spin`], then arms it and sleeps
//!   until the transport rings the [`Notify`] it was given.
//!
//! A [`LocalTransport`] makes polled links to the peers on this host; which
//! peers get one is decided by [`crate::rendezvous`], in the order NCCL's
//! `canConnect` tries its transports: same-host memory first, then the
//! network.

use std::{fmt, pin::Pin, sync::Arc, time::Instant};

use async_trait::async_trait;
use consort_comm::store::Store;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::Notify,
};

/// The read side of one data stream to a peer: a TCP read half, or any
/// other ordered byte stream (a QUIC stream).
pub type BoxRead = Pin<Box<dyn AsyncRead + Send>>;
/// The write side of one data stream to a peer.
pub type BoxWrite = Pin<Box<dyn AsyncWrite + Send>>;

/// How the driver reaches one peer.
pub enum PeerLink {
    /// This rank itself: nothing.
    Me,
    /// Ordered byte streams, the same number for every peer that has them.
    Streams(Vec<(BoxRead, BoxWrite)>),
    /// A link the waiting calls poll (same-host shared memory).
    Polled(Box<dyn PolledLink>),
}

impl PeerLink {
    /// The transport's name, for logs and [`crate::MeshBackend::transports`].
    pub fn kind(&self) -> &'static str {
        match self {
            PeerLink::Me => "self",
            PeerLink::Streams(_) => "stream",
            PeerLink::Polled(l) => l.name(),
        }
    }
}

impl fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind())
    }
}

/// Why a polled link can carry no more: the peer's process exited, or it
/// closed its end. Bytes it wrote before are still read first.
pub type Closed = String;

/// A byte pipe each way to one peer that the driver polls: the sender
/// appends frames, the receiver takes bytes as they come.
///
/// Every length is a multiple of 8 and the driver only ever writes frames
/// padded to 8 bytes, so an element never straddles two reads.
pub trait PolledLink: Send + Sync {
    /// The transport's name ("shm").
    fn name(&self) -> &'static str;

    /// Appends bytes of `parts` (taken as one concatenation) from byte
    /// `from` on, as many as fit now, in multiples of 8 unless the end is
    /// reached; returns how many it took. Only one sender at a time.
    fn push(&self, parts: &[&[u8]], from: usize) -> usize;

    /// Appends all of `parts` (one concatenation) if it fits now, else
    /// nothing; returns whether it did. Only one sender at a time. The
    /// default takes nothing, and every frame goes through [`Self::push`].
    fn push_whole(&self, parts: &[&[u8]]) -> bool {
        let _ = parts;
        false
    }

    /// Hands what has arrived to `take`, one contiguous run at a time (at
    /// most two per call, around the end of the queue); `take` returns how
    /// many bytes it consumed (a multiple of 8), and the link frees them.
    /// Returns the bytes consumed, or, once nothing is left and the peer is
    /// gone, why. Only one receiver at a time.
    fn pull(&self, take: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize, Closed>;

    /// Asks to be woken (through the transport's [`Notify`]) when the peer
    /// next writes to this rank, or frees room for it: called before the
    /// waiting call sleeps, and followed by one more poll, so that nothing
    /// that arrived in between is missed.
    fn arm(&self);

    /// Whether the peer's process is known to be gone.
    fn is_closed(&self) -> bool;

    /// Closes both directions now, as if this process had died: the peer
    /// sees the link closed (the faulty link's crash).
    fn close(&self);

    /// Whether the peer can read this process's memory (CMA), so that
    /// large payloads may go as [`consort_comm::frame::FrameKind::Pull`]
    /// frames, copied once, by the receiver.
    fn peer_pulls(&self) -> bool {
        false
    }

    /// Sender: copies `bytes` into this rank's stage, a region every peer
    /// of this transport's [`LocalTransport::connect`] reads (one stage per
    /// rank, shared by all its links), if it has room now; returns the
    /// address to send in a [`consort_comm::frame::FrameKind::Pull`] frame,
    /// which the peer's [`Self::read_peer`] reads. The default stages
    /// nothing.
    fn stage(&self, bytes: &[u8]) -> Option<u64> {
        let _ = bytes;
        None
    }

    /// Sender: the stage's bytes before `upto` (an address [`Self::stage`]
    /// returned, plus its payload's length) are read by every peer they
    /// went to, or `None`: all of them are. Only one call at a time stages.
    fn free_stage(&self, upto: Option<u64>) {
        let _ = upto;
    }

    /// Whether the peer reads this rank's stage (both ends have one).
    fn peer_reads_stage(&self) -> bool {
        false
    }

    /// Reads `dst.len()` bytes at address `addr` of the peer's process, or
    /// of its stage (an address its [`Self::stage`] returned).
    fn read_peer(&self, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
        let _ = (addr, dst);
        Err(std::io::ErrorKind::Unsupported.into())
    }

    /// Hands `f` the `len` staged bytes at `addr` in the peer's stage, as
    /// mapped here (no copy: a receive that reduces takes them straight
    /// from there); `Ok(false)` without calling `f` where `addr` is not in
    /// a stage this link maps (the caller reads it with
    /// [`Self::read_peer`]). The peer may write the bytes meanwhile, as
    /// with any read of its memory: that spoils only its own payload.
    fn with_staged(
        &self,
        addr: u64,
        len: usize,
        f: &mut dyn FnMut(&[u8]),
    ) -> std::io::Result<bool> {
        let _ = (addr, len, f);
        Ok(false)
    }

    /// [`Self::read_peer`] into a destination nothing reads again soon (a
    /// large receive, in place), so that the copy may bypass the caches.
    /// The default reads as [`Self::read_peer`] does.
    fn read_peer_streaming(&self, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
        self.read_peer(addr, dst)
    }

    /// Receiver: one more of the peer's pull frames has been read.
    fn count_pull(&self) {}

    /// Sender: how many of this rank's pull frames the peer has read.
    fn pulls_read(&self) -> u64 {
        0
    }

    /// Sender: the bytes of this rank's pull frames up to number `upto`
    /// are gone (the call that sent them ended without waiting).
    fn revoke(&self, upto: u64) {
        let _ = upto;
    }

    /// Receiver: the last of the peer's pull frame numbers whose bytes are
    /// gone. A pull read at or below it read nothing valid.
    fn revoked(&self) -> u64 {
        0
    }
}

/// What a [`LocalTransport`] connects with.
pub struct LocalSetup<'a> {
    /// The store every rank meets in.
    pub store: &'a Arc<dyn Store>,
    /// The key prefix of this mesh.
    pub namespace: &'a str,
    /// This rank.
    pub rank: usize,
    /// The card this rank published ([`LocalTransport::card`]).
    pub card: &'a str,
    /// The peers to connect, with the card each published.
    pub peers: &'a [(usize, String)],
    /// When setting up must be done.
    pub deadline: Instant,
    /// What the transport notifies when a polled link has something for a
    /// sleeping call.
    pub wake: Arc<Notify>,
}

/// A same-host transport (shared memory): it says which peers it can reach
/// and makes a polled link to each.
#[async_trait]
pub trait LocalTransport: Send + Sync + fmt::Debug {
    /// The transport's name ("shm").
    fn name(&self) -> &'static str;

    /// What this rank publishes for the others to decide on (a host
    /// identity, and whatever names this mesh's incarnation of the rank):
    /// a single line, made once per mesh and handed back in
    /// [`LocalSetup::card`].
    fn card(&self) -> String;

    /// Whether this rank (card `mine`) can reach a peer that published
    /// `theirs`. Must give the same answer on both sides.
    fn can_connect(&self, mine: &str, theirs: &str) -> bool;

    /// Bytes of the stage that the rank that published `card` has for
    /// its peers to read ([`PolledLink::stage`]); 0 for none, the
    /// default.
    fn stage_bytes(&self, card: &str) -> usize {
        let _ = card;
        0
    }

    /// Connects to every peer in `setup.peers` (all of them, or fails).
    /// The result has one link per peer, in order.
    async fn connect(&self, setup: LocalSetup<'_>) -> std::io::Result<Vec<Box<dyn PolledLink>>>;
}
