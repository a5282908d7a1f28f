//! The store against attacks that lock innocent clients out or lose data
//! (issue 49; the memory bound itself is `store_memory.rs`). Each attack
//! runs over real sockets against a real server; afterwards (or while it
//! goes on) a fresh client connects (VALIDATE and torch's connect-time
//! PING), reads what was set before the attack unchanged, and writes. The
//! deadlines here are generous hang detection for a loaded CI machine;
//! the 1 s figure is measured by `scripts/store-attacks`.

use std::time::{Duration, Instant};

use consort_comm::store::Store;
use consort_tcp::{
    Secret, ServerOptions, TcpStore, TcpStoreOptions, TcpStoreServer, store::VALIDATION_MAGIC,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const SET: u8 = 1;
const WAIT: u8 = 6;
const MULTI_SET: u8 = 11;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
const QUEUE_PUSH: u8 = 14;

fn put(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
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

/// A raw connection that has sent VALIDATE (and, with `ping`, torch's
/// connect-time PING, answered).
async fn raw(addr: &str, ping: bool) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut hello = vec![0u8];
    hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
    s.write_all(&hello).await.unwrap();
    if ping {
        assert!(
            pinged(&mut s).await,
            "a fresh connection's PING went unanswered"
        );
    }
    s
}

async fn pinged(s: &mut TcpStream) -> bool {
    let mut req = vec![PING];
    req.extend_from_slice(&7u32.to_le_bytes());
    if s.write_all(&req).await.is_err() {
        return false;
    }
    let mut back = [0u8; 4];
    let r = tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back)).await;
    matches!(r, Ok(Ok(_))) && back == 7u32.to_le_bytes()
}

/// A fresh client, as torch's: connects, reads `key` (set before the
/// attack) unchanged, writes a key and reads it back, all within `within`.
async fn fresh_client_is_served(addr: &str, key: &str, want: &[u8], within: Duration) {
    let start = Instant::now();
    let served = tokio::time::timeout(within, async {
        let mut s = raw(addr, true).await;
        assert!(pinged(&mut s).await);
        let c = client(addr).await;
        assert_eq!(c.get(key).await.unwrap(), want, "data set before changed");
        c.set("fresh", b"ok").await.unwrap();
        assert_eq!(c.get("fresh").await.unwrap(), b"ok");
    })
    .await;
    assert!(
        served.is_ok(),
        "a fresh client was not served within {within:?}"
    );
    eprintln!("fresh client served in {:?}", start.elapsed());
}

/// Fills the store to within a few bytes of its limit, in steps of
/// decreasing size, each step on a connection the server closes when it no
/// longer fits; `cmd` is SET or QUEUE_PUSH.
async fn fill_to_the_brim(addr: &str, cmd: u8) {
    for (size, n) in [(1usize << 20, 64usize), (4096, 4096), (0, 200_000)] {
        let mut hog = raw(addr, false).await;
        let mut fill = Vec::new();
        for i in 0..n {
            fill.push(cmd);
            let key = if cmd == SET {
                format!("/fill-{size}-{i}")
            } else {
                format!("/fill-{}", i % 2)
            };
            put(&mut fill, key.as_bytes());
            put(&mut fill, &vec![1u8; size]);
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), hog.write_all(&fill)).await;
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), hog.read_to_end(&mut rest)).await;
    }
}

/// One client fills the store to its limit and leaves: the store goes on
/// answering PINGs and GETs (torch's client could not even connect), a
/// delete makes room, and writes work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_fills_the_store_and_leaves_locks_nobody_out() {
    let (srv, addr) = server(limited(16 << 20)).await;
    let before = client(&addr).await;
    before.set("before", b"precious").await.unwrap();
    assert!(before.check(&["before"]).await.unwrap());
    fill_to_the_brim(&addr, SET).await;
    let mut s = raw(&addr, true).await;
    assert!(pinged(&mut s).await);
    let c = client(&addr).await;
    assert!(
        c.check(&["fill-1048576-0"]).await.unwrap(),
        "the fill did not happen"
    );
    assert_eq!(c.get("before").await.unwrap(), b"precious");
    for i in 0..8 {
        c.delete_key(&format!("fill-1048576-{i}")).await.unwrap();
    }
    fresh_client_is_served(&addr, "before", b"precious", Duration::from_secs(5)).await;
    srv.shutdown().await;
}

/// A crowd of half-written requests (SET headers announcing 64 KiB, a
/// MULTI_SET of 131,071 empty pairs stopped part-way) stays connected; a
/// fresh client is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_half_written_requests_locks_nobody_out() {
    let (srv, addr) = server(limited(16 << 20)).await;
    let before = client(&addr).await;
    before.set("before", b"precious").await.unwrap();
    assert!(before.check(&["before"]).await.unwrap());
    let mut crowd = Vec::new();
    for i in 0..300 {
        let mut s = raw(&addr, false).await;
        let mut req = vec![SET];
        put(&mut req, format!("/h{i}").as_bytes());
        let announced: u64 = if i % 2 == 0 { 64 << 10 } else { 8 << 20 };
        req.extend_from_slice(&announced.to_le_bytes());
        s.write_all(&req).await.unwrap();
        crowd.push(s);
    }
    for _ in 0..20 {
        let mut s = raw(&addr, false).await;
        let mut req = vec![MULTI_SET];
        req.extend_from_slice(&131_071u64.to_le_bytes());
        for _ in 0..100_000 {
            put(&mut req, b"");
            put(&mut req, b"");
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), s.write_all(&req)).await;
        crowd.push(s);
    }
    fresh_client_is_served(&addr, "before", b"precious", Duration::from_secs(5)).await;
    drop(crowd);
    srv.shutdown().await;
}

