//! The mesh rendezvous: every rank publishes a card in the store, reads
//! everyone's, agrees on what all must share, picks a transport per peer,
//! and connects.
//!
//! A card says where this rank listens, its segment size, and what its
//! [`crate::LocalTransport`] needs to decide (a host identity), or that it has
//! none. From the cards every rank computes the same answers:
//!
//! - the segment size: the smallest any rank was given (schedules split
//!   messages by it, so ranks started with different
//!   `CONSORT_SEGMENT_BYTES` would send frames their peers do not expect);
//! - the transport of each pair, in the order NCCL's `canConnect` tries
//!   them: the local transport where both sides have it and it can connect
//!   the pair, else the network;
//!
//! then each rank sets up its local links, dials the lower ranks it
//! reaches over the network and accepts the higher ones (with the
//! `CONSORT_SECRET` challenge and a hello on each stream). A rank that
//! never shows up is named in the timeout.

use std::{fmt, sync::Arc, time::Instant};

use async_trait::async_trait;
use consort_comm::{CommError, Result, store::Store};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    sync::Notify,
};

use crate::{
    MeshBackend, MeshOptions,
    auth::{self, HANDSHAKE_TIMEOUT},
    cpus::{Cpus, host_cores},
    link::{BoxRead, BoxWrite, LocalSetup, PeerLink},
};

/// A network transport of ordered byte streams (TCP): it listens, dials,
/// and splits a connection into its two halves.
#[async_trait]
pub trait StreamTransport: Send + Sync {
    /// One connection.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The backend's name in errors ("tcp").
    fn name(&self) -> &'static str;
    /// The address peers dial, as published on this rank's card.
    fn address(&self) -> String;
    /// The next incoming connection and where it came from.
    async fn accept(&self) -> std::io::Result<(Self::Stream, String)>;
    /// Connects to a peer's published address.
    async fn dial(&self, addr: &str) -> std::io::Result<Self::Stream>;
    /// The two halves the driver reads and writes.
    fn split(s: Self::Stream) -> (BoxRead, BoxWrite);
    /// Every rank's published address (this rank's included), once all
    /// are read and before this rank dials or accepts: a transport that
    /// pins its peers (QUIC's certificate fingerprints) learns them here.
    /// An error names what is wrong with whose address.
    fn learn_peers(&self, addrs: &[&str]) -> std::result::Result<(), String> {
        let _ = addrs;
        Ok(())
    }
}

/// An error while building the mesh.
pub fn setup_err(backend: &str, rank: usize, what: impl fmt::Display) -> CommError {
    CommError::BackendUnavailable {
        backend: backend.into(),
        reason: format!("rank {rank}: {what}"),
    }
}

/// What one rank published.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Card {
    addr: String,
    segment: usize,
    /// The cores this rank may run on.
    cpus: Cpus,
    local: Option<String>,
}

impl Card {
    fn encode(&self) -> String {
        format!(
            "consort-card 2\n{}\n{}\n{}\n{}",
            self.addr,
            self.segment,
            self.cpus,
            self.local.as_deref().unwrap_or("-")
        )
    }

    fn decode(b: &[u8]) -> Option<Card> {
        let s = std::str::from_utf8(b).ok()?;
        let mut lines = s.split('\n');
        (lines.next()? == "consort-card 2").then_some(())?;
        let addr = lines.next()?.to_string();
        let segment = lines.next()?.parse().ok().filter(|&s: &usize| s > 0)?;
        let cpus = Cpus::parse(lines.next()?)?;
        let local = match lines.next()? {
            "-" => None,
            l => Some(l.to_string()),
        };
        lines.next().is_none().then_some(Card {
            addr,
            segment,
            cpus,
            local,
        })
    }
}

