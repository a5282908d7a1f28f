//! DDP for burn modules (burn 0.22): consort's gradient averaging for any
//! burn `Module`, over any backend consort has (the simulator, TCP, QUIC,
//! NCCL).
//!
//! burn's tensors do not lend out their memory, so [`BurnModel`] keeps a
//! host copy (a [`PlainModel`]) that DDP works on, and copies across at
//! three points, as the candle adapter does:
//!
//! ```text
//! let mut host = BurnModel::from_module(&model)?;        // values → host
//! let mut ddp = Ddp::new(backend, &mut host, opts).await?;
//! let mut model = host.push_values(model)?;              // rank 0's values → module
//! loop {
//!     let mut grads = GradientsParams::from_grads(loss.backward(), &model);
//!     host.pull_grads(&mut grads)?;                          // grads → host
//!     ddp.sync_grads(&mut host).await?;                  // average
//!     host.push_grads(&mut grads)?;                      // averages → GradientsParams
//!     model = optimizer.step(lr, model, grads);
//! }
//! ```
//!
//! The sharded strategies (ZeRO-1, ZeRO-2, and FSDP's reduce-scatter and
//! sharded optimizer) take the same host copy: hand this step's gradients
//! to them with [`BurnModel::mark_ready`], step, and copy the parameters
//! back ([`Sharded::copy_params_to`], then [`BurnModel::push_values`]).
//!
//! With feature `cuda` (in the facade, `burn-cuda`), a module on a GPU
//! skips the host copy: `BurnModel::from_module_on` takes a
//! [`consort_comm::Placement`] (`placement(&Device::cuda(0))`), and the
//! same calls hand DDP and the sharded strategies the parameters' and the
//! gradients' device memory (`CubeTensor`s of burn's cubecl backend,
//! without `fusion`); see the `cuda` module for the ordering and for what
//! burn's missing in-place write costs.
//! The module keeps whole parameters, so FSDP's memory saving on the
//! parameters themselves does not apply to a burn module.
//!
//! Parameters are named by their module path (`fc1.weight`, `layers.0.bias`)
//! and listed in the order burn visits them, which is the same on every
//! rank for the same module type. f32, f64, f16 and bf16 parameters are
//! supported, up to 6 dimensions. burn's `Linear` keeps its weight as
//! `[d_input, d_output]`, the transpose of torch's, and its norm layers
//! call their affine parameters `gamma` and `beta`:
//! [`BurnModel::torch_state_dict`] gives the names and layouts of the same
//! model written with `torch.nn`, so that torch's `load_state_dict` takes
//! the checkpoint as it is, and [`BurnModel::load_torch_state_dict`] reads
//! one back.

#![cfg_attr(docsrs, feature(doc_cfg))]

/// The burn this adapter is built against (0.22.1), for code that names
/// burn's types through consort (`consort::burn::burn`).
pub use burn;
use burn::{
    Tensor,
    module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId},
    optim::GradientsParams,
    tensor::{DType as BDType, Device, TensorData},
};
use consort_comm::{DType, with_dtype};
use consort_ddp::{DdpError, ParamSet, ParamSpec, PlainModel, PlainModelError, Sharded};

mod torch;

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use cuda::placement;

