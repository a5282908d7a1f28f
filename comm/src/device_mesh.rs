//! [`DeviceMesh`]: torch's `torch.distributed.device_mesh`, an n-D layout
//! of a group's ranks with one process group per dimension.
//!
//! This module owns the mesh's bookkeeping ([`MeshLayout`], torch's
//! `_MeshLayout`: which ranks a mesh, a slice, a flattened or an
//! unflattened dim hold) and the making of each dim's groups, through the
//! subgroup API ([`ProcessGroup::split_group_with`], or `new_group` once
//! per group where torch ranks share the parent, as torch's own loop does).
//!
//! As in torch 2.15:
//! - [`DeviceMesh::init`] is `init_device_mesh(device, shape,
//!   mesh_dim_names=names)`: ranks `0..n` row-major;
//!   [`DeviceMesh::from_ranks`] is `DeviceMesh(device, mesh=ranks)`.
//! - Every dim's groups are the ranks that share all other coordinates,
//!   made by every rank in the same order (dim by dim, each dim's groups
//!   in layout order), each group's ranks sorted (torch's `new_group`
//!   default; [`GroupOptions::sort_ranks`] `false` is torch's
//!   `preserve_rank_order=True`). A dim that holds every rank reuses the
//!   parent group, as torch reuses the default group.
//! - [`DeviceMesh::slice`] (`mesh["dp", "tp"]`) keeps the groups already
//!   made; [`DeviceMesh::flatten`] (`_flatten`) makes the flattened dim's
//!   groups and registers them on the root mesh, where
//!   [`DeviceMesh::get_group`] finds them by name;
//!   [`DeviceMesh::unflatten`] (`_unflatten`) makes each new dim's groups.
//!
//! Unlike torch, a mesh holds every rank of its parent group exactly once
//! (torch also allows a mesh of some of the world's ranks), so every rank
//! has a coordinate.
//!
//! ```no_run
//! # async fn demo(pg: consort_comm::ProcessGroup) -> consort_comm::Result<()> {
//! use consort_comm::{DeviceMesh, ReduceOp};
//! let mesh = DeviceMesh::init(&pg, &[2, 2, 2], &["dp", "cp", "tp"]).await?;
//! let mut x = vec![1.0f32; 8];
//! mesh.get_group("tp")?.all_reduce(&mut x, ReduceOp::Sum).await?;
//! let dp_cp = mesh.slice(&["dp", "cp"])?.flatten(Some("dp_cp")).await?;
//! assert_eq!(dp_cp.ndim(), 1);
//! mesh.get_group("dp_cp")?.all_reduce(&mut x, ReduceOp::Sum).await?;
//! # Ok(()) }
//! ```

mod layout;

use std::sync::{Arc, Mutex};

pub use layout::MeshLayout;

use crate::{CommError, ErrorContext, GroupOptions, ProcessGroup, Result, lock};

/// A flattened dim registered on the root mesh: its name, its layout and
/// this rank's group along it (not its `DeviceMesh`, which would hold the
/// root and never be freed).
type Flattened = Vec<(String, MeshLayout, ProcessGroup)>;

/// What a root mesh and every mesh made from it share.
#[derive(Debug)]
struct Root {
    /// The root mesh's dim names.
    names: Vec<String>,
    /// The options every group of the mesh is made with.
    opts: GroupOptions,
    /// Flattened dims, by name (torch's `_flatten_mapping`).
    flattened: Mutex<Flattened>,
}

/// An n-D mesh of a group's ranks with one process group per dimension
/// (torch's `DeviceMesh`).
///
/// Cheap to clone. Every rank of the parent group must make the same
/// meshes, slices excepted, in the same order: making groups is collective.
#[derive(Clone, Debug)]
pub struct DeviceMesh {
    parent: ProcessGroup,
    layout: MeshLayout,
    names: Vec<String>,
    /// This rank's group along each dim.
    groups: Vec<ProcessGroup>,
    root: Arc<Root>,
    is_root: bool,
}

/// An invalid-argument error that names this rank.
fn refuse(rank: usize, reason: String) -> CommError {
    CommError::invalid(reason).with_context(ErrorContext {
        rank: Some(rank),
        ..ErrorContext::default()
    })
}

impl DeviceMesh {
    /// `init_device_mesh(device, shape, mesh_dim_names=names)`: the ranks
    /// of `pg` laid out row-major in `shape` (`torch.arange(n).view(shape)`),
    /// one group per dim. The product of `shape` must be `pg`'s size; the
    /// names must be as many as the dims, unique and non-empty.
    pub async fn init(pg: &ProcessGroup, shape: &[usize], names: &[&str]) -> Result<DeviceMesh> {
        Self::init_with(pg, shape, names, &GroupOptions::default()).await
    }

