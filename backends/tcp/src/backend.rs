//! [`TcpBackend`]: the mesh driver over TCP connections, with shared
//! memory for the peers on this host when `TcpOptions::local` is set.
//!
//! This module owns only what is TCP's: listening, dialling, and tuning a
//! socket ([`TcpNet`]). The rendezvous, the choice of transport per peer
//! and the driver are consort-mesh's: a TCP group is a [`MeshBackend`]
//! ([`TcpBackend`]), which [`connect`] makes.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use async_trait::async_trait;
use consort_comm::{Result, store::Store};
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

/// One rank's handle on a TCP process group (the world group, or a
/// subgroup that shares the world's links): the mesh driver itself, over
/// TCP streams. [`connect`] makes one.
pub type TcpBackend = MeshBackend;

/// Joins a group of `world` ranks as `rank`: listens, publishes this
/// rank's card in `store`, and connects to every other rank (shared memory
/// to the peers on this host when `opts.local` is set, TCP to the rest:
/// lower ranks are dialled, higher ranks dial in). The backend is the mesh
/// driver's ([`MeshBackend`]); this only adds TCP's sockets.
pub async fn connect(
    store: Arc<dyn Store>,
    rank: usize,
    world: usize,
    opts: TcpOptions,
) -> Result<TcpBackend> {
    let ip = opts.bind_addr.unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let net = TcpNet::bind(ip).await.map_err(|e| {
        rendezvous::setup_err("tcp", rank, format_args!("cannot listen on {ip}: {e}"))
    })?;
    rendezvous::connect(store, rank, world, opts, net).await
}
