//! [`QuicNet`]: QUIC as a [`StreamTransport`] of the mesh rendezvous.
//!
//! Each stream the rendezvous dials is a QUIC connection of its own, with
//! one bidirectional stream: `streams` per pair are so many connections,
//! each with its own congestion window, crypto state and quinn driver task.
//!
//! Certificates are pinned both ways. A rank's published address is
//! `ip:port fingerprint`: a dialler accepts only that server certificate,
//! and a server accepts only the job's client certificates, which it
//! learns from every rank's address ([`StreamTransport::learn_peers`]).
//! Until then a client passes the TLS handshake, and the acceptor checks
//! its certificate as soon as they are known, before it reads a byte.

use std::{
    collections::HashSet,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use async_trait::async_trait;
use consort_mesh::{BoxRead, BoxWrite, StreamTransport, auth::HANDSHAKE_TIMEOUT};
use quinn::{
    ClientConfig, Connection, Endpoint, IdleTimeout, RecvStream, SendStream, ServerConfig,
    TransportConfig, VarInt,
    crypto::rustls::{QuicClientConfig, QuicServerConfig},
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    sync::{mpsc, watch},
};

use crate::tls::{self, Fingerprint, Identity, JobCerts};

/// The first bytes a dialler writes on its stream (QUIC shows a peer a new
/// stream only once data flows on it, and the rendezvous's acceptor speaks
/// first).
const OPENER: [u8; 4] = *b"CSRQ";

/// What a rank's card says of it: its address and its certificate.
fn published(addr: SocketAddr, fp: &Fingerprint) -> String {
    format!("{addr} {}", tls::hex(fp))
}

/// Reads a published `ip:port fingerprint`.
pub(crate) fn parse_published(s: &str) -> Option<(SocketAddr, Fingerprint)> {
    let (a, f) = s.split_once(' ')?;
    Some((a.parse().ok()?, tls::parse_hex(f)?))
}

fn transport(idle: Duration) -> Arc<TransportConfig> {
    let mut t = TransportConfig::default();
    t.max_idle_timeout(IdleTimeout::try_from(idle).ok());
    t.keep_alive_interval(Some(idle / 3));
    // Windows sized for multi-megabyte segments in flight on fast links.
    t.stream_receive_window(VarInt::from_u32(32 << 20));
    t.receive_window(VarInt::from_u32(128 << 20));
    t.send_window(128 << 20);
    t.max_concurrent_bidi_streams(VarInt::from_u32(8));
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

/// A QUIC send stream shared between the driver (which writes) and the
/// backend (which finishes it and waits for its acknowledgement at the
/// end). The lock is uncontended: only the driver writes.
#[derive(Clone)]
pub(crate) struct SharedSend(Arc<Mutex<SendStream>>);

impl SharedSend {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, SendStream> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl AsyncWrite for SharedSend {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut *self.lock()), cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut *self.lock()), cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut *self.lock()), cx)
    }
}

/// One connection's stream, both ways. The mesh keeps it (and its
/// connection, for the backend to finish and close) only once it splits it:
/// a stream the rendezvous drops closes its connection.
pub(crate) struct QuicStream {
    conn: Connection,
    recv: RecvStream,
    send: SendStream,
    made: Made,
}

impl AsyncRead for QuicStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        AsyncRead::poll_read(Pin::new(&mut self.recv), cx, buf)
    }
}

impl AsyncWrite for QuicStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.send), cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.send), cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut self.send), cx)
    }
}

/// The connections and send streams made so far, for the backend to
/// finish and close at the end.
#[derive(Clone, Default)]
pub(crate) struct Made {
    pub(crate) conns: Arc<Mutex<Vec<Connection>>>,
    pub(crate) sends: Arc<Mutex<Vec<SharedSend>>>,
}

impl Made {
    fn keep(&self, conn: Connection, send: SendStream) -> SharedSend {
        let send = SharedSend(Arc::new(Mutex::new(send)));
        self.conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(conn);
        self.sends
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(send.clone());
        send
    }
}

/// QUIC for the mesh rendezvous: one UDP endpoint, a connection per
/// stream, certificates pinned through the published addresses.
pub(crate) struct QuicNet {
    id: Arc<Identity>,
    pub(crate) endpoint: Endpoint,
    addr: SocketAddr,
    allowed: JobCerts,
    /// Becomes true once `allowed` is known.
    known: watch::Sender<bool>,
    idle: Duration,
    incoming: tokio::sync::Mutex<mpsc::Receiver<(QuicStream, String)>>,
    made: Made,
}

