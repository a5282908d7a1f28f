//! The cluster presets against the figures they cite, and NCCL's model
//! against the choices NCCL's source and its maintainers document.

use consort_sim::cluster::{
    self, Algo, ClusterError, Collective, Placement, Proto, nccl::Tuning, predict, predict_on,
    preset, presets,
};
use proptest::prelude::*;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Every preset is within 15% of every published figure it cites.
#[test]
fn every_preset_is_within_15_percent_of_every_figure_it_cites() {
    let mut misses = Vec::new();
    let mut checked = 0;
    for c in presets() {
        assert!(!c.published.is_empty(), "{} cites no figure", c.name);
        for f in c.published {
            let p = predict(&c, f.world_size, f.op, f.bytes).unwrap();
            let err = (p.busbw_gbs - f.busbw_gbs) / f.busbw_gbs;
            println!(
                "{:<10} {:>5} GPUs {:<14} {:>10} B  published {:>7.2}  predicted {:>7.2} ({} {})  {:+.1}%",
                c.name,
                f.world_size,
                f.op.name(),
                f.bytes,
                f.busbw_gbs,
                p.busbw_gbs,
                p.algo,
                p.proto,
                err * 100.0
            );
            checked += 1;
            if err.abs() > 0.15 {
                misses.push(format!(
                    "{} {} GPUs {}: {err:+.3}",
                    c.name, f.world_size, f.op
                ));
            }
        }
    }
    assert!(checked >= 10, "only {checked} figures");
    assert!(misses.is_empty(), "outside 15%: {misses:?}");
}

fn choice(cluster: &str, world: usize, op: Collective, bytes: usize) -> (Algo, Proto) {
    let p = predict(&preset(cluster).unwrap(), world, op, bytes).unwrap();
    (p.algo, p.proto)
}

/// nccl-tests#212 (sjeaugey): "allreduce uses NVLink SHARP by default" on
/// one H100 node; tuning.cc: NVLS is Simple only.
#[test]
fn one_h100_node_all_reduces_large_messages_with_nvls() {
    for bytes in [256 * MIB, GIB, 8 * GIB] {
        assert_eq!(
            choice("dgx-h100", 8, Collective::AllReduce, bytes),
            (Algo::Nvls, Proto::Simple)
        );
    }
    // No NVLS before Hopper.
    let (a, _) = choice("a100-4hdr", 8, Collective::AllReduce, GIB);
    assert_eq!(a, Algo::Ring);
}

/// nccl-tests#212 (sjeaugey): non-allreduce operations show the ring's
/// 370 GB/s on one H100 node, not NVLS.
#[test]
fn one_h100_node_all_gathers_and_reduce_scatters_on_rings() {
    for op in [Collective::AllGather, Collective::ReduceScatter] {
        assert_eq!(choice("dgx-h100", 8, op, GIB).0, Algo::Ring, "{op}");
    }
}

/// tuning.cc: NVLS across nodes is CollNet+NVLS (off without SHARP), so
/// an H100 cluster all-reduces large messages with NVLSTree; nccl-tests#196
/// (sjeaugey): "On two nodes, NCCL uses the tree (or nvlstree) algorithm".
#[test]
fn h100_clusters_all_reduce_large_messages_with_nvls_tree() {
    for world in [16, 32, 256, 1984, 16384] {
        let c = if world == 1984 {
            "hgx-h200"
        } else {
            "dgx-h100"
        };
        assert_eq!(
            choice(c, world, Collective::AllReduce, GIB),
            (Algo::NvlsTree, Proto::Simple),
            "{world}"
        );
    }
}

/// tuning.cc: the tree's latency grows as log2(nodes), the ring's as the
/// ranks; small all_reduces across many nodes take the tree, large ones
/// the ring where NVLS is not there (A100).
#[test]
fn across_many_nodes_small_all_reduces_take_the_tree_and_large_the_ring() {
    for world in [64, 256, 1024] {
        for cluster in ["dgx-h100", "a100-4hdr"] {
            let (a, p) = choice(cluster, world, Collective::AllReduce, 64 * 1024);
            assert_eq!(a, Algo::Tree, "{cluster} {world}");
            assert_eq!(p, Proto::LL, "{cluster} {world}");
        }
        let (a, p) = choice("a100-4hdr", world, Collective::AllReduce, 4 * GIB);
        assert_eq!((a, p), (Algo::Ring, Proto::Simple), "a100 {world}");
    }
}

