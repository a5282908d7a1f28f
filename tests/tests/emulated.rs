//! The conformance suite on `EmulatedComm` (collectives on the emulated
//! device, stream-ordered as NCCL's), over the simulator: host-buffer calls
//! go through its communication thread in issue order, so the whole body
//! must pass unchanged through the wrapper.

use std::{sync::Arc, time::Duration};

use consort_comm::Backend;
use consort_sim::{
    EmulatedComm, EmulatedCommOptions, EmulatedDevice, EmulatedOptions, SimConfig, SimWorld,
};
use consort_tests::WorldFuture;

fn emulated(n: usize) -> WorldFuture {
    Box::pin(async move {
        let mut cfg = SimConfig::new(n).timeout(Duration::from_secs(30));
        cfg.algo.segment_bytes = 64;
        SimWorld::new(cfg)
            .unwrap()
            .ranks()
            .into_iter()
            .map(|r| {
                let device = EmulatedDevice::new(EmulatedOptions {
                    seed: r.rank() as u64,
                    ..Default::default()
                });
                let opts = EmulatedCommOptions {
                    max_delay: Duration::ZERO,
                    ..Default::default()
                };
                Arc::new(EmulatedComm::new(Arc::new(r), device, opts).unwrap()) as Arc<dyn Backend>
            })
            .collect()
    })
}

/// The emulated world as a subgroup of a bigger one (see
/// `consort_tests::subworld`).
fn emulated_subgroup(n: usize) -> WorldFuture {
    consort_tests::on_subgroup(emulated, n)
}

mod emulated_comm {
    consort_tests::conformance!(crate::emulated, cases = 32);
}

mod emulated_subgroup {
    consort_tests::conformance!(crate::emulated_subgroup, cases = 32);
}
