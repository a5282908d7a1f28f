//! The TCPStore server's memory bound, proved under a counting allocator:
//! whatever clients send (random request mixes, and the attacks of issue
//! 49), the bytes the server's threads hold never pass
//!
//! `max_bytes + connections x PER_CONNECTION + SLACK`.
//!
//! The allocator counts what glibc would take for each block (the size
//! plus its header, rounded up to 16, at least 32) for blocks allocated on
//! the server's runtime threads, and a `realloc` as a new block alive with
//! the old one, as a copying allocator does. Clients run on other threads
//! and are not counted. The tests in this file run one at a time.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use consort_tcp::{ServerOptions, TcpStoreServer, store::VALIDATION_MAGIC};
use proptest::prelude::*;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// What one connection may cost beyond the budget: its two tasks, its
/// read and write buffers, its reply channel and its socket's registration.
const PER_CONNECTION: usize = 16 << 10;
/// What the server may hold beyond the budget and its connections: one
/// request's working copies under the global lock, the runtime's own
/// growth.
const SLACK: usize = 4 << 20;

thread_local! {
    static SERVER: Cell<bool> = const { Cell::new(false) };
}

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Counts glibc-sized blocks allocated on server threads. Each block
/// carries a header saying whether it was counted, so a block freed on
/// another thread is uncounted correctly.
struct Counting;

const HEADER: usize = 16;

fn chunk(n: usize) -> usize {
    ((n + 8 + 15) & !15).max(32)
}

// SAFETY: every block comes from `System` with a layout at least as large
// and as aligned as asked, and goes back to it with the same layout.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let align = l.align().max(HEADER);
        let Ok(outer) = Layout::from_size_align(l.size() + align, align) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `outer` has a non-zero size.
        let p = unsafe { System.alloc(outer) };
        if p.is_null() {
            return p;
        }
        let counted = SERVER.with(|s| s.get());
        if counted {
            let now = NOW.fetch_add(chunk(l.size()), Ordering::Relaxed) + chunk(l.size());
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        // SAFETY: the block is `align` bytes longer than asked; the tag
        // sits just before the pointer handed out.
        unsafe {
            let user = p.add(align);
            *user.sub(1) = u8::from(counted);
            user
        }
    }

    unsafe fn dealloc(&self, user: *mut u8, l: Layout) {
        let align = l.align().max(HEADER);
        // SAFETY: as in `alloc`.
        unsafe {
            if *user.sub(1) == 1 {
                NOW.fetch_sub(chunk(l.size()), Ordering::Relaxed);
            }
            let outer = Layout::from_size_align_unchecked(l.size() + align, align);
            System.dealloc(user.sub(align), outer);
        }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// One test at a time: the counters are global.
static ONE: Mutex<()> = Mutex::new(());

/// A server on its own counted runtime.
struct Counted {
    rt: tokio::runtime::Runtime,
    server: Option<TcpStoreServer>,
    addr: String,
    base: usize,
}

impl Counted {
    fn start(max_bytes: usize) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .on_thread_start(|| SERVER.with(|s| s.set(true)))
            .build()
            .unwrap();
        let opts = ServerOptions {
            max_bytes,
            request_timeout: Duration::from_secs(5),
            validate_timeout: Duration::from_secs(5),
            ..Default::default()
        };
        let server = rt
            .block_on(async { TcpStoreServer::bind_opts("127.0.0.1:0", opts).await })
            .unwrap();
        let addr = server.local_addr().to_string();
        std::thread::sleep(Duration::from_millis(20));
        let base = NOW.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        Counted {
            rt,
            server: Some(server),
            addr,
            base,
        }
    }

    /// The most the server's threads held above where they started.
    fn peak(&self) -> usize {
        PEAK.load(Ordering::Relaxed).saturating_sub(self.base)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            self.rt.block_on(s.shutdown());
        }
    }
}

fn bound(max_bytes: usize, conns: usize) -> usize {
    max_bytes + conns * PER_CONNECTION + SLACK
}

