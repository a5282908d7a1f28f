//! A [`CandleModel`] under a sharded strategy ([`Sharded`]: ZeRO-1, ZeRO-2,
//! FSDP, HSDP): each gathered unit goes into its variables for the forward
//! pass, and `loss.backward()`'s gradients go to the shards.
//!
//! ```text
//! let mut model = CandleModel::from_varmap(&varmap)?;
//! let opts = ShardOptions::new(Strategy::Fsdp);
//! let mut fsdp = Sharded::new(backend, &mut model, AdamW::new(1e-3), opts).await?;
//! loop {
//!     for u in 0..fsdp.layout().units.len() {
//!         model.set_gathered(&fsdp.gather(u).await?)?; // unit u → its variables
//!     }
//!     let grads = loss.backward()?;
//!     model.mark_grads(&grads, &mut fsdp)?;            // averaged in the background
//!     fsdp.step().await?;                              // each rank updates its shard
//! }
//! ```
//!
//! The optimizer is the shards' ([`consort_ddp::Sgd`], [`consort_ddp::AdamW`]), not
//! candle's: each rank updates only its shard. Candle's variables always
//! hold whole tensors and its backward makes every gradient at once, so
//! every unit is gathered before the forward pass and stays in the
//! variables through the step: a rank keeps 1/N of the gradients and of
//! the optimizer state (ZeRO-2's saving), not of the parameters in use.
//! Under a mixed-precision policy the gathered compute-dtype values are
//! cast to each variable's dtype. On a GPU (feature `cuda`, the
//! model from `CandleModel::from_varmap_on`) gathered values are copied
//! into the variables and gradients handed over in device memory, with no
//! host copy; a compute dtype other than the variables' goes through the
//! host.

use candle_core::backprop::GradStore;
use consort_comm::{
    DType,
    half::{bf16, f16},
};

use super::{CandleError, CandleModel, from_bytes, our_dtype};
use consort_ddp::{DdpError, Sharded, shard::Gathered};

impl CandleModel {
    /// Writes unit `g`'s whole parameters (from [`Sharded::gather`]) into
    /// their variables, for the forward pass.
    pub fn set_gathered(&mut self, g: &Gathered) -> Result<(), CandleError> {
        for &p in g.params() {
            #[cfg(feature = "cuda")]
            if self.copy_gathered_on_device(g, p)? {
                continue;
            }
            let (name, var) = self.var(p)?;
            let t = var.as_tensor();
            let bytes = g.param_bytes(p).map_err(sharded_error(name))?;
            let got = g.param_dtype(p).map_err(sharded_error(name))?;
            let n = bytes.len() / got.size_bytes();
            if n != t.elem_count() {
                return Err(CandleError::NotThisModel(format!(
                    "unit {}'s parameter {p} has {n} elements, but variable {name} has {}: pass \
                     the CandleModel that Sharded::new wrapped",
                    g.unit(),
                    t.elem_count()
                )));
            }
            let v = from_bytes(got, &bytes, t.dims(), t.device())?;
            var.set(&v.to_dtype(t.dtype())?)?;
        }
        Ok(())
    }

    /// Hands this step's gradients in `grads` to `sharded`, the last
    /// parameter first (the order its units' reductions launch in). A
    /// variable with no gradient (unused this step) contributes zeros, as
    /// in torch's FSDP.
    pub fn mark_grads(
        &mut self,
        grads: &GradStore,
        sharded: &mut Sharded,
    ) -> Result<(), CandleError> {
        self.check_wrapped(sharded)?;
        #[cfg(feature = "cuda")]
        if self.on_device() && sharded.placement().is_some() {
            return self.mark_grads_on_device(grads, sharded);
        }
        for p in (0..self.vars.len()).rev() {
            let (name, var) = self.var(p)?;
            let t = var.as_tensor();
            let dtype = our_dtype(name, t.dtype())?;
            let g = match grads.get(t) {
                Some(g) => g.flatten_all()?,
                None => t.zeros_like()?.flatten_all()?,
            };
            let marked = match dtype {
                DType::F32 => sharded.mark_ready(p, &g.to_vec1::<f32>()?),
                DType::F64 => sharded.mark_ready(p, &g.to_vec1::<f64>()?),
                DType::F16 => sharded.mark_ready(p, &g.to_vec1::<f16>()?),
                _ => sharded.mark_ready(p, &g.to_vec1::<bf16>()?),
            };
            marked.map_err(sharded_error(name))?;
        }
        Ok(())
    }

