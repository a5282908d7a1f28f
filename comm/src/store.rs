//! The rendezvous key-value [`Store`] trait (PyTorch's `c10d::Store`), the
//! in-memory [`MemStore`], the key-prefixing [`PrefixStore`], the store
//! limits, and [`StoreError`].
//!
//! This module owns store semantics, written once: `compare_set`'s rules,
//! `add` on ASCII decimal values, and the key and value limits. The
//! TCPStore client and server in consort-tcp follow the same rules on the
//! wire. This module does not own any socket.
//!
//! `MemStore` needs a clock for its timed waits; it uses `futures-timer`,
//! which works under any async runtime.

use std::{
    collections::HashMap,
    fmt, io,
    pin::pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use tokio::sync::Notify;

/// Longest key accepted: 8 KiB, as torch's TCPStore server.
pub const MAX_KEY_LEN: usize = 8 * 1024;
/// Largest value accepted: 8 MiB, as torch's TCPStore server.
pub const MAX_VALUE_LEN: usize = 8 * 1024 * 1024;
/// Most keys in one check, wait, multi_get or multi_set: 128 Ki.
pub const MAX_KEYS_PER_REQUEST: usize = 128 * 1024;
/// The store timeout PyTorch uses by default: 300 s.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(300);

/// An error from a [`Store`].
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Keys did not appear before the deadline.
    #[error(
        "timed out after {after:?} waiting for key(s) {}. The rank that should set them may \
         have failed or not started yet; check every rank's log, or raise the store timeout",
        list_keys(keys)
    )]
    Timeout {
        /// The keys waited for.
        keys: Vec<String>,
        /// How long it waited.
        after: Duration,
    },
    /// `add` found a value that is not an ASCII decimal integer.
    #[error(
        "add({key:?}): the stored value {value:?} is not a decimal integer; `add` only works \
         on keys written by `add` (or set to a number)"
    )]
    NotANumber {
        /// The key.
        key: String,
        /// The stored value (lossy UTF-8, truncated).
        value: String,
    },
    /// `add` would overflow an i64.
    #[error("add({key:?}) overflows a 64-bit signed integer")]
    Overflow {
        /// The key.
        key: String,
    },
    /// `queue_pop` without blocking found the queue empty (torch's
    /// `DistQueueEmptyError`).
    #[error(
        "the queue under {key:?} is empty; pop with block=true to wait for an element, or check \
         queue_len first"
    )]
    QueueEmpty {
        /// The queue's key.
        key: String,
    },
    /// A key, value or key list over torch's limits.
    #[error(
        "{what} of {len} is over the limit of {max} (PyTorch's TCPStore limit); store large \
         data elsewhere and put its location in the store"
    )]
    TooLarge {
        /// What was too large: "key length", "value length" or "key count".
        what: &'static str,
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Could not reach the store server before the deadline.
    #[error(
        "could not connect to the store at {addr} within {after:?}: {reason}. Check \
         MASTER_ADDR and MASTER_PORT, that rank 0 (or the launcher's agent) is running, and \
         that a firewall is not in the way"
    )]
    Connect {
        /// The address tried.
        addr: String,
        /// How long it kept trying.
        after: Duration,
        /// The last error.
        reason: String,
    },
    /// The server could not listen on its port.
    #[error(
        "could not start the store server on {addr}: {reason}. If the port is in use, another \
         job (or a stale process of this one) holds it: pick another MASTER_PORT or stop it"
    )]
    Bind {
        /// The address.
        addr: String,
        /// The OS error.
        reason: String,
    },
    /// The server closed the connection in the middle of a request.
    #[error(
        "the store at {addr} closed the connection during {during}{}",
        hint(during)
    )]
    Closed {
        /// The server address.
        addr: String,
        /// The request in flight.
        during: String,
    },
    /// An I/O error talking to the server.
    #[error("I/O error talking to the store at {addr} during {during}: {source}")]
    Io {
        /// The server address.
        addr: String,
        /// The request in flight.
        during: String,
        /// The OS error.
        #[source]
        source: Arc<io::Error>,
    },
    /// The server answered something the protocol does not allow.
    #[error("store protocol error: {0}")]
    Protocol(String),
    /// A bad argument (mismatched key and value lists).
    #[error("invalid store argument: {0}")]
    InvalidArgument(String),
}

