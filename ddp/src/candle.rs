//! The candle adapter (feature `candle`): DDP for a candle model whose
//! parameters live in a `VarMap` and whose gradients come back from
//! `loss.backward()` as a `GradStore`.
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

use candle_core::{DType as CDType, Device, Tensor as CTensor, Var, backprop::GradStore};
use consort_comm::{
    DType,
    half::{bf16, f16},
};

use crate::params::{ParamSet, ParamSpec, PlainModel, PlainModelError};

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
}

/// A candle model as a [`ParamSet`]: the variables, and a host copy of
/// their values and gradients.
#[derive(Debug)]
pub struct CandleModel {
    vars: Vec<(String, Var)>,
    host: PlainModel,
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
        Ok(CandleModel { vars, host })
    }

    /// The variables, in DDP's order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// The host copy (values and gradients).
    pub fn host(&self) -> &PlainModel {
        &self.host
    }

    /// Writes the host values into the variables (after `Ddp::new`
    /// replaced them with rank 0's).
    pub fn push_values(&mut self) -> Result<(), CandleError> {
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
    pub fn pull_grads(&mut self, grads: &GradStore) -> Result<(), CandleError> {
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
    /// optimizer.
    pub fn push_grads(&self, grads: &mut GradStore) -> Result<(), CandleError> {
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
        self.host.params()
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
