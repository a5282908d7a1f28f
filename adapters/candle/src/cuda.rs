//! Candle models on CUDA (feature `cuda`): DDP reads the variables'
//! and the gradients' device memory where candle keeps it, with no host
//! copy.
//!
//! This module owns finding a candle tensor's device memory (its
//! `CudaSlice`, offset by its layout) and keeping each step's gradient
//! tensors alive, contiguous and unaliased while DDP writes the averages
//! into them. It owns no copy and no reduction: DDP's device buckets do
//! both, stream-ordered after candle's stream.

use candle_core::{
    DType as CDType, Storage, Tensor as CTensor, Var,
    backprop::GradStore,
    cuda::cudarc::driver::{CudaStream, DevicePtr},
};
use consort_comm::{DeviceBuffer, Placement};

use super::{CandleError, our_dtype};
use consort_ddp::params::ParamSpec;

/// The device side of a candle model: where DDP works, the specs, and
/// this step's gradient tensors.
#[derive(Debug)]
pub(super) struct OnDevice {
    pub(super) placement: Placement,
    pub(super) specs: Vec<ParamSpec>,
    /// This step's gradient of each variable, as `pull_grads` found it, or
    /// a tensor made for it (zeros for a missing gradient, a contiguous or
    /// unaliased copy); `made` says which, for `push_grads`, and `had`
    /// whether the variable had a gradient at all.
    grads: Vec<Option<CTensor>>,
    made: Vec<bool>,
    had: Vec<bool>,
}

/// A contiguous CUDA tensor's memory: its address and bytes, and the
/// stream candle orders its uses on.
struct Memory {
    ptr: u64,
    bytes: usize,
    stream: u64,
}

fn not_on(name: &str, what: &str, why: String) -> CandleError {
    CandleError::Device(format!("{what} of {name}: {why}"))
}

