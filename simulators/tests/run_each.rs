//! `SimWorld::run_each`: every rank's output in rank order, and a rank's
//! panic comes back with its own message.

use std::sync::Arc;

use consort_comm::{ProcessGroup, ReduceOp};
use consort_sim::{SimConfig, SimWorld};

#[test]
fn outputs_come_back_in_rank_order() {
    let world = SimWorld::new(SimConfig::new(3)).unwrap();
    let out = world
        .run_each(|r| async move {
            let pg = ProcessGroup::new(Arc::new(r));
            let mut v = [pg.rank() as u32];
            pg.all_reduce(&mut v, ReduceOp::Sum).await.unwrap();
            (pg.rank(), v[0])
        })
        .unwrap();
    assert_eq!(out, vec![(0, 3), (1, 3), (2, 3)]);
}

#[test]
fn a_ranks_panic_comes_back_with_its_message() {
    let world = SimWorld::new(SimConfig::new(2)).unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        world.run_each(|r| async move {
            if consort_comm::Backend::rank(&r) == 1 {
                panic!("rank one gives up");
            }
        })
    }));
    let payload = caught.unwrap_err();
    let msg = payload.downcast_ref::<&str>().copied().unwrap_or_default();
    assert_eq!(msg, "rank one gives up");
}
