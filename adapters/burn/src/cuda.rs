//! A burn module on CUDA (feature `cuda`): DDP and the sharded strategies
//! read and write the parameters' and the gradients' device memory where
//! burn keeps it, with no host copy.
//!
//! This module owns finding a burn tensor's device memory (its
//! `CubeTensor`, and cubecl's `get_resource`, whose answer pins the
//! allocation while it is held), holding each step's gradient tensors, and
//! the two waits that order burn and consort. It owns no copy and no
//! reduction: DDP's device buckets and the shards do both, on consort's
//! stream (the placement's).
//!
//! Ordering. cubecl's stream is private (one per thread, no accessor, no
//! way to hand it one), so each handover is a host wait: burn's
//! `Device::sync` before consort reads (`from_module_on`, `pull_grads`),
//! and a wait for consort's stream before burn reads again
//! (`push_values`, `push_grads`). `Device::sync` waits for the calling
//! thread's stream only; it covers backward's kernels even when another
//! thread queued them (an async task moved between threads) because
//! pinning a tensor makes this thread's stream wait on the stream the
//! tensor was made on (cubecl's `get_resource` resolves the binding as a
//! launch would). It does not cover a write to a gradient queued from a
//! third thread meanwhile: call backward and `pull_grads` with no await
//! between them. A flag written on cubecl's
//! stream that consort's stream waits on (`cuStreamWaitValue32`) would
//! remove the first host wait; it is not tried.
//!
//! What burn's missing in-place write costs. burn has no API that writes
//! into a tensor's memory, so the averages go there behind its back, in a
//! gradient `pull_grads` took out of `GradientsParams` (`push_grads` puts
//! it back): one that is contiguous and whose memory nothing else holds
//! (cubecl's `can_mut`) gets the average in place (DDP copies it into a
//! bucket and the average back, as on CUDA everywhere), with no extra
//! memory. A strided or storage-tiled gradient, or one whose memory is
//! also a parameter's, another gradient's or any live tensor's, gets a
//! contiguous copy of its own first (one more gradient-sized kernel and
//! allocation). A missing gradient gets zeros made on the device in the
//! parameter's dtype (a parameter unused this step, or frozen: a frozen
//! one's zeros are synced but never handed to burn's optimizer). The
//! parameters' memory is written in place by `Ddp::new`'s broadcast and
//! by the shards' `copy_params_to`; the model holds the parameters'
//! tensors meanwhile, so burn's optimizer cannot update them in place
//! while held (DDP lets them go in the first `push_grads`).
//!
//! Pins go back to cubecl only after consort's stream is done with them
//! (before new gradients or parameters replace them, and when the model is
//! dropped): cubecl knows nothing of consort's stream, and memory it took
//! back early could be given to the next forward while a copy or a
//! collective still writes it. A pinned tensor must be exactly the
//! parameter's shape and size (a slice of a larger buffer is refused).

use std::any::Any;

use burn::{
    Tensor,
    backend::{Cube, DispatchDevice},
    module::{Module, ModuleVisitor, Param},
    optim::GradientsParams,
    tensor::Device,
};
use burn_cubecl::tensor::CubeTensor;
use consort_comm::{DeviceBuffer, Placement};
use consort_ddp::ParamSpec;

use super::{BurnError, Entry, our_dtype};

/// cubecl's CUDA server: the type `get_resource` answers for.
type CudaServer = <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;

/// A tensor whose device memory consort uses: the tensor (so that burn
/// does not free it), cubecl's pin on its allocation (so that cubecl does
/// not move or reuse it) and the address and size it pinned.
struct Held {
    tensor: CubeTensor,
    _pin: Box<dyn Any + Send>,
    ptr: u64,
    bytes: usize,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .finish()
    }
}

fn device_error(name: &str, what: &str, why: impl std::fmt::Display) -> BurnError {
    BurnError::Device(format!("{what} of {name}: {why}"))
}

/// The CUDA ordinal of a burn device (autodiff or not), or why it has none.
pub(super) fn cuda_ordinal(device: &Device) -> Result<usize, String> {
    let plain = device.clone().inner();
    match plain.as_dispatch() {
        DispatchDevice::Cube(cubecl::Device::Cuda(d)) => Ok(d.index),
        _ => Err(format!(
            "{device:?} is not a CUDA device; make the module on `Device::cuda(i)`, or use \
             BurnModel::from_module for a module in host memory"
        )),
    }
}

