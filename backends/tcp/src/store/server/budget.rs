//! The server's one memory budget, what each connection owes against it,
//! and who is shed when it runs short.
//!
//! Everything the server holds or owes is charged before it is allocated,
//! at what the allocator really takes ([`block`]) plus a stated share of
//! the containers it sits in ([`ENTRY`]):
//! - **held**: keys, values and queue elements. Values are shared
//!   ([`Value`]): a reply that sends one holds it without a copy, and the
//!   value's charge lives as long as the value does, wherever it is.
//! - **transient**, per connection ([`Conn`]): the request being read, the
//!   replies not yet written, the keys it waits for. No connection may owe
//!   more than [`Budget::quota`], and none but small control replies may
//!   take the last [`Budget::reserve`] bytes of the limit, so a PING, a
//!   CHECK or a GET of a stored key is always answered.
//!
//! When a request cannot be paid for, the connection that owes the most
//! (more than the asker would) is closed to make room ([`Budget::reserve`]
//! with shedding): a crowd of half-written requests cannot lock out a
//! client asking for little.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::Notify;

use super::Closed;

pub(super) type ClientId = u64;

/// What the allocator may take for a block of `n` bytes: glibc's chunk
/// (`n` plus its 8-byte header, rounded up to 16, at least 32); nothing for
/// an empty one.
pub(super) const fn block(n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let c = n.saturating_add(8 + 15) & !15;
    if c < 32 { 32 } else { c }
}

/// One entry's share of the ordered map it sits in. A B-tree node holds up
/// to 11 entries and every node but the root at least 5, so an entry's
/// share of its leaf and of the internal nodes above is under a fifth of a
/// node: at most 136 bytes for the server's maps (checked against a
/// counting allocator in the tests). B-trees grow a node at a time and
/// shrink as they empty, so there is no table that doubles or stays large
/// after its keys are gone.
pub(super) const ENTRY: usize = 256;

/// What one queued reply costs beyond its bytes (its channel slot).
pub(super) const REPLY: usize = 128;

/// Where a connection stands, for choosing whom to close when the server
/// is full of connections: one that has not proved itself goes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub(super) enum Phase {
    /// Connected; has not passed the secret's handshake or sent VALIDATE.
    Pending = 0,
    /// Validated, and has sent no request yet.
    Validated = 1,
    /// Has sent a request: a client at work (it may idle for a whole job).
    Active = 2,
}

/// One connection: what it owes, and how to close it from outside.
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) id: ClientId,
    pub(super) peer: SocketAddr,
    pub(super) opened: Instant,
    phase: AtomicU8,
    used: AtomicUsize,
    killed: AtomicBool,
    why: Mutex<Option<String>>,
    kill: Notify,
}

impl Conn {
    pub(super) fn new(id: ClientId, peer: SocketAddr) -> Arc<Self> {
        Arc::new(Conn {
            id,
            peer,
            opened: Instant::now(),
            phase: AtomicU8::new(Phase::Pending as u8),
            used: AtomicUsize::new(0),
            killed: AtomicBool::new(false),
            why: Mutex::new(None),
            kill: Notify::new(),
        })
    }

    pub(super) fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Relaxed) {
            0 => Phase::Pending,
            1 => Phase::Validated,
            _ => Phase::Active,
        }
    }

    pub(super) fn advance(&self, p: Phase) {
        self.phase.fetch_max(p as u8, Ordering::Relaxed);
    }

    /// Bytes this connection owes.
    pub(super) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Closes this connection from outside, saying why.
    pub(super) fn close(&self, why: String) {
        if !self.killed.swap(true, Ordering::AcqRel) {
            *consort_comm::lock(&self.why) = Some(why);
            self.kill.notify_one();
        }
    }

    /// Whether [`Conn::close`] was called.
    pub(super) fn is_closed(&self) -> bool {
        self.killed.load(Ordering::Acquire)
    }

    /// Resolves once [`Conn::close`] was called, with its reason.
    pub(super) async fn closed(&self) -> String {
        if !self.killed.load(Ordering::Acquire) {
            self.kill.notified().await;
        }
        consort_comm::lock(&self.why)
            .clone()
            .unwrap_or_else(|| "closed by the server".into())
    }
}

