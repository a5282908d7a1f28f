//! Handing gradients to DDP: `mark_ready` and its variants (host bytes,
//! device buffers, gradient as bucket view), the slot checks, and the launch
//! of every bucket whose gradients are all in, in index order.

use std::sync::Arc;

use consort_comm::{Backend, DeviceBuffer, Element};

use super::{Ddp, DdpError, Slot};
use crate::{
    device::{self as dev, Storage},
    hook::CommHook,
    powersgd::Piece,
    worker::Job,
};

impl<B: Backend + ?Sized + 'static> Ddp<B> {
    pub(super) fn slot(&self, i: usize) -> Result<Slot, DdpError> {
        self.slots.get(i).copied().ok_or_else(|| {
            self.usage(format!(
                "parameter index {i} is out of range (the model has {} parameters)",
                self.specs.len()
            ))
        })
    }

    pub(super) fn check_dtype<T: Element>(&self, i: usize) -> Result<(), DdpError> {
        let p = &self.specs[i];
        if p.dtype == T::DTYPE {
            Ok(())
        } else {
            Err(self.usage(format!(
                "parameter {} is {}, but its gradient was given as {}",
                p.name,
                p.dtype,
                T::DTYPE
            )))
        }
    }

    /// The bytes of parameter `i`'s gradient in its bucket.
    pub(super) fn slot_bytes(&mut self, i: usize) -> Result<&mut [u8], DdpError> {
        let s = self.slot(i)?;
        let name = &self.specs[i].name;
        match self.buckets[s.bucket].data.as_mut() {
            Some(Storage::Host(d)) => Ok(&mut d.bytes_mut()[s.offset..s.offset + s.len]),
            Some(Storage::Device(_)) => Err(DdpError::Usage {
                rank: self.rank,
                reason: format!(
                    "the gradient of {name} lives in a device bucket; use grad_device({i}) and \
                     mark_ready_device, or copy_grads_to(model), instead of host views"
                ),
            }),
            None => Err(DdpError::Usage {
                rank: self.rank,
                reason: format!(
                    "the gradient of {name} is being reduced (its bucket is in flight); wait for \
                     finish() before touching it"
                ),
            }),
        }
    }

    /// Marks parameter `i`'s gradient ready and copies `grad` into its
    /// bucket (torch's autograd hook). Under [`Ddp::no_sync`] it does
    /// nothing: gradient accumulation is the model's, as with `.grad`.
    pub fn mark_ready<T: Element>(&mut self, i: usize, grad: &[T]) -> Result<(), DdpError> {
        self.slot(i)?;
        self.check_dtype::<T>(i)?;
        self.mark_ready_bytes(i, bytemuck::cast_slice(grad))
    }

    /// [`Ddp::mark_ready`] with the gradient as little-endian bytes.
    pub fn mark_ready_bytes(&mut self, i: usize, grad: &[u8]) -> Result<(), DdpError> {
        self.check()?;
        let s = self.slot(i)?;
        if grad.len() != s.len {
            let p = &self.specs[i];
            return Err(self.usage(format!(
                "the gradient of {} has {} bytes; {} needs {}",
                p.name,
                grad.len(),
                p.describe(),
                s.len
            )));
        }
        if !self.sync {
            return Ok(());
        }
        self.check_not_marked(i)?;
        if let Some(p) = self.placement.clone() {
            let dst = self.slot_ptr(i)?;
            // SAFETY: `dst` is parameter i's slot of `grad.len()` bytes
            // (checked above) in a live device bucket.
            unsafe { p.device.copy_from_host(dst, grad, p.stream) }
                .map_err(|e| self.device_error(i, e.to_string()))?;
        } else {
            self.slot_bytes(i)?.copy_from_slice(grad);
        }
        self.note_ready(i);
        Ok(())
    }

    /// The device address of parameter `i`'s slot in its device bucket.
    pub(super) fn slot_ptr(&self, i: usize) -> Result<u64, DdpError> {
        let s = self.slot(i)?;
        match &self.buckets[s.bucket].data {
            Some(Storage::Device(d)) => Ok(d.ptr() + s.offset as u64),
            _ => Err(self.usage(format!(
                "{} has no device bucket: this Ddp wraps a host model (its ParamSet has no \
                 placement); use mark_ready and grad_mut",
                self.specs[i].name
            ))),
        }
    }

    pub(super) fn device_error(&self, i: usize, reason: String) -> DdpError {
        self.usage(format!("device copy for {}: {reason}", self.specs[i].name))
    }

    /// Device-resident [`Ddp::mark_ready`]: enqueues the copy of `grad`
    /// into parameter `i`'s device bucket on the compute stream (after the
    /// stream `grad` is ready on), and launches the bucket's all-reduce
    /// once it is complete. Never blocks the host.
    pub fn mark_ready_device(&mut self, i: usize, grad: DeviceBuffer) -> Result<(), DdpError> {
        self.check()?;
        let s = self.slot(i)?;
        if grad.dtype() != self.specs[i].dtype {
            let p = &self.specs[i];
            return Err(self.usage(format!(
                "parameter {} is {}, but its gradient was given as {}",
                p.name,
                p.dtype,
                grad.dtype()
            )));
        }
        if !self.sync {
            return Ok(());
        }
        self.check_not_marked(i)?;
        let dst = self.slot_ptr(i)?;
        let p = self
            .placement
            .clone()
            .ok_or_else(|| self.usage("no placement"))?;
        let what = format!("the gradient of {}", self.specs[i].name);
        dev::copy_in(&p, dst, &grad, s.len, &what).map_err(|e| self.device_error(i, e))?;
        self.note_ready(i);
        Ok(())
    }

    /// Gradient-as-bucket-view on the device: parameter `i`'s slot in its
    /// device bucket, ready on the compute stream. Backward writes (or
    /// accumulates) into it, then calls [`Ddp::mark_ready_in_place`];
    /// after [`Ddp::finish`], work enqueued on the compute stream sees the
    /// average.
    pub fn grad_device(&self, i: usize) -> Result<DeviceBuffer, DdpError> {
        let ptr = self.slot_ptr(i)?;
        let p = self
            .placement
            .as_ref()
            .ok_or_else(|| self.usage("no placement"))?;
        let spec = &self.specs[i];
        // SAFETY: the slot lies in a live device bucket of this Ddp, which
        // frees buckets only stream-ordered (rebuild, drop).
        Ok(unsafe { p.buffer(ptr, spec.numel(), spec.dtype) })
    }

    /// Gradient-as-bucket-view (torch's `gradient_as_bucket_view=True`):
    /// parameter `i`'s gradient storage inside its bucket, for backward to
    /// write (or accumulate) into, so that no copy is made in either
    /// direction. Zeroed by [`Ddp::zero_grad`]; after [`Ddp::finish`] it
    /// holds the averaged gradient.
    pub fn grad_mut<T: Element>(&mut self, i: usize) -> Result<&mut [T], DdpError> {
        self.slot(i)?;
        self.check_dtype::<T>(i)?;
        let rank = self.rank;
        let b = self.slot_bytes(i)?;
        // Bucket storage is 8-byte aligned and every slot starts at a
        // multiple of its element size within a single-dtype bucket.
        bytemuck::try_cast_slice_mut(b).map_err(|e| DdpError::Usage {
            rank,
            reason: format!("bucket view: {e:?}"),
        })
    }

    /// Parameter `i`'s gradient as it is in its bucket: after
    /// [`Ddp::finish`], the average over all ranks.
    pub fn grad<T: Element>(&mut self, i: usize) -> Result<&[T], DdpError> {
        Ok(self.grad_mut::<T>(i)?)
    }

    /// Marks parameter `i` ready after backward wrote its gradient through
    /// [`Ddp::grad_mut`]. Under [`Ddp::no_sync`] it does nothing.
    pub fn mark_ready_in_place(&mut self, i: usize) -> Result<(), DdpError> {
        self.check()?;
        self.slot(i)?;
        if !self.sync {
            return Ok(());
        }
        self.check_not_marked(i)?;
        self.note_ready(i);
        Ok(())
    }

    pub(super) fn check_not_marked(&self, i: usize) -> Result<(), DdpError> {
        if self.marked[i] {
            return Err(self.usage(format!(
                "the gradient of {} was marked ready twice in one step. Mark each parameter once \
                 per backward; if it is used twice in the forward pass, mark it after its gradient \
                 is fully accumulated",
                self.specs[i].name
            )));
        }
        Ok(())
    }

    pub(super) fn note_ready(&mut self, i: usize) {
        self.marked[i] = true;
        self.ready_order.push(i);
        let b = self.slots[i].bucket;
        self.buckets[b].pending -= 1;
        self.launch_ready();
    }

    /// Hands every complete bucket to the worker, in index order.
    pub(super) fn launch_ready(&mut self) {
        if self.join && !self.started {
            let _ = self.jobs.send(Job::Count { active: true });
            self.in_flight += 1;
        }
        self.started = true;
        while let Some(b) = self.buckets.get_mut(self.next_launch) {
            if b.pending > 0 {
                break;
            }
            let data = match &b.data {
                Some(Storage::Device(d)) => Storage::Device(*d),
                _ => b
                    .data
                    .take()
                    .unwrap_or(Storage::Host(crate::hook::Words::default())),
            };
            let pieces = match self.opts.comm_hook {
                CommHook::PowerSgd { .. } => Arc::new(
                    b.params
                        .iter()
                        .map(|&i| {
                            let shape = &self.specs[i].shape;
                            let rows = shape.first().copied().unwrap_or(1);
                            Piece {
                                param: i,
                                offset: self.slots[i].offset / b.dtype.size_bytes(),
                                rows,
                                cols: self.specs[i].numel() / rows.max(1),
                            }
                        })
                        .collect(),
                ),
                _ => Arc::default(),
            };
            let job = Job::Reduce {
                index: self.next_launch,
                dtype: b.dtype,
                data,
                pieces,
                step: self.steps,
            };
            self.next_launch += 1;
            self.in_flight += 1;
            // A closed channel means the worker is gone; finish reports it.
            let _ = self.jobs.send(job);
        }
    }
}
