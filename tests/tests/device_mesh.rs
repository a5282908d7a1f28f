//! `DeviceMesh` on the simulator: for random shapes up to 4-D (at most 16
//! ranks), every group a mesh makes (each dim's, a slice's, a flatten's,
//! an unflatten's) holds exactly the ranks its layout says, in torch's
//! order (sorted): an `all_gather` of the ranks over it returns that list,
//! and an `all_reduce` of `1 << rank` sums exactly those ranks. The layout
//! itself equals torch's (`comm/tests/device_mesh_torch.rs`), so these
//! groups are torch's. Bad shapes and names are refused on every rank.

use std::{sync::Arc, time::Duration};

use consort_comm::{
    Backend, DeviceMesh, GroupOptions, ProcessGroup, ReduceOp, device_mesh::MeshLayout,
};
use consort_sim::{SimConfig, SimWorld};
use consort_tests::{WorldFuture, proptest::prelude::*, run_world};

fn sim(n: usize) -> WorldFuture {
    Box::pin(async move {
        let cfg = SimConfig::new(n).timeout(Duration::from_secs(30));
        (SimWorld::new(cfg).unwrap().ranks().into_iter())
            .map(|r| Arc::new(r) as Arc<dyn Backend>)
            .collect()
    })
}

/// The same world as ranks of a subgroup of a bigger one.
fn sub(n: usize) -> WorldFuture {
    consort_tests::on_subgroup(sim, n)
}

const NAMES: [&str; 4] = ["pp", "dp", "cp", "tp"];

/// Requires `g` to be this rank's group of exactly `want` (sorted), in
/// that order, and to sum exactly those ranks.
async fn same_group(g: &ProcessGroup, want: &[usize], rank: usize, what: &str) {
    let mut want = want.to_vec();
    want.sort_unstable();
    let got = g.all_gather_vec(&[rank as u64]).await.unwrap();
    let got: Vec<usize> = got.into_iter().map(|r| r as usize).collect();
    assert_eq!(got, want, "rank {rank}: {what}'s group");
    assert_eq!(want[g.rank()], rank, "rank {rank}: {what}'s group rank");
    let mut bits = [1u64 << rank];
    g.all_reduce(&mut bits, ReduceOp::Sum).await.unwrap();
    let sum = want.iter().map(|&r| 1u64 << r).sum::<u64>();
    assert_eq!(bits[0], sum, "rank {rank}: {what}'s all_reduce");
}

/// Every group of `mesh` (and of its slices, flattens and unflattens)
/// against the layout; the same calls on every rank.
async fn check_mesh(pg: ProcessGroup, shape: Vec<usize>) {
    let rank = pg.rank();
    let names = &NAMES[..shape.len()];
    let mesh = DeviceMesh::init(&pg, &shape, names).await.unwrap();
    let layout = MeshLayout::row_major(&shape).unwrap();
    assert_eq!(mesh.shape(), shape);
    assert_eq!(mesh.ranks(), (0..pg.world_size()).collect::<Vec<_>>());
    assert_eq!(Some(mesh.coordinate()), layout.coordinate_of(rank));
    for (d, name) in names.iter().enumerate() {
        let want = layout.group_of(d, rank).unwrap();
        same_group(&mesh.get_group(name).unwrap(), &want, rank, name).await;
        assert_eq!(mesh.size(d).unwrap(), shape[d]);
        let local = mesh.get_local_rank(name).unwrap();
        assert_eq!(
            local,
            mesh.coordinate()[d],
            "rank {rank}: {name}'s local rank"
        );
    }
    for i in 0..names.len() {
        for j in i + 1..names.len() {
            let dims = [names[i], names[j]];
            let s = mesh.slice(&dims).unwrap();
            let sl = layout.slice(&[i, j]).unwrap();
            assert_eq!(Some(s.ranks()), sl.mesh_of(rank));
            assert_eq!(Some(s.coordinate()), sl.coordinate_of(rank));
            for (k, dim) in dims.iter().enumerate() {
                let want = sl.group_of(k, rank).unwrap();
                same_group(&s.group(k).unwrap(), &want, rank, dim).await;
            }
            let name = format!("{}_{}", names[i], names[j]);
            let flat = s.flatten(None).await.unwrap();
            let want = sl.flatten().group_of(0, rank).unwrap();
            same_group(&mesh.get_group(&name).unwrap(), &want, rank, &name).await;
            assert_eq!(Some(flat.ranks()), sl.flatten().mesh_of(rank));
            // The root mesh slices its flattened dims too.
            assert_eq!(mesh.slice(&[&name]).unwrap().ranks(), flat.ranks());
        }
    }
    for (d, name) in names.iter().enumerate() {
        let p = (2..shape[d])
            .find(|p| shape[d].is_multiple_of(*p))
            .unwrap_or(1);
        let sizes = [p, shape[d] / p];
        let u = mesh.unflatten(name, &sizes, &["a", "b"]).await.unwrap();
        let ul = layout.unflatten(d, &sizes).unwrap();
        for k in 0..u.ndim() {
            let want = ul.group_of(k, rank).unwrap();
            let what = format!("unflatten {name} dim {k}");
            same_group(&u.group(k).unwrap(), &want, rank, &what).await;
        }
    }
}

