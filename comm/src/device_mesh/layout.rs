//! [`MeshLayout`]: a device mesh's integer bookkeeping, torch's
//! `_MeshLayout` (`torch/distributed/_mesh_layout.py`), with no groups.
//!
//! A mesh is a rank map (the root mesh's ranks, row-major) and one axis per
//! dimension. An axis is torch's `_FlatLayout`: modes of (size, stride) over
//! positions in the rank map, coalesced so that equal layouts compare equal.
//! A root mesh of shape `[a, b]` has axes `a:b` and `b:1`; slicing keeps
//! some axes, `_flatten` merges several into one axis of several modes, and
//! `_unflatten` splits one axis into several. Every copy of a mesh (the
//! ranks that share the coordinates it leaves out) is one row of torch's
//! `remap_to_tensor`: the complement of the mesh's axes, enumerated with the
//! largest stride outermost, gives each row's first position.

use std::sync::Arc;

use crate::{CommError, Result};

/// One mesh dimension's layout: modes of (size, stride), outermost first,
/// coalesced (no size-1 modes; a mode whose stride is its inner neighbour's
/// span is merged into it). torch's `_FlatLayout`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Axis {
    modes: Vec<(usize, usize)>,
}

impl Axis {
    /// Coalesces `modes` as torch's `coalesce`: from the innermost mode out,
    /// size-1 modes are dropped and a mode whose stride equals the span of
    /// the one inside it is merged with it.
    pub(crate) fn new(modes: impl IntoIterator<Item = (usize, usize)>) -> Axis {
        let modes: Vec<(usize, usize)> = modes.into_iter().collect();
        let mut out: Vec<(usize, usize)> = Vec::with_capacity(modes.len());
        for &(size, stride) in modes.iter().rev() {
            match out.last_mut() {
                _ if size == 1 => {}
                Some(last) if last.0 * last.1 == stride => last.0 *= size,
                _ => out.push((size, stride)),
            }
        }
        out.reverse();
        Axis { modes: out }
    }

    /// Number of positions the axis covers.
    pub(crate) fn numel(&self) -> usize {
        self.modes.iter().map(|m| m.0).product()
    }

    /// The positions, row-major over the modes (torch's
    /// `all_ranks_from_zero`).
    fn offsets(&self) -> Vec<usize> {
        let mut out = vec![0usize];
        for &(size, stride) in &self.modes {
            out = out
                .iter()
                .flat_map(|&o| (0..size).map(move |c| o + c * stride))
                .collect();
        }
        out
    }

    /// The modes that fill `world` positions together with this axis, the
    /// largest stride outermost (torch's `complement`).
    fn complement(&self, world: usize) -> Axis {
        let mut sorted: Vec<(usize, usize)> = self.modes.iter().map(|&(s, d)| (d, s)).collect();
        sorted.sort_unstable();
        let mut out = Vec::with_capacity(sorted.len() + 1);
        let mut current = 1usize;
        for (stride, size) in sorted {
            if stride == 0 || size == 1 {
                continue;
            }
            out.push((stride / current, current));
            current = size * stride;
        }
        out.push((world.div_ceil(current), current));
        out.reverse();
        Axis::new(out)
    }

    /// The strides never grow from the outermost mode in (torch's
    /// `check_sorted`).
    fn sorted(&self) -> bool {
        self.modes.windows(2).all(|w| w[0].1 >= w[1].1)
    }

    /// No two coordinates reach the same position (torch's
    /// `check_orthogonal`).
    fn orthogonal(&self) -> bool {
        let mut m: Vec<(usize, usize)> = self.modes.iter().map(|&(s, d)| (d, s)).collect();
        m.sort_unstable_by(|a, b| b.cmp(a));
        m.windows(2).all(|w| w[0].0 % (w[1].0 * w[1].1) == 0)
    }

    /// Splits this axis into row-major `sizes` (their product is
    /// `numel()`), as torch's `composition` with `(sizes):(suffix
    /// products)`: each new axis takes the next positions from the inside
    /// out, cutting a mode where its size divides.
    fn split(&self, sizes: &[usize]) -> Option<Vec<Axis>> {
        let mut modes = self.modes.iter().rev().copied();
        let (mut left, mut stride) = (1usize, 0usize);
        let mut out = Vec::with_capacity(sizes.len());
        for &want in sizes.iter().rev() {
            let mut need = want;
            let mut taken = Vec::new();
            while need > 1 {
                if left == 1 {
                    (left, stride) = modes.next()?;
                }
                if left % need == 0 {
                    taken.push((need, stride));
                    (left, stride, need) = (left / need, stride * need, 1);
                } else if need % left == 0 {
                    taken.push((left, stride));
                    (need, left) = (need / left, 1);
                } else {
                    return None;
                }
            }
            taken.reverse();
            out.push(Axis::new(taken));
        }
        out.reverse();
        Some(out)
    }
}

