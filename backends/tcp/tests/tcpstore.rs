//! TCPStore tests over real loopback sockets: the torch transcript byte for
//! byte (our server against torch's client bytes, our client against torch's
//! server bytes), store semantics, limits, and many clients at once.

use std::{sync::Arc, time::Duration};

use consort_comm::store::{MAX_KEY_LEN, MAX_VALUE_LEN, Store, StoreError};
use consort_tcp::{TcpStore, TcpStoreOptions, TcpStoreServer};
use serde_json::Value;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

const TRANSCRIPT: &str = include_str!("fixtures/tcpstore_transcript.json");

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("fixture hex"))
        .collect()
}

/// One recorded chunk of connection 0: who sent it and its bytes.
fn chunks() -> Vec<(bool, Vec<u8>)> {
    let t: Value = serde_json::from_str(TRANSCRIPT).unwrap();
    t["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["dir"] != "mark")
        .map(|c| {
            assert_eq!(c["conn"], 0, "the fixture uses one connection");
            (c["dir"] == "c2s", hex(c["hex"].as_str().unwrap()))
        })
        .collect()
}

fn opts(timeout: Duration) -> TcpStoreOptions {
    TcpStoreOptions {
        timeout,
        connect_timeout: Duration::from_secs(10),
        secret: None,
    }
}

#[tokio::test]
async fn our_server_answers_torch_client_bytes_exactly() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    for (i, (c2s, bytes)) in chunks().into_iter().enumerate() {
        if c2s {
            s.write_all(&bytes).await.unwrap();
        } else {
            let mut got = vec![0u8; bytes.len()];
            tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
                .await
                .unwrap_or_else(|_| panic!("chunk {i}: server sent nothing"))
                .unwrap();
            assert_eq!(got, bytes, "chunk {i}: server reply differs from torch's");
        }
    }
    // Nothing more than torch's server sent.
    let mut extra = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_millis(100), s.read(&mut extra)).await;
    assert!(r.is_err(), "server sent bytes torch's server did not");
    server.shutdown().await;
}

/// Parses the Python reprs the fixture uses for lists: `['a', 'b']` and
/// `[b'v1', b'v2']`.
fn py_list(s: &str) -> Vec<Vec<u8>> {
    s.trim_matches(|c| c == '[' || c == ']')
        .split(", ")
        .map(|item| {
            item.trim_start_matches('b')
                .trim_matches('\'')
                .as_bytes()
                .to_vec()
        })
        .collect()
}

