//! The TCPStore client: one connection, one request in flight at a time,
//! every request under a deadline.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use consort_comm::store::{
    DEFAULT_STORE_TIMEOUT, MAX_KEY_LEN, Store, StoreError, StoreResult, check_key, check_keys,
    check_multi_set, check_value,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt, BufReader},
    net::{
        TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::Mutex,
    time::{Instant, sleep, timeout},
};

use super::wire::{self, ReadError, cmd};
use crate::auth::{self, HANDSHAKE_TIMEOUT, Secret};

/// Largest reply the client accepts for one value. Larger than the server's
/// 8 MiB limit on a request because `append` can grow a value past it.
const MAX_REPLY_VALUE: u64 = 1 << 30;

/// How a [`TcpStore`] client connects and waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpStoreOptions {
    /// Deadline of every request, and of `get`'s wait for its key
    /// (torch's `timeout`, 300 s by default).
    pub timeout: Duration,
    /// How long to keep retrying the first connection while the server is
    /// not up yet.
    pub connect_timeout: Duration,
    /// Shared secret for the [`crate::auth`] handshake (`CONSORT_SECRET`);
    /// must match the server's.
    pub secret: Option<Secret>,
}

impl Default for TcpStoreOptions {
    fn default() -> Self {
        TcpStoreOptions {
            timeout: DEFAULT_STORE_TIMEOUT,
            connect_timeout: DEFAULT_STORE_TIMEOUT,
            secret: Secret::from_env(),
        }
    }
}

struct Conn {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
}

/// What a request expects back.
#[derive(Clone, Copy)]
enum Shape {
    Nothing,
    Byte,
    I64,
    Bytes,
    ManyBytes(usize),
    /// QUEUE_POP: the queue's length, then its front value if it had one.
    Popped,
    /// LIST_KEYS: a count, then that many keys.
    Keys,
}

enum Reply {
    Nothing,
    Byte(u8),
    I64(i64),
    Bytes(Vec<u8>),
    ManyBytes(Vec<Vec<u8>>),
    Popped(Option<Vec<u8>>),
}

async fn read_reply(c: &mut Conn, shape: Shape) -> Result<Reply, ReadError> {
    Ok(match shape {
        Shape::Nothing => Reply::Nothing,
        Shape::Byte => Reply::Byte(c.r.read_u8().await?),
        Shape::I64 => Reply::I64(c.r.read_i64_le().await?),
        Shape::Bytes => Reply::Bytes(wire::read_bytes(&mut c.r, MAX_REPLY_VALUE, "value").await?),
        Shape::Popped => {
            let len = c.r.read_i64_le().await?;
            if len > 0 {
                Reply::Popped(Some(
                    wire::read_bytes(&mut c.r, MAX_REPLY_VALUE, "value").await?,
                ))
            } else {
                Reply::Popped(None)
            }
        }
        Shape::Keys => {
            let n = c.r.read_u64_le().await?;
            let mut v = Vec::new();
            for _ in 0..n {
                v.push(wire::read_bytes(&mut c.r, MAX_KEY_LEN as u64, "key").await?);
            }
            Reply::ManyBytes(v)
        }
        Shape::ManyBytes(n) => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(wire::read_bytes(&mut c.r, MAX_REPLY_VALUE, "value").await?);
            }
            Reply::ManyBytes(v)
        }
    })
}