/// Builds the mesh for `rank` of `world` through `store`: local links to
/// the peers [`MeshOptions::local`] can reach, streams of `net` to the rest.
pub async fn connect<T: StreamTransport>(
    store: Arc<dyn Store>,
    rank: usize,
    world: usize,
    mut opts: MeshOptions,
    net: T,
) -> Result<MeshBackend> {
    let name = net.name();
    if world == 0 || rank >= world {
        return Err(CommError::invalid(format!(
            "rank {rank} does not fit a world of {world}"
        )));
    }
    if !(1..=8).contains(&opts.streams) {
        return Err(CommError::invalid(format!(
            "the number of streams per peer must be 1 to 8, not {}",
            opts.streams
        )));
    }
    let deadline = consort_comm::time::deadline(opts.connect_timeout);
    let cards = exchange_cards(&*store, rank, world, &opts, &net).await?;
    let addrs: Vec<&str> = cards.iter().map(|c| c.addr.as_str()).collect();
    net.learn_peers(&addrs)
        .map_err(|e| setup_err(name, rank, e))?;
    agree(rank, &cards, &mut opts);
    let me = &cards[rank];
    let local_peer = |p: usize| match (&opts.local, &me.local, &cards[p].local) {
        (Some(t), Some(mine), Some(theirs)) => p != rank && t.can_connect(mine, theirs),
        _ => false,
    };
    let wake = Arc::new(Notify::new());
    let locals: Vec<(usize, String)> = (0..world)
        .filter(|&p| local_peer(p))
        .map(|p| (p, cards[p].local.clone().unwrap_or_default()))
        .collect();
    let remote: Vec<usize> = (0..world)
        .filter(|&p| p != rank && !local_peer(p))
        .collect();
    // Both at once: a remote dialler's handshake must not wait (and time
    // out) while the ranks on this host set up their queues.
    let setup = LocalSetup {
        store: &store,
        namespace: &opts.namespace,
        rank,
        card: me.local.as_deref().unwrap_or_default(),
        peers: &locals,
        deadline,
        wake: wake.clone(),
    };
    let (made, mut streams) = tokio::try_join!(
        connect_local(name, &opts, setup),
        connect_streams(&net, rank, world, &cards, &remote, &opts, deadline)
    )?;
    let mut links: Vec<PeerLink> = (0..world).map(|_| PeerLink::Me).collect();
    for ((p, _), link) in locals.iter().zip(made) {
        links[*p] = PeerLink::Polled(link);
    }
    for p in remote {
        links[p] = PeerLink::Streams(std::mem::take(&mut streams[p]));
    }
    MeshBackend::from_links(name, rank, links, wake, opts)
}

/// Links to the peers on this host ([`LocalSetup::peers`], none without a
/// local transport), by the deadline.
async fn connect_local(
    name: &str,
    opts: &MeshOptions,
    setup: LocalSetup<'_>,
) -> Result<Vec<Box<dyn crate::PolledLink>>> {
    let Some(t) = opts.local.as_ref().filter(|_| !setup.peers.is_empty()) else {
        return Ok(Vec::new());
    };
    let rank = setup.rank;
    match consort_comm::time::before(setup.deadline, t.connect(setup)).await {
        Some(r) => r.map_err(|e| {
            setup_err(
                name,
                rank,
                format_args!(
                    "connecting {} to the ranks on this host: {e}; CONSORT_SHM=0 turns it off",
                    t.name()
                ),
            )
        }),
        None => Err(setup_err(
            name,
            rank,
            format_args!("timed out connecting {} on this host", t.name()),
        )),
    }
}

/// Publishes this rank's card and reads every rank's.
async fn exchange_cards<T: StreamTransport>(
    store: &dyn Store,
    rank: usize,
    world: usize,
    opts: &MeshOptions,
    net: &T,
) -> Result<Vec<Card>> {
    let name = net.name();
    let card = Card {
        addr: net.address(),
        segment: opts.algo.segment_bytes.max(1),
        cpus: Cpus::this_process(),
        local: opts.local.as_ref().map(|t| t.card()),
    };
    let key = |r: usize| format!("{}/card/{r}", opts.namespace);
    store
        .set(&key(rank), card.encode().as_bytes())
        .await
        .map_err(|e| setup_err(name, rank, format_args!("publishing this rank's card: {e}")))?;
    let keys: Vec<String> = (0..world).map(key).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    if let Err(e) = store.wait(&refs, opts.connect_timeout).await {
        let mut missing = Vec::new();
        for (r, k) in refs.iter().enumerate() {
            if !store.check(&[k]).await.unwrap_or(false) {
                missing.push(r);
            }
        }
        return Err(setup_err(
            name,
            rank,
            format_args!(
                "timed out after {:?} building the connection mesh, still missing ranks \
                 {missing:?} ({e}); check that every rank started with the same WORLD_SIZE and \
                 can reach the store",
                opts.connect_timeout
            ),
        ));
    }
    let raw = store
        .multi_get(&refs)
        .await
        .map_err(|e| setup_err(name, rank, format_args!("reading the cards: {e}")))?;
    raw.iter()
        .enumerate()
        .map(|(r, b)| {
            Card::decode(b).ok_or_else(|| {
                setup_err(
                    name,
                    rank,
                    format_args!(
                        "rank {r}'s card under {} is malformed: another program, or another \
                         consort version, uses this store namespace",
                        key(r)
                    ),
                )
            })
        })
        .collect()
}

