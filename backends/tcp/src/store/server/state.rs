//! What the server holds (keys and values, queues, waiting clients) and
//! the replies it queues, each paid for from the [`Budget`] before it is
//! allocated.
//!
//! Every container is an ordered map: a B-tree grows and shrinks a node at
//! a time, so what an entry costs has a bound ([`ENTRY`]) with no table
//! that doubles, or that stays large once its keys are deleted. A client's
//! waits are found from the client, so cancelling them costs in proportion
//! to its own keys, not everyone's.

use std::{collections::BTreeMap, sync::Arc};

use tokio::sync::mpsc;

use super::Closed;
use super::budget::{Budget, ClientId, Conn, ENTRY, Lease, REPLY, Tier, Value, block};
use crate::store::wire;

/// A reply: a head, then values each written as a length and bytes. Values
/// are shared with the store, not copied; the lease pays for the rest.
#[derive(Debug)]
pub(super) struct Reply {
    pub(super) head: Vec<u8>,
    pub(super) values: Vec<Option<Arc<Value>>>,
    pub(super) _lease: Lease,
}

impl Reply {
    /// The reply's bytes on the wire, in one buffer (for tests).
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut b = self.head.clone();
        for v in &self.values {
            wire::put_bytes(&mut b, v.as_deref().map_or(&[][..], Value::bytes));
        }
        b
    }

    /// What a reply with a `head` of this length and `values` slots costs.
    pub(super) const fn cost(head: usize, values: usize) -> usize {
        REPLY + block(head) + block(values * std::mem::size_of::<Option<Arc<Value>>>())
    }
}

/// A client's queue of replies, and who the client is.
#[derive(Clone, Debug)]
pub(super) struct Out {
    pub(super) tx: mpsc::UnboundedSender<Reply>,
    pub(super) budget: Arc<Budget>,
    pub(super) conn: Arc<Conn>,
}

impl Out {
    /// Queues a small reply of fixed bytes (PING, CHECK, ADD, counts): it
    /// may use the reserve, so it is refused only to a client that owes
    /// its whole share.
    pub(super) fn control(&self, head: Vec<u8>) -> Result<(), Closed> {
        let lease = self.small(head.len())?;
        self.send(head, Vec::new(), lease);
        Ok(())
    }

    /// Pays for a small reply of `len` bytes before the request changes
    /// anything: a refused reply then leaves the store as it was.
    pub(super) fn small(&self, len: usize) -> Result<Lease, Closed> {
        self.budget
            .owe(&self.conn, Reply::cost(len, 0), Tier::Control, "a reply")
    }

    /// Queues a reply whose bytes were paid for before it was built.
    pub(super) fn send(&self, head: Vec<u8>, values: Vec<Option<Arc<Value>>>, lease: Lease) {
        let _ = self.tx.send(Reply {
            head,
            values,
            _lease: lease,
        });
    }
}

/// One queue: its elements in push order.
#[derive(Debug, Default)]
struct Queue {
    items: BTreeMap<u64, Arc<Value>>,
    next: u64,
}

/// A client's registered wait.
#[derive(Debug)]
struct Waiting {
    seq: u64,
    left: usize,
    keys: Vec<Vec<u8>>,
    out: Out,
    _lease: Lease,
}

/// What a wait on `keys` costs its client: the registration and, per key,
/// the key twice (in the registration and in the index of waiters) and an
/// entry in that index.
pub(super) fn wait_cost<K: AsRef<[u8]>>(keys: &[K]) -> usize {
    let per_key: usize = keys
        .iter()
        .map(|k| 2 * block(k.as_ref().len()) + ENTRY + 3 * std::mem::size_of::<Vec<u8>>())
        .sum();
    ENTRY + block(std::mem::size_of::<Waiting>()) + per_key
}

/// Keys, values, queues and waiters.
#[derive(Debug)]
pub(super) struct State {
    pub(super) budget: Arc<Budget>,
    map: BTreeMap<Vec<u8>, Arc<Value>>,
    queues: BTreeMap<Vec<u8>, Queue>,
    /// (key, registration) -> the client waiting for it, in order.
    waiting: BTreeMap<(Vec<u8>, u64), ClientId>,
    awaited: BTreeMap<ClientId, Box<Waiting>>,
    next_seq: u64,
    /// Keys and map entries (values carry their own leases).
    structure: Lease,
}

