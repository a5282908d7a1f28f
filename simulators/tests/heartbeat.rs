//! The launcher's heartbeat on a stream-ordered communicator (the emulated
//! device, as on NCCL): a call made and not finished shows as in flight,
//! naming the call, until it ends; then progress moves on.

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, BufferMut, CallOptions, GroupId, OpKind, ReduceOp, heartbeat};
use consort_sim::{
    EmulatedComm, EmulatedCommOptions, EmulatedDevice, EmulatedOptions, SimConfig, SimWorld,
};

#[test]
fn a_call_waiting_on_a_peer_shows_in_the_heartbeat_until_it_ends() {
    let path = std::env::temp_dir().join(format!("consort-emulated-beat-{}", std::process::id()));
    let world = SimWorld::new(SimConfig::new(2).timeout(Duration::from_secs(10))).unwrap();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let mut go_rx = Some(go_rx);
    let threads: Vec<_> = world
        .ranks()
        .into_iter()
        .map(|d| {
            let go = if d.rank() == 1 { go_rx.take() } else { None };
            let path = path.clone();
            std::thread::spawn(move || {
                let rank = d.rank();
                let dev = EmulatedDevice::new(EmulatedOptions::default());
                let comm =
                    EmulatedComm::new(Arc::new(d), dev, EmulatedCommOptions::default()).unwrap();
                if rank == 0 {
                    comm.set_heartbeat(&path).unwrap();
                } else if let Some(go) = go {
                    // Rank 1 calls only once rank 0's call was seen waiting.
                    go.recv_timeout(Duration::from_secs(10)).unwrap();
                }
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let mut v = vec![1.0f32; 8];
                    let o = CallOptions::default();
                    comm.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum, &o)
                        .await
                        .unwrap();
                    comm.synchronize().await.unwrap();
                    assert_eq!(v, vec![2.0; 8]);
                });
            })
        })
        .collect();
    // Rank 0's all_reduce is made and waits for rank 1.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let waiting = loop {
        let b = heartbeat::read(&path);
        if b.is_some_and(|b| b.in_call) || std::time::Instant::now() > deadline {
            break b;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let waiting = waiting.expect("a heartbeat");
    assert!(waiting.in_call, "{waiting:?}");
    assert_eq!(waiting.last, Some((GroupId::WORLD, 0, OpKind::AllReduce)));
    assert_eq!(waiting.progress, 0);
    go_tx.send(()).unwrap();
    for t in threads {
        t.join().unwrap();
    }
    let done = heartbeat::read(&path).expect("a heartbeat");
    assert!(!done.in_call && done.progress >= 1, "{done:?}");
    let _ = std::fs::remove_file(&path);
}