/// Why `t` cannot be used as it is (a view of `spec` on GPU `ordinal`):
/// `None` when it can.
fn unfit(t: &CubeTensor, spec: &ParamSpec, ordinal: usize) -> Option<String> {
    match &t.device {
        cubecl::Device::Cuda(d) if d.index == ordinal => {}
        other => {
            return Some(format!(
                "it is on {other:?}, but the placement is cuda:{ordinal}"
            ));
        }
    }
    if t.qparams.is_some() {
        return Some("it is quantized".into());
    }
    if our_dtype(&spec.name, t.dtype).ok() != Some(spec.dtype) {
        return Some(format!(
            "it is {:?}; it should be {}",
            t.dtype,
            spec.describe()
        ));
    }
    if t.meta.is_tiled() || !t.is_contiguous() {
        return Some("it is strided or storage-tiled".into());
    }
    match t.meta.logical_shape() {
        Ok(shape) if shape.as_slice() == spec.shape.as_slice() => {}
        Ok(shape) => {
            return Some(format!(
                "its shape is {:?}, not the parameter's {:?}",
                shape.as_slice(),
                spec.shape
            ));
        }
        Err(e) => return Some(format!("its shape cannot be read: {e:?}")),
    }
    None
}

/// Pins `t`'s memory: `t` must fit `spec` (see [`unfit`]).
fn pin(t: CubeTensor, spec: &ParamSpec, what: &str, ordinal: usize) -> Result<Held, BurnError> {
    try_pin(t, spec, what, ordinal).map_err(|e| e.0)
}

/// [`pin`], giving `t` back with the error.
fn try_pin(
    t: CubeTensor,
    spec: &ParamSpec,
    what: &str,
    ordinal: usize,
) -> Result<Held, Box<(BurnError, CubeTensor)>> {
    if let Some(why) = unfit(&t, spec, ordinal) {
        return Err(Box::new((device_error(&spec.name, what, why), t)));
    }
    let r = match t.client.get_resource::<CudaServer>(t.handle.clone()) {
        Ok(r) => r,
        Err(e) => {
            let why = format!("cubecl: {e:?}");
            return Err(Box::new((device_error(&spec.name, what, why), t)));
        }
    };
    // A contiguous tensor starts where its handle does (the handle's
    // offset is in the pointer cubecl gives), and the pinned range must be
    // exactly the parameter's: a slice of a larger buffer whose handle
    // reports the whole buffer would otherwise let consort write past it.
    let (ptr, size) = (r.resource().ptr, r.resource().size);
    if size != spec.bytes() as u64 {
        let why = format!(
            "its memory holds {size} bytes, the parameter {}",
            spec.bytes()
        );
        return Err(Box::new((device_error(&spec.name, what, why), t)));
    }
    Ok(Held {
        tensor: t,
        _pin: Box::new(r),
        ptr,
        bytes: spec.bytes(),
    })
}

/// A float tensor's CubeTensor (without autodiff).
fn cube<const D: usize>(t: Tensor<D>) -> Result<CubeTensor, String> {
    t.inner().try_into_primitive::<Cube>().map_err(|e| {
        format!(
            "it is not a tensor of burn's cubecl backend ({e:?}); put the module on \
                 `Device::cuda(i)`, with burn's `fusion` off"
        )
    })
}

/// Pins every float parameter of a module, in visit order, each checked to
/// be the one the model was made from (its burn id).
struct PinParams<'a> {
    specs: &'a [ParamSpec],
    entries: &'a [Entry],
    ordinal: usize,
    found: Vec<Held>,
    err: Option<BurnError>,
}

