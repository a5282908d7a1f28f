//! Ending a step: waiting for every bucket, reporting the first failure,
//! and rebuilding the buckets in rank 0's ready order after the first
//! synced step.

use std::time::Duration;

use consort_comm::{Backend, BufferMut, CallOptions, CommError, Placement};

use super::{Ddp, DdpError};
use crate::{
    buckets::{assign_buckets, bucket_limits},
    device::{self as dev, Storage},
    worker::Done,
};

impl<B: Backend + ?Sized + 'static> Ddp<B> {
    /// Waits for every bucket of this step (launching those that are
    /// left) and leaves the averaged gradients in the buckets. Under
    /// [`Ddp::no_sync`] it only ends the step.
    ///
    /// A parameter that was never marked is an error naming it, unless
    /// `find_unused_parameters` is on; then its gradient counts as zero.
    /// After the first synced step the buckets are rebuilt in the order
    /// rank 0's gradients became ready (torch's bucket rebuild).
    pub async fn finish(&mut self) -> Result<(), DdpError> {
        match self.finish_step().await {
            Err(e) if self.shrinkable(&e) => Err(self.shrink(e).await),
            other => other,
        }
    }

    async fn finish_step(&mut self) -> Result<(), DdpError> {
        self.check()?;
        if !self.sync {
            self.reset_step();
            return Ok(());
        }
        let missing: Vec<usize> = (0..self.specs.len()).filter(|&i| !self.marked[i]).collect();
        if !missing.is_empty() {
            if !self.opts.find_unused_parameters {
                let names: Vec<&str> = missing
                    .iter()
                    .take(5)
                    .map(|&i| self.specs[i].name.as_str())
                    .collect();
                let e = DdpError::MissingGrads {
                    rank: self.rank,
                    count: missing.len(),
                    names: names.join(", ") + if missing.len() > 5 { ", …" } else { "" },
                };
                return Err(self.fail(e));
            }
            for i in missing {
                if let Some(p) = self.placement.clone() {
                    let len = self.slot(i)?.len;
                    let ptr = self.slot_ptr(i)?;
                    dev::zero(&p, ptr, len).map_err(|e| self.device_error(i, e.to_string()))?;
                } else if let Ok(b) = self.slot_bytes(i) {
                    b.fill(0);
                }
                self.marked[i] = true;
                let b = self.slots[i].bucket;
                self.buckets[b].pending -= 1;
            }
        }
        self.launch_ready();
        self.drain().await?;
        if !self.rebuilt && !self.opts.find_unused_parameters {
            self.rebuild().await?;
        }
        self.reset_step();
        self.steps += 1;
        Ok(())
    }

    /// Collects every result the worker owes.
    pub(super) async fn drain(&mut self) -> Result<(), DdpError> {
        let mut first: Option<DdpError> = None;
        while self.in_flight > 0 {
            let Some(done) = self.done.recv().await else {
                let e = self.usage("the DDP bucket worker stopped (its runtime shut down?)");
                return Err(self.fail(e));
            };
            self.in_flight -= 1;
            let (what, result) = match done {
                Done::Reduced {
                    index,
                    data,
                    result,
                } => {
                    self.buckets[index].data = Some(data);
                    (self.describe_bucket(index), result)
                }
                Done::Count(r) => ("join count".to_string(), r.map(|_| ())),
            };
            if let Err(source) = result
                && first.is_none()
            {
                let what = if matches!(
                    source,
                    CommError::Mismatch { .. } | CommError::Timeout { .. }
                ) {
                    format!(
                        "{what} (if the ranks run different numbers of steps, as with uneven \
                         data, call enable_join() on every rank and join() on those that run \
                         out: torch's `with model.join():`)"
                    )
                } else {
                    what
                };
                first = Some(DdpError::Comm {
                    what,
                    source: Box::new(source),
                });
            }
        }
        match first {
            Some(e) => Err(self.fail(e)),
            None => Ok(()),
        }
    }

    pub(super) fn describe_bucket(&self, b: usize) -> String {
        let names: Vec<&str> = self.buckets[b]
            .params
            .iter()
            .take(3)
            .map(|&i| self.specs[i].name.as_str())
            .collect();
        let more = self.buckets[b].params.len().saturating_sub(3);
        let tail = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        format!("all-reduce of bucket {b} ({}{tail})", names.join(", "))
    }

    pub(super) fn reset_step(&mut self) {
        self.marked.fill(false);
        self.ready_order.clear();
        self.next_launch = 0;
        self.started = false;
        for b in &mut self.buckets {
            b.pending = b.params.len();
        }
    }

    /// Rebuilds the buckets in the order rank 0's gradients became ready,
    /// keeping every gradient.
    pub(super) async fn rebuild(&mut self) -> Result<(), DdpError> {
        let n = self.specs.len();
        let mut order: Vec<u64> = if self.ready_order.len() == n {
            self.ready_order.iter().map(|&i| i as u64).collect()
        } else {
            // Not a full step here (a joined rank): rank 0's order wins.
            self.buckets
                .iter()
                .flat_map(|b| b.params.iter().rev().map(|&i| i as u64))
                .collect()
        };
        let opts = self.call.with_timeout(self.timeout());
        let opts = CallOptions { root: 0, ..opts };
        let sent =
            super::on_group!(self, b => b.broadcast(BufferMut::from(&mut order), &opts).await);
        if let Err(source) = sent {
            let e = DdpError::Comm {
                what: "broadcast of rank 0's bucket order".into(),
                source: Box::new(source),
            };
            return Err(self.fail(e));
        }
        let order: Vec<usize> = order.iter().map(|&i| i as usize).collect();
        let limits = bucket_limits(self.opts.bucket_cap_bytes);
        let assignment = match assign_buckets(&self.infos(), &limits, Some(&order)) {
            Ok(a) => a,
            Err(e) => {
                let e = self.bucket_error(e);
                return Err(self.fail(e));
            }
        };
        if let Some(p) = self.placement.clone() {
            if let Err(e) = self.relayout_device(&p, assignment) {
                return Err(self.fail(e));
            }
            self.rebuilt = true;
            return Ok(());
        }
        let old: Vec<Vec<u8>> = (0..n)
            .map(|i| self.slot_bytes(i).map(|b| b.to_vec()).unwrap_or_default())
            .collect();
        if let Err(e) = self.layout(assignment) {
            return Err(self.fail(e));
        }
        for (i, g) in old.iter().enumerate() {
            if let Ok(b) = self.slot_bytes(i) {
                b.copy_from_slice(g);
            }
        }
        self.rebuilt = true;
        Ok(())
    }

    /// Device buckets for a new assignment: every gradient copied slot to
    /// slot on the compute stream, the old buckets freed after the copies.
    pub(super) fn relayout_device(
        &mut self,
        p: &Placement,
        assignment: Vec<Vec<usize>>,
    ) -> Result<(), DdpError> {
        let n = self.specs.len();
        let old: Vec<u64> = (0..n).map(|i| self.slot_ptr(i)).collect::<Result<_, _>>()?;
        let old_buckets: Vec<Storage> = self
            .buckets
            .iter_mut()
            .filter_map(|b| b.data.take())
            .collect();
        self.layout(assignment)?;
        for (i, &src) in old.iter().enumerate() {
            let (dst, len) = (self.slot_ptr(i)?, self.slots[i].len);
            dev::copy_slot(p, dst, src, len).map_err(|e| self.device_error(i, e.to_string()))?;
        }
        for b in old_buckets {
            b.free(Some(p))
                .map_err(|e| self.usage(format!("freeing an old bucket: {e}")))?;
        }
        Ok(())
    }

    pub(super) fn timeout(&self) -> Duration {
        self.call
            .timeout_or(super::on_group!(self, b => b.default_timeout()))
    }
}
