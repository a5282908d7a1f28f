//! CONSORT_SECRET and addressing over real sockets: the store and the data
//! mesh refuse peers that do not know the secret, and the mesh runs on IPv6.

use std::{sync::Arc, time::Duration};

use consort_comm::{
    ProcessGroup, ReduceOp,
    store::{MemStore, Store, StoreError},
};
use consort_tcp::{Secret, TcpOptions, TcpStore, TcpStoreOptions, TcpStoreServer};
use tokio::{io::AsyncWriteExt, net::TcpStream};

/// The address rank `rank` listens on: the second line of the card it
/// publishes under `<namespace>/card/<rank>` (waits for it).
async fn address(store: &dyn Store, namespace: &str, rank: usize) -> String {
    let card = store
        .get(&format!("{namespace}/card/{rank}"))
        .await
        .unwrap();
    let card = String::from_utf8(card).unwrap();
    card.lines().nth(1).expect("an address line").to_string()
}

fn client_opts(secret: Option<&str>) -> TcpStoreOptions {
    TcpStoreOptions {
        timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        secret: secret.and_then(|s| Secret::new(s.as_bytes().to_vec())),
    }
}

#[tokio::test]
async fn the_store_serves_only_clients_with_the_secret() {
    let server = TcpStoreServer::bind_with("127.0.0.1:0", Secret::new(b"s3cret".to_vec()))
        .await
        .unwrap();
    let addr = server.local_addr().to_string();

    let good = TcpStore::connect(addr.clone(), client_opts(Some("s3cret")))
        .await
        .unwrap();
    good.set("k", b"v").await.unwrap();
    assert_eq!(good.get("k").await.unwrap(), b"v");

    let wrong = TcpStore::connect(addr.clone(), client_opts(Some("guess"))).await;
    assert!(
        matches!(wrong, Err(StoreError::Connect { .. })),
        "{wrong:?}"
    );

    // A client without the secret (a torch client, say) never gets an
    // answer: its VALIDATE is not a handshake reply.
    let none = TcpStore::connect(addr, client_opts(None)).await;
    assert!(none.is_err(), "{none:?}");
    assert_eq!(
        good.get("k").await.unwrap(),
        b"v",
        "the server keeps serving"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_refuses_strangers_and_works_with_the_secret() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new(Duration::from_secs(10)));
    let opts = TcpOptions {
        timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        secret: Secret::new(b"mesh-secret".to_vec()),
        ..TcpOptions::default()
    };
    // Rank 0 listens first; a stranger dials it before rank 1 does and
    // tries to pass as rank 1 without the handshake.
    let s0 = store.clone();
    let o0 = opts.clone();
    let r0 = tokio::spawn(async move { consort_tcp::connect(s0, 0, 2, o0).await });
    let addr = address(&*store, &opts.namespace, 0).await;
    let mut stranger = TcpStream::connect(&addr).await.unwrap();
    let mut hello = b"CSRH\x02".to_vec();
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&2u32.to_le_bytes());
    hello.extend_from_slice(&[0u8; 64]);
    let _ = stranger.write_all(&hello).await;

    let r1 = consort_tcp::connect(store.clone(), 1, 2, opts)
        .await
        .unwrap();
    let r0 = r0.await.unwrap().unwrap();
    let (a, b) = (
        ProcessGroup::new(Arc::new(r0)),
        ProcessGroup::new(Arc::new(r1)),
    );
    let (x, y) = tokio::join!(
        async {
            let mut v = vec![1.0f32; 8];
            a.all_reduce(&mut v, ReduceOp::Sum).await.map(|()| v)
        },
        async {
            let mut v = vec![2.0f32; 8];
            b.all_reduce(&mut v, ReduceOp::Sum).await.map(|()| v)
        }
    );
    assert_eq!(x.unwrap(), vec![3.0; 8]);
    assert_eq!(y.unwrap(), vec![3.0; 8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_with_different_secrets_do_not_connect() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new(Duration::from_secs(10)));
    let opts = |s: &str| TcpOptions {
        connect_timeout: Duration::from_secs(2),
        secret: Secret::new(s.as_bytes().to_vec()),
        ..TcpOptions::default()
    };
    let s0 = store.clone();
    let o0 = opts("one");
    let r0 = tokio::spawn(async move { consort_tcp::connect(s0, 0, 2, o0).await });
    let e1 = consort_tcp::connect(store, 1, 2, opts("two"))
        .await
        .unwrap_err();
    assert!(e1.to_string().contains("authenticat"), "{e1}");
    let e0 = r0.await.unwrap().unwrap_err();
    assert!(e0.to_string().contains("timed out"), "{e0}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_works_over_ipv6() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new(Duration::from_secs(10)));
    let opts = TcpOptions {
        bind_addr: Some("::1".parse().unwrap()),
        connect_timeout: Duration::from_secs(10),
        secret: None,
        ..TcpOptions::default()
    };
    let tasks: Vec<_> = (0..3)
        .map(|r| {
            let (s, o) = (store.clone(), opts.clone());
            tokio::spawn(async move {
                let pg = ProcessGroup::new(Arc::new(consort_tcp::connect(s, r, 3, o).await?));
                let mut v = vec![r as f32; 4];
                pg.all_reduce(&mut v, ReduceOp::Sum).await.map(|()| v)
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), vec![3.0; 4]);
    }
    let a = address(&*store, &opts.namespace, 0).await;
    assert!(a.starts_with("[::1]:"), "{a}");
}

/// A stray connection to a rank's data port that never says hello (a port
/// scanner, a stale client of an earlier job on a reused port) must not
/// hold up the mesh: handshakes run side by side, each with a deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stray_connection_does_not_block_the_mesh() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new(Duration::from_secs(30)));
    let opts = TcpOptions {
        connect_timeout: Duration::from_secs(30),
        ..TcpOptions::default()
    };
    let rank0 = tokio::spawn(consort_tcp::connect(store.clone(), 0, 2, opts.clone()));
    let addr = address(&*store, &opts.namespace, 0).await;
    // Connects first, and then sends nothing, for the whole test.
    let _stray = TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let rank1 = tokio::spawn(consort_tcp::connect(store.clone(), 1, 2, opts));
    let pgs = [rank0.await.unwrap(), rank1.await.unwrap()]
        .map(|b| ProcessGroup::new(Arc::new(b.expect("mesh despite a silent stray connection"))));
    let [a, b] = pgs;
    let (ra, rb) = tokio::join!(
        async move {
            let mut v = vec![1.0f32; 3];
            a.all_reduce(&mut v, ReduceOp::Sum).await.map(|()| v)
        },
        async move {
            let mut v = vec![2.0f32; 3];
            b.all_reduce(&mut v, ReduceOp::Sum).await.map(|()| v)
        }
    );
    assert_eq!(ra.unwrap(), vec![3.0; 3]);
    assert_eq!(rb.unwrap(), vec![3.0; 3]);
}
