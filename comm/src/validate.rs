//! Argument checks that every backend runs before it moves a byte, so that
//! every backend rejects the same bad calls with the same message.
//!
//! This module owns the shape rules of each op (lengths, roots, splits,
//! peers, subgroup lists). The errors carry no context; a backend adds its
//! op, rank and seq with [`crate::CommError::with_context`].

use crate::{CommError, DType, Result};

/// `root` must be a rank of the group.
pub fn root(root: usize, world_size: usize) -> Result<()> {
    if root < world_size {
        Ok(())
    } else {
        Err(CommError::invalid(format!(
            "root {root} is out of range for a group of {world_size} ranks (valid roots: 0..={})",
            world_size.saturating_sub(1)
        )))
    }
}

/// Gather's output and scatter's input: the root passes the buffer, and
/// only the root. `what` names it (`"an output"`, `"an input"`).
pub fn root_only(op: &str, what: &str, present: bool, rank: usize, root: usize) -> Result<()> {
    match (present, rank == root) {
        (true, true) | (false, false) => Ok(()),
        (false, true) => Err(CommError::invalid(format!(
            "{op}: the root (rank {root}) must pass {what} buffer"
        ))),
        (true, false) => Err(CommError::invalid(format!(
            "{op}: only the root (rank {root}) passes {what} buffer; pass None on rank {rank}"
        ))),
    }
}

/// A point-to-point peer must be another rank of the group.
pub fn peer(peer: usize, rank: usize, world_size: usize) -> Result<()> {
    if peer >= world_size {
        return Err(CommError::invalid(format!(
            "peer rank {peer} is out of range for a group of {world_size} ranks"
        )));
    }
    if peer == rank {
        return Err(CommError::invalid(format!(
            "rank {rank} cannot send to or receive from itself; copy the buffer locally instead"
        )));
    }
    Ok(())
}

/// Input and output of one call must hold the same dtype.
pub fn same_dtype(output: DType, input: DType) -> Result<()> {
    if output == input {
        Ok(())
    } else {
        Err(CommError::invalid(format!(
            "output holds {output} but input holds {input}; both buffers of a call need the \
             same dtype"
        )))
    }
}

/// `output.len() == world_size * input.len()` for all_gather and
/// reduce_scatter (with the roles of the two lengths named by `what`).
pub fn whole_times_world(
    whole_len: usize,
    part_len: usize,
    world_size: usize,
    what: &str,
) -> Result<()> {
    if part_len.checked_mul(world_size) == Some(whole_len) {
        Ok(())
    } else {
        Err(CommError::invalid(format!(
            "{what}: the whole buffer has {whole_len} elements but must have world_size × part = \
             {world_size} × {part_len} = {}",
            part_len.saturating_mul(world_size)
        )))
    }
}

/// Split sizes for `all_to_all_single`: returns each part's length, checking
/// that the list (if given) has one entry per rank and sums to `len`.
pub fn splits(
    sizes: Option<&[usize]>,
    len: usize,
    world_size: usize,
    side: &str,
) -> Result<Vec<usize>> {
    match sizes {
        None => {
            if world_size == 0 || !len.is_multiple_of(world_size) {
                return Err(CommError::invalid(format!(
                    "{side} of {len} elements cannot be split equally over {world_size} ranks; \
                     pass {side}_split_sizes"
                )));
            }
            Ok(vec![len / world_size; world_size])
        }
        Some(s) => {
            if s.len() != world_size {
                return Err(CommError::invalid(format!(
                    "{side}_split_sizes has {} entries but the group has {world_size} ranks",
                    s.len()
                )));
            }
            let total = s.iter().try_fold(0usize, |a, b| a.checked_add(*b));
            if total != Some(len) {
                return Err(CommError::invalid(format!(
                    "{side}_split_sizes sum to {} but the {side} buffer has {len} elements",
                    total.map_or("more than usize::MAX".to_string(), |t| t.to_string())
                )));
            }
            Ok(s.to_vec())
        }
    }
}

/// Every argument check of one call that does not need its memory: roots,
/// root-only buffers, dtypes, lengths against the world, splits, peers and
/// the reduce op's dtype. `rank` of `world` makes the call, `root_rank` is
/// `CallOptions::root`. Stream-ordered backends run it before a call takes
/// its place in the order, so a bad call fails alone; schedule backends
/// run it in `algo::exec::Call::from_op`. This is the one place every
/// backend's calls are checked. Errors carry the op and the rank.
pub fn op(op: &crate::Op<'_>, rank: usize, world: usize, root_rank: usize) -> Result<()> {
    let ctx = crate::ErrorContext {
        op: Some(op.kind()),
        rank: Some(rank),
        ..Default::default()
    };
    shape(op, rank, world, root_rank).map_err(|e| e.with_context(ctx))
}

