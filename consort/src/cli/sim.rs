//! `consort sim`: the cost-only simulator as an nccl-tests-style table,
//! with the closed-form α–β time beside every row.

use consort_comm::{OpKind, algo::AlgoConfig, algo::Algorithm};
use consort_sim::cost::{Link, Topology, simulate};
use serde_json::json;

use super::table::Table;

/// What `consort sim` was asked for.
#[derive(Debug)]
pub(crate) struct SimArgs {
    pub(crate) op: OpKind,
    pub(crate) algo: Option<Algorithm>,
    pub(crate) world: usize,
    pub(crate) ranks_per_node: Option<usize>,
    pub(crate) sizes: Vec<usize>,
    pub(crate) intra: Link,
    pub(crate) inter: Link,
    pub(crate) segment_bytes: usize,
}

/// Runs the sweep.
pub(crate) fn run(a: &SimArgs) -> Result<Table, String> {
    if a.world == 0 {
        return Err("--world-size must be at least 1".into());
    }
    let rpn = a.ranks_per_node.unwrap_or(a.world);
    if rpn == 0 || a.world % rpn != 0 {
        return Err(format!(
            "--world-size {} is not a multiple of --ranks-per-node {rpn}",
            a.world
        ));
    }
    let topo = Topology {
        nodes: a.world / rpn,
        ranks_per_node: rpn,
        intra: a.intra,
        inter: a.inter,
    };
    let cfg = AlgoConfig {
        segment_bytes: a.segment_bytes,
        ..AlgoConfig::default()
    };
    let mut t = Table::new(&[
        "op",
        "algo",
        "world",
        "bytes",
        "time_us",
        "algbw_gbs",
        "busbw_gbs",
        "closed_form_us",
    ]);
    for &bytes in &a.sizes {
        let algo = a.algo.unwrap_or_else(|| cfg.select(a.op, bytes, a.world));
        if !algo.supports(a.op) {
            return Err(format!(
                "`{algo}` does not implement {}; it implements {}",
                a.op,
                algo.ops()
                    .iter()
                    .map(|o| o.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let r = simulate(a.op, algo, bytes, &topo, &cfg).map_err(|e| e.to_string())?;
        t.push(vec![
            json!(a.op.name()),
            json!(algo.name()),
            json!(a.world),
            json!(bytes),
            json!(r.time * 1e6),
            json!(r.algbw_gbs),
            json!(r.busbw_gbs),
            json!(r.closed_form * 1e6),
        ]);
    }
    Ok(t)
}

/// Parses an op name as `torch.distributed` spells it.
pub(crate) fn parse_op(s: &str) -> Result<OpKind, String> {
    let s = s.trim();
    OpKind::ALL
        .into_iter()
        .filter(|o| !matches!(o, OpKind::Send | OpKind::Recv | OpKind::NewGroup))
        .find(|o| o.name() == s || (s == "all_to_all" && *o == OpKind::AllToAll))
        .ok_or_else(|| {
            format!(
                "unknown op {s:?}: expected all_reduce, broadcast, reduce, all_gather, gather, \
                 scatter, reduce_scatter, all_to_all or barrier"
            )
        })
}
