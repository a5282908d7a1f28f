//! State dicts and PyTorch's key prefixes.
//!
//! Wrapping a model in DistributedDataParallel puts `module.` in front of
//! every key; `torch.compile` puts `_orig_mod.`; both can stack, in either
//! order. A checkpoint saved from one form and loaded into another fails
//! in PyTorch with "Missing key(s) … Unexpected key(s) …". Here the
//! prefixes can be added and stripped explicitly
//! ([`StateDict::add_prefix`], [`StateDict::consume_prefix`], as torch's
//! `consume_prefix_in_state_dict_if_present`), and
//! [`StateDict::load_into`] matches keys whatever wrappers either side had.

use std::collections::BTreeMap;

use crate::tensor::Tensor;

/// The prefix DistributedDataParallel adds.
pub const DDP_PREFIX: &str = "module.";
/// The prefix `torch.compile` adds.
pub const COMPILE_PREFIX: &str = "_orig_mod.";

/// Named tensors, ordered by name (a `state_dict()`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StateDict {
    /// Tensors by key.
    pub tensors: BTreeMap<String, Tensor>,
}

/// Why a state dict does not fit a model.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StateDictError {
    /// Keys differ even after the wrapper prefixes are taken off.
    #[error(
        "the state dict does not match the model: missing key(s) {missing:?}, unexpected key(s) \
         {unexpected:?}. Keys are compared without `module.` and `_orig_mod.`, so this is not a \
         DDP or torch.compile prefix mismatch: the checkpoint is from a different model"
    )]
    Mismatch {
        /// Keys the model has and the state dict lacks.
        missing: Vec<String>,
        /// Keys the state dict has and the model lacks.
        unexpected: Vec<String>,
    },
    /// Two keys become the same once the prefixes are taken off.
    #[error(
        "keys {first:?} and {second:?} both mean {bare:?} once `module.`/`_orig_mod.` are taken \
         off; the state dict mixes wrapped and bare copies of one parameter"
    )]
    Ambiguous {
        /// The key without prefixes.
        bare: String,
        /// One key.
        first: String,
        /// The other key.
        second: String,
    },
    /// A tensor's shape or dtype differs from the model's.
    #[error("size mismatch for {key:?}: the state dict has {found}, the model {expected}")]
    Shape {
        /// The model's key.
        key: String,
        /// What the state dict holds (dtype and shape).
        found: String,
        /// What the model wants.
        expected: String,
    },
}

/// `key` without any leading run of `module.` and `_orig_mod.`.
pub fn bare_key(key: &str) -> &str {
    let mut k = key;
    loop {
        if let Some(rest) = k.strip_prefix(DDP_PREFIX) {
            k = rest;
        } else if let Some(rest) = k.strip_prefix(COMPILE_PREFIX) {
            k = rest;
        } else {
            return k;
        }
    }
}

fn describe(t: &Tensor) -> String {
    format!("{} {:?}", t.dtype.name(), t.shape)
}

impl StateDict {
    /// An empty state dict.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) one tensor.
    pub fn insert(&mut self, key: impl Into<String>, t: Tensor) {
        self.tensors.insert(key.into(), t);
    }

    /// Every key gets `prefix` in front (what wrapping in DDP does to a
    /// model's `state_dict()`).
    pub fn add_prefix(&mut self, prefix: &str) {
        let old = std::mem::take(&mut self.tensors);
        self.tensors = old
            .into_iter()
            .map(|(k, v)| (format!("{prefix}{k}"), v))
            .collect();
    }

    /// torch's `consume_prefix_in_state_dict_if_present`: strips `prefix`
    /// from every key that starts with it and leaves the others.
    pub fn consume_prefix(&mut self, prefix: &str) {
        if prefix.is_empty() {
            return;
        }
        let old = std::mem::take(&mut self.tensors);
        self.tensors = old
            .into_iter()
            .map(|(k, v)| match k.strip_prefix(prefix) {
                Some(rest) => (rest.to_string(), v),
                None => (k, v),
            })
            .collect();
    }

    /// Strips every leading `module.` and `_orig_mod.` from every key (the
    /// form to save: it loads into wrapped and bare models alike).
    pub fn unwrapped(&self) -> Result<StateDict, StateDictError> {
        let mut out = BTreeMap::new();
        let mut from: BTreeMap<String, &String> = BTreeMap::new();
        for (k, v) in &self.tensors {
            let bare = bare_key(k).to_string();
            if let Some(first) = from.get(&bare) {
                return Err(StateDictError::Ambiguous {
                    bare,
                    first: (*first).clone(),
                    second: k.clone(),
                });
            }
            from.insert(bare.clone(), k);
            out.insert(bare, v.clone());
        }
        Ok(StateDict { tensors: out })
    }

