//! Continuing without a lost rank: [`OnPeerLost::Shrink`], beyond what
//! torchrun does (it restarts the whole world).
//!
//! When a step fails because a peer is gone, the survivors:
//! 1. agree on who is left through the store: each writes that it is
//!    alive; once every rank but the lost ones has (or the deadline has
//!    passed), the first to look closes the list with a compare-and-set,
//!    and everyone takes the closed list;
//! 2. make a group of the survivors from the current one (no call on the
//!    broken group: a subgroup is agreed on, not negotiated);
//! 3. move DDP onto it (a new bucket worker, ranks renumbered in the old
//!    order) and drop the failed step's gradients.
//!
//! `finish` then returns [`DdpError::Shrunk`] with the new rank and world
//! size: the step did not happen, and the caller redoes it on the new
//! group (re-sharding its data, keeping the global batch).

use std::{sync::Arc, time::Duration};

use consort_comm::{Backend, CommError, store::Store};
use tokio::sync::mpsc;

use super::{Ddp, DdpError, on_group};
use crate::worker::worker;

/// Rank 0's id for this wrapper's shrink keys, to every rank.
pub(super) async fn job_id<B: Backend + ?Sized>(
    backend: &B,
    call: &consort_comm::CallOptions,
) -> Result<u64, DdpError> {
    let mut id = [0u64];
    if backend.rank() == 0 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        id[0] = t ^ (u64::from(std::process::id()) << 32);
    }
    let root = consort_comm::CallOptions { root: 0, ..*call };
    backend
        .broadcast(consort_comm::BufferMut::from(&mut id[..]), &root)
        .await
        .map_err(|source| DdpError::Comm {
            what: "broadcast of the shrink id".into(),
            source: Box::new(source),
        })?;
    Ok(id[0])
}

/// What [`Ddp`] does when a step fails because a peer is gone.
#[derive(Clone, Debug, Default)]
pub enum OnPeerLost {
    /// Fail, and stay failed (torch; a launcher restarts the world).
    #[default]
    Fail,
    /// Agree with the other survivors on who is left, through `store`,
    /// waiting at most `timeout` for them, and continue on a group of the
    /// survivors ([`DdpError::Shrunk`]).
    Shrink {
        /// A store every rank reaches (the job's rendezvous store).
        store: Arc<dyn Store>,
        /// How long the survivors wait for each other.
        timeout: Duration,
    },
}

impl<B: Backend + ?Sized + 'static> Ddp<B> {
    /// Whether `e` is a lost peer that the options say to shrink past:
    /// `PeerLost`, or a call that failed after one while the backend knows
    /// a peer is gone (a stream-ordered communicator fails the calls made
    /// after its first failure as aborted by it, and a call waiting on a
    /// dead peer may end at its deadline; [`Backend::lost_peers`] of the
    /// current group names the rank either way).
    pub(super) fn shrinkable(&self, e: &DdpError) -> bool {
        if !matches!(self.opts.on_peer_lost, OnPeerLost::Shrink { .. }) {
            return false;
        }
        let DdpError::Comm { source, .. } = e else {
            return false;
        };
        match **source {
            CommError::PeerLost { .. } => true,
            // The group DDP runs on now (after a shrink, the survivors'):
            // the failed group it left still lists the rank it lost.
            CommError::Aborted { .. } | CommError::Backend { .. } | CommError::Timeout { .. } => {
                !on_group!(self, b => b.lost_peers()).is_empty()
            }
            _ => false,
        }
    }

    /// A collective of the caller's own (a metric's all-reduce, say)
    /// failed with `error`: under [`OnPeerLost::Shrink`], when a peer is
    /// lost, agree with the survivors (who meet the same failure) and move
    /// onto their group, as [`Ddp::finish`] does. Returns
    /// [`DdpError::Shrunk`], or `error` unchanged when the policy is to
    /// fail or no peer was lost.
    pub async fn shrink_after(&mut self, error: DdpError) -> DdpError {
        if self.shrinkable(&error) {
            // Buckets the worker still holds come back first.
            if self.in_flight > 0 {
                let _ = self.drain().await;
            }
            self.shrink(error).await
        } else {
            error
        }
    }

    /// Moves onto a group of the survivors after `cause`; returns
    /// [`DdpError::Shrunk`], or why it could not.
    pub(super) async fn shrink(&mut self, cause: DdpError) -> DdpError {
        let OnPeerLost::Shrink { store, timeout } = self.opts.on_peer_lost.clone() else {
            return cause;
        };
        let (me, world) = (self.rank, self.world_size());
        let prefix = format!(
            "consort/ddp/shrink/{:016x}/{}",
            self.shrink_id, self.shrinks
        );
        // Where this rank is: the survivors must all be at the same step
        // (a call can finish on some ranks when the lost peer had sent its
        // part to them and not to others).
        let at = format!("{},{}", self.steps, self.rebuilt);
        let agreed =
            on_group!(self, b => agree(b, &*store, &prefix, me, world, &at, timeout).await);
        let members = match agreed {
            Ok(m) => m,
            Err(why) => return self.fail(self.usage(why)),
        };
        if !members.contains(&me) {
            let why = format!(
                "rank {me} was left out of the survivors {members:?} (it reported too late); it \
                 cannot continue with them"
            );
            return self.fail(self.usage(why));
        }
        let call = self.call;
        let made = on_group!(self, b => b.new_group(&members, &call).await);
        let group = match made {
            Ok(Some(g)) => g,
            Ok(None) => return self.fail(self.usage("the survivors' group left this rank out")),
            Err(source) => {
                let e = DdpError::Comm {
                    what: "making the survivors' group".into(),
                    source: Box::new(source),
                };
                return self.fail(e);
            }
        };
        let lost: Vec<usize> = (0..world).filter(|r| !members.contains(r)).collect();
        let (jobs, job_rx) = mpsc::unbounded_channel();
        let (done_tx, done) = mpsc::unbounded_channel();
        let old = std::mem::replace(
            &mut self.worker,
            tokio::spawn(worker(
                group.clone(),
                self.opts.comm_hook,
                self.call,
                job_rx,
                done_tx,
            )),
        );
        old.abort();
        self.jobs = jobs;
        self.done = done;
        self.in_flight = 0;
        self.rank = group.rank();
        self.group = Some(group);
        self.shrinks += 1;
        self.failed = None;
        self.reset_step();
        DdpError::Shrunk {
            rank: self.rank,
            world: members.len(),
            lost,
            cause: Box::new(cause),
        }
    }
}

