//! The parameter-set abstraction that [`Ddp`](crate::Ddp) works over, and
//! [`PlainModel`], the adapter for frameworks that have none of their own.
//!
//! A [`ParamSet`] is a model as DDP sees it: named, typed parameters (each
//! with a gradient beside it, or none when it took no part in the step)
//! and named buffers (running statistics and the like, broadcast from rank
//! 0 but never reduced). A host model exposes its storage as
//! little-endian bytes; a device model (its [`ParamSet::placement`] names a
//! device) exposes device buffers instead, and DDP then keeps its buckets
//! on that device.

use consort_comm::{DType, DeviceBuffer, Element, Placement};

use crate::{checkpoint::Tensor, state_dict::StateDict};

/// What every rank must agree on about one parameter or buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    /// Its name in the state dict (`"fc1.weight"`).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions (empty for a scalar).
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of the tensor.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    /// `name: f32 [10, 5]`, as error messages print it.
    pub fn describe(&self) -> String {
        format!("{}: {} {:?}", self.name, self.dtype, self.shape)
    }
}

/// A model's parameters, gradients and buffers, as DDP needs them.
///
/// Indices are positions in [`ParamSet::params`] (registration order, as
/// `model.parameters()` lists them) and [`ParamSet::buffers`]. Byte slices
/// hold exactly `spec.bytes()` bytes, little-endian.
pub trait ParamSet {
    /// The parameters that take gradients, in registration order.
    fn params(&self) -> Vec<ParamSpec>;

    /// Parameter `i`'s values, to be overwritten by rank 0's at
    /// construction (host models).
    fn param_bytes_mut(&mut self, i: usize) -> &mut [u8] {
        let _ = i;
        &mut []
    }

    /// Parameter `i`'s gradient, or `None` when it has none this step
    /// (host models).
    fn grad_bytes(&self, i: usize) -> Option<&[u8]> {
        let _ = i;
        None
    }

    /// Parameter `i`'s gradient storage, for DDP to write the averaged
    /// gradient into (created zeroed if the parameter had none; host
    /// models).
    fn grad_bytes_mut(&mut self, i: usize) -> &mut [u8] {
        let _ = i;
        &mut []
    }

    /// Where the parameters and gradients live: `None` (the default) for
    /// host memory, or a device and the compute stream. With a device,
    /// DDP allocates its buckets there and uses the `*_device` methods.
    fn placement(&self) -> Option<Placement> {
        None
    }

    /// Parameter `i`'s values on the device (device models).
    fn param_device(&mut self, i: usize) -> Option<DeviceBuffer> {
        let _ = i;
        None
    }

    /// Parameter `i`'s gradient storage on the device (device models): DDP
    /// reads the local gradient from it in [`crate::Ddp::sync_grads`] and
    /// writes the average back into it.
    fn grad_device(&mut self, i: usize) -> Option<DeviceBuffer> {
        let _ = i;
        None
    }

    /// Whether parameter `i` has a gradient this step (device models):
    /// [`crate::Ddp::sync_grads`] hands DDP only those, so a parameter
    /// without one is unused (an error unless `find_unused_parameters` is
    /// on, as in torch). `grad_device(i)` must still give storage for the
    /// average. Every parameter has one by default.
    fn has_grad_device(&self, i: usize) -> bool {
        let _ = i;
        true
    }

    /// Buffer `i`'s values on the device (device models).
    fn buffer_device(&mut self, i: usize) -> Option<DeviceBuffer> {
        let _ = i;
        None
    }

    /// The buffers (not reduced; broadcast from rank 0). None by default.
    fn buffers(&self) -> Vec<ParamSpec> {
        Vec::new()
    }

    /// Buffer `i`'s values. Only called for `i < buffers().len()`.
    fn buffer_bytes_mut(&mut self, i: usize) -> &mut [u8] {
        let _ = i;
        &mut []
    }
}

/// A named tensor with an optional gradient.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    name: String,
    value: Tensor,
    grad: Option<Vec<u8>>,
}

