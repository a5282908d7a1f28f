//! What the server holds, and the one memory budget everything it holds or
//! owes is charged against: keys and values ([`State`]), requests being
//! read, and replies not yet written ([`Lease`], [`Out`]). A client whose
//! request or reply would pass the limit is closed, and the log says why;
//! the others go on.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::sync::mpsc;

use super::super::wire;
use super::Closed;

pub(super) type ClientId = u64;

/// What one map entry, queue element, awaited key or queued reply costs
/// beyond its bytes (its allocation, its slot in a map or a queue): charged
/// too, so that empty values and empty requests are not free.
pub(super) const OVERHEAD: usize = 64;

/// The server's memory limit and what counts against it.
#[derive(Debug)]
pub(super) struct Budget {
    max: usize,
    /// Bytes of keys and values held (map and queues).
    held: AtomicUsize,
    /// Bytes of requests being read and of replies queued for writing.
    transient: AtomicUsize,
}

impl Budget {
    pub(super) fn new(max: usize) -> Arc<Self> {
        Arc::new(Budget {
            max,
            held: AtomicUsize::new(0),
            transient: AtomicUsize::new(0),
        })
    }

    /// A lease of nothing, never refused (a one-byte wake-up: refusing it
    /// would leave a waiter hanging with its keys present).
    pub(super) fn nothing(self: &Arc<Self>) -> Lease {
        Lease {
            budget: self.clone(),
            n: 0,
        }
    }

    /// Reserves `n` transient bytes for `what`, or refuses.
    pub(super) fn reserve(self: &Arc<Self>, n: usize, what: &str) -> Result<Lease, Closed> {
        let mut cur = self.transient.load(Ordering::Relaxed);
        loop {
            let held = self.held.load(Ordering::Relaxed);
            let total = held.saturating_add(cur).saturating_add(n);
            if total > self.max {
                return Err(Closed::Refused(format!(
                    "{what} of {n} bytes would take the store past its limit of {} bytes ({held} \
                     held, {cur} in requests being read and replies not yet sent); \
                     CONSORT_STORE_MAX_BYTES (or ServerOptions::max_bytes, or consort store \
                     --max-bytes) sets the limit",
                    self.max
                )));
            }
            match self.transient.compare_exchange_weak(
                cur,
                cur + n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Ok(Lease {
                        budget: self.clone(),
                        n,
                    });
                }
                Err(now) => cur = now,
            }
        }
    }
}

impl Budget {
    /// Bytes held plus bytes in flight.
    pub(super) fn used(&self) -> usize {
        self.held.load(Ordering::Relaxed) + self.transient.load(Ordering::Relaxed)
    }
}

/// Transient bytes reserved from the [`Budget`]; given back on drop.
#[derive(Debug)]
pub(super) struct Lease {
    budget: Arc<Budget>,
    n: usize,
}

impl Lease {
    /// Reserves `n` more bytes on this lease.
    pub(super) fn grow(&mut self, n: usize, what: &str) -> Result<(), Closed> {
        let mut more = self.budget.reserve(n, what)?;
        self.n += std::mem::take(&mut more.n);
        Ok(())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.transient.fetch_sub(self.n, Ordering::Relaxed);
    }
}

/// A client's queue of replies: each holds its bytes' lease until written.
#[derive(Clone, Debug)]
pub(super) struct Out {
    pub(super) tx: mpsc::UnboundedSender<(Vec<u8>, Lease)>,
    pub(super) budget: Arc<Budget>,
}

impl Out {
    /// Queues `reply`, or refuses it past the limit (the client is then
    /// closed).
    pub(super) fn send(&self, reply: Vec<u8>) -> Result<(), Closed> {
        let lease = self.budget.reserve(reply.len() + OVERHEAD, "a reply")?;
        self.send_reserved(reply, lease);
        Ok(())
    }

    /// Queues a reply whose bytes were reserved before it was built.
    pub(super) fn send_reserved(&self, reply: Vec<u8>, lease: Lease) {
        let _ = self.tx.send((reply, lease));
    }
}

/// Keys, values, queues and waiters.
#[derive(Debug)]
pub(super) struct State {
    pub(super) budget: Arc<Budget>,
    pub(super) map: HashMap<Vec<u8>, Vec<u8>>,
    pub(super) queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// key -> clients waiting for it.
    pub(super) waiting: HashMap<Vec<u8>, Vec<ClientId>>,
    /// client -> (keys still missing, its reply queue, the bytes its
    /// registration holds).
    pub(super) awaited: HashMap<ClientId, (usize, Out, usize)>,
}

impl State {
    pub(super) fn new(budget: Arc<Budget>) -> Self {
        State {
            budget,
            map: HashMap::new(),
            queues: HashMap::new(),
            waiting: HashMap::new(),
            awaited: HashMap::new(),
        }
    }

