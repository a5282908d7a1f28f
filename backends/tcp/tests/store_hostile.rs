//! The TCPStore server against hostile and broken clients, spoken to in
//! raw bytes over real sockets: amplification, a request past the limit,
//! a client that never reads, slowloris, a flood of connections, and
//! garbage. Each attack closes the attacking client; the server goes on
//! serving the others, and the memory the attack reserved comes back.
//! (Peak memory under these attacks is measured in the note, not here.)

use std::time::{Duration, Instant};

use consort_comm::store::Store;

use consort_tcp::{
    ServerOptions, TcpStore, TcpStoreOptions, TcpStoreServer, store::VALIDATION_MAGIC,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

// torch's command bytes.
const SET: u8 = 1;
const GET: u8 = 3;
const MULTI_GET: u8 = 10;
const MULTI_SET: u8 = 11;
const PING: u8 = 13;

/// A length-prefixed string. Keys from our client and torch's carry a
/// leading `/` on the wire.
fn bytes(out: &mut Vec<u8>, b: &[u8]) {
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

async fn client(addr: &str) -> TcpStore {
    let o = TcpStoreOptions {
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    TcpStore::connect(addr, o).await.unwrap()
}

/// A raw connection that has sent VALIDATE.
async fn raw(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut hello = vec![0u8];
    hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
    s.write_all(&hello).await.unwrap();
    s
}

/// Reads until the server closes the connection (or `within` passes);
/// returns the bytes read, `None` if it stayed open.
async fn read_to_close(s: &mut TcpStream, within: Duration) -> Option<usize> {
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0;
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(n),
            Ok(Ok(k)) => n += k,
            Err(_) => return None,
        }
    }
}

async fn ping(s: &mut TcpStream) -> bool {
    let mut req = vec![PING];
    req.extend_from_slice(&7u32.to_le_bytes());
    if s.write_all(&req).await.is_err() {
        return false;
    }
    let mut back = [0u8; 4];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back)).await,
        Ok(Ok(_))
    ) && back == 7u32.to_le_bytes()
}

fn limited(max_bytes: usize) -> ServerOptions {
    ServerOptions {
        max_bytes,
        ..Default::default()
    }
}

/// torch's client asked `multi_get` for one 1 MiB key 3,000 times and took
/// a store to 3 GB. Replies share the values they send: the 3 GB reply
/// costs the store a few bytes per name while the client does not read it,
/// and others go on storing up to the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_get_amplification_costs_the_store_no_copies() {
    let (srv, addr) = server(limited(64 << 20)).await;
    let good = client(&addr).await;
    good.set("v", &vec![1u8; 1 << 20]).await.unwrap();
    // SET has no reply: a round trip on the same connection makes sure the
    // value is stored before the other connection asks for it.
    assert!(good.check(&["v"]).await.unwrap());
    let mut bad = raw(&addr).await;
    let mut req = vec![MULTI_GET];
    req.extend_from_slice(&3000u64.to_le_bytes());
    for _ in 0..3000 {
        bytes(&mut req, b"/v");
    }
    bad.write_all(&req).await.unwrap();
    // Its first bytes come: the reply is being written, not refused.
    let mut first = [0u8; 8];
    bad.read_exact(&mut first).await.unwrap();
    assert_eq!(u64::from_le_bytes(first), 1 << 20);
    for i in 0..5 {
        good.set(&format!("big{i}"), &vec![2u8; 8 << 20])
            .await
            .unwrap();
    }
    assert!(good.check(&["big0", "big4"]).await.unwrap());
    assert_eq!(good.get("v").await.unwrap().len(), 1 << 20);
    srv.shutdown().await;
}

/// A MULTI_SET past the limit is refused as it is read, before the rest of
/// it arrives: the sender meets a closed connection part-way through its
/// 64 MiB, and none of its keys is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_set_past_the_limit_is_refused_before_it_is_all_read() {
    let (srv, addr) = server(limited(16 << 20)).await;
    let mut bad = raw(&addr).await;
    let pairs = 64u64;
    let mut head = vec![MULTI_SET];
    head.extend_from_slice(&pairs.to_le_bytes());
    bad.write_all(&head).await.unwrap();
    let value = vec![3u8; 1 << 20];
    let mut sent = 0;
    for i in 0..pairs {
        let mut pair = Vec::new();
        bytes(&mut pair, format!("/k{i}").as_bytes());
        bytes(&mut pair, &value);
        let w = tokio::time::timeout(Duration::from_secs(10), bad.write_all(&pair)).await;
        if !matches!(w, Ok(Ok(()))) {
            break;
        }
        sent += 1;
    }
    assert!(sent < pairs, "all {pairs} MiB were read before the refusal");
    let good = client(&addr).await;
    assert_eq!(good.num_keys().await.unwrap(), 0);
    assert!(!good.check(&["k0"]).await.unwrap());
    srv.shutdown().await;
}