/// Why the burn adapter failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BurnError {
    /// A parameter's dtype has no float equivalent here.
    #[error("parameter {name} has dtype {dtype:?}; DDP reduces f32, f64, f16 and bf16 parameters")]
    Unsupported {
        /// The parameter's module path.
        name: String,
        /// Its burn dtype.
        dtype: BDType,
    },
    /// A parameter of more dimensions than the adapter handles.
    #[error("parameter {name} has {dims} dimensions; the burn adapter handles up to 6")]
    TooManyDims {
        /// The parameter's module path.
        name: String,
        /// Its rank.
        dims: usize,
    },
    /// The module given back is not the one the adapter was made from.
    #[error(
        "the module does not match the one BurnModel::from_module was made from: {why}; pass \
         that module (or one made the same way)"
    )]
    Mismatch {
        /// What differs.
        why: String,
    },
    /// A gradient of another size than its parameter.
    #[error("the gradient of {name} has {got} bytes where its parameter has {want}")]
    GradSize {
        /// The parameter's module path.
        name: String,
        /// The gradient's bytes.
        got: usize,
        /// The parameter's bytes.
        want: usize,
    },
    /// The host copy refused a tensor.
    #[error(transparent)]
    Model(#[from] PlainModelError),
    /// A tensor cannot be used on the model's device (feature `cuda`):
    /// which one and why.
    #[error("burn on CUDA: {0}")]
    Device(String),
    /// The device or its driver refused (feature `cuda`).
    #[error(transparent)]
    Comm(#[from] consort_comm::CommError),
}

/// One float parameter of the module.
#[derive(Clone, Debug)]
struct Entry {
    name: String,
    /// The innermost struct module holding it (`Struct:Linear`), which
    /// decides its torch name and layout (see [`torch`]).
    container: String,
    id: ParamId,
    dims: Vec<usize>,
    dtype: BDType,
    /// Where its gradient lives (the parameter's device without autodiff).
    grad_device: Device,
    /// A parameter that takes no gradient (`set_require_grad(false)`, or
    /// `no_grad()`, on an autodiff device; BatchNorm's running statistics),
    /// as the module was when last read (`from_module*`, `pull_values`,
    /// `adopt_ids`). In a step where it has no gradient it is synced like
    /// the others with zeros, and burn's optimizer is never handed one for
    /// it (torch's DDP leaves such parameters out; an optimizer given zeros
    /// would still apply weight decay or momentum to them). A step where it
    /// has one uses it: it was unfrozen since.
    frozen: bool,
}

/// A burn module's float parameters as a [`ParamSet`]: their ids, and a
/// host copy of their values and gradients.
#[derive(Debug)]
pub struct BurnModel {
    entries: Vec<Entry>,
    /// This step's idle parameters: frozen, and without a gradient in the
    /// `GradientsParams` that `pull_grads` read.
    idle: Vec<bool>,
    host: PlainModel,
    #[cfg(feature = "cuda")]
    dev: Option<cuda::OnDevice>,
}

fn our_dtype(name: &str, d: BDType) -> Result<DType, BurnError> {
    match d {
        BDType::F32 => Ok(DType::F32),
        BDType::F64 => Ok(DType::F64),
        BDType::F16 => Ok(DType::F16),
        BDType::BF16 => Ok(DType::BF16),
        dtype => Err(BurnError::Unsupported {
            name: name.to_string(),
            dtype,
        }),
    }
}

/// Collects every float parameter with its module path.
struct Collect {
    path: Vec<String>,
    containers: Vec<String>,
    found: Vec<(Entry, Vec<u8>)>,
    err: Option<BurnError>,
    /// Whether to copy the values to the host.
    copy: bool,
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.push(name.to_string());
        self.containers.push(container.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
        self.containers.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        let name = self.path.join(".");
        // Vec and array wrappers sit between a struct and its children.
        let container = self
            .containers
            .iter()
            .rev()
            .find(|c| c.starts_with("Struct:"));
        let entry = Entry {
            name,
            container: container.cloned().unwrap_or_default(),
            id: param.id,
            dims: t.dims().to_vec(),
            dtype: t.dtype(),
            grad_device: t.device().inner(),
            frozen: frozen(&t),
        };
        if D > 6 {
            self.err.get_or_insert(BurnError::TooManyDims {
                name: entry.name.clone(),
                dims: D,
            });
        }
        let bytes = if self.copy {
            t.to_data().as_bytes().to_vec()
        } else {
            Vec::new()
        };
        self.found.push((entry, bytes));
    }
}

/// Whether a parameter's value takes no gradient: on an autodiff device,
/// without `require_grad` (off the autodiff device nothing does, and
/// nothing is frozen).
fn frozen<const D: usize>(t: &Tensor<D>) -> bool {
    t.device().is_autodiff() && !t.is_require_grad()
}

/// A module with `found` float parameters where `want` were expected.
pub(crate) fn same_count(found: usize, want: usize) -> Result<(), BurnError> {
    if found == want {
        return Ok(());
    }
    Err(BurnError::Mismatch {
        why: format!("it has {found} float parameters, not {want}"),
    })
}

fn collect<M: Module>(module: &M) -> Result<Vec<(Entry, Vec<u8>)>, BurnError> {
    collect_with(module, true)
}

/// Every float parameter with its module path, and its values' bytes if
/// `copy`.
fn collect_with<M: Module>(module: &M, copy: bool) -> Result<Vec<(Entry, Vec<u8>)>, BurnError> {
    let mut c = Collect {
        path: Vec::new(),
        containers: Vec::new(),
        found: Vec::new(),
        err: None,
        copy,
    };
    module.visit(&mut c);
    match c.err {
        Some(e) => Err(e),
        None => Ok(c.found),
    }
}

/// Replaces each float parameter's value with the host copy's, in visit
/// order, keeping its id and whether it takes gradients.
struct Push<'a> {
    model: &'a mut BurnModel,
    next: usize,
    err: Option<BurnError>,
}