fn hint(during: &str) -> &'static str {
    if during.starts_with("add") {
        ". PyTorch's TCPStore server drops a client whose `add` finds a value that is not a \
         decimal integer; check what was stored under that key"
    } else {
        ". The store server may have exited (rank 0 or the launcher agent died?), or refused a \
         write past its memory limit (CONSORT_STORE_MAX_BYTES where it runs; its log names the \
         write)"
    }
}

fn list_keys(keys: &[String]) -> String {
    if keys.len() <= 4 {
        format!("{keys:?}")
    } else {
        format!("{:?} and {} more", &keys[..4], keys.len() - 4)
    }
}

/// `Result` with [`StoreError`].
pub type StoreResult<T> = std::result::Result<T, StoreError>;

/// Checks a key against [`MAX_KEY_LEN`].
pub fn check_key(key: &[u8]) -> StoreResult<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(StoreError::TooLarge {
            what: "key length",
            len: key.len(),
            max: MAX_KEY_LEN,
        });
    }
    Ok(())
}

/// Checks a value against [`MAX_VALUE_LEN`].
pub fn check_value(value: &[u8]) -> StoreResult<()> {
    if value.len() > MAX_VALUE_LEN {
        return Err(StoreError::TooLarge {
            what: "value length",
            len: value.len(),
            max: MAX_VALUE_LEN,
        });
    }
    Ok(())
}

/// Checks a key list against [`MAX_KEYS_PER_REQUEST`] and each key's length.
pub fn check_keys<K: AsRef<[u8]>>(keys: &[K]) -> StoreResult<()> {
    if keys.len() > MAX_KEYS_PER_REQUEST {
        return Err(StoreError::TooLarge {
            what: "key count",
            len: keys.len(),
            max: MAX_KEYS_PER_REQUEST,
        });
    }
    keys.iter().try_for_each(|k| check_key(k.as_ref()))
}

/// The store semantics of `add`: parse the stored ASCII decimal (or start at
/// 0), add, and return the new value and its stored form.
pub fn add_to_value(key: &str, old: Option<&[u8]>, delta: i64) -> StoreResult<(i64, Vec<u8>)> {
    let base = match old {
        None => 0,
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.trim_ascii().parse::<i64>().ok())
            .ok_or_else(|| StoreError::NotANumber {
                key: key.to_string(),
                value: String::from_utf8_lossy(&v[..v.len().min(64)]).into_owned(),
            })?,
    };
    let new = base
        .checked_add(delta)
        .ok_or_else(|| StoreError::Overflow {
            key: key.to_string(),
        })?;
    Ok((new, new.to_string().into_bytes()))
}

/// The semantics of `compare_set`, shared by every store implementation:
/// returns the reply and, if the map must change, the value to store.
///
/// - missing key, empty `expected`: store `desired`, reply `desired`;
/// - missing key, other `expected`: store nothing, reply `expected`;
/// - present key equal to `expected`: store `desired`, reply `desired`;
/// - present key otherwise: store nothing, reply the current value.
pub fn compare_set_rule<'a>(
    current: Option<&'a [u8]>,
    expected: &'a [u8],
    desired: &'a [u8],
) -> (&'a [u8], Option<&'a [u8]>) {
    match current {
        None if expected.is_empty() => (desired, Some(desired)),
        None => (expected, None),
        Some(cur) if cur == expected => (desired, Some(desired)),
        Some(cur) => (cur, None),
    }
}

