//! [`QuicBackend`]: the mesh of QUIC connections, handed to the shared
//! stream driver.
//!
//! Setup, for rank `r` of `n`:
//!
//! 1. make a job certificate ([`Identity`]) and bind a UDP endpoint;
//! 2. publish `address fingerprint` under `<namespace>/quic/<r>` in the
//!    store, and read every other rank's;
//! 3. accept client certificates from the job's fingerprints only, then
//!    publish `<namespace>/quic/<r>/ready` (peers dial only ready ranks);
//! 4. dial every lower rank (pinning its fingerprint) and accept every
//!    higher one: one connection per pair, `streams` bidirectional streams
//!    on each, each opened with a hello (and, with a job secret, the same
//!    HMAC challenge-response as TCP);
//! 5. hand the streams to `MeshBackend::from_links`, which runs the same
//!    `comm::algo` schedules and frames as TCP.

use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use consort_comm::{Backend, CallOptions, CommError, GroupId, Op, Result, Store, Work};
use consort_mesh::{BoxRead, BoxWrite, MeshBackend, MeshOptions, PeerLink, Secret, auth};
use quinn::{
    ClientConfig, Connection, Endpoint, IdleTimeout, RecvStream, SendStream, ServerConfig,
    TransportConfig, VarInt,
    crypto::rustls::{QuicClientConfig, QuicServerConfig},
};

use crate::tls::{self, Fingerprint, Identity};

/// The first bytes of each stream: magic, rank, stream index.
const HELLO_MAGIC: [u8; 4] = *b"CSRQ";

/// How a [`QuicBackend`] connects and runs.
#[derive(Clone, Debug)]
pub struct QuicOptions {
    /// The address to bind the UDP endpoint on (port 0: any free port).
    /// Default: 127.0.0.1.
    pub bind_addr: Option<IpAddr>,
    /// Store key prefix (one per group and restart round).
    pub namespace: String,
    /// Streams per pair of ranks (1 to 8).
    pub streams: usize,
    /// How long building the mesh may take.
    pub connect_timeout: Duration,
    /// A peer silent this long is gone (QUIC idle timeout; keep-alives go
    /// every third of it). Bounds how soon a killed rank becomes
    /// `PeerLost` on the others.
    pub idle_timeout: Duration,
    /// The job secret (`CONSORT_SECRET`): each stream then also runs the
    /// HMAC challenge-response.
    pub secret: Option<Secret>,
    /// The driver's options (op timeout, schedules, frame limits).
    pub driver: MeshOptions,
}

impl Default for QuicOptions {
    fn default() -> Self {
        QuicOptions {
            bind_addr: None,
            namespace: "consort/quic/world".into(),
            streams: 1,
            connect_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(5),
            secret: Secret::from_env(),
            driver: MeshOptions {
                local: None,
                ..MeshOptions::default()
            },
        }
    }
}

/// The QUIC backend: every link encrypted and mutually authenticated with
/// per-job certificates pinned through the store.
pub struct QuicBackend {
    inner: MeshBackend,
    endpoint: Endpoint,
    conns: Vec<Connection>,
    /// Refuses every connection that arrives after the mesh is built.
    gatekeeper: tokio::task::JoinHandle<()>,
    idle_timeout: Duration,
    /// The send halves the driver writes through, to finish at the end.
    sends: Vec<SharedSend>,
}

/// A QUIC send stream shared between the driver (which writes) and the
/// backend (which finishes it and waits for its acknowledgement at the
/// end). The lock is uncontended: only the driver writes.
#[derive(Clone)]
struct SharedSend(Arc<std::sync::Mutex<SendStream>>);