/// Sets what every rank must share from the cards: the smallest segment
/// size, the local transport only if every rank has one, and whether the
/// ranks share one oversubscribed host.
fn agree(rank: usize, cards: &[Card], opts: &mut MeshOptions) {
    let smallest = cards.iter().map(|c| c.segment).min().unwrap_or(1);
    let mine = opts.algo.segment_bytes;
    if smallest != mine {
        tracing::warn!(
            rank,
            "the ranks run with different segment sizes (CONSORT_SEGMENT_BYTES); this rank's \
             {mine} becomes the smallest, {smallest}, as on every rank"
        );
        opts.algo.segment_bytes = smallest;
    }
    if opts.local.is_some() && cards.iter().any(|c| c.local.is_none()) {
        tracing::warn!(
            rank,
            "shared memory is off on some rank (CONSORT_SHM=0): every pair uses the network"
        );
        opts.local = None;
    }
    opts.algo.oversubscribed = oversubscribed(cards, opts);
    opts.algo.shared_stage = shared_stage(cards, opts);
    if opts.threads.is_none() {
        opts.threads = Some(spare_threads(rank, cards, opts));
    }
}

/// Threads for rank `rank`'s large copies and reductions where the user
/// set none ([`MeshOptions::threads`]): where every rank is on one host,
/// the cores the ranks have between them (the union of their affinity
/// masks, capped by a quota) divided by the ranks, less one for the rank's
/// own runtime, so a host with cores to spare lends each rank an equal
/// share, and never more than the rank itself may use (its own mask and
/// quota: a rank pinned to one core beside one on fifteen gets 1). 1 where the ranks have a core each or
/// share them, where they span hosts (the network, not a core, sets the
/// pace there) and where the mesh cannot tell (no local transport).
fn spare_threads(rank: usize, cards: &[Card], opts: &MeshOptions) -> usize {
    if !one_host(cards, opts) {
        return 1;
    }
    let share = host_cores(cards.iter().map(|c| &c.cpus)) / cards.len().max(1);
    let mine = share.min(cards.get(rank).map_or(1, |c| c.cpus.usable()));
    // One core of the share stays with the rank's runtime (its readers,
    // its peers' pollers): 2 ranks each splitting over 2 threads on 2
    // cores ran a bf16 all_reduce of 64 MiB at half the speed of 1 thread.
    mine.saturating_sub(1)
        .clamp(1, consort_comm::par::MAX_THREADS)
}

/// Whether every rank is on one host, linked by the local transport, and
/// each has a stage its peers read that holds two of the direct
/// broadcast's segments (at the agreed segment size), so that the root can
/// stage one while the readers copy out the other
/// ([`consort_comm::algo::AlgoConfig::shared_stage`]). The same on every
/// rank: it reads only the cards.
fn shared_stage(cards: &[Card], opts: &MeshOptions) -> bool {
    let Some(t) = &opts.local else {
        return false;
    };
    let need = opts.algo.fan_out_segment_bytes().saturating_mul(2);
    one_host(cards, opts)
        && cards.iter().all(|c| {
            c.local
                .as_ref()
                .is_some_and(|card| t.stage_bytes(card) >= need)
        })
}

/// Whether every rank is on one host, linked by the local transport.
fn one_host(cards: &[Card], opts: &MeshOptions) -> bool {
    let (Some(t), Some(first)) = (&opts.local, cards.first().and_then(|c| c.local.as_ref())) else {
        return false;
    };
    cards.iter().skip(1).all(|c| {
        c.local
            .as_ref()
            .is_some_and(|theirs| t.can_connect(first, theirs))
    })
}

/// Whether every rank is on one host, linked by the local transport, and
/// the host runs more ranks than the cores they have between them (the
/// union of their affinity masks, capped by a cgroup quota; see
/// [`crate::cpus`]; [`consort_comm::algo::AlgoConfig::oversubscribed`]). The same on every
/// rank: it reads only the cards. A mesh with network links stays
/// pipelined, since there the links, not the cores, set the pace.
fn oversubscribed(cards: &[Card], opts: &MeshOptions) -> bool {
    one_host(cards, opts) && cards.len() > host_cores(cards.iter().map(|c| &c.cpus))
}

/// The first bytes of a data stream: magic, version, rank, world size,
/// stream index, streams per peer.
const HELLO_MAGIC: [u8; 4] = *b"CSRH";
const HELLO_LEN: usize = 4 + 1 + 4 + 4 + 1 + 1;

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