/// The plain-slices adapter: a model that is just named tensors, for
/// frameworks without an adapter and for hand-written models. Read and
/// write values and gradients as typed slices.
///
/// ```
/// use consort_ddp::PlainModel;
/// let mut m = PlainModel::new();
/// let w = m.add_param("fc.weight", vec![2, 3], &[0.0f32; 6]).unwrap();
/// m.grad_mut::<f32>(w).unwrap()[0] = 1.5;
/// assert_eq!(m.grad::<f32>(w).unwrap().unwrap()[0], 1.5);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlainModel {
    params: Vec<Entry>,
    buffers: Vec<(String, Tensor)>,
}

/// Why a [`PlainModel`] call was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct PlainModelError(String);

impl PlainModel {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a parameter with initial `values`; returns its index.
    pub fn add_param<T: Element>(
        &mut self,
        name: impl Into<String>,
        shape: Vec<usize>,
        values: &[T],
    ) -> Result<usize, PlainModelError> {
        self.add_param_bytes(name, T::DTYPE, shape, bytemuck::cast_slice(values).to_vec())
    }

    /// Adds a parameter from raw little-endian bytes; returns its index.
    pub fn add_param_bytes(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Result<usize, PlainModelError> {
        let name = name.into();
        let mut value = Tensor::new(dtype, shape, bytes)
            .map_err(|e| PlainModelError(format!("parameter {name}: {e}")))?;
        value.data = aligned_copy(&value.data);
        self.params.push(Entry {
            name,
            value,
            grad: None,
        });
        Ok(self.params.len() - 1)
    }

    /// Adds a buffer; returns its index among buffers.
    pub fn add_buffer<T: Element>(
        &mut self,
        name: impl Into<String>,
        shape: Vec<usize>,
        values: &[T],
    ) -> Result<usize, PlainModelError> {
        let name = name.into();
        let mut t = Tensor::from_slice(shape, values)
            .map_err(|e| PlainModelError(format!("buffer {name}: {e}")))?;
        t.data = aligned_copy(&t.data);
        self.buffers.push((name, t));
        Ok(self.buffers.len() - 1)
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The index of the parameter called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|e| e.name == name)
    }

    fn entry(&self, i: usize) -> Result<&Entry, PlainModelError> {
        self.params.get(i).ok_or_else(|| self.out_of_range(i))
    }

    fn entry_mut(&mut self, i: usize) -> Result<&mut Entry, PlainModelError> {
        let n = self.params.len();
        self.params.get_mut(i).ok_or_else(|| {
            PlainModelError(format!(
                "parameter index {i} is out of range (the model has {n})"
            ))
        })
    }

    fn out_of_range(&self, i: usize) -> PlainModelError {
        PlainModelError(format!(
            "parameter index {i} is out of range (the model has {})",
            self.params.len()
        ))
    }

    fn typed<T: Element>(e: &Entry) -> Result<(), PlainModelError> {
        if e.value.dtype == T::DTYPE {
            Ok(())
        } else {
            Err(PlainModelError(format!(
                "parameter {} is {}, not {}",
                e.name,
                e.value.dtype,
                T::DTYPE
            )))
        }
    }

    /// Parameter `i`'s values.
    pub fn param<T: Element>(&self, i: usize) -> Result<&[T], PlainModelError> {
        let e = self.entry(i)?;
        Self::typed::<T>(e)?;
        view(&e.value.data)
    }

    /// Parameter `i`'s values, mutable (for the optimizer step).
    pub fn param_mut<T: Element>(&mut self, i: usize) -> Result<&mut [T], PlainModelError> {
        let e = self.entry_mut(i)?;
        Self::typed::<T>(e)?;
        view_mut(&mut e.value.data)
    }

    /// Parameter `i`'s gradient, if it has one.
    pub fn grad<T: Element>(&self, i: usize) -> Result<Option<&[T]>, PlainModelError> {
        let e = self.entry(i)?;
        Self::typed::<T>(e)?;
        e.grad.as_deref().map(view).transpose()
    }

    /// Parameter `i`'s gradient, created zeroed if it has none.
    pub fn grad_mut<T: Element>(&mut self, i: usize) -> Result<&mut [T], PlainModelError> {
        let e = self.entry_mut(i)?;
        Self::typed::<T>(e)?;
        let len = e.value.data.len();
        view_mut(e.grad.get_or_insert_with(|| aligned_zeroed(len)))
    }