/// A client of a TCPStore server (ours or torch's), as
/// `torch.distributed.TCPStore(..., is_master=False)`.
///
/// Like torch's client it puts every user key under `/`, so that a torch
/// process and a consort process see the same keys. After a request fails
/// mid-flight (I/O error, deadline), the connection is closed and every
/// later request returns that first error.
///
/// Requests are cancel-safe: a request whose future is dropped part-way
/// (by a `select!` or a timeout around it) retires its connection, whose
/// state is then unknown, and the next request opens a fresh one. It never
/// reads the abandoned request's reply as its own.
///
/// The [`Store`] methods are torch's: `add` as a counter, `compare_set`
/// to claim a key, `wait` for keys other ranks set.
///
/// ```
/// use std::time::Duration;
/// use consort_comm::Store;
/// use consort_tcp::{TcpStore, TcpStoreOptions, TcpStoreServer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = TcpStoreServer::bind("127.0.0.1:0").await?;
/// # let addr = server.local_addr().to_string();
/// // TCPStore(host, port, is_master=False, timeout=timedelta(seconds=300))
/// let opts = TcpStoreOptions { secret: None, ..Default::default() };
/// let store = TcpStore::connect(addr, opts).await?;
/// assert_eq!(store.add("arrived", 1).await?, 1);
/// let owner = store.compare_set("leader", b"", b"rank0").await?;
/// assert_eq!(owner, b"rank0"); // the key was free: this client claimed it
/// store.wait(&["leader"], Duration::from_secs(5)).await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TcpStore {
    addr: String,
    opts: TcpStoreOptions,
    conn: Mutex<Slot>,
}

/// The client's connection between requests.
#[derive(Debug)]
enum Slot {
    Ready(ConnBox),
    /// A request was dropped mid-way (or never finished opening one): the
    /// next request opens a new connection.
    Retired,
    /// The first failure, which every later request returns.
    Failed(StoreError),
}

/// `Conn` without a `Debug` requirement on tokio's halves.
struct ConnBox(Conn);

impl std::fmt::Debug for ConnBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Conn")
    }
}

fn user_key(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(b'/');
    k.extend_from_slice(key.as_bytes());
    k
}

impl TcpStore {
    /// Connects to the server at `addr` (`host:port`), retrying until
    /// `opts.connect_timeout` while it is not up yet, then validates the
    /// connection as torch's client does (VALIDATE, then PING with the pid).
    pub async fn connect(addr: impl Into<String>, opts: TcpStoreOptions) -> StoreResult<Self> {
        let addr = addr.into();
        let conn = open(&addr, &opts).await?;
        Ok(TcpStore {
            addr,
            opts,
            conn: Mutex::new(Slot::Ready(conn)),
        })
    }

    /// The server address this client talks to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Takes the connection out for one exchange, leaving the slot
    /// `Retired` until [`TcpStore::settle`] puts it back: a request dropped
    /// part-way leaves it retired, and its connection closes with it.
    async fn take(&self, slot: &mut Slot) -> StoreResult<ConnBox> {
        match std::mem::replace(slot, Slot::Retired) {
            Slot::Ready(c) => Ok(c),
            Slot::Failed(e) => {
                *slot = Slot::Failed(e.clone());
                Err(e)
            }
            Slot::Retired => {
                tracing::debug!(addr = %self.addr, "an earlier store request was dropped part-way; opening a new connection");
                open(&self.addr, &self.opts).await
            }
        }
    }

    /// Sends one request and reads its reply under the store deadline.
    async fn call(&self, during: &str, req: &[u8], shape: Shape) -> StoreResult<Reply> {
        let mut slot = self.conn.lock().await;
        let mut c = self.take(&mut slot).await?;
        let r = timeout(self.opts.timeout, async {
            c.0.w.write_all(req).await?;
            read_reply(&mut c.0, shape).await
        })
        .await;
        self.settle(&mut slot, c, during, r)
    }

    /// Turns a request's outcome into a result: the connection goes back on
    /// success; on failure it is closed and the failure sticks (its state
    /// is unknown after a partial exchange).
    fn settle<T>(
        &self,
        slot: &mut Slot,
        conn: ConnBox,
        during: &str,
        r: Result<Result<T, ReadError>, tokio::time::error::Elapsed>,
    ) -> StoreResult<T> {
        let err = match r {
            Ok(Ok(v)) => {
                *slot = Slot::Ready(conn);
                return Ok(v);
            }
            Ok(Err(e)) => read_error(&self.addr, during, e),
            Err(_) => StoreError::Timeout {
                keys: vec![],
                after: self.opts.timeout,
            },
        };
        *slot = Slot::Failed(err.clone());
        Err(err)
    }

    /// A failure found after the exchange itself went through.
    fn fail<T>(&self, slot: &mut Slot, e: StoreError) -> StoreResult<T> {
        *slot = Slot::Failed(e.clone());
        Err(e)
    }

