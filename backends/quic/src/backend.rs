//! [`QuicBackend`]: a QUIC mesh built by consort-mesh's rendezvous and
//! run by its driver.
//!
//! Setup, for rank `r` of `n` ([`crate::net`] moves the bytes):
//!
//! 1. make a job certificate and bind a UDP endpoint;
//! 2. publish a card whose address is `ip:port fingerprint`, and read
//!    every rank's ([`consort_mesh::rendezvous`], as TCP does);
//! 3. pin: dial only the certificate a rank published, accept only the
//!    job's certificates;
//! 4. dial every lower rank and accept every higher one, `streams`
//!    connections per pair, each with the hello (and, with a job secret,
//!    the HMAC challenge-response) of every stream transport;
//! 5. hand the streams to `MeshBackend`, which runs the same `comm::algo`
//!    schedules and frames as TCP, and close the gate to newcomers; the
//!    backend is that `MeshBackend`, with QUIC's last step on closing
//!    ([`consort_mesh::MeshCloser`]).

use std::{future::Future, net::IpAddr, pin::Pin, sync::Arc, time::Duration};

use consort_comm::{Result, Store};
use consort_mesh::{MeshBackend, MeshCloser, MeshOptions, Secret, rendezvous};
use quinn::VarInt;

use crate::net::{Gate, QuicNet};

/// How a [`QuicBackend`] connects and runs.
#[derive(Clone, Debug)]
pub struct QuicOptions {
    /// The address to bind the UDP endpoint on (port 0: any free port).
    /// Default: 127.0.0.1.
    pub bind_addr: Option<IpAddr>,
    /// Store key prefix (one per group and restart round).
    pub namespace: String,
    /// Connections per pair of ranks (1 to 8), each with one stream.
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
/// per-job certificates pinned through the store. It is the mesh driver
/// itself ([`MeshBackend`]) over QUIC streams; [`connect`] makes one.
pub type QuicBackend = MeshBackend;

/// Joins a group of `world` ranks as `rank` over QUIC, meeting through
/// `store`. Every rank must call it with the same namespace.
pub async fn connect(
    store: Arc<dyn Store>,
    rank: usize,
    world: usize,
    opts: QuicOptions,
) -> Result<QuicBackend> {
    let ip = opts.bind_addr.unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let (net, gate) = QuicNet::bind((ip, 0).into(), opts.idle_timeout)
        .map_err(|e| rendezvous::setup_err("quic", rank, format_args!("QUIC setup: {e}")))?;
    let mesh = MeshOptions {
        namespace: opts.namespace,
        streams: opts.streams,
        connect_timeout: opts.connect_timeout,
        secret: opts.secret,
        bind_addr: opts.bind_addr,
        ..opts.driver
    };
    let mut backend = rendezvous::connect(store, rank, world, mesh, net).await?;
    gate.close();
    backend.set_closer(Arc::new(Closer {
        gate,
        linger: opts.idle_timeout,
    }));
    Ok(backend)
}

/// QUIC's last step when the world handle closes the mesh. Unlike TCP's,
/// QUIC's unsent and unacknowledged data dies with the connection, and the
/// connection with this process: after the parting aborts and every
/// stream's finish (the mesh's close), wait (up to the idle timeout) until
/// the peers have acknowledged all of it, then close. A rank that returns
/// from its last collective and exits cannot strand a peer that still
/// needs its final frames.
struct Closer {
    gate: Gate,
    linger: Duration,
}

impl Closer {
    fn close_all(conns: &[quinn::Connection], endpoint: &quinn::Endpoint) {
        for c in conns {
            c.close(VarInt::from_u32(0), b"rank left");
        }
        endpoint.close(VarInt::from_u32(0), b"rank left");
    }
}

impl MeshCloser for Closer {
    fn closed(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        let sends = std::mem::take(&mut *lock(&self.gate.made.sends));
        let conns = std::mem::take(&mut *lock(&self.gate.made.conns));
        let endpoint = self.gate.endpoint.clone();
        let linger = self.linger;
        Box::pin(async move {
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
            Closer::close_all(&conns, &endpoint);
        })
    }

    fn budget(&self) -> Duration {
        self.linger
    }

    fn close_now(&self) {
        let conns = std::mem::take(&mut *lock(&self.gate.made.conns));
        Closer::close_all(&conns, &self.gate.endpoint);
    }
}

use consort_comm::lock;