    /// Accounts for a write that adds `add` held bytes and frees `free`, or
    /// refuses it (the client is then dropped: the protocol has no error
    /// reply) with a reason naming the limit.
    pub(super) fn charge(&mut self, add: usize, free: usize) -> Result<(), Closed> {
        let b = &self.budget;
        let held = b.held.load(Ordering::Relaxed);
        let new = held.saturating_sub(free).saturating_add(add);
        let transient = b.transient.load(Ordering::Relaxed);
        if add > free && new.saturating_add(transient) > b.max {
            return Err(Closed::Refused(format!(
                "this write of {add} bytes would take the store from {held} to {new} bytes held, \
                 with {transient} more in requests being read and replies not yet sent, past its \
                 limit of {} (CONSORT_STORE_MAX_BYTES on the process that hosts the store, or \
                 ServerOptions::max_bytes); the store holds rendezvous data, not tensors",
                b.max
            )));
        }
        b.held.store(new, Ordering::Relaxed);
        Ok(())
    }

    /// Gives back `n` held bytes.
    pub(super) fn free(&mut self, n: usize) {
        let held = self.budget.held.load(Ordering::Relaxed);
        self.budget
            .held
            .store(held.saturating_sub(n), Ordering::Relaxed);
    }

    /// The bytes `key` holds in the map (key and value), 0 if absent.
    pub(super) fn held(&self, key: &[u8]) -> usize {
        self.map
            .get(key)
            .map_or(0, |v| key.len() + v.len() + OVERHEAD)
    }

    /// Stores `key = value` within the limit, and wakes its waiters.
    pub(super) fn put(&mut self, key: Vec<u8>, value: Vec<u8>) -> Result<(), Closed> {
        self.charge(key.len() + value.len() + OVERHEAD, self.held(&key))?;
        self.map.insert(key.clone(), value);
        self.wake(&key);
        Ok(())
    }

    /// Stores every pair, all or nothing: the net change (a key repeated in
    /// the request counts once, at its last value) is charged first.
    pub(super) fn put_all(&mut self, pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Result<(), Closed> {
        let mut last: HashMap<&[u8], usize> = HashMap::new();
        for (k, v) in &pairs {
            last.insert(k, k.len() + v.len() + OVERHEAD);
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
    pub(super) fn push(&mut self, key: Vec<u8>, value: Vec<u8>) -> Result<(), Closed> {
        let fresh = if self.queues.contains_key(&key) {
            0
        } else {
            key.len() + OVERHEAD
        };
        self.charge(fresh + value.len() + OVERHEAD, 0)?;
        self.queues.entry(key.clone()).or_default().push_back(value);
        self.wake_one(&key);
        Ok(())
    }

    /// QUEUE_POP's reply (torch's: the length before, then the value if
    /// there was one); an emptied queue is forgotten, key and all.
    pub(super) fn pop(&mut self, key: &[u8]) -> Vec<u8> {
        let Some(q) = self.queues.get_mut(key) else {
            return 0i64.to_le_bytes().to_vec();
        };
        let mut out = (q.len() as i64).to_le_bytes().to_vec();
        let mut freed = 0;
        if let Some(v) = q.pop_front() {
            wire::put_bytes(&mut out, &v);
            freed += v.len() + OVERHEAD;
        }
        if q.is_empty() {
            self.queues.remove(key);
            freed += key.len() + OVERHEAD;
        }
        self.free(freed);
        out
    }

    pub(super) fn has(&self, k: &[u8]) -> bool {
        self.map.contains_key(k) || self.queues.get(k).is_some_and(|q| !q.is_empty())
    }

    /// A key came into existence: wake every client whose last missing key
    /// it was.
    pub(super) fn wake(&mut self, key: &[u8]) {
        let Some(clients) = self.waiting.remove(key) else {
            return;
        };
        for c in clients {
            if let Some((left, tx, _)) = self.awaited.get_mut(&c) {
                *left -= 1;
                if *left == 0 {
                    stop_waiting(tx);
                    self.unwait(c);
                }
            }
        }
    }

    /// A queue got an element: wake one waiter (queue semantics).
    pub(super) fn wake_one(&mut self, key: &[u8]) {
        let Some(clients) = self.waiting.get_mut(key) else {
            return;
        };
        let mut woken = None;
        while let Some(c) = clients.first().copied() {
            clients.remove(0);
            if let Some((left, tx, _)) = self.awaited.get_mut(&c) {
                *left -= 1;
                if *left == 0 {
                    stop_waiting(tx);
                    woken = Some(c);
                }
                break;
            }
        }
        if clients.is_empty() {
            self.waiting.remove(key);
        }
        if let Some(c) = woken {
            self.unwait(c);
        }
    }

    /// A client's wait is over: its registration's bytes come back.
    fn unwait(&mut self, client: ClientId) {
        if let Some((_, _, bytes)) = self.awaited.remove(&client) {
            self.free(bytes);
        }
    }

    pub(super) fn forget(&mut self, client: ClientId) {
        if let Some((_, _, bytes)) = self.awaited.remove(&client) {
            self.free(bytes);
            self.waiting.retain(|_, v| {
                v.retain(|c| *c != client);
                !v.is_empty()
            });
        }
    }
}

/// Tells a waiting client its keys are there: never refused (its
/// registration, charged while it waited, has just been freed).
fn stop_waiting(tx: &Out) {
    tx.send_reserved(vec![wire::STOP_WAITING], tx.budget.nothing());
}
