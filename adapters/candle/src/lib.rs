//! consort-candle: DDP and the sharded strategies (ZeRO-1, ZeRO-2, FSDP)
//! for a candle model whose parameters live in a `VarMap` and whose
//! gradients come back from `loss.backward()` as a `GradStore`. In the
//! facade it is `consort::candle` (feature `candle`).
//!
//! Candle tensors do not lend out their host bytes, so [`CandleModel`]
//! keeps a host copy (a [`PlainModel`]) that DDP works on, and copies
//! across at three points:
//!
//! ```text
//! let mut model = CandleModel::from_varmap(&varmap)?;   // values → host
//! let mut ddp = Ddp::new(backend, &mut model, opts).await?;
//! model.push_values()?;                                 // rank 0's values → vars
//! loop {
//!     let mut grads = loss.backward()?;
//!     model.pull_grads(&grads)?;                        // grads → host
//!     ddp.sync_grads(&mut model).await?;                // average
//!     model.push_grads(&mut grads)?;                    // averages → GradStore
//!     optimizer.step(&grads)?;
//! }
//! ```
//!
//! Parameters are ordered by name (a `VarMap` is a hash map), so every rank
//! lists them alike. f32, f64, f16 and bf16 are supported.
//!
//! With feature `cuda` (in the facade, `candle-cuda`), a model on a GPU
//! skips the host copy: `CandleModel::from_varmap_on` takes a
//! [`Placement`](consort_comm::Placement) (`placement(&cuda_device)`), DDP broadcasts into the
//! variables and averages the `GradStore`'s gradients in their device
//! memory (stream-ordered after candle's stream), and the same loop runs:
//! `push_values` and `push_grads` then have nothing to copy.

#![cfg_attr(docsrs, feature(doc_cfg))]

use candle_core::{DType as CDType, Device, Tensor as CTensor, Var, backprop::GradStore};
use consort_comm::{
    DType,
    half::{bf16, f16},
};

use consort_ddp::params::{ParamSet, ParamSpec, PlainModel, PlainModelError};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod placement;
mod sharded;

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use placement::placement;

/// The candle this adapter is built against (its `Tensor`, `Var` and
/// `GradStore` are the ones [`CandleModel`] takes).
pub use candle_core;
/// candle's `nn` crate, of the same release.
pub use candle_nn;

#[cfg(feature = "cuda")]
use consort_comm::{DeviceBuffer, Placement};

/// Why the candle adapter failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CandleError {
    /// Candle refused an operation.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A variable's dtype has no float equivalent here.
    #[error(
        "variable {name} has dtype {dtype:?}; DDP reduces f32, f64, f16 and bf16 parameters \
         (keep integer state out of the VarMap)"
    )]
    Unsupported {
        /// The variable.
        name: String,
        /// Its candle dtype.
        dtype: CDType,
    },
    /// The host copy refused the tensor.
    #[error(transparent)]
    Model(#[from] PlainModelError),
    /// A tensor cannot be used on the model's device (feature
    /// `cuda`): which one and why.
    #[error("candle on CUDA: {0}")]
    Device(String),
    /// The model is not the one the sharded strategy wrapped.
    #[error("candle: {0}")]
    NotThisModel(String),
    /// A sharded strategy refused a variable's values or gradient.
    #[error("variable {name}: {source}")]
    Sharded {
        /// The variable.
        name: String,
        /// What the sharded strategy said (its rank, call and cause).
        source: Box<consort_ddp::DdpError>,
    },
}

/// A candle model as a [`ParamSet`]: the variables, and a host copy of
/// their values and gradients (or, on CUDA, their device memory).
#[derive(Debug)]
pub struct CandleModel {
    vars: Vec<(String, Var)>,
    host: PlainModel,
    #[cfg(feature = "cuda")]
    dev: Option<cuda::OnDevice>,
}