impl ModuleVisitor for PinParams<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let i = self.found.len();
        let (Some(spec), Some(e)) = (self.specs.get(i), self.entries.get(i)) else {
            self.err.get_or_insert(BurnError::Mismatch {
                why: format!("it has more than {} float parameters", self.specs.len()),
            });
            return;
        };
        if param.id != e.id {
            self.err.get_or_insert(BurnError::Mismatch {
                why: format!(
                    "its float parameter #{i} is not {} (another burn id): pass the module \
                     this model was made from, or the one burn's optimizer returned for it",
                    e.name
                ),
            });
            return;
        }
        let held = cube(param.val())
            .map_err(|why| device_error(&spec.name, "the values", why))
            .and_then(|t| pin(t, spec, "the values", self.ordinal));
        match held {
            Ok(h) => self.found.push(h),
            Err(e) => {
                self.err.get_or_insert(e);
            }
        }
    }
}

/// The device side of a burn module: where DDP works, the specs, the
/// parameters' tensors while consort may write them, and this step's
/// gradient tensors.
#[derive(Debug)]
pub(super) struct OnDevice {
    pub(super) placement: Placement,
    pub(super) specs: Vec<ParamSpec>,
    ordinal: usize,
    /// burn's device, for its `sync`.
    device: Device,
    params: Vec<Held>,
    /// This step's gradients, taken out of burn's `GradientsParams` by
    /// `take_grads` until `give_grads` puts them back (or `drop_grads`).
    grads: Vec<Option<Held>>,
    /// Which parameters had a gradient in this step's `GradientsParams`
    /// (a frozen one counts: its zeros are its gradient).
    had: Vec<bool>,
}

impl OnDevice {
    /// The device side of `module` (whose parameters are `entries`), checked:
    /// every parameter a contiguous CUDA tensor on the placement's GPU, of
    /// a dtype DDP reduces. Waits for burn's queued kernels.
    pub(super) fn new<M: Module>(
        entries: &[Entry],
        module: &M,
        placement: Placement,
    ) -> Result<Self, BurnError> {
        if placement.device.kind() != "cuda" {
            return Err(BurnError::Device(format!(
                "the placement is a {} device; burn's CUDA tensors need a CUDA placement \
                 (consort::burn::placement)",
                placement.device.kind()
            )));
        }
        let ordinal = placement.device.ordinal() as usize;
        let Some(first) = entries.first() else {
            return Err(BurnError::Device(
                "the module has no float parameters".into(),
            ));
        };
        let device = first.grad_device.clone();
        let mut specs = Vec::with_capacity(entries.len());
        for e in entries {
            let dtype = our_dtype(&e.name, e.dtype)?;
            specs.push(ParamSpec {
                name: e.name.clone(),
                dtype,
                shape: e.dims.clone(),
            });
        }
        let n = specs.len();
        let mut dev = OnDevice {
            placement,
            specs,
            ordinal,
            device,
            params: Vec::new(),
            grads: (0..n).map(|_| None).collect(),
            had: vec![false; n],
        };
        dev.hold_params(entries, module)?;
        Ok(dev)
    }

    /// Holds `module`'s parameters (again: after burn's optimizer replaced
    /// them), once burn's kernels that write them are done. `module` must
    /// have `entries`' parameters (the same burn ids, in visit order).
    pub(super) fn hold_params<M: Module>(
        &mut self,
        entries: &[Entry],
        module: &M,
    ) -> Result<(), BurnError> {
        let mut v = PinParams {
            specs: &self.specs,
            entries,
            ordinal: self.ordinal,
            found: Vec::new(),
            err: None,
        };
        module.visit(&mut v);
        if let Some(e) = v.err {
            return Err(e);
        }
        crate::same_count(v.found.len(), self.specs.len())?;
        // The pins replaced go back to cubecl only once consort's stream
        // has done with them.
        self.release_after_consort()?;
        self.params = v.found;
        self.sync_burn()
    }

    /// Waits for consort's stream if anything is pinned, so that the pins
    /// dropped next go back to cubecl's pool with no copy or collective
    /// still queued on them (cubecl knows nothing of consort's stream: a
    /// pin let go early is memory the next forward may be given while
    /// consort still writes it).
    fn release_after_consort(&self) -> Result<(), BurnError> {
        if self.params.is_empty() && self.grads.iter().all(Option::is_none) {
            return Ok(());
        }
        self.sync_consort()
    }

    fn sync_burn(&self) -> Result<(), BurnError> {
        self.device
            .sync()
            .map_err(|e| BurnError::Device(format!("burn's device sync failed: {e:?}")))
    }

