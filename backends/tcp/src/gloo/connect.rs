//! Gloo's full-mesh rendezvous over a store (`tcp::Context::
//! createAndConnectAllPairs`): every rank publishes its [`RankInfo`] under
//! its rank, reads everyone's, and connects one TCP stream per pair. The
//! greater address of a pair dials and writes the 8-byte sequence number
//! that the listening side gave that pair; the listener matches streams to
//! pairs by it.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use consort_comm::{CommError, Result, store::Store};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::oneshot,
    time::Instant,
};

use super::wire::{Address, RankInfo, is_initiator};

/// How long a dialled or accepted connection may take to name its pair.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// `gethostname()`, as Gloo publishes it.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length, and gethostname
    // writes at most that many bytes.
    let rv = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rv != 0 {
        return "localhost".to_string();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Connects this rank to every other rank of a Gloo context whose
/// rendezvous keys live in `store` (already under the group's prefix).
/// Returns the stream to each peer (`None` for this rank).
pub async fn full_mesh(
    store: &dyn Store,
    rank: usize,
    size: usize,
    ip: IpAddr,
    timeout: Duration,
) -> Result<Vec<Option<TcpStream>>> {
    let deadline = Instant::now() + timeout;
    let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
    let device = Address {
        addr: listener.local_addr()?,
        seq: -1,
    };
    // Our pair for rank r answers to sequence number r.
    let me = RankInfo {
        hostname: hostname(),
        device,
        pair_ids: (0..size as i64).collect(),
    };
    store.set(&rank.to_string(), &me.encode()).await?;

    let mut waiting: HashMap<i64, oneshot::Sender<TcpStream>> = HashMap::new();
    let mut dials = Vec::new();
    let mut accepts = Vec::new();
    for peer in (0..size).filter(|&p| p != rank) {
        let (remote, remote_device) = peer_address(store, rank, size, peer, deadline).await?;
        let local = Address {
            addr: device.addr,
            seq: peer as i64,
        };
        match is_initiator(&local, &remote) {
            Some(true) => dials.push((peer, remote)),
            Some(false) => {
                let (tx, rx) = oneshot::channel();
                waiting.insert(peer as i64, tx);
                accepts.push((peer, rx));
            }
            None => {
                return Err(CommError::invalid(format!(
                    "rank {rank} listens on {} and rank {peer} on {}: Gloo needs one address \
                     family and distinct addresses; set GLOO_SOCKET_IFNAME to the same \
                     interface on every rank",
                    device.addr, remote_device
                )));
            }
        }
    }

    // Aborted when this function returns or is dropped, error or not: the
    // listener closes with it.
    let acceptor = AbortOnDrop(tokio::spawn(accept_loop(listener, waiting)));
    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    for (peer, remote) in dials {
        streams[peer] = Some(dial(rank, peer, remote, deadline).await?);
    }
    for (peer, rx) in accepts {
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(s)) => streams[peer] = Some(s),
            _ => {
                return Err(CommError::Timeout {
                    ctx: Default::default(),
                    after: timeout,
                    waiting_on: vec![peer],
                });
            }
        }
    }
    drop(acceptor);
    Ok(streams)
}

/// Where rank `rank` dials (or is dialled by) `peer`: the peer's device
/// and the sequence number its pair for `rank` answers to, from the rank
/// record `peer` published.
async fn peer_address(
    store: &dyn Store,
    rank: usize,
    size: usize,
    peer: usize,
    deadline: Instant,
) -> Result<(Address, SocketAddr)> {
    let key = peer.to_string();
    store.wait(&[key.as_str()], remaining(deadline)).await?;
    let info = RankInfo::decode(&store.get(&key).await?).map_err(|why| {
        CommError::protocol(
            Some(peer),
            format!("its Gloo rank record is malformed: {why}"),
        )
    })?;
    let seq = match info.pair_ids.len() {
        0 => rank as i64,
        n if n == size => info.pair_ids[rank],
        n => {
            return Err(CommError::protocol(
                Some(peer),
                format!("its Gloo rank record names {n} pairs in a group of {size}"),
            ));
        }
    };
    let remote = Address {
        addr: info.device.addr,
        seq,
    };
    Ok((remote, info.device.addr))
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// No Nagle delay (Gloo's `noDelay`), and socket buffers for a few
/// segments in flight each way.
fn tune(s: &TcpStream) {
    const BUFFER: usize = 4 << 20;
    let _ = s.set_nodelay(true);
    let sock = socket2::SockRef::from(s);
    let _ = sock.set_send_buffer_size(BUFFER);
    let _ = sock.set_recv_buffer_size(BUFFER);
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Dials `remote` until it answers or `deadline` passes (its listener may
/// not be up yet), then names the pair.
async fn dial(rank: usize, peer: usize, remote: Address, deadline: Instant) -> Result<TcpStream> {
    let mut pause = Duration::from_millis(10);
    loop {
        match tokio::time::timeout_at(deadline, TcpStream::connect(remote.addr)).await {
            Ok(Ok(mut s)) => {
                tune(&s);
                tokio::time::timeout(HELLO_TIMEOUT, s.write_all(&remote.seq.to_ne_bytes()))
                    .await
                    .map_err(|_| hello_timeout(peer))??;
                return Ok(s);
            }
            Ok(Err(e)) if Instant::now() + pause < deadline => {
                tracing::debug!(rank, peer, %e, "gloo dial failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Ok(Err(e)) => {
                return Err(CommError::PeerLost {
                    ctx: Default::default(),
                    peer,
                    reason: format!(
                        "rank {rank} could not connect to it at {}: {e}",
                        remote.addr
                    ),
                });
            }
            Err(_) => {
                return Err(CommError::PeerLost {
                    ctx: Default::default(),
                    peer,
                    reason: format!(
                        "rank {rank} could not connect to it at {} in time",
                        remote.addr
                    ),
                });
            }
        }
    }
}

fn hello_timeout(peer: usize) -> CommError {
    CommError::protocol(
        Some(peer),
        format!("its Gloo connection did not name its pair within {HELLO_TIMEOUT:?}"),
    )
}

/// Accepts connections and hands each to the pair whose sequence number it
/// writes; anything else is closed.
async fn accept_loop(listener: TcpListener, waiting: HashMap<i64, oneshot::Sender<TcpStream>>) {
    let waiting = Arc::new(std::sync::Mutex::new(waiting));
    loop {
        let (mut s, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, say: wait rather than spin.
                tracing::debug!(%e, "gloo accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let waiting = waiting.clone();
        tokio::spawn(async move {
            let mut seq = [0u8; 8];
            match tokio::time::timeout(HELLO_TIMEOUT, s.read_exact(&mut seq)).await {
                Ok(Ok(_)) => {}
                _ => return,
            }
            let seq = i64::from_ne_bytes(seq);
            let tx = consort_comm::lock(&waiting).remove(&seq);
            match tx {
                Some(tx) => {
                    tune(&s);
                    let _ = tx.send(s);
                }
                None => {
                    tracing::warn!(%from, seq, "a Gloo connection named no pair of ours; closed")
                }
            }
        });
    }
}
