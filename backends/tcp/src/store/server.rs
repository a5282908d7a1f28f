//! The TCPStore server: one tokio task accepts, one task per client reads
//! requests, and one task per client writes replies (so that a `set` from
//! one client can wake another client's `wait`).

use std::{
    collections::{HashMap, VecDeque},
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use consort_comm::store::{StoreError, StoreResult, add_to_value, compare_set_rule};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt, BufReader},
    net::{TcpListener, TcpStream, ToSocketAddrs},
    sync::mpsc,
    task::JoinSet,
};

use super::wire::{self, ReadError, cmd};
use crate::auth::{self, HANDSHAKE_TIMEOUT, Secret};

type ClientId = u64;
type Reply = mpsc::UnboundedSender<Vec<u8>>;

#[derive(Default)]
struct State {
    /// Bytes of keys and values held (map and queues).
    bytes: usize,
    /// The limit on `bytes` ([`ServerOptions::max_bytes`]).
    max_bytes: usize,
    map: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// key -> clients waiting for it.
    waiting: HashMap<Vec<u8>, Vec<ClientId>>,
    /// client -> (keys still missing, its reply channel).
    awaited: HashMap<ClientId, (usize, Reply)>,
}

impl State {
    /// Accounts for a write that adds `add` bytes and frees `free`, or
    /// refuses it (the client is then dropped: the protocol has no error
    /// reply) with a reason naming the limit.
    fn charge(&mut self, add: usize, free: usize) -> Result<(), Closed> {
        let new = self.bytes.saturating_sub(free).saturating_add(add);
        if add > free && new > self.max_bytes {
            return Err(Closed::Refused(format!(
                "this write of {add} bytes would take the store from {} to {new} bytes, past its \
                 limit of {} (CONSORT_STORE_MAX_BYTES on the process that hosts the store, or \
                 ServerOptions::max_bytes); the store holds rendezvous data, not tensors",
                self.bytes, self.max_bytes
            )));
        }
        self.bytes = new;
        Ok(())
    }

    /// The bytes `key` holds in the map (key and value), 0 if absent.
    fn held(&self, key: &[u8]) -> usize {
        self.map.get(key).map_or(0, |v| key.len() + v.len())
    }

    /// Stores `key = value` within the limit, and wakes its waiters.
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>) -> Result<(), Closed> {
        self.charge(key.len() + value.len(), self.held(&key))?;
        self.map.insert(key.clone(), value);
        self.wake(&key);
        Ok(())
    }

    /// Stores every pair, all or nothing: the net change (a key repeated in
    /// the request counts once, at its last value) is charged first.
    fn put_all(&mut self, pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Result<(), Closed> {
        let mut last: HashMap<&[u8], usize> = HashMap::new();
        for (k, v) in &pairs {
            last.insert(k, k.len() + v.len());
        }
        let add: usize = last.values().sum();
        let free: usize = last.keys().map(|k| self.held(k)).sum();
        self.charge(add, free)?;
        for (k, v) in pairs {
            self.map.insert(k.clone(), v);
            self.wake(&k);
        }
        Ok(())
    }

    /// Appends to the queue under `key` (charging its key when the queue
    /// is new) and wakes one waiter.
    fn push(&mut self, key: Vec<u8>, value: Vec<u8>) -> Result<(), Closed> {
        let fresh = if self.queues.contains_key(&key) {
            0
        } else {
            key.len()
        };
        self.charge(fresh + value.len(), 0)?;
        self.queues.entry(key.clone()).or_default().push_back(value);
        self.wake_one(&key);
        Ok(())
    }

    /// QUEUE_POP's reply (torch's: the length before, then the value if
    /// there was one); an emptied queue is forgotten, key and all.
    fn pop(&mut self, key: &[u8]) -> Vec<u8> {
        let Some(q) = self.queues.get_mut(key) else {
            return 0i64.to_le_bytes().to_vec();
        };
        let mut out = (q.len() as i64).to_le_bytes().to_vec();
        let mut freed = 0;
        if let Some(v) = q.pop_front() {
            wire::put_bytes(&mut out, &v);
            freed += v.len();
        }
        if q.is_empty() {
            self.queues.remove(key);
            freed += key.len();
        }
        self.bytes = self.bytes.saturating_sub(freed);
        out
    }

    fn has(&self, k: &[u8]) -> bool {
        self.map.contains_key(k) || self.queues.get(k).is_some_and(|q| !q.is_empty())
    }

    /// A key came into existence: wake every client whose last missing key
    /// it was.
    fn wake(&mut self, key: &[u8]) {
        let Some(clients) = self.waiting.remove(key) else {
            return;
        };
        for c in clients {
            if let Some((left, tx)) = self.awaited.get_mut(&c) {
                *left -= 1;
                if *left == 0 {
                    let _ = tx.send(vec![wire::STOP_WAITING]);
                    self.awaited.remove(&c);
                }
            }
        }
    }

    /// A queue got an element: wake one waiter (queue semantics).
    fn wake_one(&mut self, key: &[u8]) {
        let Some(clients) = self.waiting.get_mut(key) else {
            return;
        };
        while let Some(c) = clients.first().copied() {
            clients.remove(0);
            if let Some((left, tx)) = self.awaited.get_mut(&c) {
                *left -= 1;
                if *left == 0 {
                    let _ = tx.send(vec![wire::STOP_WAITING]);
                    self.awaited.remove(&c);
                }
                break;
            }
        }
        if clients.is_empty() {
            self.waiting.remove(key);
        }
    }

    fn forget(&mut self, client: ClientId) {
        if self.awaited.remove(&client).is_some() {
            self.waiting.retain(|_, v| {
                v.retain(|c| *c != client);
                !v.is_empty()
            });
        }
    }
}