    /// Waits for consort's stream: what it wrote is then there for burn.
    pub(super) fn sync_consort(&self) -> Result<(), BurnError> {
        let p = &self.placement;
        p.device
            .synchronize(p.stream)
            .map_err(|e| BurnError::Device(format!("waiting for consort's stream: {e}")))
    }

    fn view(&self, h: &Held, spec: &ParamSpec) -> DeviceBuffer {
        // SAFETY: `h` pins `spec.bytes()` of live device memory of this GPU
        // (cubecl's resource and the tensor are held by `h`, which the model
        // keeps until after a wait for consort's stream); the view is ready
        // on the placement's stream because burn's writes finished in the
        // host sync that preceded it.
        unsafe { self.placement.buffer(h.ptr, spec.numel(), spec.dtype) }
    }

    /// Parameter `i`'s values, while held.
    pub(super) fn param(&self, i: usize) -> Option<DeviceBuffer> {
        Some(self.view(self.params.get(i)?, self.specs.get(i)?))
    }

    /// Parameter `i`'s gradient for this step (after `take_grads`).
    pub(super) fn grad(&self, i: usize) -> Option<DeviceBuffer> {
        Some(self.view(self.grads.get(i)?.as_ref()?, self.specs.get(i)?))
    }

    /// Whether parameter `i` had a gradient in this step's `GradientsParams`.
    pub(super) fn had_grad(&self, i: usize) -> bool {
        self.had.get(i).copied().unwrap_or(false)
    }
}

impl Drop for OnDevice {
    /// The pins go back to cubecl only once consort's stream is done with
    /// them (bounded by the device's sync timeout); if that wait fails, the
    /// pinned memory is leaked rather than handed back while work on it may
    /// still be queued.
    fn drop(&mut self) {
        if self.release_after_consort().is_err() {
            tracing::warn!(
                device = self.ordinal,
                "consort's stream did not finish; leaking the burn tensors it may still use"
            );
            std::mem::forget(std::mem::take(&mut self.params));
            std::mem::forget(std::mem::take(&mut self.grads));
        }
    }
}

/// The placement of a burn module on GPU `device` (`Device::cuda(i)`):
/// the NCCL backend's view of that GPU (the primary context, which cubecl
/// uses too) and a stream of consort's own, where DDP's copies and
/// collectives run; burn and consort hand over with host waits (see the
/// module doc). A device other than CUDA is refused by name;
/// `BackendUnavailable` without a CUDA driver or that GPU.
pub fn placement(device: &Device) -> Result<Placement, BurnError> {
    use consort_comm::Device as _;
    let ordinal = cuda_ordinal(device).map_err(BurnError::Device)?;
    let gpu = consort_nccl::CudaDevice::new(ordinal)?;
    let stream = gpu.new_stream()?;
    Ok(Placement {
        device: gpu,
        stream,
    })
}

/// Address ranges, for the aliasing check.
fn overlaps(seen: &[(u64, u64)], ptr: u64, bytes: usize) -> bool {
    let (a, b) = (ptr, ptr + bytes as u64);
    bytes > 0 && seen.iter().any(|&(c, d)| a < d && c < b)
}

/// Why taking a step's gradients failed, and the tensor of the entry that
/// failed if it had been taken out of `GradientsParams` (to go back in).
type TakeError = Box<(BurnError, Option<(usize, CubeTensor)>)>;