impl SharedSend {
    fn lock(&self) -> std::sync::MutexGuard<'_, SendStream> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl tokio::io::AsyncWrite for SharedSend {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let mut s = self.lock();
        tokio::io::AsyncWrite::poll_write(std::pin::Pin::new(&mut *s), cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let mut s = self.lock();
        tokio::io::AsyncWrite::poll_flush(std::pin::Pin::new(&mut *s), cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let mut s = self.lock();
        tokio::io::AsyncWrite::poll_shutdown(std::pin::Pin::new(&mut *s), cx)
    }
}

impl std::fmt::Debug for QuicBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicBackend")
            .field("rank", &self.inner.rank())
            .field("world", &self.inner.world_size())
            .finish()
    }
}

impl Drop for QuicBackend {
    fn drop(&mut self) {
        self.gatekeeper.abort();
        // Unlike TCP's, QUIC's unsent and unacknowledged data dies with the
        // connection, and the connection with this process. So finish every
        // stream and wait (up to the idle timeout) until the peers have
        // acknowledged all of it, then close: a rank that returns from its
        // last collective and exits cannot strand a peer that still needs
        // its final frames.
        let sends = std::mem::take(&mut self.sends);
        let conns = std::mem::take(&mut self.conns);
        let endpoint = self.endpoint.clone();
        let linger = self.idle_timeout;
        let work = async move {
            let acked: Vec<_> = sends
                .iter()
                .map(|s| {
                    let mut g = s.lock();
                    let _ = g.finish();
                    g.stopped()
                })
                .collect();
            let _ = tokio::time::timeout(linger, async {
                for a in acked {
                    let _ = a.await;
                }
            })
            .await;
            for c in &conns {
                c.close(VarInt::from_u32(0), b"rank left");
            }
            endpoint.close(VarInt::from_u32(0), b"rank left");
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) if rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| rt.block_on(work));
            }
            Ok(rt) => {
                rt.spawn(work);
            }
            Err(_) => {
                for c in &self.conns {
                    c.close(VarInt::from_u32(0), b"rank left");
                }
                self.endpoint.close(VarInt::from_u32(0), b"rank left");
            }
        }
    }
}

fn setup_err(rank: usize, what: impl std::fmt::Display) -> CommError {
    CommError::Aborted {
        ctx: consort_comm::ErrorContext {
            rank: Some(rank),
            ..Default::default()
        },
        cause: format!("QUIC setup: {what}"),
    }
}

fn transport(idle: Duration) -> Arc<TransportConfig> {
    let mut t = TransportConfig::default();
    t.max_idle_timeout(IdleTimeout::try_from(idle).ok());
    t.keep_alive_interval(Some(idle / 3));
    // Windows sized for multi-megabyte segments in flight on fast links.
    t.stream_receive_window(VarInt::from_u32(32 << 20));
    t.receive_window(VarInt::from_u32(128 << 20));
    t.send_window(128 << 20);
    t.max_concurrent_bidi_streams(VarInt::from_u32(64));
    Arc::new(t)
}

/// Socket buffers asked for (the kernel caps them at net.core.rmem_max and
/// wmem_max): the default 208 KiB overflows under a burst of large
/// datagrams, and every drop halves the congestion window.
const SOCKET_BUFFER: usize = 4 << 20;

/// A UDP endpoint on `addr` with large socket buffers.
fn bind(addr: SocketAddr, server: ServerConfig) -> std::io::Result<Endpoint> {
    let domain = socket2::Domain::for_address(addr);
    let sock = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER);
    sock.bind(&addr.into())?;
    let runtime: Arc<dyn quinn::Runtime> = Arc::new(quinn::TokioRuntime);
    Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server),
        sock.into(),
        runtime,
    )
}

fn hello(rank: usize, stream: usize) -> [u8; 9] {
    let mut h = [0u8; 9];
    h[..4].copy_from_slice(&HELLO_MAGIC);
    h[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
    h[8] = stream as u8;
    h
}

/// Runs the secret handshake (if any) on one stream.
async fn authenticate(
    send: &mut SendStream,
    recv: &mut RecvStream,
    secret: &Option<Secret>,
    dialer: bool,
) -> std::io::Result<()> {
    let Some(secret) = secret else {
        return Ok(());
    };
    let mut duplex = tokio::io::join(recv, send);
    let f = async {
        if dialer {
            auth::connect(&mut duplex, secret).await
        } else {
            auth::accept(&mut duplex, secret).await
        }
    };
    match tokio::time::timeout(auth::HANDSHAKE_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::other(
            "the CONSORT_SECRET handshake timed out",
        )),
    }
}