const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const DELETE_KEY: u8 = 8;
const APPEND: u8 = 9;
const MULTI_GET: u8 = 10;
const MULTI_SET: u8 = 11;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
const QUEUE_PUSH: u8 = 14;
const QUEUE_POP: u8 = 15;
const LIST_KEYS: u8 = 17;

fn put(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

async fn raw(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut hello = vec![0u8];
    hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
    s.write_all(&hello).await.unwrap();
    s
}

/// Sends `bytes` as far as the server takes them within `within`.
async fn send(s: &mut TcpStream, bytes: &[u8], within: Duration) {
    let _ = tokio::time::timeout(within, s.write_all(bytes)).await;
}

/// Reads and discards whatever comes within `within`.
async fn drain(s: &mut TcpStream, within: Duration) {
    let mut buf = vec![0u8; 1 << 16];
    let end = tokio::time::Instant::now() + within;
    while let Ok(Ok(n)) = tokio::time::timeout_at(end, s.read(&mut buf)).await {
        if n == 0 {
            break;
        }
    }
}

/// A client runtime, not counted.
fn clients() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// One request of a random mix.
#[derive(Clone, Debug)]
enum Req {
    Set(u8, usize),
    Get(u8),
    MultiGet(u8, usize),
    MultiSet(usize, usize),
    Append(u8, usize),
    CompareSet(u8, usize),
    Add(u8),
    Delete(u8),
    Wait(usize),
    Cancel,
    Push(u8, usize),
    Pop(u8),
    List,
    Check(usize),
    Ping,
    /// A request cut off after its header.
    Stall(usize),
}

fn req() -> impl Strategy<Value = Req> {
    let size = prop_oneof![
        Just(0usize),
        Just(1),
        Just(100),
        Just(4096),
        Just(70_000),
        Just(1 << 20),
        Just(8 << 20),
    ];
    let key = 0u8..24;
    prop_oneof![
        (key.clone(), size.clone()).prop_map(|(k, n)| Req::Set(k, n)),
        key.clone().prop_map(Req::Get),
        (key.clone(), 1usize..5000).prop_map(|(k, n)| Req::MultiGet(k, n)),
        (1usize..20_000, 0usize..64).prop_map(|(n, v)| Req::MultiSet(n, v)),
        (key.clone(), size.clone()).prop_map(|(k, n)| Req::Append(k, n)),
        (key.clone(), size.clone()).prop_map(|(k, n)| Req::CompareSet(k, n)),
        key.clone().prop_map(Req::Add),
        key.clone().prop_map(Req::Delete),
        (1usize..50_000).prop_map(Req::Wait),
        Just(Req::Cancel),
        (key.clone(), size.clone()).prop_map(|(k, n)| Req::Push(k, n)),
        key.clone().prop_map(Req::Pop),
        Just(Req::List),
        (1usize..50_000).prop_map(Req::Check),
        Just(Req::Ping),
        size.prop_map(Req::Stall),
    ]
}

fn encode(r: &Req, tag: usize, out: &mut Vec<u8>) {
    let key = |k: &u8| format!("/k{k}").into_bytes();
    match r {
        Req::Set(k, n) => {
            out.push(SET);
            put(out, &key(k));
            put(out, &vec![1u8; *n]);
        }
        Req::Get(k) => {
            out.push(GET);
            put(out, &key(k));
        }
        Req::MultiGet(k, n) => {
            out.push(MULTI_GET);
            out.extend_from_slice(&(*n as u64).to_le_bytes());
            for _ in 0..*n {
                put(out, &key(k));
            }
        }
        Req::MultiSet(n, v) => {
            out.push(MULTI_SET);
            out.extend_from_slice(&(*n as u64).to_le_bytes());
            for i in 0..*n {
                put(out, format!("/m{tag}-{i}").as_bytes());
                put(out, &vec![2u8; *v]);
            }
        }
        Req::Append(k, n) => {
            out.push(APPEND);
            put(out, &key(k));
            put(out, &vec![3u8; *n]);
        }
        Req::CompareSet(k, n) => {
            out.push(COMPARE_SET);
            put(out, &key(k));
            put(out, b"x");
            put(out, &vec![4u8; *n]);
        }
        Req::Add(k) => {
            out.push(ADD);
            put(out, format!("/c{k}").as_bytes());
            out.extend_from_slice(&1i64.to_le_bytes());
        }
        Req::Delete(k) => {
            out.push(DELETE_KEY);
            put(out, &key(k));
        }
        Req::Wait(n) | Req::Check(n) => {
            out.push(if matches!(r, Req::Wait(_)) {
                WAIT
            } else {
                CHECK
            });
            out.extend_from_slice(&(*n as u64).to_le_bytes());
            for i in 0..*n {
                put(out, format!("/never-{tag}-{i}").as_bytes());
            }
        }
        Req::Cancel => out.push(CANCEL_WAIT),
        Req::Push(k, n) => {
            out.push(QUEUE_PUSH);
            put(out, &key(k));
            put(out, &vec![5u8; *n]);
        }
        Req::Pop(k) => {
            out.push(QUEUE_POP);
            put(out, &key(k));
        }
        Req::List => out.push(LIST_KEYS),
        Req::Ping => {
            out.push(PING);
            out.extend_from_slice(&7u32.to_le_bytes());
        }
        Req::Stall(n) => {
            out.push(SET);
            put(out, format!("/stall{tag}").as_bytes());
            out.extend_from_slice(&(*n as u64).to_le_bytes());
            out.extend_from_slice(&vec![6u8; n / 3]);
        }
    }
}

/// Runs `plan` (one request list per connection; some connections never
/// read their replies) against a counted server; returns the peak.
fn run_mix(max_bytes: usize, plan: &[(bool, Vec<Req>)]) -> (usize, usize) {
    let srv = Counted::start(max_bytes);
    let rt = clients();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for (c, (reads, reqs)) in plan.iter().enumerate() {
            let addr = srv.addr.clone();
            let (reads, reqs) = (*reads, reqs.clone());
            tasks.push(tokio::spawn(async move {
                let mut s = raw(&addr).await;
                for (i, r) in reqs.iter().enumerate() {
                    let mut b = Vec::new();
                    encode(r, c * 1000 + i, &mut b);
                    send(&mut s, &b, Duration::from_secs(2)).await;
                    if matches!(r, Req::Stall(_)) {
                        break;
                    }
                    if reads {
                        drain(&mut s, Duration::from_millis(5)).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                s
            }));
        }
        let mut held = Vec::new();
        for t in tasks {
            held.push(t.await.unwrap());
        }
        drop(held);
    });
    (srv.peak(), bound(max_bytes, plan.len()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Random request mixes from a few clients, some never reading their
    /// replies, some cut off mid-request: the server's bytes stay within
    /// the bound.
    #[test]
    fn random_mixes_stay_within_the_bound(
        plan in proptest::collection::vec(
            (any::<bool>(), proptest::collection::vec(req(), 1..24)),
            1..5,
        ),
        limit_mib in prop_oneof![Just(4usize), Just(16), Just(40)],
    ) {
        let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
        let (peak, bound) = run_mix(limit_mib << 20, &plan);
        prop_assert!(peak <= bound, "peak {peak} over the bound {bound}");
    }
}

/// Attacks from issue 49, each under its limit.
fn attack(max_bytes: usize, conns: usize, each: impl Fn(usize) -> Vec<u8> + Send + Sync + 'static) {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let srv = Counted::start(max_bytes);
    let rt = clients();
    let each = std::sync::Arc::new(each);
    rt.block_on(async {
        let mut tasks = Vec::new();
        for c in 0..conns {
            let (addr, each) = (srv.addr.clone(), each.clone());
            tasks.push(tokio::spawn(async move {
                let mut s = raw(&addr).await;
                send(&mut s, &each(c), Duration::from_secs(10)).await;
                s
            }));
        }
        let mut held = Vec::new();
        for t in tasks {
            held.push(t.await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(held);
    });
    let (peak, bound) = (srv.peak(), bound(max_bytes, conns));
    eprintln!(
        "peak {} KiB, limit {} KiB, bound {} KiB",
        peak >> 10,
        max_bytes >> 10,
        bound >> 10
    );
    assert!(peak <= bound, "peak {peak} over the bound {bound}");
}

/// Many small keys (rendezvous data looks like this): the table's growth
/// and each entry's slot are paid for.
#[test]
fn many_small_keys_stay_within_the_bound() {
    attack(16 << 20, 1, |_| {
        let mut b = Vec::new();
        for i in 0..200_000u32 {
            b.push(SET);
            put(&mut b, format!("/key-{i:08}").as_bytes());
            put(&mut b, b"");
        }
        b
    });
}

/// A crowd of stalled MULTI_SETs of empty pairs: each element read is paid
/// for, whatever its length.
#[test]
fn stalled_multi_sets_of_empty_pairs_stay_within_the_bound() {
    attack(16 << 20, 40, |_| {
        let mut b = vec![MULTI_SET];
        b.extend_from_slice(&131_071u64.to_le_bytes());
        for _ in 0..100_000 {
            put(&mut b, b"");
            put(&mut b, b"");
        }
        b
    });
}

/// WAITs on many never-set keys: each registration is paid for.
#[test]
fn waits_on_never_set_keys_stay_within_the_bound() {
    attack(32 << 20, 8, |c| {
        let mut b = Vec::new();
        for r in 0..4 {
            b.push(WAIT);
            b.extend_from_slice(&131_071u64.to_le_bytes());
            for i in 0..131_071 {
                put(&mut b, format!("/w{c}-{r}-{i}").as_bytes());
            }
        }
        b
    });
}

/// COMPARE_SET on a value appended to near the limit: the reply shares the
/// value instead of copying it.
#[test]
fn compare_set_on_a_large_value_stays_within_the_bound() {
    attack(64 << 20, 1, |_| {
        let mut b = Vec::new();
        for _ in 0..7 {
            b.push(APPEND);
            put(&mut b, b"/big");
            put(&mut b, &vec![9u8; 8 << 20]);
        }
        for _ in 0..20 {
            b.push(COMPARE_SET);
            put(&mut b, b"/big");
            put(&mut b, b"not it");
            put(&mut b, b"x");
        }
        b
    });
}

/// SET headers announcing 8 MiB values, never followed by the bytes.
#[test]
fn set_headers_without_values_stay_within_the_bound() {
    attack(16 << 20, 200, |c| {
        let mut b = vec![SET];
        put(&mut b, format!("/h{c}").as_bytes());
        b.extend_from_slice(&(8u64 << 20).to_le_bytes());
        b
    });
}

/// What a connection costs at rest (after VALIDATE and a PING, as torch's
/// client leaves it): within [`PER_CONNECTION`], the figure the bound
/// states.
#[test]
fn a_connection_at_rest_costs_less_than_the_stated_figure() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let srv = Counted::start(1 << 30);
    let rt = clients();
    let n = 500;
    let per = rt.block_on(async {
        let mut conns = Vec::new();
        for _ in 0..n {
            let mut s = raw(&srv.addr).await;
            let mut ping = vec![PING];
            ping.extend_from_slice(&7u32.to_le_bytes());
            s.write_all(&ping).await.unwrap();
            let mut back = [0u8; 4];
            s.read_exact(&mut back).await.unwrap();
            conns.push(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let per = NOW.load(Ordering::Relaxed).saturating_sub(srv.base) / n;
        drop(conns);
        per
    });
    eprintln!("a connection at rest: {per} bytes");
    assert!(per <= PER_CONNECTION, "{per} bytes per connection");
}

/// Many clients each waiting on a full request of never-set keys, more
/// than the store can hold: registrations are refused or shed, and the
/// bytes stay within the bound.
#[test]
fn a_crowd_of_large_waits_stays_within_the_bound() {
    attack(64 << 20, 40, |c| {
        let mut b = vec![WAIT];
        b.extend_from_slice(&131_071u64.to_le_bytes());
        for i in 0..131_071 {
            put(&mut b, format!("/never-{c}-{i}").as_bytes());
        }
        b
    });
}
