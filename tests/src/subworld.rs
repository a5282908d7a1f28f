//! [`on_subgroup`]: a world that is a subgroup of a bigger one, so that the
//! whole conformance body runs on subgroups too (`conformance!` mounted on
//! a factory that calls it).
//!
//! The parent has two ranks more than the subgroup asks for. Parent ranks 0
//! and 2 stay out; the rest form the subgroup, listed in reverse and kept
//! in list order (`sort_ranks: false`), so that a member's group rank, its
//! parent rank and its place in the sorted list all differ: for a subgroup
//! of 3, parent ranks {4, 3, 1} of 5 are group ranks 0, 1, 2.
//!
//! The two outsiders leave once the subgroup is made: their handles drop,
//! as a process that exits, which breaks the parent (a lost member) but not
//! the subgroup, whose members never talk to them. (An outsider that stayed
//! alive and idle would hold the simulator's virtual time back, as any idle
//! rank does.) Each member's handle keeps its own parent handle, so a
//! member whose test body ends leaves the world as its process would.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use consort_comm::{Backend, CallOptions, GroupId, Op, ProcessGroup, Result, Work};

use crate::{Factory, WorldFuture};

/// The parent ranks that form the subgroup of `n`, in group-rank order.
pub fn subgroup_ranks(n: usize) -> Vec<usize> {
    let parent = n + 2;
    let mut list: Vec<usize> = (0..parent).filter(|&r| r != 0 && r != 2).collect();
    list.reverse();
    list
}

/// A world of `n` ranks that is a subgroup of a world of `n + 2` made by
/// `factory` (see the module docs), in group-rank order.
pub fn on_subgroup(factory: Factory, n: usize) -> WorldFuture {
    Box::pin(async move {
        let parents: Vec<ProcessGroup> = factory(n + 2)
            .await
            .into_iter()
            .map(ProcessGroup::new)
            .collect();
        let list = subgroup_ranks(n);
        // The trait's `new_group` (the list already in torch's form), not
        // `ProcessGroup::new_group`: its agreement all_gather would leave
        // the first rank done idle while the others finish, which holds the
        // simulator's virtual time back until the test body starts. The
        // agreement has its own properties in `concurrency`.
        let mut subs = Vec::with_capacity(n);
        for (r, pg) in parents.iter().enumerate() {
            let got = pg
                .backend()
                .new_group(&list, &CallOptions::default())
                .await
                .unwrap_or_else(|e| panic!("new_group({list:?}) on parent rank {r}: {e}"));
            assert_eq!(got.is_some(), list.contains(&r), "membership of {r}");
            subs.extend(got.map(|sub| (r, ProcessGroup::new(sub))));
        }
        subs.sort_by_key(|(_, sub)| sub.rank());
        let mut parents: Vec<Option<ProcessGroup>> = parents.into_iter().map(Some).collect();
        subs.into_iter()
            .map(|(r, sub)| {
                Arc::new(Member {
                    inner: sub.backend().clone(),
                    _parent: parents[r].take().expect("one subgroup per parent rank"),
                }) as Arc<dyn Backend>
            })
            .collect()
    })
}

/// A subgroup handle that keeps its own parent handle alive.
struct Member {
    inner: Arc<dyn Backend>,
    _parent: ProcessGroup,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member")
            .field("inner", &self.inner)
            .finish()
    }
}

#[async_trait]
impl Backend for Member {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn group_id(&self) -> GroupId {
        self.inner.group_id()
    }

    fn default_timeout(&self) -> Duration {
        self.inner.default_timeout()
    }

    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        self.inner.submit(op, opts)
    }

    async fn synchronize(&self) -> Result<()> {
        self.inner.synchronize().await
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        self.inner.new_group(ranks, opts).await
    }
}