/// tuning.cc (`ncclPatEnable`): "PAT only supports 1 GPU per node"; its
/// latency is logarithmic in the nodes, so it wins at small sizes, the
/// ring at large ones.
#[test]
fn pat_runs_all_gather_and_reduce_scatter_with_one_gpu_per_node_only() {
    let c = preset("dgx-h100").unwrap();
    let one_per_node = Placement {
        nodes: 64,
        ranks_per_node: 1,
    };
    for op in [Collective::AllGather, Collective::ReduceScatter] {
        let small = predict_on(&c, one_per_node, op, MIB, None).unwrap();
        assert_eq!(small.algo, Algo::Pat, "{op}");
        let large = predict_on(&c, one_per_node, op, 4 * GIB, None).unwrap();
        assert_eq!(large.algo, Algo::Ring, "{op}");
        for bytes in [1024, MIB, GIB] {
            assert_ne!(
                predict(&c, 512, op, bytes).unwrap().algo,
                Algo::Pat,
                "{op} 8 per node"
            );
        }
    }
    let forced = predict_on(
        &c,
        one_per_node,
        Collective::AllReduce,
        MIB,
        Some((Some(Algo::Pat), None)),
    );
    assert!(
        matches!(forced, Err(ClusterError::AlgoUnavailable { .. })),
        "{forced:?}"
    );
}

/// One H100 node's tuning table reproduces NCCL's own arithmetic for it:
/// NVLS searches 8 heads at 50 GB/s (370.8 · 8/7 holds 8 · 50), pass 2
/// raises bwInter to 60, and min(50 · 0.85 · 7/8 · 2, 60) = 60 a head
/// gives a busbw of 480 and an algbw of 480 · 8/14 = 274 ("algbw
/// ~275GB/s", nccl-tests#212).
#[test]
fn one_h100_node_tuning_table_matches_nccls_arithmetic() {
    let c = preset("dgx-h100").unwrap();
    let at = Placement {
        nodes: 1,
        ranks_per_node: 8,
    };
    let t = Tuning::new(&c, at);
    let nvls = t.graphs().nvls.unwrap();
    assert_eq!(
        (nvls.channels, nvls.bw_intra, nvls.bw_inter),
        (8, 50.0, 60.0)
    );
    assert_eq!(
        (t.graphs().ring.channels, t.graphs().ring.bw_intra),
        (12, 30.0)
    );
    let bytes = GIB;
    let want = 25.0 + bytes as f64 / (1000.0 * 8.0 * 60.0 * 8.0 / 14.0);
    let got = t
        .time_us(Collective::AllReduce, Algo::Nvls, Proto::Simple, bytes)
        .unwrap();
    assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
}

#[test]
fn bad_input_is_refused_with_the_reason() {
    let c = preset("dgx-h100").unwrap();
    assert_eq!(
        predict(&c, 0, Collective::AllReduce, 1),
        Err(ClusterError::NoGpus)
    );
    assert!(matches!(
        predict(&c, 12, Collective::AllReduce, 1),
        Err(ClusterError::NotWholeNodes { .. })
    ));
    assert!(matches!(
        predict(&c, 8, Collective::AllGather, 0),
        Err(ClusterError::ZeroSize { .. })
    ));
    let e = preset("dgx-h1000").unwrap_err().to_string();
    assert!(e.contains("dgx-h100") && e.contains("a100-4hdr"), "{e}");
    let e = predict(&c, 12, Collective::AllReduce, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("12") && e.contains("8 GPUs per node"), "{e}");
}

fn any_cluster() -> impl Strategy<Value = cluster::Cluster> {
    prop::sample::select(presets())
}