    /// Drops every gradient (`optimizer.zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        for e in &mut self.params {
            e.grad = None;
        }
    }

    /// Buffer `i`'s values, mutable.
    pub fn buffer_mut<T: Element>(&mut self, i: usize) -> Result<&mut [T], PlainModelError> {
        let n = self.buffers.len();
        let (name, t) = self.buffers.get_mut(i).ok_or_else(|| {
            PlainModelError(format!(
                "buffer index {i} is out of range (the model has {n})"
            ))
        })?;
        if t.dtype != T::DTYPE {
            return Err(PlainModelError(format!(
                "buffer {name} is {}, not {}",
                t.dtype,
                T::DTYPE
            )));
        }
        view_mut(&mut t.data)
    }

    /// The parameters and buffers as a state dict (bare keys, as
    /// `model.state_dict()` gives them before any DDP wrapping).
    pub fn state_dict(&self) -> StateDict {
        let mut sd = StateDict::new();
        for e in &self.params {
            sd.insert(e.name.clone(), e.value.clone());
        }
        for (name, t) in &self.buffers {
            sd.insert(name.clone(), t.clone());
        }
        sd
    }

    /// Loads values from `sd` (either key form: bare, `module.` or
    /// `_orig_mod.`), strictly: every key must match in name and shape.
    pub fn load_state_dict(&mut self, sd: &StateDict) -> Result<(), crate::StateDictError> {
        let loaded = sd.load_into(&self.state_dict())?;
        for e in &mut self.params {
            if let Some(t) = loaded.tensors.get(&e.name) {
                e.value.data.copy_from_slice(&t.data);
            }
        }
        for (name, t) in &mut self.buffers {
            if let Some(v) = loaded.tensors.get(name) {
                t.data.copy_from_slice(&v.data);
            }
        }
        Ok(())
    }
}

fn misaligned(e: bytemuck::PodCastError) -> PlainModelError {
    PlainModelError(format!(
        "tensor storage cannot be viewed as that type: {e:?}"
    ))
}

fn view<T: Element>(b: &[u8]) -> Result<&[T], PlainModelError> {
    if b.is_empty() {
        return Ok(&[]);
    }
    bytemuck::try_cast_slice(b).map_err(misaligned)
}

fn view_mut<T: Element>(b: &mut [u8]) -> Result<&mut [T], PlainModelError> {
    if b.is_empty() {
        return Ok(&mut []);
    }
    bytemuck::try_cast_slice_mut(b).map_err(misaligned)
}

/// `b` copied into 8-byte-aligned storage.
pub(crate) fn aligned_copy(b: &[u8]) -> Vec<u8> {
    let mut v = aligned_zeroed(b.len());
    v.copy_from_slice(b);
    v
}

/// A zeroed byte vector. The global allocator on every platform we build
/// for returns at least 8-byte-aligned blocks, so typed views succeed; the
/// views use `try_cast` and report, never panic, if one ever did not.
pub(crate) fn aligned_zeroed(len: usize) -> Vec<u8> {
    vec![0u8; len]
}

impl ParamSet for PlainModel {
    fn params(&self) -> Vec<ParamSpec> {
        self.params
            .iter()
            .map(|e| ParamSpec {
                name: e.name.clone(),
                dtype: e.value.dtype,
                shape: e.value.shape.clone(),
            })
            .collect()
    }

    fn param_bytes_mut(&mut self, i: usize) -> &mut [u8] {
        self.params
            .get_mut(i)
            .map_or(&mut [], |e| &mut e.value.data)
    }

    fn grad_bytes(&self, i: usize) -> Option<&[u8]> {
        self.params.get(i)?.grad.as_deref()
    }

    fn grad_bytes_mut(&mut self, i: usize) -> &mut [u8] {
        match self.params.get_mut(i) {
            Some(e) => {
                let len = e.value.data.len();
                e.grad.get_or_insert_with(|| aligned_zeroed(len))
            }
            None => &mut [],
        }
    }

    fn buffers(&self) -> Vec<ParamSpec> {
        self.buffers
            .iter()
            .map(|(name, t)| ParamSpec {
                name: name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            })
            .collect()
    }

    fn buffer_bytes_mut(&mut self, i: usize) -> &mut [u8] {
        self.buffers
            .get_mut(i)
            .map_or(&mut [], |(_, t)| &mut t.data)
    }
}
