//! What a training loop calls around the step: zeroing and copying
//! gradients, `sync_grads`, `no_sync`, buffer broadcasts, join for uneven
//! inputs, and rank-0 checkpoints.

use std::path::Path;

use consort_comm::{Backend, BufferMut, CallOptions};

use super::{Ddp, DdpError, NoSync};
use crate::{
    StateDict,
    device::{self as dev, Storage},
    params::ParamSet,
    setup::broadcast_tensors,
    worker::{Done, Job},
};

impl<B: Backend + ?Sized + 'static> Ddp<B> {
    /// Zeroes every gradient in the buckets (`optimizer.zero_grad()` in
    /// gradient-as-bucket-view mode).
    ///
    /// With device buckets the zeroing is enqueued on the compute stream;
    /// a device error makes this `Ddp` fail (the next call reports it).
    pub fn zero_grad(&mut self) {
        let mut failed = None;
        for b in &mut self.buckets {
            match &mut b.data {
                Some(Storage::Host(d)) => d.bytes_mut().fill(0),
                Some(Storage::Device(d)) => {
                    if let Some(p) = &self.placement {
                        let bytes = d.len() * d.dtype().size_bytes();
                        if let Err(e) = dev::zero(p, d.ptr(), bytes) {
                            failed.get_or_insert(e);
                        }
                    }
                }
                None => {}
            }
        }
        if let Some(e) = failed {
            let e = self.usage(format!("zeroing the device buckets: {e}"));
            self.fail(e);
        }
    }

    /// Writes every averaged gradient into `model`'s gradients (the copy
    /// that gradient-as-bucket-view avoids).
    ///
    /// For a device model the copies are enqueued on the compute stream
    /// (after the all-reduces it already waits for); the host does not
    /// wait.
    pub fn copy_grads_to(&mut self, model: &mut (impl ParamSet + ?Sized)) -> Result<(), DdpError> {
        self.check()?;
        if let Some(p) = self.placement.clone() {
            for i in 0..self.specs.len() {
                let s = self.slot(i)?;
                let Some(grad) = model.grad_device(i) else {
                    return Err(self.usage(format!(
                        "the model has no device gradient storage for {}",
                        self.specs[i].name
                    )));
                };
                let src = self.slot_ptr(i)?;
                let what = format!("the model's gradient storage for {}", self.specs[i].name);
                dev::copy_out(&p, &grad, src, s.len, &what).map_err(|e| self.device_error(i, e))?;
            }
            return Ok(());
        }
        for i in 0..self.specs.len() {
            let want = self.slot(i)?.len;
            let have = model.grad_bytes_mut(i).len();
            if have != want {
                let name = &self.specs[i].name;
                return Err(self.usage(format!(
                    "the model's gradient storage for {name} has {have} bytes; it needs {want}"
                )));
            }
            let src = self.slot_bytes(i)?;
            model.grad_bytes_mut(i).copy_from_slice(src);
        }
        Ok(())
    }

    /// One synced step for a model whose gradients are all computed: marks
    /// every parameter that has a gradient (in bucket order), waits for the
    /// buckets, and writes the averages back into `model`.
    pub async fn sync_grads(
        &mut self,
        model: &mut (impl ParamSet + ?Sized),
    ) -> Result<(), DdpError> {
        self.check()?;
        let order: Vec<usize> = self
            .buckets
            .iter()
            .flat_map(|b| b.params.iter().rev().copied())
            .collect();
        for i in order {
            if self.placement.is_some() {
                if !model.has_grad_device(i) {
                    continue;
                }
                if let Some(g) = model.grad_device(i) {
                    self.mark_ready_device(i, g)?;
                }
            } else if let Some(g) = model.grad_bytes(i) {
                self.mark_ready_bytes(i, g)?;
            }
        }
        self.finish().await?;
        if self.sync {
            self.copy_grads_to(model)?;
        }
        Ok(())
    }

    /// torch's `no_sync()`: until the guard drops, steps reduce nothing and
    /// gradients accumulate where backward writes them. The first step
    /// after it reduces the accumulated gradients.
    pub fn no_sync(&mut self) -> NoSync<'_, B> {
        self.sync = false;
        NoSync { ddp: self }
    }

    /// Sends rank 0's buffers to every rank (torch does this before each
    /// forward when `broadcast_buffers=True`). Does nothing when the option
    /// is off. Every rank must call it.
    pub async fn broadcast_buffers(
        &mut self,
        model: &mut (impl ParamSet + ?Sized),
    ) -> Result<(), DdpError> {
        self.check()?;
        if !self.opts.broadcast_buffers {
            return Ok(());
        }
        let buffers = model.buffers();
        let res = if self.placement.is_some() {
            let call = self.call;
            super::on_group!(self, b => dev::broadcast_device(b, model, &[], &buffers, &call).await)
        } else {
            let call = self.call;
            super::on_group!(self, b => broadcast_tensors(b, model, &[], &buffers, &call).await)
        };
        if let Err(e) = res {
            return Err(self.fail(e));
        }
        Ok(())
    }

    /// Starts torch's `join()` context for uneven inputs: from now on every
    /// synced step first counts the ranks still training, so that ranks
    /// that ran out of data can call [`Ddp::join`] and shadow the others'
    /// collectives. Every rank must call it before the same step.
    pub fn enable_join(&mut self) {
        self.join = true;
    }

    /// For a rank that has run out of data (inside [`Ddp::enable_join`]):
    /// takes part in the other ranks' steps with zero gradients until every
    /// rank has joined. Averages still divide by the full world size, as
    /// torch's default (`divide_by_initial_world_size=True`).
    ///
    /// Buffers are not shadowed: with `broadcast_buffers`, stop calling
    /// [`Ddp::broadcast_buffers`] inside the join context.
    pub async fn join(&mut self) -> Result<(), DdpError> {
        self.check()?;
        if !self.join {
            return Err(self.usage(
                "join() needs enable_join() on every rank first (torch: `with model.join():`)",
            ));
        }
        if self.started || self.in_flight > 0 || !self.sync {
            return Err(
                self.usage("join() must be called between steps (after finish(), outside no_sync)")
            );
        }
        loop {
            let _ = self.jobs.send(Job::Count { active: false });
            self.in_flight += 1;
            let Some(done) = self.done.recv().await else {
                let e = self.usage("the DDP bucket worker stopped (its runtime shut down?)");
                return Err(self.fail(e));
            };
            self.in_flight -= 1;
            let active = match done {
                Done::Count(Ok(n)) => n,
                Done::Count(Err(source)) => {
                    let e = DdpError::Comm {
                        what: "join count".into(),
                        source: Box::new(source),
                    };
                    return Err(self.fail(e));
                }
                Done::Reduced { .. } => {
                    let e = self.usage("DDP worker answered out of order");
                    return Err(self.fail(e));
                }
            };
            if active == 0 {
                self.join = false;
                return Ok(());
            }
            // Shadow one step: every bucket, in order, with zeros.
            self.zero_grad();
            self.started = true;
            for i in 0..self.specs.len() {
                self.marked[i] = true;
            }
            for b in &mut self.buckets {
                b.pending = 0;
            }
            self.launch_ready();
            self.drain().await?;
            if !self.rebuilt && !self.opts.find_unused_parameters {
                self.rebuild().await?;
            }
            self.reset_step();
            self.steps += 1;
        }
    }

    /// Writes `state` as a safetensors checkpoint at `path` on rank 0 (temp
    /// file, fsync, rename), then tells every rank whether it worked. Every
    /// rank must call it; only rank 0 touches the file system. Save the
    /// bare keys (`PlainModel::state_dict`, or `StateDict::unwrapped`): they
    /// load into wrapped and bare models alike.
    pub async fn save_checkpoint(
        &mut self,
        path: &Path,
        state: &StateDict,
        metadata: &std::collections::BTreeMap<String, String>,
    ) -> Result<(), DdpError> {
        self.check()?;
        let mut status = [0u8; 1];
        let mut reason = String::new();
        if self.rank == 0
            && let Err(e) = crate::save_safetensors(path, state, metadata)
        {
            status[0] = 1;
            reason = e.to_string();
        }
        let opts = CallOptions {
            root: 0,
            ..self.call
        };
        let sent =
            super::on_group!(self, b => b.broadcast(BufferMut::from(&mut status[..]), &opts).await);
        if let Err(source) = sent {
            let e = DdpError::Comm {
                what: "checkpoint status broadcast".into(),
                source: Box::new(source),
            };
            return Err(self.fail(e));
        }
        if status[0] != 0 {
            if reason.is_empty() {
                reason = format!("rank 0 could not write {}", path.display());
            }
            return Err(DdpError::Checkpoint {
                rank: self.rank,
                reason,
            });
        }
        Ok(())
    }
}
