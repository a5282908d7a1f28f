//! Device-resident DDP: bucket storage that lives where the gradients live,
//! and the stream-ordered copies around it.
//!
//! This module owns:
//!
//! - `Storage`: a bucket's memory, host words or a device allocation;
//! - the copies DDP enqueues on the compute stream (gradient into its
//!   bucket slot, average back into the gradient, slot to slot when
//!   buckets are rebuilt), each made to wait for the stream its source is
//!   ready on;
//! - the per-tensor device broadcast of rank 0's parameters;
//! - [`DeviceModel`], the [`ParamSet`] adapter for tensors in device
//!   memory.
//!
//! It owns no reduction: the backend averages a device bucket with
//! `ReduceOp::Avg` on the device, stream-ordered (see
//! [`consort_comm::Backend`]), so no gradient crosses to the host and the
//! host never waits for the device inside a step.

use consort_comm::{
    Backend, BufferMut, CallOptions, CommError, DType, DeviceBuffer, Element, Event, Placement,
};

use crate::{
    StateDict, Tensor,
    error::DdpError,
    hook::Words,
    params::{ParamSet, ParamSpec},
};

/// A bucket's memory.
#[derive(Debug)]
pub(crate) enum Storage {
    /// Host memory, 8-byte aligned.
    Host(Words),
    /// A device allocation, viewed as the bucket's dtype on the compute
    /// stream.
    Device(DeviceBuffer),
}

impl Storage {
    /// A zeroed bucket of `bytes` for `dtype`: on the placement's device,
    /// or on the host.
    pub(crate) fn zeroed(
        placement: Option<&Placement>,
        dtype: DType,
        bytes: usize,
    ) -> Result<Self, CommError> {
        let Some(p) = placement else {
            return Ok(Storage::Host(Words::zeroed(bytes)));
        };
        let ptr = p.device.alloc_zeroed(bytes, p.stream)?;
        // SAFETY: `ptr` was just allocated with `bytes` bytes on this device;
        // it is freed only by `Storage::free`, on the compute stream.
        Ok(Storage::Device(unsafe {
            p.buffer(ptr, bytes / dtype.size_bytes(), dtype)
        }))
    }

    /// Frees device storage once the compute stream reaches this point
    /// (after every collective the stream already waits for).
    pub(crate) fn free(self, placement: Option<&Placement>) -> Result<(), CommError> {
        if let (Storage::Device(d), Some(p)) = (self, placement) {
            // SAFETY: allocated by `zeroed` on this device and freed once
            // (the storage is consumed); the compute stream orders the free
            // after every use it has enqueued or waited for.
            unsafe { p.device.free(d.ptr(), p.stream) }?;
        }
        Ok(())
    }
}

/// Makes the compute stream wait for `stream` when they differ.
pub(crate) fn order_after(p: &Placement, stream: u64) -> Result<(), CommError> {
    if stream != p.stream {
        Event::record(&*p.device, stream)?.wait_on(p.stream)?;
    }
    Ok(())
}

/// Makes `stream` wait for the compute stream when they differ.
pub(crate) fn order_before(p: &Placement, stream: u64) -> Result<(), CommError> {
    if stream != p.stream {
        Event::record(&*p.device, p.stream)?.wait_on(stream)?;
    }
    Ok(())
}

/// Checks that `b` is `bytes` of `what` on the placement's device.
pub(crate) fn check_view(
    p: &Placement,
    b: &DeviceBuffer,
    bytes: usize,
    what: &str,
) -> Result<(), String> {
    if b.device() != p.device.ordinal() {
        return Err(format!(
            "{what} is on device {}, but the model is on device {}",
            b.device(),
            p.device.ordinal()
        ));
    }
    let have = b.len() * b.dtype().size_bytes();
    if have != bytes {
        return Err(format!("{what} has {have} bytes; it needs {bytes}"));
    }
    Ok(())
}