/// A key-value store that ranks rendezvous through (PyTorch's `c10d::Store`).
///
/// `get` and `multi_get` wait for their keys up to [`Store::timeout`], as
/// PyTorch's do. Every method is safe to call from many tasks at once.
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug {
    /// Sets `key` to `value`, waking anyone waiting for it.
    async fn set(&self, key: &str, value: &[u8]) -> StoreResult<()>;
    /// Waits for `key` (up to the store timeout) and returns its value.
    async fn get(&self, key: &str) -> StoreResult<Vec<u8>>;
    /// Adds `delta` to the decimal integer under `key` (0 if missing) and
    /// returns the new value.
    async fn add(&self, key: &str, delta: i64) -> StoreResult<i64>;
    /// Atomic compare-and-set; see [`compare_set_rule`] for the rules.
    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8])
    -> StoreResult<Vec<u8>>;
    /// Whether every key exists, without waiting.
    async fn check(&self, keys: &[&str]) -> StoreResult<bool>;
    /// Waits until every key exists, or `Timeout` after `timeout`.
    async fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<()>;
    /// Deletes `key`; returns whether it existed.
    async fn delete_key(&self, key: &str) -> StoreResult<bool>;
    /// Number of keys in the store (all prefixes).
    async fn num_keys(&self) -> StoreResult<i64>;
    /// Waits for every key and returns their values in order.
    async fn multi_get(&self, keys: &[&str]) -> StoreResult<Vec<Vec<u8>>>;
    /// Sets every `keys[i]` to `values[i]`.
    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> StoreResult<()>;
    /// Appends `value` to `key`'s value (creating it if missing).
    async fn append(&self, key: &str, value: &[u8]) -> StoreResult<()>;
    /// Appends `value` to the queue under `key` (torch's `queue_push`),
    /// waking one waiter. A non-empty queue counts as an existing key for
    /// `check` and `wait`.
    async fn queue_push(&self, key: &str, value: &[u8]) -> StoreResult<()>;
    /// Takes the oldest element of the queue under `key` (torch's
    /// `queue_pop`). With `block`, waits up to the store timeout for one;
    /// without, an empty queue is [`StoreError::QueueEmpty`].
    async fn queue_pop(&self, key: &str, block: bool) -> StoreResult<Vec<u8>>;
    /// The number of elements in the queue under `key` (torch's
    /// `queue_len`).
    async fn queue_len(&self, key: &str) -> StoreResult<i64>;
    /// Every key of the key/value map (not queues), in no set order
    /// (torch's `list_keys`).
    async fn list_keys(&self) -> StoreResult<Vec<String>>;
    /// torch's `barrier`: adds one to the counter under `key` and waits,
    /// up to `timeout`, until it reaches `world_size`.
    async fn barrier(&self, key: &str, world_size: i64, timeout: Duration) -> StoreResult<()>;
    /// The timeout `get` and `multi_get` wait for.
    fn timeout(&self) -> Duration;
}

/// Whether the counter `value` (an ASCII decimal, as `add` stores it) has
/// reached `world_size`: torch's barrier rule.
pub fn barrier_reached(key: &str, value: Option<&[u8]>, world_size: i64) -> StoreResult<bool> {
    let (count, _) = add_to_value(key, value, 0)?;
    Ok(count >= world_size)
}

/// An in-process store: a world of one, unit tests, and the simulator.
#[derive(Debug)]
pub struct MemStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    queues: Mutex<HashMap<String, std::collections::VecDeque<Vec<u8>>>>,
    changed: Notify,
    timeout: Duration,
}

impl Default for MemStore {
    fn default() -> Self {
        MemStore::new(DEFAULT_STORE_TIMEOUT)
    }
}