fn our_dtype(name: &str, d: CDType) -> Result<DType, CandleError> {
    match d {
        CDType::F32 => Ok(DType::F32),
        CDType::F64 => Ok(DType::F64),
        CDType::F16 => Ok(DType::F16),
        CDType::BF16 => Ok(DType::BF16),
        dtype => Err(CandleError::Unsupported {
            name: name.to_string(),
            dtype,
        }),
    }
}

/// A tensor's values as little-endian bytes.
fn to_bytes(t: &CTensor) -> Result<Vec<u8>, CandleError> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        CDType::F32 => bytemuck::cast_slice(&flat.to_vec1::<f32>()?).to_vec(),
        CDType::F64 => bytemuck::cast_slice(&flat.to_vec1::<f64>()?).to_vec(),
        CDType::F16 => bytemuck::cast_slice(&flat.to_vec1::<f16>()?).to_vec(),
        _ => bytemuck::cast_slice(&flat.to_vec1::<bf16>()?).to_vec(),
    })
}

/// A tensor of `dtype` and `shape` on `device` from little-endian bytes.
fn from_bytes(
    dtype: DType,
    bytes: &[u8],
    shape: &[usize],
    device: &Device,
) -> Result<CTensor, CandleError> {
    Ok(match dtype {
        DType::F32 => CTensor::from_slice(
            &bytemuck::pod_collect_to_vec::<u8, f32>(bytes),
            shape,
            device,
        )?,
        DType::F64 => CTensor::from_slice(
            &bytemuck::pod_collect_to_vec::<u8, f64>(bytes),
            shape,
            device,
        )?,
        DType::F16 => CTensor::from_slice(
            &bytemuck::pod_collect_to_vec::<u8, f16>(bytes),
            shape,
            device,
        )?,
        _ => CTensor::from_slice(
            &bytemuck::pod_collect_to_vec::<u8, bf16>(bytes),
            shape,
            device,
        )?,
    })
}

impl CandleModel {
    /// Every variable of `varmap`, ordered by name.
    pub fn from_varmap(varmap: &candle_nn::VarMap) -> Result<Self, CandleError> {
        let vars: Vec<(String, Var)> = {
            let data = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
            data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        Self::from_vars(vars)
    }

    /// The given named variables, ordered by name.
    pub fn from_vars(mut vars: Vec<(String, Var)>) -> Result<Self, CandleError> {
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut host = PlainModel::new();
        for (name, var) in &vars {
            let t = var.as_tensor();
            let dtype = our_dtype(name, t.dtype())?;
            let bytes = to_bytes(t)?;
            host.add_param_bytes(name.clone(), dtype, t.dims().to_vec(), bytes)?;
        }
        Ok(CandleModel {
            vars,
            host,
            #[cfg(feature = "cuda")]
            dev: None,
        })
    }

    /// Every variable of `varmap`, ordered by name, on the GPU of
    /// `placement` (feature `cuda`): DDP works in the variables' and
    /// the gradients' device memory, with no host copy. In consort,
    /// `consort::candle::placement(&cuda_device)` makes the placement (the
    /// NCCL backend's view of candle's GPU). Every variable must be a
    /// contiguous CUDA tensor on that GPU.
    #[cfg(feature = "cuda")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn from_varmap_on(
        varmap: &candle_nn::VarMap,
        placement: Placement,
    ) -> Result<Self, CandleError> {
        let vars: Vec<(String, Var)> = {
            let data = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
            data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        Self::from_vars_on(vars, placement)
    }

    /// The given named variables, ordered by name, on the GPU of
    /// `placement` (see [`CandleModel::from_varmap_on`]).
    #[cfg(feature = "cuda")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn from_vars_on(
        mut vars: Vec<(String, Var)>,
        placement: Placement,
    ) -> Result<Self, CandleError> {
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let dev = cuda::OnDevice::new(&vars, placement)?;
        Ok(CandleModel {
            vars,
            host: PlainModel::new(),
            dev: Some(dev),
        })
    }

