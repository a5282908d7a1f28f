//! The layout against torch's documented examples.

use super::{MeshLayout, check_names};

#[test]
fn row_major_groups_and_coordinates() {
    let l = MeshLayout::row_major(&[2, 4]).unwrap();
    assert_eq!(l.rows(), vec![(0..8).collect::<Vec<_>>()]);
    assert_eq!(
        l.groups(0).unwrap(),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(
        l.groups(1).unwrap(),
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
    );
    assert_eq!(l.coordinate_of(6), Some(vec![1, 2]));
    assert_eq!(l.group_of(0, 5).unwrap(), vec![1, 5]);
}

#[test]
fn slices_follow_torchs_docstring() {
    // mesh_3d = (2, 2, 2) ("dp", "pp", "cp"): mesh_3d["dp", "cp"] on rank 2
    // is [[2, 3], [6, 7]].
    let l = MeshLayout::row_major(&[2, 2, 2]).unwrap();
    let s = l.slice(&[0, 2]).unwrap();
    assert_eq!(s.mesh_of(2), Some(vec![2, 3, 6, 7]));
    assert_eq!(s.coordinate_of(7), Some(vec![1, 1]));
    // Out of order is refused, as torch's KeyError.
    let e = l.slice(&[2, 0]).unwrap_err().to_string();
    assert!(e.contains("mesh's order"), "{e}");
    // A size-1 dim has no stride, so torch lets it come in any order.
    let l = MeshLayout::row_major(&[1, 4]).unwrap();
    assert!(l.slice(&[1, 0]).is_ok());
}

#[test]
fn flatten_and_unflatten_follow_torchs_docstring() {
    // mesh_3d["dp", "cp"]._flatten() of (2, 2, 2): [0, 2, 4, 6] on rank 0.
    let l = MeshLayout::row_major(&[2, 2, 2]).unwrap();
    let f = l.slice(&[0, 2]).unwrap().flatten();
    assert_eq!(f.mesh_of(0), Some(vec![0, 1, 4, 5]));
    let f = l.slice(&[0, 1]).unwrap().flatten();
    assert_eq!(f.mesh_of(1), Some(vec![1, 3, 5, 7]));
    // mesh_1d._unflatten(0, (2, 2, 2)) of 8 ranks: the 3-D row-major mesh.
    let u = MeshLayout::row_major(&[8])
        .unwrap()
        .unflatten(0, &[2, 2, 2])
        .unwrap();
    for d in 0..3 {
        assert_eq!(u.groups(d).unwrap(), l.groups(d).unwrap());
    }
    // A flattened pair of non-adjacent dims splits back into them.
    let back = f.unflatten(0, &[2, 2]).unwrap();
    assert_eq!(back.groups(1).unwrap(), l.groups(1).unwrap());
    let e = l.unflatten(0, &[3]).unwrap_err().to_string();
    assert!(e.contains("multiply"), "{e}");
}

#[test]
fn bad_shapes_ranks_and_names_are_refused() {
    for (shape, want) in [(&[][..], "at least one dim"), (&[2, 0][..], "size 0")] {
        let e = MeshLayout::row_major(shape).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    assert!(MeshLayout::row_major(&[usize::MAX, 2]).is_err());
    for ranks in [vec![0, 1, 2], vec![0, 1, 1, 3], vec![0, 1, 2, 4]] {
        assert!(MeshLayout::new(&[2, 2], ranks).is_err());
    }
    assert!(check_names(0, 2, &["a"], &[]).is_err());
    assert!(check_names(0, 2, &["a", "a"], &[]).is_err());
    assert!(check_names(0, 2, &["a", ""], &[]).is_err());
    assert!(check_names(0, 1, &["a"], &["a".to_string()]).is_err());
    let e = check_names(3, 2, &["a", "a"], &[]).unwrap_err().to_string();
    assert!(e.contains("rank 3") && e.contains("unique"), "{e}");
}

#[test]
fn hsdps_mesh_has_the_hand_made_groups() {
    // HSDP's [world / g, g] ("replicate", "shard"): shard groups are the
    // blocks of g consecutive ranks, replica groups every g-th rank.
    for world in 1..=12 {
        for g in (1..=world).filter(|g| world % g == 0) {
            let l = MeshLayout::row_major(&[world / g, g]).unwrap();
            let blocks: Vec<Vec<usize>> = (0..world / g)
                .map(|b| (b * g..(b + 1) * g).collect())
                .collect();
            let strided: Vec<Vec<usize>> =
                (0..g).map(|j| (j..world).step_by(g).collect()).collect();
            assert_eq!(l.groups(1).unwrap(), blocks, "world {world} g {g}");
            assert_eq!(l.groups(0).unwrap(), strided, "world {world} g {g}");
        }
    }
}