/// The accepting side of one connection: the CONSORT_SECRET challenge
/// (with a secret) and the peer's hello, all within [`HANDSHAKE_TIMEOUT`].
async fn accept_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    from: String,
    secret: Option<auth::Secret>,
) -> std::result::Result<(S, String, [u8; HELLO_LEN]), (String, String)> {
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
    match consort_comm::time::before(Instant::now() + HANDSHAKE_TIMEOUT, work).await {
        Some(Ok(h)) => Ok((s, from, h)),
        Some(Err(e)) => Err((from, e)),
        None => Err((
            from,
            format!("no hello (or CONSORT_SECRET answer) within {HANDSHAKE_TIMEOUT:?}"),
        )),
    }
}

/// The dialling side of one stream: connect, the secret, the hello.
async fn dial_one<T: StreamTransport>(
    net: &T,
    addr: &str,
    secret: Option<&auth::Secret>,
    hello: &[u8],
) -> std::result::Result<T::Stream, String> {
    let mut s = net
        .dial(addr)
        .await
        .map_err(|e| format!("connecting: {e}"))?;
    if let Some(secret) = secret {
        match consort_comm::time::before(
            Instant::now() + HANDSHAKE_TIMEOUT,
            auth::connect(&mut s, secret),
        )
        .await
        {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(format!("authenticating: {e}")),
            None => return Err("no answer to the CONSORT_SECRET handshake".into()),
        }
    }
    s.write_all(hello)
        .await
        .map_err(|e| format!("sending the hello: {e}"))?;
    Ok(s)
}

type Streams = Vec<Vec<(BoxRead, BoxWrite)>>;

/// Dials the `remote` peers below this rank and accepts those above it,
/// `opts.streams` streams each.
async fn connect_streams<T: StreamTransport>(
    net: &T,
    rank: usize,
    world: usize,
    cards: &[Card],
    remote: &[usize],
    opts: &MeshOptions,
    deadline: Instant,
) -> Result<Streams> {
    let name = net.name();
    let k = opts.streams;
    let mut conns: Vec<Vec<Option<T::Stream>>> =
        (0..world).map(|_| (0..k).map(|_| None).collect()).collect();
    let dial = async {
        for &peer in remote.iter().filter(|&&p| p < rank) {
            for (stream, slot) in conns[peer].iter_mut().enumerate() {
                let h = hello(rank, world, stream, k);
                let addr = &cards[peer].addr;
                let s = dial_one(net, addr, opts.secret.as_ref(), &h)
                    .await
                    .map_err(|e| {
                        setup_err(name, rank, format_args!("rank {peer} at {addr}: {e}"))
                    })?;
                *slot = Some(s);
            }
        }
        let wanted = |p: usize| p > rank && remote.contains(&p);
        accept_all(net, rank, world, &mut conns, wanted, opts).await
    };
    let missing = |conns: &[Vec<Option<T::Stream>>]| -> Vec<usize> {
        remote
            .iter()
            .copied()
            .filter(|&p| conns[p].iter().any(Option::is_none))
            .collect()
    };
    match consort_comm::time::before(deadline, dial).await {
        Some(r) => r?,
        None => {
            return Err(setup_err(
                name,
                rank,
                format_args!(
                    "timed out after {:?} building the connection mesh, still missing ranks {:?}; \
                     check that every rank started with the same WORLD_SIZE and can reach the \
                     others",
                    opts.connect_timeout,
                    missing(&conns)
                ),
            ));
        }
    }
    Ok(conns
        .into_iter()
        .map(|s| s.into_iter().flatten().map(T::split).collect())
        .collect())
}