/// The default limit on what a store holds: 1 GiB of keys and values.
/// Rendezvous data (addresses, NCCL ids, counters) is a few KiB per rank.
pub const DEFAULT_STORE_MAX_BYTES: usize = 1 << 30;

/// How a [`TcpStoreServer`] runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Shared secret every client must prove ([`crate::auth`]).
    pub secret: Option<Secret>,
    /// The most bytes of keys and values it holds; a write past it drops
    /// the writing client (the protocol has no error reply) and logs the
    /// limit.
    pub max_bytes: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            secret: None,
            max_bytes: DEFAULT_STORE_MAX_BYTES,
        }
    }
}

impl ServerOptions {
    /// `CONSORT_SECRET`, and `CONSORT_STORE_MAX_BYTES` (bytes, with an
    /// optional K, M, G or T suffix) over the default limit.
    pub fn from_env() -> StoreResult<Self> {
        let mut o = ServerOptions {
            secret: Secret::from_env(),
            ..Default::default()
        };
        if let Ok(v) = std::env::var("CONSORT_STORE_MAX_BYTES")
            && !v.trim().is_empty()
        {
            o.max_bytes = parse_bytes(&v).ok_or_else(|| {
                StoreError::Protocol(format!(
                    "CONSORT_STORE_MAX_BYTES={v:?} is not valid: expected a number of bytes, \
                     optionally with a K, M, G or T suffix (1024-based), such as 4G"
                ))
            })?;
        }
        Ok(o)
    }
}

/// `4096`, `64K`, `1G`: bytes with an optional 1024-based suffix.
fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, shift) = match s.chars().last()?.to_ascii_uppercase() {
        'K' => (&s[..s.len() - 1], 10),
        'M' => (&s[..s.len() - 1], 20),
        'G' => (&s[..s.len() - 1], 30),
        'T' => (&s[..s.len() - 1], 40),
        _ => (s, 0),
    };
    num.trim()
        .parse::<usize>()
        .ok()?
        .checked_mul(1usize << shift)
}

/// A TCPStore server, wire-compatible with `torch.distributed.TCPStore`.
///
/// It runs on the tokio runtime it was bound on, and stops when
/// [`TcpStoreServer::shutdown`] is called or the value is dropped.
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    tasks: JoinSet<()>,
}

impl TcpStoreServer {
    /// Listens on `addr` (port 0 picks a free port), open to any client.
    pub async fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> StoreResult<Self> {
        Self::bind_with(addr, None).await
    }

    /// Listens on `addr`; with a `secret`, every client must pass the
    /// [`crate::auth`] handshake before its first request (torch's own
    /// clients cannot: use a secret only when every client is consort).
    pub async fn bind_with(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        secret: Option<Secret>,
    ) -> StoreResult<Self> {
        let opts = ServerOptions {
            secret,
            ..Default::default()
        };
        Self::bind_opts(addr, opts).await
    }