    /// [`DeviceMesh::init`] with the options every group is made with
    /// (`timeout`; `sort_ranks: false` is torch's `preserve_rank_order`).
    pub async fn init_with(
        pg: &ProcessGroup,
        shape: &[usize],
        names: &[&str],
        opts: &GroupOptions,
    ) -> Result<DeviceMesh> {
        let layout = MeshLayout::row_major(shape).map_err(|e| e.with_context(at(pg)))?;
        Self::make_root(pg, layout, names, opts).await
    }

    /// `DeviceMesh(device, mesh=ranks, mesh_dim_names=names)`: `ranks`
    /// (row-major, each rank of `pg` once) laid out in `shape`.
    pub async fn from_ranks(
        pg: &ProcessGroup,
        shape: &[usize],
        ranks: Vec<usize>,
        names: &[&str],
    ) -> Result<DeviceMesh> {
        Self::from_ranks_with(pg, shape, ranks, names, &GroupOptions::default()).await
    }

    /// [`DeviceMesh::from_ranks`] with the options every group is made with.
    pub async fn from_ranks_with(
        pg: &ProcessGroup,
        shape: &[usize],
        ranks: Vec<usize>,
        names: &[&str],
        opts: &GroupOptions,
    ) -> Result<DeviceMesh> {
        let layout = MeshLayout::new(shape, ranks).map_err(|e| e.with_context(at(pg)))?;
        Self::make_root(pg, layout, names, opts).await
    }

    async fn make_root(
        pg: &ProcessGroup,
        layout: MeshLayout,
        names: &[&str],
        opts: &GroupOptions,
    ) -> Result<DeviceMesh> {
        let rank = pg.rank();
        if layout.numel() != pg.world_size() {
            return Err(refuse(
                rank,
                format!(
                    "a mesh of shape {:?} holds {} ranks but the group has {}; pass a shape \
                     whose product is the group's size",
                    layout.shape(),
                    layout.numel(),
                    pg.world_size()
                ),
            ));
        }
        let names = check_names(rank, layout.ndim(), names, &[])?;
        let root = Arc::new(Root {
            names: names.clone(),
            opts: *opts,
            flattened: Mutex::new(Vec::new()),
        });
        let mut groups = Vec::with_capacity(layout.ndim());
        for dim in 0..layout.ndim() {
            groups.push(make_dim_group(pg, &layout, dim, opts).await?);
        }
        Ok(DeviceMesh {
            parent: pg.clone(),
            layout,
            names,
            groups,
            root,
            is_root: true,
        })
    }

    /// The mesh's layout (every copy of it, each dim's groups).
    pub fn layout(&self) -> &MeshLayout {
        &self.layout
    }

    /// This rank, in the parent group (torch's `get_rank`).
    pub fn rank(&self) -> usize {
        self.parent.rank()
    }

    /// Number of dimensions (torch's `ndim`).
    pub fn ndim(&self) -> usize {
        self.layout.ndim()
    }

    /// The size of each dimension (torch's `shape`).
    pub fn shape(&self) -> Vec<usize> {
        self.layout.shape()
    }

    /// The size of dimension `dim` (torch's `size(dim)`).
    pub fn size(&self, dim: usize) -> Result<usize> {
        Ok(self.group(dim)?.world_size())
    }

    /// The dimensions' names (torch's `mesh_dim_names`).
    pub fn dim_names(&self) -> &[String] {
        &self.names
    }

    /// The ranks of the copy of this mesh that holds this rank, row-major
    /// (torch's `mesh.flatten().tolist()`): for a root mesh, all of them.
    pub fn ranks(&self) -> Vec<usize> {
        self.layout.mesh_of(self.rank()).unwrap_or_default()
    }

    /// This rank's coordinate in the mesh (torch's `get_coordinate`).
    pub fn coordinate(&self) -> Vec<usize> {
        self.layout.coordinate_of(self.rank()).unwrap_or_default()
    }

    /// This rank's group along dimension `dim` (torch's `get_group(dim)`).
    pub fn group(&self, dim: usize) -> Result<ProcessGroup> {
        self.groups.get(dim).cloned().ok_or_else(|| {
            refuse(
                self.rank(),
                format!(
                    "mesh dim {dim} is out of range: the mesh has {} dims {:?}",
                    self.ndim(),
                    self.names
                ),
            )
        })
    }

