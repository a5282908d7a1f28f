//! The torch view of a burn module's parameters: the names and layouts the
//! same model has when written with `torch.nn`, so that a checkpoint
//! consort writes for a burn model loads into torch's `load_state_dict`
//! as it is, and a torch checkpoint loads into the burn model.
//!
//! Two of burn's modules differ from torch's (as burn-store's PyTorch
//! adapters have it): `Linear` keeps its weight as `[d_input, d_output]`,
//! torch as `[out_features, in_features]`; the norm layers (`LayerNorm`,
//! `BatchNorm`, `GroupNorm`, `RmsNorm`) call their affine parameters
//! `gamma` and `beta`, torch `weight` and `bias`. Everything else
//! (`Embedding`, convolutions, the user's own parameters) has the same
//! name and layout in both.

use std::collections::{BTreeMap, HashMap};

use consort_ddp::{StateDict, StateDictError, Tensor};

use crate::{BurnModel, Entry};

/// Norm layers whose `gamma`/`beta` are torch's `weight`/`bias`.
const NORMS: [&str; 4] = [
    "Struct:LayerNorm",
    "Struct:BatchNorm",
    "Struct:GroupNorm",
    "Struct:RmsNorm",
];

/// Prefixes torch's wrappers put before every key (DDP, `torch.compile`).
const WRAPPERS: [&str; 2] = ["module.", "_orig_mod."];

/// Entry `e`'s torch name, and whether its torch layout is the transpose
/// of burn's.
fn torch_view(e: &Entry) -> (String, bool) {
    let (parent, leaf) = match e.name.rsplit_once('.') {
        Some((p, l)) => (Some(p), l),
        None => (None, e.name.as_str()),
    };
    let renamed = match leaf {
        "gamma" if NORMS.contains(&e.container.as_str()) => "weight",
        "beta" if NORMS.contains(&e.container.as_str()) => "bias",
        l => l,
    };
    let name = match parent {
        Some(p) => format!("{p}.{renamed}"),
        None => renamed.to_string(),
    };
    let transpose = e.container == "Struct:Linear" && leaf == "weight" && e.dims.len() == 2;
    (name, transpose)
}

/// The 2-D `t` transposed (shape and elements).
fn transposed(t: &Tensor) -> Tensor {
    let (rows, cols) = (t.shape[0], t.shape[1]);
    let size = t.dtype.size_bytes();
    let mut data = vec![0u8; t.data.len()];
    for r in 0..rows {
        for c in 0..cols {
            let from = (r * cols + c) * size;
            let to = (c * rows + r) * size;
            data[to..to + size].copy_from_slice(&t.data[from..from + size]);
        }
    }
    Tensor {
        dtype: t.dtype,
        shape: vec![cols, rows],
        data,
    }
}

impl BurnModel {
    /// The parameters' names as torch has them for the same model
    /// (`norm.weight` for burn's `norm.gamma`), in DDP's order.
    pub fn torch_names(&self) -> Vec<String> {
        self.entries.iter().map(|e| torch_view(e).0).collect()
    }

    /// The host copy's parameters in torch's names and layouts (`Linear`
    /// weights transposed): a checkpoint that the same model written with
    /// `torch.nn` loads with `load_state_dict(..., strict=True)`. As for
    /// [`BurnModel::state_dict`], call [`BurnModel::pull_values`] first
    /// under DDP.
    pub fn torch_state_dict(&self) -> StateDict {
        let mut ours = self.host.state_dict();
        let mut tensors = BTreeMap::new();
        for e in &self.entries {
            let Some(t) = ours.tensors.remove(&e.name) else {
                continue;
            };
            let (name, transpose) = torch_view(e);
            tensors.insert(name, if transpose { transposed(&t) } else { t });
        }
        StateDict { tensors }
    }

    /// Loads a state dict in torch's names and layouts (from
    /// [`BurnModel::torch_state_dict`], or from torch itself) into the host
    /// copy; then [`BurnModel::push_values`] puts the values in the module.
    /// DDP's and `torch.compile`'s key prefixes are taken off first.
    pub fn load_torch_state_dict(&mut self, sd: &StateDict) -> Result<(), StateDictError> {
        let theirs: HashMap<String, (&str, bool)> = self
            .entries
            .iter()
            .map(|e| {
                let (name, transpose) = torch_view(e);
                (name, (e.name.as_str(), transpose))
            })
            .collect();
        let mut tensors = BTreeMap::new();
        for (key, t) in &sd.tensors {
            let mut bare = key.as_str();
            while let Some(rest) = WRAPPERS.iter().find_map(|w| bare.strip_prefix(w)) {
                bare = rest;
            }
            match theirs.get(bare) {
                Some(&(ours, transpose)) if transpose && t.shape.len() == 2 => {
                    tensors.insert(ours.to_string(), transposed(t));
                }
                Some(&(ours, _)) => {
                    tensors.insert(ours.to_string(), t.clone());
                }
                // Named as it was: the host copy reports it unexpected.
                None => {
                    tensors.insert(key.clone(), t.clone());
                }
            }
        }
        self.host.load_state_dict(&StateDict { tensors })
    }
}