    /// On a GPU: parameter `p` of `g`, gathered on the device in the
    /// variable's dtype, copied into the variable's memory on the compute
    /// stream, with no host copy. `false` when it cannot be (a host model
    /// or host shards, or a compute dtype to cast): the caller copies
    /// through the host.
    #[cfg(feature = "cuda")]
    fn copy_gathered_on_device(&mut self, g: &Gathered, p: usize) -> Result<bool, CandleError> {
        let (Some(dev), Ok(src)) = (&self.dev, g.param_device(p)) else {
            return Ok(false);
        };
        let (name, _) = self.var(p)?;
        let Some(dst) = dev.param(&self.vars, p) else {
            return Ok(false);
        };
        if src.dtype() != dst.dtype() || src.len() != dst.len() {
            return Ok(false);
        }
        let bytes = src.len() * src.dtype().size_bytes();
        consort_ddp::device::copy_out(&dev.placement, &dst, src.ptr(), bytes, name)
            .map_err(|e| CandleError::Device(format!("the gathered values of {name}: {e}")))?;
        Ok(true)
    }

    /// On a GPU: this step's gradient tensors (zeros for an unused
    /// variable) go to the device shards from their device memory.
    #[cfg(feature = "cuda")]
    fn mark_grads_on_device(
        &mut self,
        grads: &GradStore,
        sharded: &mut Sharded,
    ) -> Result<(), CandleError> {
        use consort_ddp::ParamSet;
        self.pull_grads(grads)?;
        for p in (0..self.vars.len()).rev() {
            let name = self.vars[p].0.clone();
            let g = self.grad_device(p).ok_or_else(|| {
                CandleError::Device(format!("the gradient of {name} has no device memory"))
            })?;
            sharded
                .mark_ready_device(p, &g)
                .map_err(sharded_error(&name))?;
        }
        Ok(())
    }

    /// Whether `sharded` wrapped this model: the same variables, by name,
    /// in the same order.
    fn check_wrapped(&self, sharded: &Sharded) -> Result<(), CandleError> {
        let specs = sharded.params();
        let ours: Vec<&str> = self.vars.iter().map(|(n, _)| n.as_str()).collect();
        let theirs: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        if ours == theirs {
            return Ok(());
        }
        Err(CandleError::NotThisModel(format!(
            "rank {}: this CandleModel's variables are {ours:?}, but the sharded model's \
             parameters are {theirs:?}: pass the CandleModel that Sharded::new wrapped",
            sharded.rank()
        )))
    }

    /// Variable `p` (in the model's order, which is the shards' parameter
    /// order), with its name.
    fn var(&self, p: usize) -> Result<(&str, &candle_core::Var), CandleError> {
        match self.vars.get(p) {
            Some((name, var)) => Ok((name, var)),
            None => Err(CandleError::NotThisModel(format!(
                "the sharded model has a parameter {p}, but this CandleModel has {} variables: \
                 pass the CandleModel that Sharded::new wrapped",
                self.vars.len()
            ))),
        }
    }
}

/// A sharded call about variable `name` failed.
fn sharded_error(name: &str) -> impl FnOnce(DdpError) -> CandleError + '_ {
    move |source| CandleError::Sharded {
        name: name.to_string(),
        source: Box::new(source),
    }
}