/// Idle floods at the connection cap: connections that never VALIDATE,
/// then connections that VALIDATE and send nothing. Each fresh client
/// takes the place of one of them at once, and a client at work before
/// the flood keeps its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_floods_at_the_cap_lock_nobody_out() {
    let cap = 32;
    let (srv, addr) = server(ServerOptions {
        max_clients: cap,
        ..Default::default()
    })
    .await;
    let known = client(&addr).await;
    known.set("before", b"precious").await.unwrap();
    for validated in [false, true] {
        let mut flood = Vec::new();
        for _ in 0..cap * 2 {
            let s = if validated {
                raw(&addr, false).await
            } else {
                TcpStream::connect(&addr).await.unwrap()
            };
            flood.push(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        fresh_client_is_served(&addr, "before", b"precious", Duration::from_secs(3)).await;
        assert_eq!(known.get("before").await.unwrap(), b"precious");
    }
    srv.shutdown().await;
}

/// On a store with a secret, a flood of connections that never answer the
/// challenge: the real client gets through every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_flood_never_keeps_the_secret_holder_out() {
    let secret = Secret::new(b"a secret long enough to pass the checks".to_vec()).unwrap();
    let cap = 16;
    let (srv, addr) = server(ServerOptions {
        max_clients: cap,
        secret: Some(secret.clone()),
        ..Default::default()
    })
    .await;
    let mut through = 0;
    for _ in 0..25 {
        let mut flood = Vec::new();
        for _ in 0..cap {
            flood.push(TcpStream::connect(&addr).await.unwrap());
        }
        let c = tokio::time::timeout(
            Duration::from_secs(5),
            TcpStore::connect(&addr, client_opts(Some(secret.clone()))),
        )
        .await;
        if let Ok(Ok(c)) = c
            && c.set("k", b"v").await.is_ok()
            && c.get("k").await.is_ok()
        {
            through += 1;
        }
    }
    assert_eq!(
        through, 25,
        "the real client got through {through} times in 25"
    );
    srv.shutdown().await;
}

/// QUEUE_POP on a full store: the reply is paid for before the item
/// leaves its queue, and no item is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_pop_on_a_full_store_loses_nothing() {
    let (srv, addr) = server(limited(16 << 20)).await;
    let c = client(&addr).await;
    for v in [b"one", b"two", b"333"] {
        c.queue_push("q", v).await.unwrap();
    }
    fill_to_the_brim(&addr, QUEUE_PUSH).await;
    let fresh = client(&addr).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(fresh.queue_pop("q", false).await.unwrap());
    }
    assert_eq!(got, [b"one".to_vec(), b"two".to_vec(), b"333".to_vec()]);
    srv.shutdown().await;
}

/// 200 clients each wait on 5,000 never-set keys and leave at once; two
/// more loop WAIT and CANCEL_WAIT: a fresh client's gets are served
/// promptly throughout (cancel costs a client's own keys, not everyone's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_storms_delay_nobody() {
    let (srv, addr) = server(ServerOptions::default()).await;
    let c = client(&addr).await;
    c.set("before", b"precious").await.unwrap();
    let wait_req = |tag: usize| {
        let mut req = vec![WAIT];
        req.extend_from_slice(&5000u64.to_le_bytes());
        for i in 0..5000 {
            put(&mut req, format!("/never-{tag}-{i}").as_bytes());
        }
        req
    };
    let mut waiters = Vec::new();
    for t in 0..200 {
        let mut s = raw(&addr, false).await;
        s.write_all(&wait_req(t)).await.unwrap();
        waiters.push(s);
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut loops = Vec::new();
    for t in 0..2 {
        let (addr, stop) = (addr.clone(), stop.clone());
        let req = wait_req(1000 + t);
        loops.push(tokio::spawn(async move {
            let mut s = raw(&addr, false).await;
            let mut buf = [0u8; 1];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                s.write_all(&req).await.unwrap();
                s.write_all(&[CANCEL_WAIT]).await.unwrap();
                s.read_exact(&mut buf).await.unwrap();
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(waiters);
    let mut slowest = Duration::ZERO;
    for _ in 0..50 {
        let t = Instant::now();
        let v = tokio::time::timeout(Duration::from_secs(2), c.get("before")).await;
        assert_eq!(v.expect("a get stalled").unwrap(), b"precious");
        slowest = slowest.max(t.elapsed());
    }
    eprintln!("slowest get during the storm: {slowest:?}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in loops {
        l.await.unwrap();
    }
    srv.shutdown().await;
}
