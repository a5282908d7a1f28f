//! The rendezvous: how the agents meet on the agent store before each
//! round and agree on who takes part.
//!
//! - **Static** (`--nnodes N`): every node has its `--node-rank` and the
//!   round starts when all N have joined.
//! - **Elastic** (`--nnodes MIN:MAX`, torch's c10d rendezvous): agents join
//!   in any order and get node ranks in join order. The round closes when
//!   MAX have joined, or when MIN have and the last call (`--rdzv-last-call`,
//!   torch's `last_call_timeout`) has passed since the MIN-th joined. An
//!   agent that joins after the close waits for the next round, which the
//!   running agents start when they see it (`waiting`).

use std::time::{Duration, Instant};

use consort_comm::store::Store;

use super::{LaunchError, LaunchSpec};

/// Who takes part in one round, as this agent sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Membership {
    /// This node's index in the round.
    pub(super) node_rank: usize,
    /// Nodes in the round.
    pub(super) nnodes: usize,
    /// The global rank of this node's first worker.
    pub(super) rank_offset: usize,
    /// Workers in the round, on every node.
    pub(super) world: usize,
}

/// The store keys of round `round`.
pub(super) fn round_key(ns: &str, round: u32) -> String {
    format!("{ns}/round/{round}")
}

/// Whether an agent waits to join round `next` (so the running round
/// should end and make room for it).
pub(super) async fn waiting(store: &dyn Store, ns: &str, next: u32) -> bool {
    let key = format!("{}/joined", round_key(ns, next));
    store.check(&[&key]).await.unwrap_or(false)
}

/// Meets the other agents for round `round`: `None` when this agent came
/// too late for it (elastic: it waits for the next).
pub(super) async fn meet(
    a: &LaunchSpec,
    store: &dyn Store,
    ns: &str,
    round: u32,
) -> Result<Option<Membership>, LaunchError> {
    if a.min_nodes == a.max_nodes {
        return meet_static(a, store, ns, round).await.map(Some);
    }
    meet_elastic(a, store, ns, round).await
}

async fn meet_static(
    a: &LaunchSpec,
    store: &dyn Store,
    ns: &str,
    round: u32,
) -> Result<Membership, LaunchError> {
    let base = round_key(ns, round);
    store
        .set(&format!("{base}/node/{}", a.node_rank), b"1")
        .await?;
    let keys: Vec<String> = (0..a.max_nodes)
        .map(|n| format!("{base}/node/{n}"))
        .collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    store
        .wait(&keys, Duration::from_secs_f64(a.rdzv_timeout))
        .await
        .map_err(|e| {
            LaunchError::Rendezvous(format!(
                "rendezvous of {} nodes (round {round}) failed: {e}. Start `consort run \
                 --node-rank N` on every node, with the same --nnodes, --master-addr, \
                 --master-port and --rdzv-id",
                a.max_nodes
            ))
        })?;
    Ok(Membership {
        node_rank: a.node_rank,
        nnodes: a.max_nodes,
        rank_offset: a.node_rank * a.local_world_size,
        world: a.max_nodes * a.local_world_size,
    })
}

/// Milliseconds since the Unix epoch: the agents' shared clock for the last
/// call (they run on hosts whose clocks agree to well under a second).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn meet_elastic(
    a: &LaunchSpec,
    store: &dyn Store,
    ns: &str,
    round: u32,
) -> Result<Option<Membership>, LaunchError> {
    let base = round_key(ns, round);
    let me = usize::try_from(store.add(&format!("{base}/joined"), 1).await? - 1).unwrap_or(0);
    store
        .set(
            &format!("{base}/size/{me}"),
            a.local_world_size.to_string().as_bytes(),
        )
        .await?;
    let closed_key = format!("{base}/closed");
    let call_key = format!("{base}/last_call");
    let start = Instant::now();
    let n = loop {
        if store.check(&[&closed_key]).await? {
            break parse(&store.get(&closed_key).await?);
        }
        let joined = usize::try_from(store.add(&format!("{base}/joined"), 0).await?).unwrap_or(0);
        let close = if joined >= a.max_nodes {
            true
        } else if joined >= a.min_nodes {
            // The first agent to see MIN nodes starts the last call.
            let until = now_ms() + (a.last_call * 1000.0) as u64;
            let set = store
                .compare_set(&call_key, b"", until.to_string().as_bytes())
                .await?;
            now_ms() >= parse(&set) as u64
        } else {
            false
        };
        if close {
            let n = joined.min(a.max_nodes).to_string();
            break parse(&store.compare_set(&closed_key, b"", n.as_bytes()).await?);
        }
        if start.elapsed().as_secs_f64() > a.rdzv_timeout {
            return Err(LaunchError::Rendezvous(format!(
                "round {round}: only {joined} of at least {} nodes joined within --rdzv-timeout \
                 {}s. Start more nodes with the same --rdzv-endpoint and --rdzv-id, or lower \
                 --nnodes' minimum",
                a.min_nodes, a.rdzv_timeout
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if me >= n {
        eprintln!(
            "[consort run] round {round} closed with {n} node(s) before this one joined; it \
             joins the next round"
        );
        return Ok(None);
    }
    let mut sizes = Vec::with_capacity(n);
    for i in 0..n {
        sizes.push(parse(&store.get(&format!("{base}/size/{i}")).await?));
    }
    Ok(Some(Membership {
        node_rank: me,
        nnodes: n,
        rank_offset: sizes[..me].iter().sum(),
        world: sizes.iter().sum(),
    }))
}

/// A decimal the agents wrote (0 if it is not one).
fn parse(v: &[u8]) -> usize {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}
