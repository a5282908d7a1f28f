//! The store against attacks that lock innocent clients out or lose data
//! (issue 49; the memory bound itself is `store_memory.rs`, the older
//! battery of amplification, slowloris and garbage is `store_hostile.rs`).
//!
//! Each attack runs over real sockets against a real server in this
//! process; afterwards (or while it goes on) a fresh client connects
//! (VALIDATE, then torch's connect-time PING), reads what was set before
//! the attack unchanged, and writes. Covered:
//! - a client that fills the store (small keys, then large values) and
//!   leaves: reads, CHECK, DELETE_KEY and the writes it makes room for;
//! - a crowd of half-written requests (SET headers announcing 8 MiB,
//!   MULTI_SETs of 131,071 empty pairs, WAIT, CHECK and MULTI_GET key
//!   lists) stalled while a fresh client is served, and a crowd of a
//!   thousand that each owe the store only a few KiB;
//! - idle floods at the connection cap (never VALIDATE; VALIDATE and
//!   nothing more) and, with a secret, a flood renewed without end that
//!   never answers the challenge (as many connections as the cap, and
//!   twice as many), while the secret holder connects 25 times;
//! - queue items and every other change near the limit: each request that
//!   changes state completes with its reply or changes nothing, also when
//!   its client is closed for a later request;
//! - wait storms: 200 clients waiting on 2,000 keys each leaving at once,
//!   and WAIT + CANCEL_WAIT loops beside a client's GETs;
//! - COMPARE_SET on a value appended to near the limit.
//!
//! torch's own client against this server, and LIST_KEYS and BARRIER in
//! raw bytes, are in `torch_interop.rs` and `tcpstore.rs`.
//!
//! The deadlines here ([`SERVED_WITHIN`]) are hang detection, generous for
//! a loaded 2-core CI machine; the figure that matters, a fresh client
//! (torch's own, where importable) served within about a second during or
//! after each attack, is measured by `scripts/store-attacks`, not asserted.
//! The tests run one at a time (they time their clients).