type Streams = Vec<(RecvStream, SendStream)>;

impl QuicBackend {
    /// Joins a group of `world` ranks as `rank` over QUIC, meeting through
    /// `store`. Every rank must call it with the same namespace.
    pub async fn connect(
        store: Arc<dyn Store>,
        rank: usize,
        world: usize,
        opts: QuicOptions,
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(CommError::invalid(format!(
                "rank {rank} does not fit a world of {world}"
            )));
        }
        if !(1..=8).contains(&opts.streams) {
            return Err(CommError::invalid(format!(
                "QuicOptions::streams must be 1 to 8, not {}",
                opts.streams
            )));
        }
        let id = Identity::generate().map_err(|e| setup_err(rank, e))?;
        let ip = opts.bind_addr.unwrap_or(IpAddr::from([127, 0, 0, 1]));
        // Until the job's fingerprints are known, nobody is accepted.
        let server = |allowed: HashSet<Fingerprint>| -> Result<ServerConfig> {
            let tls = tls::server_config(&id, allowed).map_err(|e| setup_err(rank, e))?;
            let q = QuicServerConfig::try_from(tls).map_err(|e| setup_err(rank, e))?;
            let mut cfg = ServerConfig::with_crypto(Arc::new(q));
            cfg.transport_config(transport(opts.idle_timeout));
            Ok(cfg)
        };
        let endpoint = bind(SocketAddr::new(ip, 0), server(HashSet::new())?)
            .map_err(|e| setup_err(rank, format_args!("cannot bind UDP on {ip}: {e}")))?;
        let addr = endpoint.local_addr().map_err(|e| setup_err(rank, e))?;
        let key = |r: usize| format!("{}/quic/{r}", opts.namespace);
        store
            .set(
                &key(rank),
                format!("{addr} {}", tls::hex(&id.fingerprint)).as_bytes(),
            )
            .await
            .map_err(|e| setup_err(rank, format_args!("publishing the address: {e}")))?;

        let deadline = consort_comm::time::deadline(opts.connect_timeout);
        let mut peers: Vec<(SocketAddr, Fingerprint)> = Vec::with_capacity(world);
        for r in 0..world {
            let raw = tokio::time::timeout_at(deadline.into(), store.get(&key(r)))
                .await
                .map_err(|_| setup_err(rank, format_args!("rank {r} never published its address")))?
                .map_err(|e| setup_err(rank, format_args!("finding rank {r}: {e}")))?;
            let text = String::from_utf8_lossy(&raw).into_owned();
            let parsed = text
                .split_once(' ')
                .and_then(|(a, f)| Some((a.parse::<SocketAddr>().ok()?, tls::parse_hex(f)?)));
            let Some(p) = parsed else {
                return Err(setup_err(
                    rank,
                    format_args!("rank {r}'s entry {text:?} is not `address fingerprint`"),
                ));
            };
            peers.push(p);
        }
        endpoint.set_server_config(Some(server(peers.iter().map(|p| p.1).collect())?));
        // Only now can this rank judge client certificates: say so, and
        // dial each peer only after it has said so too (a handshake that
        // arrives earlier would meet the accept-nobody configuration).
        let ready = |r: usize| format!("{}/quic/{r}/ready", opts.namespace);
        store
            .set(&ready(rank), b"1")
            .await
            .map_err(|e| setup_err(rank, format_args!("publishing readiness: {e}")))?;

