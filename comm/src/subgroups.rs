//! Subgroups with torch's semantics, on any backend that can make them:
//! [`ProcessGroup::new_group`], [`ProcessGroup::new_subgroups`],
//! [`ProcessGroup::new_subgroups_by_enumeration`],
//! [`ProcessGroup::split_group`] and [`ProcessGroup::split`].
//!
//! This module owns the rules for the rank lists (sorting, duplicates,
//! ranges, overlaps) and the check that every rank passed the same lists;
//! the backend's [`crate::Backend::new_group`] only makes a group from a
//! list already checked and in group-rank order.
//!
//! Every rank of the parent must make the same subgroups in the same order,
//! members or not, as in torch. Making a group is itself a call on the
//! parent (a small `all_gather` that compares the lists), so a rank that
//! passed another list gets an error instead of a hang; not on a backend
//! whose group torch ranks share ([`crate::Backend::may_add_calls`]).

use std::time::Duration;

use crate::{CallOptions, CommError, ProcessGroup, Result, validate::group_ranks};

/// Options of [`ProcessGroup::new_group_with`].
#[derive(Clone, Copy, Debug)]
pub struct GroupOptions {
    /// Sort the ranks first (torch's `sort_ranks=True`, the default): a
    /// member's group rank is its index in the sorted list. With `false`
    /// the list's order is kept.
    pub sort_ranks: bool,
    /// The new group's default timeout; `None` inherits the parent's.
    pub timeout: Option<Duration>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            sort_ranks: true,
            timeout: None,
        }
    }
}