/// Drives our client through the fixture's script against a scripted peer
/// that checks every byte our client sends and replies with torch's
/// server's bytes.
#[tokio::test]
async fn our_client_sends_torch_client_bytes_exactly() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let peer = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        for (i, (c2s, bytes)) in chunks().into_iter().enumerate() {
            if c2s {
                let mut got = vec![0u8; bytes.len()];
                s.read_exact(&mut got).await.unwrap();
                if i == 0 {
                    // VALIDATE + PING: the nonce is the client's pid.
                    assert_eq!(got[..6], bytes[..6], "handshake differs");
                    let nonce = got[6..].to_vec();
                    assert_eq!(nonce, std::process::id().to_le_bytes());
                    continue;
                }
                assert_eq!(
                    got, bytes,
                    "chunk {i}: our client's request differs from torch's"
                );
            } else if i == 1 {
                let pid = std::process::id().to_le_bytes();
                s.write_all(&pid).await.unwrap();
            } else {
                s.write_all(&bytes).await.unwrap();
            }
        }
    });

    let store = TcpStore::connect(addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    let t: Value = serde_json::from_str(TRANSCRIPT).unwrap();
    for step in t["script"].as_array().unwrap() {
        let call = step["call"].as_str().unwrap();
        let a = step["args"].as_array().unwrap();
        let s = |i: usize| a[i].as_str().unwrap();
        let want = &step["result"];
        match call {
            "set" => store.set(s(0), &hex(s(1))).await.unwrap(),
            "get" => assert_eq!(store.get(s(0)).await.unwrap(), hex(want.as_str().unwrap())),
            "add" => assert_eq!(
                store.add(s(0), a[1].as_i64().unwrap()).await.unwrap(),
                want.as_i64().unwrap()
            ),
            "compare_set" => assert_eq!(
                store
                    .compare_set(s(0), &hex(s(1)), &hex(s(2)))
                    .await
                    .unwrap(),
                hex(want.as_str().unwrap())
            ),
            "check" | "wait" | "multi_get" => {
                let keys: Vec<String> = py_list(s(0))
                    .into_iter()
                    .map(|k| String::from_utf8(k).unwrap())
                    .collect();
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                match call {
                    "check" => {
                        assert_eq!(store.check(&keys).await.unwrap(), want.as_bool().unwrap())
                    }
                    "wait" => store.wait(&keys, Duration::from_secs(5)).await.unwrap(),
                    _ => {
                        let got = store.multi_get(&keys).await.unwrap();
                        let want: Vec<Vec<u8>> = want
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|v| hex(v.as_str().unwrap()))
                            .collect();
                        assert_eq!(got, want);
                    }
                }
            }
            "num_keys" => assert_eq!(store.num_keys().await.unwrap(), want.as_i64().unwrap()),
            "delete_key" => assert_eq!(
                store.delete_key(s(0)).await.unwrap(),
                want.as_bool().unwrap()
            ),
            "multi_set" => {
                let keys: Vec<String> = py_list(s(0))
                    .into_iter()
                    .map(|k| String::from_utf8(k).unwrap())
                    .collect();
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                let values = py_list(s(1));
                let values: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
                store.multi_set(&keys, &values).await.unwrap();
            }
            "append" => store.append(s(0), &hex(s(1))).await.unwrap(),
            other => panic!("fixture call {other} not handled"),
        }
    }
    peer.await.unwrap();
}

async fn pair() -> (TcpStoreServer, TcpStore) {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStore::connect(
        server.local_addr().to_string(),
        opts(Duration::from_secs(5)),
    )
    .await
    .unwrap();
    (server, client)
}

#[tokio::test]
async fn semantics_over_the_wire() {
    let (server, c) = pair().await;
    assert_eq!(c.compare_set("cs", b"", b"first").await.unwrap(), b"first");
    assert_eq!(c.compare_set("cs", b"wrong", b"x").await.unwrap(), b"first");
    assert_eq!(
        c.compare_set("cs", b"first", b"second").await.unwrap(),
        b"second"
    );
    assert_eq!(
        c.compare_set("absent", b"exp", b"des").await.unwrap(),
        b"exp"
    );
    assert!(!c.check(&["absent"]).await.unwrap());
    assert_eq!(c.add("n", 10).await.unwrap(), 10);
    assert_eq!(c.add("n", -3).await.unwrap(), 7);
    assert_eq!(c.get("n").await.unwrap(), b"7");
    c.append("log", b"a").await.unwrap();
    c.append("log", b"b").await.unwrap();
    assert_eq!(c.get("log").await.unwrap(), b"ab");
    assert_eq!(c.num_keys().await.unwrap(), 3);
    server.shutdown().await;
}

#[tokio::test]
async fn wait_times_out_cleanly_and_the_connection_stays_usable() {
    let (server, c) = pair().await;
    let t0 = std::time::Instant::now();
    let e = c
        .wait(&["never"], Duration::from_millis(150))
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e}");
    assert!(t0.elapsed() >= Duration::from_millis(150));
    assert!(e.to_string().contains("\"never\""), "{e}");
    // CANCEL_WAIT left the connection in sync:
    c.set("k", b"v").await.unwrap();
    assert_eq!(c.get("k").await.unwrap(), b"v");
    server.shutdown().await;
}