    /// Listens on `addr` with `opts` (a secret, a memory limit).
    pub async fn bind_opts(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        opts: ServerOptions,
    ) -> StoreResult<Self> {
        let ServerOptions { secret, max_bytes } = opts;
        let shown = format!("{addr:?}").trim_matches('"').to_string();
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| StoreError::Bind {
                addr: shown.clone(),
                reason: e.to_string(),
            })?;
        let local_addr = listener.local_addr().map_err(|e| StoreError::Bind {
            addr: shown,
            reason: e.to_string(),
        })?;
        let state = Arc::new(Mutex::new(State {
            max_bytes,
            ..State::default()
        }));
        let mut tasks = JoinSet::new();
        tasks.spawn(accept_loop(listener, state, secret));
        tracing::debug!(%local_addr, "TCPStore server listening");
        Ok(TcpStoreServer { local_addr, tasks })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, closes every client connection, and waits for the
    /// tasks to end.
    pub async fn shutdown(mut self) {
        self.tasks.shutdown().await;
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<Mutex<State>>, secret: Option<Secret>) {
    let mut clients = JoinSet::new();
    let mut next_id: ClientId = 0;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    next_id += 1;
                    clients.spawn(serve_client(stream, peer, next_id, state.clone(), secret.clone()));
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("TCPStore accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // Every update leaves the state consistent before it can panic, so a
    // poisoned lock is still usable.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

async fn serve_client(
    mut stream: TcpStream,
    peer: SocketAddr,
    id: ClientId,
    state: Arc<Mutex<State>>,
    secret: Option<Secret>,
) {
    let _ = stream.set_nodelay(true);
    if let Some(k) = &secret {
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, auth::accept(&mut stream, k)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(%peer, "TCPStore refused a client: {e}");
                return;
            }
            Err(_) => {
                tracing::warn!(%peer, "TCPStore refused a client: no answer to the CONSORT_SECRET challenge");
                return;
            }
        }
    }
    let (r, mut w) = stream.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let writer = tokio::spawn(async move {
        while let Some(buf) = rx.recv().await {
            if w.write_all(&buf).await.is_err() {
                break;
            }
        }
    });
    let mut r = BufReader::new(r);
    match handle_requests(&mut r, id, &tx, &state).await {
        Ok(()) => {}
        Err(Closed::Eof) => tracing::trace!(%peer, "TCPStore client disconnected"),
        Err(Closed::Refused(why)) => {
            tracing::warn!(%peer, "TCPStore closed a client connection: {why}");
        }
    }
    lock(&state).forget(id);
    drop(tx);
    let _ = writer.await;
}

enum Closed {
    Eof,
    Refused(String),
}

impl From<ReadError> for Closed {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Closed::Eof,
            ReadError::Io(e) => Closed::Refused(e.to_string()),
            other => Closed::Refused(other.to_string()),
        }
    }
}

impl From<std::io::Error> for Closed {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e).into()
    }
}