/// A device mesh's layout: which ranks it holds and where, with no groups
/// (the integer side of [`super::DeviceMesh`]).
///
/// Every copy of the mesh is one row of [`MeshLayout::rows`]: a root mesh
/// has one; a mesh sliced, flattened or unflattened from it has one per
/// combination of the coordinates it leaves out, and each rank sees the row
/// that holds it ([`MeshLayout::mesh_of`]), as torch's `DeviceMesh.mesh`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MeshLayout {
    rank_map: Arc<[usize]>,
    axes: Vec<Axis>,
}

impl MeshLayout {
    /// `init_device_mesh`'s layout: ranks `0..n` laid out row-major in
    /// `shape` (`torch.arange(n).view(shape)`), `n` the product of `shape`.
    pub fn row_major(shape: &[usize]) -> Result<MeshLayout> {
        let n = numel(shape)?;
        MeshLayout::new(shape, (0..n).collect())
    }

    /// `DeviceMesh(mesh=...)`'s layout: `ranks` (row-major, one per
    /// element) in `shape`. `ranks` must hold each of `0..ranks.len()` once.
    pub fn new(shape: &[usize], ranks: Vec<usize>) -> Result<MeshLayout> {
        let n = numel(shape)?;
        if ranks.len() != n {
            return Err(CommError::invalid(format!(
                "the mesh's ranks are {} but a mesh of shape {shape:?} holds {n}; pass one rank \
                 per element, row-major",
                ranks.len()
            )));
        }
        let mut seen = vec![false; n];
        for &r in &ranks {
            if r >= n || std::mem::replace(&mut seen[r], true) {
                return Err(CommError::invalid(format!(
                    "the mesh's ranks {ranks:?} are not each of 0..{n} once (rank {r} is {}); \
                     a mesh holds every rank of its group exactly once",
                    if r >= n {
                        "out of range"
                    } else {
                        "there twice"
                    }
                )));
            }
        }
        let mut stride = n;
        let axes = shape
            .iter()
            .map(|&s| {
                stride /= s;
                Axis::new([(s, stride)])
            })
            .collect();
        Ok(MeshLayout {
            rank_map: ranks.into(),
            axes,
        })
    }

    pub(crate) fn with_axes(&self, axes: Vec<Axis>) -> MeshLayout {
        MeshLayout {
            rank_map: self.rank_map.clone(),
            axes,
        }
    }

    pub(crate) fn axes(&self) -> &[Axis] {
        &self.axes
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.axes.len()
    }

    /// The size of each dimension (torch's `mesh.shape`).
    pub fn shape(&self) -> Vec<usize> {
        self.axes.iter().map(Axis::numel).collect()
    }

    /// Number of ranks in one copy of the mesh.
    pub fn numel(&self) -> usize {
        self.axes.iter().map(Axis::numel).product()
    }

    /// The root mesh's ranks, row-major (torch's `_rank_map`).
    pub fn rank_map(&self) -> &[usize] {
        &self.rank_map
    }

    /// Every copy of the mesh, each row-major; torch's
    /// `_layout.remap_to_tensor(_rank_map)` with one row per copy.
    pub fn rows(&self) -> Vec<Vec<usize>> {
        let all = Axis::new(self.axes.iter().flat_map(|a| a.modes.iter().copied()));
        let inner = all.offsets();
        (all.complement(self.rank_map.len()).offsets().into_iter())
            .map(|o| inner.iter().map(|&i| self.rank_map[o + i]).collect())
            .collect()
    }

    /// The copy of the mesh that holds `rank`, row-major (torch's
    /// `DeviceMesh.mesh` on that rank, flattened); `None` if none does.
    pub fn mesh_of(&self, rank: usize) -> Option<Vec<usize>> {
        self.rows().into_iter().find(|row| row.contains(&rank))
    }

    /// `rank`'s coordinate in the copy of the mesh that holds it (torch's
    /// `get_coordinate`).
    pub fn coordinate_of(&self, rank: usize) -> Option<Vec<usize>> {
        let mesh = self.mesh_of(rank)?;
        let mut at = mesh.iter().position(|&r| r == rank)?;
        let mut coord = vec![0; self.ndim()];
        for (c, size) in coord.iter_mut().zip(self.shape()).rev() {
            *c = at % size;
            at /= size;
        }
        Some(coord)
    }