use std::{
    io::ErrorKind,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use consort_comm::store::Store;
use consort_tcp::{
    Secret, ServerOptions, TcpStore, TcpStoreOptions, TcpStoreServer, store::VALIDATION_MAGIC,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

// torch's command bytes.
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
const QUEUE_LEN: u8 = 16;
const BARRIER: u8 = 18;

/// Hang detection: how long a fresh client may take for each step. The
/// target is well under a second (measured by `scripts/store-attacks`).
const SERVED_WITHIN: Duration = Duration::from_secs(5);

/// One test at a time: they time their clients, and one measures RSS.
static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A length-prefixed string. Keys from our client and torch's carry a
/// leading `/` on the wire.
fn put(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// A request: the command byte, then each argument as a string.
fn req(out: &mut Vec<u8>, command: u8, args: &[&[u8]]) {
    out.push(command);
    for a in args {
        put(out, a);
    }
}

/// A request naming keys (CHECK, WAIT, MULTI_GET): `count`, then `keys`
/// (fewer than `count` for a request stalled half-way).
fn key_list(command: u8, count: u64, keys: impl Iterator<Item = String>) -> Vec<u8> {
    let mut b = vec![command];
    b.extend_from_slice(&count.to_le_bytes());
    for k in keys {
        put(&mut b, k.as_bytes());
    }
    b
}

async fn server(opts: ServerOptions) -> (TcpStoreServer, String) {
    let s = TcpStoreServer::bind_opts("127.0.0.1:0", opts)
        .await
        .unwrap();
    let addr = s.local_addr().to_string();
    (s, addr)
}

fn limited(max_bytes: usize) -> ServerOptions {
    ServerOptions {
        max_bytes,
        ..Default::default()
    }
}

fn client_opts(secret: Option<Secret>) -> TcpStoreOptions {
    TcpStoreOptions {
        timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        secret,
    }
}

async fn client(addr: &str) -> TcpStore {
    TcpStore::connect(addr, client_opts(None)).await.unwrap()
}

/// VALIDATE, torch's first message.
fn hello() -> Vec<u8> {
    let mut b = vec![0u8];
    b.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
    b
}

/// A raw connection that has sent VALIDATE, speaking torch's wire one
/// request at a time; each reply is awaited for at most [`SERVED_WITHIN`]
/// (a `TimedOut` error past it; a closed connection reads as an EOF).
struct Raw(TcpStream);

type Io<T> = std::io::Result<T>;

impl Raw {
    async fn connect(addr: &str) -> Io<Raw> {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        s.write_all(&hello()).await?;
        Ok(Raw(s))
    }

    async fn send(&mut self, b: &[u8]) -> Io<()> {
        match tokio::time::timeout(SERVED_WITHIN, self.0.write_all(b)).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!("the server took no more bytes for {SERVED_WITHIN:?}"),
            )),
        }
    }

    async fn read(&mut self, n: usize, what: &str) -> Io<Vec<u8>> {
        let mut b = vec![0u8; n];
        match tokio::time::timeout(SERVED_WITHIN, self.0.read_exact(&mut b)).await {
            Ok(Ok(_)) => Ok(b),
            Ok(Err(e)) if e.kind() == ErrorKind::UnexpectedEof => Err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                format!("the server closed the connection instead of answering {what}"),
            )),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!("no answer to {what} within {SERVED_WITHIN:?}"),
            )),
        }
    }

    async fn u64(&mut self, what: &str) -> Io<u64> {
        let b = self.read(8, what).await?;
        Ok(u64::from_le_bytes(b.try_into().unwrap()))
    }

    async fn string(&mut self, what: &str) -> Io<Vec<u8>> {
        let n = self.u64(what).await?;
        self.read(n as usize, what).await
    }

    async fn ping(&mut self) -> Io<()> {
        let mut b = vec![PING];
        b.extend_from_slice(&7u32.to_le_bytes());
        self.send(&b).await?;
        let back = self.read(4, "PING").await?;
        if back != 7u32.to_le_bytes() {
            return Err(std::io::Error::new(
                ErrorKind::InvalidData,
                format!("PING 7 answered {back:?}"),
            ));
        }
        Ok(())
    }

    /// SET has no reply.
    async fn set(&mut self, key: &str, value: &[u8]) -> Io<()> {
        let mut b = Vec::new();
        req(&mut b, SET, &[key.as_bytes(), value]);
        self.send(&b).await
    }

    async fn get(&mut self, key: &str) -> Io<Vec<u8>> {
        let mut b = Vec::new();
        req(&mut b, GET, &[key.as_bytes()]);
        self.send(&b).await?;
        self.string(&format!("GET {key}")).await
    }

    async fn check(&mut self, keys: &[&str]) -> Io<bool> {
        let b = key_list(CHECK, keys.len() as u64, keys.iter().map(|k| k.to_string()));
        self.send(&b).await?;
        Ok(self.read(1, "CHECK").await? == [0])
    }

    async fn add(&mut self, key: &str, n: i64) -> Io<i64> {
        let mut b = Vec::new();
        req(&mut b, ADD, &[key.as_bytes()]);
        b.extend_from_slice(&n.to_le_bytes());
        self.send(&b).await?;
        Ok(self.u64(&format!("ADD {key}")).await? as i64)
    }

    async fn delete(&mut self, key: &str) -> Io<bool> {
        let mut b = Vec::new();
        req(&mut b, DELETE_KEY, &[key.as_bytes()]);
        self.send(&b).await?;
        Ok(self.u64(&format!("DELETE_KEY {key}")).await? == 1)
    }

    async fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Io<Vec<u8>> {
        let mut b = Vec::new();
        req(&mut b, COMPARE_SET, &[key.as_bytes(), expected, desired]);
        self.send(&b).await?;
        self.string(&format!("COMPARE_SET {key}")).await
    }

    async fn queue_pop(&mut self, key: &str) -> Io<Option<Vec<u8>>> {
        let mut b = Vec::new();
        req(&mut b, QUEUE_POP, &[key.as_bytes()]);
        self.send(&b).await?;
        let before = self.u64(&format!("QUEUE_POP {key}")).await? as i64;
        if before > 0 {
            Ok(Some(self.string(&format!("QUEUE_POP {key}")).await?))
        } else {
            Ok(None)
        }
    }

    async fn queue_len(&mut self, key: &str) -> Io<i64> {
        let mut b = Vec::new();
        req(&mut b, QUEUE_LEN, &[key.as_bytes()]);
        self.send(&b).await?;
        Ok(self.u64(&format!("QUEUE_LEN {key}")).await? as i64)
    }
}