#[tokio::test]
async fn wait_is_woken_by_another_client() {
    let (server, c) = pair().await;
    let other = TcpStore::connect(
        server.local_addr().to_string(),
        opts(Duration::from_secs(5)),
    )
    .await
    .unwrap();
    let waiter = tokio::spawn(async move {
        c.wait(&["a", "b"], Duration::from_secs(10)).await?;
        c.multi_get(&["a", "b"]).await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    other.set("a", b"1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!waiter.is_finished(), "woke with one of two keys");
    other.set("b", b"2").await.unwrap();
    let got = waiter.await.unwrap().unwrap();
    assert_eq!(got, vec![b"1".to_vec(), b"2".to_vec()]);
    server.shutdown().await;
}

#[tokio::test]
async fn add_on_a_non_number_is_an_error_not_a_crash() {
    let (server, c) = pair().await;
    c.set("word", b"hello").await.unwrap();
    let e = c.add("word", 1).await.unwrap_err();
    assert!(matches!(e, StoreError::Closed { .. }), "{e}");
    assert!(e.to_string().contains("not a decimal integer"), "{e}");
    // The error is sticky on that client; the server keeps serving others.
    assert!(c.set("x", b"y").await.is_err());
    let c2 = TcpStore::connect(
        server.local_addr().to_string(),
        opts(Duration::from_secs(5)),
    )
    .await
    .unwrap();
    assert_eq!(c2.get("word").await.unwrap(), b"hello");
    server.shutdown().await;
}

#[tokio::test]
async fn limits_are_refused_client_side_with_a_clear_error() {
    let (server, c) = pair().await;
    let e = c.set(&"k".repeat(MAX_KEY_LEN), b"v").await.unwrap_err();
    assert!(
        e.to_string()
            .contains("key length of 8193 is over the limit of 8192"),
        "{e}"
    );
    let big = vec![7u8; MAX_VALUE_LEN + 1];
    assert!(matches!(
        c.set("big", &big).await,
        Err(StoreError::TooLarge { .. })
    ));
    // The largest legal value goes through.
    c.set("big", &big[..MAX_VALUE_LEN]).await.unwrap();
    assert_eq!(c.get("big").await.unwrap().len(), MAX_VALUE_LEN);
    server.shutdown().await;
}

#[tokio::test]
async fn server_closes_connections_that_break_the_limits_or_the_handshake() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    // No VALIDATE first.
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    s.write_all(&[7]).await.unwrap();
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).await.unwrap(), 0, "server should close");
    // A key longer than 8 KiB.
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    let mut req = vec![0u8];
    req.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
    req.push(1);
    req.extend_from_slice(&(1u64 << 40).to_le_bytes());
    s.write_all(&req).await.unwrap();
    assert_eq!(s.read(&mut b).await.unwrap(), 0, "server should close");
    server.shutdown().await;
}

#[tokio::test]
async fn unreachable_master_is_a_clear_error() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let e = TcpStore::connect(
        addr,
        TcpStoreOptions {
            timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_millis(300),
            secret: None,
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(e, StoreError::Connect { .. }), "{e}");
    assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
}

/// A MASTER_ADDR that does not resolve is said at once and fails after a
/// short grace, not after the whole store timeout (it used to retry for
/// 300 s with the DNS error at debug level only).
#[tokio::test]
async fn an_unresolvable_master_fails_soon_naming_the_lookup() {
    let start = std::time::Instant::now();
    let e = tokio::time::timeout(
        Duration::from_secs(60),
        TcpStore::connect(
            "no-such-host.invalid:29500",
            TcpStoreOptions {
                timeout: Duration::from_secs(300),
                connect_timeout: Duration::from_secs(300),
                secret: None,
            },
        ),
    )
    .await
    .expect("still retrying after 60 s")
    .unwrap_err();
    assert!(e.to_string().contains("does not resolve"), "{e}");
    assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(60));
}

/// torch 2.15's LIST_KEYS (17) and BARRIER (18) through our client and
/// server: the map's keys without queues; a barrier of two released when
/// the second arrives, one that times out cancelled cleanly, its counter
/// left as torch leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_keys_and_barrier_as_torch() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let addr = server.local_addr().to_string();
    let a = TcpStore::connect(&addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    let b = TcpStore::connect(&addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    a.set("x", b"1").await.unwrap();
    a.set("y", b"2").await.unwrap();
    a.queue_push("q", b"3").await.unwrap();
    // SET has no reply: a round trip makes sure the keys are stored.
    assert!(a.check(&["x", "y", "q"]).await.unwrap());
    let mut keys = b.list_keys().await.unwrap();
    keys.sort();
    assert_eq!(keys, ["x", "y"]);
    let e = a
        .barrier("lonely", 2, Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e}");
    // The connection is still usable after the cancel.
    assert_eq!(a.get("lonely").await.unwrap(), b"1");
    let (ra, rb) = tokio::join!(a.barrier("both", 2, Duration::from_secs(5)), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        b.barrier("both", 2, Duration::from_secs(5)).await
    });
    ra.unwrap();
    rb.unwrap();
    assert_eq!(a.get("both").await.unwrap(), b"2");
    // A barrier whose count is already past its size returns at once.
    b.barrier("both", 2, Duration::from_secs(5)).await.unwrap();
    server.shutdown().await;
}