fn shapes() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..=4, 1..=4)
        .prop_filter("at most 16 ranks", |s| s.iter().product::<usize>() <= 16)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_group_holds_the_layouts_ranks(shape in shapes()) {
        let n = shape.iter().product();
        run_world(sim, n, move |pg| check_mesh(pg, shape.clone()));
    }
}

#[test]
fn a_mesh_over_a_subgroup_uses_its_ranks() {
    run_world(sub, 6, |pg| check_mesh(pg, vec![3, 2]));
    run_world(sub, 8, |pg| check_mesh(pg, vec![2, 1, 2, 2]));
}

#[test]
fn given_ranks_lay_out_the_mesh_and_groups_are_sorted() {
    let ranks = vec![5, 4, 3, 2, 1, 0];
    run_world(sim, 6, move |pg| {
        let ranks = ranks.clone();
        async move {
            let rank = pg.rank();
            let mesh = DeviceMesh::from_ranks(&pg, &[2, 3], ranks.clone(), &["dp", "tp"]);
            let mesh = mesh.await.unwrap();
            let layout = MeshLayout::new(&[2, 3], ranks.clone()).unwrap();
            assert_eq!(mesh.ranks(), ranks);
            assert_eq!(Some(mesh.coordinate()), layout.coordinate_of(rank));
            for d in 0..2 {
                let want = layout.group_of(d, rank).unwrap();
                same_group(&mesh.group(d).unwrap(), &want, rank, "dim").await;
            }
            // torch's preserve_rank_order: the groups keep the layout's order.
            let keep = GroupOptions {
                sort_ranks: false,
                timeout: None,
            };
            let mesh = DeviceMesh::from_ranks_with(&pg, &[2, 3], ranks, &["dp", "tp"], &keep);
            let tp = mesh.await.unwrap().get_group("tp").unwrap();
            let got = tp.all_gather_vec(&[rank as u64]).await.unwrap();
            let want: Vec<u64> = (layout.group_of(1, rank).unwrap().into_iter())
                .map(|r| r as u64)
                .collect();
            assert_eq!(got, want);
        }
    });
}

fn refused(e: consort_comm::CommError, rank: usize, words: &str) {
    let text = e.to_string();
    assert!(text.contains(&format!("rank {rank}")), "{text}");
    assert!(text.contains(words), "wanted {words:?} in: {text}");
}

#[test]
fn bad_shapes_and_names_are_refused_on_every_rank() {
    run_world(sim, 4, |pg| async move {
        let r = pg.rank();
        let init = |shape: Vec<usize>, names: Vec<&'static str>| {
            let pg = pg.clone();
            async move { DeviceMesh::init(&pg, &shape, &names).await.unwrap_err() }
        };
        refused(init(vec![2, 3], vec!["a", "b"]).await, r, "the group has 4");
        refused(init(vec![4, 0], vec!["a", "b"]).await, r, "size 0");
        refused(init(vec![], vec![]).await, r, "at least one dim");
        refused(init(vec![2, 2], vec!["a"]).await, r, "for 2 dims");
        refused(init(vec![2, 2], vec!["a", "a"]).await, r, "unique");
        refused(init(vec![2, 2], vec!["a", ""]).await, r, "empty");
        let e = DeviceMesh::from_ranks(&pg, &[2, 2], vec![0, 1, 1, 2], &["a", "b"]).await;
        refused(e.unwrap_err(), r, "there twice");
        let mesh = DeviceMesh::init(&pg, &[2, 1, 2], &["dp", "cp", "tp"])
            .await
            .unwrap();
        refused(mesh.slice(&["tp", "dp"]).unwrap_err(), r, "mesh's order");
        refused(mesh.slice(&["ep"]).unwrap_err(), r, "does not exist");
        refused(mesh.get_group("ep").unwrap_err(), r, "does not exist");
        refused(mesh.group(3).unwrap_err(), r, "out of range");
        refused(
            mesh.flatten(Some("tp")).await.unwrap_err(),
            r,
            "already a dim",
        );
        let un = mesh.unflatten("dp", &[3], &["x"]).await.unwrap_err();
        refused(un, r, "multiply");
        let un = mesh
            .unflatten("dp", &[2, 1], &["x", "tp"])
            .await
            .unwrap_err();
        refused(un, r, "already a dim");
        // Flattening again under one name: the first mesh, or a refusal.
        let dp_tp = mesh
            .slice(&["dp", "tp"])
            .unwrap()
            .flatten(Some("x"))
            .await
            .unwrap();
        let again = mesh
            .slice(&["dp", "tp"])
            .unwrap()
            .flatten(Some("x"))
            .await
            .unwrap();
        assert_eq!(again.ranks(), dp_tp.ranks());
        let other = mesh.slice(&["dp", "cp"]).unwrap().flatten(Some("x")).await;
        refused(other.unwrap_err(), r, "made before");
        // A size-1 dim has no order of its own, as in torch.
        assert_eq!(mesh.slice(&["cp", "dp"]).unwrap().shape(), vec![1, 2]);
        // A sliced mesh does not see the root's flattened dims, as in torch.
        let tp = mesh.slice(&["tp"]).unwrap();
        refused(tp.slice(&["x"]).unwrap_err(), r, "does not exist");
        // ... but get_group does, through the root.
        assert_eq!(tp.get_group("x").unwrap().world_size(), 4);
    });
}
