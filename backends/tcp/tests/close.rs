//! Closing a TCP group: a rank that drops its world handle right after its
//! last call must not take back the frames its sockets still hold.
//!
//! A call can end while its last bytes are still in the kernel's send
//! buffer (a `send` ends once its frame is written). Were the socket then
//! simply closed, anything the peer sent afterwards (a probe, an abort, its
//! next call's frame) would make the closed socket answer with a reset, and
//! a reset throws away what the send buffer still held: the peer would get
//! `PeerLost` in the middle of the frame it was owed.

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, CommError, ProcessGroup, store::MemStore};
use consort_tcp::TcpOptions;

/// Elements sent: 8 MiB, which rank 0's send buffer and rank 1's receive
/// buffer hold between them (so rank 0's `send` ends with rank 1 reading
/// nothing: it took 3 ms here), but rank 1's receive window does not (so
/// part of it is still in rank 0's send buffer when rank 0 leaves). With
/// `linger` zero this test fails with `connection reset mid-frame`.
const LEN: usize = 2 << 20;

fn options() -> TcpOptions {
    TcpOptions {
        timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(60),
        local: None,
        ..TcpOptions::default()
    }
}

/// Rank 0 sends and drops its handle at once. Rank 1 runs on a runtime of
/// its own, which it blocks for a while (its reader cannot drain the
/// socket), and then sends to rank 0 before it receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_leaves_right_after_its_last_send_still_delivers_it() {
    let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
    let s1 = store.clone();
    let late = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(rank_one(s1))
    });
    let b0 = consort_tcp::connect(store, 0, 2, options()).await.unwrap();
    let pg = ProcessGroup::new(Arc::new(b0) as Arc<dyn Backend>);
    let x: Vec<f32> = (0..LEN).map(|i| (i % 251) as f32).collect();
    pg.send(&x, 1, 0).await.unwrap();
    let left = std::time::Instant::now();
    drop(pg);
    let waited = left.elapsed();
    let got = tokio::task::spawn_blocking(move || late.join().unwrap())
        .await
        .unwrap();
    let x =
        got.unwrap_or_else(|e| panic!("rank 1's recv failed (rank 0's drop took {waited:?}): {e}"));
    let wrong = x
        .iter()
        .enumerate()
        .filter(|&(i, &v)| v != (i % 251) as f32)
        .count();
    assert_eq!(wrong, 0, "rank 1 got {wrong} wrong elements");
}

/// Rank 1: stalls its whole runtime for 500 ms, writes a frame to rank 0
/// (gone by then) before its reader runs again, and receives.
async fn rank_one(store: Arc<dyn consort_comm::Store>) -> Result<Vec<f32>, CommError> {
    let b1 = consort_tcp::connect(store, 1, 2, options()).await?;
    let pg = ProcessGroup::new(Arc::new(b1) as Arc<dyn Backend>);
    std::thread::sleep(Duration::from_millis(500));
    let y = [1.0f32; 4];
    let mut to_zero = std::pin::pin!(pg.send(&y, 0, 1));
    // Its first poll writes the frame; whether the call then succeeds does
    // not matter here.
    let _ = std::future::poll_fn(|cx| std::task::Poll::Ready(to_zero.as_mut().poll(cx))).await;
    let mut x = vec![-1.0f32; LEN];
    pg.recv(&mut x, 0, 0).await?;
    Ok(x)
}

/// Handles dropped by a runtime shutting down close at once (see
/// `consort_tests::shutdown`).
#[test]
fn handles_dropped_by_a_runtime_shutting_down_close_quietly() {
    consort_tests::shutdown::handles_dropped_by_a_runtime_shutting_down_close_quietly(world);
}

/// Ranks meeting through one store, on TCP only.
fn world(n: usize) -> consort_tests::WorldFuture {
    Box::pin(async move {
        let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
        let tasks: Vec<_> = (0..n)
            .map(|r| tokio::spawn(consort_tcp::connect(store.clone(), r, n, options())))
            .collect();
        let mut out: Vec<Arc<dyn Backend>> = Vec::with_capacity(n);
        for t in tasks {
            out.push(Arc::new(t.await.expect("connect task").expect("connect")));
        }
        out
    })
}
