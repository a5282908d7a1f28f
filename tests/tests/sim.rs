//! The conformance suite on the simulator: with the default selection
//! policy, and with the choices forced to the other algorithms (ring for
//! small all_reduce, chain broadcast, store-and-forward chain broadcast;
//! binomial-tree all_reduce; direct all_reduce and broadcast),
//! so that every schedule in `comm::algo` passes the whole suite.

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, algo::AlgoConfig};
use consort_sim::{SimConfig, SimWorld};
use consort_tests::WorldFuture;

fn world(n: usize, overrides: &str) -> Vec<Arc<dyn Backend>> {
    world_with(n, overrides, false)
}

fn world_with(n: usize, overrides: &str, oversubscribed: bool) -> Vec<Arc<dyn Backend>> {
    let mut cfg = SimConfig::new(n).timeout(Duration::from_secs(30));
    // Small segments so that short buffers exercise multi-segment
    // pipelines.
    cfg.algo.segment_bytes = 64;
    cfg.algo.overrides = AlgoConfig::parse_overrides(overrides).unwrap();
    cfg.algo.oversubscribed = oversubscribed;
    SimWorld::new(cfg)
        .unwrap()
        .ranks()
        .into_iter()
        .map(|r| Arc::new(r) as Arc<dyn Backend>)
        .collect()
}

fn default_policy(n: usize) -> WorldFuture {
    Box::pin(async move { world(n, "") })
}

fn other_algorithms(n: usize) -> WorldFuture {
    Box::pin(async move { world(n, "all_reduce=ring,broadcast=chain") })
}

/// The chain broadcast as an oversubscribed host runs it: whole messages,
/// store and forward.
fn store_and_forward(n: usize) -> WorldFuture {
    Box::pin(async move { world_with(n, "broadcast=chain", true) })
}

/// The direct schedules: all_reduce as a direct reduce-scatter and
/// all-gather, broadcast from the root to every reader.
fn direct(n: usize) -> WorldFuture {
    Box::pin(async move { world(n, "all_reduce=direct,broadcast=direct") })
}

fn tree_all_reduce(n: usize) -> WorldFuture {
    Box::pin(async move { world(n, "all_reduce=binomial_tree") })
}

/// The default policy's world as ranks {n+1, ..., 3, 1} of a world of
/// n + 2: the whole body on a subgroup.
fn subgroup_of_a_bigger_world(n: usize) -> WorldFuture {
    consort_tests::on_subgroup(default_policy, n)
}

mod default_policy {
    consort_tests::conformance!(crate::default_policy);
}

mod other_algorithms {
    consort_tests::conformance!(crate::other_algorithms);
}

mod store_and_forward {
    consort_tests::conformance!(crate::store_and_forward);
}

mod direct {
    consort_tests::conformance!(crate::direct);
}

mod tree_all_reduce {
    consort_tests::conformance!(crate::tree_all_reduce);
}

mod subgroup {
    consort_tests::conformance!(crate::subgroup_of_a_bigger_world);
}