impl OnDevice {
    /// This step's gradient of parameter `e` (`spec`), taken out of `grads`,
    /// as a tensor DDP may write in place: the one burn made if nothing
    /// else holds its memory and it is contiguous, else a contiguous copy
    /// of its own; zeros in the parameter's dtype when there is none (an
    /// idle parameter, or one unused this step). Also whether `grads` had
    /// one. A gradient that is not a cubecl tensor stays in `grads`.
    fn grad_tensor(
        &self,
        e: &Entry,
        spec: &ParamSpec,
        grads: &mut GradientsParams,
    ) -> Result<(CubeTensor, bool), BurnError> {
        let found: Option<Result<CubeTensor, String>> = with_rank!(e.dims.len(), D => {
            grads.remove::<D>(e.id).map(|g| match cube::<D>(g.clone()) {
                Ok(t) => Ok(t), // `g` drops here: `t` alone holds the memory
                Err(why) => {
                    grads.register::<D>(e.id, g);
                    Err(why)
                }
            })
        }, None);
        let Some(t) = found else {
            // Made on the device, in the parameter's own dtype (the device's
            // default float dtype may be another).
            let t = with_rank!(e.dims.len(), D => {
                cube(Tensor::<D>::zeros(e.dims.clone(), (&e.grad_device, e.dtype)))
            }, Err("more than 6 dimensions".into()));
            let t = t.map_err(|why| device_error(&spec.name, "the gradient", why))?;
            return Ok((t, false));
        };
        let t = t.map_err(|why| device_error(&spec.name, "the gradient", why))?;
        // Out of `grads`, `t` is the only tensor on its memory unless
        // something else holds it too: the parameter (a gradient that is
        // the parameter), another parameter's gradient, an activation, a
        // clone the caller kept. An average written there would change
        // what those read.
        if !t.can_mut() {
            return Ok((burn_cubecl::kernel::into_contiguous(t.copy()), true));
        }
        if t.meta.is_tiled() || !t.is_contiguous() {
            return Ok((burn_cubecl::kernel::into_contiguous(t), true));
        }
        Ok((t, true))
    }

    /// Takes this step's gradients out of `grads` (see the module doc: in
    /// place where they fit, a copy of their own where not, zeros where
    /// missing), then waits for burn's kernels. `idle[i]`: parameter `i` is
    /// frozen and has no gradient this step (synced as zeros, and given
    /// back to no optimizer). On an error every gradient taken goes back
    /// into `grads`.
    pub(super) fn take_grads(
        &mut self,
        entries: &[Entry],
        grads: &mut GradientsParams,
        idle: &[bool],
    ) -> Result<(), BurnError> {
        if let Some(i) = self.grads.iter().position(Option::is_some) {
            return Err(BurnError::Device(format!(
                "the last step's gradients (of {} and the others) were not handed back: call \
                 BurnModel::push_grads after Ddp::sync_grads (or push_values after the \
                 sharded step) before pulling the next step's",
                self.specs[i].name
            )));
        }
        self.had.iter_mut().for_each(|h| *h = false);
        if let Err(failed) = self.take_each(entries, grads, idle) {
            let (e, mut at) = *failed;
            // Back into `grads`, as taken (or as copied: the same values).
            for (i, en) in entries.iter().enumerate() {
                let back = match at.take() {
                    Some((j, t)) if j == i => Some(t),
                    other => {
                        at = other;
                        self.grads[i].take().map(|h| h.tensor)
                    }
                };
                if let Some(t) = back.filter(|_| self.had[i] && !idle[i]) {
                    with_rank!(en.dims.len(), D => {
                        grads.register::<D>(en.id, Tensor::<D>::from_primitive::<Cube>(t));
                    }, ());
                }
            }
            self.grads.iter_mut().for_each(|g| *g = None);
            self.had.iter_mut().for_each(|h| *h = false);
            return Err(e);
        }
        // Pinning made this thread's cubecl stream wait on the stream each
        // gradient was made on (cubecl's get_resource resolves the binding
        // as a launch would), so this wait covers backward's kernels even
        // where another thread queued them, as long as nothing writes the
        // gradients from a third thread meanwhile (call backward and
        // pull_grads with no await between, as the examples do).
        self.sync_burn()
    }