    /// torch's wait: send WAIT; if the deadline passes first, send
    /// CANCEL_WAIT and drain the reply (a STOP_WAITING may arrive first if
    /// the keys appeared meanwhile), then report the timeout.
    async fn wait_raw(&self, keys: &[Vec<u8>], names: &[&str], limit: Duration) -> StoreResult<()> {
        check_keys(keys)?;
        let mut req = vec![cmd::WAIT];
        wire::put_keys(&mut req, keys);
        let during = format!("wait({names:?})");
        self.wait_on(req, &during, names, limit).await
    }

    /// Sends a request answered by STOP_WAITING (WAIT, BARRIER); if the
    /// deadline passes first, cancels it as [`TcpStore::wait_raw`] says.
    async fn wait_on(
        &self,
        req: Vec<u8>,
        during: &str,
        names: &[&str],
        limit: Duration,
    ) -> StoreResult<()> {
        let mut slot = self.conn.lock().await;
        let mut c = self.take(&mut slot).await?;
        let first = timeout(limit, async {
            c.0.w.write_all(&req).await?;
            c.0.r.read_u8().await
        })
        .await;
        if let Ok(r) = first {
            let reply = self.settle(&mut slot, c, during, Ok(r.map_err(ReadError::Io)))?;
            if reply != wire::STOP_WAITING {
                let e = StoreError::Protocol(format!("WAIT answered with {reply}"));
                return self.fail(&mut slot, e);
            }
            return Ok(());
        }
        let bound = self.opts.timeout.min(Duration::from_secs(30));
        let cancel = timeout(bound, async {
            c.0.w.write_all(&[cmd::CANCEL_WAIT]).await?;
            let mut b = c.0.r.read_u8().await?;
            if b == wire::STOP_WAITING {
                b = c.0.r.read_u8().await?;
            }
            Ok::<u8, std::io::Error>(b)
        })
        .await;
        let Ok(cancel) = cancel else {
            // The bound this exchange had, not the request timeout.
            let keys = names.iter().map(|k| k.to_string()).collect();
            return self.fail(&mut slot, StoreError::Timeout { keys, after: bound });
        };
        let b = self.settle(&mut slot, c, during, Ok(cancel.map_err(ReadError::Io)))?;
        if b != wire::WAIT_CANCELED {
            let e = StoreError::Protocol(format!("CANCEL_WAIT answered with {b}"));
            return self.fail(&mut slot, e);
        }
        Err(StoreError::Timeout {
            keys: names.iter().map(|k| k.to_string()).collect(),
            after: limit,
        })
    }
}

/// A reply that could not be read, as the store error a caller sees.
fn read_error(addr: &str, during: &str, e: ReadError) -> StoreError {
    match e {
        ReadError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => StoreError::Closed {
            addr: addr.to_string(),
            during: during.to_string(),
        },
        ReadError::Io(e) => StoreError::Io {
            addr: addr.to_string(),
            during: during.to_string(),
            source: Arc::new(e),
        },
        e @ ReadError::TooLarge { .. } => {
            StoreError::Protocol(format!("reply to {during} from {addr}: {e}"))
        }
    }
}