impl ModuleMapper for Push<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let i = self.next;
        self.next += 1;
        let Some(e) = self.model.entries.get(i).filter(|e| e.id == param.id) else {
            self.err.get_or_insert(BurnError::Mismatch {
                why: format!(
                    "its float parameter #{i} is not the one expected there (of {})",
                    self.model.entries.len()
                ),
            });
            return param;
        };
        let (dims, dtype) = (e.dims.clone(), e.dtype);
        let bytes = self.model.host.param_bytes_mut(i).to_vec();
        param.map(|t| {
            let grad = t.is_require_grad();
            let data = TensorData::from_bytes_vec(bytes, dims, dtype);
            let v = Tensor::<D>::from_data(data, &t.device());
            if grad { v.require_grad() } else { v }
        })
    }
}

/// Gives each float parameter the id [`BurnModel::adopt_ids`] names for
/// its module path.
struct Adopt<'a> {
    model: &'a mut BurnModel,
    ids: &'a std::collections::BTreeMap<String, u64>,
    next: usize,
    err: Option<BurnError>,
}

impl ModuleMapper for Adopt<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let i = self.next;
        self.next += 1;
        let Some(e) = self.model.entries.get_mut(i).filter(|e| e.id == param.id) else {
            self.err.get_or_insert(BurnError::Mismatch {
                why: format!("its float parameter #{i} is not the one expected there"),
            });
            return param;
        };
        let Some(&id) = self.ids.get(&e.name) else {
            self.err.get_or_insert(BurnError::Mismatch {
                why: format!("no id was saved for its parameter {}", e.name),
            });
            return param;
        };
        e.id = ParamId::from(id);
        let t = param.val();
        e.frozen = frozen(&t);
        Param::initialized(e.id, t)
    }
}

/// How a mapper over every float parameter ends: with its first error, or
/// with a count of parameters other than the model's.
fn mapped<M>(module: M, err: Option<BurnError>, seen: usize, want: usize) -> Result<M, BurnError> {
    if let Some(e) = err {
        return Err(e);
    }
    if seen != want {
        return Err(BurnError::Mismatch {
            why: format!("it has {seen} float parameters, not {want}"),
        });
    }
    Ok(module)
}

/// Calls `$body` with `$d` bound to a const rank from 1 to 6.
macro_rules! with_rank {
    ($dims:expr, $d:ident => $body:expr, $else:expr) => {
        match $dims {
            1 => {
                const $d: usize = 1;
                $body
            }
            2 => {
                const $d: usize = 2;
                $body
            }
            3 => {
                const $d: usize = 3;
                $body
            }
            4 => {
                const $d: usize = 4;
                $body
            }
            5 => {
                const $d: usize = 5;
                $body
            }
            6 => {
                const $d: usize = 6;
                $body
            }
            _ => $else,
        }
    };
}

#[cfg(feature = "cuda")]
mod cuda;

impl BurnModel {
    /// Every float parameter of `module`, named by its module path.
    pub fn from_module<M: Module>(module: &M) -> Result<Self, BurnError> {
        let mut host = PlainModel::new();
        let mut entries = Vec::new();
        for (e, bytes) in collect(module)? {
            let dtype = our_dtype(&e.name, e.dtype)?;
            host.add_param_bytes(e.name.clone(), dtype, e.dims.clone(), bytes)?;
            entries.push(e);
        }
        Ok(BurnModel {
            idle: vec![false; entries.len()],
            entries,
            host,
            #[cfg(feature = "cuda")]
            dev: None,
        })
    }

