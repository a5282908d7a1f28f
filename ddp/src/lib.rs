//! consort-ddp: data-parallel training.
//!
//! Built so far: [`buckets`] (c10d's bucket assignment), [`state_dict`]
//! (PyTorch's `module.` and `_orig_mod.` key prefixes, added and stripped
//! in both directions, and loading that accepts either form) and
//! [`checkpoint`] (safetensors files written atomically, which Python's
//! `safetensors` and PyTorch load).
//!
//! Still to come here: `Ddp<B: Backend>` with parameter broadcast from
//! rank 0, bucket rebuilding after the first iteration, overlapped bucket
//! all-reduce, `no_sync`, comm hooks and join.

pub mod buckets;
pub mod checkpoint;
pub mod state_dict;

pub use checkpoint::{CheckpointError, Tensor, load_safetensors, save_safetensors};
pub use state_dict::{StateDict, StateDictError};