/// A fresh client, as torch's connects: VALIDATE and PING, then a GET of
/// each of `before` (set before the attack: must read back unchanged) and,
/// with `writes`, a SET of a small key and a GET of it. Panics naming the
/// step that failed; returns how long it all took.
async fn fresh_client_is_served(addr: &str, before: &[(&str, &[u8])], writes: bool) -> Duration {
    let start = Instant::now();
    let steps = async {
        let mut c = Raw::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        c.ping()
            .await
            .map_err(|e| format!("the connect-time PING: {e}"))?;
        for (k, want) in before {
            let got = c.get(k).await.map_err(|e| format!("GET {k}: {e}"))?;
            if got != *want {
                return Err(format!(
                    "GET {k} read {} bytes, not the {} set before the attack",
                    got.len(),
                    want.len()
                ));
            }
        }
        if !writes {
            return Ok(());
        }
        c.set("/fresh", b"ok")
            .await
            .map_err(|e| format!("SET /fresh: {e}"))?;
        let got = c
            .get("/fresh")
            .await
            .map_err(|e| format!("GET /fresh after SET /fresh (was the SET refused?): {e}"))?;
        if got != b"ok" {
            return Err(format!("GET /fresh read {got:?} after SET /fresh ok"));
        }
        Ok::<_, String>(())
    };
    match tokio::time::timeout(3 * SERVED_WITHIN, steps).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("a fresh client was not served: {e}"),
        Err(_) => panic!(
            "a fresh client was not served within {:?}",
            3 * SERVED_WITHIN
        ),
    }
    let took = start.elapsed();
    eprintln!("a fresh client was served in {took:?}");
    took
}

/// One client fills the store and leaves: `small` keys of 16 bytes first,
/// then values of 1 MiB, 4 KiB and none, each size until the server
/// refuses it (closes the connection). Returns how many values a PING
/// after them showed stored.
async fn fill_to_the_brim(addr: &str, small: usize) -> usize {
    let mut stored = 0;
    if small > 0 {
        let mut c = Raw::connect(addr).await.unwrap();
        let mut b = Vec::new();
        for i in 0..small {
            req(&mut b, SET, &[format!("/small-{i}").as_bytes(), &[7u8; 16]]);
        }
        c.send(&b).await.unwrap();
        c.ping().await.expect("the small keys were refused");
        stored += small;
    }
    for (size, batch) in [(1usize << 20, 2usize), (4096, 64), (0, 1024)] {
        let Ok(mut c) = Raw::connect(addr).await else {
            continue;
        };
        let value = vec![5u8; size];
        for round in 0.. {
            assert!(round < 100_000, "the store never refused the filler");
            let mut b = Vec::new();
            for i in 0..batch {
                let key = format!("/fill-{size}-{}", round * batch + i);
                req(&mut b, SET, &[key.as_bytes(), &value]);
            }
            if c.send(&b).await.is_err() || c.ping().await.is_err() {
                break;
            }
            stored += batch;
        }
    }
    stored
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

/// One client fills the store to its limit, small keys first and then
/// large values, and leaves. A fresh client connects (VALIDATE and
/// PING), reads what was set before unchanged, CHECKs; an ADD to an existing counter may be refused but then changes
/// nothing; DELETE_KEY makes room, and a SET of 1 MiB then succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fill_and_leave_locks_nobody_out() {
    let _one = ONE.lock().await;
    let (srv, addr) = server(limited(16 << 20)).await;
    let big = pattern(1 << 20);
    let before = client(&addr).await;
    before.set("before", b"precious").await.unwrap();
    before.set("before-big", &big).await.unwrap();
    assert_eq!(before.add("n", 5).await.unwrap(), 5);
    let stored = fill_to_the_brim(&addr, 20_000).await;
    eprintln!("the filler stored {stored} values before it was refused");
    let start = Instant::now();
    // The store is full: the fresh client reads, and writes once it has
    // deleted.
    fresh_client_is_served(
        &addr,
        &[("/before", b"precious"), ("/before-big", &big)],
        false,
    )
    .await;
    let mut c = Raw::connect(&addr).await.unwrap();
    c.ping().await.unwrap();
    assert!(
        c.check(&["/before", "/small-0", "/fill-1048576-0"])
            .await
            .unwrap(),
        "CHECK on a full store: keys set before and during the fill are not all there"
    );
    // An ADD may be refused on a full store; if so it changed nothing.
    let mut adder = Raw::connect(&addr).await.unwrap();
    let added = adder.add("/n", 1).await;
    let n = c.get("/n").await.unwrap();
    match added {
        Ok(v) => assert_eq!((v, n.as_slice()), (6, &b"6"[..]), "ADD said {v}"),
        Err(e) => assert_eq!(n, b"5", "a refused ADD ({e}) changed the counter"),
    }
    for i in 0..4 {
        let key = format!("/fill-1048576-{i}");
        assert!(c.delete(&key).await.unwrap(), "DELETE_KEY {key}");
    }
    c.set("/after", &big).await.unwrap();
    let got = c
        .get("/after")
        .await
        .unwrap_or_else(|e| panic!("a SET of 1 MiB after deleting 4 MiB was refused: {e}"));
    assert_eq!(got, big);
    assert!(start.elapsed() < 4 * SERVED_WITHIN);
    srv.shutdown().await;
}