fn shape(op: &crate::Op<'_>, rank: usize, world: usize, root_rank: usize) -> Result<()> {
    use crate::Op;
    let rooted = |r: usize| root(r, world);
    match op {
        Op::AllReduce { buf, op } => op.check(buf.dtype()),
        Op::Broadcast { .. } => rooted(root_rank),
        Op::Reduce { buf, op } => rooted(root_rank).and_then(|()| op.check(buf.dtype())),
        Op::AllGather { output, input } => {
            same_dtype(output.dtype(), input.dtype())?;
            whole_times_world(output.len(), input.len(), world, "all_gather output")
        }
        Op::Gather { output, input } => {
            rooted(root_rank)?;
            root_only("gather", "an output", output.is_some(), rank, root_rank)?;
            match output {
                Some(o) => {
                    same_dtype(o.dtype(), input.dtype())?;
                    whole_times_world(o.len(), input.len(), world, "gather output")
                }
                None => Ok(()),
            }
        }
        Op::Scatter { output, input } => {
            rooted(root_rank)?;
            root_only("scatter", "an input", input.is_some(), rank, root_rank)?;
            match input {
                Some(i) => {
                    same_dtype(output.dtype(), i.dtype())?;
                    whole_times_world(i.len(), output.len(), world, "scatter input")
                }
                None => Ok(()),
            }
        }
        Op::ReduceScatter { output, input, op } => {
            same_dtype(output.dtype(), input.dtype())?;
            whole_times_world(input.len(), output.len(), world, "reduce_scatter input")?;
            op.check(output.dtype())
        }
        Op::AllToAll {
            output,
            input,
            output_splits,
            input_splits,
        } => {
            same_dtype(output.dtype(), input.dtype())?;
            splits(*output_splits, output.len(), world, "output")?;
            splits(*input_splits, input.len(), world, "input").map(|_| ())
        }
        Op::Barrier => Ok(()),
        Op::Send { dst: p, .. } | Op::Recv { src: p, .. } => peer(*p, rank, world),
    }
}

/// Checks one rank list against a parent of `world` ranks: no duplicates,
/// no rank outside the parent, no longer than it. An empty list means every
/// rank, as in torch.
pub fn group_ranks(ranks: &[usize], world: usize, sort: bool) -> Result<Vec<usize>> {
    if ranks.is_empty() {
        return Ok((0..world).collect());
    }
    if ranks.len() > world {
        return Err(CommError::invalid(format!(
            "a group of {} ranks cannot be made from a group of {world}",
            ranks.len()
        )));
    }
    if let Some(&r) = ranks.iter().find(|&&r| r >= world) {
        return Err(CommError::invalid(format!(
            "rank {r} is not in the parent group, whose ranks are 0..{world}"
        )));
    }
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(CommError::invalid(format!(
            "rank {} appears twice in the group's rank list {ranks:?}",
            w[0]
        )));
    }
    Ok(if sort { sorted } else { ranks.to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_and_peers() {
        assert!(root(3, 4).is_ok());
        let e = root(4, 4).unwrap_err().to_string();
        assert!(
            e.contains("root 4 is out of range for a group of 4 ranks"),
            "{e}"
        );
        assert!(peer(1, 0, 2).is_ok());
        assert!(peer(0, 0, 2).is_err());
        assert!(peer(2, 0, 2).is_err());
    }

    #[test]
    fn lengths() {
        assert!(whole_times_world(12, 3, 4, "all_gather").is_ok());
        assert!(whole_times_world(0, 0, 4, "all_gather").is_ok());
        assert!(whole_times_world(13, 3, 4, "all_gather").is_err());
        assert!(whole_times_world(usize::MAX, usize::MAX, 4, "x").is_err());
    }

    #[test]
    fn all_to_all_splits() {
        assert_eq!(splits(None, 6, 3, "input").unwrap(), vec![2, 2, 2]);
        assert!(splits(None, 7, 3, "input").is_err());
        assert_eq!(
            splits(Some(&[0, 5, 2]), 7, 3, "input").unwrap(),
            vec![0, 5, 2]
        );
        assert!(splits(Some(&[1, 1]), 2, 3, "output").is_err());
        assert!(splits(Some(&[1, 1, 1]), 2, 3, "output").is_err());
        assert!(splits(Some(&[usize::MAX, 2, 0]), 1, 3, "output").is_err());
    }
}