/// What the backend keeps of a [`QuicNet`] after the rendezvous: the
/// endpoint, what was made on it, and the background acceptor, which
/// refuses every connection once the gate is closed and stops when the
/// gate is dropped.
pub(crate) struct Gate {
    pub(crate) endpoint: Endpoint,
    pub(crate) made: Made,
    open: watch::Sender<bool>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl Gate {
    /// From now on every incoming connection is refused.
    pub(crate) fn close(&self) {
        self.open.send_replace(false);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl QuicNet {
    /// Makes this rank's certificate and binds a UDP endpoint on `addr`
    /// (port 0: any free port), accepting in the background from then on.
    pub(crate) fn bind(addr: SocketAddr, idle: Duration) -> Result<(Self, Gate), String> {
        let id = Arc::new(Identity::generate()?);
        let allowed = JobCerts::default();
        let tls = tls::job_server_config(&id, allowed.clone()).map_err(|e| e.to_string())?;
        let q = QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
        let mut server = ServerConfig::with_crypto(Arc::new(q));
        server.transport_config(transport(idle));
        let endpoint = bind(addr, server).map_err(|e| format!("cannot bind UDP on {addr}: {e}"))?;
        let addr = endpoint.local_addr().map_err(|e| e.to_string())?;
        let (known, _) = watch::channel(false);
        let (open, _) = watch::channel(true);
        let (tx, rx) = mpsc::channel(64);
        let made = Made::default();
        let acceptor = tokio::spawn(accept_loop(
            endpoint.clone(),
            allowed.clone(),
            known.subscribe(),
            open.subscribe(),
            made.clone(),
            tx,
        ));
        let gate = Gate {
            endpoint: endpoint.clone(),
            made: made.clone(),
            open,
            acceptor,
        };
        let net = QuicNet {
            id,
            endpoint,
            addr,
            allowed,
            known,
            idle,
            incoming: tokio::sync::Mutex::new(rx),
            made,
        };
        Ok((net, gate))
    }
}

/// Accepts every incoming connection; each handshake runs on its own task
/// under [`HANDSHAKE_TIMEOUT`], so a stray client cannot hold up the rest.
async fn accept_loop(
    endpoint: Endpoint,
    allowed: JobCerts,
    known: watch::Receiver<bool>,
    open: watch::Receiver<bool>,
    made: Made,
    tx: mpsc::Sender<(QuicStream, String)>,
) {
    while let Some(inc) = endpoint.accept().await {
        let from = inc.remote_address();
        if !*open.borrow() {
            tracing::warn!(%from, "refused a QUIC connection after the mesh was built");
            inc.refuse();
            continue;
        }
        let (allowed, known, made, tx) = (allowed.clone(), known.clone(), made.clone(), tx.clone());
        tokio::spawn(async move {
            let work = accept_one(inc, &allowed, known, &made);
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, work).await {
                Ok(Ok(s)) => {
                    let _ = tx.send((s, from.to_string())).await;
                }
                Ok(Err(e)) => tracing::warn!("refused a QUIC connection from {from}: {e}"),
                Err(_) => tracing::warn!("refused a QUIC connection from {from}: no handshake"),
            }
        });
    }
}

/// One incoming connection: TLS, the client's certificate checked against
/// the job's (waiting until they are known), its stream and opener.
async fn accept_one(
    inc: quinn::Incoming,
    allowed: &JobCerts,
    mut known: watch::Receiver<bool>,
    made: &Made,
) -> Result<QuicStream, String> {
    let conn = inc.await.map_err(|e| format!("TLS/QUIC handshake: {e}"))?;
    let fp = conn
        .peer_identity()
        .and_then(|i| {
            i.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .and_then(|c| c.first().map(|c| tls::fingerprint(c)))
        .ok_or("no client certificate")?;
    known
        .wait_for(|k| *k)
        .await
        .map_err(|_| "the rank stopped building its mesh")?;
    if allowed.check(&fp) != Some(true) {
        conn.close(VarInt::from_u32(1), b"not a certificate of this job");
        return Err(format!(
            "client certificate {} is not one of this job's",
            tls::hex(&fp)
        ));
    }
    let (send, mut recv) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("accepting its stream: {e}"))?;
    let mut o = [0u8; 4];
    recv.read_exact(&mut o)
        .await
        .map_err(|e| format!("reading its opener: {e}"))?;
    if o != OPENER {
        return Err("not a consort stream (bad opener)".into());
    }
    Ok(QuicStream {
        conn,
        recv,
        send,
        made: made.clone(),
    })
}

#[async_trait]
impl StreamTransport for QuicNet {
    type Stream = QuicStream;

    fn name(&self) -> &'static str {
        "quic"
    }

    fn address(&self) -> String {
        published(self.addr, &self.id.fingerprint)
    }

    async fn accept(&self) -> std::io::Result<(QuicStream, String)> {
        self.incoming
            .lock()
            .await
            .recv()
            .await
            .ok_or_else(|| std::io::Error::other("the QUIC endpoint closed"))
    }

    async fn dial(&self, addr: &str) -> std::io::Result<QuicStream> {
        let (to, fp) = parse_published(addr).ok_or_else(|| {
            std::io::Error::other(format!("{addr:?} is not `ip:port fingerprint`"))
        })?;
        let tls = tls::client_config(&self.id, fp).map_err(std::io::Error::other)?;
        let q = QuicClientConfig::try_from(tls).map_err(std::io::Error::other)?;
        let mut cfg = ClientConfig::new(Arc::new(q));
        cfg.transport_config(transport(self.idle));
        let conn = self
            .endpoint
            .connect_with(cfg, to, "consort")
            .map_err(std::io::Error::other)?
            .await
            .map_err(std::io::Error::other)?;
        let (mut send, recv) = conn.open_bi().await.map_err(std::io::Error::other)?;
        send.write_all(&OPENER)
            .await
            .map_err(std::io::Error::other)?;
        Ok(QuicStream {
            conn,
            recv,
            send,
            made: self.made.clone(),
        })
    }

    fn split(s: QuicStream) -> (BoxRead, BoxWrite) {
        let send = s.made.keep(s.conn, s.send);
        (Box::pin(s.recv), Box::pin(send))
    }

    fn learn_peers(&self, addrs: &[&str]) -> Result<(), String> {
        let mut fps = HashSet::with_capacity(addrs.len());
        for (r, a) in addrs.iter().enumerate() {
            let (_, fp) = parse_published(a).ok_or_else(|| {
                format!("rank {r} published {a:?}, not a QUIC `ip:port fingerprint`: is every rank on QUIC?")
            })?;
            fps.insert(fp);
        }
        self.allowed.learn(fps);
        self.known.send_replace(true);
        Ok(())
    }
}