/// A client that sends requests and never reads its replies: they queue
/// against the limit until the client is closed, and their memory comes
/// back (a second client then stores 24 MiB under a 32 MiB limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_closed_at_the_limit_and_its_replies_freed() {
    let (srv, addr) = server(limited(32 << 20)).await;
    let good = client(&addr).await;
    good.set("v", &vec![1u8; 1 << 20]).await.unwrap();
    // SET has no reply: a round trip on the same connection makes sure the
    // value is stored before the other connection asks for it.
    assert!(good.check(&["v"]).await.unwrap());
    let mut bad = raw(&addr).await;
    let mut get = vec![GET];
    bytes(&mut get, b"/v");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut closed = false;
    while Instant::now() < deadline {
        let w = tokio::time::timeout(Duration::from_secs(2), bad.write_all(&get)).await;
        if matches!(w, Ok(Err(_))) {
            closed = true;
            break;
        }
    }
    assert!(closed, "a client that never reads was not closed");
    good.delete_key("v").await.unwrap();
    for i in 0..3 {
        good.set(&format!("big{i}"), &vec![2u8; 8 << 20])
            .await
            .unwrap();
    }
    // SET has no reply: a round trip shows all three were stored.
    assert!(good.check(&["big0", "big1", "big2"]).await.unwrap());
    srv.shutdown().await;
}

/// Slowloris: a connection that never sends VALIDATE, and one that stops
/// half-way through a request, are closed at their deadlines; a validated
/// client may stay idle between requests for as long as it likes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_closed_at_their_deadlines_and_idle_ones_are_not() {
    let (srv, addr) = server(ServerOptions {
        validate_timeout: Duration::from_millis(300),
        request_timeout: Duration::from_millis(300),
        ..Default::default()
    })
    .await;
    let mut silent = TcpStream::connect(&addr).await.unwrap();
    assert!(
        read_to_close(&mut silent, Duration::from_secs(10))
            .await
            .is_some()
    );
    let mut half = raw(&addr).await;
    half.write_all(&[SET, 9, 0, 0]).await.unwrap(); // part of a key length
    assert!(
        read_to_close(&mut half, Duration::from_secs(10))
            .await
            .is_some()
    );
    let mut idle = raw(&addr).await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(ping(&mut idle).await, "an idle validated client was closed");
    srv.shutdown().await;
}

/// A flood of connections: past the cap each new one is closed at once;
/// those already in are served, and room comes back as clients leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_closed_as_they_come() {
    let cap = 16;
    let (srv, addr) = server(ServerOptions {
        max_clients: cap,
        ..Default::default()
    })
    .await;
    let mut first = Vec::new();
    for _ in 0..cap {
        let mut s = raw(&addr).await;
        assert!(ping(&mut s).await);
        first.push(s);
    }
    let mut refused = 0;
    for _ in 0..200 {
        let mut s = raw(&addr).await;
        if read_to_close(&mut s, Duration::from_millis(500))
            .await
            .is_some()
        {
            refused += 1;
        }
    }
    assert_eq!(refused, 200, "connections past the cap were kept");
    for s in &mut first {
        assert!(ping(s).await, "a client within the cap lost its connection");
    }
    first.truncate(cap - 4);
    let mut later = None;
    for _ in 0..50 {
        let mut s = raw(&addr).await;
        if ping(&mut s).await {
            later = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(later.is_some(), "no room came back after clients left");
    srv.shutdown().await;
}

/// Garbage after VALIDATE (an unknown command, an oversized length) closes
/// that client with nothing stored; the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_closes_the_client_and_the_server_goes_on() {
    let (srv, addr) = server(ServerOptions::default()).await;
    for junk in [
        vec![200u8, 1, 2, 3],
        vec![SET, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        vec![MULTI_GET, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0],
    ] {
        let mut s = raw(&addr).await;
        s.write_all(&junk).await.unwrap();
        assert!(
            read_to_close(&mut s, Duration::from_secs(10))
                .await
                .is_some()
        );
    }
    let mut plain = TcpStream::connect(&addr).await.unwrap();
    plain.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert!(
        read_to_close(&mut plain, Duration::from_secs(10))
            .await
            .is_some()
    );
    let good = client(&addr).await;
    good.set("ok", b"1").await.unwrap();
    assert_eq!(good.num_keys().await.unwrap(), 1);
    srv.shutdown().await;
}
