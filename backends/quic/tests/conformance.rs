//! The conformance suite on the QUIC backend: real QUIC connections (TLS
//! 1.3, pinned job certificates) between ranks of one process, on loopback.

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, algo::AlgoConfig, store::MemStore};
use consort_mesh::MeshOptions as TcpOptions;
use consort_quic::{QuicBackend, QuicOptions};
use consort_tests::WorldFuture;

/// `n` QUIC ranks meeting through one store, with driver options `driver`.
async fn connect_all(n: usize, driver: TcpOptions) -> Vec<QuicBackend> {
    let store: Arc<dyn consort_comm::Store> = Arc::new(MemStore::new(Duration::from_secs(60)));
    let opts = QuicOptions {
        connect_timeout: Duration::from_secs(60),
        secret: None,
        driver,
        ..QuicOptions::default()
    };
    let tasks: Vec<_> = (0..n)
        .map(|r| tokio::spawn(consort_quic::connect(store.clone(), r, n, opts.clone())))
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("connect task").expect("connect"));
    }
    out
}

/// The handles of `connect_all` as a conformance world.
fn as_world(b: Vec<QuicBackend>) -> Vec<Arc<dyn Backend>> {
    b.into_iter()
        .map(|b| Arc::new(b) as Arc<dyn Backend>)
        .collect()
}

fn quic_world(n: usize) -> WorldFuture {
    Box::pin(async move {
        let driver = TcpOptions {
            timeout: Duration::from_secs(20),
            // Small segments so that short buffers exercise pipelining.
            algo: AlgoConfig {
                segment_bytes: 64,
                window: 4,
                overrides: Vec::new(),
                oversubscribed: false,
                shared_stage: false,
            },
            stall_probe: Duration::from_millis(100),
            ..TcpOptions::default()
        };
        as_world(connect_all(n, driver).await)
    })
}

mod quic {
    consort_tests::conformance!(crate::quic_world, cases = 12);
}

/// A QUIC world that is a subgroup of a bigger one (see
/// `consort_tests::subworld`): the whole body on a subgroup.
fn quic_subgroup(n: usize) -> WorldFuture {
    consort_tests::on_subgroup(quic_world, n)
}

mod subgroup {
    consort_tests::conformance!(crate::quic_subgroup, cases = 6);
}

/// A QUIC world whose links apply `faults` (the faulty link), with a 3 s op
/// timeout.
fn faulty_quic(n: usize, faults: Vec<consort_comm::fault::Fault>) -> WorldFuture {
    Box::pin(async move {
        let driver = TcpOptions {
            timeout: Duration::from_secs(3),
            stall_probe: Duration::from_millis(100),
            faults,
            fault_seed: 7,
            ..TcpOptions::default()
        };
        as_world(connect_all(n, driver).await)
    })
}

mod quic_faults {
    consort_tests::faults!(crate::faulty_quic);
}

/// QUIC takes its peers on one host through the local transport when one
/// is given, as TCP does, and the collectives still agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_on_one_host_share_memory_under_quic() {
    let driver = TcpOptions {
        local: Some(consort_shm::ShmTransport::default().shared()),
        ..TcpOptions::default()
    };
    let mut sums = Vec::new();
    for (r, b) in connect_all(3, driver).await.into_iter().enumerate() {
        let mut want = vec!["shm"; 3];
        want[r] = "self";
        assert_eq!(b.transports(), want);
        let pg = consort_comm::ProcessGroup::new(Arc::new(b) as Arc<dyn Backend>);
        sums.push(tokio::spawn(async move {
            let mut v = vec![pg.rank() as f32 + 1.0; 1 << 16];
            pg.all_reduce(&mut v, consort_comm::ReduceOp::Sum)
                .await
                .unwrap();
            v[(1 << 16) - 1]
        }));
    }
    for s in sums {
        assert_eq!(s.await.unwrap(), 6.0);
    }
}

/// Handles dropped by a runtime shutting down close at once (QUIC's drop,
/// waiting there for its streams' acknowledgements, used to hang).
#[test]
fn handles_dropped_by_a_runtime_shutting_down_close_quietly() {
    consort_tests::shutdown::handles_dropped_by_a_runtime_shutting_down_close_quietly(quic_world);
}