async fn handle_requests(
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    id: ClientId,
    tx: &Reply,
    state: &Mutex<State>,
) -> Result<(), Closed> {
    // The first message must be VALIDATE with torch's magic.
    let first = r.read_u8().await?;
    if first != cmd::VALIDATE {
        return Err(Closed::Refused(format!(
            "first message was command {first}, not VALIDATE; not a TCPStore client"
        )));
    }
    let magic = r.read_u32_le().await?;
    if magic != wire::VALIDATION_MAGIC {
        return Err(Closed::Refused(format!("bad validation magic {magic:#x}")));
    }
    let send = |b: Vec<u8>| {
        let _ = tx.send(b);
    };
    loop {
        let command = match r.read_u8().await {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        match command {
            cmd::PING => {
                let nonce = r.read_u32_le().await?;
                send(nonce.to_le_bytes().to_vec());
            }
            cmd::SET => {
                let key = wire::read_key(r).await?;
                let value = wire::read_value(r).await?;
                lock(state).put(key, value)?;
            }
            cmd::COMPARE_SET => {
                let key = wire::read_key(r).await?;
                let expected = wire::read_value(r).await?;
                let desired = wire::read_value(r).await?;
                let mut s = lock(state);
                let (reply, store) =
                    compare_set_rule(s.map.get(&key).map(Vec::as_slice), &expected, &desired);
                let mut out = Vec::with_capacity(8 + reply.len());
                wire::put_bytes(&mut out, reply);
                if let Some(v) = store {
                    let v = v.to_vec();
                    s.put(key, v)?;
                }
                send(out);
            }
            cmd::GET => {
                let key = wire::read_key(r).await?;
                let s = lock(state);
                let mut out = Vec::new();
                // A missing key reads as empty, as in torch's server.
                wire::put_bytes(&mut out, s.map.get(&key).map_or(&[][..], Vec::as_slice));
                send(out);
            }
            cmd::ADD => {
                let key = wire::read_key(r).await?;
                let delta = r.read_i64_le().await?;
                let mut s = lock(state);
                let name = String::from_utf8_lossy(&key).into_owned();
                // torch's server drops the client here (no error reply exists
                // in the protocol); we do the same, with a clear log line.
                let (new, bytes) = add_to_value(&name, s.map.get(&key).map(Vec::as_slice), delta)
                    .map_err(|e| Closed::Refused(e.to_string()))?;
                s.put(key, bytes)?;
                send(new.to_le_bytes().to_vec());
            }
            cmd::CHECK => {
                let keys = wire::read_keys(r).await?;
                let s = lock(state);
                let ready = keys.iter().all(|k| s.has(k));
                send(vec![if ready {
                    wire::CHECK_READY
                } else {
                    wire::CHECK_NOT_READY
                }]);
            }
            cmd::WAIT => {
                let keys = wire::read_keys(r).await?;
                let mut s = lock(state);
                let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !s.has(k)).collect();
                if missing.is_empty() {
                    send(vec![wire::STOP_WAITING]);
                } else {
                    s.forget(id);
                    s.awaited.insert(id, (missing.len(), tx.clone()));
                    for k in missing {
                        s.waiting.entry(k).or_default().push(id);
                    }
                }
            }
            cmd::GETNUMKEYS => {
                let n = lock(state).map.len() as i64;
                send(n.to_le_bytes().to_vec());
            }
            cmd::DELETE_KEY => {
                let key = wire::read_key(r).await?;
                let mut s = lock(state);
                let held = s.held(&key);
                s.bytes = s.bytes.saturating_sub(held);
                let n = i64::from(s.map.remove(&key).is_some());
                send(n.to_le_bytes().to_vec());
            }
            cmd::APPEND => {
                let key = wire::read_key(r).await?;
                let value = wire::read_value(r).await?;
                let mut s = lock(state);
                let fresh = if s.map.contains_key(&key) {
                    0
                } else {
                    key.len()
                };
                s.charge(fresh + value.len(), 0)?;
                s.map
                    .entry(key.clone())
                    .or_default()
                    .extend_from_slice(&value);
                s.wake(&key);
            }
            cmd::MULTI_GET => {
                let keys = wire::read_keys(r).await?;
                let s = lock(state);
                let mut out = Vec::new();
                for k in &keys {
                    wire::put_bytes(&mut out, s.map.get(k).map_or(&[][..], Vec::as_slice));
                }
                send(out);
            }
            cmd::MULTI_SET => {
                let n = wire::read_count(r).await?;
                let mut pairs = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    let k = wire::read_key(r).await?;
                    let v = wire::read_value(r).await?;
                    pairs.push((k, v));
                }
                lock(state).put_all(pairs)?;
            }
            cmd::CANCEL_WAIT => {
                lock(state).forget(id);
                send(vec![wire::WAIT_CANCELED]);
            }
            cmd::QUEUE_PUSH => {
                let key = wire::read_key(r).await?;
                let value = wire::read_value(r).await?;
                lock(state).push(key, value)?;
            }
            cmd::QUEUE_POP => {
                let key = wire::read_key(r).await?;
                let reply = lock(state).pop(&key);
                send(reply);
            }
            cmd::QUEUE_LEN => {
                let key = wire::read_key(r).await?;
                let n = lock(state).queues.get(&key).map_or(0, VecDeque::len) as i64;
                send(n.to_le_bytes().to_vec());
            }
            other => {
                return Err(Closed::Refused(format!("unknown command byte {other}")));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_take_1024_based_suffixes_and_refuse_overflow() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes(" 64k "), Some(64 << 10));
        assert_eq!(parse_bytes("4G"), Some(4 << 30));
        assert_eq!(parse_bytes("1T"), Some(1 << 40));
        for bad in ["", "G", "-1", "1.5G", "99999999999999999T", "four"] {
            assert_eq!(parse_bytes(bad), None, "{bad}");
        }
    }
}