/// A device as torch names it: `cpu`, `cuda:1`.
fn device_name(loc: candle_core::DeviceLocation) -> String {
    match loc {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// The memory of `t` (named `name` in errors): a contiguous tensor on GPU
/// `ordinal`.
fn memory(t: &CTensor, name: &str, what: &str, ordinal: i32) -> Result<Memory, CandleError> {
    if !t.is_contiguous() {
        return Err(not_on(name, what, "it is not contiguous".into()));
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(not_on(
            name,
            what,
            format!(
                "it is on {}, not on CUDA; put every variable on the GPU (or use \
                 CandleModel::from_varmap for a model in host memory)",
                device_name(t.device().location())
            ),
        ));
    };
    let on = match t.device().location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id as i32,
        other => {
            let on = device_name(other);
            return Err(not_on(name, what, format!("it is on {on}")));
        }
    };
    if on != ordinal {
        return Err(not_on(
            name,
            what,
            format!("it is on cuda:{on}, but DDP's placement is cuda:{ordinal}"),
        ));
    }
    let stream = cs.device.cuda_stream();
    let base = match t.dtype() {
        CDType::F32 => address::<f32>(cs.as_cuda_slice()?, &stream),
        CDType::F64 => address::<f64>(cs.as_cuda_slice()?, &stream),
        CDType::F16 => address::<consort_comm::half::f16>(cs.as_cuda_slice()?, &stream),
        CDType::BF16 => address::<consort_comm::half::bf16>(cs.as_cuda_slice()?, &stream),
        dtype => {
            return Err(CandleError::Unsupported {
                name: name.to_string(),
                dtype,
            });
        }
    };
    let size = t.dtype().size_in_bytes();
    Ok(Memory {
        ptr: base + (layout.start_offset() * size) as u64,
        bytes: t.elem_count() * size,
        stream: stream.cu_stream() as u64,
    })
}

/// The device address of `slice`, for use on `stream` (candle's own).
fn address<T>(
    slice: &candle_core::cuda::cudarc::driver::CudaSlice<T>,
    stream: &std::sync::Arc<CudaStream>,
) -> u64 {
    let (ptr, _read) = slice.device_ptr(stream);
    ptr
}

/// A view DDP may read and write: `t`'s memory as `spec`'s tensor.
///
/// `t` must be kept alive by the caller for as long as DDP's ops on the
/// view run (the model holds its variables and this step's gradients).
fn view(
    t: &CTensor,
    spec: &ParamSpec,
    what: &str,
    ordinal: i32,
) -> Result<DeviceBuffer, CandleError> {
    let m = memory(t, &spec.name, what, ordinal)?;
    if m.bytes != spec.bytes() {
        return Err(not_on(
            &spec.name,
            what,
            format!(
                "it has {} bytes; {} needs {}",
                m.bytes,
                spec.describe(),
                spec.bytes()
            ),
        ));
    }
    // SAFETY: `m` is the memory of a live, contiguous CUDA tensor of
    // `spec.numel()` elements of `spec.dtype` on GPU `ordinal`; the model
    // keeps the tensor (and so candle's allocation) alive while DDP uses
    // the view, and candle frees it on `m.stream`, which DDP orders after
    // its own uses.
    Ok(unsafe { DeviceBuffer::new(m.ptr, spec.numel(), spec.dtype, ordinal, m.stream) })
}

impl OnDevice {
    /// The device side of `vars` (ordered), checked: every variable on the
    /// placement's GPU, contiguous, of a dtype DDP reduces.
    pub(super) fn new(vars: &[(String, Var)], placement: Placement) -> Result<Self, CandleError> {
        if placement.device.kind() != "cuda" {
            return Err(CandleError::Device(format!(
                "the placement is a {} device; candle's CUDA tensors need a CUDA placement \
                 (consort::candle::placement)",
                placement.device.kind()
            )));
        }
        let ordinal = placement.device.ordinal();
        let mut specs = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            let t = var.as_tensor();
            let spec = ParamSpec {
                name: name.clone(),
                dtype: our_dtype(name, t.dtype())?,
                shape: t.dims().to_vec(),
            };
            memory(t, name, "the values", ordinal)?;
            specs.push(spec);
        }
        let n = specs.len();
        Ok(OnDevice {
            placement,
            specs,
            grads: vec![None; n],
            made: vec![false; n],
            had: vec![false; n],
        })
    }

    fn ordinal(&self) -> i32 {
        self.placement.device.ordinal()
    }

    /// Parameter `i`'s values.
    pub(super) fn param(&self, vars: &[(String, Var)], i: usize) -> Option<DeviceBuffer> {
        let (spec, (_, var)) = (self.specs.get(i)?, vars.get(i)?);
        view(var.as_tensor(), spec, "the values", self.ordinal()).ok()
    }

    /// Whether variable `i` had a gradient in this step's `GradStore`.
    pub(super) fn had_grad(&self, i: usize) -> bool {
        self.had.get(i).copied().unwrap_or(false)
    }

    /// Parameter `i`'s gradient for this step (after `take_grads`).
    pub(super) fn grad(&self, i: usize) -> Option<DeviceBuffer> {
        let (spec, g) = (self.specs.get(i)?, self.grads.get(i)?.as_ref()?);
        view(g, spec, "the gradient", self.ordinal()).ok()
    }

    /// Takes this step's gradients from `grads`: each variable's gradient,
    /// checked, or a tensor made for it: zeros where the variable has no
    /// gradient (DDP treats it as unused, as torch does, and writes the
    /// average there), and a contiguous copy where the gradient is a
    /// strided view or shares memory with another gradient or a variable
    /// (DDP writes each average in place).
    pub(super) fn take_grads(
        &mut self,
        vars: &[(String, Var)],
        grads: &GradStore,
    ) -> Result<(), CandleError> {
        let ordinal = self.ordinal();
        let mut taken = Vec::with_capacity(vars.len());
        let mut made = Vec::with_capacity(vars.len());
        let mut had = Vec::with_capacity(vars.len());
        for (spec, (name, var)) in self.specs.iter().zip(vars) {
            let v = var.as_tensor();
            let (g, new) = match grads.get(v) {
                None => (v.zeros_like()?.detach(), true),
                Some(g) if !g.is_contiguous() => (g.force_contiguous()?.detach(), true),
                Some(g) => (g.clone(), false),
            };
            had.push(grads.get(v).is_some());
            if g.dtype() != v.dtype() || g.dims() != v.dims() {
                return Err(not_on(
                    name,
                    "the gradient",
                    format!(
                        "it is {:?} {:?}; a gradient has its variable's dtype and shape ({})",
                        g.dtype(),
                        g.dims(),
                        spec.describe()
                    ),
                ));
            }
            taken.push(g);
            made.push(new);
        }
        // Every gradient DDP writes must own its memory: copy any that
        // overlaps a variable or an earlier gradient.
        let mut seen: Vec<(u64, u64)> = Vec::new();
        for (name, var) in vars {
            let m = memory(var.as_tensor(), name, "the values", ordinal)?;
            seen.push((m.ptr, m.ptr + m.bytes as u64));
        }
        for (i, g) in taken.iter_mut().enumerate() {
            let name = &self.specs[i].name;
            let m = memory(g, name, "the gradient", ordinal)?;
            let range = (m.ptr, m.ptr + m.bytes as u64);
            if m.bytes > 0 && seen.iter().any(|&(a, b)| range.0 < b && a < range.1) {
                *g = g.force_contiguous()?.detach();
                made[i] = true;
                let m = memory(g, name, "the gradient", ordinal)?;
                seen.push((m.ptr, m.ptr + m.bytes as u64));
            } else {
                seen.push(range);
            }
        }
        self.grads = taken.into_iter().map(Some).collect();
        self.made = made;
        self.had = had;
        Ok(())
    }

    /// Puts the tensors `take_grads` made into `grads` (the others already
    /// hold their averages in place), and lets go of this step's gradients:
    /// the next step's `sync_grads` without `pull_grads` finds none, rather
    /// than reducing stale ones.
    pub(super) fn give_grads(
        &mut self,
        vars: &[(String, Var)],
        grads: &mut GradStore,
    ) -> Result<(), CandleError> {
        let taken = std::mem::replace(&mut self.grads, vec![None; vars.len()]);
        self.had = vec![false; vars.len()];
        for ((made, g), (_, var)) in self.made.iter().zip(taken).zip(vars) {
            if let (true, Some(g)) = (made, g) {
                grads.insert(var.as_tensor(), g);
            }
        }
        Ok(())
    }
}