impl MemStore {
    /// An empty store whose `get` waits up to `timeout`.
    pub fn new(timeout: Duration) -> Self {
        MemStore {
            map: Mutex::new(HashMap::new()),
            queues: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            timeout,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding the lock cannot leave the map half-written
        // (every update is a single insert or remove), so poison is ignored.
        crate::lock(&self.map)
    }

    fn changed(&self) {
        self.changed.notify_waiters();
    }

    fn queues(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, std::collections::VecDeque<Vec<u8>>>> {
        crate::lock(&self.queues)
    }
}

#[async_trait]
impl Store for MemStore {
    async fn set(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        check_key(key.as_bytes())?;
        check_value(value)?;
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed();
        Ok(())
    }

    async fn get(&self, key: &str) -> StoreResult<Vec<u8>> {
        Ok(self.multi_get(&[key]).await?.remove(0))
    }

    async fn add(&self, key: &str, delta: i64) -> StoreResult<i64> {
        check_key(key.as_bytes())?;
        let new = {
            let mut map = self.lock();
            let (new, bytes) = add_to_value(key, map.get(key).map(Vec::as_slice), delta)?;
            map.insert(key.to_string(), bytes);
            new
        };
        self.changed();
        Ok(new)
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> StoreResult<Vec<u8>> {
        check_key(key.as_bytes())?;
        check_value(expected)?;
        check_value(desired)?;
        let reply = {
            let mut map = self.lock();
            let (reply, store) =
                compare_set_rule(map.get(key).map(Vec::as_slice), expected, desired);
            let reply = reply.to_vec();
            if let Some(v) = store {
                let v = v.to_vec();
                map.insert(key.to_string(), v);
            }
            reply
        };
        self.changed();
        Ok(reply)
    }

    async fn check(&self, keys: &[&str]) -> StoreResult<bool> {
        check_keys(keys)?;
        let map = self.lock();
        let queues = self.queues();
        Ok(keys
            .iter()
            .all(|k| map.contains_key(*k) || queues.get(*k).is_some_and(|q| !q.is_empty())))
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<()> {
        check_keys(keys)?;
        let deadline = crate::time::deadline(timeout);
        loop {
            let mut notified = pin!(self.changed.notified());
            notified.as_mut().enable();
            if self.check(keys).await? {
                return Ok(());
            }
            if crate::time::before(deadline, notified).await.is_none() {
                return Err(StoreError::Timeout {
                    keys: keys.iter().map(|k| k.to_string()).collect(),
                    after: timeout,
                });
            }
        }
    }

    async fn delete_key(&self, key: &str) -> StoreResult<bool> {
        Ok(self.lock().remove(key).is_some())
    }

    async fn num_keys(&self) -> StoreResult<i64> {
        Ok(self.lock().len() as i64)
    }

    async fn multi_get(&self, keys: &[&str]) -> StoreResult<Vec<Vec<u8>>> {
        self.wait(keys, self.timeout).await?;
        let map = self.lock();
        Ok(keys
            .iter()
            .map(|k| map.get(*k).cloned().unwrap_or_default())
            .collect())
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> StoreResult<()> {
        check_multi_set(keys, values)?;
        {
            let mut map = self.lock();
            for (k, v) in keys.iter().zip(values) {
                map.insert(k.to_string(), v.to_vec());
            }
        }
        self.changed();
        Ok(())
    }

    async fn append(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        check_key(key.as_bytes())?;
        {
            let mut map = self.lock();
            let entry = map.entry(key.to_string()).or_default();
            if entry.len() + value.len() > MAX_VALUE_LEN {
                return Err(StoreError::TooLarge {
                    what: "value length",
                    len: entry.len() + value.len(),
                    max: MAX_VALUE_LEN,
                });
            }
            entry.extend_from_slice(value);
        }
        self.changed();
        Ok(())
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        check_key(key.as_bytes())?;
        check_value(value)?;
        self.queues()
            .entry(key.to_string())
            .or_default()
            .push_back(value.to_vec());
        self.changed();
        Ok(())
    }

    async fn queue_pop(&self, key: &str, block: bool) -> StoreResult<Vec<u8>> {
        check_key(key.as_bytes())?;
        let deadline = crate::time::deadline(self.timeout);
        loop {
            let mut notified = pin!(self.changed.notified());
            notified.as_mut().enable();
            if let Some(v) = self.queues().get_mut(key).and_then(|q| q.pop_front()) {
                return Ok(v);
            }
            if !block {
                return Err(StoreError::QueueEmpty {
                    key: key.to_string(),
                });
            }
            if crate::time::before(deadline, notified).await.is_none() {
                return Err(StoreError::Timeout {
                    keys: vec![key.to_string()],
                    after: self.timeout,
                });
            }
        }
    }

    async fn queue_len(&self, key: &str) -> StoreResult<i64> {
        Ok(self.queues().get(key).map_or(0, |q| q.len() as i64))
    }

    async fn list_keys(&self) -> StoreResult<Vec<String>> {
        Ok(self.lock().keys().cloned().collect())
    }

    async fn barrier(&self, key: &str, world_size: i64, timeout: Duration) -> StoreResult<()> {
        self.add(key, 1).await?;
        let deadline = crate::time::deadline(timeout);
        loop {
            let mut notified = pin!(self.changed.notified());
            notified.as_mut().enable();
            let value = self.lock().get(key).cloned();
            if barrier_reached(key, value.as_deref(), world_size)? {
                return Ok(());
            }
            if crate::time::before(deadline, notified).await.is_none() {
                return Err(StoreError::Timeout {
                    keys: vec![key.to_string()],
                    after: timeout,
                });
            }
        }
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Checks the arguments of `multi_set`.
pub fn check_multi_set(keys: &[&str], values: &[&[u8]]) -> StoreResult<()> {
    if keys.len() != values.len() {
        return Err(StoreError::InvalidArgument(format!(
            "multi_set got {} keys but {} values",
            keys.len(),
            values.len()
        )));
    }
    check_keys(keys)?;
    values.iter().try_for_each(|v| check_value(v))
}

/// A view of another store with every key put under `prefix/`, as
/// `torch.distributed.PrefixStore`.
#[derive(Debug, Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Keys become `"{prefix}/{key}"` in `inner`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store underneath.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    fn keys(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.key(k)).collect()
    }
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[async_trait]
impl Store for PrefixStore {
    async fn set(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        self.inner.set(&self.key(key), value).await
    }
    async fn get(&self, key: &str) -> StoreResult<Vec<u8>> {
        self.inner.get(&self.key(key)).await
    }
    async fn add(&self, key: &str, delta: i64) -> StoreResult<i64> {
        self.inner.add(&self.key(key), delta).await
    }
    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> StoreResult<Vec<u8>> {
        self.inner
            .compare_set(&self.key(key), expected, desired)
            .await
    }
    async fn check(&self, keys: &[&str]) -> StoreResult<bool> {
        self.inner.check(&refs(&self.keys(keys))).await
    }
    async fn wait(&self, keys: &[&str], timeout: Duration) -> StoreResult<()> {
        self.inner.wait(&refs(&self.keys(keys)), timeout).await
    }
    async fn delete_key(&self, key: &str) -> StoreResult<bool> {
        self.inner.delete_key(&self.key(key)).await
    }
    async fn num_keys(&self) -> StoreResult<i64> {
        self.inner.num_keys().await
    }
    async fn multi_get(&self, keys: &[&str]) -> StoreResult<Vec<Vec<u8>>> {
        self.inner.multi_get(&refs(&self.keys(keys))).await
    }
    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> StoreResult<()> {
        self.inner.multi_set(&refs(&self.keys(keys)), values).await
    }
    async fn append(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        self.inner.append(&self.key(key), value).await
    }
    async fn queue_push(&self, key: &str, value: &[u8]) -> StoreResult<()> {
        self.inner.queue_push(&self.key(key), value).await
    }
    async fn queue_pop(&self, key: &str, block: bool) -> StoreResult<Vec<u8>> {
        self.inner.queue_pop(&self.key(key), block).await
    }
    async fn queue_len(&self, key: &str) -> StoreResult<i64> {
        self.inner.queue_len(&self.key(key)).await
    }
    /// The inner store's keys under this prefix, without it.
    async fn list_keys(&self) -> StoreResult<Vec<String>> {
        let under = self.key("");
        Ok(self
            .inner
            .list_keys()
            .await?
            .into_iter()
            .filter_map(|k| k.strip_prefix(&under).map(str::to_string))
            .collect())
    }
    async fn barrier(&self, key: &str, world_size: i64, timeout: Duration) -> StoreResult<()> {
        self.inner
            .barrier(&self.key(key), world_size, timeout)
            .await
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memstore_queues_are_fifo_wake_a_waiter_and_count_as_keys() {
        let s = std::sync::Arc::new(MemStore::new(Duration::from_secs(5)));
        let e = s.queue_pop("q", false).await.unwrap_err();
        assert!(matches!(e, StoreError::QueueEmpty { .. }), "{e}");
        s.queue_push("q", b"a").await.unwrap();
        s.queue_push("q", b"b").await.unwrap();
        assert_eq!(s.queue_len("q").await.unwrap(), 2);
        assert!(s.check(&["q"]).await.unwrap());
        assert_eq!(s.queue_pop("q", false).await.unwrap(), b"a");
        assert_eq!(s.queue_pop("q", true).await.unwrap(), b"b");
        assert!(!s.check(&["q"]).await.unwrap());
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.queue_pop("q", true).await });
        tokio::task::yield_now().await;
        s.queue_push("q", b"c").await.unwrap();
        assert_eq!(waiter.await.unwrap().unwrap(), b"c");
        let p = PrefixStore::new("job", s.clone());
        p.queue_push("q", b"d").await.unwrap();
        assert_eq!(s.queue_len("job/q").await.unwrap(), 1);
        assert_eq!(p.queue_pop("q", true).await.unwrap(), b"d");
        let quick = MemStore::new(Duration::from_millis(20));
        let e = quick.queue_pop("none", true).await.unwrap_err();
        assert!(matches!(e, StoreError::Timeout { .. }), "{e}");
    }

    #[test]
    fn compare_set_rules() {
        assert_eq!(
            compare_set_rule(None, b"", b"new"),
            (&b"new"[..], Some(&b"new"[..]))
        );
        assert_eq!(compare_set_rule(None, b"x", b"new"), (&b"x"[..], None));
        assert_eq!(
            compare_set_rule(Some(b"x"), b"x", b"y"),
            (&b"y"[..], Some(&b"y"[..]))
        );
        assert_eq!(compare_set_rule(Some(b"z"), b"x", b"y"), (&b"z"[..], None));
        assert_eq!(
            compare_set_rule(Some(b""), b"", b"y"),
            (&b"y"[..], Some(&b"y"[..]))
        );
    }

    #[test]
    fn add_parses_decimal_and_rejects_the_rest() {
        assert_eq!(add_to_value("k", None, 5).unwrap(), (5, b"5".to_vec()));
        assert_eq!(
            add_to_value("k", Some(b"3"), -5).unwrap(),
            (-2, b"-2".to_vec())
        );
        assert_eq!(add_to_value("k", Some(b" 7\n"), 1).unwrap().0, 8);
        let e = add_to_value("k", Some(b"one"), 1).unwrap_err();
        assert!(matches!(e, StoreError::NotANumber { .. }), "{e}");
        assert!(e.to_string().contains("\"one\" is not a decimal integer"));
        assert!(add_to_value("k", Some(b"\xff\xfe"), 1).is_err());
        assert!(matches!(
            add_to_value("k", Some(b"9223372036854775807"), 1),
            Err(StoreError::Overflow { .. })
        ));
    }

    #[tokio::test]
    async fn mem_store_semantics() {
        let s = MemStore::new(Duration::from_millis(200));
        s.set("a", b"1").await.unwrap();
        assert_eq!(s.get("a").await.unwrap(), b"1");
        assert_eq!(s.add("a", 4).await.unwrap(), 5);
        assert_eq!(s.get("a").await.unwrap(), b"5");
        s.set("s", b"text").await.unwrap();
        assert!(matches!(
            s.add("s", 1).await,
            Err(StoreError::NotANumber { .. })
        ));
        assert_eq!(
            s.get("s").await.unwrap(),
            b"text",
            "a failed add changes nothing"
        );
        assert_eq!(s.compare_set("c", b"", b"x").await.unwrap(), b"x");
        assert_eq!(s.compare_set("c", b"nope", b"y").await.unwrap(), b"x");
        assert_eq!(s.compare_set("c", b"x", b"y").await.unwrap(), b"y");
        assert_eq!(s.compare_set("d", b"e", b"f").await.unwrap(), b"e");
        assert!(!s.check(&["d"]).await.unwrap());
        assert!(s.check(&["a", "c"]).await.unwrap());
        assert_eq!(s.num_keys().await.unwrap(), 3);
        assert!(s.delete_key("c").await.unwrap());
        assert!(!s.delete_key("c").await.unwrap());
        s.multi_set(&["k1", "k2"], &[b"v1", b"v2"]).await.unwrap();
        assert_eq!(
            s.multi_get(&["k2", "k1"]).await.unwrap(),
            vec![b"v2".to_vec(), b"v1".to_vec()]
        );
        s.append("k1", b"+").await.unwrap();
        s.append("new", b"z").await.unwrap();
        assert_eq!(s.get("k1").await.unwrap(), b"v1+");
        assert_eq!(s.get("new").await.unwrap(), b"z");
        assert!(s.multi_set(&["k"], &[]).await.is_err());
    }

    #[tokio::test]
    async fn wait_times_out_then_wakes_on_set() {
        let s = Arc::new(MemStore::new(Duration::from_millis(100)));
        let t0 = std::time::Instant::now();
        let e = s
            .wait(&["late"], Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::Timeout { .. }), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert!(matches!(
            s.get("late").await,
            Err(StoreError::Timeout { .. })
        ));

        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.wait(&["late"], Duration::from_secs(10)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        s.set("late", b"here").await.unwrap();
        waiter.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn limits_are_enforced_with_clear_errors() {
        let s = MemStore::default();
        let big_key = "k".repeat(MAX_KEY_LEN + 1);
        let e = s.set(&big_key, b"v").await.unwrap_err();
        assert!(
            e.to_string()
                .contains("key length of 8193 is over the limit of 8192"),
            "{e}"
        );
        let big = vec![0u8; MAX_VALUE_LEN + 1];
        assert!(matches!(
            s.set("k", &big).await,
            Err(StoreError::TooLarge { .. })
        ));
        s.set("k", &big[..MAX_VALUE_LEN]).await.unwrap();
        assert!(s.append("k", b"x").await.is_err());
    }

    #[tokio::test]
    async fn prefix_store_nests_keys() {
        let base: Arc<dyn Store> = Arc::new(MemStore::default());
        let p = PrefixStore::new("default_pg", base.clone());
        let pp = PrefixStore::new("0", Arc::new(p.clone()));
        pp.set("cpu", b"v").await.unwrap();
        assert_eq!(base.get("default_pg/0/cpu").await.unwrap(), b"v");
        assert!(p.check(&["0/cpu"]).await.unwrap());
        assert_eq!(pp.add("n", 2).await.unwrap(), 2);
        assert_eq!(base.get("default_pg/0/n").await.unwrap(), b"2");
    }
}