    /// The groups along `dim`, in torch's order (the order every rank
    /// makes them in), each in layout order (unsorted): the ranks that
    /// share every other coordinate.
    pub fn groups(&self, dim: usize) -> Result<Vec<Vec<usize>>> {
        Ok(self.with_axes(vec![self.axis(dim)?.clone()]).rows())
    }

    /// The group along `dim` that holds `rank`, in layout order.
    pub fn group_of(&self, dim: usize, rank: usize) -> Result<Vec<usize>> {
        (self.groups(dim)?.into_iter().find(|g| g.contains(&rank))).ok_or_else(|| {
            CommError::invalid(format!(
                "rank {rank} is not in this mesh of {:?}",
                self.rank_map
            ))
        })
    }

    pub(crate) fn axis(&self, dim: usize) -> Result<&Axis> {
        self.axes.get(dim).ok_or_else(|| {
            CommError::invalid(format!(
                "mesh dim {dim} is out of range: the mesh has {} dims",
                self.ndim()
            ))
        })
    }

    /// The mesh of `dims` only, in that order (torch's `mesh[names]`):
    /// refused where the dims would not keep the mesh's order, or overlap.
    pub fn slice(&self, dims: &[usize]) -> Result<MeshLayout> {
        let axes = dims
            .iter()
            .map(|&d| self.axis(d).cloned())
            .collect::<Result<Vec<_>>>()?;
        let out = self.with_axes(axes);
        out.check_slice(&format!("dims {dims:?}"))?;
        Ok(out)
    }

    /// torch's checks on a slice: strides that never grow (the mesh's
    /// order; size-1 dims do not count) and no overlap.
    pub(crate) fn check_slice(&self, what: &str) -> Result<()> {
        let all = self.flatten_axis();
        if !all.sorted() {
            return Err(CommError::invalid(format!(
                "cannot slice {what}: the dims must keep the mesh's order (torch: \"Mesh dim \
                 indices should be in ascending order\"); name them in the mesh's order"
            )));
        }
        if !all.orthogonal() {
            return Err(CommError::invalid(format!(
                "cannot slice {what}: the dims overlap (a flattened dim with one it holds); \
                 slice dims that share no rank positions"
            )));
        }
        Ok(())
    }

    pub(crate) fn flatten_axis(&self) -> Axis {
        Axis::new(self.axes.iter().flat_map(|a| a.modes.iter().copied()))
    }

    /// The mesh flattened into one dim (torch's `_flatten`'s layout).
    pub fn flatten(&self) -> MeshLayout {
        self.with_axes(vec![self.flatten_axis()])
    }

    /// Dim `dim` split into row-major `sizes` (torch's `_unflatten`'s
    /// layout); their product must be the dim's size.
    pub fn unflatten(&self, dim: usize, sizes: &[usize]) -> Result<MeshLayout> {
        let axis = self.axis(dim)?;
        let n = numel(sizes)?;
        if n != axis.numel() {
            return Err(CommError::invalid(format!(
                "cannot unflatten mesh dim {dim} of size {} into {sizes:?}, whose product is \
                 {n}; the sizes must multiply to the dim's size",
                axis.numel()
            )));
        }
        let parts = axis.split(sizes).ok_or_else(|| {
            CommError::invalid(format!(
                "cannot unflatten mesh dim {dim} into {sizes:?}: the sizes cut its layout {:?} \
                 where no mode divides; choose sizes that divide its flattened parts",
                axis.modes
            ))
        })?;
        let mut axes = self.axes.clone();
        axes.splice(dim..=dim, parts);
        Ok(self.with_axes(axes))
    }
}

/// The product of `shape`, refused when empty, holding a 0, or overflowing.
fn numel(shape: &[usize]) -> Result<usize> {
    if shape.is_empty() {
        return Err(CommError::invalid(
            "a mesh shape needs at least one dim; pass [world] for a 1-D mesh",
        ));
    }
    if let Some(d) = shape.iter().position(|&s| s == 0) {
        return Err(CommError::invalid(format!(
            "mesh shape {shape:?} has size 0 at dim {d}; every dim holds at least 1 rank"
        )));
    }
    shape
        .iter()
        .try_fold(1usize, |acc, &s| acc.checked_mul(s))
        .ok_or_else(|| CommError::invalid(format!("mesh shape {shape:?} overflows usize")))
}
