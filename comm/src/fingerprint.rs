//! What identifies one collective call: [`OpKind`], [`GroupId`] and the
//! [`Fingerprint`] that every rank sends with its first frame of a call.
//!
//! This module owns the identity of a call and the comparison that turns a
//! disagreement into [`crate::CommError::Mismatch`]. It does not own the
//! bytes that carry it; see [`crate::frame`].

use std::fmt;

use crate::{DType, ReduceOp};

/// Which collective (or point-to-point op) a call is.
///
/// The discriminants are wire codes and never change meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum OpKind {
    /// `all_reduce`.
    AllReduce = 1,
    /// `broadcast`.
    Broadcast = 2,
    /// `reduce`.
    Reduce = 3,
    /// `all_gather`.
    AllGather = 4,
    /// `gather`.
    Gather = 5,
    /// `scatter`.
    Scatter = 6,
    /// `reduce_scatter`.
    ReduceScatter = 7,
    /// `all_to_all_single` (equal or uneven splits).
    AllToAll = 8,
    /// `barrier`.
    Barrier = 9,
    /// `send` (point-to-point).
    Send = 10,
    /// `recv` (point-to-point).
    Recv = 11,
    /// `new_group` (the setup exchange of a subgroup).
    NewGroup = 12,
}

impl OpKind {
    /// Every op kind, in code order.
    pub const ALL: [OpKind; 12] = [
        OpKind::AllReduce,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::AllGather,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::Barrier,
        OpKind::Send,
        OpKind::Recv,
        OpKind::NewGroup,
    ];

    /// The snake_case name, as in `torch.distributed`.
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllGather => "all_gather",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "all_to_all_single",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::NewGroup => "new_group",
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// Decodes a wire code; `None` for codes this version does not know.
    pub fn from_code(code: u8) -> Option<OpKind> {
        OpKind::ALL.into_iter().find(|k| k.code() == code)
    }

    /// Whether the op has a meaningful root rank.
    pub const fn has_root(self) -> bool {
        matches!(
            self,
            OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter
        )
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Identifies a process group. The default (world) group is `GroupId::WORLD`.
///
/// Subgroup ids are derived from the parent id and the member ranks, so that
/// every member computes the same id without talking to anyone
/// ([`GroupId::subgroup`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(pub u32);

impl GroupId {
    /// The default group of all ranks (`torch.distributed.group.WORLD`).
    pub const WORLD: GroupId = GroupId(0);

    /// The id of the subgroup of `parent` made of `ranks` (ranks of the
    /// parent, in the order given). FNV-1a over the parent id and the ranks;
    /// never returns [`GroupId::WORLD`].
    pub fn subgroup(parent: GroupId, ranks: &[usize]) -> GroupId {
        let mut h: u32 = 0x811c_9dc5;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                h ^= u32::from(b);
                h = h.wrapping_mul(0x0100_0193);
            }
        };
        eat(&parent.0.to_le_bytes());
        eat(&(ranks.len() as u64).to_le_bytes());
        for &r in ranks {
            eat(&(r as u64).to_le_bytes());
        }
        GroupId(if h == 0 { 1 } else { h })
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == GroupId::WORLD {
            f.write_str("world")
        } else {
            write!(f, "group {:#010x}", self.0)
        }
    }
}

/// The identity of one collective call: `(group, seq, op, dtype, count,
/// root)`, plus the reduce op for reducing collectives.
///
/// Every rank sends its fingerprint with its first frame of a call and checks
/// the one it receives. Two ranks that disagree get
/// [`crate::CommError::Mismatch`] naming both sides, instead of a hang or a
/// silently wrong result. PyTorch only checks this in `TORCH_DISTRIBUTED_DEBUG
/// =DETAIL`; consort always does, because it costs a frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    /// The process group.
    pub group: GroupId,
    /// The call's sequence number in its group, starting at 0.
    pub seq: u64,
    /// Which op.
    pub op: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Element count of the call as this rank sees it (the input length for
    /// ops whose input and output differ).
    pub count: u64,
    /// Root rank for rooted ops, 0 otherwise.
    pub root: u32,
    /// The reduce op for all_reduce, reduce and reduce_scatter.
    pub reduce_op: Option<ReduceOp>,
}

/// What a call is, apart from where it stands: the fields of its
/// [`Fingerprint`] that its arguments fix. Computed once per call, from its
/// op ([`crate::Op::shape`]), and placed in its group's sequence by the
/// engine ([`Shape::at`]) when the call is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Which op.
    pub op: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Element count as this rank sees it (see [`Fingerprint::count`]).
    pub count: u64,
    /// Root rank for rooted ops, 0 otherwise.
    pub root: u32,
    /// The reduce op as compared (see [`ReduceOp::compared`]).
    pub reduce_op: Option<ReduceOp>,
}

impl Shape {
    /// The fingerprint of this call as call `seq` of `group`.
    pub fn at(self, group: GroupId, seq: u64) -> Fingerprint {
        Fingerprint {
            group,
            seq,
            op: self.op,
            dtype: self.dtype,
            count: self.count,
            root: self.root,
            reduce_op: self.reduce_op,
        }
    }
}

/// A call of `op` on 4 `f32`s (an all_reduce sums), for tests.
#[cfg(test)]
pub(crate) fn test_shape(op: OpKind) -> Shape {
    Shape {
        op,
        dtype: DType::F32,
        count: 4,
        root: 0,
        reduce_op: (op == OpKind::AllReduce).then_some(ReduceOp::Sum),
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} #{} on {}: {} x {}",
            self.op, self.seq, self.group, self.count, self.dtype
        )?;
        if let Some(r) = self.reduce_op {
            write!(f, ", op={r}")?;
        }
        if self.op.has_root() {
            write!(f, ", root={}", self.root)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_codes_round_trip() {
        for k in OpKind::ALL {
            assert_eq!(OpKind::from_code(k.code()), Some(k));
        }
        assert_eq!(OpKind::from_code(0), None);
        assert_eq!(OpKind::from_code(200), None);
    }

    #[test]
    fn subgroup_ids_depend_on_members_and_parent() {
        let a = GroupId::subgroup(GroupId::WORLD, &[0, 1]);
        assert_eq!(a, GroupId::subgroup(GroupId::WORLD, &[0, 1]));
        assert_ne!(a, GroupId::subgroup(GroupId::WORLD, &[0, 2]));
        assert_ne!(a, GroupId::subgroup(a, &[0, 1]));
        assert_ne!(a, GroupId::WORLD);
    }

    #[test]
    fn fingerprint_display_names_everything() {
        let f = Fingerprint {
            group: GroupId::WORLD,
            seq: 7,
            op: OpKind::Broadcast,
            dtype: DType::F32,
            count: 10,
            root: 2,
            reduce_op: None,
        };
        assert_eq!(f.to_string(), "broadcast #7 on world: 10 x float32, root=2");
    }
}
