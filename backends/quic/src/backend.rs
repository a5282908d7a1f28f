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
//!    schedules and frames as TCP, and close the gate to newcomers.

use std::{net::IpAddr, sync::Arc, time::Duration};

use async_trait::async_trait;
use consort_comm::{Backend, CallOptions, GroupId, Op, Result, Store, Work};
use consort_mesh::{MeshBackend, MeshOptions, Secret, rendezvous};
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
/// per-job certificates pinned through the store.
pub struct QuicBackend {
    inner: MeshBackend,
    gate: Gate,
    idle_timeout: Duration,
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
        // Unlike TCP's, QUIC's unsent and unacknowledged data dies with the
        // connection, and the connection with this process. So send the
        // parting aborts (`MeshBackend::parting`: they must go before the
        // streams end, and the mesh's own drop runs after this one), finish
        // every stream and wait (up to the idle timeout) until the peers have
        // acknowledged all of it, then close: a rank that returns from its
        // last collective and exits cannot strand a peer that still needs
        // its final frames.
        let sends = std::mem::take(&mut *lock(&self.gate.made.sends));
        let conns = std::mem::take(&mut *lock(&self.gate.made.conns));
        let endpoint = self.gate.endpoint.clone();
        let close = move |conns: &[quinn::Connection], endpoint: &quinn::Endpoint| {
            for c in conns {
                c.close(VarInt::from_u32(0), b"rank left");
            }
            endpoint.close(VarInt::from_u32(0), b"rank left");
        };
        let linger = self.idle_timeout;
        let (conns2, endpoint2) = (conns.clone(), endpoint.clone());
        let parting = self.inner.parting();
        let work = async move {
            parting.await;
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
            close(&conns2, &endpoint2);
        };
        if !consort_mesh::finish_in_drop(work, linger.saturating_add(Duration::from_secs(5))) {
            // No runtime to wait for acknowledgements on: close at once.
            close(&conns, &endpoint);
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl QuicBackend {
    /// Joins a group of `world` ranks as `rank` over QUIC, meeting through
    /// `store`. Every rank must call it with the same namespace.
    pub async fn connect(
        store: Arc<dyn Store>,
        rank: usize,
        world: usize,
        opts: QuicOptions,
    ) -> Result<Self> {
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
        let inner = rendezvous::connect(store, rank, world, mesh, net).await?;
        gate.close();
        Ok(QuicBackend {
            inner,
            gate,
            idle_timeout: opts.idle_timeout,
        })
    }

    /// What each peer's link is: "quic", "shm" (a peer on this host, with
    /// [`MeshOptions::local`] set), or "self".
    pub fn transports(&self) -> Vec<&'static str> {
        self.inner
            .transports()
            .into_iter()
            .map(|t| if t == "stream" { "quic" } else { t })
            .collect()
    }

    /// The UDP address this rank listens on.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.gate.endpoint.local_addr().ok()
    }
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

    fn lost_peers(&self) -> Vec<(usize, String)> {
        self.inner.lost_peers()
    }

    fn peer_aborts(&self) -> Vec<consort_comm::PeerAbort> {
        self.inner.peer_aborts()
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