/// The survivors, as every one of them sees it: ranks (of the current
/// group) that wrote they are alive before the list closed.
async fn agree<G: Backend + ?Sized>(
    group: &G,
    store: &dyn Store,
    p: &str,
    me: usize,
    world: usize,
    at: &str,
    timeout: Duration,
) -> Result<Vec<usize>, String> {
    let members = close(group, store, p, me, world, at, timeout).await?;
    let fail = store_error(me);
    for &r in &members {
        let theirs = store.get(&format!("{p}/alive/{r}")).await.map_err(fail)?;
        if theirs != at.as_bytes() {
            return Err(format!(
                "the survivors are not all at the same step: rank {r} is at (steps, rebuilt) = \
                 ({}), rank {me} at ({at}); the lost rank's part reached some of them. Restart \
                 from the last checkpoint",
                String::from_utf8_lossy(&theirs)
            ));
        }
    }
    Ok(members)
}

/// Writes that this rank is alive (and where), and returns the closed list
/// of ranks that did.
async fn close<G: Backend + ?Sized>(
    group: &G,
    store: &dyn Store,
    p: &str,
    me: usize,
    world: usize,
    at: &str,
    timeout: Duration,
) -> Result<Vec<usize>, String> {
    let fail = store_error(me);
    store
        .set(&format!("{p}/alive/{me}"), at.as_bytes())
        .await
        .map_err(fail)?;
    let closed = format!("{p}/members");
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if store.check(&[&closed]).await.map_err(fail)? {
            let v = store.get(&closed).await.map_err(fail)?;
            return Ok(decode(&v));
        }
        let mut alive = Vec::new();
        for r in 0..world {
            if store
                .check(&[&format!("{p}/alive/{r}")])
                .await
                .map_err(fail)?
            {
                alive.push(r);
            }
        }
        if alive.len() + 1 >= world || tokio::time::Instant::now() >= deadline {
            let list = alive
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let v = store
                .compare_set(&closed, b"", list.as_bytes())
                .await
                .map_err(fail)?;
            return Ok(decode(&v));
        }
        // Idle on the old group too: the simulator lets the peers' failing
        // calls progress meanwhile.
        group.idle(Duration::from_millis(20)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A store failure during the agreement, on rank `me`.
fn store_error(me: usize) -> impl Fn(consort_comm::StoreError) -> String + Copy {
    move |e| format!("rank {me}: the survivors could not agree through the store: {e}")
}

fn decode(v: &[u8]) -> Vec<usize> {
    String::from_utf8_lossy(v)
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}
