//! [`TcpBackend`]: the mesh driver over TCP connections, with shared
//! memory for the peers on this host when `TcpOptions::local` is set.
//!
//! This module owns only what is TCP's: listening, dialling, and tuning a
//! socket ([`TcpNet`]). The rendezvous, the choice of transport per peer
//! and the driver are consort-mesh's.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use consort_comm::{Backend, CallOptions, GroupId, Op, Result, Work, store::Store};
use consort_mesh::{BoxRead, BoxWrite, MeshBackend, MeshOptions, StreamTransport, rendezvous};
use tokio::net::{TcpListener, TcpStream};

/// How a [`TcpBackend`] connects and runs: the mesh's options.
pub type TcpOptions = MeshOptions;

/// Socket buffer size: a few segments in flight each way.
const SOCKET_BUFFER: usize = 4 << 20;

/// TCP as a stream transport: a listener on this rank's address, and
/// connections tuned for bulk transfer with no Nagle delay.
pub struct TcpNet {
    listener: TcpListener,
    addr: SocketAddr,
}

impl TcpNet {
    /// Listens on `ip`, on a port the system picks.
    pub async fn bind(ip: IpAddr) -> std::io::Result<TcpNet> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
        let addr = listener.local_addr()?;
        Ok(TcpNet { listener, addr })
    }
}

fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let s = socket2::SockRef::from(stream);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
}

#[async_trait]
impl StreamTransport for TcpNet {
    type Stream = TcpStream;

    fn name(&self) -> &'static str {
        "tcp"
    }

    fn address(&self) -> String {
        self.addr.to_string()
    }

    async fn accept(&self) -> std::io::Result<(TcpStream, String)> {
        let (s, from) = self.listener.accept().await?;
        tune(&s);
        Ok((s, from.to_string()))
    }

    async fn dial(&self, addr: &str) -> std::io::Result<TcpStream> {
        let s = TcpStream::connect(addr).await?;
        tune(&s);
        Ok(s)
    }

    fn split(s: TcpStream) -> (BoxRead, BoxWrite) {
        let (r, w) = s.into_split();
        (Box::pin(r), Box::pin(crate::close::TcpWrite::new(w)))
    }
}

/// One rank's handle on a TCP process group: the world group, or a
/// subgroup that shares the world's links.
#[derive(Debug)]
pub struct TcpBackend {
    mesh: MeshBackend,
}

impl TcpBackend {
    /// Joins a group of `world` ranks as `rank`: listens, publishes this
    /// rank's card in `store`, and connects to every other rank (shared
    /// memory to the peers on this host when `opts.local` is set, TCP to
    /// the rest: lower ranks are dialled, higher ranks dial in).
    pub async fn connect(
        store: Arc<dyn Store>,
        rank: usize,
        world: usize,
        opts: TcpOptions,
    ) -> Result<Self> {
        let ip = opts.bind_addr.unwrap_or(IpAddr::from([127, 0, 0, 1]));
        let net = TcpNet::bind(ip).await.map_err(|e| {
            rendezvous::setup_err("tcp", rank, format_args!("cannot listen on {ip}: {e}"))
        })?;
        let mesh = rendezvous::connect(store, rank, world, opts, net).await?;
        Ok(TcpBackend { mesh })
    }

    /// The transport that reaches each world rank ("self", "stream" for
    /// TCP, "shm").
    pub fn transports(&self) -> Vec<&'static str> {
        self.mesh.transports()
    }

    /// The world ranks this rank reaches through shared memory.
    pub fn shared_memory_peers(&self) -> Vec<usize> {
        self.mesh.shared_memory_peers()
    }

    /// The world ranks that read this rank's large payloads from its
    /// memory (see `consort_shm::ShmTransport::cma`).
    pub fn single_copy_peers(&self) -> Vec<usize> {
        self.mesh.single_copy_peers()
    }

    /// The mesh this backend drives.
    pub fn mesh(&self) -> &MeshBackend {
        &self.mesh
    }
}

#[async_trait]
impl Backend for TcpBackend {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> usize {
        self.mesh.rank()
    }

    fn world_size(&self) -> usize {
        self.mesh.world_size()
    }

    fn group_id(&self) -> GroupId {
        self.mesh.group_id()
    }

    fn default_timeout(&self) -> Duration {
        self.mesh.default_timeout()
    }

    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        self.mesh.submit(op, opts)
    }

    fn lost_peers(&self) -> Vec<(usize, String)> {
        self.mesh.lost_peers()
    }

    fn peer_aborts(&self) -> Vec<consort_comm::PeerAbort> {
        self.mesh.peer_aborts()
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        Ok(self
            .mesh
            .subgroup(ranks, opts)?
            .map(|mesh| Arc::new(TcpBackend { mesh }) as Arc<dyn Backend>))
    }
}