fn fnv(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for w in words {
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl ProcessGroup {
    /// `new_group(ranks)` with torch's defaults: the ranks are sorted, and
    /// an empty list means every rank. Members get `Some(group)`, in which
    /// their rank is their index in the sorted list; other ranks get `None`.
    ///
    /// Every rank of this group must call it with the same list, and make
    /// its subgroups in the same order; a rank that passes another list
    /// fails (all of them do), naming it.
    pub async fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        self.new_group_with(ranks, &GroupOptions::default()).await
    }

    /// `new_group` with [`GroupOptions`] (`sort_ranks`, `timeout`).
    pub async fn new_group_with(
        &self,
        ranks: &[usize],
        opts: &GroupOptions,
    ) -> Result<Option<ProcessGroup>> {
        let list = group_ranks(ranks, self.world_size(), opts.sort_ranks)?;
        self.agree("new_group", std::slice::from_ref(&list)).await?;
        self.make(&list, opts.timeout).await
    }

    /// `new_subgroups(size)`: the consecutive blocks of `size` ranks, each a
    /// group. Returns this rank's group and every block's ranks.
    pub async fn new_subgroups(&self, size: usize) -> Result<(ProcessGroup, Vec<Vec<usize>>)> {
        let world = self.world_size();
        if size == 0 || !world.is_multiple_of(size) {
            return Err(CommError::invalid(format!(
                "new_subgroups needs a group size that divides the world size {world}; got \
                 {size}"
            )));
        }
        let lists: Vec<Vec<usize>> = (0..world / size)
            .map(|b| (b * size..(b + 1) * size).collect())
            .collect();
        let (mine, lists) = self.new_subgroups_by_enumeration(&lists).await?;
        let mine = mine.ok_or_else(|| {
            CommError::invalid("internal: new_subgroups left this rank out of every block")
        })?;
        Ok((mine, lists))
    }

    /// `new_subgroups_by_enumeration`: one group per list (sorted), which
    /// must not overlap. Returns this rank's group (`None` when no list
    /// names it) and the lists.
    pub async fn new_subgroups_by_enumeration(
        &self,
        ranks_per_subgroup: &[Vec<usize>],
    ) -> Result<(Option<ProcessGroup>, Vec<Vec<usize>>)> {
        let lists = self.check_disjoint(ranks_per_subgroup, true)?;
        self.agree("new_subgroups", &lists).await?;
        let mut mine = None;
        for l in &lists {
            if let Some(g) = self.make(l, None).await? {
                mine = Some(g);
            }
        }
        Ok((mine, lists))
    }

    /// `split_group(split_ranks)`: one group per list, in the list's order
    /// (not sorted); the lists must not overlap. Ranks no list names get
    /// `None`.
    pub async fn split_group(&self, split_ranks: &[Vec<usize>]) -> Result<Option<ProcessGroup>> {
        let opts = GroupOptions {
            sort_ranks: false,
            timeout: None,
        };
        self.split_group_with(split_ranks, &opts).await
    }

    /// `split_group` with [`GroupOptions`]: `sort_ranks` sorts each list
    /// (as `new_group` would), `timeout` is every new group's default.
    pub async fn split_group_with(
        &self,
        split_ranks: &[Vec<usize>],
        opts: &GroupOptions,
    ) -> Result<Option<ProcessGroup>> {
        self.own_calls("split_group")?;
        let lists = self.check_disjoint(split_ranks, opts.sort_ranks)?;
        self.agree("split_group", &lists).await?;
        let mut mine = None;
        for l in &lists {
            if let Some(g) = self.make(l, opts.timeout).await? {
                mine = Some(g);
            }
        }
        Ok(mine)
    }

    /// `ncclCommSplit`'s form: ranks that pass the same `color` form a group,
    /// ordered by `key` and then by rank; a rank that passes `None` joins
    /// none and gets `None`. Every rank of this group calls it.
    pub async fn split(&self, color: Option<u32>, key: i64) -> Result<Option<ProcessGroup>> {
        self.own_calls("split")?;
        let mine = [color.map_or(u64::MAX, u64::from), key as u64];
        let all = self.all_gather_vec(&mine).await?;
        let mut colors: Vec<u64> = all.chunks(2).map(|c| c[0]).collect();
        colors.sort_unstable();
        colors.dedup();
        let mut made = None;
        for c in colors.into_iter().filter(|&c| c != u64::MAX) {
            let mut members: Vec<(i64, usize)> = all
                .chunks(2)
                .enumerate()
                .filter(|(_, ck)| ck[0] == c)
                .map(|(r, ck)| (ck[1] as i64, r))
                .collect();
            members.sort_unstable();
            let list: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
            if let Some(g) = self.make(&list, None).await? {
                made = Some(g);
            }
        }
        Ok(made)
    }

    fn check_disjoint(&self, lists: &[Vec<usize>], sort: bool) -> Result<Vec<Vec<usize>>> {
        let world = self.world_size();
        let mut seen = vec![false; world];
        let mut out = Vec::with_capacity(lists.len());
        for l in lists {
            if l.is_empty() {
                return Err(CommError::invalid("a subgroup's rank list is empty"));
            }
            let l = group_ranks(l, world, sort)?;
            for &r in &l {
                if std::mem::replace(&mut seen[r], true) {
                    return Err(CommError::invalid(format!(
                        "rank {r} is in more than one subgroup; the lists must not overlap"
                    )));
                }
            }
            out.push(l);
        }
        Ok(out)
    }

    /// Refuses `what`, which makes calls or encodings of consort's own,
    /// on a group that torch ranks may share ([`crate::Backend::may_add_calls`]):
    /// they would make other calls, or read other bytes.
    pub(crate) fn own_calls(&self, what: &str) -> Result<()> {
        if self.backend().may_add_calls() {
            return Ok(());
        }
        Err(CommError::unsupported(format!(
            "{what} makes calls of consort's own, which torch's ranks in this {} group would not \
             make; use what torch's ranks call (new_group, the collectives)",
            self.backend().name()
        )))
    }

    /// Checks that every rank passed the same lists to `what`, where the
    /// backend lets consort make a call of its own for it (not where torch
    /// ranks share the group: they make no such call).
    async fn agree(&self, what: &str, lists: &[Vec<usize>]) -> Result<()> {
        if !self.backend().may_add_calls() {
            return Ok(());
        }
        let words = what.bytes().map(u64::from).chain(
            lists
                .iter()
                .flat_map(|l| std::iter::once(u64::MAX).chain(l.iter().map(|&r| r as u64))),
        );
        let mine = [fnv(words)];
        let all = self.all_gather_vec(&mine).await?;
        let differ: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
        if differ.is_empty() {
            return Ok(());
        }
        Err(CommError::invalid(format!(
            "{what}: ranks {differ:?} passed other rank lists than rank 0 (this rank, {}, passed \
             {lists:?}); every rank of the parent must make the same groups in the same order",
            self.rank()
        )))
    }

    async fn make(
        &self,
        list: &[usize],
        timeout: Option<Duration>,
    ) -> Result<Option<ProcessGroup>> {
        let opts = CallOptions {
            timeout,
            ..Default::default()
        };
        Ok(self
            .backend()
            .new_group(list, &opts)
            .await?
            .map(ProcessGroup::new))
    }
}

#[cfg(test)]
mod tests {
    use crate::validate::group_ranks;

    #[test]
    fn rank_lists_follow_torch() {
        assert_eq!(group_ranks(&[3, 1], 4, true).unwrap(), vec![1, 3]);
        assert_eq!(group_ranks(&[3, 1], 4, false).unwrap(), vec![3, 1]);
        assert_eq!(group_ranks(&[], 3, true).unwrap(), vec![0, 1, 2]);
        for (bad, what) in [
            (&[1, 1][..], "twice"),
            (&[4][..], "not in the parent"),
            (&[0, 1, 2, 3, 0][..], "cannot be made"),
        ] {
            let e = group_ranks(bad, 4, true).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
    }
}