/// A crowd of half-written requests under a 64 MiB limit: 300 SET
/// headers announcing 8 MiB values (key and length sent, no value
/// bytes), 400 MULTI_SETs announcing 131,071 pairs stalled after 3,000
/// empty ones, and WAIT, CHECK and MULTI_GET lists of 131,071 keys
/// stalled after 60,000. While they stay connected a fresh client is
/// served: PING, a SET of a small key, a GET of a key set before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_half_written_requests_locks_nobody_out() {
    let _one = ONE.lock().await;
    let (srv, addr) = server(limited(64 << 20)).await;
    let known = client(&addr).await;
    known.set("before", b"precious").await.unwrap();
    assert!(known.check(&["before"]).await.unwrap());
    let mut crowd = Vec::new();
    for i in 0..300 {
        let mut s = Raw::connect(&addr).await.unwrap();
        let mut b = vec![SET];
        put(&mut b, format!("/h{i}").as_bytes());
        b.extend_from_slice(&(8u64 << 20).to_le_bytes());
        let _ = s.send(&b).await;
        crowd.push(s);
    }
    let mut multi_set = vec![MULTI_SET];
    multi_set.extend_from_slice(&131_071u64.to_le_bytes());
    for _ in 0..3000 {
        put(&mut multi_set, b"");
        put(&mut multi_set, b"");
    }
    for _ in 0..400 {
        let mut s = Raw::connect(&addr).await.unwrap();
        let _ = s.send(&multi_set).await;
        crowd.push(s);
    }
    for command in [WAIT, CHECK, MULTI_GET] {
        let list = key_list(command, 131_071, (0..60_000).map(|i| format!("/never-{i}")));
        for _ in 0..8 {
            let mut s = Raw::connect(&addr).await.unwrap();
            let _ = s.send(&list).await;
            crowd.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    fresh_client_is_served(&addr, &[("/before", b"precious")], true).await;
    assert_eq!(known.get("before").await.unwrap(), b"precious");
    drop(crowd);
    srv.shutdown().await;
}

/// The same with requests that each owe the store little (a few KiB:
/// a MULTI_SET stalled after 100 empty pairs, a SET header), a
/// thousand of them under a 4 MiB limit: small enough each to be
/// served from what the store keeps for small requests, together more
/// than the limit. A fresh client is served meanwhile, its SET too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_small_half_written_requests_locks_nobody_out() {
    let _one = ONE.lock().await;
    let (srv, addr) = server(limited(4 << 20)).await;
    let known = client(&addr).await;
    known.set("before", b"precious").await.unwrap();
    assert!(known.check(&["before"]).await.unwrap());
    let mut crowd = Vec::new();
    for i in 0..300 {
        let mut s = Raw::connect(&addr).await.unwrap();
        let mut b = vec![SET];
        put(&mut b, format!("/h{i}").as_bytes());
        b.extend_from_slice(&(8u64 << 20).to_le_bytes());
        let _ = s.send(&b).await;
        crowd.push(s);
    }
    let mut multi_set = vec![MULTI_SET];
    multi_set.extend_from_slice(&131_071u64.to_le_bytes());
    for _ in 0..100 {
        put(&mut multi_set, b"");
        put(&mut multi_set, b"");
    }
    for _ in 0..1000 {
        let mut s = Raw::connect(&addr).await.unwrap();
        let _ = s.send(&multi_set).await;
        crowd.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    fresh_client_is_served(&addr, &[("/before", b"precious")], true).await;
    assert_eq!(known.get("before").await.unwrap(), b"precious");
    drop(crowd);
    srv.shutdown().await;
}

/// Idle floods at a cap of 32 connections: 32 that never send
/// VALIDATE, then 32 that send VALIDATE and nothing more. A fresh
/// client is served at once each time (the VALIDATE deadline is a
/// minute: waiting it out is not being served), and a client at work
/// before the flood keeps its connection throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_floods_at_the_cap_lock_nobody_out() {
    let _one = ONE.lock().await;
    let cap = 32;
    let (srv, addr) = server(ServerOptions {
        max_clients: cap,
        validate_timeout: Duration::from_secs(60),
        ..Default::default()
    })
    .await;
    let known = client(&addr).await;
    known.set("before", b"precious").await.unwrap();
    assert!(known.check(&["before"]).await.unwrap());
    for validated in [false, true] {
        let mut flood = Vec::new();
        for _ in 0..cap {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            if validated {
                s.write_all(&hello()).await.unwrap();
            }
            flood.push(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let took = fresh_client_is_served(&addr, &[("/before", b"precious")], true).await;
        assert!(took < SERVED_WITHIN, "served in {took:?}");
        assert_eq!(
            known.get("before").await.unwrap(),
            b"precious",
            "the client at work lost its connection to the flood"
        );
        drop(flood);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    srv.shutdown().await;
}

/// On a store with a secret and a cap of 32 connections, a flood of
/// 32 connections that never answer the challenge, each reopened as
/// soon as the server closes it: the secret holder connects, sets and
/// gets 25 times out of 25 while the flood goes on, and a client
/// connected before the flood keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_flood_that_never_answers_the_secret_keeps_nobody_out() {
    let _one = ONE.lock().await;
    secret_holder_gets_through_a_renewed_flood(32).await;
}

/// The same with 64 such connections, twice the cap: nothing limits
/// how many an attacker opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_flood_of_twice_the_cap_keeps_nobody_out() {
    let _one = ONE.lock().await;
    secret_holder_gets_through_a_renewed_flood(64).await;
}

async fn secret_holder_gets_through_a_renewed_flood(flooders: usize) {
    let secret = Secret::new(b"a secret long enough to pass the checks".to_vec()).unwrap();
    let (srv, addr) = server(ServerOptions {
        max_clients: 32,
        secret: Some(secret.clone()),
        validate_timeout: Duration::from_secs(60),
        ..Default::default()
    })
    .await;
    let known = TcpStore::connect(&addr, client_opts(Some(secret.clone())))
        .await
        .unwrap();
    known.set("before", b"precious").await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let mut flood = Vec::new();
    for _ in 0..flooders {
        let (addr, stop, opened) = (addr.clone(), stop.clone(), opened.clone());
        flood.push(tokio::spawn(async move {
            let mut buf = [0u8; 256];
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = TcpStream::connect(&addr).await else {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                };
                opened.fetch_add(1, Ordering::Relaxed);
                // Read the challenge, never answer; reopen once closed.
                while !stop.load(Ordering::Relaxed) {
                    match tokio::time::timeout(Duration::from_millis(50), s.read(&mut buf)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => break,
                        _ => {}
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut through = 0;
    let mut failures = Vec::new();
    for i in 0..25 {
        let attempt = async {
            let c = TcpStore::connect(&addr, client_opts(Some(secret.clone()))).await?;
            c.set("k", format!("{i}").as_bytes()).await?;
            c.get("k").await
        };
        match tokio::time::timeout(SERVED_WITHIN, attempt).await {
            Ok(Ok(v)) if v == format!("{i}").as_bytes() => through += 1,
            Ok(Ok(v)) => failures.push(format!("try {i}: read {v:?}")),
            Ok(Err(e)) => failures.push(format!("try {i}: {e}")),
            Err(_) => failures.push(format!("try {i}: not through within {SERVED_WITHIN:?}")),
        }
        assert_eq!(
            known.get("before").await.unwrap(),
            b"precious",
            "the client connected before the flood lost its connection"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for f in flood {
        f.await.unwrap();
    }
    eprintln!(
        "{flooders} flooders opened {} connections",
        opened.load(Ordering::Relaxed)
    );
    assert_eq!(
        through,
        25,
        "the secret holder got through {through} times in 25 while {flooders} connections \
         that never answer the challenge were renewed; first failure: {}",
        failures.first().map_or("-", String::as_str)
    );
    srv.shutdown().await;
}

/// Three items pushed, then another client fills the store to its
/// limit: a fresh client pops all three, in order, and then finds the
/// queue empty. Nothing is lost to the full budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_items_survive_a_full_store() {
    let _one = ONE.lock().await;
    let (srv, addr) = server(limited(16 << 20)).await;
    let c = client(&addr).await;
    for v in [b"one", b"two", b"333"] {
        c.queue_push("q", v).await.unwrap();
    }
    assert_eq!(c.queue_len("q").await.unwrap(), 3);
    fill_to_the_brim(&addr, 0).await;
    let mut fresh = Raw::connect(&addr).await.unwrap();
    fresh.ping().await.unwrap();
    assert_eq!(fresh.queue_len("/q").await.unwrap(), 3);
    let mut got = Vec::new();
    for i in 0..3 {
        match fresh.queue_pop("/q").await {
            Ok(Some(v)) => got.push(v),
            Ok(None) => panic!("pop {i}: the queue was empty after {got:?}"),
            Err(e) => panic!("pop {i} on a full store failed: {e}"),
        }
    }
    assert_eq!(got, [b"one".to_vec(), b"two".to_vec(), b"333".to_vec()]);
    assert_eq!(fresh.queue_pop("/q").await.unwrap(), None);
    srv.shutdown().await;
}

/// On a store filled to its limit, each request that changes state
/// (ADD, DELETE_KEY, COMPARE_SET, QUEUE_POP, APPEND, BARRIER), each on
/// a fresh connection, either completes with its reply or is refused
/// having changed nothing, as another client then sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn near_the_limit_every_change_completes_with_its_reply_or_changes_nothing() {
    let _one = ONE.lock().await;
    let (srv, addr) = server(limited(16 << 20)).await;
    let c = client(&addr).await;
    assert_eq!(c.add("n", 5).await.unwrap(), 5);
    c.set("d", b"doomed").await.unwrap();
    c.set("cas", b"old").await.unwrap();
    c.set("app", b"x").await.unwrap();
    c.queue_push("q", b"a").await.unwrap();
    c.queue_push("q", b"b").await.unwrap();
    assert!(c.check(&["n", "d", "cas", "app", "q"]).await.unwrap());
    fill_to_the_brim(&addr, 0).await;
    let mut look = Raw::connect(&addr).await.unwrap();
    look.ping().await.unwrap();

    let mut r = Raw::connect(&addr).await.unwrap();
    match r.add("/n", 1).await {
        Ok(v) => {
            assert_eq!(v, 6);
            assert_eq!(look.get("/n").await.unwrap(), b"6");
        }
        Err(e) => assert_eq!(look.get("/n").await.unwrap(), b"5", "refused ADD ({e})"),
    }
    let mut r = Raw::connect(&addr).await.unwrap();
    match r.delete("/d").await {
        Ok(gone) => {
            assert!(gone);
            assert!(!look.check(&["/d"]).await.unwrap());
        }
        Err(e) => assert!(look.check(&["/d"]).await.unwrap(), "refused DELETE ({e})"),
    }
    let mut r = Raw::connect(&addr).await.unwrap();
    match r.compare_set("/cas", b"old", b"new").await {
        Ok(v) => {
            assert_eq!(v, b"new");
            assert_eq!(look.get("/cas").await.unwrap(), b"new");
        }
        Err(e) => assert_eq!(look.get("/cas").await.unwrap(), b"old", "refused CAS ({e})"),
    }
    let mut r = Raw::connect(&addr).await.unwrap();
    match r.queue_pop("/q").await {
        Ok(v) => {
            assert_eq!(v.as_deref(), Some(&b"a"[..]));
            assert_eq!(look.queue_len("/q").await.unwrap(), 1);
        }
        Err(e) => assert_eq!(look.queue_len("/q").await.unwrap(), 2, "refused POP ({e})"),
    }
    // APPEND has no reply: a PING after it says whether it went through (a
    // PING is answered on a full store, so a closed connection means the
    // APPEND was refused).
    let mut r = Raw::connect(&addr).await.unwrap();
    let mut b = Vec::new();
    req(&mut b, APPEND, &[b"/app", b"y"]);
    r.send(&b).await.unwrap();
    match r.ping().await {
        Ok(()) => assert_eq!(look.get("/app").await.unwrap(), b"xy"),
        Err(e) => assert_eq!(
            look.get("/app").await.unwrap(),
            b"x",
            "refused APPEND ({e})"
        ),
    }
    // A barrier of two, then cancelled: its arrival counts if the cancel
    // is answered (as in torch), and not at all if it was refused.
    let mut r = Raw::connect(&addr).await.unwrap();
    let mut b = Vec::new();
    req(&mut b, BARRIER, &[b"/bar"]);
    b.extend_from_slice(&2i64.to_le_bytes());
    b.push(CANCEL_WAIT);
    r.send(&b).await.unwrap();
    match r.read(1, "BARRIER + CANCEL_WAIT").await {
        Ok(v) => {
            assert_eq!(v, [1], "a barrier of two with one arrival was released");
            assert_eq!(look.get("/bar").await.unwrap(), b"1");
        }
        Err(e) => assert!(
            !look.check(&["/bar"]).await.unwrap(),
            "refused BARRIER ({e})"
        ),
    }
    srv.shutdown().await;
}

/// A client sends QUEUE_POPs and ADDs in one go, then a byte that is
/// no command: it is closed for that byte, but the changes before it
/// were made, so their replies reach it first. Every item popped is
/// either in its hands or still in the queue, and the counter counts
/// exactly the ADDs it was told of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_closed_for_a_later_request_gets_the_replies_to_its_changes() {
    let _one = ONE.lock().await;
    let (srv, addr) = server(ServerOptions::default()).await;
    let items: Vec<Vec<u8>> = (0..3).map(|i| format!("item-{i}").into_bytes()).collect();
    let mut setup = Raw::connect(&addr).await.unwrap();
    for it in &items {
        let mut b = Vec::new();
        req(&mut b, QUEUE_PUSH, &[b"/q", it]);
        setup.send(&b).await.unwrap();
    }
    setup.ping().await.unwrap();
    let adds = 200;
    let mut b = Vec::new();
    for _ in 0..items.len() {
        req(&mut b, QUEUE_POP, &[b"/q"]);
    }
    for _ in 0..adds {
        req(&mut b, ADD, &[b"/n"]);
        b.extend_from_slice(&1i64.to_le_bytes());
    }
    b.push(200); // no such command
    let mut bad = Raw::connect(&addr).await.unwrap();
    bad.send(&b).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(SERVED_WITHIN, bad.0.read_to_end(&mut got)).await;
    // Parse what came: the pops' replies, then the ADDs'.
    let mut at = 0;
    let mut popped = Vec::new();
    let word = |at: &mut usize| {
        let w = got.get(*at..*at + 8)?;
        *at += 8;
        Some(u64::from_le_bytes(w.try_into().unwrap()))
    };
    for _ in 0..items.len() {
        let Some(before) = word(&mut at) else { break };
        assert!(before > 0, "a pop found the queue empty");
        let Some(len) = word(&mut at) else { break };
        let Some(v) = got.get(at..at + len as usize) else {
            break;
        };
        at += len as usize;
        popped.push(v.to_vec());
    }
    let mut told = 0;
    while word(&mut at).is_some() {
        told += 1;
    }
    let mut look = Raw::connect(&addr).await.unwrap();
    let mut left = Vec::new();
    while let Some(v) = look.queue_pop("/q").await.unwrap() {
        left.push(v);
    }
    let n = look.get("/n").await.unwrap();
    let counted = if n.is_empty() {
        0
    } else {
        String::from_utf8(n).unwrap().parse::<usize>().unwrap()
    };
    eprintln!(
        "the client was told of {} pops and {told} ADDs; the store counted {counted}",
        popped.len()
    );
    let mut all = popped.clone();
    all.extend(left.iter().cloned());
    assert_eq!(
        all,
        items,
        "items lost: {} popped and told, {} left in the queue",
        popped.len(),
        left.len()
    );
    assert_eq!(
        counted, told,
        "the counter counts {counted} ADDs, the client was told of {told}"
    );
    srv.shutdown().await;
}

/// 200 clients each wait on 2,000 distinct never-set keys, then all
/// leave at once: a fresh client's SET and GET are served promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_storm_leaving_at_once_delays_nobody() {
    let _one = ONE.lock().await;
    let (srv, addr) = server(ServerOptions::default()).await;
    let c = client(&addr).await;
    c.set("before", b"precious").await.unwrap();
    let mut waiters = Vec::new();
    for t in 0..200 {
        let mut s = Raw::connect(&addr).await.unwrap();
        let list = key_list(WAIT, 2000, (0..2000).map(|i| format!("/storm-{t}-{i}")));
        s.send(&list).await.unwrap();
        waiters.push(s);
    }
    // A round trip on each: a CHECK after the WAIT is answered (and the
    // WAIT is not), so the WAIT is registered.
    for w in &mut waiters {
        assert!(w.check(&["/before"]).await.unwrap());
    }
    drop(waiters);
    let took = fresh_client_is_served(&addr, &[("/before", b"precious")], true).await;
    assert!(took < SERVED_WITHIN, "served in {took:?}");
    srv.shutdown().await;
}

/// Two clients loop WAIT on 2,000 never-set keys and CANCEL_WAIT as
/// fast as they can while another client does 50 GETs: each GET is
/// answered promptly, and the loops go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_and_cancel_loops_delay_nobody() {
    let _one = ONE.lock().await;
    let (srv, addr) = server(ServerOptions::default()).await;
    let c = client(&addr).await;
    c.set("before", b"precious").await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicUsize::new(0));
    let mut loops = Vec::new();
    for t in 0..2 {
        let (addr, stop, rounds) = (addr.clone(), stop.clone(), rounds.clone());
        let mut round = key_list(WAIT, 2000, (0..2000).map(|i| format!("/loop-{t}-{i}")));
        round.push(CANCEL_WAIT);
        loops.push(tokio::spawn(async move {
            let mut s = Raw::connect(&addr).await.unwrap();
            while !stop.load(Ordering::Relaxed) {
                s.send(&round).await.unwrap();
                assert_eq!(s.read(1, "CANCEL_WAIT").await.unwrap(), [1]);
                rounds.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut slowest = Duration::ZERO;
    for i in 0..50 {
        let t = Instant::now();
        let v = tokio::time::timeout(SERVED_WITHIN, c.get("before")).await;
        let v = v.unwrap_or_else(|_| panic!("GET {i} took over {SERVED_WITHIN:?}"));
        assert_eq!(v.unwrap(), b"precious");
        slowest = slowest.max(t.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        l.await.unwrap();
    }
    eprintln!(
        "slowest of 50 GETs beside {} WAIT + CANCEL_WAIT rounds: {slowest:?}",
        rounds.load(Ordering::Relaxed)
    );
    assert!(rounds.load(Ordering::Relaxed) > 0, "the loops never ran");
    srv.shutdown().await;
}

/// The process's resident set, in bytes.
fn rss() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// A value appended to until the store refuses (about half the 64 MiB
/// limit: APPEND holds the old and the new value at once), then 16
/// clients each COMPARE_SET on it with a mismatching 8 MiB expected
/// value and never read their replies. The server does not copy the
/// value per reply (its memory grows by far less than 16 copies); a
/// client may be refused, but others are served, and the value reads
/// back unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_set_on_a_value_appended_to_near_the_limit() {
    let _one = ONE.lock().await;
    let limit = 64 << 20;
    let (srv, addr) = server(limited(limit)).await;
    let chunk = vec![9u8; 1 << 20];
    let mut a = Raw::connect(&addr).await.unwrap();
    let mut appended = 0;
    loop {
        let mut b = Vec::new();
        req(&mut b, APPEND, &[b"/big", &chunk]);
        if a.send(&b).await.is_err() || a.ping().await.is_err() {
            break;
        }
        appended += 1;
        assert!(appended < 64, "APPEND was never refused");
    }
    drop(a);
    let mut look = Raw::connect(&addr).await.unwrap();
    let len = look.get("/big").await.unwrap().len();
    eprintln!("appended {appended} MiB before the refusal; the value is {len} bytes");
    // The last APPEND may have gone through with the PING after it refused.
    assert!(
        len == appended << 20 || len == (appended + 1) << 20,
        "{appended} APPENDs of 1 MiB made a value of {len} bytes"
    );
    assert!(len >= 16 << 20, "the value grew to only {len} bytes");
    let mut cas = vec![COMPARE_SET];
    put(&mut cas, b"/big");
    put(&mut cas, &vec![8u8; 8 << 20]);
    put(&mut cas, b"desired");
    let cas = Arc::new(cas);
    let rss_before = rss();
    let mut held = Vec::new();
    for _ in 0..16 {
        let mut s = Raw::connect(&addr).await.unwrap();
        let _ = s.send(&cas).await;
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let grew = rss().saturating_sub(rss_before);
    eprintln!("RSS grew by {} MiB during the COMPARE_SETs", grew >> 20);
    assert!(
        grew < 2 * limit,
        "RSS grew by {grew} bytes with a limit of {limit}: the value was copied per reply"
    );
    // One of them reads its reply: the current value, or a closed
    // connection.
    match held[15].string("COMPARE_SET").await {
        Ok(v) => assert_eq!(v.len(), len, "COMPARE_SET answered something else"),
        Err(e) => eprintln!("the last COMPARE_SET was refused: {e}"),
    }
    look.ping().await.unwrap();
    let v = look.get("/big").await.unwrap();
    assert!(
        v.len() == len && v.iter().all(|&b| b == 9),
        "the value changed"
    );
    fresh_client_is_served(&addr, &[], true).await;
    drop(held);
    srv.shutdown().await;
}
