//! Our mesh layout against torch's: `tests/golden/device_mesh_torch.json`
//! holds, for a grid of mesh shapes (1-D to 4-D, up to 16 ranks, dims of
//! size 1 included; row-major and, from 2-D on, reversed ranks), what
//! torch 2.15's `DeviceMesh` gives on every rank: the mesh, the
//! coordinate, each dim's group and local rank, every two-dim slice (or
//! torch's refusal), every two-dim flatten's group and every dim's
//! unflatten's groups. `scripts/torch_device_mesh.py` made it. Ours must
//! equal it. Groups here come from the layout ([`MeshLayout`]); the
//! simulator tests (`tests/tests/device_mesh.rs`) show that the groups a
//! `DeviceMesh` makes hold exactly those ranks.
//!
//! `torch_still_agrees` reruns that script against the installed torch
//! (`CONSORT_TORCH_PYTHON`, set in CI) and requires the same file, so a
//! torch release that changes the layout is seen.

use consort_comm::device_mesh::MeshLayout;
use serde_json::Value;

const GOLDEN: &str = include_str!("../../tests/golden/device_mesh_torch.json");

/// A nested list of ranks, row-major.
fn flat(v: &Value) -> Vec<usize> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        n => vec![n.as_u64().unwrap() as usize],
    }
}

fn list(v: &Value) -> Vec<usize> {
    serde_json::from_value(v.clone()).unwrap()
}

/// A group's ranks as torch's default `new_group` orders them.
fn sorted(mut g: Vec<usize>) -> Vec<usize> {
    g.sort_unstable();
    g
}

fn layout_of(row: &Value) -> MeshLayout {
    let shape = list(&row["shape"]);
    let n: usize = shape.iter().product();
    if row["reversed"].as_bool().unwrap() {
        MeshLayout::new(&shape, (0..n).rev().collect()).unwrap()
    } else {
        MeshLayout::row_major(&shape).unwrap()
    }
}

fn check_rank(l: &MeshLayout, r: usize, want: &Value, at: &str) {
    assert_eq!(
        l.coordinate_of(r).unwrap(),
        list(&want["coordinate"]),
        "{at} coordinate"
    );
    for d in 0..l.ndim() {
        let g = sorted(l.group_of(d, r).unwrap());
        assert_eq!(g, list(&want["groups"][d]), "{at} dim {d} group");
        let local = g.iter().position(|&x| x == r).unwrap();
        assert_eq!(
            local as u64, want["local_ranks"][d],
            "{at} dim {d} local rank"
        );
    }
    for s in want["slices"].as_array().unwrap() {
        let dims = list(&s["dims"]);
        match (l.slice(&dims), s.get("error")) {
            (Err(_), Some(_)) => {}
            (Ok(_), Some(e)) => panic!("{at} slice {dims:?}: torch refuses ({e}), we do not"),
            (Err(e), None) => panic!("{at} slice {dims:?}: we refuse ({e}), torch does not"),
            (Ok(sub), None) => {
                assert_eq!(
                    sub.mesh_of(r).unwrap(),
                    flat(&s["mesh"]),
                    "{at} slice {dims:?}"
                );
                let c = list(&s["coordinate"]);
                assert_eq!(
                    sub.coordinate_of(r).unwrap(),
                    c,
                    "{at} slice {dims:?} coordinate"
                );
            }
        }
    }
    for f in want["flatten"].as_array().unwrap() {
        let dims = list(&f["dims"]);
        let flat = l.slice(&dims).unwrap().flatten();
        let g = sorted(flat.group_of(0, r).unwrap());
        assert_eq!(g, list(&f["group"]), "{at} flatten {dims:?}");
    }
    for u in want["unflatten"].as_array().unwrap() {
        let d = u["dim"].as_u64().unwrap() as usize;
        let un = l.unflatten(d, &list(&u["sizes"])).unwrap();
        let groups: Vec<Vec<usize>> = (0..un.ndim())
            .map(|k| sorted(un.group_of(k, r).unwrap()))
            .collect();
        let want: Vec<Vec<usize>> = serde_json::from_value(u["groups"].clone()).unwrap();
        assert_eq!(groups, want, "{at} unflatten dim {d}");
    }
}

#[test]
fn every_layout_equals_torchs_on_every_rank() {
    let rows: Vec<Value> = serde_json::from_str(GOLDEN).unwrap();
    let (mut ranks, mut refusals, mut four_d) = (0, 0, 0);
    for row in &rows {
        let l = layout_of(row);
        let at = format!("shape {} reversed {}", row["shape"], row["reversed"]);
        assert_eq!(l.rows(), vec![flat(&row["mesh"])], "{at} mesh");
        let want = row["ranks"].as_array().unwrap();
        assert_eq!(want.len(), l.numel(), "{at}");
        for (r, w) in want.iter().enumerate() {
            check_rank(&l, r, w, &format!("{at} rank {r}"));
            let slices = w["slices"].as_array().unwrap();
            refusals += slices.iter().filter(|s| s.get("error").is_some()).count();
        }
        ranks += want.len();
        four_d += usize::from(l.ndim() == 4);
    }
    // The grid is the whole file: 1-D to 4-D, refusals included.
    assert!(
        rows.len() >= 240 && ranks >= 1500 && four_d >= 60,
        "{ranks} {four_d}"
    );
    assert!(refusals >= 1000, "{refusals}");
}

#[test]
fn torch_still_agrees() {
    let Ok(python) = std::env::var("CONSORT_TORCH_PYTHON") else {
        eprintln!("skipped: set CONSORT_TORCH_PYTHON to a python with torch (CI does)");
        return;
    };
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/torch_device_mesh.py"
    );
    let out = std::process::Command::new(python)
        .arg(script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let now: Value = serde_json::from_slice(&out.stdout).unwrap();
    let golden: Value = serde_json::from_str(GOLDEN).unwrap();
    assert!(
        now == golden,
        "the installed torch's device meshes differ from tests/golden/device_mesh_torch.json; \
         rerun scripts/torch_device_mesh.py and look at the difference"
    );
}