/// Opens one validated connection: TCP (retrying until
/// `opts.connect_timeout` while the server is not up), the secret's
/// handshake, then VALIDATE and a PING with the pid, as torch's client.
async fn open(addr: &str, opts: &TcpStoreOptions) -> StoreResult<ConnBox> {
    let mut stream = dial(addr, opts.connect_timeout).await?;
    let _ = stream.set_nodelay(true);
    if let Some(k) = &opts.secret {
        let refused = |after, reason: String| StoreError::Connect {
            addr: addr.to_string(),
            after,
            reason,
        };
        match timeout(HANDSHAKE_TIMEOUT, auth::connect(&mut stream, k)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(refused(opts.connect_timeout, e.to_string())),
            Err(_) => {
                return Err(refused(
                    HANDSHAKE_TIMEOUT,
                    "the server did not start the CONSORT_SECRET handshake (is it a torch \
                     TCPStore, or started without the secret?)"
                        .into(),
                ));
            }
        }
    }
    let (r, w) = stream.into_split();
    let mut c = Conn {
        r: BufReader::new(r),
        w,
    };
    let nonce = std::process::id();
    let mut req = vec![cmd::VALIDATE];
    req.extend_from_slice(&wire::VALIDATION_MAGIC.to_le_bytes());
    req.push(cmd::PING);
    req.extend_from_slice(&nonce.to_le_bytes());
    let echoed = timeout(opts.timeout, async {
        c.w.write_all(&req).await?;
        c.r.read_u32_le().await
    })
    .await
    .map_err(|_| StoreError::Timeout {
        keys: vec![],
        after: opts.timeout,
    })?
    .map_err(|e| read_error(addr, "the handshake", ReadError::Io(e)))?;
    if echoed != nonce {
        return Err(StoreError::Protocol(format!(
            "the server at {addr} answered PING {nonce} with {echoed}; it is not a TCPStore"
        )));
    }
    Ok(ConnBox(c))
}

/// How long a name that does not resolve is retried (DNS for a pod that
/// just started may lag) before the connection fails, whatever the store
/// timeout.
const DNS_GRACE: Duration = Duration::from_secs(10);