    /// Every float parameter of `module`, named by its module path, on the
    /// GPU of `placement` (feature `cuda`): DDP and the sharded strategies
    /// work in the parameters' and the gradients' device memory, with no
    /// host copy. `consort::burn::placement(&device)` makes the placement.
    /// Every parameter must be a contiguous tensor of burn's cubecl backend
    /// (no `fusion`) on that GPU, f32, f16 or bf16. Waits for burn's queued
    /// kernels.
    #[cfg(feature = "cuda")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn from_module_on<M: Module>(
        module: &M,
        placement: consort_comm::Placement,
    ) -> Result<Self, BurnError> {
        let entries: Vec<Entry> = collect_with(module, false)?
            .into_iter()
            .map(|(e, _)| e)
            .collect();
        let dev = cuda::OnDevice::new(&entries, module, placement)?;
        Ok(BurnModel {
            idle: vec![false; entries.len()],
            entries,
            host: PlainModel::new(),
            dev: Some(dev),
        })
    }

    /// Whether DDP works in the module's device memory (a model made by
    /// `from_module_on`).
    pub fn on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.dev.is_some() {
            return true;
        }
        false
    }

    /// The parameters' module paths, in DDP's order.
    pub fn names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.name.as_str()).collect()
    }

    /// The host copy (values and gradients); empty for a model on a
    /// device.
    pub fn host(&self) -> &PlainModel {
        &self.host
    }

    /// Copies `module`'s current values into the host copy: after burn's
    /// optimizer stepped the module (DDP), before a checkpoint. The module
    /// must be the one this was made from.
    ///
    /// On a device nothing is copied: the model holds `module`'s current
    /// parameter tensors again, for the sharded strategies to read and
    /// write (a checkpoint of a device model goes through
    /// `BurnModel::from_module(&module)?.state_dict()`).
    pub fn pull_values<M: Module>(&mut self, module: &M) -> Result<(), BurnError> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &mut self.dev {
            dev.hold_params(&self.entries, module)?;
            return self.reread_frozen(module);
        }
        self.reread_frozen(module)?;
        let found = collect(module)?;
        same_count(found.len(), self.entries.len())?;
        for (i, (e, bytes)) in found.into_iter().enumerate() {
            let dst = self.host.param_bytes_mut(i);
            if e.id != self.entries[i].id || dst.len() != bytes.len() {
                return Err(BurnError::Mismatch {
                    why: format!(
                        "its parameter {} is another one, or of another size",
                        e.name
                    ),
                });
            }
            dst.copy_from_slice(&bytes);
        }
        Ok(())
    }

    /// Reads again which of `module`'s parameters are frozen.
    fn reread_frozen<M: Module>(&mut self, module: &M) -> Result<(), BurnError> {
        let found = collect_with(module, false)?;
        same_count(found.len(), self.entries.len())?;
        for (e, (f, _)) in self.entries.iter_mut().zip(found) {
            e.frozen = f.frozen;
        }
        Ok(())
    }

    /// The host copy's parameters by module path (a checkpoint: pass it to
    /// `consort_ddp::save_safetensors`). Under DDP burn's optimizer steps
    /// the module, not the host copy: call [`BurnModel::pull_values`]
    /// first.
    pub fn state_dict(&self) -> consort_ddp::StateDict {
        self.host.state_dict()
    }

    /// Loads parameters by name into the host copy (then
    /// [`BurnModel::push_values`] puts them in the module).
    pub fn load_state_dict(
        &mut self,
        sd: &consort_ddp::StateDict,
    ) -> Result<(), consort_ddp::StateDictError> {
        self.host.load_state_dict(sd)
    }

    /// `module` with the host values (after `Ddp::new` replaced them with
    /// rank 0's). `module` must be the one this was made from (the same
    /// parameter ids).
    ///
    /// On a device there is nothing to copy: `Ddp::new` broadcast (and
    /// [`Sharded::copy_params_to`] copied) into the parameters' memory.
    /// This waits for consort's stream, so that burn reads the new values,
    /// and lets go of this step's gradients; `module` comes back as it is.
    pub fn push_values<M: Module>(&mut self, module: M) -> Result<M, BurnError> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &mut self.dev {
            dev.drop_grads()?;
            return Ok(module);
        }
        let want = self.entries.len();
        let mut push = Push {
            model: self,
            next: 0,
            err: None,
        };
        let module = module.map(&mut push);
        mapped(module, push.err, push.next, want)
    }

    /// Each float parameter's burn id, by module path: save it beside an
    /// optimizer record (burn keys optimizer state by parameter id, and a
    /// module made again gets new ids), then [`BurnModel::adopt_ids`].
    pub fn param_ids(&self) -> std::collections::BTreeMap<String, u64> {
        let ids = self.entries.iter().map(|e| (e.name.clone(), e.id.val()));
        ids.collect()
    }

    /// `module` with its float parameters carrying the ids `ids` names for
    /// their module paths (from [`BurnModel::param_ids`] of an earlier
    /// run, or of rank 0), values unchanged: so that an optimizer record
    /// saved then (`ModuleOptimizer::to_record`) applies to this module
    /// when loaded (`load_record`). `module` must be the one this was made
    /// from; this model takes the ids too.
    pub fn adopt_ids<M: Module>(
        &mut self,
        module: M,
        ids: &std::collections::BTreeMap<String, u64>,
    ) -> Result<M, BurnError> {
        let want = self.entries.len();
        let mut adopt = Adopt {
            model: self,
            ids,
            next: 0,
            err: None,
        };
        let module = module.map(&mut adopt);
        mapped(module, adopt.err, adopt.next, want)
    }

    /// Copies this step's gradients from `grads` to the host copy; a
    /// parameter with no gradient has none there either, except a frozen
    /// one (no `require_grad` when the module was last read), which has
    /// zeros: DDP syncs it like the others, and [`BurnModel::push_grads`]
    /// hands burn no gradient for it. A frozen one that has a gradient
    /// after all (unfrozen since) is synced and handed back as any other.
    ///
    /// On a device nothing is copied: the model takes this step's gradient
    /// tensors out of `grads` for DDP, which writes the averages into them
    /// in place, and [`BurnModel::push_grads`] puts them back (call it
    /// after each synced step, before the optimizer; until then `grads`
    /// lacks them, so an optimizer stepped without it steps nothing rather
    /// than reading averages still being written). A parameter without a
    /// gradient gets zeros (unused this step, as on the host); a gradient
    /// that is strided, or whose memory something else also holds (a
    /// parameter, another gradient, a tensor of the caller's), gets a
    /// contiguous copy of its own, so that no average lands in memory
    /// another tensor reads. Waits for burn's queued kernels.
    pub fn pull_grads(&mut self, grads: &mut GradientsParams) -> Result<(), BurnError> {
        self.idle = self
            .entries
            .iter()
            .map(|e| {
                e.frozen && !with_rank!(e.dims.len(), D => grads.get::<D>(e.id).is_some(), false)
            })
            .collect();
        #[cfg(feature = "cuda")]
        if let Some(dev) = &mut self.dev {
            return dev.take_grads(&self.entries, grads, &self.idle);
        }
        self.host.zero_grad();
        for i in 0..self.entries.len() {
            let e = &self.entries[i];
            if self.idle[i] {
                self.host.grad_bytes_mut(i); // zeros
                continue;
            }
            let got: Option<Vec<u8>> = with_rank!(e.dims.len(), D => {
                grads.get::<D>(e.id).map(|g| g.to_data().as_bytes().to_vec())
            }, None);
            if let Some(bytes) = got {
                let dst = self.host.grad_bytes_mut(i);
                if dst.len() != bytes.len() {
                    // Zeros would train silently on nothing.
                    return Err(BurnError::GradSize {
                        name: self.entries[i].name.clone(),
                        got: bytes.len(),
                        want: dst.len(),
                    });
                }
                dst.copy_from_slice(&bytes);
            }
        }
        Ok(())
    }

    /// Hands this step's gradients (from [`BurnModel::pull_grads`]) to the
    /// sharded strategies, every parameter's (zeros for one without a
    /// gradient this step, as [`Sharded::step`] needs them all).
    ///
    /// On a device the gradients go over in device memory
    /// ([`Sharded::mark_ready_device`]).
    ///
    /// A step with frozen parameters (no `require_grad` and no gradient: a
    /// frozen layer, BatchNorm's running statistics) is refused: the
    /// sharded strategies step every parameter they hold and
    /// `copy_params_to` writes their shard back, which would move a frozen
    /// one and put back stale running statistics. Use DDP for such modules.
    pub fn mark_ready(&self, sharded: &mut Sharded) -> Result<(), DdpError> {
        if let Some(i) = self.idle.iter().position(|&idle| idle) {
            return Err(DdpError::Usage {
                rank: sharded.rank(),
                reason: format!(
                    "{} takes no gradient (a frozen parameter, or a running statistic such as \
                     BatchNorm's), and the sharded strategies step every parameter and write \
                     their copy back; train it, or use Ddp for this module",
                    self.entries[i].name
                ),
            });
        }
        #[cfg(feature = "cuda")]
        if let Some(dev) = &self.dev {
            for i in 0..dev.specs.len() {
                let g = dev.grad(i).ok_or_else(|| DdpError::Usage {
                    rank: sharded.rank(),
                    reason: format!(
                        "no gradient of {} on the device: call BurnModel::pull_grads first",
                        dev.specs[i].name
                    ),
                })?;
                sharded.mark_ready_device(i, &g)?;
            }
            return Ok(());
        }
        for (i, spec) in self.host.params().iter().enumerate() {
            with_dtype!(spec.dtype, T => {
                let zeros;
                // The host copy holds each parameter in its own dtype.
                let g: &[T] = match self.host.grad::<T>(i).ok().flatten() {
                    Some(g) => g,
                    None => {
                        zeros = vec![<T as bytemuck::Zeroable>::zeroed(); spec.numel()];
                        &zeros
                    }
                };
                sharded.mark_ready(i, g)?;
            });
        }
        Ok(())
    }

    /// Writes the (averaged) host gradients into `grads`, for the
    /// optimizer, on the device each parameter's gradient was on (none for
    /// a frozen parameter).
    ///
    /// On a device the averages are already in the gradients' memory: this
    /// waits for consort's stream, puts the gradient tensors `pull_grads`
    /// took back into `grads` (and the ones it made), and lets go of them
    /// and of the parameters' tensors (so that burn's optimizer may update
    /// them in place).
    pub fn push_grads(&mut self, grads: &mut GradientsParams) -> Result<(), BurnError> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &mut self.dev {
            return dev.give_grads(&self.entries, grads, &self.idle);
        }
        for (i, e) in self.entries.iter().enumerate() {
            let Some(g) = self.host.grad_bytes(i).filter(|_| !self.idle[i]) else {
                continue;
            };
            // A parameter this rank computed no gradient for still gets the
            // average: the other ranks' optimizers step it too.
            let data = TensorData::from_bytes_vec(g.to_vec(), e.dims.clone(), e.dtype);
            with_rank!(e.dims.len(), D => {
                let device = grads
                    .remove::<D>(e.id)
                    .map_or_else(|| e.grad_device.clone(), |old| old.device());
                grads.register::<D>(e.id, Tensor::<D>::from_data(data, &device));
            }, ());
        }
        Ok(())
    }
}

impl ParamSet for BurnModel {
    fn params(&self) -> Vec<ParamSpec> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &self.dev {
            return dev.specs.clone();
        }
        self.host.params()
    }

    #[cfg(feature = "cuda")]
    fn placement(&self) -> Option<consort_comm::Placement> {
        self.dev.as_ref().map(|d| d.placement.clone())
    }

    #[cfg(feature = "cuda")]
    fn param_device(&mut self, i: usize) -> Option<consort_comm::DeviceBuffer> {
        self.dev.as_ref()?.param(i)
    }

    #[cfg(feature = "cuda")]
    fn grad_device(&mut self, i: usize) -> Option<consort_comm::DeviceBuffer> {
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