fn any_world() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..=8, (1usize..=2048).prop_map(|n| n * 8)]
}

fn any_op() -> impl Strategy<Value = Collective> {
    prop::sample::select(Collective::ALL.to_vec())
}

proptest! {
    #[test]
    fn busbw_never_exceeds_the_chosen_algorithms_bound(
        c in any_cluster(), world in any_world(), op in any_op(), bytes in 1usize..(1 << 34)
    ) {
        let p = predict(&c, world, op, bytes).unwrap();
        prop_assert!(p.time_us >= 0.0 && p.time_us.is_finite());
        prop_assert!(p.busbw_gbs <= p.bus_bound_gbs * (1.0 + 1e-9), "{p:?}");
        // And never above twice the NVLink (NVLS counts the switch's sums).
        prop_assert!(p.busbw_gbs <= 2.0 * c.nvlink_gbs, "{p:?}");
    }

    /// Doubling a message never makes it faster (NCCL's tree correction
    /// factors make the model's tree time dip within a doubling, so only
    /// doublings are promised for all_reduce).
    #[test]
    fn doubling_a_message_never_makes_it_faster(
        c in any_cluster(), world in any_world(), op in any_op(), bytes in 1usize..(1 << 33)
    ) {
        let one = predict(&c, world, op, bytes).unwrap();
        let two = predict(&c, world, op, 2 * bytes).unwrap();
        prop_assert!(two.time_us >= one.time_us, "{one:?} {two:?}");
    }

    /// all_gather and reduce_scatter have no size-dependent factor: their
    /// time grows with every byte.
    #[test]
    fn all_gather_time_is_monotone_in_size(
        c in any_cluster(), world in any_world(), bytes in 1usize..(1 << 33), more in 1usize..(1 << 20)
    ) {
        for op in [Collective::AllGather, Collective::ReduceScatter] {
            let a = predict(&c, world, op, bytes).unwrap();
            let b = predict(&c, world, op, bytes + more).unwrap();
            prop_assert!(b.time_us >= a.time_us, "{a:?} {b:?}");
        }
    }
}

/// The README's table of predicted all_reduce busbw on DGX H100 nodes is
/// what the model says (to the rounding printed there): a change to the
/// model that moves a figure must move the README's with it.
#[test]
fn the_readme_table_is_the_model() {
    let dgx = preset("dgx-h100").unwrap();
    // (GPUs, bytes, busbw GB/s as printed, algorithm, protocol)
    let rows = [
        (8, MIB, 66.0, Algo::Ring, Proto::LL),
        (8, 16 * MIB, 341.0, Algo::Nvls, Proto::Simple),
        (8, 256 * MIB, 468.0, Algo::Nvls, Proto::Simple),
        (8, 4 * GIB, 479.0, Algo::Nvls, Proto::Simple),
        (1024, MIB, 13.0, Algo::Tree, Proto::LL128),
        (1024, 16 * MIB, 108.0, Algo::Tree, Proto::LL128),
        (1024, 256 * MIB, 299.0, Algo::NvlsTree, Proto::Simple),
        (1024, 4 * GIB, 359.0, Algo::NvlsTree, Proto::Simple),
        (16384, MIB, 9.0, Algo::Tree, Proto::LL128),
        (16384, 16 * MIB, 88.0, Algo::Tree, Proto::LL128),
        (16384, 256 * MIB, 274.0, Algo::NvlsTree, Proto::Simple),
        (16384, 4 * GIB, 357.0, Algo::NvlsTree, Proto::Simple),
    ];
    for (gpus, bytes, busbw, algo, proto) in rows {
        let p = predict(&dgx, gpus, Collective::AllReduce, bytes).unwrap();
        assert!(
            (p.busbw_gbs - busbw).abs() <= 0.6 + busbw * 0.005,
            "{gpus} GPUs, {bytes} B: the model says {:.2} GB/s, the README {busbw}",
            p.busbw_gbs
        );
        assert_eq!((p.algo, p.proto), (algo, proto), "{gpus} GPUs, {bytes} B");
    }
}