/// Accepts every stream the `wanted` peers open. Handshakes run
/// concurrently, each under its own deadline, so a stray connection (a port
/// scanner, a stale client of an earlier job on a reused port) that sends
/// nothing cannot hold up the peers behind it.
async fn accept_all<T: StreamTransport>(
    net: &T,
    rank: usize,
    world: usize,
    conns: &mut [Vec<Option<T::Stream>>],
    wanted: impl Fn(usize) -> bool,
    opts: &MeshOptions,
) -> Result<()> {
    let k = opts.streams;
    let need = (0..world).filter(|&p| wanted(p)).count() * k;
    let mut accepted = 0;
    let mut handshakes = tokio::task::JoinSet::new();
    while accepted < need {
        tokio::select! {
            conn = net.accept() => {
                let (s, from) = conn.map_err(|e| setup_err(net.name(), rank, e))?;
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
                    Ok((p, j)) if wanted(p) && conns[p][j].is_none() => {
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cards_round_trip_and_refuse_garbage() {
        let c = Card {
            addr: "127.0.0.1:5".into(),
            segment: 1 << 20,
            cpus: Cpus::of(&[0, 1], None),
            local: Some("host/x".into()),
        };
        assert_eq!(Card::decode(c.encode().as_bytes()), Some(c.clone()));
        let none = Card { local: None, ..c };
        assert_eq!(Card::decode(none.encode().as_bytes()), Some(none));
        for bad in [
            &b""[..],
            b"consort-card 3\na\n1\n2\n-",
            b"consort-card 1\na\n1\n-",
            b"consort-card 2\na\n0\n2\n-",
            b"consort-card 2\na\n1\n0\n-",
            b"consort-card 2\na\n1\n2\n-\nextra",
            b"\xff",
        ] {
            assert_eq!(Card::decode(bad), None, "{bad:?}");
        }
    }

    /// A local transport whose cards are host names, then `:` and the
    /// rank's stage size, if it has a stage.
    #[derive(Debug)]
    struct Hosts;

    #[async_trait]
    impl crate::LocalTransport for Hosts {
        fn name(&self) -> &'static str {
            "hosts"
        }
        fn card(&self) -> String {
            "a".into()
        }
        fn can_connect(&self, mine: &str, theirs: &str) -> bool {
            let host = |c: &str| c.split(':').next().unwrap_or_default().to_string();
            host(mine) == host(theirs)
        }
        fn stage_bytes(&self, card: &str) -> usize {
            card.split_once(':')
                .map_or(0, |(_, n)| n.parse().unwrap_or(0))
        }
        async fn connect(
            &self,
            _: LocalSetup<'_>,
        ) -> std::io::Result<Vec<Box<dyn crate::PolledLink>>> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn only_one_host_with_more_ranks_than_cores_is_oversubscribed() {
        // A rank on `cores` (CPU ids) of host `host`.
        let card = |cores: &[usize], host: Option<&str>| Card {
            addr: "a".into(),
            segment: 1,
            cpus: Cpus::of(cores, None),
            local: host.map(str::to_string),
        };
        let opts = MeshOptions {
            local: Some(Arc::new(Hosts)),
            ..MeshOptions::default()
        };
        let over = |cards: &[Card]| oversubscribed(cards, &opts);
        let two = [0, 1];
        assert!(over(&[
            card(&two, Some("a")),
            card(&two, Some("a")),
            card(&two, Some("a"))
        ]));
        assert!(!over(&[card(&two, Some("a")), card(&two, Some("a"))]));
        // Ranks pinned to a core each are not: the host's cores are the
        // union of theirs.
        assert!(!over(&[
            card(&[0], Some("a")),
            card(&[1], Some("a")),
            card(&[2], Some("a"))
        ]));
        // Two pinned to one core are.
        assert!(over(&[card(&[3], Some("a")), card(&[3], Some("a"))]));
        // Two hosts, or a rank without the local transport: network links.
        assert!(!over(&[
            card(&[0], Some("a")),
            card(&[0], Some("b")),
            card(&[0], Some("a"))
        ]));
        assert!(!over(&[
            card(&[0], Some("a")),
            card(&[0], None),
            card(&[0], Some("a"))
        ]));
        let no_local = MeshOptions::default();
        assert!(!oversubscribed(
            &[card(&[0], Some("a")), card(&[0], Some("a"))],
            &no_local
        ));
    }

    /// Each rank's share of its host's cores, counting only the ranks on
    /// its own host, and 1 where the mesh cannot tell who shares it.
    #[test]
    fn a_rank_lends_itself_its_share_of_its_host_s_spare_cores() {
        let card = |cores: std::ops::Range<usize>, host: Option<&str>| Card {
            addr: "a".into(),
            segment: 1,
            cpus: Cpus::of(&cores.collect::<Vec<_>>(), None),
            local: host.map(str::to_string),
        };
        let opts = MeshOptions {
            local: Some(Arc::new(Hosts)),
            ..MeshOptions::default()
        };
        let threads = |rank: usize, cards: &[Card]| spare_threads(rank, cards, &opts);
        // 2 ranks on 16 cores: 7 each (a core of each share for the
        // rank's runtime); 4: 3 each; 8 or 16: 1.
        let host = |n: usize, cores: usize| -> Vec<Card> {
            (0..n).map(|_| card(0..cores, Some("a"))).collect()
        };
        assert_eq!(threads(0, &host(2, 16)), 7);
        assert_eq!(threads(3, &host(4, 16)), 3);
        assert_eq!(threads(7, &host(8, 16)), 1);
        assert_eq!(threads(0, &host(16, 16)), 1);
        // More ranks than cores, and the cap.
        assert_eq!(threads(1, &host(3, 2)), 1);
        assert_eq!(threads(0, &host(2, 64)), consort_comm::par::MAX_THREADS);
        // Pinned to 4 cores each, 2 ranks: 3 each (the union is 8).
        assert_eq!(
            threads(1, &[card(0..4, Some("a")), card(4..8, Some("a"))]),
            3
        );
        // Ranks on two hosts: 1 (the network sets the pace).
        let two_hosts = [
            card(0..8, Some("a")),
            card(0..8, Some("a")),
            card(0..8, Some("b")),
        ];
        assert_eq!(threads(0, &two_hosts), 1);
        assert_eq!(threads(2, &two_hosts), 1);
        // Never more than the rank's own cores: pinned to one beside a rank
        // on fifteen, or under a quota of 2.
        assert_eq!(
            threads(0, &[card(0..1, Some("a")), card(1..16, Some("a"))]),
            1
        );
        assert_eq!(
            threads(1, &[card(0..1, Some("a")), card(1..16, Some("a"))]),
            7
        );
        let quota = Card {
            cpus: Cpus::of(&(0..16).collect::<Vec<_>>(), Some(2)),
            ..card(0..16, Some("a"))
        };
        // (the host's cores are capped by the quota too: `host_cores`)
        assert_eq!(threads(0, &[quota.clone(), card(0..16, Some("a"))]), 1);
        assert_eq!(threads(0, &[quota]), 1);
        // No shared memory on this rank, or in the mesh: 1.
        assert_eq!(threads(0, &[card(0..8, None), card(0..8, Some("a"))]), 1);
        assert_eq!(spare_threads(0, &host(2, 16), &MeshOptions::default()), 1);
    }

    /// The direct broadcast needs every rank on one host with a stage of
    /// at least two of its segments (512 KiB at the mesh's default segment size).
    #[test]
    fn a_shared_stage_needs_one_host_and_every_rank_s_stage_large_enough() {
        let card = |local: Option<&str>| Card {
            addr: "a".into(),
            segment: 1,
            cpus: Cpus::of(&[0, 1], None),
            local: local.map(str::to_string),
        };
        let opts = MeshOptions {
            local: Some(Arc::new(Hosts)),
            ..MeshOptions::default()
        };
        let shared = |cards: &[Option<&str>]| {
            let cards: Vec<Card> = cards.iter().map(|c| card(*c)).collect();
            shared_stage(&cards, &opts)
        };
        let (big, two, small) = (Some("a:4194304"), Some("a:2097152"), Some("a:262144"));
        assert!(shared(&[big, big, two]));
        assert!(!shared(&[big, big, small]), "one stage too small");
        assert!(!shared(&[big, Some("a"), big]), "one rank without a stage");
        assert!(!shared(&[big, None, big]), "one rank without shared memory");
        assert!(!shared(&[big, Some("b:4194304"), big]), "two hosts");
        // Smaller segments need a smaller stage, on every rank alike.
        let mut smaller = MeshOptions {
            local: Some(Arc::new(Hosts)),
            ..MeshOptions::default()
        };
        smaller.algo.segment_bytes = 64 << 10;
        let cards: Vec<Card> = [small, small, small].iter().map(|c| card(*c)).collect();
        assert!(shared_stage(&cards, &smaller), "64 KiB segments");
        assert!(!shared_stage(&cards, &opts));
        let cards: Vec<Card> = [big, big, big].iter().map(|c| card(*c)).collect();
        assert!(
            !shared_stage(&cards, &MeshOptions::default()),
            "no local transport"
        );
    }

    #[test]
    fn hellos_check_rank_world_and_streams() {
        let h = hello(2, 4, 1, 2);
        assert_eq!(parse_hello(&h, 4, 2), Ok((2, 1)));
        assert!(
            parse_hello(&h, 5, 2)
                .unwrap_err()
                .contains("thinks the world")
        );
        assert!(parse_hello(&h, 4, 1).unwrap_err().contains("streams"));
        let mut bad = h;
        bad[0] = b'X';
        assert!(parse_hello(&bad, 4, 2).is_err());
    }
}