/// Who may take the last bytes of the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tier {
    /// Small replies to control requests (PING, CHECK, WAIT's wake-up, a
    /// GET's header): may use the reserve.
    Control,
    /// Everything else.
    Normal,
}

/// The server's memory limit and what counts against it.
#[derive(Debug)]
pub(super) struct Budget {
    max: usize,
    reserve: usize,
    quota: usize,
    /// Keys, values and queue elements.
    held: AtomicUsize,
    /// Requests being read, replies not yet written, registered waits.
    transient: AtomicUsize,
    /// The connections, to choose whom to shed.
    conns: Mutex<BTreeMap<ClientId, Arc<Conn>>>,
    /// Bytes given back since the allocator was last asked to return
    /// free pages ([`Budget::trim`]).
    freed: AtomicUsize,
}

/// Why a charge was refused.
#[derive(Debug)]
pub(super) enum Short {
    /// This connection would owe more than its quota: its own doing.
    Quota { owed: usize },
    /// The store as a whole is full.
    Full { held: usize, transient: usize },
}

impl Budget {
    pub(super) fn new(max: usize) -> Arc<Self> {
        Arc::new(Budget {
            max,
            reserve: max / 16,
            quota: (max / 8).max(MIN_QUOTA).min(max - max / 16),
            held: AtomicUsize::new(0),
            transient: AtomicUsize::new(0),
            conns: Mutex::new(BTreeMap::new()),
            freed: AtomicUsize::new(0),
        })
    }

    /// Bytes held plus bytes owed by connections.
    pub(super) fn used(&self) -> usize {
        self.held.load(Ordering::Relaxed) + self.transient.load(Ordering::Relaxed)
    }

    pub(super) fn register(&self, c: &Arc<Conn>) {
        consort_comm::lock(&self.conns).insert(c.id, c.clone());
    }

    pub(super) fn unregister(&self, id: ClientId) {
        consort_comm::lock(&self.conns).remove(&id);
    }

    /// The connections, for the accept loop's choice of whom to close.
    pub(super) fn conns(&self) -> Vec<Arc<Conn>> {
        consort_comm::lock(&self.conns).values().cloned().collect()
    }

    fn ceiling(&self, tier: Tier) -> usize {
        match tier {
            Tier::Control => self.max,
            Tier::Normal => self.max - self.reserve,
        }
    }

