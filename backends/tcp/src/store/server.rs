//! The TCPStore server: one tokio task accepts, one task per client reads
//! requests ([`requests`]), and one task per client writes replies (so that
//! a `set` from one client can wake another client's `wait`).
//!
//! A hostile or broken client costs bounded memory: what the store holds,
//! the requests being read and the replies not yet written all count
//! against one limit ([`state`]); connections are capped; a client must
//! send VALIDATE soon after connecting and finish each request it starts.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use consort_comm::store::{StoreError, StoreResult};
use tokio::{
    io::{AsyncWriteExt, BufReader, BufWriter},
    net::{TcpListener, TcpStream, ToSocketAddrs},
    sync::mpsc,
    task::JoinSet,
};

use super::wire::ReadError;
use crate::auth::{self, HANDSHAKE_TIMEOUT, Secret};

mod budget;
mod requests;
#[doc(hidden)]
pub use requests::{Fed, feed};
mod state;

use budget::{Budget, ClientId, Conn, Phase, Value};
use state::{Out, Reply, State};

/// The default limit on what a store holds: 1 GiB of keys and values.
/// Rendezvous data (addresses, NCCL ids, counters) is a few KiB per rank.
pub const DEFAULT_STORE_MAX_BYTES: usize = 1 << 30;

/// The default cap on connected clients (each costs a few KiB).
pub const DEFAULT_STORE_MAX_CLIENTS: usize = 16 * 1024;

/// How a [`TcpStoreServer`] runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Shared secret every client must prove ([`crate::auth`]).
    pub secret: Option<Secret>,
    /// The most bytes it holds or owes: keys and values, requests being
    /// read and replies not yet written. A request or reply past it drops
    /// that client (the protocol has no error reply) and logs the limit.
    pub max_bytes: usize,
    /// The most clients connected at once; more are closed as they come,
    /// with a log line.
    pub max_clients: usize,
    /// How long a new connection may take to send VALIDATE (and, with a
    /// secret, to pass the handshake).
    pub validate_timeout: Duration,
    /// How long a client may take to send the rest of a request once its
    /// first byte has come. Between requests a client may stay idle: torch
    /// clients hold one connection for a whole job.
    pub request_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            secret: None,
            max_bytes: DEFAULT_STORE_MAX_BYTES,
            max_clients: DEFAULT_STORE_MAX_CLIENTS,
            validate_timeout: HANDSHAKE_TIMEOUT,
            request_timeout: Duration::from_secs(30),
        }
    }
}

impl ServerOptions {
    /// `CONSORT_SECRET`, `CONSORT_STORE_MAX_BYTES` (bytes, with an
    /// optional K, M, G or T suffix) and `CONSORT_STORE_MAX_CLIENTS` over
    /// the defaults.
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
        if let Ok(v) = std::env::var("CONSORT_STORE_MAX_CLIENTS")
            && !v.trim().is_empty()
        {
            o.max_clients = v
                .trim()
                .parse()
                .ok()
                .filter(|&n: &usize| n > 0)
                .ok_or_else(|| {
                    StoreError::Protocol(format!(
                        "CONSORT_STORE_MAX_CLIENTS={v:?} is not valid: expected a whole number of \
                     clients, at least 1"
                    ))
                })?;
        }
        Ok(o)
    }
}