    /// [`OnDevice::take_grads`]'s loop; on an error, the error and the
    /// tensor of the entry that failed, if it was taken.
    fn take_each(
        &mut self,
        entries: &[Entry],
        grads: &mut GradientsParams,
        idle: &[bool],
    ) -> Result<(), TakeError> {
        // Parameters still held (before the first push_grads, or for the
        // sharded strategies) are pinned too: no gradient may be their memory.
        let mut seen: Vec<(u64, u64)> = self
            .params
            .iter()
            .map(|h| (h.ptr, h.ptr + h.bytes as u64))
            .collect();
        for (i, e) in entries.iter().enumerate() {
            let spec = &self.specs[i];
            let (t, had) = self
                .grad_tensor(e, spec, grads)
                .map_err(|e| Box::new((e, None)))?;
            self.had[i] = had || idle[i];
            let mut h = try_pin(t, spec, "the gradient", self.ordinal)
                .map_err(|f| Box::new((f.0, Some((i, f.1)))))?;
            if overlaps(&seen, h.ptr, h.bytes) {
                let own = burn_cubecl::kernel::into_contiguous(h.tensor.copy());
                h = try_pin(own, spec, "the gradient", self.ordinal)
                    .map_err(|f| Box::new((f.0, Some((i, f.1)))))?;
            }
            seen.push((h.ptr, h.ptr + h.bytes as u64));
            self.grads[i] = Some(h);
        }
        Ok(())
    }

    /// After consort's stream is done: puts this step's gradients (holding
    /// their averages) back into `grads`, none for an idle parameter (see
    /// [`OnDevice::take_grads`]), and lets go of them and of the
    /// parameters' tensors.
    pub(super) fn give_grads(
        &mut self,
        entries: &[Entry],
        grads: &mut GradientsParams,
        idle: &[bool],
    ) -> Result<(), BurnError> {
        self.sync_consort()?;
        self.params.clear();
        for (i, e) in entries.iter().enumerate() {
            let Some(h) = self.grads[i].take() else {
                continue;
            };
            if idle[i] {
                continue;
            }
            with_rank!(e.dims.len(), D => {
                grads.register::<D>(e.id, Tensor::<D>::from_primitive::<Cube>(h.tensor));
            }, ());
        }
        self.had.iter_mut().for_each(|h| *h = false);
        Ok(())
    }

    /// After consort's stream is done: lets go of this step's gradients
    /// (the sharded strategies copied them into their shards).
    pub(super) fn drop_grads(&mut self) -> Result<(), BurnError> {
        self.sync_consort()?;
        self.grads.iter_mut().for_each(|g| *g = None);
        self.had.iter_mut().for_each(|h| *h = false);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(deprecated)] // the adapter's CPU backend is ndarray
    fn a_cpu_device_has_no_cuda_ordinal() {
        let err = cuda_ordinal(&Device::ndarray()).unwrap_err();
        assert!(err.contains("is not a CUDA device"), "{err}");
        assert!(err.contains("BurnModel::from_module"), "{err}");
    }

    #[test]
    fn a_cuda_device_names_its_ordinal_without_a_gpu() {
        assert_eq!(cuda_ordinal(&Device::cuda(0)), Ok(0));
        assert_eq!(cuda_ordinal(&Device::cuda(3)), Ok(3));
    }

    #[test]
    #[allow(deprecated)]
    fn placement_refuses_a_cpu_device_by_name() {
        let err = placement(&Device::ndarray()).unwrap_err().to_string();
        assert!(err.contains("is not a CUDA device"), "{err}");
    }

    #[test]
    fn placement_without_a_driver_is_an_error_not_a_panic() {
        match placement(&Device::cuda(0)) {
            Ok(p) => assert_eq!(p.device.kind(), "cuda"), // a GPU is here
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    #[allow(deprecated)]
    fn a_module_on_a_placement_other_than_cuda_is_refused() {
        use burn::nn::LinearConfig;
        let net = LinearConfig::new(2, 3).init(&Device::ndarray());
        let emulated = consort_sim::EmulatedDevice::new(Default::default());
        let place = Placement {
            device: emulated,
            stream: 0,
        };
        let err = crate::BurnModel::from_module_on(&net, place).unwrap_err();
        assert!(err.to_string().contains("need a CUDA placement"), "{err}");
    }

    #[test]
    fn a_device_model_can_cross_an_await_on_a_multi_threaded_runtime() {
        fn send<T: Send>() {}
        send::<crate::BurnModel>();
    }

    #[test]
    fn ranges_that_touch_do_not_overlap() {
        let seen = [(100, 200)];
        assert!(!overlaps(&seen, 200, 8));
        assert!(!overlaps(&seen, 92, 8));
        assert!(overlaps(&seen, 199, 8));
        assert!(overlaps(&seen, 50, 400));
        assert!(!overlaps(&seen, 150, 0));
    }
}