    /// This rank's group along the dim named `name` (torch's
    /// `get_group(name)`): one of this mesh's dims, or a dim flattened
    /// from the root mesh (as torch, flattened names first).
    pub fn get_group(&self, name: &str) -> Result<ProcessGroup> {
        if let Some(m) = self.flattened(name) {
            return m.group(0);
        }
        self.group(self.dim_of(name)?)
    }

    /// This rank's rank in its group along `name` (torch's
    /// `get_local_rank(name)`).
    pub fn get_local_rank(&self, name: &str) -> Result<usize> {
        Ok(self.get_group(name)?.rank())
    }

    /// The dim flattened on the root mesh under `name`, as a 1-D mesh.
    fn flattened(&self, name: &str) -> Option<DeviceMesh> {
        let map = lock(&self.root.flattened);
        let (_, layout, group) = map.iter().find(|(n, ..)| n == name)?;
        Some(DeviceMesh {
            parent: self.parent.clone(),
            layout: layout.clone(),
            names: vec![name.to_string()],
            groups: vec![group.clone()],
            root: self.root.clone(),
            is_root: false,
        })
    }

    fn dim_of(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            let flat: Vec<String> = lock(&self.root.flattened)
                .iter()
                .map(|(n, ..)| n.clone())
                .collect();
            refuse(
                self.rank(),
                format!(
                    "mesh dim '{name}' does not exist: the mesh's dims are {:?} (flattened on \
                     the root mesh: {flat:?}); name one of them",
                    self.names
                ),
            )
        })
    }

    /// The submesh of the dims `names`, in the mesh's order, that holds
    /// this rank (torch's `mesh["dp", "tp"]`), with the groups already
    /// made: no collective. A root mesh also slices its flattened dims.
    pub fn slice(&self, names: &[&str]) -> Result<DeviceMesh> {
        if names.is_empty() {
            return Err(refuse(
                self.rank(),
                format!(
                    "slice needs at least one dim name; the mesh's are {:?}",
                    self.names
                ),
            ));
        }
        if names.iter().eq(self.names.iter()) {
            return Ok(self.clone());
        }
        let (mut axes, mut groups) = (Vec::new(), Vec::new());
        for &name in names {
            let (axis, group) = match self.names.iter().position(|n| n == name) {
                Some(d) => (self.layout.axes()[d].clone(), self.groups[d].clone()),
                None => match self.flattened(name).filter(|_| self.is_root) {
                    Some(m) => (m.layout.axes()[0].clone(), m.groups[0].clone()),
                    None => return Err(self.slice_unknown(name)),
                },
            };
            axes.push(axis);
            groups.push(group);
        }
        let layout = self.layout.with_axes(axes);
        let what = format!("{names:?} from a mesh with dims {:?}", self.names);
        (layout.check_slice(&what)).map_err(|e| e.with_context(at(&self.parent)))?;
        Ok(DeviceMesh {
            parent: self.parent.clone(),
            layout,
            names: names.iter().map(|n| n.to_string()).collect(),
            groups,
            root: self.root.clone(),
            is_root: false,
        })
    }

    fn slice_unknown(&self, name: &str) -> CommError {
        let flat: Vec<String> = lock(&self.root.flattened)
            .iter()
            .map(|(n, ..)| n.clone())
            .collect();
        let extra = if self.is_root {
            format!(" and the flattened {flat:?}")
        } else {
            String::new()
        };
        refuse(
            self.rank(),
            format!(
                "cannot slice mesh dim '{name}': it does not exist; the mesh's dims are {:?}{extra}",
                self.names
            ),
        )
    }

    /// torch's `_flatten(name)`: this mesh's dims as one dim, whose groups
    /// (the ranks that share every other coordinate of the root mesh) are
    /// made collectively and registered on the root mesh, so that
    /// `root.get_group(name)` finds them. `None` names it torch's way, the
    /// dim names joined by `_`. Flattening again under the same name with
    /// the same layout returns the mesh made the first time, with no
    /// collective; every rank must flatten in the same order.
    pub async fn flatten(&self, name: Option<&str>) -> Result<DeviceMesh> {
        let name = name.map_or_else(|| self.names.join("_"), str::to_string);
        if self.ndim() == 1 && self.names[0] == name {
            return Ok(self.clone());
        }
        let rank = self.rank();
        check_names(rank, 1, &[&name], &self.root.names)?;
        let layout = self.layout.flatten();
        if let Some(m) = self.flattened(&name) {
            if m.layout == layout {
                return Ok(m);
            }
            return Err(refuse(
                rank,
                format!(
                    "a flattened dim named '{name}' was made before from other dims; flatten \
                     under another name"
                ),
            ));
        }
        let group = make_dim_group(&self.parent, &layout, 0, &self.root.opts).await?;
        let flat = DeviceMesh {
            parent: self.parent.clone(),
            layout,
            names: vec![name.clone()],
            groups: vec![group],
            root: self.root.clone(),
            is_root: false,
        };
        let entry = (name, flat.layout.clone(), flat.groups[0].clone());
        lock(&self.root.flattened).push(entry);
        Ok(flat)
    }

    /// torch's `_unflatten(dim, sizes, names)`: dim `name` split into
    /// row-major `sizes` named `names`, each new dim's groups made
    /// collectively; the other dims keep theirs. The new names must not be
    /// the mesh's other dims' (torch does not check).
    pub async fn unflatten(
        &self,
        name: &str,
        sizes: &[usize],
        names: &[&str],
    ) -> Result<DeviceMesh> {
        let rank = self.rank();
        let dim = self.dim_of(name)?;
        let others: Vec<String> = (self.names.iter().enumerate())
            .filter(|&(d, _)| d != dim)
            .map(|(_, n)| n.clone())
            .collect();
        let new_names = check_names(rank, sizes.len(), names, &others)?;
        let layout =
            (self.layout.unflatten(dim, sizes)).map_err(|e| e.with_context(at(&self.parent)))?;
        let mut groups = self.groups.clone();
        let mut made = Vec::with_capacity(sizes.len());
        for d in dim..dim + sizes.len() {
            made.push(make_dim_group(&self.parent, &layout, d, &self.root.opts).await?);
        }
        groups.splice(dim..=dim, made);
        let mut all_names = self.names.clone();
        all_names.splice(dim..=dim, new_names);
        Ok(DeviceMesh {
            parent: self.parent.clone(),
            layout,
            names: all_names,
            groups,
            root: self.root.clone(),
            is_root: false,
        })
    }
}