        let k = opts.streams;
        let mut slots: Vec<Option<(Connection, Streams)>> = (0..world).map(|_| None).collect();
        let build = async {
            // Dial the lower ranks.
            for p in 0..rank {
                store
                    .get(&ready(p))
                    .await
                    .map_err(|e| setup_err(rank, format_args!("waiting for rank {p}: {e}")))?;
                let tls = tls::client_config(&id, peers[p].1).map_err(|e| setup_err(rank, e))?;
                let q = QuicClientConfig::try_from(tls).map_err(|e| setup_err(rank, e))?;
                let mut cfg = ClientConfig::new(Arc::new(q));
                cfg.transport_config(transport(opts.idle_timeout));
                let conn = endpoint
                    .connect_with(cfg, peers[p].0, "consort")
                    .map_err(|e| setup_err(rank, format_args!("dialing rank {p}: {e}")))?
                    .await
                    .map_err(|e| {
                        setup_err(
                            rank,
                            format_args!("connecting to rank {p} at {}: {e}", peers[p].0),
                        )
                    })?;
                let mut streams = Vec::with_capacity(k);
                for j in 0..k {
                    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| {
                        setup_err(rank, format_args!("opening a stream to rank {p}: {e}"))
                    })?;
                    send.write_all(&hello(rank, j))
                        .await
                        .map_err(|e| setup_err(rank, e))?;
                    authenticate(&mut send, &mut recv, &opts.secret, true)
                        .await
                        .map_err(|e| {
                            setup_err(rank, format_args!("authenticating with rank {p}: {e}"))
                        })?;
                    streams.push((recv, send));
                }
                slots[p] = Some((conn, streams));
            }
            // Accept the higher ranks; a connection that fails TLS (no job
            // certificate) or says nothing sensible is logged and dropped.
            let mut pending = world - rank - 1;
            let mut handshakes = tokio::task::JoinSet::new();
            while pending > 0 {
                tokio::select! {
                    inc = endpoint.accept() => {
                        let Some(inc) = inc else {
                            return Err(setup_err(rank, "the endpoint closed while accepting"));
                        };
                        let fps: Vec<Fingerprint> = peers.iter().map(|p| p.1).collect();
                        let secret = opts.secret.clone();
                        handshakes.spawn(accept_peer(inc, fps, rank, k, secret));
                    }
                    Some(done) = handshakes.join_next(), if !handshakes.is_empty() => {
                        match done {
                            Ok(Ok((p, conn, streams))) if slots[p].is_none() => {
                                slots[p] = Some((conn, streams));
                                pending -= 1;
                            }
                            Ok(Ok((p, ..))) => tracing::warn!(rank, "a second connection claiming rank {p}; dropped"),
                            Ok(Err(e)) => tracing::warn!(rank, "refused a QUIC connection: {e}"),
                            Err(e) => tracing::warn!(rank, "a QUIC handshake task failed: {e}"),
                        }
                    }
                }
            }
            Ok::<_, CommError>(())
        };
        match tokio::time::timeout_at(deadline.into(), build).await {
            Ok(r) => r?,
            Err(_) => {
                let missing: Vec<usize> = (0..world)
                    .filter(|&p| p != rank && slots[p].is_none())
                    .collect();
                return Err(setup_err(
                    rank,
                    format_args!(
                        "timed out after {:?} building the QUIC mesh, still missing ranks \
                         {missing:?}; check that every rank runs with the same WORLD_SIZE and \
                         that UDP is open between them",
                        opts.connect_timeout
                    ),
                ));
            }
        }
        let mut conns = Vec::new();
        let mut sends = Vec::new();
        let mut streams: Vec<Vec<(BoxRead, BoxWrite)>> = Vec::with_capacity(world);
        for slot in slots {
            match slot {
                Some((c, s)) => {
                    conns.push(c);
                    streams.push(
                        s.into_iter()
                            .map(|(r, w)| {
                                let w = SharedSend(Arc::new(std::sync::Mutex::new(w)));
                                sends.push(w.clone());
                                (Box::pin(r) as BoxRead, Box::pin(w) as BoxWrite)
                            })
                            .collect(),
                    );
                }
                None => streams.push(Vec::new()),
            }
        }
        let links = streams
            .into_iter()
            .enumerate()
            .map(|(p, s)| {
                if p == rank {
                    PeerLink::Me
                } else {
                    PeerLink::Streams(s)
                }
            })
            .collect();
        let wake = Arc::new(tokio::sync::Notify::new());
        let driver = MeshOptions {
            local: None,
            ..opts.driver.clone()
        };
        let inner = MeshBackend::from_links("quic", rank, links, wake, driver)?;
        let gate = endpoint.clone();
        let gatekeeper = tokio::spawn(async move {
            while let Some(inc) = gate.accept().await {
                tracing::warn!(
                    rank,
                    from = %inc.remote_address(),
                    "refused a QUIC connection after the mesh was built"
                );
                inc.refuse();
            }
        });
        Ok(QuicBackend {
            inner,
            endpoint,
            conns,
            gatekeeper,
            idle_timeout: opts.idle_timeout,
            sends,
        })
    }

    /// The UDP address this rank listens on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.endpoint.local_addr().ok()
    }
}