/// Enqueues `grad` → bucket slot at `dst` on the compute stream, after
/// the stream `grad` is ready on.
pub(crate) fn copy_in(
    p: &Placement,
    dst: u64,
    grad: &DeviceBuffer,
    bytes: usize,
    what: &str,
) -> Result<(), String> {
    check_view(p, grad, bytes, what)?;
    let run = || -> Result<(), CommError> {
        order_after(p, grad.stream())?;
        // SAFETY: `dst` is a slot of `bytes` in a live bucket; `grad` was
        // checked to hold `bytes` on this device (its constructor promised
        // it is live).
        unsafe { p.device.copy(dst, grad.ptr(), bytes, p.stream) }
    };
    run().map_err(|e| e.to_string())
}

/// Enqueues bucket slot at `src` → `grad` on the compute stream, and makes
/// `grad`'s stream wait for it. For adapters whose framework keeps the
/// gradient in device memory of its own (the candle adapter); `what` names
/// the tensor in the error.
pub fn copy_out(
    p: &Placement,
    grad: &DeviceBuffer,
    src: u64,
    bytes: usize,
    what: &str,
) -> Result<(), String> {
    check_view(p, grad, bytes, what)?;
    let run = || -> Result<(), CommError> {
        order_after(p, grad.stream())?;
        // SAFETY: as in `copy_in`, the other way.
        unsafe { p.device.copy(grad.ptr(), src, bytes, p.stream) }?;
        order_before(p, grad.stream())
    };
    run().map_err(|e| e.to_string())
}

/// Enqueues a slot-to-slot copy on the compute stream (bucket rebuild).
pub(crate) fn copy_slot(p: &Placement, dst: u64, src: u64, bytes: usize) -> Result<(), CommError> {
    // SAFETY: both are slots of `bytes` in live buckets of this device.
    unsafe { p.device.copy(dst, src, bytes, p.stream) }
}

/// Enqueues zeroing `bytes` at `dst` on the compute stream.
pub(crate) fn zero(p: &Placement, dst: u64, bytes: usize) -> Result<(), CommError> {
    // SAFETY: `dst` is a slot or a whole bucket of a live allocation.
    unsafe { p.device.fill_zero(dst, bytes, p.stream) }
}

/// Broadcasts rank 0's parameters and buffers of a device model, one
/// stream-ordered broadcast per tensor.
pub(crate) async fn broadcast_device<B: Backend + ?Sized>(
    backend: &B,
    model: &mut (impl ParamSet + ?Sized),
    params: &[ParamSpec],
    buffers: &[ParamSpec],
    opts: &CallOptions,
) -> Result<(), DdpError> {
    let rank = backend.rank();
    let root = CallOptions { root: 0, ..*opts };
    let items = params
        .iter()
        .enumerate()
        .map(|(i, s)| (false, i, s))
        .chain(buffers.iter().enumerate().map(|(i, s)| (true, i, s)));
    for (is_buffer, i, spec) in items {
        let view = if is_buffer {
            model.buffer_device(i)
        } else {
            model.param_device(i)
        };
        let Some(view) = view else {
            return Err(DdpError::Usage {
                rank,
                reason: format!(
                    "the model has a device placement but no device storage for {}; a device \
                     model implements param_device and buffer_device",
                    spec.name
                ),
            });
        };
        if view.len() * view.dtype().size_bytes() != spec.bytes() || view.dtype() != spec.dtype {
            return Err(DdpError::Usage {
                rank,
                reason: format!(
                    "the device storage of {} holds {} x {}; it needs {}",
                    spec.name,
                    view.len(),
                    view.dtype(),
                    spec.describe()
                ),
            });
        }
        backend
            .broadcast(BufferMut::Device(view), &root)
            .await
            .map_err(|source| DdpError::Comm {
                what: format!("broadcast of rank 0's {}", spec.name),
                source: Box::new(source),
            })?;
    }
    Ok(())
}

/// Checks that `bytes` are exactly `spec`'s tensor.
fn check_len(spec: &ParamSpec, bytes: &[u8]) -> Result<(), CommError> {
    if bytes.len() == spec.bytes() {
        return Ok(());
    }
    Err(CommError::invalid(format!(
        "{} got {} bytes of values; it holds {}",
        spec.describe(),
        bytes.len(),
        spec.bytes()
    )))
}

/// One tensor of a [`DeviceModel`].
#[derive(Debug)]
struct DevTensor {
    spec: ParamSpec,
    value: u64,
    /// Gradient storage (parameters only).
    grad: Option<u64>,
}

