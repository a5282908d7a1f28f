//! EmulatedComm: stream-ordered collectives on emulated device buffers,
//! rank per thread (device synchronization blocks the host, as on a GPU).

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, BufferMut, CallOptions, DType, Device, ReduceOp};
use consort_sim::{
    EmulatedComm, EmulatedCommOptions, EmulatedDevice, EmulatedOptions, SimConfig, SimRank,
    SimWorld,
};

fn per_thread<T: Send + 'static>(
    world: usize,
    f: impl Fn(SimRank) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let w = SimWorld::new(SimConfig::new(world)).unwrap();
    let threads: Vec<_> = w
        .ranks()
        .into_iter()
        .map(|r| {
            let f = f.clone();
            std::thread::spawn(move || f(r))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn setup(rank: SimRank, seed: u64) -> (Arc<EmulatedDevice>, EmulatedComm) {
    let r = rank.rank() as u64;
    let dev = EmulatedDevice::new(EmulatedOptions {
        seed: seed ^ r,
        max_delay: Duration::from_micros(50),
        ..Default::default()
    });
    let comm =
        EmulatedComm::new(Arc::new(rank), dev.clone(), EmulatedCommOptions::default()).unwrap();
    (dev, comm)
}

#[test]
fn all_reduce_and_broadcast_on_device_buffers_are_stream_ordered() {
    let out = per_thread(3, |rank| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let r = rank.rank();
            let (dev, comm) = setup(rank, 7);
            let s = dev.new_stream().unwrap();
            let x = dev.alloc_zeroed(16, s).unwrap();
            let vals = [r as f32 + 1.0; 4];
            // SAFETY: x holds 16 bytes.
            let buf = unsafe {
                dev.copy_from_host(x, consort_comm::dtype::as_bytes(&vals), s)
                    .unwrap();
                consort_comm::DeviceBuffer::new(x, 4, DType::F32, 0, s)
            };
            comm.all_reduce(
                BufferMut::Device(buf),
                ReduceOp::Sum,
                &CallOptions::default(),
            )
            .await
            .unwrap();
            let mut sum = [0f32; 4];
            // SAFETY: x holds 16 bytes.
            unsafe { dev.copy_to_host(consort_comm::dtype::as_bytes_mut(&mut sum), x, s) }.unwrap();
            comm.broadcast(BufferMut::Device(buf), &CallOptions::root(2))
                .await
                .unwrap();
            comm.synchronize().await.unwrap();
            (sum, r)
        })
    });
    for (sum, r) in out {
        assert_eq!(sum, [6.0; 4], "rank {r}");
    }
}

/// Dropping a communicator while one of its subgroups lives on (DDP's
/// bucket worker holds the survivors' group until the runtime goes) ends
/// the rank's communication thread instead of waiting for the subgroup:
/// the rank's process exits (its peers see it go), and the subgroup's
/// later calls fail.
#[test]
fn dropping_the_parent_while_a_subgroup_lives_does_not_hang() {
    let out = per_thread(2, |rank| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let (_dev, comm) = setup(rank, 3);
            let o = CallOptions::default();
            let sub = comm.new_group(&[0, 1], &o).await.unwrap().unwrap();
            let mut v = [1.0f32; 4];
            sub.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum, &o)
                .await
                .unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                drop(comm);
                let _ = tx.send(());
            });
            let dropped = rx.recv_timeout(Duration::from_secs(20)).is_ok();
            let later = sub
                .all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum, &o)
                .await;
            (v, dropped, later.is_err())
        })
    });
    for (v, dropped, later_failed) in out {
        assert_eq!(v, [2.0; 4]);
        assert!(dropped, "dropping the parent hung on its subgroup");
        assert!(
            later_failed,
            "a subgroup call after its parent's drop must fail"
        );
    }
}