/// `4096`, `64K`, `1G`: bytes with an optional 1024-based suffix.
pub fn parse_bytes(s: &str) -> Option<usize> {
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
///
/// `TCPStore(host, port, is_master=True)` in torch's words; a torch client
/// can connect to it as well as a [`TcpStore`](crate::TcpStore):
///
/// ```
/// use consort_comm::Store;
/// use consort_tcp::{TcpStore, TcpStoreOptions, TcpStoreServer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let server = TcpStoreServer::bind("127.0.0.1:0").await?; // port 0: any free port
/// let opts = TcpStoreOptions { secret: None, ..Default::default() };
/// let client = TcpStore::connect(server.local_addr().to_string(), opts).await?;
/// client.set("master_weights", b"v1").await?;
/// assert_eq!(client.get("master_weights").await?, b"v1");
/// server.shutdown().await;
/// # Ok(()) }
/// ```
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
        let budget = Budget::new(opts.max_bytes);
        let state = Arc::new(Mutex::new(State::new(budget)));
        let mut tasks = JoinSet::new();
        tasks.spawn(accept_loop(listener, state, opts));
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

async fn accept_loop(listener: TcpListener, state: Arc<Mutex<State>>, opts: ServerOptions) {
    let budget = consort_comm::lock(&state).budget.clone();
    let mut clients = JoinSet::new();
    let mut next_id: ClientId = 0;
    let mut refused = 0u64;
    let mut trim = tokio::time::interval(Duration::from_secs(1));
    trim.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // At the cap, a new connection waits in the listen backlog (a
        // queue the kernel keeps in arrival order) until a connection
        // that has not proved itself is old enough to give up its slot;
        // if every connection is a client at work, it is closed at once.
        let full = clients.len() >= opts.max_clients;
        let room_at = if full { room_at(&budget) } else { None };
        let now = tokio::time::Instant::now();
        let accepting = !full || room_at.is_none_or(|t| t <= now);
        let wait_until = room_at.filter(|t| *t > now).unwrap_or(now);
        tokio::select! {
            _ = trim.tick() => {
                let b = budget.clone();
                let _ = tokio::task::spawn_blocking(move || b.trim()).await;
            }
            accepted = listener.accept(), if accepting => match accepted {
                Ok((stream, peer)) => {
                    if clients.len() >= opts.max_clients && !make_room(&budget, peer) {
                        // Closed at once: a flood of connections costs a
                        // socket each, briefly, and one log line per
                        // thousand.
                        drop(stream);
                        if refused.is_multiple_of(1000) {
                            tracing::warn!(
                                %peer,
                                "TCPStore refused a connection: {} clients are connected and \
                                 at work, its cap (CONSORT_STORE_MAX_CLIENTS, or consort store \
                                 --max-clients); {} refused so far",
                                opts.max_clients,
                                refused + 1
                            );
                        }
                        refused += 1;
                        continue;
                    }
                    next_id += 1;
                    let conn = Conn::new(next_id, peer);
                    budget.register(&conn);
                    clients.spawn(serve_client(stream, conn, state.clone(), opts.clone()));
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("TCPStore accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = tokio::time::sleep_until(wait_until), if !accepting => {}
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
        }
    }
}

/// How long a new connection keeps its slot, at the cap, before one that
/// has proved itself may take it: long enough for a client's handshake
/// (VALIDATE, or the secret's challenge) across a slow network, short
/// enough that a client waiting behind a flood is let in within a second.
const GRACE: Duration = Duration::from_millis(100);

/// The connections that may give up their slot: not yet at work, not
/// already closed.
fn idle_conns(budget: &Budget) -> impl Iterator<Item = Arc<Conn>> {
    budget
        .conns()
        .into_iter()
        .filter(|c| c.phase() < Phase::Active && !c.is_closed())
}

/// When, at the cap, a slot can next be made: when the oldest connection
/// not yet at work is [`GRACE`] old; `None` if every connection is at work.
fn room_at(budget: &Budget) -> Option<tokio::time::Instant> {
    idle_conns(budget)
        .map(|c| tokio::time::Instant::from_std(c.opened + GRACE))
        .min()
}

/// The server is full of connections: closes the oldest that has not
/// proved itself (no handshake or VALIDATE yet), else the oldest that has
/// sent no request, once [`GRACE`] old, to admit `peer`; false if none
/// may be closed.
fn make_room(budget: &Budget, peer: SocketAddr) -> bool {
    let victim = idle_conns(budget)
        .filter(|c| c.opened.elapsed() >= GRACE)
        .min_by_key(|c| (c.phase(), c.opened));
    let Some(v) = victim else {
        return false;
    };
    let what = match v.phase() {
        Phase::Pending => {
            "had not passed the handshake (VALIDATE, or the CONSORT_SECRET challenge)"
        }
        _ => "had sent no request",
    };
    // One line per thousand: a flood must not flood the log too.
    static EVICTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = EVICTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if n.is_multiple_of(1000) {
        tracing::warn!(
            peer = %v.peer,
            "TCPStore closed a connection that {what} after {:?}, to admit {peer}: it is at its \
             cap of clients ({} such so far)",
            v.opened.elapsed(),
            n + 1
        );
    }
    v.close(format!(
        "{FULL_OF_CONNECTIONS} and this one {what}; a new client took its place"
    ));
    true
}

async fn serve_client(
    stream: TcpStream,
    conn: Arc<Conn>,
    state: Arc<Mutex<State>>,
    opts: ServerOptions,
) {
    let budget = consort_comm::lock(&state).budget.clone();
    let peer = conn.peer;
    let ended = serve(stream, &conn, &state, &opts).await;
    consort_comm::lock(&state).forget(conn.id);
    budget.unregister(conn.id);
    match ended {
        Ok(()) | Err(Closed::Eof) => tracing::trace!(%peer, "TCPStore client disconnected"),
        // Said once per thousand by make_room.
        Err(Closed::Refused(why)) if why.starts_with(FULL_OF_CONNECTIONS) => {
            tracing::debug!(%peer, "TCPStore closed a client connection: {why}");
        }
        Err(Closed::Refused(why)) => {
            tracing::warn!(%peer, "TCPStore closed a client connection: {why}");
        }
    }
}

/// How a connection closed to make room is told so.
const FULL_OF_CONNECTIONS: &str = "the store was full of connections";

/// A client's connection from its handshake to its end, or until it is
/// closed from outside (shed, or its slot given to a new client). However
/// it ends, the replies to the requests it made are still written: a
/// change the store made reaches a client that reads.
async fn serve(
    mut stream: TcpStream,
    conn: &Arc<Conn>,
    state: &Arc<Mutex<State>>,
    opts: &ServerOptions,
) -> Result<(), Closed> {
    let _ = stream.set_nodelay(true);
    if let Some(k) = &opts.secret {
        let shake = tokio::time::timeout(opts.validate_timeout, auth::accept(&mut stream, k));
        match tokio::select! { r = shake => Some(r), _ = conn.closed() => None } {
            Some(Ok(Ok(()))) => {}
            Some(Ok(Err(e))) => return Err(Closed::Refused(format!("refused a client: {e}"))),
            Some(Err(_)) => {
                return Err(Closed::Refused(
                    "refused a client: no answer to the CONSORT_SECRET challenge".into(),
                ));
            }
            None => return Err(Closed::Refused(conn.closed().await)),
        }
    }
    let (r, w) = stream.into_split();
    let (tx, rx) = mpsc::unbounded_channel::<Reply>();
    let budget = consort_comm::lock(state).budget.clone();
    let out = Out {
        tx,
        budget,
        conn: conn.clone(),
    };
    let mut writer = AbortOnDrop(tokio::spawn(write_replies(w, rx, opts.request_timeout)));
    let mut r = BufReader::with_capacity(BUFFER, r);
    let deadlines = requests::Deadlines {
        validate: opts.validate_timeout,
        request: opts.request_timeout,
    };
    let ended = tokio::select! {
        ended = requests::handle_requests(&mut r, &out, state, deadlines) => ended,
        why = conn.closed() => Err(Closed::Refused(why)),
    };
    // A client that left reads what it was answered within the request
    // timeout; one closed by the server (a broken rule, its share spent,
    // shed) gets a second, so that what it holds comes back soon.
    let drain = match ended {
        Ok(()) | Err(Closed::Eof) => opts.request_timeout,
        Err(Closed::Refused(_)) => Duration::from_secs(1).min(opts.request_timeout),
    };
    // What was answered is written; the request being read (and its
    // bytes) went with the future above.
    drop(out);
    let _ = tokio::time::timeout(drain, &mut writer.0).await;
    ended
}

/// What each connection buffers for reading and for writing.
const BUFFER: usize = 2048;

/// Writes a client's replies in order; a client that does not read what it
/// asked for is cut off after the request timeout, and its queued replies
/// (with their bytes) go.
async fn write_replies(
    w: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Reply>,
    timeout: Duration,
) {
    let mut w = BufWriter::with_capacity(BUFFER, w);
    while let Some(reply) = rx.recv().await {
        let write = async {
            w.write_all(&reply.head).await?;
            for v in &reply.values {
                let b = v.as_deref().map_or(&[][..], Value::bytes);
                w.write_all(&(b.len() as u64).to_le_bytes()).await?;
                w.write_all(b).await?;
            }
            if rx.is_empty() {
                w.flush().await?;
            }
            std::io::Result::Ok(())
        };
        match tokio::time::timeout(timeout, write).await {
            Ok(Ok(())) => {}
            _ => break,
        }
    }
}

/// A task aborted when its handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Why a client's connection ended.
#[derive(Debug)]
enum Closed {
    Eof,
    Refused(String),
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Closed::Eof => f.write_str("the client closed its connection"),
            Closed::Refused(why) => f.write_str(why),
        }
    }
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