#[tokio::test]
async fn port_in_use_is_a_clear_error() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let e = TcpStoreServer::bind(server.local_addr()).await.unwrap_err();
    assert!(matches!(e, StoreError::Bind { .. }), "{e}");
    assert!(e.to_string().contains("MASTER_PORT"), "{e}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_serves_a_thousand_concurrent_clients() {
    const N: usize = 1000;
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let addr = server.local_addr().to_string();
    let mut tasks = Vec::with_capacity(N);
    for i in 0..N {
        let addr = addr.clone();
        tasks.push(tokio::spawn(async move {
            let c = TcpStore::connect(addr, opts(Duration::from_secs(60))).await?;
            c.set(&format!("rank/{i}"), i.to_string().as_bytes())
                .await?;
            c.add("arrived", 1).await?;
            // Everyone holds its connection open and waits for everyone.
            let keys: Vec<String> = (0..N).map(|j| format!("rank/{j}")).collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            c.wait(&keys, Duration::from_secs(60)).await?;
            Ok::<_, StoreError>(c)
        }));
    }
    let mut clients = Vec::with_capacity(N);
    for t in tasks {
        clients.push(t.await.unwrap().unwrap());
    }
    let c = Arc::new(clients.pop().unwrap());
    assert_eq!(c.get("arrived").await.unwrap(), N.to_string().as_bytes());
    assert_eq!(c.num_keys().await.unwrap(), N as i64 + 1);
    drop(clients);
    server.shutdown().await;
}