/// A TCP connection to `addr`, retried with backoff until `within`. A host
/// name that does not resolve is said at once (warn), retried for at most
/// [`DNS_GRACE`], and then fails naming MASTER_ADDR.
async fn dial(addr: &str, within: Duration) -> StoreResult<TcpStream> {
    let deadline = Instant::from_std(consort_comm::time::deadline(within));
    let dns_deadline = Instant::from_std(consort_comm::time::deadline(within.min(DNS_GRACE)));
    let mut backoff = Duration::from_millis(10);
    let mut dns_said = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let (reason, unresolved) = match timeout(left.min(DNS_GRACE), tokio::net::lookup_host(addr))
            .await
        {
            Ok(Ok(addrs)) => {
                let addrs: Vec<_> = addrs.collect();
                let attempt = timeout(
                    deadline.saturating_duration_since(Instant::now()),
                    TcpStream::connect(&addrs[..]),
                )
                .await;
                match attempt {
                    Ok(Ok(s)) => return Ok(s),
                    Ok(Err(e)) => (e.to_string(), false),
                    Err(_) => ("connection attempt timed out".to_string(), false),
                }
            }
            Ok(Err(e)) => {
                let reason = format!(
                    "the host name does not resolve ({e}); check MASTER_ADDR (or the address \
                     given to the store)"
                );
                if !dns_said {
                    tracing::warn!(%addr, "store address: {reason}; retrying for up to {DNS_GRACE:?}");
                    dns_said = true;
                }
                (reason, true)
            }
            Err(_) => ("name lookup timed out".to_string(), true),
        };
        let give_up = if unresolved { dns_deadline } else { deadline };
        if Instant::now() + backoff >= give_up {
            return Err(StoreError::Connect {
                addr: addr.to_string(),
                after: within.min(if unresolved { DNS_GRACE } else { within }),
                reason,
            });
        }
        tracing::debug!(%addr, "store not reachable yet ({reason}); retrying");
        sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

fn unexpected(during: &str) -> StoreError {
    StoreError::Protocol(format!("internal: wrong reply shape for {during}"))
}

#[async_trait]
impl Store for TcpStore {
    async fn set(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        let k = user_key(key);
        check_key(&k)?;
        check_value(value)?;
        let mut req = vec![cmd::SET];
        wire::put_bytes(&mut req, &k);
        wire::put_bytes(&mut req, value);
        self.call(&format!("set({key:?})"), &req, Shape::Nothing)
            .await
            .map(|_| ())
    }

    async fn get(&self, key: &str) -> StoreResult<Vec<u8>> {
        Ok(self.multi_get_inner(&[key], false).await?.remove(0))
    }

    async fn add(&self, key: &str, delta: i64) -> StoreResult<i64> {
        let k = user_key(key);
        check_key(&k)?;
        let mut req = vec![cmd::ADD];
        wire::put_bytes(&mut req, &k);
        req.extend_from_slice(&delta.to_le_bytes());
        let during = format!("add({key:?})");
        match self.call(&during, &req, Shape::I64).await? {
            Reply::I64(v) => Ok(v),
            _ => Err(unexpected(&during)),
        }
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> StoreResult<Vec<u8>> {
        let k = user_key(key);
        check_key(&k)?;
        check_value(expected)?;
        check_value(desired)?;
        let mut req = vec![cmd::COMPARE_SET];
        wire::put_bytes(&mut req, &k);
        wire::put_bytes(&mut req, expected);
        wire::put_bytes(&mut req, desired);
        let during = format!("compare_set({key:?})");
        match self.call(&during, &req, Shape::Bytes).await? {
            Reply::Bytes(v) => Ok(v),
            _ => Err(unexpected(&during)),
        }
    }

    async fn check(&self, keys: &[&str]) -> StoreResult<bool> {
        let ks: Vec<Vec<u8>> = keys.iter().map(|k| user_key(k)).collect();
        check_keys(&ks)?;
        let mut req = vec![cmd::CHECK];
        wire::put_keys(&mut req, &ks);
        let during = format!("check({keys:?})");
        match self.call(&during, &req, Shape::Byte).await? {
            Reply::Byte(wire::CHECK_READY) => Ok(true),
            Reply::Byte(wire::CHECK_NOT_READY) => Ok(false),
            Reply::Byte(b) => Err(StoreError::Protocol(format!("CHECK answered with {b}"))),
            _ => Err(unexpected(&during)),
        }
    }

    async fn wait(&self, keys: &[&str], limit: Duration) -> StoreResult<()> {
        let ks: Vec<Vec<u8>> = keys.iter().map(|k| user_key(k)).collect();
        self.wait_raw(&ks, keys, limit).await
    }

    async fn delete_key(&self, key: &str) -> StoreResult<bool> {
        let k = user_key(key);
        check_key(&k)?;
        let mut req = vec![cmd::DELETE_KEY];
        wire::put_bytes(&mut req, &k);
        let during = format!("delete_key({key:?})");
        match self.call(&during, &req, Shape::I64).await? {
            Reply::I64(n) => Ok(n > 0),
            _ => Err(unexpected(&during)),
        }
    }

    async fn num_keys(&self) -> StoreResult<i64> {
        match self
            .call("num_keys()", &[cmd::GETNUMKEYS], Shape::I64)
            .await?
        {
            Reply::I64(n) => Ok(n),
            _ => Err(unexpected("num_keys()")),
        }
    }

    async fn multi_get(&self, keys: &[&str]) -> StoreResult<Vec<Vec<u8>>> {
        self.multi_get_inner(keys, true).await
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> StoreResult<()> {
        check_multi_set(keys, values)?;
        let mut req = vec![cmd::MULTI_SET];
        req.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for (k, v) in keys.iter().zip(values) {
            let k = user_key(k);
            check_key(&k)?;
            wire::put_bytes(&mut req, &k);
            wire::put_bytes(&mut req, v);
        }
        self.call(&format!("multi_set({keys:?})"), &req, Shape::Nothing)
            .await
            .map(|_| ())
    }

    async fn append(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        let k = user_key(key);
        check_key(&k)?;
        check_value(value)?;
        let mut req = vec![cmd::APPEND];
        wire::put_bytes(&mut req, &k);
        wire::put_bytes(&mut req, value);
        self.call(&format!("append({key:?})"), &req, Shape::Nothing)
            .await
            .map(|_| ())
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        let k = user_key(key);
        check_key(&k)?;
        check_value(value)?;
        let mut req = vec![cmd::QUEUE_PUSH];
        wire::put_bytes(&mut req, &k);
        wire::put_bytes(&mut req, value);
        self.call(&format!("queue_push({key:?})"), &req, Shape::Nothing)
            .await
            .map(|_| ())
    }

    /// torch's `queue_pop`: with `block`, WAIT for the key first; another
    /// client may take the element between the wait and the pop, so the
    /// wait repeats until the store timeout.
    async fn queue_pop(&self, key: &str, block: bool) -> StoreResult<Vec<u8>> {
        let k = user_key(key);
        check_key(&k)?;
        let mut req = vec![cmd::QUEUE_POP];
        wire::put_bytes(&mut req, &k);
        let during = format!("queue_pop({key:?})");
        let start = std::time::Instant::now();
        loop {
            if block {
                let left = self.opts.timeout.saturating_sub(start.elapsed());
                self.wait_raw(std::slice::from_ref(&k), &[key], left)
                    .await
                    .map_err(|e| match e {
                        // Say the whole wait, not the slice left on a retry.
                        StoreError::Timeout { keys, .. } => StoreError::Timeout {
                            keys,
                            after: self.opts.timeout,
                        },
                        other => other,
                    })?;
            }
            match self.call(&during, &req, Shape::Popped).await? {
                Reply::Popped(Some(v)) => return Ok(v),
                Reply::Popped(None) if !block => {
                    return Err(StoreError::QueueEmpty {
                        key: key.to_string(),
                    });
                }
                Reply::Popped(None) => continue,
                _ => return Err(unexpected(&during)),
            }
        }
    }

    async fn queue_len(&self, key: &str) -> StoreResult<i64> {
        let k = user_key(key);
        check_key(&k)?;
        let mut req = vec![cmd::QUEUE_LEN];
        wire::put_bytes(&mut req, &k);
        let during = format!("queue_len({key:?})");
        match self.call(&during, &req, Shape::I64).await? {
            Reply::I64(n) => Ok(n),
            _ => Err(unexpected(&during)),
        }
    }

    /// torch's `list_keys`: the server's keys, without the `/` torch's
    /// client puts before each.
    async fn list_keys(&self) -> StoreResult<Vec<String>> {
        match self
            .call("list_keys()", &[cmd::LIST_KEYS], Shape::Keys)
            .await?
        {
            Reply::ManyBytes(keys) => Ok(keys
                .into_iter()
                .map(|k| {
                    let k = String::from_utf8_lossy(&k).into_owned();
                    k.strip_prefix('/').map(str::to_string).unwrap_or(k)
                })
                .collect()),
            _ => Err(unexpected("list_keys()")),
        }
    }

    /// torch's `barrier`: one request; on the deadline, CANCEL_WAIT as
    /// torch's client does.
    async fn barrier(&self, key: &str, world_size: i64, timeout: Duration) -> StoreResult<()> {
        let k = user_key(key);
        check_key(&k)?;
        let mut req = vec![cmd::BARRIER];
        wire::put_bytes(&mut req, &k);
        req.extend_from_slice(&world_size.to_le_bytes());
        let during = format!("barrier({key:?}, {world_size})");
        self.wait_on(req, &during, &[key], timeout).await
    }

    fn timeout(&self) -> Duration {
        self.opts.timeout
    }
}

impl TcpStore {
    /// torch's `get` and `multi_get`: WAIT for the keys, then GET (one key)
    /// or MULTI_GET (several).
    async fn multi_get_inner(&self, keys: &[&str], multi: bool) -> StoreResult<Vec<Vec<u8>>> {
        let ks: Vec<Vec<u8>> = keys.iter().map(|k| user_key(k)).collect();
        check_keys(&ks)?;
        self.wait_raw(&ks, keys, self.opts.timeout).await?;
        let during = format!("get({keys:?})");
        if !multi {
            let mut req = vec![cmd::GET];
            wire::put_bytes(&mut req, &ks[0]);
            return match self.call(&during, &req, Shape::Bytes).await? {
                Reply::Bytes(v) => Ok(vec![v]),
                _ => Err(unexpected(&during)),
            };
        }
        let mut req = vec![cmd::MULTI_GET];
        wire::put_keys(&mut req, &ks);
        match self.call(&during, &req, Shape::ManyBytes(ks.len())).await? {
            Reply::ManyBytes(v) => Ok(v),
            _ => Err(unexpected(&during)),
        }
    }
}