    /// Maps this state dict onto a model whose keys are `model` (with
    /// their dtype and shape), whatever `module.`/`_orig_mod.` wrappers
    /// either side had. Returns the tensors under the model's own keys;
    /// a missing or unexpected key, or a shape or dtype that differs, is an
    /// error that names them, like torch's `load_state_dict(strict=True)`.
    pub fn load_into(&self, model: &StateDict) -> Result<StateDict, StateDictError> {
        let ours = self.unwrapped()?;
        let theirs = model.unwrapped()?;
        let missing: Vec<String> = theirs
            .tensors
            .keys()
            .filter(|k| !ours.tensors.contains_key(*k))
            .cloned()
            .collect();
        let unexpected: Vec<String> = ours
            .tensors
            .keys()
            .filter(|k| !theirs.tensors.contains_key(*k))
            .cloned()
            .collect();
        if !missing.is_empty() || !unexpected.is_empty() {
            return Err(StateDictError::Mismatch {
                missing,
                unexpected,
            });
        }
        let mut out = BTreeMap::new();
        for (key, want) in &model.tensors {
            let got = &ours.tensors[bare_key(key)];
            if got.dtype != want.dtype || got.shape != want.shape {
                return Err(StateDictError::Shape {
                    key: key.clone(),
                    found: describe(got),
                    expected: describe(want),
                });
            }
            out.insert(key.clone(), got.clone());
        }
        Ok(StateDict { tensors: out })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use consort_comm::DType;
    use proptest::prelude::*;

    fn t(v: f32, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_slice::<f32>(shape.to_vec(), &vec![v; n]).unwrap()
    }

    fn model() -> StateDict {
        let mut sd = StateDict::new();
        sd.insert("fc.weight", t(1.0, &[2, 3]));
        sd.insert("fc.bias", t(2.0, &[2]));
        sd
    }

    #[test]
    fn consume_prefix_matches_torch() {
        let mut sd = model();
        sd.add_prefix("module.");
        sd.insert("other", t(0.0, &[1]));
        sd.consume_prefix("module.");
        let keys: Vec<_> = sd.tensors.keys().cloned().collect();
        assert_eq!(keys, ["fc.bias", "fc.weight", "other"]);
    }

    #[test]
    fn every_wrapping_loads_into_every_other() {
        let wraps: [&[&str]; 5] = [
            &[],
            &["module."],
            &["_orig_mod."],
            &["module.", "_orig_mod."],
            &["_orig_mod.", "module."],
        ];
        for saved in wraps {
            for loaded in wraps {
                let mut ckpt = model();
                for p in saved.iter().rev() {
                    ckpt.add_prefix(p);
                }
                let mut target = model();
                for p in loaded.iter().rev() {
                    target.add_prefix(p);
                }
                let got = ckpt.load_into(&target).unwrap();
                let keys: Vec<_> = got.tensors.keys().collect();
                let want: Vec<_> = target.tensors.keys().collect();
                assert_eq!(keys, want, "saved {saved:?} loaded {loaded:?}");
            }
        }
    }

    #[test]
    fn mismatches_name_the_keys() {
        let mut ckpt = model();
        ckpt.tensors.remove("fc.bias");
        ckpt.insert("module.head.weight", t(0.0, &[1]));
        let err = ckpt.load_into(&model()).unwrap_err();
        assert_eq!(
            err,
            StateDictError::Mismatch {
                missing: vec!["fc.bias".into()],
                unexpected: vec!["head.weight".into()],
            }
        );
        let mut ckpt = model();
        ckpt.insert("fc.bias", t(0.0, &[3]));
        let msg = ckpt.load_into(&model()).unwrap_err().to_string();
        assert!(msg.contains("size mismatch for \"fc.bias\""), "{msg}");
        let mut ckpt = model();
        ckpt.insert("module.fc.bias", t(0.0, &[2]));
        assert!(matches!(
            ckpt.unwrapped(),
            Err(StateDictError::Ambiguous { .. })
        ));
        let mut ckpt = model();
        ckpt.insert(
            "fc.bias",
            Tensor::new(DType::F64, vec![2], vec![0; 16]).unwrap(),
        );
        assert!(matches!(
            ckpt.load_into(&model()),
            Err(StateDictError::Shape { .. })
        ));
    }

    proptest! {
        #[test]
        fn prefixes_round_trip(keys in prop::collection::btree_set("[a-z]{1,4}(\\.[a-z0-9]{1,4}){0,3}", 0..8),
                               wraps in prop::collection::vec(prop::bool::ANY, 0..4)) {
            let mut sd = StateDict::new();
            for k in &keys {
                sd.insert(k.clone(), t(1.0, &[1]));
            }
            let mut wrapped = sd.clone();
            for w in &wraps {
                wrapped.add_prefix(if *w { DDP_PREFIX } else { COMPILE_PREFIX });
            }
            prop_assert_eq!(wrapped.unwrapped().unwrap(), sd.clone());
            prop_assert_eq!(wrapped.load_into(&sd).unwrap(), sd);
        }
    }
}