    /// Whether DDP works in the variables' device memory (a model made by
    /// `from_varmap_on`).
    pub fn on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.dev.is_some() {
            return true;
        }
        false
    }

    /// The variables, in DDP's order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// The host copy (values and gradients); empty for a model on a
    /// device.
    pub fn host(&self) -> &PlainModel {
        &self.host
    }

    /// Writes the host values into the variables (after `Ddp::new`
    /// replaced them with rank 0's). On a device there is nothing to
    /// write: DDP broadcast into the variables' memory.
    pub fn push_values(&mut self) -> Result<(), CandleError> {
        if self.on_device() {
            return Ok(());
        }
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let t = var.as_tensor();
            let dtype = our_dtype("", t.dtype())?;
            let v = from_bytes(dtype, self.host.param_bytes_mut(i), t.dims(), t.device())?;
            var.set(&v)?;
        }
        Ok(())
    }

    /// Copies this step's gradients from `grads` to the host copy; a
    /// variable with no gradient has none there either.
    ///
    /// On a device nothing is copied: the model keeps this step's gradient
    /// tensors for DDP, which writes the averages into them in place (as
    /// torch's DDP writes `param.grad`). A variable with no gradient is
    /// unused this step, as on the host (an error unless
    /// `find_unused_parameters` is on); it gets a zero gradient for DDP to
    /// write the average into. A strided or shared gradient gets a
    /// contiguous copy of its own. [`CandleModel::push_grads`] puts the
    /// gradients made here into `grads`.
    pub fn pull_grads(&mut self, grads: &GradStore) -> Result<(), CandleError> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &mut self.dev {
            return dev.take_grads(&self.vars, grads);
        }
        self.host.zero_grad();
        for (i, (_, var)) in self.vars.iter().enumerate() {
            if let Some(g) = grads.get(var.as_tensor()) {
                let bytes = to_bytes(g)?;
                let dst = self.host.grad_bytes_mut(i);
                if dst.len() == bytes.len() {
                    dst.copy_from_slice(&bytes);
                }
            }
        }
        Ok(())
    }

    /// Writes the (averaged) host gradients into `grads`, for the
    /// optimizer. On a device the averages are already in `grads`' tensors;
    /// only the gradients `pull_grads` had to make are inserted.
    pub fn push_grads(&mut self, grads: &mut GradStore) -> Result<(), CandleError> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &mut self.dev {
            return dev.give_grads(&self.vars, grads);
        }
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let t = var.as_tensor();
            if let Some(g) = self.host.grad_bytes(i) {
                let dtype = our_dtype("", t.dtype())?;
                grads.insert(t, from_bytes(dtype, g, t.dims(), t.device())?);
            }
        }
        Ok(())
    }
}

impl ParamSet for CandleModel {
    fn params(&self) -> Vec<ParamSpec> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &self.dev {
            return dev.specs.clone();
        }
        self.host.params()
    }

    #[cfg(feature = "cuda")]
    fn placement(&self) -> Option<Placement> {
        self.dev.as_ref().map(|d| d.placement.clone())
    }

    #[cfg(feature = "cuda")]
    fn param_device(&mut self, i: usize) -> Option<DeviceBuffer> {
        self.dev.as_ref()?.param(&self.vars, i)
    }

    #[cfg(feature = "cuda")]
    fn grad_device(&mut self, i: usize) -> Option<DeviceBuffer> {
        self.dev.as_ref()?.grad(i)
    }

    #[cfg(feature = "cuda")]
    fn has_grad_device(&self, i: usize) -> bool {
        self.dev.as_ref().is_some_and(|d| d.had_grad(i))
    }

    fn param_bytes_mut(&mut self, i: usize) -> &mut [u8] {
        self.host.param_bytes_mut(i)
    }

    fn grad_bytes(&self, i: usize) -> Option<&[u8]> {
        self.host.grad_bytes(i)
    }

    fn grad_bytes_mut(&mut self, i: usize) -> &mut [u8] {
        self.host.grad_bytes_mut(i)
    }
}