    /// Takes `n` bytes for `conn` (transient) or for the store (held, with
    /// `conn` None), or says why not.
    fn take(&self, conn: Option<&Conn>, n: usize, tier: Tier) -> Result<(), Short> {
        if let Some(c) = conn {
            let owed = c.used().saturating_add(n);
            if owed > self.quota {
                return Err(Short::Quota { owed });
            }
        }
        let (mine, other) = match conn {
            Some(_) => (&self.transient, &self.held),
            None => (&self.held, &self.transient),
        };
        let ceiling = self.ceiling(tier);
        let mut cur = mine.load(Ordering::Relaxed);
        loop {
            let others = other.load(Ordering::Relaxed);
            if cur.saturating_add(others).saturating_add(n) > ceiling {
                let (held, transient) = match conn {
                    Some(_) => (others, cur),
                    None => (cur, others),
                };
                return Err(Short::Full { held, transient });
            }
            match mine.compare_exchange_weak(cur, cur + n, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        if let Some(c) = conn {
            c.used.fetch_add(n, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Asks the allocator to return free pages to the system once more
    /// than 16 MiB were given back since the last time: what the server
    /// frees leaves its resident set, instead of staying as fragments that
    /// later allocations of other sizes cannot use (glibc only).
    pub(super) fn trim(&self) {
        if self.freed.load(Ordering::Relaxed) < TRIM_AFTER {
            return;
        }
        self.freed.store(0, Ordering::Relaxed);
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only walks the allocator's own free lists.
        unsafe {
            libc::malloc_trim(0);
        }
    }

    fn give(&self, conn: Option<&Conn>, n: usize) {
        self.freed.fetch_add(n, Ordering::Relaxed);
        match conn {
            Some(c) => {
                c.used.fetch_sub(n, Ordering::Relaxed);
                self.transient.fetch_sub(n, Ordering::Relaxed);
            }
            None => {
                self.held.fetch_sub(n, Ordering::Relaxed);
            }
        }
    }

    fn refusal(&self, short: Short, n: usize, what: &str) -> Closed {
        Closed::Refused(match short {
            Short::Quota { owed } => format!(
                "{what} of {n} bytes would have this client owe the store {owed} bytes (its \
                 requests being read, replies not yet read and keys waited for), past the share \
                 one client may use: {} bytes (an eighth of the store's limit, at least 16 MiB; \
                 CONSORT_STORE_MAX_BYTES, or consort store --max-bytes, sets the limit)",
                self.quota
            ),
            Short::Full { held, transient } => format!(
                "{what} of {n} bytes would take the store past its limit of {} bytes ({held} held \
                 in keys and values, {transient} owed by clients); CONSORT_STORE_MAX_BYTES (or \
                 ServerOptions::max_bytes, or consort store --max-bytes) sets the limit",
                self.max
            ),
        })
    }

    /// A lease of nothing (for the store's own structure when `conn` is
    /// None), never refused.
    pub(super) fn zero(self: &Arc<Self>, conn: Option<&Arc<Conn>>) -> Lease {
        Lease {
            budget: self.clone(),
            conn: conn.cloned(),
            n: 0,
        }
    }

    /// Charges `n` held bytes (a key, a value, a queue element), or
    /// refuses with a reason naming the limit.
    pub(super) fn hold(self: &Arc<Self>, n: usize, what: &str) -> Result<Lease, Closed> {
        self.take(None, n, Tier::Normal)
            .map_err(|s| self.refusal(s, n, what))?;
        Ok(Lease {
            budget: self.clone(),
            conn: None,
            n,
        })
    }

    /// Charges `n` bytes to `conn` now, without making room.
    pub(super) fn owe(
        self: &Arc<Self>,
        conn: &Arc<Conn>,
        n: usize,
        tier: Tier,
        what: &str,
    ) -> Result<Lease, Closed> {
        self.take(Some(conn), n, tier)
            .map_err(|s| self.refusal(s, n, what))?;
        Ok(Lease {
            budget: self.clone(),
            conn: Some(conn.clone()),
            n,
        })
    }

    /// Charges `n` bytes to `conn`; when the store is full, closes the
    /// connections that owe more than `conn` would, the largest first, and
    /// waits briefly for their bytes to come back.
    pub(super) async fn owe_or_shed(
        self: &Arc<Self>,
        conn: &Arc<Conn>,
        n: usize,
        what: &str,
    ) -> Result<Lease, Closed> {
        let give_up = Instant::now() + SHED_WAIT;
        // A client owing little (a key being read, a small request) may use
        // the reserve: a store full of data still reads a GET.
        let tier = if conn.used().saturating_add(n) <= SMALL {
            Tier::Control
        } else {
            Tier::Normal
        };
        loop {
            match self.take(Some(conn), n, tier) {
                Ok(()) => {
                    return Ok(Lease {
                        budget: self.clone(),
                        conn: Some(conn.clone()),
                        n,
                    });
                }
                Err(s @ Short::Quota { .. }) => return Err(self.refusal(s, n, what)),
                Err(s) => {
                    if Instant::now() >= give_up || !self.shed(conn, n) {
                        return Err(self.refusal(s, n, what));
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }

    /// Waits briefly until `n` more held bytes fit, closing the
    /// connections that owe more than `asker` would, the largest first:
    /// a crowd of half-written requests cannot keep a small write out. It
    /// does not charge: the store does, under its lock, and may still
    /// refuse.
    pub(super) async fn room_to_hold(&self, asker: &Conn, n: usize) {
        let give_up = Instant::now() + SHED_WAIT;
        let ceiling = self.ceiling(Tier::Normal);
        loop {
            if self.used().saturating_add(n) <= ceiling
                || Instant::now() >= give_up
                || self.transient.load(Ordering::Relaxed) == 0
                || !self.shed(asker, n)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Closes the connection owing the most, if it owes more than `asker`
    /// would after taking `n`; false if there is none to close.
    fn shed(&self, asker: &Conn, n: usize) -> bool {
        let would = asker.used().saturating_add(n);
        let conns = consort_comm::lock(&self.conns);
        let victim = conns
            .values()
            .filter(|c| c.id != asker.id && !c.killed.load(Ordering::Relaxed))
            .max_by_key(|c| c.used());
        match victim {
            Some(v) if v.used() > would => {
                let owed = v.used();
                tracing::warn!(
                    peer = %v.peer,
                    "TCPStore closed the client that owed it the most ({owed} bytes in requests \
                     being read, replies not yet read and keys waited for) to serve {} (asking for \
                     {n} bytes): the store is at its limit",
                    asker.peer
                );
                v.close(format!(
                    "the store was full and this client owed it the most ({owed} bytes); another \
                     client needed room"
                ));
                true
            }
            // Those already closed are giving their bytes back.
            _ => conns
                .values()
                .any(|c| c.id != asker.id && c.killed.load(Ordering::Relaxed) && c.used() > 0),
        }
    }
}

/// The least one connection may owe, whatever the limit: enough to read
/// one value of torch's largest size (8 MiB) while its buffer grows.
const MIN_QUOTA: usize = 16 << 20;

/// Bytes given back before [`Budget::trim`] asks the allocator to return
/// free pages.
const TRIM_AFTER: usize = 16 << 20;

/// What a client may owe and still dip into the reserve: a small request.
const SMALL: usize = 16 << 10;

/// How long a request waits for shed connections to give their bytes back.
const SHED_WAIT: Duration = Duration::from_millis(500);

/// Bytes charged to the [`Budget`]; given back on drop.
#[derive(Debug)]
pub(super) struct Lease {
    budget: Arc<Budget>,
    conn: Option<Arc<Conn>>,
    n: usize,
}

impl Lease {
    /// Charges `n` more bytes to this lease's owner, without making room.
    pub(super) fn grow(&mut self, n: usize, what: &str) -> Result<(), Closed> {
        let tier = Tier::Normal;
        self.budget
            .take(self.conn.as_deref(), n, tier)
            .map_err(|s| self.budget.refusal(s, n, what))?;
        self.n += n;
        Ok(())
    }

    /// [`Lease::grow`], shedding others when the store is full (transient
    /// leases only).
    pub(super) async fn grow_or_shed(&mut self, n: usize, what: &str) -> Result<(), Closed> {
        match self.conn.clone() {
            Some(c) => {
                let mut more = self.budget.owe_or_shed(&c, n, what).await?;
                self.n += std::mem::take(&mut more.n);
                Ok(())
            }
            None => self.grow(n, what),
        }
    }

    /// Gives back `n` of this lease's bytes.
    pub(super) fn shrink(&mut self, n: usize) {
        let n = n.min(self.n);
        self.budget.give(self.conn.as_deref(), n);
        self.n -= n;
    }

    /// The bytes it holds.
    pub(super) fn bytes(&self) -> usize {
        self.n
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.give(self.conn.as_deref(), self.n);
    }
}

/// A stored value, shared by the map (or a queue) and the replies that
/// send it, and charged for as long as any of them holds it.
#[derive(Debug)]
pub(super) struct Value {
    bytes: Vec<u8>,
    _lease: Lease,
}

/// What a [`Value`] costs besides its bytes: its shared allocation.
pub(super) const VALUE: usize = block(16 + std::mem::size_of::<Value>());

impl Value {
    /// Wraps `bytes` with the lease that pays for them (and for [`VALUE`]).
    pub(super) fn new(bytes: Vec<u8>, lease: Lease) -> Arc<Self> {
        Arc::new(Value {
            bytes,
            _lease: lease,
        })
    }

    /// What holding `len` bytes as a value costs.
    pub(super) const fn cost(len: usize) -> usize {
        block(len) + VALUE
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(id: ClientId) -> Arc<Conn> {
        Conn::new(id, "127.0.0.1:1".parse().unwrap())
    }

    #[test]
    fn blocks_are_glibc_chunks() {
        assert_eq!(block(0), 0);
        assert_eq!(block(1), 32);
        assert_eq!(block(24), 32);
        assert_eq!(block(25), 48);
        assert_eq!(block(4096), 4112);
    }

    #[test]
    fn control_replies_may_use_the_reserve_and_nothing_else_may() {
        let b = Budget::new(1600);
        let c = conn(1);
        b.register(&c);
        let _held = b.hold(1400, "data").unwrap();
        // 1,600 - 100 reserve: normal charges stop at 1,500.
        assert!(b.owe(&c, 150, Tier::Normal, "a request").is_err());
        let ok = b.owe(&c, 150, Tier::Control, "a ping reply");
        assert!(ok.is_ok());
        drop(ok);
        assert_eq!(b.used(), 1400);
        assert_eq!(c.used(), 0);
    }

    #[test]
    fn one_connection_owes_at_most_its_quota() {
        let b = Budget::new(1 << 30);
        let c = conn(1);
        let _a = b.owe(&c, 128 << 20, Tier::Normal, "a").unwrap();
        let e = b.owe(&c, 1, Tier::Control, "b").unwrap_err();
        assert!(e.to_string().contains("eighth"), "{e}");
    }

    #[tokio::test]
    async fn a_full_store_sheds_the_largest_debtor_for_a_small_asker() {
        // 1 MiB: 960 KiB for all but control replies.
        let b = Budget::new(1 << 20);
        let (hog, small) = (conn(1), conn(2));
        b.register(&hog);
        b.register(&small);
        let _held = b.hold(900 << 10, "data").unwrap();
        let hog_lease = b
            .owe(&hog, 40 << 10, Tier::Normal, "a stalled request")
            .unwrap();
        assert!(b.owe(&small, 30 << 10, Tier::Normal, "x").is_err());
        let freed = tokio::spawn({
            let hog = hog.clone();
            async move {
                let why = hog.closed().await;
                drop(hog_lease);
                why
            }
        });
        let got = b.owe_or_shed(&small, 30 << 10, "a request").await;
        assert!(got.is_ok());
        assert!(freed.await.unwrap().contains("owed it the most"));
    }

    #[tokio::test]
    async fn nobody_is_shed_for_a_larger_asker() {
        let b = Budget::new(1 << 20);
        let (small, big) = (conn(1), conn(2));
        b.register(&small);
        b.register(&big);
        let _held = b.hold(920 << 10, "data").unwrap();
        let _s = b.owe(&small, 20 << 10, Tier::Normal, "x").unwrap();
        assert!(
            b.owe_or_shed(&big, 30 << 10, "a big request")
                .await
                .is_err()
        );
        assert!(!small.is_closed());
    }

    #[tokio::test]
    async fn a_small_request_may_use_the_reserve() {
        let b = Budget::new(1 << 20);
        let c = conn(1);
        let _held = b.hold(960 << 10, "data").unwrap();
        assert!(b.owe_or_shed(&c, 100, "a key").await.is_ok());
        assert!(b.owe_or_shed(&c, 32 << 10, "a value").await.is_err());
    }
}