/// One client cannot fill the server's memory: a write past the limit
/// (what is held, plus the request being read, plus the replies not yet
/// sent) drops that client (the protocol has no error reply), whose next
/// request fails naming the limit; what was freed (deleted keys, popped queue
/// items) can be written again, and other clients go on. (Replies count
/// too: a get of a value as large as what is held would pass the limit, so
/// this test reads with `check`.)
#[tokio::test]
async fn a_write_past_the_memory_limit_is_refused_and_names_it() {
    let limit = 1 << 20;
    let server = TcpStoreServer::bind_opts(
        "127.0.0.1:0",
        consort_tcp::ServerOptions {
            max_bytes: limit,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let addr = server.local_addr().to_string();
    let a = TcpStore::connect(&addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    // Reading a value costs up to twice its size while its buffer grows.
    let big = vec![7u8; 280 << 10];
    a.set("first", &big).await.unwrap();
    // Overwriting a key replaces its bytes: within the limit.
    a.set("first", &big).await.unwrap();
    a.set("second", &big).await.unwrap();
    assert!(a.check(&["first", "second"]).await.unwrap());
    a.set("third", &big).await.unwrap(); // refused: the client is dropped
    let e = a.get("first").await.unwrap_err();
    assert!(
        matches!(e, StoreError::Closed { .. }) && e.to_string().contains("CONSORT_STORE_MAX_BYTES"),
        "{e}"
    );
    // Another client: the first value is there, the second is not; after
    // a delete there is room again.
    let b = TcpStore::connect(&addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(b.check(&["first", "second"]).await.unwrap());
    assert!(!b.check(&["third"]).await.unwrap());
    assert!(b.delete_key("first").await.unwrap());
    b.set("third", &big).await.unwrap();
    assert!(b.check(&["third"]).await.unwrap());
    // A multi_set past the limit stores none of its keys.
    b.multi_set(&["m1", "m2"], &[&big[..100], &big])
        .await
        .unwrap();
    let e = b.check(&["m1"]).await.unwrap_err();
    assert!(matches!(e, StoreError::Closed { .. }), "{e}");
    let c = TcpStore::connect(&addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(
        !c.check(&["m1"]).await.unwrap(),
        "half of a refused multi_set"
    );
    server.shutdown().await;
}

/// torch's queue ops through our client and server: FIFO order, the
/// length, an empty non-blocking pop, a blocking pop woken by another
/// client's push, and a non-empty queue counting as an existing key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_push_pop_and_wake_one_waiter() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let addr = server.local_addr().to_string();
    let a = TcpStore::connect(&addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    let b = TcpStore::connect(&addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!(a.queue_len("q").await.unwrap(), 0);
    let e = a.queue_pop("q", false).await.unwrap_err();
    assert!(matches!(e, StoreError::QueueEmpty { .. }), "{e}");
    assert!(!a.check(&["q"]).await.unwrap());
    a.queue_push("q", b"one").await.unwrap();
    a.queue_push("q", b"two").await.unwrap();
    // A push has no reply (as in torch): a round trip on the same
    // connection orders it before other clients' requests.
    assert_eq!(a.queue_len("q").await.unwrap(), 2);
    assert_eq!(b.queue_len("q").await.unwrap(), 2);
    assert!(b.check(&["q"]).await.unwrap(), "a non-empty queue exists");
    assert_eq!(b.queue_pop("q", false).await.unwrap(), b"one");
    assert_eq!(b.queue_pop("q", true).await.unwrap(), b"two");
    let waiter = tokio::spawn(async move { b.queue_pop("q", true).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "the pop waits for an element");
    a.queue_push("q", b"three").await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), b"three");
    // A blocking pop on an empty queue times out with the store's timeout.
    let c = TcpStore::connect(&addr, opts(Duration::from_millis(200)))
        .await
        .unwrap();
    let e = c.queue_pop("empty", true).await.unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e}");
    server.shutdown().await;
}

/// A request dropped part-way (by a `select!` or a timeout around it) never
/// hands its reply to the next request: for every number of polls before
/// the drop, a dropped `get` of an empty value (whose reply begins with the
/// byte that means "ready" to CHECK) is followed by a `check` of a missing
/// key, which must say missing, and by requests that get their own replies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_part_way_retires_its_connection() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let addr = server.local_addr().to_string();
    let c = TcpStore::connect(&addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    c.set("empty", b"").await.unwrap();
    c.set("full", b"value").await.unwrap();
    for polls in 0..8 {
        {
            let mut get = Box::pin(c.get("empty"));
            let mut multi = Box::pin(c.multi_get(&["empty", "full"]));
            // One poll at a time, stopping at completion.
            for _ in 0..polls {
                if tokio::time::timeout(Duration::ZERO, get.as_mut())
                    .await
                    .is_ok()
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            drop(get);
            for _ in 0..polls {
                if tokio::time::timeout(Duration::ZERO, multi.as_mut())
                    .await
                    .is_ok()
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        assert!(
            !c.check(&["missing"]).await.unwrap(),
            "after a get dropped at poll {polls}, check read the dropped reply"
        );
        assert_eq!(c.get("full").await.unwrap(), b"value", "poll {polls}");
        assert_eq!(c.add("n", 1).await.unwrap(), polls as i64 + 1);
    }
    server.shutdown().await;
}

/// The same against a server that answers late, so that the drop falls
/// between the request and its reply every time: the client's first
/// `check` is cut off by a timeout around it, its READY arrives afterwards
/// on that connection, and the next `check` (answered NOT_READY) must not
/// read it. The old client reported the missing key as present here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_reply_to_a_dropped_request_is_never_read_as_the_next() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let late = std::mem::replace(&mut first, false);
            tokio::spawn(async move {
                // VALIDATE (1 + 4 bytes), then PING (1 + 4): echo the nonce.
                let mut hello = [0u8; 10];
                s.read_exact(&mut hello).await.unwrap();
                s.write_all(&hello[6..10]).await.unwrap();
                // CHECK of one two-byte key: 1 + 8 + 8 + 2 bytes each.
                let mut req = [0u8; 19];
                let mut n = 0;
                while s.read_exact(&mut req).await.is_ok() {
                    if late && n == 0 {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        s.write_all(&[0]).await.unwrap(); // READY, too late
                    } else {
                        s.write_all(&[1]).await.unwrap(); // NOT_READY
                    }
                    n += 1;
                }
            });
        }
    });
    let c = TcpStore::connect(&addr, opts(Duration::from_secs(5)))
        .await
        .unwrap();
    let cut = tokio::time::timeout(Duration::from_millis(50), c.check(&["a"])).await;
    assert!(cut.is_err(), "the first check was not cut off");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !c.check(&["b"]).await.unwrap(),
        "the next check read the dropped request's late reply"
    );
}

/// A raw connection that has sent VALIDATE.
async fn validated(addr: std::net::SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut hello = vec![0u8];
    hello.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
    s.write_all(&hello).await.unwrap();
    s
}

/// A request: the command byte, then each argument as a string.
fn raw_req(command: u8, args: &[&[u8]]) -> Vec<u8> {
    let mut b = vec![command];
    for a in args {
        b.extend_from_slice(&(a.len() as u64).to_le_bytes());
        b.extend_from_slice(a);
    }
    b
}

/// BARRIER: the key, then the world size as an i64.
fn raw_barrier(key: &[u8], world: i64) -> Vec<u8> {
    let mut b = raw_req(18, &[key]);
    b.extend_from_slice(&world.to_le_bytes());
    b
}

/// Exactly `n` bytes within `within`; `None` if they did not all come.
async fn raw_reply(s: &mut TcpStream, n: usize, within: Duration) -> Option<Vec<u8>> {
    let mut b = vec![0u8; n];
    match tokio::time::timeout(within, s.read_exact(&mut b)).await {
        Ok(Ok(_)) => Some(b),
        _ => None,
    }
}

/// Nothing more arrives within 200 ms.
async fn raw_quiet(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    tokio::time::timeout(Duration::from_millis(200), s.read(&mut b))
        .await
        .is_err()
}

async fn raw_get(s: &mut TcpStream, key: &[u8]) -> Vec<u8> {
    s.write_all(&raw_req(3, &[key])).await.unwrap();
    let n = raw_reply(s, 8, Duration::from_secs(5)).await.unwrap();
    let n = u64::from_le_bytes(n.try_into().unwrap()) as usize;
    raw_reply(s, n, Duration::from_secs(5)).await.unwrap()
}

/// torch 2.15's LIST_KEYS (17) and BARRIER (18) in raw bytes, answered as
/// torch's own libuv server answers them (each exchange here was checked
/// against it). LIST_KEYS: a u64 count, then the map's keys as stored
/// (with their `/`, or without one when the client sent none), never a
/// queue's; torch's order is its hash map's, so they compare as a set.
/// BARRIER: adds one to the decimal counter under its key and answers 0
/// once the count reaches the world size; cancelled, it answers 1 alone,
/// and its arrival still counts (a retry on the same connection counts
/// again and, at world 2, releases itself); a world size of 0 or less
/// answers at once; a counter that is not a number closes the connection;
/// CANCEL_WAIT with nothing to cancel answers 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_keys_and_barrier_bytes_as_torchs_server_sends_them() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let addr = server.local_addr();
    let within = Duration::from_secs(5);
    let mut a = validated(addr).await;
    let mut b = validated(addr).await;
    a.write_all(&raw_req(1, &[b"/a", b"1"])).await.unwrap();
    a.write_all(&raw_req(14, &[b"/q", b"x"])).await.unwrap();
    a.write_all(&raw_req(1, &[b"b-noslash", b""]))
        .await
        .unwrap();
    a.write_all(&[17]).await.unwrap();
    let count = raw_reply(&mut a, 8, within).await.unwrap();
    assert_eq!(count, 2u64.to_le_bytes(), "LIST_KEYS count");
    let mut keys = Vec::new();
    for _ in 0..2 {
        let n = raw_reply(&mut a, 8, within).await.unwrap();
        let n = u64::from_le_bytes(n.try_into().unwrap()) as usize;
        keys.push(raw_reply(&mut a, n, within).await.unwrap());
    }
    keys.sort();
    assert_eq!(keys, [b"/a".to_vec(), b"b-noslash".to_vec()]);
    assert!(raw_quiet(&mut a).await, "LIST_KEYS sent more than its keys");

    a.write_all(&raw_barrier(b"/bar1", 1)).await.unwrap();
    assert_eq!(raw_reply(&mut a, 1, within).await.unwrap(), [0]);
    assert_eq!(raw_get(&mut a, b"/bar1").await, b"1");

    // Alone at world 2: no answer; cancelled: 1 alone; the arrival counts.
    a.write_all(&raw_barrier(b"/bar2", 2)).await.unwrap();
    assert!(raw_quiet(&mut a).await, "a barrier of two released one");
    a.write_all(&[12]).await.unwrap();
    assert_eq!(raw_reply(&mut a, 1, within).await.unwrap(), [1]);
    assert!(raw_quiet(&mut a).await, "CANCEL_WAIT answered more than 1");
    assert_eq!(raw_get(&mut a, b"/bar2").await, b"1");
    a.write_all(&raw_barrier(b"/bar2", 2)).await.unwrap();
    assert_eq!(raw_reply(&mut a, 1, within).await.unwrap(), [0]);
    assert_eq!(raw_get(&mut a, b"/bar2").await, b"2");

    // Two connections: the second arrival releases both.
    a.write_all(&raw_barrier(b"/bar3", 2)).await.unwrap();
    assert!(raw_quiet(&mut a).await);
    b.write_all(&raw_barrier(b"/bar3", 2)).await.unwrap();
    assert_eq!(raw_reply(&mut b, 1, within).await.unwrap(), [0]);
    assert_eq!(raw_reply(&mut a, 1, within).await.unwrap(), [0]);
    assert_eq!(raw_get(&mut a, b"/bar3").await, b"2");

    for (key, world) in [(&b"/bar4"[..], 0), (b"/bar5", -1)] {
        a.write_all(&raw_barrier(key, world)).await.unwrap();
        assert_eq!(
            raw_reply(&mut a, 1, within).await.unwrap(),
            [0],
            "world {world}"
        );
    }
    a.write_all(&[12]).await.unwrap();
    assert_eq!(raw_reply(&mut a, 1, within).await.unwrap(), [1]);

    a.write_all(&raw_req(1, &[b"/word", b"hi"])).await.unwrap();
    // SET has no reply: a round trip on `a` (served in order) makes sure
    // it is in before another connection's barrier reads the counter.
    assert_eq!(raw_get(&mut a, b"/word").await, b"hi");
    let mut c = validated(addr).await;
    c.write_all(&raw_barrier(b"/word", 2)).await.unwrap();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(within, c.read_to_end(&mut rest)).await;
    assert!(
        matches!(closed, Ok(Ok(0))),
        "a barrier on a counter that is not a number: {closed:?}"
    );
    server.shutdown().await;
}

/// A WAIT that names the same key twice (torch's `wait(["a", "a"])` sends
/// both) is answered 0 once the key is set, as torch's server answers it;
/// and at once when the key already exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_naming_a_key_twice_is_woken_when_it_is_set() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let addr = server.local_addr();
    let mut waiter = validated(addr).await;
    let mut wait = vec![6u8];
    wait.extend_from_slice(&2u64.to_le_bytes());
    for _ in 0..2 {
        wait.extend_from_slice(&3u64.to_le_bytes());
        wait.extend_from_slice(b"/w1");
    }
    waiter.write_all(&wait).await.unwrap();
    assert!(raw_quiet(&mut waiter).await, "woken before the key was set");
    let mut setter = validated(addr).await;
    setter
        .write_all(&raw_req(1, &[b"/w1", b"1"]))
        .await
        .unwrap();
    assert_eq!(
        raw_reply(&mut waiter, 1, Duration::from_secs(5)).await,
        Some(vec![0]),
        "a WAIT naming /w1 twice was not woken when /w1 was set"
    );
    waiter.write_all(&wait).await.unwrap();
    assert_eq!(
        raw_reply(&mut waiter, 1, Duration::from_secs(5)).await,
        Some(vec![0])
    );
    server.shutdown().await;
}