/// The context of an error on `pg`'s rank.
fn at(pg: &ProcessGroup) -> ErrorContext {
    ErrorContext {
        rank: Some(pg.rank()),
        ..ErrorContext::default()
    }
}

/// Checks `names` for `ndim` dims: as many, non-empty, unique, and none of
/// `taken`.
fn check_names(rank: usize, ndim: usize, names: &[&str], taken: &[String]) -> Result<Vec<String>> {
    if names.len() != ndim {
        return Err(refuse(
            rank,
            format!(
                "{} dim names {names:?} for {ndim} dims; name every dim once",
                names.len()
            ),
        ));
    }
    for (i, n) in names.iter().enumerate() {
        let reason = if n.is_empty() {
            "is empty"
        } else if names[..i].contains(n) {
            "is given twice (each mesh_dim_name must be unique)"
        } else if taken.iter().any(|t| t == n) {
            "is already a dim of the mesh"
        } else {
            continue;
        };
        return Err(refuse(
            rank,
            format!("dim name '{n}' in {names:?} {reason}; pick unique, non-empty names"),
        ));
    }
    Ok(names.iter().map(|n| n.to_string()).collect())
}

/// Makes the groups along `dim` of `layout` on every rank of `pg`, and
/// returns this rank's, as torch's `_init_one_process_group`: a dim that
/// holds every rank reuses `pg` (unless its order is kept and differs);
/// otherwise every group, in layout order, through `split_group` where
/// consort may add its own calls, or one `new_group` each (torch's loop)
/// where torch ranks share `pg`.
async fn make_dim_group(
    pg: &ProcessGroup,
    layout: &MeshLayout,
    dim: usize,
    opts: &GroupOptions,
) -> Result<ProcessGroup> {
    let rank = pg.rank();
    let lists = layout.groups(dim)?;
    let in_order = |l: &Vec<usize>| l.iter().copied().eq(0..pg.world_size());
    if lists.len() == 1 && (opts.sort_ranks || in_order(&lists[0])) {
        return Ok(pg.clone());
    }
    let mine = if pg.backend().may_add_calls() {
        pg.split_group_with(&lists, opts).await?
    } else {
        let mut mine = None;
        for l in &lists {
            mine = pg.new_group_with(l, opts).await?.or(mine);
        }
        mine
    };
    mine.ok_or_else(|| {
        refuse(
            rank,
            format!("internal: no group along mesh dim {dim} holds this rank ({lists:?})"),
        )
    })
}

#[cfg(test)]
mod tests;