/// One incoming connection: TLS (client certificate pinned by the server
/// config), then which rank it is, then its streams.
async fn accept_peer(
    inc: quinn::Incoming,
    fps: Vec<Fingerprint>,
    rank: usize,
    k: usize,
    secret: Option<Secret>,
) -> std::result::Result<(usize, Connection, Streams), String> {
    let from = inc.remote_address();
    let work = async {
        let conn = inc
            .await
            .map_err(|e| format!("from {from}: TLS/QUIC handshake: {e}"))?;
        let certs = conn
            .peer_identity()
            .and_then(|i| {
                i.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                    .ok()
            })
            .ok_or_else(|| format!("from {from}: no client certificate"))?;
        let fp = certs
            .first()
            .map(|c| tls::fingerprint(c))
            .ok_or_else(|| format!("from {from}: empty certificate chain"))?;
        let p = fps
            .iter()
            .position(|f| *f == fp)
            .ok_or_else(|| format!("from {from}: certificate not of this job"))?;
        if p <= rank {
            return Err(format!("from {from}: rank {p} should not dial rank {rank}"));
        }
        let mut streams: Vec<Option<(RecvStream, SendStream)>> = (0..k).map(|_| None).collect();
        for _ in 0..k {
            let (mut send, mut recv) = conn
                .accept_bi()
                .await
                .map_err(|e| format!("from rank {p}: accepting a stream: {e}"))?;
            let mut h = [0u8; 9];
            recv.read_exact(&mut h)
                .await
                .map_err(|e| format!("from rank {p}: reading the hello: {e}"))?;
            let claimed = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
            let j = h[8] as usize;
            if h[..4] != HELLO_MAGIC || claimed != p || j >= k || streams[j].is_some() {
                return Err(format!("from rank {p}: a malformed stream hello"));
            }
            authenticate(&mut send, &mut recv, &secret, false)
                .await
                .map_err(|e| format!("from rank {p}: {e}"))?;
            streams[j] = Some((recv, send));
        }
        Ok((p, conn, streams.into_iter().flatten().collect()))
    };
    tokio::time::timeout(auth::HANDSHAKE_TIMEOUT, work)
        .await
        .map_err(|_| format!("from {from}: the handshake timed out"))?
}

#[async_trait]
impl Backend for QuicBackend {
    fn name(&self) -> &'static str {
        "quic"
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn group_id(&self) -> GroupId {
        self.inner.group_id()
    }

    fn default_timeout(&self) -> Duration {
        self.inner.default_timeout()
    }

    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        self.inner.submit(op, opts)
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        // Subgroups share this rank's QUIC connections; the world handle
        // keeps the endpoint, and closes it when dropped.
        Ok(self
            .inner
            .subgroup(ranks, opts)?
            .map(|b| Arc::new(b) as Arc<dyn Backend>))
    }
}