/// What a key and its entry in the map cost.
const fn entry_cost(key: &[u8]) -> usize {
    ENTRY + block(key.len())
}

impl State {
    pub(super) fn new(budget: Arc<Budget>) -> Self {
        let structure = budget.zero(None);
        State {
            budget,
            map: BTreeMap::new(),
            queues: BTreeMap::new(),
            waiting: BTreeMap::new(),
            awaited: BTreeMap::new(),
            next_seq: 0,
            structure,
        }
    }

    /// Wraps `bytes` as a held value, or refuses past the limit.
    pub(super) fn value(&self, bytes: Vec<u8>, what: &str) -> Result<Arc<Value>, Closed> {
        let lease = self.budget.hold(Value::cost(bytes.len()), what)?;
        Ok(Value::new(bytes, lease))
    }

    pub(super) fn get(&self, key: &[u8]) -> Option<&Arc<Value>> {
        self.map.get(key)
    }

    pub(super) fn num_keys(&self) -> usize {
        self.map.len()
    }

    /// The map's keys in order (LIST_KEYS), with the bytes they take.
    pub(super) fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.map.keys().map(Vec::as_slice)
    }

    /// Stores `key = value` and wakes its waiters. The value was paid for;
    /// a new key is paid for here, or refused.
    pub(super) fn put(&mut self, key: Vec<u8>, value: Arc<Value>) -> Result<(), Closed> {
        self.put_quiet(key.clone(), value)?;
        self.wake(&key);
        Ok(())
    }

    /// [`State::put`] without waking anyone (a barrier short of its count).
    pub(super) fn put_quiet(&mut self, key: Vec<u8>, value: Arc<Value>) -> Result<(), Closed> {
        if !self.map.contains_key(&key) {
            self.structure.grow(entry_cost(&key), "a new key")?;
        }
        self.map.insert(key, value);
        Ok(())
    }

    /// Stores every pair, all or nothing: new keys are paid for first.
    pub(super) fn put_all(&mut self, pairs: Vec<(Vec<u8>, Arc<Value>)>) -> Result<(), Closed> {
        let mut fresh: BTreeMap<&[u8], usize> = BTreeMap::new();
        for (k, _) in &pairs {
            if !self.map.contains_key(k) {
                fresh.insert(k, entry_cost(k));
            }
        }
        let add: usize = fresh.values().sum();
        drop(fresh);
        self.structure.grow(add, "a multi_set's new keys")?;
        for (k, v) in pairs {
            self.map.insert(k.clone(), v);
            self.wake(&k);
        }
        Ok(())
    }

    /// Removes `key`; whether it was there.
    pub(super) fn delete(&mut self, key: &[u8]) -> bool {
        let gone = self.map.remove(key).is_some();
        if gone {
            self.structure.shrink(entry_cost(key));
        }
        gone
    }

    /// Appends to the queue under `key` and wakes one waiter.
    pub(super) fn push(&mut self, key: Vec<u8>, value: Arc<Value>) -> Result<(), Closed> {
        let fresh = if self.queues.contains_key(&key) {
            0
        } else {
            ENTRY + entry_cost(&key)
        };
        self.structure.grow(fresh + ENTRY, "a queue element")?;
        let q = self.queues.entry(key.clone()).or_default();
        q.items.insert(q.next, value);
        q.next += 1;
        self.wake_one(&key);
        Ok(())
    }

    /// Takes the head of the queue under `key`, with the length before
    /// (torch's QUEUE_POP). The value moves to the reply: nothing is
    /// copied, so nothing can be lost to a refused reply.
    pub(super) fn pop(&mut self, key: &[u8]) -> (i64, Option<Arc<Value>>) {
        let Some(q) = self.queues.get_mut(key) else {
            return (0, None);
        };
        let before = q.items.len() as i64;
        let head = q.items.pop_first().map(|(_, v)| v);
        let mut freed = if head.is_some() { ENTRY } else { 0 };
        if q.items.is_empty() {
            self.queues.remove(key);
            freed += ENTRY + entry_cost(key);
        }
        self.structure.shrink(freed);
        (before, head)
    }

    pub(super) fn queue_len(&self, key: &[u8]) -> usize {
        self.queues.get(key).map_or(0, |q| q.items.len())
    }

    /// Whether `k` exists (a key, or a queue with elements).
    pub(super) fn has(&self, k: &[u8]) -> bool {
        self.map.contains_key(k) || self.queues.get(k).is_some_and(|q| !q.items.is_empty())
    }

    /// Registers `out`'s client as waiting for `missing` (which must not
    /// be empty), replacing any wait it had; `lease` pays for it.
    pub(super) fn wait(&mut self, out: &Out, missing: Vec<Vec<u8>>, lease: Lease) {
        let id = out.conn.id;
        self.forget(id);
        let seq = self.next_seq;
        self.next_seq += 1;
        for k in &missing {
            self.waiting.insert((k.clone(), seq), id);
        }
        let w = Waiting {
            seq,
            left: missing.len(),
            keys: missing,
            out: out.clone(),
            _lease: lease,
        };
        self.awaited.insert(id, Box::new(w));
    }

    /// The waiters registered on `key`, in order.
    fn waiters(&self, key: &[u8]) -> Vec<(u64, ClientId)> {
        let lo = (key.to_vec(), 0);
        let hi = (key.to_vec(), u64::MAX);
        self.waiting
            .range(lo..=hi)
            .map(|((_, s), c)| (*s, *c))
            .collect()
    }

    /// One of `client`'s keys came: wakes it if it was its last.
    fn arrived(&mut self, key: &[u8], seq: u64, client: ClientId) -> bool {
        self.waiting.remove(&(key.to_vec(), seq));
        let Some(w) = self.awaited.get_mut(&client) else {
            return false;
        };
        if w.seq != seq {
            return false;
        }
        w.left -= 1;
        if w.left > 0 {
            return false;
        }
        if let Some(w) = self.awaited.remove(&client) {
            self.unregister(&w);
            stop_waiting(*w);
        }
        true
    }

    /// A key came into existence: wake every client whose last missing key
    /// it was.
    pub(super) fn wake(&mut self, key: &[u8]) {
        for (seq, c) in self.waiters(key) {
            self.arrived(key, seq, c);
        }
    }

    /// A queue got an element: the first waiter in line for it counts it.
    fn wake_one(&mut self, key: &[u8]) {
        if let Some((seq, c)) = self.waiters(key).first().copied() {
            self.arrived(key, seq, c);
        }
    }

    /// Removes a finished registration's other keys from the index.
    fn unregister(&mut self, w: &Waiting) {
        for k in &w.keys {
            self.waiting.remove(&(k.clone(), w.seq));
        }
    }

    /// `client` left or cancelled: its wait goes, in time proportional to
    /// its own keys.
    pub(super) fn forget(&mut self, client: ClientId) {
        if let Some(w) = self.awaited.remove(&client) {
            self.unregister(&w);
        }
    }

    /// What the store should be charged for what it holds now, counted
    /// afresh (values as if held by the store alone): for tests.
    pub(super) fn audit(&self) -> usize {
        let map: usize = self
            .map
            .iter()
            .map(|(k, v)| entry_cost(k) + Value::cost(v.bytes().len()))
            .sum();
        let queues: usize = self
            .queues
            .iter()
            .map(|(k, q)| {
                ENTRY
                    + entry_cost(k)
                    + q.items
                        .values()
                        .map(|v| ENTRY + Value::cost(v.bytes().len()))
                        .sum::<usize>()
            })
            .sum();
        map + queues
    }
}

/// Tells a waiting client its keys are there: never refused, as the
/// reply is paid for from its registration's lease (always larger).
fn stop_waiting(w: Waiting) {
    let mut lease = w._lease;
    lease.shrink(lease.bytes().saturating_sub(Reply::cost(1, 0)));
    w.out.send(vec![wire::STOP_WAITING], Vec::new(), lease);
}