/// A model whose parameters, gradients and buffers live in device memory:
/// the [`ParamSet`] adapter for device-resident DDP. Tensors are
/// allocated on the placement's device; uploads and downloads run on its
/// compute stream.
#[derive(Debug)]
pub struct DeviceModel {
    placement: Placement,
    params: Vec<DevTensor>,
    buffers: Vec<DevTensor>,
}

impl DeviceModel {
    /// An empty model on `placement`.
    pub fn new(placement: Placement) -> Self {
        DeviceModel {
            placement,
            params: Vec::new(),
            buffers: Vec::new(),
        }
    }

    /// Where the tensors live.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    fn upload(&self, spec: &ParamSpec, bytes: &[u8]) -> Result<u64, CommError> {
        check_len(spec, bytes)?;
        let p = &self.placement;
        let ptr = p.device.alloc_zeroed(bytes.len(), p.stream)?;
        self.enqueue_write(ptr, spec, bytes)?;
        Ok(ptr)
    }

    /// Uploads one tensor (with zeroed gradient storage for a parameter).
    fn add<T: Element>(
        &mut self,
        name: String,
        shape: Vec<usize>,
        values: &[T],
        param: bool,
    ) -> Result<DevTensor, CommError> {
        let spec = ParamSpec {
            name,
            dtype: T::DTYPE,
            shape,
        };
        let value = self.upload(&spec, consort_comm::dtype::as_bytes(values))?;
        let p = &self.placement;
        let grad = if param {
            Some(p.device.alloc_zeroed(spec.bytes(), p.stream)?)
        } else {
            None
        };
        Ok(DevTensor { spec, value, grad })
    }

    /// Adds a parameter with these values, and a zeroed gradient; returns
    /// its index.
    pub fn add_param<T: Element>(
        &mut self,
        name: impl Into<String>,
        shape: Vec<usize>,
        values: &[T],
    ) -> Result<usize, CommError> {
        let t = self.add(name.into(), shape, values, true)?;
        self.params.push(t);
        Ok(self.params.len() - 1)
    }

    /// Adds a buffer (broadcast from rank 0, never reduced); returns its
    /// index among buffers.
    pub fn add_buffer<T: Element>(
        &mut self,
        name: impl Into<String>,
        shape: Vec<usize>,
        values: &[T],
    ) -> Result<usize, CommError> {
        let t = self.add(name.into(), shape, values, false)?;
        self.buffers.push(t);
        Ok(self.buffers.len() - 1)
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    fn param(&self, i: usize) -> Result<&DevTensor, CommError> {
        self.params.get(i).ok_or_else(|| {
            CommError::invalid(format!(
                "parameter index {i} is out of range (the model has {})",
                self.params.len()
            ))
        })
    }

    fn typed<T: Element>(t: &DevTensor) -> Result<(), CommError> {
        if t.spec.dtype == T::DTYPE {
            Ok(())
        } else {
            Err(CommError::invalid(format!(
                "{} is {}, not {}",
                t.spec.name,
                t.spec.dtype,
                T::DTYPE
            )))
        }
    }

    fn view(&self, ptr: u64, spec: &ParamSpec) -> DeviceBuffer {
        // SAFETY: `ptr` is one of this model's live allocations of
        // `spec.bytes()`; the model frees them only on drop, stream-ordered.
        unsafe { self.placement.buffer(ptr, spec.numel(), spec.dtype) }
    }

    /// Parameter `i`'s values as a device view.
    pub fn param_buffer(&self, i: usize) -> Result<DeviceBuffer, CommError> {
        let t = self.param(i)?;
        Ok(self.view(t.value, &t.spec))
    }

    /// Parameter `i`'s gradient storage as a device view.
    pub fn grad_buffer(&self, i: usize) -> Result<DeviceBuffer, CommError> {
        let t = self.param(i)?;
        Ok(self.view(t.grad.unwrap_or(t.value), &t.spec))
    }

    /// Waits for the compute stream and reads parameter `i`.
    pub fn read_param<T: Element>(&self, i: usize) -> Result<Vec<T>, CommError> {
        let t = self.param(i)?;
        Self::typed::<T>(t)?;
        self.download(t.value, t.spec.numel())
    }

    /// Waits for the compute stream and reads parameter `i`'s gradient.
    pub fn read_grad<T: Element>(&self, i: usize) -> Result<Vec<T>, CommError> {
        let t = self.param(i)?;
        Self::typed::<T>(t)?;
        self.download(t.grad.unwrap_or(t.value), t.spec.numel())
    }

    /// Enqueues new values for parameter `i` on the compute stream.
    pub fn write_param<T: Element>(&self, i: usize, values: &[T]) -> Result<(), CommError> {
        let t = self.param(i)?;
        Self::typed::<T>(t)?;
        self.enqueue_write(t.value, &t.spec, consort_comm::dtype::as_bytes(values))
    }

    /// Enqueues a gradient for parameter `i` on the compute stream (what a
    /// backward kernel would write).
    pub fn write_grad<T: Element>(&self, i: usize, values: &[T]) -> Result<(), CommError> {
        let t = self.param(i)?;
        Self::typed::<T>(t)?;
        let g = t.grad.unwrap_or(t.value);
        self.enqueue_write(g, &t.spec, consort_comm::dtype::as_bytes(values))
    }

    fn enqueue_write(&self, ptr: u64, spec: &ParamSpec, bytes: &[u8]) -> Result<(), CommError> {
        check_len(spec, bytes)?;
        let p = &self.placement;
        // SAFETY: `ptr` is a live allocation of `spec.bytes()` bytes.
        unsafe { p.device.copy_from_host(ptr, bytes, p.stream) }
    }

    fn download<T: Element>(&self, ptr: u64, n: usize) -> Result<Vec<T>, CommError> {
        let mut out = vec![<T as bytemuck::Zeroable>::zeroed(); n];
        let p = &self.placement;
        // SAFETY: `ptr` holds `n` elements of `T` (dtype checked).
        unsafe {
            p.device
                .copy_to_host(consort_comm::dtype::as_bytes_mut(&mut out), ptr, p.stream)
        }?;
        Ok(out)
    }

    /// Enqueues zeroing every gradient on the compute stream.
    pub fn zero_grad(&self) -> Result<(), CommError> {
        for t in &self.params {
            if let Some(g) = t.grad {
                zero(&self.placement, g, t.spec.bytes())?;
            }
        }
        Ok(())
    }

    /// Waits for the compute stream and copies every parameter and buffer
    /// to the host, under their bare names (for a checkpoint).
    pub fn state_dict(&self) -> Result<StateDict, CommError> {
        let mut sd = StateDict::new();
        for t in self.params.iter().chain(&self.buffers) {
            let mut data = vec![0u8; t.spec.bytes()];
            let p = &self.placement;
            // SAFETY: `t.value` holds `data.len()` bytes.
            unsafe { p.device.copy_to_host(&mut data, t.value, p.stream) }?;
            let tensor = Tensor::new(t.spec.dtype, t.spec.shape.clone(), data)
                .map_err(|e| CommError::invalid(e.to_string()))?;
            sd.insert(t.spec.name.clone(), tensor);
        }
        Ok(sd)
    }
}

impl Drop for DeviceModel {
    fn drop(&mut self) {
        let p = &self.placement;
        for t in self.params.iter().chain(&self.buffers) {
            for ptr in std::iter::once(t.value).chain(t.grad) {
                // SAFETY: each allocation is freed once, here, after every
                // use the compute stream has enqueued.
                let _ = unsafe { p.device.free(ptr, p.stream) };
            }
        }
    }
}

impl ParamSet for DeviceModel {
    fn params(&self) -> Vec<ParamSpec> {
        self.params.iter().map(|t| t.spec.clone()).collect()
    }

    fn buffers(&self) -> Vec<ParamSpec> {
        self.buffers.iter().map(|t| t.spec.clone()).collect()
    }

    fn placement(&self) -> Option<Placement> {
        Some(self.placement.clone())
    }

    fn param_device(&mut self, i: usize) -> Option<DeviceBuffer> {
        self.param_buffer(i).ok()
    }

    fn grad_device(&mut self, i: usize) -> Option<DeviceBuffer> {
        self.grad_buffer(i).ok()
    }

    fn buffer_device(&mut self, i: usize) -> Option<DeviceBuffer> {
        let t = self.buffers.get(i)?;
        Some(self.view(t.value, &t.spec))
    }
}
